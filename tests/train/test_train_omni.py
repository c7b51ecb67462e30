"""The main job end to end on the micro config: resume, NaN guard, summary, new modalities."""

import json
import os
import signal
import subprocess
import sys
import wave

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from PIL import Image

from configs.omni_moe import get_config
from omni_jax.common.config import ConfigError
from omni_jax.common.tensorboard import read_events
from omni_jax.data.stream import OmniStream
from omni_jax.modalities import ModalityKind, register_kind
from omni_jax.modalities.base import MODALITY_KINDS
from omni_jax.models.encoders import register_encoder, stack_for
from omni_jax.train import loop as loop_lib
from omni_jax.train.omni import train_omni

SUMMARY_KEYS = {"steps", "initial_loss", "final_loss", "eval", "tokens_per_sec", "mfu",
                "params_total", "params_active", "params_trainable", "trainable_fraction",
                "config"}


def _params(workdir, step):
  restored = ocp.StandardCheckpointer().restore(
      os.path.abspath(os.path.join(workdir, "checkpoints", str(step), "default")))
  return restored["params"]


def crash_after_step_2(cfg, workdir, monkeypatch):
  """Runs train_omni until fetching step 3's batch raises (after the step-2 checkpoint)."""
  real_batch = OmniStream.batch

  def crash_at_step_3(self, step):
    if step == 2:
      raise KeyboardInterrupt("simulated crash")
    return real_batch(self, step)
  monkeypatch.setattr(OmniStream, "batch", crash_at_step_3)
  with pytest.raises(KeyboardInterrupt):
    train_omni(cfg, workdir)
  monkeypatch.setattr(OmniStream, "batch", real_batch)


def check_trace_and_events(workdir: str) -> dict:
  """A run with profile_steps left a jax.profiler trace, and its TensorBoard events hold the
  losses of metrics.jsonl and both figures; returns the events."""
  traces = [f for _, _, fs in os.walk(os.path.join(workdir, "profile")) for f in fs]
  assert any(f.endswith(".xplane.pb") for f in traces), traces
  ev = read_events(workdir)
  records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
  assert [s for s, _ in ev["loss"]] == [s for s, _ in losses]
  assert [v for _, v in ev["loss"]] == pytest.approx([v for _, v in losses], rel=1e-6)
  assert {"figures/loss", "figures/eval"} <= set(ev)
  return ev


def check_summary(summary: dict, workdir: str):
  """A finished 4-step run's summary: its public keys and values, the copy on disk, the loss
  figure, the profiler trace of step 2 and the TensorBoard events."""
  assert SUMMARY_KEYS <= set(summary)
  assert summary["steps"] == 4
  assert summary["params_total"] > summary["params_active"] > 0
  assert summary["params_trainable"] == summary["params_total"]  # no groups: all of it trains
  assert summary["tokens_per_sec"] > 0 and 0 < summary["mfu"] < 1
  on_disk = json.load(open(os.path.join(workdir, "summary.json")))
  assert on_disk["final_loss"] == pytest.approx(summary["final_loss"])
  assert os.path.getsize(os.path.join(workdir, "loss.png")) > 1000
  check_trace_and_events(workdir)  # (config text: test_tensorboard.py)


# The synthetic-data run's resume, its four evals and its summary; the default suite checks
# resume and the summary on the manifest run below (the SIGKILL test).
@pytest.mark.slow
def test_resume_is_bit_identical_and_summary_complete(tmp_path, monkeypatch):
  cfg = get_config("micro")
  cfg.train.profile_steps = "2:2"
  straight = str(tmp_path / "straight")
  summary = train_omni(cfg, straight)
  check_summary(summary, straight)
  assert 0 < summary["data"]["input_wait_fraction"] < 1
  assert summary["data"]["records_per_sec"] is None  # synthetic samples are not records
  assert set(summary["eval"]) == {"text", "image", "audio", "video"}
  image_eval = set(summary["eval"]["image"])
  assert {"understand_acc", "generate_acc", "understand_chance_acc"} <= image_eval

  # Interrupted after the step-2 checkpoint, then the same command again.
  resumed = str(tmp_path / "resumed")
  crash_after_step_2(cfg, resumed, monkeypatch)
  summary2 = train_omni(cfg, resumed)
  assert summary2["resumed_from_step"] == 2
  a, b = _params(straight, 4), _params(resumed, 4)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)
  steps = [json.loads(line)["step"] for line in open(os.path.join(resumed, "metrics.jsonl"))]
  assert steps == sorted(set(steps)), "metrics.jsonl holds a step twice after resume"
  assert summary2["initial_loss"] == summary["initial_loss"]


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
  loop = loop_lib.LoopConfig(steps=6, seed=0, log_every=2, eval_every=0, eval_batches=1,
                             checkpoint_every=2, keep_checkpoints=5, peak_flops=1.0)

  def loss_fn(params, batch):
    loss = jnp.sum((params["w"] - batch["x"]) ** 2) + jnp.where(batch["x"][0] >= 2.5, jnp.nan,
                                                                0.0)
    return loss, {"loss": loss}
  with pytest.raises(loop_lib.NonFiniteLossError, match="at step 4.*last good checkpoint is "
                     "step 2"):
    loop_lib.fit(workdir=str(tmp_path), loop=loop, init_params=lambda k: {"w": jnp.zeros(2)},
                 loss_fn=loss_fn, tx=optax.sgd(0.1),
                 get_batch=lambda s: {"x": np.full(2, float(s))}, put_batch=lambda b: b,
                 param_sharding=lambda t: jax.tree.map(lambda _: None, t))
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]


class SpectrumEncoder(nn.Module):
  """A test-only encoder kind: mean-pooled rows of a 2-D array."""
  spec: dict
  d_model: int
  dtype: object = jnp.float32

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(self.spec["encoder_dim"])(x.reshape(x.shape[0], 4, -1))
    return stack_for(self.spec, self.d_model, self.dtype, 4)(h)


@pytest.mark.slow  # an end-to-end run (default suite time)
def test_new_modalities_by_config_and_by_registration_train(tmp_path):
  if "test_spectrum" not in MODALITY_KINDS:
    register_kind(ModalityKind(
        name="test_spectrum", defaults=dict(bins=8),
        input_shape=lambda s: (4, s["bins"]), num_tokens=lambda s: 4,
        labels=lambda s: ["flat", "peaked"],
        synthesize=lambda s, rng, lab: (rng.normal(size=(4, s["bins"])) * 0.1 + (
            np.eye(4, s["bins"]) * 3 * lab)).astype(np.float32)))
    register_encoder("test_spectrum", SpectrumEncoder)
  cfg = get_config("micro")
  cfg.model.modalities = dict(
      thermal=dict(kind="patch", size=(16, 16), channels=1, patch=8, codebook_size=8,
                   encoder_dim=16, encoder_layers=1, encoder_heads=2),
      notes=dict(kind="tokens", length=8, vocab=16, codebook_size=16, encoder_dim=16),
      spectrum=dict(kind="test_spectrum", bins=8, encoder_dim=16),
  )
  cfg.train.steps = 8
  cfg.train.eval_every = 8
  summary = train_omni(cfg, str(tmp_path))
  assert summary["final_loss"] < summary["initial_loss"]
  ev = summary["eval"]
  assert {"thermal", "notes", "spectrum", "text"} == set(ev)
  assert "generate_acc" in ev["thermal"] and "generate_acc" in ev["notes"]
  assert "generate_acc" not in ev["spectrum"]


def _write_wav(path, samples, rate):
  with wave.open(str(path), "wb") as w:
    w.setnchannels(1)
    w.setsampwidth(2)
    w.setframerate(rate)
    w.writeframes((np.asarray(samples) * 32767).astype("<i2").tobytes())


def write_manifest(tmp_path, n=24, broken=True):
  """n records with an image and a WAV each (+ a line naming a missing file)."""
  rng = np.random.default_rng(0)
  lines = []
  for i in range(n):
    Image.fromarray((rng.uniform(size=(20, 24, 3)) * 255).astype(np.uint8)).save(
        tmp_path / f"im{i}.png")
    _write_wav(tmp_path / f"a{i}.wav", np.sin(np.arange(1500) * 0.1 * (i + 1)) * 0.5, 8000)
    lines.append(json.dumps({"id": i, "text": f"sample {i}", "image": f"im{i}.png",
                             "audio": f"a{i}.wav"}))
  if broken:
    lines.append(json.dumps({"id": "x", "text": "broken", "image": "missing.png"}))
  (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
  return tmp_path / "m.jsonl"


def manifest_config(manifest, modalities=("image", "audio")):
  cfg = get_config("micro")
  cfg.model.modalities = {k: cfg.model.modalities[k] for k in modalities}
  cfg.data.update(source="manifest", manifest=str(manifest), pack_window=16, prefetch=1,
                  max_bad_fraction=0.1)  # 1 bad record in 25 passes
  return cfg


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KILL_IN_SAVE = """
import os, signal
import jax
jax.config.update("jax_num_cpu_devices", 8)
from tests.train.test_train_omni import manifest_config
from omni_jax.train.loop import StateOf
from omni_jax.train.omni import train_omni

real = StateOf.get_state
def get_state(self):  # called by the checkpoint's data item, after the train state's save began
  if self.state["batches"] == 4:  # the input state saved with step 4
    os.kill(os.getpid(), signal.SIGKILL)
  return real(self)
StateOf.get_state = get_state
train_omni(manifest_config({manifest!r}, {modalities!r}), {workdir!r})
"""


# The promise at its least compile on every landing (image only); both file modalities
# under -m slow (three micro runs, one in a subprocess).
@pytest.mark.parametrize("modalities", [
    ("image",), pytest.param(("image", "audio"), marks=pytest.mark.slow)])
def test_manifest_run_killed_mid_save_resumes_exactly_and_reports_bad_lines(tmp_path,
                                                                          modalities):
  cfg = manifest_config(write_manifest(tmp_path), modalities)
  cfg.train.profile_steps = "2:2"
  straight = train_omni(cfg, str(tmp_path / "straight"))
  check_summary(straight, str(tmp_path / "straight"))
  data = straight["data"]
  assert {"source", "records_read", "records_skipped", "tokenizer", "vocab_size",
          "packing_efficiency", "input_wait_fraction", "records_per_sec"} <= set(data)
  assert data["source"] == "manifest" and data["tokenizer"] == "bytes"
  assert data["records_skipped"] >= 1 and data["records_read"] >= 16
  assert 0.5 < data["packing_efficiency"] <= 1
  assert set(modalities) == set(straight["eval"])

  # Killed (SIGKILL) inside the step-4 checkpoint save, while the input state is written.
  script = KILL_IN_SAVE.format(manifest=cfg.data.manifest, modalities=tuple(modalities),
                               workdir=str(tmp_path / "resumed"))
  run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                       timeout=900)
  assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
  left = os.listdir(tmp_path / "resumed" / "checkpoints")
  assert "2" in left and "4" not in left and any(x.startswith("4.") for x in left), left
  assert "process_0-of-1.json" in os.listdir(tmp_path / "resumed" / "checkpoints" / "2" / "data")
  resumed = train_omni(cfg, str(tmp_path / "resumed"))
  assert resumed["resumed_from_step"] == 2
  for x, y in zip(jax.tree.leaves(_params(tmp_path / "straight", 4)),
                  jax.tree.leaves(_params(tmp_path / "resumed", 4)), strict=True):
    np.testing.assert_array_equal(x, y)
  rates = ("input_wait_fraction", "records_per_sec")  # measured: differ between runs
  assert 0 <= data["input_wait_fraction"] < 1 and data["records_per_sec"] > 0
  keep = lambda d: {k: v for k, v in d.items() if k not in rates}
  assert keep(resumed["data"]) == keep(data)  # read / skipped counts and efficiency come back


def test_config_errors_come_before_compile(tmp_path):
  cfg = get_config("micro")
  cfg.data.seq_len = 12
  with pytest.raises(ValueError, match="data.seq_len = 12"):
    train_omni(cfg, str(tmp_path))
  cfg = get_config("micro")
  cfg.train.checkpoint_every = 0
  with pytest.raises(ConfigError, match="train.checkpoint_every"):
    train_omni(cfg, str(tmp_path))

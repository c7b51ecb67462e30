"""The k-means codebooks of the generate heads are saved with every checkpoint: a resumed run
and generation use them exactly as saved (the k-means fit is never called again), so data
that changed under a run can change neither; a changed manifest is noticed on resume."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from omni_jax.common.checkpoint import Checkpointer, saved_codebooks
from omni_jax.common.config import ConfigError
from omni_jax.data import vq
from omni_jax.data.pipeline import given_codebooks
from omni_jax.data.reader import DataError
from omni_jax.data.stream import make_stream
from omni_jax.generate import job
from omni_jax.generate import outputs as outs
from omni_jax.train.omni import train_omni
from omni_jax.train.spec import build_spec
from tests.train.test_train_omni import manifest_config, write_manifest


def test_checkpoint_round_trips_codebooks_bit_for_bit(tmp_path):
  rng = np.random.default_rng(0)
  books = {"image": rng.standard_normal((8, 3)).astype(np.float32),
           "audio": rng.standard_normal((8, 16)).astype(np.float32)}
  assert saved_codebooks(str(tmp_path)) is None  # no checkpoint yet
  ck = Checkpointer(str(tmp_path), with_codebooks=True)
  state = {"w": jnp.arange(4.0)}
  ck.save(1, state, codebooks=books)
  ck.save(2, state, codebooks={k: v + 1 for k, v in books.items()})
  with pytest.raises(ValueError, match="pass codebooks to save exactly when"):
    ck.save(3, state)
  ck.close()
  for step, add in ((1, 0), (2, 1), (None, 1)):  # None: the latest
    got = saved_codebooks(str(tmp_path), step)
    assert set(got) == set(books)
    for k in books:
      assert got[k].dtype == np.float32
      np.testing.assert_array_equal(got[k], books[k] + add)
  np.testing.assert_array_equal(Checkpointer(str(tmp_path), with_codebooks=True).restore(
      2, {"w": jnp.zeros(4)})["w"], state["w"])
  plain = Checkpointer(str(tmp_path / "plain"))  # a run without codebooks has none
  plain.save(1, state)
  plain.close()
  assert saved_codebooks(str(tmp_path / "plain")) is None


def test_saved_codebooks_unlike_the_config_are_one_clear_error():
  cfg = manifest_config("unused.jsonl")
  mods = dict(build_spec(cfg.model).modalities)  # micro: image 8 x 3, audio 8 x 16
  ok = {"image": np.zeros((8, 3), np.float32), "audio": np.zeros((8, 16), np.float32)}
  assert set(given_codebooks(mods, ok, complete=True)) == {"image", "audio"}
  assert set(given_codebooks(mods, {"image": ok["image"]}, complete=False)) == {"image"}
  with pytest.raises(ConfigError, match=r"codebooks are for \['image'\].*\['audio', 'image'\]"):
    given_codebooks(mods, {"image": ok["image"]}, complete=True)
  with pytest.raises(ConfigError, match=r"codebook of 'image' is float32 \[16, 3\].*\[8, 3\]"):
    given_codebooks(mods, {**ok, "image": np.zeros((16, 3), np.float32)}, complete=True)
  with pytest.raises(ConfigError, match=r"codebooks are for \[.*'text'\]"):
    given_codebooks(mods, {**ok, "text": np.zeros((8, 3), np.float32)}, complete=False)



# Under slow (default-suite time: three micro runs and a generation, ~30 s): the default
# suite keeps the checkpoint's bit-for-bit round trip of the codebooks above and the refusal
# of codebooks unlike the config.
@pytest.mark.slow
def test_a_manifest_run_keeps_its_codebook_through_changed_data_resume_and_generation(
    tmp_path, monkeypatch):
  manifest = write_manifest(tmp_path, n=12, broken=False)
  cfg = manifest_config(manifest, ("image",))
  cfg.train.update(steps=2, checkpoint_every=2, eval_every=0)
  run = str(tmp_path / "run")
  train_omni(cfg, run)
  spec = build_spec(cfg.model)
  saved = saved_codebooks(run)
  assert set(saved) == {"image"}
  # the codebook trained with is the one fitted from the manifest (the fit is deterministic)
  np.testing.assert_array_equal(saved["image"], make_stream(spec, cfg.data).codebooks["image"])

  # The data change under the run: other pictures, one more record. A refit would now differ.
  rng = np.random.default_rng(7)
  for i in range(12):
    Image.fromarray((rng.uniform(0.5, 1.0, (20, 24, 3)) * 255).astype(np.uint8)).save(
        tmp_path / f"im{i}.png")
  with open(manifest, "a") as f:
    f.write(json.dumps({"id": 99, "text": "late", "image": "im0.png"}) + "\n")
  assert not np.array_equal(make_stream(spec, cfg.data).codebooks["image"], saved["image"])

  def refit(*args, **kwargs):
    raise AssertionError("a k-means codebook was refitted")
  monkeypatch.setattr(vq, "fit_codebook", refit)
  cfg.train.steps = 4
  with pytest.raises(DataError, match="data changed since the checkpoint"):
    train_omni(cfg, run)  # the changed manifest is noticed
  cfg.data.allow_changed_data = True  # accepted: the run goes on with its own codebook
  assert train_omni(cfg, run)["resumed_from_step"] == 2
  np.testing.assert_array_equal(saved_codebooks(run, 4)["image"], saved["image"])

  # generation decodes through the saved codebook (no stream, no fit)
  prompts = tmp_path / "p.jsonl"
  prompts.write_text(json.dumps({"text": "sample 3", "output": "image"}) + "\n")
  out = job.run_generate(cfg, run, str(prompts), str(tmp_path / "gen"), temperature=0.0,
                         max_new_tokens=4, batch_size=1)
  rec = out["outputs"][0]
  want = outs.codes_to_image(spec.modality("image"), saved["image"], rec["codes"])
  got = np.asarray(Image.open(tmp_path / "gen" / rec["file"]))
  np.testing.assert_array_equal(got, np.round(want * 255).astype(np.uint8))

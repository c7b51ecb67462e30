"""The FSQ image codec: shapes, a PSNR floor after fitting a fixed image, the CLI (resume,
summary keys, saved codec), bad input."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from omni_jax.common import batched_rng
from omni_jax.examples import image_data
from omni_jax.tokenizers import fsq, image_codec
from omni_jax.tokenizers.image_codec import ImageCodec
from tests.cli import run_module


def _fixed_image():
  y, x = np.mgrid[0:16, 0:16] / 15.0
  return np.stack([x, y, 0.5 * (x + y)], -1)[None].astype(np.float32)  # smooth ramps


def test_fit_fixed_image_round_trip_above_psnr_floor():
  codec = ImageCodec(levels=(8, 5, 5, 5), width=8)
  img = jnp.asarray(_fixed_image())
  params = batched_rng.init(codec, jax.random.PRNGKey(0), img)["params"]  # op by op: ~25 s
  tx = optax.adam(1e-2)
  opt = tx.init(params)

  @jax.jit
  def step(params, opt):
    loss, g = jax.value_and_grad(
        lambda p: jnp.mean((codec.apply({"params": p}, img)[0] - img) ** 2))(params)
    upd, opt = tx.update(g, opt)
    return optax.apply_updates(params, upd), opt, loss

  before = image_codec.psnr_db(img, image_codec.decode(codec, params,
                                                       image_codec.encode(codec, params, img)))
  for _ in range(150):
    params, opt, _ = step(params, opt)
  ids = image_codec.encode(codec, params, img)
  assert ids.shape == (1, 4, 4) and ids.dtype == jnp.int32
  assert int(ids.min()) >= 0 and int(ids.max()) < 1000
  out = image_codec.decode(codec, params, ids)
  assert out.shape == img.shape
  after = image_codec.psnr_db(img, out)
  assert after > 25.0 and after > before + 10.0
  # encode -> decode equals the module's own forward pass (the codes carry everything)
  np.testing.assert_allclose(np.asarray(out),
                             np.clip(np.asarray(codec.apply({"params": params}, img)[0]), 0, 1),
                             atol=1e-5)


def test_psnr_closed_form():
  x = np.zeros((1, 4, 4, 3))
  assert image_codec.psnr_db(x, x + 0.1) == pytest.approx(20.0, abs=1e-4)


def test_heldout_pictures_are_disjoint_and_batches_deterministic():
  train = {p.tobytes() for p in image_data.pictures("train") if p.shape[0] > 32}
  held = {p.tobytes() for p in image_data.pictures("heldout") if p.shape[0] > 32}
  assert train and held and not train & held
  a, b = image_data.train_batch(3, 7, 4, 32), image_data.train_batch(3, 7, 4, 32)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, image_data.train_batch(3, 8, 4, 32))


def test_bad_input():
  codec = ImageCodec(levels=(8, 5, 5, 5), width=8)
  params = batched_rng.init(codec, jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 3)))["params"]
  with pytest.raises(ValueError, match="multiples of 4"):
    image_codec.encode(codec, params, np.zeros((1, 10, 8, 3)))
  with pytest.raises(ValueError, match="RGB"):
    image_codec.encode(codec, params, np.zeros((1, 8, 8)))
  with pytest.raises(ValueError, match=r"\[0, 1000\)"):
    image_codec.decode(codec, params, jnp.full((1, 2, 2), 1000))


def _run(workdir, *extra):
  return run_module("experiments.train_tokenizer", "--config=configs/tokenizer.py:image_tiny",
                    f"--workdir={workdir}", *extra)


@pytest.mark.slow  # moved out of the default suite for time (still runs under -m slow)
def test_cli_image_tiny_writes_summary_and_resumes(tmp_path):
  r = _run(tmp_path)
  assert r.returncode == 0, r.stderr[-3000:]
  s = json.loads((tmp_path / "summary.json").read_text())
  assert s["steps"] == 6 and s["codebook_size"] == 1000 and s["codes_per_image"] == 64
  assert np.isfinite(s["recon_psnr_db"])
  assert 1.0 <= s["codebook_perplexity"] <= 1000 and 0 < s["codebook_usage"] <= 1
  assert (tmp_path / "recon.png").stat().st_size > 0
  assert "step: 6/6" in r.stderr   # the train loop's progress line
  r = _run(tmp_path, "--config.train.steps=8")
  assert r.returncode == 0, r.stderr[-3000:]
  assert "resumed from checkpoint step 6" in r.stderr
  assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 8
  from omni_jax.tokenizers.codec_io import load_codec
  kind, codec, params = load_codec(str(tmp_path))
  assert kind == "image" and codec.levels == (8, 5, 5, 5)
  ids = image_codec.encode(codec, params, image_data.heldout_crops(2, 32))
  assert ids.shape == (2, 8, 8)
  assert fsq.code_stats(ids, 1000)["codebook_usage"] > 0


def test_load_codec_missing(tmp_path):
  from omni_jax.tokenizers.codec_io import load_codec
  with pytest.raises(FileNotFoundError, match="no trained tokenizer"):
    load_codec(str(tmp_path))

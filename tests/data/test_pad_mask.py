"""Variable-length media: short audio and letterboxed images carry ``<m>_valid``, and the
encoders' features do not depend on what the padding holds."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from omni_jax.common.config import ConfigError
from omni_jax.data.decode import decode_record
from omni_jax.data.encode import write_wav
from omni_jax.modalities import MODALITY_KINDS
from omni_jax.modalities.base import resolve_spec
from omni_jax.models.encoders import ENCODERS
from omni_jax.train.spec import build_spec
from tests.data.test_decode_record import micro_model

AUDIO = dict(kind="frames", num_samples=1024, sample_rate=8000, n_fft=64, hop=32, n_mels=8,
             encoder_dim=16, encoder_heads=2)
IMAGE = dict(kind="patch", size=(16, 16), channels=3, patch=4, encoder_dim=16,
             encoder_heads=2, fit="letterbox")


def _encode(spec, x, valid):
  enc = ENCODERS.get(spec["kind"])(spec=spec, d_model=8)
  params = jax.jit(enc.init)(jax.random.PRNGKey(0), jnp.asarray(x[:1]),
                              jnp.asarray(valid[:1]))
  apply = jax.jit(enc.apply)
  with_mask = apply(params, jnp.asarray(x), jnp.asarray(valid))
  without = apply(params, jnp.asarray(x))
  return np.asarray(with_mask), np.asarray(without)


def test_audio_features_ignore_what_the_padding_holds():
  spec = resolve_spec("audio", AUDIO)
  rng = np.random.default_rng(0)
  real = 300
  clip = np.zeros((2, 1024), np.float32)
  clip[:, :real] = rng.normal(size=real)
  clip[1, real:] = rng.normal(size=1024 - real) * 3  # garbage in the second copy's padding
  valid = np.full(2, real, np.int32)
  feats, unmasked = _encode(spec, clip, valid)
  np.testing.assert_allclose(feats[0], feats[1], atol=1e-5)
  # 300 samples: ceil(300 / 32) = 10 frames hold real samples -> ceil(ceil(10 / 2) / 2) = 3
  # of the ceil(ceil(31 / 2) / 2) = 8 tokens; the others are zero.
  mask = np.asarray(MODALITY_KINDS.get("frames").token_mask(spec, jnp.asarray(valid)))
  assert mask.tolist() == [[True] * 3 + [False] * 5] * 2
  assert np.all(feats[:, 3:] == 0) and np.all(np.abs(feats[:, :3]).sum(-1) > 0)
  assert np.abs(unmasked[0] - unmasked[1]).max() > 1e-3  # without the mask the garbage shows


def test_letterboxed_image_features_ignore_the_padding():
  spec = resolve_spec("image", IMAGE)
  rng = np.random.default_rng(1)
  img = np.zeros((2, 16, 16, 3), np.float32)
  img[:, :6] = rng.uniform(size=(6, 16, 3))  # content 6 rows high: patch row 1 is part pad
  img[1, 6:] = rng.uniform(size=(10, 16, 3))
  valid = np.asarray([[6, 16], [6, 16]], np.int32)
  feats, unmasked = _encode(spec, img, valid)
  np.testing.assert_allclose(feats[0], feats[1], atol=1e-5)
  # rows 0-5 touch patch rows 0 and 1 (pixel rows 0-3, 4-7): 2 x 4 of the 16 patches
  assert np.all(feats[:, 8:] == 0) and np.all(np.abs(feats[:, :8]).sum(-1) > 0)
  assert np.abs(unmasked[0] - unmasked[1]).max() > 1e-3


def test_all_valid_mask_changes_nothing():
  spec = resolve_spec("image", IMAGE)
  img = np.random.default_rng(2).uniform(size=(2, 16, 16, 3)).astype(np.float32)
  feats, unmasked = _encode(spec, img, np.full((2, 2), 16, np.int32))
  # the same maths; under jit XLA fuses the masked graph differently (float rounding only)
  np.testing.assert_allclose(feats, unmasked, atol=1e-5)


def test_decoder_valid_for_a_short_wav_and_a_wide_png(tmp_path):
  spec = build_spec(micro_model(audio={**AUDIO, "codebook_size": 0},
                                image={**IMAGE, "codebook_size": 0}))
  write_wav(tmp_path / "s.wav", np.full(600, 0.25, np.float32), 16000)  # 600 at 16 kHz
  wide = np.zeros((4, 32, 3), np.uint8)  # 4 high, 32 wide: letterboxed to 2 x 16
  wide[..., 0] = 200
  Image.fromarray(wide).save(tmp_path / "w.png")
  out = decode_record({"text": "t", "audio": "s.wav", "image": "w.png"}, spec, tmp_path)
  assert sorted(out) == ["audio", "audio_valid", "image", "image_valid"]
  assert int(out["audio_valid"]) == 300  # 600 samples at 16 kHz -> 300 at 8 kHz
  assert np.all(out["audio"][300:] == 0) and abs(out["audio"][150] - 0.25) < 1e-3
  assert out["image_valid"].tolist() == [2, 16]
  np.testing.assert_allclose(out["image"][:2, :, 0], 200 / 255, atol=1e-6)
  assert np.all(out["image"][2:] == 0)
  tmask = MODALITY_KINDS.get("patch").token_mask(spec.modality("image"),
                                                 jnp.asarray(out["image_valid"])[None])
  assert np.asarray(tmask).sum() == 4  # one row of the 4 x 4 patches
  stretched = build_spec(micro_model(image={**IMAGE, "fit": "stretch"}))
  out = decode_record({"text": "t", "image": "w.png"}, stretched, tmp_path)
  assert out["image_valid"].tolist() == [16, 16] and np.all(out["image"][..., 0] > 0.7)
  cropped = build_spec(micro_model(image={**IMAGE, "fit": "crop"}))
  out = decode_record({"text": "t", "image": "w.png"}, cropped, tmp_path)
  assert out["image_valid"].tolist() == [16, 16]


def test_bad_fit_is_one_config_error():
  with pytest.raises(ConfigError, match=r"fit.*\['stretch', 'crop', 'letterbox'\]"):
    resolve_spec("image", {**IMAGE, "fit": "pad"})


@pytest.mark.slow  # an end-to-end run; the encoders' invariances above are the default suite's
def test_train_omni_on_short_wav_and_wide_png(tmp_path):
  from omni_jax.train.omni import train_omni  # noqa: PLC0415  (a heavy import, one test)
  from tests.train.test_train_omni import manifest_config  # noqa: PLC0415

  rng = np.random.default_rng(0)
  lines = []
  for i in range(8):
    write_wav(tmp_path / f"a{i}.wav", rng.uniform(-0.5, 0.5, 200 + 50 * i).astype(np.float32),
              8000)
    Image.fromarray((rng.uniform(size=(8, 40, 3)) * 255).astype(np.uint8)).save(
        tmp_path / f"w{i}.png")
    lines.append(json.dumps({"id": i, "text": f"clip {i}", "audio": f"a{i}.wav",
                             "image": f"w{i}.png"}))
  (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
  cfg = manifest_config(tmp_path / "m.jsonl")
  cfg.model.modalities["image"]["fit"] = "letterbox"
  cfg.train.steps = 2
  summary = train_omni(cfg, str(tmp_path / "run"))
  assert summary["steps"] == 2 and np.isfinite(summary["final_loss"])


def test_slots_with_padding_scatter_only_real_tokens():
  """K = 2 slots per row: each slot's valid goes to the encoder, and only its real tokens of
  used slots reach the sequence (image 1: 6 rows -> 8 patches; image 2: 16 x 4 -> 4)."""
  from omni_jax.models.omni import encode_slots, scatter_features  # noqa: PLC0415

  spec = resolve_spec("image", IMAGE)
  kind = MODALITY_KINDS.get("patch")
  rng = np.random.default_rng(3)
  x = rng.uniform(size=(1, 2, 16, 16, 3)).astype(np.float32)
  valid = np.asarray([[[6, 16], [16, 4]]], np.int32)
  garbage = x.copy()
  garbage[0, 0, 6:] = 5.0
  garbage[0, 1, :, 4:] = -5.0
  pos = np.arange(32, dtype=np.int32).reshape(1, 2, 16)
  used = np.asarray([[True, True]])
  enc = ENCODERS.get(spec["kind"])(spec=spec, d_model=8)
  params = jax.jit(enc.init)(jax.random.PRNGKey(0), jnp.asarray(x[:, 0]))

  def run(inputs):
    return enc.apply(params, method=lambda m: scatter_features(
        jnp.ones((1, 40, 8)), *encode_slots(m, jnp.asarray(inputs), pos, used, valid,
                                            lambda v: kind.token_mask(spec, v))))
  a, b = np.asarray(run(x)), np.asarray(run(garbage))
  np.testing.assert_allclose(a, b, atol=1e-5)
  written = np.any(a[0] != 1.0, axis=-1)
  expect = np.zeros(40, bool)
  expect[:8] = True  # slot 1: patch rows 0-1
  expect[16 + np.arange(0, 16, 4)] = True  # slot 2: patch column 0 of each row
  np.testing.assert_array_equal(written, expect)

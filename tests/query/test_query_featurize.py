"""Featurizers (batching, unit norm, near-duplicates) and the ingest / query / show CLI."""

from __future__ import annotations

import wave

import numpy as np
import pytest
from PIL import Image

from omni_jax.query import cli, featurize


def _image(seed, size=48):
  rng = np.random.default_rng(seed)
  base = rng.random((6, 6, 3))
  img = np.kron(base, np.ones((size // 6, size // 6, 1)))
  return (img * 255).astype(np.uint8)


def test_image_embeddings_are_unit_and_batch_invariant():
  f = featurize.make_featurizer("image", dim=16, image_size=32, batch_size=4)
  x = np.random.default_rng(0).random((7, 32, 32, 3)).astype(np.float32)
  e = f.embed(x)
  assert e.shape == (7, 16)
  np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, rtol=1e-4)
  one_by_one = np.concatenate([f.embed(x[i:i + 1]) for i in range(7)])
  np.testing.assert_allclose(one_by_one, e, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match=r"image inputs must have shape"):
    f.embed(np.zeros((2, 16, 16, 3)))


def test_audio_embedding_separates_tones():
  f = featurize.make_featurizer("audio", dim=16, audio_samples=2000, batch_size=2)
  t = np.arange(2000) / 8000.0
  a = np.sin(2 * np.pi * 440 * t)
  x = np.stack([a, a + 0.01 * np.random.default_rng(1).standard_normal(2000),
                np.random.default_rng(2).standard_normal(2000)]).astype(np.float32)
  e = f.embed(x)
  assert e[0] @ e[1] > 0.99 and e[0] @ e[1] > e[0] @ e[2]


def test_unknown_kind():
  with pytest.raises(ValueError, match="kind 'video' not allowed"):
    featurize.make_featurizer("video")


def test_cli_ingest_query_show(tmp_path, capsys):
  imgs = tmp_path / "imgs"
  imgs.mkdir()
  for i in range(6):
    Image.fromarray(_image(i)).save(imgs / f"im{i}.png")
  (imgs / "notes.txt").write_text("ignored")
  st = tmp_path / "st"
  assert cli.main(["ingest", "--store", str(st), "--input", str(imgs), "--kind", "image",
                   "--dim", "16", "--rows_per_shard", "4"]) == 0
  hits = cli.query_file(st, imgs / "im3.png", k=3, channels=2)
  assert hits[0][0].endswith("im3.png") and hits[0][1] == pytest.approx(1.0, abs=1e-4)
  assert cli.main(["show", "--store", str(st), "--verify"]) == 0
  out = capsys.readouterr().out
  assert "6 items, dim 16" in out and "2 shards" in out and "checksums OK" in out
  # appending the same folder again doubles the store without touching old shards
  assert cli.main(["ingest", "--store", str(st), "--input", str(imgs), "--kind", "image"]) == 0
  assert "12 items" in cli.describe(st)
  assert cli.main(["ingest", "--store", str(st), "--input", str(imgs), "--kind", "audio"]) == 2
  assert "no audio files" in capsys.readouterr().err


def test_load_audio_crops_and_pads(tmp_path):
  p = tmp_path / "a.wav"
  with wave.open(str(p), "wb") as w:
    w.setnchannels(1)
    w.setsampwidth(2)
    w.setframerate(8000)
    w.writeframes((np.arange(100, dtype="<i2") * 100).tobytes())
  x = featurize.load_audio(p, 150)
  np.testing.assert_allclose(x[:100], np.arange(100) * 100 / 32768.0)
  assert np.all(x[100:] == 0)
  with pytest.raises(ValueError, match="not a readable PCM WAV"):
    featurize.load_audio(tmp_path / "missing.wav", 10)

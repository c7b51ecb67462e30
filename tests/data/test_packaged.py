"""The real-files manifest maker: records decode under configs/omni_moe.py:files and their
captions describe the content (tone pitch, clip colour and motion, digit label)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from configs.omni_moe import get_config
from omni_jax.data.decode import decode_record, decode_video, decode_wav
from omni_jax.examples.packaged import VOWELS, make_manifest, voice
from omni_jax.modalities.frames import NOTES
from omni_jax.modalities.patch import RGB_COLOURS
from omni_jax.train.spec import build_spec


@pytest.fixture(name="made", scope="module")
def fixture_made(tmp_path_factory):
  root = tmp_path_factory.mktemp("files")
  summary = make_manifest(root, count=12, seed=3)
  records = [json.loads(line) for line in (root / "manifest.jsonl").read_text().splitlines()]
  return root, summary, records


def test_counts_ids_and_files(made):
  root, summary, records = made
  assert summary["records"] == len(records) == 12
  # floor(12 x shares 0.2, 0.25, 0.15, 0.15, 0.25) = 2, 3, 1, 1, 3; digits take the other 2
  assert {k: summary[k] for k in ("photo", "digit", "tone", "voice", "clip")} == dict(
      photo=2, digit=5, tone=1, voice=1, clip=3)
  assert len({r["id"] for r in records}) == 12
  for r in records:
    media = [k for k in r if k not in ("id", "text")]
    assert len(media) == 1 and (root / r[media[0]]).is_file()
    assert r["text"]


def test_every_record_decodes_for_the_files_config(made):
  root, _, records = made
  cfg = get_config("files")
  spec = build_spec(cfg.model)
  for r in records:
    out = decode_record(r, spec, root)
    media = [k for k in r if k not in ("id", "text")][0]
    assert media in out
    if "with a soft tone" in r["text"]:  # the clip's track feeds the audio modality
      assert "audio" in out and np.abs(out["audio"]).max() > 0.3
    elif media == "video":
      assert "audio" not in out


def test_captions_describe_the_content(made):
  root, _, records = made
  for r in records:
    words = r["text"].split()
    if r["id"].startswith("tone"):
      x = decode_wav(root / r["audio"], sample_rate=8000, num_samples=4096)
      spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
      peak = np.argmax(spectrum) * 8000 / len(x)
      assert abs(peak - NOTES[words[-1]]) < 0.02 * NOTES[words[-1]] + 2
    if r["id"].startswith("clip"):
      colour, direction = words[1], words[4]
      frames, _ = decode_video(root / r["video"], frames=2, size=(64, 64), channels=3)
      masks = [np.abs(f - RGB_COLOURS[colour]).max(axis=-1) < 0.2 for f in frames]
      assert all(m.sum() > 50 for m in masks)  # the named colour is there
      (y0, x0), (y1, x1) = [np.argwhere(m).mean(axis=0) for m in masks]
      dy, dx = y1 - y0, x1 - x0
      moved = {"left": -dx, "right": dx, "up": -dy, "down": dy}
      assert max(moved, key=moved.get) == direction and moved[direction] > 20
    if r["id"].startswith("digit"):
      img = np.asarray(Image.open(root / r["image"]))
      assert img.shape == (32, 32) and img.max() > 200


def test_voice_formants():
  """The vowel's first formant dominates the spectrum near it."""
  rate = 16_000
  for vowel, (f1, _) in VOWELS.items():
    x = voice(vowel, 110.0, 2, rate)
    spectrum = np.abs(np.fft.rfft(x))
    freqs = np.fft.rfftfreq(len(x), 1 / rate)
    band = (freqs > 150) & (freqs < 1200)
    assert abs(freqs[band][np.argmax(spectrum[band])] - f1) < 120


def test_deterministic_by_seed(made, tmp_path):
  root, _, records = made
  make_manifest(tmp_path, count=12, seed=3)
  assert (tmp_path / "manifest.jsonl").read_text() == (root / "manifest.jsonl").read_text()
  for r in records:
    for key in ("image", "audio"):
      if key in r:
        assert (tmp_path / r[key]).read_bytes() == (root / r[key]).read_bytes()
  with pytest.raises(ValueError, match="count must be an integer >= 5"):
    make_manifest(tmp_path, count=4)

"""Tests for the JSONL manifest loader with real PNG/JPEG/WAV files written in tmp_path."""

from __future__ import annotations

import json
import struct
import wave

import numpy as np
import pytest
from absl import logging
from PIL import Image

from omni_jax.data.manifest import ManifestError, ManifestSample, load_manifest

SR = 8000
KW = dict(image_size=(6, 10), sample_rate=SR, max_audio_samples=8)


def write_wav(path, samples, *, width=2, channels=1, rate=SR):
  """Writes integer PCM samples [frames, channels] (or [frames]) to a WAV file."""
  dtype = {1: np.uint8, 2: "<i2", 4: "<i4"}.get(width, np.uint8)
  data = np.asarray(samples).astype(dtype).tobytes() if width in (1, 2, 4) else bytes(samples)
  with wave.open(str(path), "wb") as f:
    f.setnchannels(channels)
    f.setsampwidth(width)
    f.setframerate(rate)
    f.writeframes(data)


def write_float_wav(path, samples):
  """Writes an IEEE-float (format code 3) WAV, which is not integer PCM."""
  data = np.asarray(samples, "<f4").tobytes()
  fmt = struct.pack("<HHIIHH", 3, 1, SR, 4 * SR, 4, 32)
  path.write_bytes(b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)) + b"WAVE"
                   + b"fmt " + struct.pack("<I", len(fmt)) + fmt
                   + b"data" + struct.pack("<I", len(data)) + data)


def write_manifest(path, lines):
  """Writes lines (dicts are JSON-encoded, strings written as they are)."""
  path.write_text("\n".join(json.dumps(x) if isinstance(x, dict) else x for x in lines) + "\n")
  return path


@pytest.fixture(name="media")
def fixture_media(tmp_path):
  """A red PNG, a blue-ish JPEG, a mono int16 WAV and a stereo WAV in tmp_path/media."""
  d = tmp_path / "media"
  d.mkdir()
  Image.new("RGB", (32, 20), (255, 0, 0)).save(d / "red.png")
  Image.new("RGB", (16, 16), (20, 40, 200)).save(d / "blue.jpg", quality=95)
  Image.new("L", (5, 5), 77).save(d / "gray.png")
  write_wav(d / "mono.wav", [0, 16384, -32768, 32767, -1])
  write_wav(d / "stereo.wav", [[1000, 3000], [-2000, 0]] * 6, channels=2)
  return d


def test_good_lines_load(tmp_path, media):
  manifest = write_manifest(tmp_path / "m.jsonl", [
      {"text": "just text"},
      {"text": "red", "image": "media/red.png"},
      "",
      {"text": "blue", "image": str(media / "blue.jpg"), "audio": "media/mono.wav"},
      {"text": "gray", "image": "media/gray.png", "audio": "media/stereo.wav"},
      "   ",
      {"text": "nulls", "image": None, "audio": None},
  ])
  samples, errors = load_manifest(manifest, **KW)
  assert errors == []
  assert [s.text for s in samples] == ["just text", "red", "blue", "gray", "nulls"]
  assert [s.source for s in samples] == [f"{manifest}:{n}" for n in (1, 2, 4, 5, 7)]
  assert all(isinstance(s, ManifestSample) for s in samples)
  assert samples[0].image is None and samples[0].audio is None
  red = samples[1].image
  assert red.shape == (6, 10, 3) and red.dtype == np.uint8
  np.testing.assert_array_equal(red, np.broadcast_to([255, 0, 0], (6, 10, 3)))
  blue = samples[2].image.astype(int)
  assert blue.shape == (6, 10, 3)
  assert np.abs(blue - [20, 40, 200]).max() <= 3  # JPEG is lossy
  np.testing.assert_array_equal(samples[3].image, np.full((6, 10, 3), 77))
  mono = samples[2].audio
  assert mono.dtype == np.float32 and mono.shape == (8,)
  np.testing.assert_array_equal(
      mono, np.array([0, 16384, -32768, 32767, -1, 0, 0, 0], np.float32) / 32768)
  stereo = samples[3].audio  # 12 frames trimmed to 8, channels averaged
  np.testing.assert_array_equal(stereo, np.array([2000, -1000] * 4, np.float32) / 32768)


def test_8_and_32_bit_pcm(tmp_path):
  write_wav(tmp_path / "u8.wav", [128, 255, 0, 192], width=1)
  write_wav(tmp_path / "i32.wav", [2 ** 30, -(2 ** 31), 2 ** 31 - 1], width=4)
  manifest = write_manifest(tmp_path / "m.jsonl", [
      {"text": "a", "audio": "u8.wav"}, {"text": "b", "audio": "i32.wav"}])
  (u8, i32), _ = load_manifest(manifest, **{**KW, "max_audio_samples": 4})
  np.testing.assert_array_equal(u8.audio, [0.0, 127 / 128, -1.0, 0.5])
  np.testing.assert_allclose(i32.audio, [0.5, -1.0, (2 ** 31 - 1) / 2 ** 31, 0.0], rtol=1e-7)


def bad_line_cases(tmp_path, media):
  """(manifest line, fragments the error must contain) for every kind of bad line."""
  (media / "junk.png").write_bytes(b"not an image at all")
  write_wav(media / "pcm24.wav", bytes(12), width=3)
  write_wav(media / "fast.wav", [1, 2, 3], rate=16000)
  write_wav(media / "empty.wav", [])
  (media / "junk.wav").write_bytes(b"RIFF....nope")
  write_float_wav(media / "float.wav", [0.5, -0.25])
  return [
      ("{not json", ["invalid JSON"]),
      ("[1, 2]", ["expected a JSON object", "list"]),
      ({"image": "media/red.png"}, ["missing required key 'text'"]),
      ({"text": 5}, ["'text' must be a string", "int"]),
      ({"text": "x", "video": "v.mp4"}, ["unknown key", "'video'", "'audio'", "'image'"]),
      ({"text": "x", "image": "media/nope.png"}, ["not found", "nope.png"]),
      ({"text": "x", "audio": "media/nope.wav"}, ["not found", "nope.wav"]),
      ({"text": "x", "image": 3}, ["'image' must be a non-empty path string"]),
      ({"text": "x", "image": "media/junk.png"}, ["unreadable image", "junk.png"]),
      ({"text": "x", "audio": "media/pcm24.wav"}, ["pcm24.wav", "24-bit", "8/16/32"]),
      ({"text": "x", "audio": "media/junk.wav"}, ["junk.wav", "8/16/32"]),
      ({"text": "x", "audio": "media/float.wav"}, ["float.wav", "not integer PCM", "8/16/32"]),
      ({"text": "x", "audio": "media/fast.wav"}, ["fast.wav", "16000", f"expected {SR}"]),
      ({"text": "x", "audio": "media/empty.wav"}, ["empty audio", "empty.wav"]),
  ]


def test_each_bad_line_fatal(tmp_path, media):
  for i, (line, fragments) in enumerate(bad_line_cases(tmp_path, media)):
    manifest = write_manifest(tmp_path / f"bad{i}.jsonl", [{"text": "ok"}, "", line])
    with pytest.raises(ManifestError) as info:
      load_manifest(manifest, **KW)
    message = str(info.value)
    assert message.startswith(f"{manifest}:3: "), message
    for fragment in fragments:
      assert fragment in message, (fragment, message)
    assert info.value.lineno == 3


def test_skip_mode_keeps_good_lines_and_reports_all(tmp_path, media, monkeypatch):
  cases = bad_line_cases(tmp_path, media)
  lines = [{"text": "first"}]
  for line, _ in cases:
    lines += [line, {"text": "good", "image": "media/red.png"}]
  manifest = write_manifest(tmp_path / "mixed.jsonl", lines)
  warnings = []
  monkeypatch.setattr(logging, "warning", lambda msg, *args: warnings.append(msg % args))
  samples, errors = load_manifest(manifest, **KW, on_error="skip")
  assert len(samples) == 1 + len(cases)
  assert [s.source for s in samples] == [f"{manifest}:{n}"
                                         for n in range(1, len(lines) + 1, 2)]
  assert len(errors) == len(cases) == len(warnings)
  for k, (error, (_, fragments)) in enumerate(zip(errors, cases, strict=True)):
    assert error.startswith(f"{manifest}:{2 * k + 2}: ")
    assert all(f in error for f in fragments), (fragments, error)
    assert error in warnings[k]


def test_invalid_utf8_line(tmp_path):
  manifest = tmp_path / "m.jsonl"
  manifest.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
  with pytest.raises(ManifestError, match=r"m\.jsonl:2: .*UTF-8"):
    load_manifest(manifest, **KW)


def test_missing_and_empty_manifests(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.jsonl"):
    load_manifest(tmp_path / "nope.jsonl", **KW)
  blank = write_manifest(tmp_path / "blank.jsonl", ["", "  "])
  with pytest.raises(ValueError, match="no usable lines"):
    load_manifest(blank, **KW)
  all_bad = write_manifest(tmp_path / "bad.jsonl", ["{", {"foo": 1}])
  with pytest.raises(ValueError, match=r"no usable lines.*bad\.jsonl:1: invalid JSON"):
    load_manifest(all_bad, **KW, on_error="skip")


def test_bad_arguments(tmp_path):
  manifest = write_manifest(tmp_path / "m.jsonl", [{"text": "ok"}])
  with pytest.raises(ValueError, match=r"on_error must be one of \['fatal', 'skip'\]"):
    load_manifest(manifest, **KW, on_error="ignore")
  with pytest.raises(ValueError, match="image_size"):
    load_manifest(manifest, **{**KW, "image_size": (0, 4)})
  with pytest.raises(ValueError, match="image_size"):
    load_manifest(manifest, **{**KW, "image_size": 4})
  with pytest.raises(ValueError, match="sample_rate"):
    load_manifest(manifest, **{**KW, "sample_rate": 0})
  with pytest.raises(ValueError, match="max_audio_samples"):
    load_manifest(manifest, **{**KW, "max_audio_samples": -1})

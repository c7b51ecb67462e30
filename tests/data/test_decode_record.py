"""Manifest record -> modality inputs, driven by each modality's source fields (config only)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from configs.omni_moe import get_config
from omni_jax.common.config import ConfigError
from omni_jax.data.decode import DecodeError, RecordError, decode_record, record_keys
from omni_jax.data.encode import write_video, write_wav
from omni_jax.train.spec import build_spec


def micro_model(**extra):
  cfg = get_config("micro").model
  mods = dict(cfg.modalities)
  mods.update(extra)
  cfg.modalities = mods
  return cfg


def depth_spec(**depth):
  """micro plus a one-channel `depth` patch modality defined by config alone."""
  return build_spec(micro_model(depth=dict(kind="patch", size=(8, 8), channels=1, patch=4,
                                           encoder_dim=16, **depth)))


def test_one_channel_png_modality_decodes_from_files(tmp_path):
  spec = depth_spec()
  ms = spec.modality("depth")
  assert (ms["source_key"], ms["decoder"]) == ("depth", "image")
  ramp = np.tile(np.arange(0, 64, 4, dtype=np.uint16)[None, :] * 1000, (16, 1))  # 16-bit PNG
  Image.fromarray(ramp).save(tmp_path / "d.png")
  (tmp_path / "sub").mkdir()
  Image.new("RGB", (16, 16), (255, 0, 0)).save(tmp_path / "sub" / "r.png")
  out = decode_record({"id": "a", "text": "a ramp", "depth": "d.png", "image": "sub/r.png"},
                      spec, tmp_path)
  assert sorted(out) == ["depth", "depth_valid", "image", "image_valid"]
  assert out["depth"].shape == (8, 8, 1) and out["depth"].dtype == np.float32
  cols = out["depth"][0, :, 0] * 65535
  # Column k of the file holds 4000 k at x = k + 0.5; a symmetric filter keeps a linear ramp,
  # so output column j (centre x = 2 j + 1) holds 4000 (2 j + 0.5), away from the edges.
  j = np.arange(1, 7)
  np.testing.assert_allclose(cols[1:-1], 4000 * (2 * j + 0.5), atol=0.5)
  assert np.all(out["depth"] == out["depth"][:1])  # every row alike
  np.testing.assert_allclose(out["image"], np.broadcast_to([1.0, 0, 0], (16, 16, 3)))


def test_source_key_and_npy_and_ids(tmp_path):
  spec = build_spec(micro_model(
      thermal=dict(kind="patch", size=(4, 4), channels=2, patch=2, encoder_dim=16,
                   source_key="heat", decoder="npy"),
      actions=dict(kind="tokens", length=3, vocab=5, encoder_dim=16)))
  assert record_keys(spec) == ("id", "text", "actions", "audio", "image", "heat", "video")
  arr = np.arange(32, dtype=np.float32).reshape(4, 4, 2)
  np.save(tmp_path / "t.npy", arr)
  out = decode_record({"text": "x", "heat": str(tmp_path / "t.npy"), "actions": [4, 0, 2]},
                      spec, "/nonexistent")  # absolute path ignores base_dir
  np.testing.assert_array_equal(out["thermal"], arr)
  np.testing.assert_array_equal(out["actions"], [4, 0, 2])
  assert out["actions"].dtype == np.int32
  np.save(tmp_path / "bad.npy", np.zeros((4, 4, 3), np.float32))
  with pytest.raises(DecodeError, match=r"shape \(4, 4, 3\); the modality wants \(4, 4, 2\)"):
    decode_record({"heat": "bad.npy"}, spec, tmp_path)
  with pytest.raises(RecordError, match=r"must lie in \[0, 5\)"):
    decode_record({"actions": [1, 5, 0]}, spec, tmp_path)
  with pytest.raises(RecordError, match="list of 3 integers"):
    decode_record({"actions": [1, 2]}, spec, tmp_path)
  with pytest.raises(RecordError, match=r"unknown key\(s\) \['thermal'\]"):
    decode_record({"thermal": "t.npy"}, spec, tmp_path)  # the key is 'heat', not the name


def test_video_audio_track_feeds_the_audio_modality(tmp_path):
  cfg = micro_model()
  cfg.modalities["video"]["audio_track"] = "audio"
  spec = build_spec(cfg)
  sr, t = 16_000, np.arange(16_000) / 16_000
  frames = np.zeros((6, 16, 16, 3), np.uint8)
  write_video(tmp_path / "v.mp4", frames, fps=6, audio=0.5 * np.sin(2 * np.pi * 300 * t),
              sample_rate=sr)
  write_wav(tmp_path / "a.wav", np.zeros(100), 8000)
  out = decode_record({"text": "t", "video": "v.mp4"}, spec, tmp_path)
  assert out["video"].shape == (2, 16, 16, 3)
  assert out["audio"].shape == (1024,) and np.abs(out["audio"][512:]).max() > 0.3
  assert int(out["audio_valid"]) == 1024  # the track covers the window
  # A track shorter than the window is padded, and its valid count says where (the mask).
  rate = dict(spec.modalities)["audio"]["sample_rate"]
  short = np.arange(int(0.05 * sr)) / sr  # 400 samples at the modality's 8 kHz
  write_video(tmp_path / "s.mp4", frames, fps=6, audio=0.5 * np.sin(2 * np.pi * 300 * short),
              sample_rate=sr)
  out = decode_record({"video": "s.mp4"}, spec, tmp_path)
  n = int(out["audio_valid"])
  # (AAC stores whole frames of 1,024 samples at 16 kHz: 512 at 8 kHz)
  assert 0.05 * rate <= n < 1024 and n % 512 == 0 and not out["audio"][n:].any(), (n, rate)
  with pytest.raises(RecordError, match="'audio' is given twice"):
    decode_record({"video": "v.mp4", "audio": "a.wav"}, spec, tmp_path)


def test_bad_values_raise(tmp_path):
  spec = depth_spec()
  with pytest.raises(RecordError, match="non-empty path string"):
    decode_record({"depth": 3}, spec, tmp_path)
  with pytest.raises(DecodeError, match="file not found"):
    decode_record({"depth": "nope.png"}, spec, tmp_path)
  with pytest.raises(RecordError, match="JSON object"):
    decode_record(["depth"], spec, tmp_path)
  assert decode_record({"text": "only text", "depth": None}, spec, tmp_path) == {}


@pytest.mark.parametrize("extra,match", [
    (dict(decoder="mp3"), r"decoder = 'mp3' is not allowed: must be one of"),
    (dict(decoder="audio"), "lacks the fields"),
    (dict(decoder="video"), "lacks the fields"),
    (dict(decoder="ids"), "needs a 1-D integer input"),
    (dict(source_key="image"), "'depth' and 'image' both read the manifest key 'image'"),
    (dict(source_key="text"), "reserved"),
    (dict(source_key=""), "non-empty manifest key"),
    (dict(audio_track="audio"), "only a modality with decoder 'video'"),
])
def test_bad_source_config(extra, match):
  with pytest.raises(ConfigError, match=match):
    depth_spec(**extra)


def test_bad_audio_track_config():
  cfg = micro_model()
  cfg.modalities["video"]["audio_track"] = "image"
  with pytest.raises(ConfigError, match="needs one with decoder 'audio'"):
    build_spec(cfg)
  cfg.modalities["video"]["audio_track"] = "speech"
  with pytest.raises(ConfigError, match="must name a modality"):
    build_spec(cfg)

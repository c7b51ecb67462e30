"""File decoders (image / WAV / video) against files with known content written in tmp_path."""

from __future__ import annotations

import wave

import numpy as np
import pytest
import scipy.io.wavfile
import scipy.signal
from PIL import Image

from omni_jax.data.decode import (
  DecodeError,
  decode_audio,
  decode_image,
  decode_video,
  decode_wav,
  fit_audio,
  sample_indices,
)
from omni_jax.data.encode import write_audio, write_video, write_wav


# ------------------------------------------------------------------------------ video
def gray_clip(n=30, h=32, w=48):
  """Frame i is uniformly grey at level 8 * i."""
  return np.repeat((8 * np.arange(n, dtype=np.uint8))[:, None, None, None], h * w * 3
                   ).reshape(n, h, w, 3)


@pytest.mark.parametrize("suffix", [".mp4", ".webm", ".avi"])
def test_video_returns_uniformly_sampled_frames(tmp_path, suffix):
  path = tmp_path / f"clip{suffix}"
  opts = {".mp4": {"qp": "0"}, ".webm": {"lossless": "1"}, ".avi": {}}[suffix]
  write_video(path, gray_clip(), fps=10, options=opts)
  video, track = decode_video(path, frames=4, size=(16, 8), channels=3)
  assert video.shape == (4, 16, 8, 3) and video.dtype == np.float32
  assert track is None
  want = 8 * np.asarray([0, 10, 19, 29])  # round(i * 29 / 3)
  np.testing.assert_array_equal(sample_indices(30, 4), [0, 10, 19, 29])
  tol = 3 if suffix != ".avi" else 4  # colour conversion (and JPEG) round-off
  np.testing.assert_allclose(video * 255, np.broadcast_to(want[:, None, None, None],
                                                          video.shape), atol=tol)
  # Scaling only the picked frames (the container states its count) = scaling all, then picking.
  every, _ = decode_video(path, frames=4, size=(16, 8), channels=3, trust_frame_count=False)
  np.testing.assert_array_equal(every, video)
  grey, _ = decode_video(path, frames=1, size=(4, 4), channels=1)
  assert grey.shape == (1, 4, 4, 1)
  np.testing.assert_allclose(grey * 255, 8 * 14, atol=tol)  # middle frame (29 // 2)


def test_video_frame_content_is_spatial(tmp_path):
  """A frame split into a red left half and a blue right half keeps its layout."""
  frame = np.zeros((1, 32, 64, 3), np.uint8)
  frame[:, :, :32] = (255, 0, 0)
  frame[:, :, 32:] = (0, 0, 255)
  write_video(tmp_path / "rb.mp4", np.repeat(frame, 3, axis=0), fps=5, options={"qp": "0"})
  video, _ = decode_video(tmp_path / "rb.mp4", frames=2, size=(8, 8), channels=3)
  assert np.abs(video[:, :, 0] - [1, 0, 0]).max() < 0.03  # left column red
  assert np.abs(video[:, :, -1] - [0, 0, 1]).max() < 0.03  # right column blue


def test_sample_indices_short_clips_repeat_frames():
  np.testing.assert_array_equal(sample_indices(3, 5), [0, 1, 1, 2, 2])  # floor(i/2 + 1/2)
  np.testing.assert_array_equal(sample_indices(7, 1), [3])
  with pytest.raises(ValueError, match="num_frames > 0"):
    sample_indices(0, 4)


def test_video_audio_track_is_resampled(tmp_path):
  sr, f0 = 16_000, 500.0
  t = np.arange(sr) / sr
  write_video(tmp_path / "tone.mp4", gray_clip(10), fps=10, audio=0.5 * np.sin(2 * np.pi * f0 * t),
              sample_rate=sr)
  spec = dict(sample_rate=8000, num_samples=4096, channels=1)
  _, (track, valid) = decode_video(tmp_path / "tone.mp4", frames=2, size=(8, 8), channels=3,
                                  audio=spec)
  assert track.shape == (4096,) and track.dtype == np.float32 and int(valid) == 4096
  seg = track[2048:4096]  # past AAC's encoder delay
  spectrum = np.abs(np.fft.rfft(seg * np.hanning(len(seg))))
  assert abs(np.argmax(spectrum) * 8000 / len(seg) - f0) <= 8000 / len(seg)
  assert np.sqrt(2 * np.mean(seg ** 2)) == pytest.approx(0.5, rel=0.1)
  # A window longer than the track: zero-padded after the 8,000 real samples (1 s at 8 kHz,
  # give or take AAC's framing), which `valid` counts for the encoder's mask.
  long = dict(spec, num_samples=12_000)
  _, (padded, valid) = decode_video(tmp_path / "tone.mp4", frames=2, size=(8, 8), channels=3,
                                    audio=long)
  n = int(valid)
  assert 7_900 <= n <= 8_600 and not padded[n:].any()
  np.testing.assert_array_equal(padded[:4096], track)
  # A shorter window than the track is cropped where the offset says (here: its tail).
  _, (tail, valid) = decode_video(tmp_path / "tone.mp4", frames=2, size=(8, 8), channels=3,
                                  audio=dict(spec, num_samples=2048), audio_offset=1.0)
  assert int(valid) == 2048
  np.testing.assert_allclose(tail, padded[n - 2048:n], atol=1e-6)
  # A clip without a track gives None even when a track is asked for.
  write_video(tmp_path / "silent.mp4", gray_clip(4), fps=10)
  assert decode_video(tmp_path / "silent.mp4", frames=2, size=(8, 8), channels=3,
                      audio=spec)[1] is None


# ------------------------------------------------------------------------------- audio
def tone(rate, seconds, freq, amps):
  """[n, channels] sine at ``freq`` with one amplitude per channel."""
  t = np.arange(int(rate * seconds)) / rate
  return np.sin(2 * np.pi * freq * t)[:, None] * np.asarray(amps)[None, :]


def fit_sine(x, rate, freq):
  """Least-squares amplitude of a sine/cosine pair at ``freq``."""
  t = np.arange(len(x)) / rate
  basis = np.stack([np.sin(2 * np.pi * freq * t), np.cos(2 * np.pi * freq * t)], axis=1)
  coef = np.linalg.lstsq(basis, x, rcond=None)[0]
  return float(np.hypot(*coef))


def test_wav_resample_and_downmix_keep_frequency_and_mean_amplitude(tmp_path):
  # stereo 44.1 kHz, channels at 0.6 and 0.2 -> mono at 8 kHz has amplitude 0.4 at 440 Hz
  x = tone(44_100, 1.0, 440.0, [0.6, 0.2])
  write_wav(tmp_path / "st.wav", x, 44_100)
  y = decode_wav(tmp_path / "st.wav", sample_rate=8000, num_samples=6000)
  assert y.shape == (6000,) and y.dtype == np.float32
  mid = y[500:5500]  # away from the resampling filter's edges
  assert fit_sine(mid, 8000, 440.0) == pytest.approx(0.4, abs=2e-3)
  spectrum = np.abs(np.fft.rfft(mid))
  assert abs(np.argmax(spectrum) * 8000 / len(mid) - 440.0) <= 8000 / len(mid)
  # Only the head is resampled: same samples as resampling the whole (int16-rounded) file.
  full = np.round(np.clip(x, -1, 1) * 32767).mean(axis=1) / 32768
  ref = scipy.signal.resample_poly(full, 80, 441)[:6000]
  np.testing.assert_allclose(y, ref, atol=1e-6)


def test_wav_short_file_is_zero_padded_and_channels_kept(tmp_path):
  x = tone(8000, 0.1, 1000.0, [0.5, -0.25])
  write_wav(tmp_path / "s.wav", x, 8000)
  y = decode_wav(tmp_path / "s.wav", sample_rate=8000, num_samples=1000, channels=2)
  assert y.shape == (1000, 2)
  np.testing.assert_allclose(y[:800], np.round(x * 32767) / 32768, atol=1e-7)
  assert not y[800:].any()
  with pytest.raises(DecodeError, match="2 channel.*wants 3"):
    decode_wav(tmp_path / "s.wav", sample_rate=8000, num_samples=1000, channels=3)


@pytest.mark.parametrize("suffix,atol", [(".flac", 2e-3), (".mp3", 0.05), (".ogg", 0.05)])
def test_compressed_audio_files_decode_through_pyav(tmp_path, suffix, atol):
  x = 0.5 * np.sin(2 * np.pi * 440.0 * np.arange(24_000) / 48_000)
  write_audio(tmp_path / f"t{suffix}", x, 48_000)
  y = decode_audio(tmp_path / f"t{suffix}", sample_rate=8000, num_samples=3000)
  mid = y[1000:3000]  # past codec priming and the resampling filter's start
  spectrum = np.abs(np.fft.rfft(mid * np.hanning(len(mid))))
  assert abs(np.argmax(spectrum) * 8000 / len(mid) - 440.0) <= 8000 / len(mid)  # rate kept
  assert fit_sine(mid, 8000, 440.0) == pytest.approx(0.5, abs=atol)  # lossy codecs: 5 %
  if suffix == ".flac":  # lossless: the int16 samples resampled, as a WAV would be
    ref = scipy.signal.resample_poly(np.round(x * 32767) / 32768, 1, 6)[:3000]
    np.testing.assert_allclose(y, ref, atol=1e-6)


@pytest.mark.parametrize("dtype,scale,zero", [(np.uint8, 128, 128), ("<i2", 32768, 0),
                                              ("<i4", 2 ** 31, 0), ("<f4", 1, 0)])
def test_wav_sample_formats_scale_to_unit_range(tmp_path, dtype, scale, zero):
  values = np.asarray([0.5, -0.25, 0.0, -1.0])
  raw = (values * scale + zero).astype(dtype)
  scipy.io.wavfile.write(tmp_path / "f.wav", 8000, raw)
  y = decode_wav(tmp_path / "f.wav", sample_rate=8000, num_samples=4)
  np.testing.assert_allclose(y, values, atol=1e-7)


def test_wav_24_bit(tmp_path):
  values = np.asarray([0.5, -0.25, 2 ** -20])
  ints = np.round(values * 2 ** 23).astype("<i4")
  raw = b"".join(int(v).to_bytes(3, "little", signed=True) for v in ints)
  with wave.open(str(tmp_path / "w24.wav"), "wb") as f:
    f.setnchannels(1)
    f.setsampwidth(3)
    f.setframerate(8000)
    f.writeframes(raw)
  np.testing.assert_allclose(decode_wav(tmp_path / "w24.wav", sample_rate=8000, num_samples=3),
                             values, atol=1e-9)


# ------------------------------------------------------------------------------ images
def test_png_channels(tmp_path):
  Image.new("L", (10, 6), 77).save(tmp_path / "g.png")
  Image.new("RGB", (10, 6), (200, 100, 50)).save(tmp_path / "c.png")
  Image.new("RGBA", (10, 6), (10, 20, 30, 40)).save(tmp_path / "a.png")
  Image.fromarray(np.full((6, 10), 40_000, np.uint16)).save(tmp_path / "d16.png")
  g1 = decode_image(tmp_path / "g.png", (3, 5), 1)
  assert g1.shape == (3, 5, 1) and g1.dtype == np.float32
  np.testing.assert_allclose(g1, 77 / 255, atol=1e-7)
  np.testing.assert_allclose(decode_image(tmp_path / "g.png", (3, 5), 3), 77 / 255, atol=1e-7)
  luma = (200 * 299 + 100 * 587 + 50 * 114) / 1000  # ITU-R 601-2, Pillow's "L"
  np.testing.assert_allclose(decode_image(tmp_path / "c.png", (6, 10), 1), round(luma) / 255,
                             atol=1e-7)
  rgb = decode_image(tmp_path / "a.png", (6, 10), 3)
  assert np.abs(rgb - np.asarray([10, 20, 30]) / 255).max() < 1e-7
  rgba = decode_image(tmp_path / "c.png", (6, 10), 4)
  assert np.abs(rgba - np.asarray([200, 100, 50, 255]) / 255).max() < 1e-7
  depth = decode_image(tmp_path / "d16.png", (3, 5), 1)  # 16-bit precision survives
  np.testing.assert_allclose(depth, 40_000 / 65535, atol=1e-6)
  with pytest.raises(DecodeError, match="1-4 channels"):
    decode_image(tmp_path / "c.png", (6, 10), 5)


def test_image_resize_keeps_layout(tmp_path):
  arr = np.zeros((40, 80, 3), np.uint8)
  arr[:20] = (255, 0, 0)   # top red
  arr[20:] = (0, 0, 255)   # bottom blue
  Image.fromarray(arr).save(tmp_path / "tb.png")
  img = decode_image(tmp_path / "tb.png", (4, 2), 3)
  np.testing.assert_allclose(img[0], [[1, 0, 0]] * 2, atol=1e-6)  # top row red
  np.testing.assert_allclose(img[-1], [[0, 0, 1]] * 2, atol=1e-6)  # bottom row blue


# --------------------------------------------------------------------------- bad files
@pytest.fixture(name="bad")
def fixture_bad(tmp_path):
  Image.new("RGB", (64, 64), (1, 2, 3)).save(tmp_path / "ok.png")
  png = (tmp_path / "ok.png").read_bytes()
  (tmp_path / "trunc.png").write_bytes(png[: len(png) // 2])
  (tmp_path / "empty.png").write_bytes(b"")
  (tmp_path / "junk.bin").write_bytes(b"this is not media at all" * 10)
  write_wav(tmp_path / "ok.wav", np.zeros(4000), 8000)
  wav = (tmp_path / "ok.wav").read_bytes()
  (tmp_path / "trunc.wav").write_bytes(wav[: len(wav) // 2])
  (tmp_path / "header.wav").write_bytes(wav[:30])
  write_video(tmp_path / "ok.mp4", gray_clip(20), fps=10)
  mp4 = (tmp_path / "ok.mp4").read_bytes()
  (tmp_path / "trunc.mp4").write_bytes(mp4[: len(mp4) // 2])
  return tmp_path


@pytest.mark.parametrize("name,match", [
    ("missing.png", "file not found"), ("empty.png", "empty"), ("trunc.png", "not a readable"),
    ("junk.bin", "not a readable image")])
def test_bad_images_raise(bad, name, match):
  with pytest.raises(DecodeError, match=match) as e:
    decode_image(bad / name, (8, 8), 3)
  assert e.value.path == str(bad / name)
  assert str(e.value).startswith(str(bad / name))


@pytest.mark.parametrize("name,match", [
    ("missing.wav", "file not found"), ("trunc.wav", "truncated"),
    ("header.wav", "not a readable WAV"), ("junk.bin", "not a readable WAV")])
def test_bad_wavs_raise(bad, name, match):
  with pytest.raises(DecodeError, match=match):
    decode_wav(bad / name, sample_rate=8000, num_samples=100)


@pytest.mark.parametrize("name,match", [
    ("missing.mp4", "file not found"), ("trunc.mp4", "truncated|not a decodable"),
    ("junk.bin", "not a decodable video"), ("ok.wav", "no video stream")])
def test_bad_videos_raise(bad, name, match):
  with pytest.raises(DecodeError, match=match):
    decode_video(bad / name, frames=2, size=(8, 8), channels=3)


def test_video_with_no_frames_raises(tmp_path):
  # A video stream without packets (the audio track makes the muxer write the file; MP4
  # would drop the empty track, Matroska keeps it).
  write_video(tmp_path / "empty.mkv", np.zeros((0, 16, 16, 3), np.uint8), fps=10,
              audio=np.zeros(16_000), sample_rate=16_000)
  with pytest.raises(DecodeError, match="no decodable frames"):
    decode_video(tmp_path / "empty.mkv", frames=2, size=(8, 8), channels=3)


def test_bad_compressed_audio_raises(bad):
  (bad / "junk.flac").write_bytes(b"fLaC but not really" * 5)
  with pytest.raises(DecodeError, match="not a decodable audio file"):
    decode_audio(bad / "junk.flac", sample_rate=8000, num_samples=100)
  write_video(bad / "silent.mp4", gray_clip(4), fps=10)
  with pytest.raises(DecodeError, match="no audio stream"):
    decode_audio(bad / "silent.mp4", sample_rate=8000, num_samples=100)


@pytest.mark.parametrize("rate", [44_100, 22_050, 6_000])
def test_cached_resampling_filter_equals_scipys_default(rate):
  import scipy.signal
  x = np.random.default_rng(rate).normal(size=(rate // 4, 1))
  got = fit_audio(x, rate, sample_rate=8_000, num_samples=2_000, channels=1)
  g = np.gcd(rate, 8_000)
  want = scipy.signal.resample_poly(x[:, 0], 8_000 // g, rate // g)[:2_000]
  np.testing.assert_allclose(got, want.astype(np.float32), rtol=0, atol=1e-6)

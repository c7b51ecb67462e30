"""WAV folder loader: labels from names, resampling, and bad-input rejection with file names."""

from __future__ import annotations

import numpy as np
import pytest

from omni_jax.data import speech
from omni_jax.data import wav_folder as wf
from omni_jax.lsm import ear


def _tone(sr, secs, amp=0.3, f=440.0):
  t = np.arange(int(sr * secs)) / sr
  return (amp * np.sin(2 * np.pi * f * t)).astype(np.float32)


def test_loader_labels_resamples_and_rejects(tmp_path):
  (tmp_path / "seven").mkdir()
  wf.write_wav(tmp_path / "three_a_00.wav", _tone(16000, 0.5), 16000)
  wf.write_wav(tmp_path / "seven" / "take1.wav", _tone(16000, 0.4), 16000)
  wf.write_wav(tmp_path / "07f1set0.wav", _tone(16000, 0.4), 16000)
  wf.write_wav(tmp_path / "five_b_00.wav", _tone(22050, 0.5), 22050)
  wf.write_wav(tmp_path / "one_silent.wav", np.zeros(8000, np.float32), 16000)
  wf.write_wav(tmp_path / "two_clip.wav", np.clip(_tone(16000, 0.5, amp=3.0), -1, 1), 16000)
  wf.write_wav(tmp_path / "four_short.wav", _tone(16000, 0.05), 16000)
  wf.write_wav(tmp_path / "six_lowrate.wav", _tone(4000, 0.5, f=300.0), 4000)
  wf.write_wav(tmp_path / "hello.wav", _tone(16000, 0.5), 16000)
  (tmp_path / "eight_broken.wav").write_bytes(b"not a wav at all")
  ds = wf.load_folder(tmp_path)
  got = dict(zip([p.split("/")[-1] for p in ds.paths], ds.labels, strict=True))
  assert got == {"07f1set0.wav": 7, "five_b_00.wav": 5, "take1.wav": 7, "three_a_00.wav": 3}
  five = ds.waves[[p.endswith("five_b_00.wav") for p in ds.paths].index(True)]
  assert five.size == 8000
  assert ds.notes == [(str(tmp_path / "five_b_00.wav"), "resampled from 22050 Hz to 16000 Hz")]
  reasons = {p.split("/")[-1]: r for p, r in ds.rejected}
  assert set(reasons) == {"one_silent.wav", "two_clip.wav", "four_short.wav",
                          "six_lowrate.wav", "hello.wav", "eight_broken.wav"}
  assert reasons["one_silent.wav"].startswith("silent")
  assert reasons["two_clip.wav"].startswith("clipped")
  assert reasons["four_short.wav"].startswith("too short")
  assert "too low" in reasons["six_lowrate.wav"]
  assert reasons["hello.wav"].startswith("unlabelled")
  assert "not a readable PCM WAV" in reasons["eight_broken.wav"]


def test_loader_missing_folder_and_empty_folder(tmp_path):
  with pytest.raises(ValueError, match="does not exist"):
    wf.load_folder(tmp_path / "nope")
  with pytest.raises(ValueError, match="no .wav files"):
    wf.load_folder(tmp_path)


def test_resample_preserves_a_tone():
  x = _tone(22050, 1.0, f=500.0)
  y = wf.resample(x, 22050, 16000)
  assert y.size == 16000
  spec = np.abs(np.fft.rfft(y))
  assert abs(int(spec.argmax()) - 500) <= 1


def test_wav_roundtrip(tmp_path):
  x = _tone(16000, 0.2)
  wf.write_wav(tmp_path / "a.wav", x, 16000)
  y, sr = wf.read_wav(tmp_path / "a.wav")
  assert sr == 16000
  np.testing.assert_allclose(y, x, atol=1 / 32768)


def test_ear_channel_peaks_follow_frequency_and_bsa_encodes():
  p = ear.EarParams()
  cas = ear.design_cascade(p)
  assert cas.b.shape == (77, 3) and np.all(np.diff(cas.freqs) < 0)
  # A 1 kHz tone excites the channel whose characteristic frequency is near 1 kHz most.
  out = np.asarray(ear.cochlea(cas, np.asarray(_tone(16000, 0.3, f=1000.0)), p.decimation))
  best = cas.freqs[out[100:].mean(0).argmax()]
  assert 800.0 < best < 1300.0
  # BSA: no spikes for zero signal, more spikes for a larger constant signal.
  sig = np.full((400, 3), [1.0, 0.5, 0.0], np.float32)
  spikes = np.asarray(ear.bsa_encode(sig, ear.bsa_kernel(16, 4.0), 0.05))
  assert spikes[:, 2].sum() == 0
  assert spikes[:, 0].sum() > spikes[:, 1].sum() > 0
  with pytest.raises(ValueError, match="f_lo"):
    ear.design_cascade(ear.EarParams(f_lo=7000.0))


@pytest.mark.usefixtures("needs_espeak_ng")   # tests/system_packages.py
def test_generate_digits_with_espeak_and_reuse(tmp_path):
  spec = speech.SpeechSpec(voices=("en-us",), utterances=1)
  paths = speech.generate_digits(tmp_path, spec)
  assert len(paths) == 10
  mtime = paths[0].stat().st_mtime_ns
  speech.generate_digits(tmp_path, spec)            # reuses, does not rewrite
  assert paths[0].stat().st_mtime_ns == mtime
  ds = wf.load_folder(tmp_path)
  assert sorted(ds.labels) == list(range(10)) and not ds.rejected


def test_speech_folder_refuses_another_spec(tmp_path):
  spec = speech.SpeechSpec(voices=("en-us",), utterances=1)
  speech._check_spec(tmp_path, spec)                    # empty folder: records the spec
  speech._check_spec(tmp_path, spec)                    # same spec: accepted
  with pytest.raises(ValueError, match=r"another speech spec \(differs in \['pitch'\]"):
    speech._check_spec(tmp_path, speech.SpeechSpec(voices=("en-us",), utterances=1,
                                                   pitch=(40, 60)))
  other = tmp_path / "old"
  other.mkdir()
  wf.write_wav(other / "one_enus_00.wav", np.zeros(160, np.float32), 16000)
  with pytest.raises(ValueError, match="no speech_spec.json"):
    speech._check_spec(other, spec)


def test_room_with_zero_rt60_is_the_identity():
  x = np.random.default_rng(0).standard_normal(100).astype(np.float32)
  y = speech.room(x, 16000, 0.0, np.random.default_rng(1))
  np.testing.assert_array_equal(x, y)
  z = speech.room(x, 16000, 0.05, np.random.default_rng(1))
  assert z.size == 100 + 800 - 1 and abs(z[0] - x[0]) < 1e-5


def test_studio_variant_changes_only_the_recording_conditions():
  from configs import lsm as lsm_cfg
  paper, studio = lsm_cfg.get_config("paper").to_dict(), lsm_cfg.get_config("studio").to_dict()
  changed = {k for k in paper["data"] if paper["data"][k] != studio["data"][k]}
  assert changed == {"speed_wpm", "pitch", "snr_db", "rt60_s"}
  paper.pop("data"), studio.pop("data"), paper.pop("variant"), studio.pop("variant")
  assert paper == studio
  with pytest.raises(ValueError, match="allowed"):
    lsm_cfg.get_config("ti46")

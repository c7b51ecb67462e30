"""Audio longer than its window: cropped where asked, resampling only the window; training
draws a window per element (deterministic), held-out records take the centre."""

import json
import wave

import numpy as np
import pytest
import scipy.signal

from configs.omni_moe import get_config
from omni_jax.data.decode import fit_audio
from omni_jax.data.documents import DocMaker
from omni_jax.data.records import open_dataset
from omni_jax.train.spec import build_spec


def test_a_crop_equals_that_window_of_the_whole_file_resampled():
  rng = np.random.default_rng(0)
  x = rng.normal(size=22_050 * 3)  # 3 s of noise at 22.05 kHz -> 24,000 samples at 8 kHz
  full = scipy.signal.resample_poly(x, 160, 441)
  n = 4000
  for offset in (0.0, 0.5, 0.83, 1.0):
    y = fit_audio(x, 22_050, sample_rate=8000, num_samples=n, channels=1, offset=offset)
    start = int(round(offset * (len(full) - n))) // 160 * 160  # on the input sample grid
    assert abs(start - offset * (len(full) - n)) < 160
    # Edges: the window's own filter warm-up is kept, so the whole window matches; the tail
    # window ends where the file ends (its last samples see the file's end like `full`).
    np.testing.assert_allclose(y[:len(full) - start], full[start:start + n], atol=1e-6)
  same_rate = fit_audio(x, 8000, sample_rate=8000, num_samples=n, channels=1, offset=0.5)
  a = (len(x) - n) // 2
  np.testing.assert_allclose(same_rate, x[a:a + n].astype(np.float32))
  short = fit_audio(x[:100], 8000, sample_rate=8000, num_samples=n, channels=1, offset=0.5)
  np.testing.assert_allclose(short[:100], x[:100].astype(np.float32))
  assert not short[100:].any()  # shorter than the window: padded at the end, not moved
  with pytest.raises(ValueError, match=r"offset must be in \[0, 1\]"):
    fit_audio(x, 8000, sample_rate=8000, num_samples=n, channels=1, offset=1.5)


def write_ramp_wav(path, n):
  """A WAV whose sample k is k (int16): a window's first sample names where it starts."""
  with wave.open(str(path), "wb") as w:
    w.setnchannels(1)
    w.setsampwidth(2)
    w.setframerate(8000)
    w.writeframes(np.arange(n, dtype=np.int16).tobytes())


def test_training_windows_are_drawn_per_element_and_eval_is_centred(tmp_path):
  cfg = get_config("micro")
  spec = build_spec(cfg.model)
  n = dict(spec.modalities)["audio"]["num_samples"]
  write_ramp_wav(tmp_path / "long.wav", 4 * n)
  (tmp_path / "m.jsonl").write_text(json.dumps({"id": 1, "text": "ramp",
                                                "audio": "long.wav"}) + "\n")
  item = open_dataset(tmp_path / "m.jsonl", 0.0).split("train")[0]
  maker = DocMaker(spec, 64, {}, ["text", "audio:understand"], audio_crop="random", seed=3)
  starts = {}
  for index in range(6):
    _, x = maker.record(item, index=index)
    first = int(round(x["audio"][0] * 32768))
    np.testing.assert_allclose(x["audio"] * 32768, np.arange(first, first + n), atol=1e-3)
    assert first == int(round(maker.crop_offset(index) * 3 * n))
    starts[index] = first
  assert len(set(starts.values())) == 6  # a new window per element (epoch)
  assert maker.record(item, index=4)[1]["audio"][0] * 32768 == pytest.approx(starts[4])  # same draw
  _, held = maker.record(item)  # held-out / codebook records: the centre
  assert int(round(held["audio"][0] * 32768)) == int(round(0.5 * 3 * n))
  head = DocMaker(spec, 64, {}, ["text", "audio:understand"], audio_crop="head")
  assert head.record(item, index=5)[1]["audio"][0] == 0.0
  with pytest.raises(ValueError, match="audio_crop must be one of"):
    DocMaker(spec, 64, {}, ["text"], audio_crop="middle")

"""Voice split (tuning vs held-out test voices), the strict test-folder loader, the flite engine."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from configs import lsm as lsm_cfg
from omni_jax.data import speech
from omni_jax.data import wav_folder as wf
from omni_jax.lsm import corpus
from omni_jax.lsm import study as lsm_study


def _tone(secs=0.4, f=440.0):
  t = np.arange(int(16000 * secs)) / 16000
  return (0.3 * np.sin(2 * np.pi * f * t)).astype(np.float32)


def _dataset(speakers_per_label):
  ds = wf.Dataset()
  for label, spk in speakers_per_label:
    ds.labels.append(label)
    ds.speakers.append(spk)
    ds.paths.append(f"{label}_{spk}.wav")
    ds.waves.append(None)
  return ds


def test_paper_config_test_voices_are_new_voices():
  cfg = lsm_cfg.get_config("paper")
  assert corpus.test_speakers(cfg) == ("engbxrpm2", "engbxgbclanf4", "engbxgbcwmdm5")
  assert not set(corpus.test_speakers(cfg)) & {corpus.speaker_id(v) for v in cfg.data.voices}
  lsm_study.validate(cfg)
  cfg.data.test_voices = ("en-us-nyc+m7",)                  # a tuning voice
  with pytest.raises(ValueError, match=r"repeat tuning voices \(speaker ids \['enusnycm7'\]\)"):
    lsm_study.validate(cfg)


def test_split_voices_masks_exactly_the_held_out_speakers():
  cfg = lsm_cfg.get_config("tiny")                          # tuning en-us, en-gb+f3; test RP
  rows = [(d, s) for s in ("enus", "engbf3", "engbxrpm2") for d in range(10) for _ in range(3)]
  ds = _dataset(rows)
  mask = corpus.split_voices(cfg, ds)
  np.testing.assert_array_equal(mask, [s == "engbxrpm2" for _, s in rows])
  sub = corpus.subset(ds, ~mask)
  assert set(sub.speakers) == {"enus", "engbf3"} and len(sub.labels) == 60


def test_split_voices_rejects_missing_speakers_and_unseen_classes():
  cfg = lsm_cfg.get_config("tiny")
  with pytest.raises(ValueError, match=r"test speakers \['engbxrpm2'\] have no usable files"):
    corpus.split_voices(cfg, _dataset([(d, "enus") for d in range(10) for _ in range(3)]))
  rows = [(d, "enus") for d in range(5) for _ in range(3)] + [(7, "engbxrpm2")]
  with pytest.raises(ValueError, match=r"test voices hold classes \[7\]"):
    corpus.split_voices(cfg, _dataset(rows))


def test_wav_dir_holds_out_the_named_speakers():
  cfg = lsm_cfg.get_config("tiny")
  cfg.data.wav_dir, cfg.data.test_speakers = "/data/ti46", ("f1",)
  rows = [(d, s) for s in ("m1", "f1") for d in range(10) for _ in range(3)]
  np.testing.assert_array_equal(corpus.split_voices(cfg, _dataset(rows)),
                                [s == "f1" for _, s in rows])


def test_test_dir_loads_every_labelled_file(tmp_path):
  wf.write_wav(tmp_path / "seven_kal_00.wav", _tone(), 16000)
  (tmp_path / "3").mkdir()
  wf.write_wav(tmp_path / "3" / "take1.wav", _tone(), 22050)
  cfg = lsm_cfg.get_config("tiny")
  cfg.data.test_wav_dir = str(tmp_path)
  ds = corpus.load_test_dir(cfg)
  assert dict(zip([p.split("/")[-1] for p in ds.paths], ds.labels, strict=True)) == {
      "take1.wav": 3, "seven_kal_00.wav": 7}


def test_test_dir_names_unlabelled_and_unreadable_files(tmp_path):
  wf.write_wav(tmp_path / "seven_kal_00.wav", _tone(), 16000)
  wf.write_wav(tmp_path / "hello_kal_00.wav", _tone(), 16000)
  (tmp_path / "two_kal_00.wav").write_bytes(b"RIFF but not really")
  cfg = lsm_cfg.get_config("tiny")
  cfg.data.test_wav_dir = str(tmp_path)
  with pytest.raises(ValueError) as e:
    corpus.load_test_dir(cfg)
  msg = str(e.value)
  assert "2 of 3 WAV files not usable" in msg
  assert f"{tmp_path / 'hello_kal_00.wav'}: unlabelled" in msg
  assert f"{tmp_path / 'two_kal_00.wav'}: not a readable PCM WAV" in msg
  assert wf.LABEL_RULE in msg
  cfg.data.test_wav_dir = str(tmp_path / "nope")
  with pytest.raises(ValueError, match="test_wav_dir = .* is not a folder"):
    lsm_study.validate(cfg)


def test_speech_engine_choice():
  with pytest.raises(ValueError, match=r"speech engine 'festival' is not allowed"):
    speech.synthesize("one", "kal", 175, 50, 16000, engine="festival")


@pytest.mark.skipif(shutil.which("flite") is None, reason="flite not installed (apt-get install "
                    "-y flite): the second speech engine for test folders")
def test_flite_speaks_slower_at_lower_rate():
  fast = speech.synthesize("seven", "slt", 190, 50, 16000, engine="flite")
  slow = speech.synthesize("seven", "slt", 130, 50, 16000, engine="flite")
  assert 0.3 < fast.size / 16000 < slow.size / 16000 < 1.5


def test_speech_folder_made_before_engines_were_named_is_reused(tmp_path):
  spec = speech.SpeechSpec(voices=("en-us",), utterances=1)
  speech._check_spec(tmp_path, spec)
  rec = (tmp_path / speech.SPEC_FILE).read_text().replace(', "engine": "espeak-ng"', "")
  (tmp_path / speech.SPEC_FILE).write_text(rec)
  speech._check_spec(tmp_path, spec)                                 # still accepted
  with pytest.raises(ValueError, match=r"differs in \['engine'\]"):
    speech._check_spec(tmp_path, speech.SpeechSpec(voices=("en-us",), utterances=1,
                                                   engine="flite"))


def test_extra_model_leaves_the_folds_draws_unchanged():
  import jax
  cfg = lsm_cfg.get_config("tiny")                          # 3 folds
  labels = np.tile(np.arange(3), 6)
  fold = corpus.make_folds(labels, 3, 0)
  folds = [fold != f for f in range(3)]
  full = np.ones(labels.size, bool)
  full[[0, 5]] = False                                      # the extra row excludes two samples
  streams_a = lsm_study.draw_streams(cfg, 3)
  streams_b = lsm_study.draw_streams(cfg, 4)
  for epoch in range(3):
    o3, k3 = lsm_study.epoch_draws(cfg, np.stack(folds), 12, streams_a, epoch)
    o4, k4 = lsm_study.epoch_draws(cfg, np.stack(folds + [full]), 12, streams_b, epoch)
    np.testing.assert_array_equal(o4[:3], o3)
    np.testing.assert_array_equal(jax.random.key_data(k4[:3]), jax.random.key_data(k3))
    for j, row in enumerate(folds + [full]):                # drawn from its own row, no repeats
      assert row[o4[j]].all() and len(set(o4[j].tolist())) == 12
    assert not np.array_equal(jax.random.key_data(k4[3]), jax.random.key_data(k4[0]))


@pytest.mark.slow
def test_adding_the_all_tuning_voices_model_leaves_the_folds_unchanged(tmp_path):
  from omni_jax.common.metrics import MetricsLog
  cfg = lsm_cfg.get_config("tiny")
  cfg.folds, cfg.readout.epochs, cfg.readout.eval_every, cfg.readout.group = 2, 2, 2, 1
  rng = np.random.default_rng(0)
  labels = np.tile([0, 1], 4)
  spikes = (rng.random((8, 30, 6)) < 0.3).astype(np.uint8)
  fold = corpus.make_folds(labels, 2, 0)
  _, out_lif, rule = lsm_study.lif_params(cfg)
  fmt = lsm_study.fmt_for(cfg, 16)
  seen = []
  log = MetricsLog(str(tmp_path / "m.jsonl"))

  def train(rows):
    return np.asarray(lsm_study.train_readouts(cfg, spikes, labels, np.stack(rows), fmt, out_lif,
                                               rule, 16, lambda w: seen.append(w.shape) or {},
                                               log))

  folds = [fold != 0, fold != 1]
  w_folds = train(folds)
  w_all = train(folds + [np.ones(8, bool)])
  assert seen == [(2, 6, 2), (3, 6, 2)]                   # evaluated once, at the last epoch
  np.testing.assert_array_equal(w_all[:2], w_folds)
  assert np.abs(w_folds).sum() > 0 and not np.array_equal(w_all[2], w_all[0])

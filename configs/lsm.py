"""Liquid state machine on spoken digits: espeak-ng data, Lyon ear, LIF reservoir.

Run:
  python -m experiments.lsm --config=configs/lsm.py:tiny --workdir=/tmp/lsm_tiny
  python -m experiments.lsm --config=configs/lsm.py:paper --workdir=/tmp/lsm_paper
Variants: ``tiny`` (2 voices x 10 digits x 3 utterances, 1 epoch, < 2 min smoke run),
``paper`` (5 voices x 10 digits x 10 utterances, 5-fold cross-validation, bits 16/12/12-8-8/8;
each utterance gets a random speed, pitch, room and noise level) and ``studio`` (the same with
TI46's recording conditions: a sound booth, so no room and 40-50 dB SNR, and the speed and
pitch of one speaker repeating a word, about +-10 % in F0 and duration; see docs/lsm.md).
Use your own corpus (e.g. TI46) with ``--config.data.wav_dir=/path/to/wavs``.
"""

from __future__ import annotations

import ml_collections

VARIANTS = ("tiny", "paper", "studio", "fsdd", "fsdd_tiny")


def get_config(arg: str = "paper") -> ml_collections.ConfigDict:
  """Config for the LSM experiment; ``arg`` picks a variant."""
  if arg not in VARIANTS:
    raise ValueError(f"unknown lsm config variant {arg!r}; allowed: {list(VARIANTS)}")
  c = ml_collections.ConfigDict()
  c.variant = arg
  c.seed = 0
  # Voices: every hyperparameter below was tuned (docs/lsm.md, rounds 1-4) on the five
  # ``voices``, the tuning voices (readouts train on them; 5-fold CV on them is the secondary
  # ``accuracy``). ``test_voices`` were added afterwards and never used while tuning: other
  # espeak-ng accents (RP, Lancaster, West Midlands) with variants no tuning voice uses;
  # ``accuracy_test_voices`` is measured on them only. With wav_dir, test_speakers names the
  # held-out speakers (the file name's second token). test_wav_dir: a folder of labelled WAVs
  # (another engine or recorded speech) to test on as well (accuracy_test_dir).
  c.data = ml_collections.ConfigDict(dict(
      corpus="speech",         # "speech": WAVs (generated or wav_dir); "fsdd": recorded MFCCs
      wav_dir="",              # a folder of labelled WAVs; empty = generate with espeak-ng
      cache_dir="",            # where generated WAVs go; empty = <workdir>/wavs
      voices=("en-us", "en-gb+f3", "en-gb-scotland+m3", "en-029+f2", "en-us-nyc+m7"),
      test_voices=("en-gb-x-rp+m2", "en-gb-x-gbclan+f4", "en-gb-x-gbcwmd+m5"),
      test_speakers=(), test_wav_dir="",
      utterances=10, sample_rate=16000, snr_db=(20.0, 35.0), rt60_s=(0.05, 0.3),
      speed_wpm=(130, 190), pitch=(30, 70)))
  c.ear = ml_collections.ConfigDict(dict(
      num_channels=77, f_lo=100.0, f_hi=6000.0, decimation=16, bsa_length=16,
      bsa_spike_mass=4.0, bsa_threshold=0.5, scale_percentile=99.5))
  c.reservoir = ml_collections.ConfigDict(dict(
      grid=(3, 3, 15), r=2.0, frac_inhibitory=0.2, inputs_per_channel=4, w_input=8.0,
      threshold=80.0, tau_shift=6, syn_shift=3, refractory=2, membrane_range=256.0))
  # Calcium rule (tuned on 2-fold subsets, see docs/lsm.md): calcium leak 2**-5, so a
  # readout firing at rate r holds about 32 r. The teacher alone (+6) makes the desired
  # neuron fire at ~0.17/step (calcium ~5.3, inside the potentiation band (4.0, 6.3));
  # it stops learning once its own input lifts it above the band. The others get -1.5 and
  # are depressed while their calcium is in (1.7, 4.0), i.e. while they still fire.
  # v_plus / v_minus: optional membrane condition of Zhang et al. 2015 (off at +-1e9).
  # epochs / dw_decay: the rule converges slowly; 40 epochs with dw x0.93 per epoch (ends at
  # 0.055 dw) instead of 12 with x0.8: 5-fold accuracy 0.858 -> 0.862 (60 epochs x0.95: 0.878;
  # studio data 0.896 -> 0.932), flat after ~30 epochs.
  # group: readout neurons per class, all taught alike; the class with the most spikes of
  # its group wins (a population vote that averages the rule's stochastic weights).
  # dc_minus: depression band width (negative = dc, symmetric); c_init_plus: the taught
  # neuron's calcium at the start of each sample (0 = rest); lateral: test-time inhibition
  # between readout neurons per spike. All three were tried and are off.
  c.readout = ml_collections.ConfigDict(dict(
      threshold=20.0, tau_shift=5, c_th=4.0, dc=2.3, p_plus=0.1, p_minus=0.1, dw=0.06,
      dw_decay=0.93, w_max=8.0, teacher_plus=6.0, teacher_minus=-1.5, calcium_shift=5,
      v_plus=-1e9, v_minus=1e9, epochs=40, eval_every=10, ls_ridge=1e-4, refractory=2,
      group=3, dc_minus=-1.0, c_init_plus=0.0, lateral=0.0,
      calcium_range=8.0))   # 8-bit lsb 1/16; saturating above 8 is still above the bands
  c.folds = 5
  # Fixed-point settings: an integer = that width for membrane, weights and calcium alike;
  # "m/w/c" = per-quantity widths (membrane/weight/calcium).
  c.bits = (16, 12, "12/8/8", 8)
  c.reference_bits = 16            # the full-precision design energy is measured against
  c.max_accuracy_loss = 0.01       # precision scaling may cost at most this much accuracy
  # Brian2 speed peer (omni_jax/lsm/brian2_env.py): Brian2 needs numpy < 2.3, so unless it
  # imports here the experiment creates a venv at ``venv`` (empty = ~/.cache/omni_jax/
  # brian2-venv) on first use with pip install brian2 'numpy<2.3' cython. Each target is timed;
  # brian2_steps_per_sec is the fastest. () = not measured.
  c.brian2 = ml_collections.ConfigDict(dict(
      venv="", utterances=3, targets=("numpy", "cython", "cpp_standalone"), timeout_s=900))
  c.speed_repeats = 3
  # FSDD (recorded speech as MFCCs, omni_jax/lsm/fsdd.py): split sizes per digit and the
  # MFCC spike encoder (receptive fields x BSA with the ear's BSA kernel and threshold).
  c.fsdd = ml_collections.ConfigDict(dict(
      test_per_class=30, val_per_class=27, train_per_class=0, fields=6, span=2.0,
      steps_per_frame=4, bins=4))
  if arg in ("fsdd", "fsdd_tiny"):
    # Chosen on the validation part only. MFCC utterances are short (72 steps on average at
    # 4 steps per frame) against the calcium's 32-step time constant: starting the taught
    # neurons' calcium at their teacher-alone level (c_init_plus) stops the rule from
    # depressing them while their calcium climbs (without it the readout collapsed onto
    # two classes). 3x3x30 neurons: least squares on spike counts 0.952 on validation
    # against 0.919 for 3x3x15. The rule sees 2430 utterances per epoch (the paper config:
    # 400). Rule schedule (validation, float rule, after 15 epochs): p+ = p- = 0.1 with dw
    # x0.85 per epoch 0.81; p+ = p- = 0.2 with x0.9 0.79-0.82 (two draws of the same
    # settings differ by up to 4 points); teacher_minus -1.0 instead of -1.5 0.80; 6 neurons
    # per class instead of 3 0.83 (the vote averages the stochastic weights). 16 epochs: a
    # run of record on the shared 2-core machine must stay within about half an hour.
    # Brian2: the numpy target checks the spike counts; the paper variant times all three.
    # bins: the linear readout's time bins (validation, 8-bit reservoir, 8-bit integer
    # readout: 3 bins 0.978, 4 bins 0.985, 6 bins 0.981; float reservoir and weights: total
    # counts 0.948, 3 bins 0.996). The calcium rule runs at the chosen precision and in float.
    c.data.corpus = "fsdd"
    c.folds = 2                       # unused: fsdd tunes on its validation part
    c.reservoir.grid = (3, 3, 30)
    c.readout.c_init_plus = 5.3
    c.readout.p_plus = c.readout.p_minus = 0.2
    c.readout.teacher_minus = -1.0
    c.readout.group = 6
    c.readout.epochs, c.readout.dw_decay, c.readout.eval_every = 16, 0.9, 8
    c.brian2.targets = ("numpy",)
  if arg == "fsdd_tiny":    # fsdd's test and validation parts, 20 train per digit, 1 epoch
    c.fsdd.train_per_class = 20
    c.readout.epochs = 1
    c.bits = (16, "12/8/8")
    c.brian2.targets = ()
    c.speed_repeats = 1
  if arg == "studio":
    # espeak-ng pitch 40 / 50 / 60 -> F0 81 / 90 / 101 Hz (en-us), speed 145 / 160 / 175 wpm
    # -> "seven" 0.58 / 0.53 / 0.49 s: about +-10 % around the voice's own values.
    c.data.speed_wpm = (145, 175)
    c.data.pitch = (40, 60)
    c.data.snr_db = (40.0, 50.0)
    c.data.rt60_s = (0.0, 0.0)       # 0 = no room (close-talking microphone in a booth)
  if arg == "tiny":
    c.data.voices = ("en-us", "en-gb+f3")
    c.data.test_voices = ("en-gb-x-rp+m2",)
    c.data.utterances = 3
    c.folds = 3
    c.readout.epochs = 1
    c.readout.group = 2
    c.bits = (16, "12/8/8")
    c.brian2.targets = ()           # the smoke run does not create the Brian2 venv
    c.speed_repeats = 1
  return c

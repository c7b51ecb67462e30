"""Write a labelled spoken-digit WAV folder with a speech engine: a test set for the LSM.

  python -m experiments.lsm_speech --out=/tmp/lsm_flite            # flite, 4 voices x 10 x 5
  python -m experiments.lsm --config=configs/lsm.py:paper --workdir=/tmp/lsm_paper \\
      --config.data.test_wav_dir=/tmp/lsm_flite

Files are named ``<digit>_<voice>_<index>.wav`` (``wav_folder``'s labelling rule), each with
its own speed and the paper config's room and noise ranges. The LSM trains on espeak-ng
speech; flite (CMU Flite) is another engine, so the folder measures generalisation beyond it.
"""

from __future__ import annotations

from absl import app, flags

from experiments import common
from omni_jax.data import speech

_OUT = flags.DEFINE_string("out", None, "output folder (reused if made with the same settings)")
_ENGINE = flags.DEFINE_enum("engine", "flite", list(speech.ENGINES), "speech engine")
_VOICES = flags.DEFINE_list("voices", list(speech.FLITE_VOICES), "voices of that engine")
_UTTERANCES = flags.DEFINE_integer("utterances", 5, "utterances per voice and digit")
_SEED = flags.DEFINE_integer("seed", 100, "seed of the speed / room / noise draws")


def main(argv):
  del argv
  if not _OUT.value:
    raise app.UsageError("--out is required")
  spec = speech.SpeechSpec(voices=tuple(_VOICES.value), utterances=_UTTERANCES.value,
                           seed=_SEED.value, engine=_ENGINE.value)
  speech.generate_digits(_OUT.value, spec)


if __name__ == "__main__":
  common.run(main)

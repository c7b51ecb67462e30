"""The judge of generated outputs (omni_jax/generate/judge.py): trained briefly on real renders
of the micro model's image modality it names the attributes of fixed held-out renders; the
label layout matches the captions; bad modalities / attributes are one clear error."""

import numpy as np
import pytest

from configs.omni_moe import get_config
from omni_jax.generate import judge as jd
from omni_jax.modalities import MODALITY_KINDS
from omni_jax.train.spec import build_spec


@pytest.fixture(scope="module")
def spec():
  return build_spec(get_config("micro").model)


def test_label_attributes_follow_the_captions(spec):
  ms = spec.modality("image")
  labels = MODALITY_KINDS.get("patch").labels(ms)
  att = jd.attributes(ms)
  for i, caption in enumerate(labels):
    a = jd.label_attributes(ms, i)
    assert caption == f"{att['colour'][a['colour']]} {att['shape'][a['shape']]} " \
                      f"{att['place'][a['place']]}"
    assert jd.caption_label(ms, f"  {caption} ") == i
  assert jd.caption_label(ms, "purple circle top left") is None
  assert jd.chance(ms) == {"shape": 0.25, "colour": 0.25, "place": 0.25}
  ma = spec.modality("audio")
  tones = MODALITY_KINDS.get("frames").labels(ma)
  for i, caption in enumerate(tones):
    a = jd.label_attributes(ma, i)
    timbre, _, note = caption.split()
    assert jd.attributes(ma)["pitch"][a["pitch"]] == note
    # At 8 kHz the overtones of f#6 and b6 lie above Nyquist: a buzzy one is a sine.
    assert a["timbre"] == (-1 if note in ("f#6", "b6") else ("soft", "buzzy").index(timbre))



@pytest.mark.slow  # trains the image judge (150 steps, ~13 s); labels and errors run by default
def test_judge_names_the_attributes_of_fixed_renders(spec, tmp_path):
  ms = dict(spec.modality("image"), size=(32, 32))  # the default task's size
  kw = dict(steps=150, per_class=4, heldout_per_class=1, lr=5e-3, batch=32)
  judge = jd.load_or_train(ms, str(tmp_path), **kw)  # trains (nothing cached yet)
  x, y = jd.render(ms, 12345, 1)  # 64 fixed renders, one per class, never trained on
  pred = judge.predict(x)
  for a in ("shape", "colour", "place"):
    truth = np.asarray([jd.label_attributes(ms, int(i))[a] for i in y])
    assert np.mean(pred[a] == truth) >= 0.95, a
    assert judge.score(x, y, only=a) == {a: float(np.mean(pred[a] == truth))}
  assert judge.info["heldout"]["colour"] >= 0.95 and "cached" not in judge.info
  # The second call loads the saved parameters: same predictions, no training.
  loaded = jd.load_or_train(ms, str(tmp_path), **kw)
  assert loaded.info["cached"].startswith(str(tmp_path))
  np.testing.assert_array_equal(loaded.predict(x)["shape"], pred["shape"])


def test_bad_modality_or_attribute_is_one_clear_error(spec):
  with pytest.raises(ValueError, match=r"kind 'video' cannot be judged; judged kinds: "
                                       r"\['patch', 'frames'\]"):
    jd.attributes(spec.modality("video"))
  raw = dict(spec.modality("audio"), features="raw")
  with pytest.raises(ValueError, match="needs log-mel features"):
    jd.train_judge(raw)
  ms = spec.modality("image")
  judge = jd.Judge(ms, None)
  with pytest.raises(ValueError, match=r"unknown attribute 'size'.*allowed: \['shape', "
                                       r"'colour', 'place'\]"):
    judge.score(np.zeros((1, 16, 16, 3)), [0], only="size")
  with pytest.raises(ValueError, match="label 64 out of range"):
    jd.label_attributes(ms, 64)

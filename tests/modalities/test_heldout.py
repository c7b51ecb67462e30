"""Attribute combinations held out of the synthetic task's training rows."""

import numpy as np
import pytest

from configs.omni_moe import get_config
from omni_jax.common.config import ConfigError
from omni_jax.data.stream import OmniStream
from omni_jax.generate import job
from omni_jax.modalities import MODALITY_KINDS, patch
from omni_jax.modalities.heldout import digits, heldout_labels, partial_caption, radices
from omni_jax.train.spec import build_spec


def _spec():
  cfg = get_config("micro")
  return cfg, build_spec(cfg.model)


@pytest.mark.parametrize("every", [3, 5, 8])
def test_every_value_keeps_training_classes_and_about_one_in_every_is_held(every):
  _, spec = _spec()
  for name in ("image", "audio"):
    ms = spec.modality(name)
    rad = radices(ms)
    n = int(np.prod(rad))
    held = heldout_labels(ms, every)
    assert 0 < len(held) < n
    assert abs(len(held) / n - 1 / every) <= 1 / every   # about 1/every of them
    seen = [digits(lab, rad) for lab in range(n) if lab not in held]
    for a, r in enumerate(rad):                          # every value still trained
      assert {d[a] for d in seen} == set(range(r))
  assert heldout_labels(spec.modality("image"), 0) == frozenset()


def test_digits_follow_the_kinds_label_order():
  _, spec = _spec()
  ms = spec.modality("image")
  labels = patch.labels(ms)
  rad = radices(ms)
  names = (patch.SHAPES, list(patch.palette(ms["channels"])), patch.PLACES)
  for lab in (0, 5, 37, len(labels) - 1):
    s, c, p = digits(lab, rad)
    assert labels[lab] == f"{names[1][c]} {names[0][s]} {names[2][p]}"


def test_bad_settings_are_one_clear_error():
  _, spec = _spec()
  with pytest.raises(ConfigError, match="heldout_every = 1 "):
    heldout_labels(spec.modality("image"), 1)
  # timbre x pitch at 2: t + 2p is even exactly for t = 0, so every soft tone would be held
  with pytest.raises(ConfigError, match=r"value\(s\) \[0\] of attribute 0 of modality 'audio'"):
    heldout_labels(spec.modality("audio"), 2)


def test_training_rows_never_show_a_held_out_caption_and_eval_rows_do():
  cfg, spec = _spec()
  cfg.data.heldout_every = 8
  stream = OmniStream(spec, cfg.data)
  captions = {m: MODALITY_KINDS.get(spec.modality(m)["kind"]).labels(spec.modality(m))
              for m in ("image", "audio")}
  held = {m: {captions[m][lab] for lab in heldout_labels(spec.modality(m), 8)}
          for m in captions}
  tok = spec.tokenizer

  def texts(batch):
    return [tok.decode([int(t) for t in row if 0 <= t < tok.vocab_size])
            for row in batch["tokens"]]

  train = [t for step in range(40) for t in texts(stream.batch(step))]
  evals = [t for i in range(40) for t in texts(stream.eval_batch(i))]
  for m in held:
    assert not any(c in t for t in train for c in held[m]), m
  assert any(c in t for t in evals for m in held for c in held[m])


def test_judged_scores_split_into_seen_and_unseen():
  _, spec = _spec()

  class Judge:  # scores by label parity: enough to check the split is by held-out class
    info = {"heldout": {}}
    attrs = {"shape": ["a"]}

    def score(self, xs, labels):
      return {"shape": float(np.mean(labels % 2)), "all": 0.0}

    def predict(self, xs):
      return {"shape": np.zeros(len(xs), int)}

  held = sorted(heldout_labels(spec.modality("image"), 8))
  seen = [lab for lab in range(64) if lab not in held][:6]
  labels = held[:3] + seen
  items = [(lab, np.zeros(1), {}) for lab in labels]
  s = job.score_judged(spec, {"image": Judge()}, {"image": items}, heldout_every=8)
  assert s["conditional_accuracy_unseen"]["image"]["shape"] == np.mean(np.array(held[:3]) % 2)
  assert s["conditional_accuracy_seen"]["image"]["shape"] == np.mean(np.array(seen) % 2)
  s0 = job.score_judged(spec, {"image": Judge()}, {"image": items})
  assert "conditional_accuracy_unseen" not in s0


def test_residues_split_the_combinations_into_disjoint_groups_of_one_make_up():
  """heldout_residue picks one of the k groups (tune on one, report another): the groups
  are disjoint and cover every class; at k = 8 the even residues (0 reported, 4 tuned on)
  hold every image attribute value twice, so the tuning group asks the reported one's
  question."""
  _, spec = _spec()
  ms = spec.modality("image")
  rad = radices(ms)
  groups = [heldout_labels(ms, 8, r) for r in range(8)]
  assert sum(len(g) for g in groups) == 64 and frozenset().union(*groups) == set(range(64))
  for g in groups[::2]:
    for a, r in enumerate(rad):
      counts = np.bincount([digits(lab, rad)[a] for lab in g], minlength=r)
      assert counts.tolist() == [2] * r
  assert heldout_labels(ms, 8) == groups[0]
  with pytest.raises(ConfigError, match=r"heldout_residue = 8 .*\[0, heldout_every = 8\)"):
    heldout_labels(ms, 8, 8)
  with pytest.raises(ConfigError, match="heldout_residue = 4 needs"):
    heldout_labels(ms, 0, 4)


def test_a_tuning_group_is_scored_as_unseen_and_the_reported_group_as_seen():
  _, spec = _spec()

  class Judge:
    info = {"heldout": {}}
    attrs = {"shape": ["a"]}

    def score(self, xs, labels):
      return {"shape": float(len(labels)), "all": 0.0}

    def predict(self, xs):
      return {"shape": np.zeros(len(xs), int)}

  ms = spec.modality("image")
  tune, report = sorted(heldout_labels(ms, 8, 4)), sorted(heldout_labels(ms, 8, 0))
  items = [(lab, np.zeros(1), {}) for lab in tune[:3] + report]
  s = job.score_judged(spec, {"image": Judge()}, {"image": items}, heldout_every=8, residue=4)
  assert s["conditional_accuracy_unseen"]["image"]["shape"] == 3
  assert s["conditional_accuracy_seen"]["image"]["shape"] == len(report)


def test_caption_dropout_leaves_attributes_out_of_generate_rows_only():
  cfg, spec = _spec()
  base = OmniStream(spec, cfg.data).batch(3)
  cfg.data.caption_dropout = 0.0  # set but 0: the very same stream as without the key
  same = OmniStream(spec, cfg.data).batch(3)
  for k in base:
    np.testing.assert_array_equal(base[k], same[k])
  cfg.data.update(caption_dropout=0.5, heldout_every=8)
  stream = OmniStream(spec, cfg.data)
  tok = spec.tokenizer
  full = {m: set(MODALITY_KINDS.get(spec.modality(m)["kind"]).labels(spec.modality(m)))
          for m in ("image", "audio")}
  gen_ids = {tok.special(f"<{m}:gen>"): m for m in full}
  und_ids = {tok.special(f"</{m}>"): m for m in full}
  partial, whole, understood = 0, 0, 0
  for step in range(30):
    for row in stream.batch(step)["tokens"]:
      row = [int(t) for t in row]
      for marker, m in gen_ids.items():
        if marker in row:  # <bos> caption <m:gen> codes: the caption before the marker
          words = tok.decode([t for t in row[1:row.index(marker)]]).split()
          assert set(words) <= {w for c in full[m] for w in c.split()}
          whole += " ".join(words) in full[m]
          partial += " ".join(words) not in full[m]
      for marker, m in und_ids.items():
        if marker in row:  # understand rows keep the whole caption
          text = tok.decode([t for t in row[row.index(marker) + 1:] if 0 <= t < tok.vocab_size])
          assert text.strip() in full[m], text
          understood += 1
  assert partial > 0 and whole > 0 and understood > 0
  with pytest.raises(ConfigError, match="caption_dropout"):
    cfg.data.caption_dropout = 1.0
    OmniStream(spec, cfg.data)


def test_partial_captions_name_exactly_the_kept_attributes():
  _, spec = _spec()
  for m in ("image", "audio"):
    ms = spec.modality(m)
    labels = MODALITY_KINDS.get(ms["kind"]).labels(ms)
    rad = radices(ms)
    for lab in range(len(labels)):
      assert partial_caption(ms, lab, (True,) * len(rad)) == labels[lab]
  ms = spec.modality("image")
  lab = patch.labels(ms).index("green triangle bottom right")
  assert partial_caption(ms, lab, (True, False, True)) == "triangle bottom right"
  assert partial_caption(ms, lab, (False, True, False)) == "green"
  assert partial_caption(spec.modality("audio"), 3, (False, True)) == "tone d#5"

"""Screen-recaptured document detection with FMAG + M2FM (issue 7).

Run:
  python -m experiments.dpad --config=configs/dpad.py:tiny --workdir=/tmp/dpad_tiny
  python -m experiments.dpad --config=configs/dpad.py:default --workdir=/tmp/dpad_default
  python -m experiments.dpad --config=configs/dpad.py:more_data --workdir=/tmp/dpad_more
Variants: ``tiny`` (a few documents, a few training steps: seconds, for tests),
``default`` (the CPU-sized run reported in WORKSPACE.md: ~10-15 min on 2 cores) and
``more_data`` (twice the training documents; the data-scaling point).
Rerunning with the same --workdir reuses the rendered captures (captures.npz).
"""

from __future__ import annotations

import ml_collections

VARIANTS = ("tiny", "default", "more_data")


def _range(lo: float, hi: float) -> tuple[float, float]:
  return (float(lo), float(hi))


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
  """Config for the dpad experiment; ``arg`` picks a variant."""
  if arg not in VARIANTS:
    raise ValueError(f"unknown dpad config variant {arg!r}; allowed: {list(VARIANTS)}")
  c = ml_collections.ConfigDict()
  c.variant = arg
  c.seed = 0
  c.data = ml_collections.ConfigDict(dict(
      canvas=512,                          # print page side (px); the screen shows it at 1/2
      train_kinds=("id_card", "certificate"),
      test_kinds=("invoice", "form", "letter"),
      train_docs=24,                       # documents per training kind
      test_docs=12))                       # documents per held-out kind
  c.sim = ml_collections.ConfigDict(dict(
      sensor=256,                          # captured frame side (sensor px)
      ss=4,                                # supersampling of the radiance per sensor px
      row_depth=0.5,                       # dimming of the display's row gaps
      period=_range(1.2, 1.7),             # screen pixel pitch on the sensor (sensor px)
      max_roll=0.08, max_persp=0.06, max_k1=0.04,
      high=dict(sigma=_range(0.4, 0.65), shot=_range(0.001, 0.004), read=_range(0.002, 0.006),
                jpeg=(85, 95), scale=_range(1.0, 1.0)),
      low=dict(sigma=_range(0.6, 0.9), shot=_range(0.006, 0.015), read=_range(0.006, 0.015),
               jpeg=(50, 75), scale=_range(0.75, 0.9))))
  c.patch = 64                             # classifier patch side (px)
  c.fmag = ml_collections.ConfigDict(dict(
      prob=0.5,                            # share of training patches augmented
      alpha=_range(0.5, 0.8),              # attenuation outside the mask
      beta_std=0.02,                       # additive amplitude noise (ortho FFT, [0,1] pixels)
      search_radius=4.0,                   # bins around the predicted peak
      disc_radius=2.5,                     # kept disc radius (bins)
      min_peak_ratio=3.0))                 # peak / mean of its ring below this -> use prediction
  c.train = ml_collections.ConfigDict(dict(
      steps=300, batch=32, lr=2e-3, weight_decay=1e-4))
  c.m2fm = ml_collections.ConfigDict(dict(
      steps=250, batch=24, lr=1e-3, mask_prob=0.7, mask_radius=0.2,   # radius: share of N
      masked_weight=4.0, ce_weight=0.2, width=48, depth=2, patch=8))
  c.models = ("resnet", "vit")             # both classifiers; the summary's main keys use the first
  c.methods = ("baseline_aug", "fmag", "fmag_m2fm")
  if arg == "tiny":
    c.data.canvas = 256
    c.data.train_kinds = ("id_card",)
    c.data.test_kinds = ("invoice",)
    c.data.train_docs = 3
    c.data.test_docs = 2
    c.sim.sensor = 128
    c.patch = 32
    c.train.steps = 6
    c.train.batch = 16
    c.m2fm.steps = 4
    c.m2fm.batch = 8
    c.m2fm.width = 16
    c.m2fm.depth = 1
    c.models = ("resnet",)
  elif arg == "more_data":
    c.data.train_docs = 48
  return c

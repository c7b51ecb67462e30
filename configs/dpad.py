"""Screen-recaptured document detection with FMAG + M2FM (issue 7).

Run:
  python -m experiments.dpad --config=configs/dpad.py:tiny --workdir=/tmp/dpad_tiny
  python -m experiments.dpad --config=configs/dpad.py:default --workdir=/tmp/dpad_default
  python -m experiments.dpad --config=configs/dpad.py:half_data --workdir=/tmp/dpad_half \
    --config.captures_from=/tmp/dpad_default/captures.npz
  python -m experiments.dpad --config=configs/dpad.py:quarter_data --workdir=/tmp/dpad_quarter \
    --config.captures_from=/tmp/dpad_default/captures.npz
  python -m experiments.dpad --config=configs/dpad.py:sharp_low --workdir=/tmp/dpad_sharp_low
Variants: ``tiny`` (a few documents, a few training steps: seconds, for tests),
``default`` (the CPU-sized run reported in WORKSPACE.md: 48 training documents per kind,
240 held-out images per quality; ~6-10 min on 2 busy cores + ~3-5 min of rendering),
``half_data`` / ``quarter_data`` (ResNet on the first 24 / 12 training documents per kind
of the same captures: the data-scaling points; ``captures_from`` reuses the default's
rendered captures instead of rendering them again) and ``sharp_low`` (sensitivity check:
the low channel keeps the high-quality optics — resolution loss, noise and JPEG only — to
see whether moiré then survives it; default's documents, ResNet only; renders its own
captures).
Rerunning with the same --workdir reuses the rendered captures (captures.npz).
"""

from __future__ import annotations

import ml_collections

VARIANTS = ("tiny", "default", "half_data", "quarter_data", "sharp_low")


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
      train_docs=48,                       # documents per training kind (rendered)
      test_docs=40))                       # documents per held-out kind: 240 images/quality
  c.train_subset = 0                       # use the first k training docs per kind (0: all);
                                           # outside `data`, so the captures cache is shared
  c.captures_from = ""                     # a captures.npz to reuse if its data/sim match
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
      steps=300, batch=32, lr=2e-3, weight_decay=1e-4,
      whiten=True))                        # ring-whitened log spectra (models.ring_whiten)
  c.m2fm = ml_collections.ConfigDict(dict(
      steps=250, batch=24, lr=1e-3, mask_prob=0.7,
      mask="channel",                      # "lowpass": hard disc of mask_radius (cycles/px);
      mask_radius=0.2,                     # "channel": blur x cut + noise like the low channel
      mask_sigma=_range(0.0, 0.5), mask_cut=_range(0.3, 0.45), mask_noise=_range(0.0, 0.015),
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
  elif arg in ("half_data", "quarter_data"):      # data scaling on the default's captures
    c.train_subset = 24 if arg == "half_data" else 12
    c.models = ("resnet",)
  elif arg == "sharp_low":      # sensitivity: low quality made only after the lens
    c.sim.low.sigma = c.sim.high.sigma
    c.models = ("resnet",)
  return c

"""The GPS receiver's error model, estimated from the survey's own tags.

Bundle adjustment weighs GPS fixes by a Gauss-Markov bias (sigma ``bias``, correlation time
``tau_s``) plus white noise (``white``) per axis (:func:`geometry.gps_information`). Those
figures are not given to the pipeline; they are estimated here from the fixes themselves:
on each flight line the drone flies straight at constant speed, so the second differences
of the fixes (divided-difference weights: exact zero for any constant-velocity path) hold
only the receiver's error. Their Gaussian likelihood under the bias + white model is
maximised, horizontal axes pooled, vertical apart.

What is identifiable: the white noise and the bias's short-lag growth (its diffusion rate
2 bias^2 / tau) are well determined by lines of tens of fixes; bias and tau separately are
not (on simulated 40 s lines the free three-parameter fit wandered to tau = 10 s or to the
3600 s bound). So the bias's stationary sigma — the receiver's absolute accuracy, which only
places the model and does not change its shape — is a datasheet figure (config, with its
source), and the fit gives tau and the white sigma. Anything the drone's path adds (wind,
altitude hold) is counted as receiver error: the estimate errs on the cautious side.
"""

from __future__ import annotations

import numpy as np
from scipy import optimize

TAU_RANGE_S = (1.0, 3600.0)


def second_difference_operator(times_s) -> np.ndarray:
  """(n-2, n) rows a, -(a+c), c (a = 1/(t1-t0), c = 1/(t2-t1)): zero on any path
  linear in time."""
  t = np.asarray(times_s, float)
  n = len(t)
  if n < 3 or np.any(np.diff(t) <= 0):
    raise ValueError(f"need >= 3 strictly increasing times per line, got {t.tolist()}")
  d = np.zeros((n - 2, n))
  for i in range(n - 2):
    a, c = 1.0 / (t[i + 1] - t[i]), 1.0 / (t[i + 2] - t[i + 1])
    d[i, i:i + 3] = a, -(a + c), c
  return d


def _nll(theta, series, bias: float) -> float:
  """Negative log-likelihood of second-differenced series [(D, t, (n, axes) values)] under
  bias sigma ``bias``, correlation time exp(theta[0]) and white sigma exp(theta[1])."""
  tau, white = np.exp(theta)
  total = 0.0
  for d, t, x in series:
    cov = bias ** 2 * np.exp(-np.abs(t[:, None] - t[None, :]) / tau) + white ** 2 * np.eye(len(t))
    s = d @ cov @ d.T
    try:
      ch = np.linalg.cholesky(s)
    except np.linalg.LinAlgError:
      return 1e30
    y = np.linalg.solve(ch, d @ x)
    total += 0.5 * np.sum(y * y) + x.shape[1] * np.sum(np.log(np.diag(ch)))
  return float(total)


def fit_axis_group(lines: list[tuple[np.ndarray, np.ndarray]], bias: float,
                   min_white: float = 0.0) -> dict:
  """ML correlation time and white sigma of the error in ``lines`` [(times (n,), fixes
  (n, axes))] for a bias of stationary sigma ``bias`` (the receiver's absolute accuracy, a
  datasheet figure: second differences cannot see it). The fit pins the bias's diffusion
  rate 2 bias^2 / tau and the white noise, the two things the BA's weights on nearby fixes
  depend on. The white sigma is floored at ``min_white`` (a short track can drive the ML
  estimate to zero, which would make the prior overconfident)."""
  if not bias > 0:
    raise ValueError(f"GPS absolute accuracy (bias sigma) must be > 0 m, got {bias!r}")
  series = [(second_difference_operator(t), np.asarray(t, float), np.asarray(x, float)
             .reshape(len(t), -1)) for t, x in lines if len(t) >= 3]
  if not series:
    raise ValueError("no flight line has >= 3 GPS fixes: cannot estimate the GPS error model")
  # start: white noise from the lag-1 second differences (sum of squared weights 2a^2 + 2c^2
  # + 2ac ~ 6 / dt^2 at even spacing), tau from the survey's time scale
  d2 = np.concatenate([((d @ x) / np.sqrt((d ** 2).sum(1))[:, None]).ravel()
                       for d, _, x in series])
  w0 = max(float(np.std(d2)), 1e-3)
  r = optimize.minimize(_nll, np.log([60.0, w0]), args=(series, bias), method="Nelder-Mead",
                        options={"xatol": 1e-3, "fatol": 1e-4, "maxiter": 400})
  tau, white = np.exp(r.x)
  tau = float(np.clip(tau, *TAU_RANGE_S))
  return {"bias": float(bias), "tau_s": tau, "white": float(max(white, min_white)),
          "white_ml": float(white),
          "diffusion_m2_per_s": float(2 * bias ** 2 / tau),
          "samples": int(sum(x.size - 2 * x.shape[1] for _, _, x in series)),
          "nll": float(r.fun)}


def estimate(tags: list[dict], abs_sigma: float, alt_abs_sigma: float,
             min_white: float = 0.0) -> dict:
  """The receiver error model from tags (``time_s``, ``line``, ``gps``): per flight line the
  fixes in time order; horizontal (east, north) pooled, vertical apart; the absolute
  accuracies (bias sigmas, horizontal per axis and vertical) are datasheet figures.
  Returns ``{"horizontal": {...}, "vertical": {...}, "lines": n, "method": ...}``."""
  by_line: dict = {}
  for t in tags:
    if t.get("gps") is not None:
      by_line.setdefault(t["line"], []).append((float(t["time_s"]), t["gps"]))
  lines = []
  for v in by_line.values():
    v.sort(key=lambda p: p[0])
    lines.append((np.array([p[0] for p in v]), np.array([p[1] for p in v], float)))
  hor = fit_axis_group([(t, x[:, :2]) for t, x in lines], abs_sigma, min_white)
  ver = fit_axis_group([(t, x[:, 2:]) for t, x in lines], alt_abs_sigma, min_white)
  return {"horizontal": hor, "vertical": ver, "lines": len(lines),
          "method": "maximum likelihood of per-line second differences of the GPS fixes "
                    "(constant-velocity lines) under a Gauss-Markov bias (absolute sigma "
                    "from the datasheet) + white noise: fitted tau and white sigma"}

"""Runtime-adjustable fixed-point formats for the LSM state (membrane, weights, calcium).

Each quantity has a power-of-two range R: a b-bit signed word holds multiples of
lsb = R / 2**(b-1) in [-R, R - lsb]. Values are carried as float32 numbers that lie on that
grid, so integer arithmetic is emulated exactly while every intermediate stays below 2**24
lsb (always true for b <= 16 here); for wider words the grid is finer than float32's own
rounding and the result equals the float simulation within rounding. The format is a pytree
of traced scalars, so one compiled simulation serves every precision: precision is
changeable at run time without recompiling, as the FPGA design allows.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

# Power-of-two ranges (hardware integer bits): membrane and calcium in [-64, 64),
# weights in [-16, 16) so the +-8 input weights are exact in every format.
DEFAULT_RANGES = {"membrane": 64.0, "weight": 16.0, "calcium": 64.0}
MIN_BITS, MAX_BITS = 2, 32


class Quant(NamedTuple):
  """One quantity's grid: ``lsb`` step and ``hi`` range (values clip to [-hi, hi - lsb])."""
  lsb: jnp.ndarray
  hi: jnp.ndarray


class Format(NamedTuple):
  """Fixed-point format of the whole simulation; ``enabled`` = 0 means plain float."""
  enabled: jnp.ndarray
  membrane: Quant
  weight: Quant
  calcium: Quant


def _quant(bits: int, rng: float) -> Quant:
  """Grid for a ``bits``-bit signed word covering [-rng, rng)."""
  return Quant(lsb=jnp.float32(rng / 2.0 ** (bits - 1)), hi=jnp.float32(rng))


def _check_bits(name: str, bits: int) -> None:
  if not isinstance(bits, int) or isinstance(bits, bool) or not MIN_BITS <= bits <= MAX_BITS:
    raise ValueError(f"{name} bits = {bits!r} is not allowed: an integer in "
                     f"[{MIN_BITS}, {MAX_BITS}]")


def make_format(membrane_bits: int | None = None, weight_bits: int | None = None,
                calcium_bits: int | None = None, ranges: dict | None = None) -> Format:
  """Fixed-point format with the given word widths; all ``None`` means float simulation.

  Giving only ``membrane_bits`` uses it for all three quantities.
  """
  ranges = dict(DEFAULT_RANGES, **(ranges or {}))
  if membrane_bits is None:
    if weight_bits is not None or calcium_bits is not None:
      raise ValueError("membrane_bits is None (float) but weight_bits/calcium_bits were "
                       "given: give all widths or none")
    return Format(enabled=jnp.float32(0.0), membrane=_quant(16, ranges["membrane"]),
                  weight=_quant(16, ranges["weight"]), calcium=_quant(16, ranges["calcium"]))
  weight_bits = membrane_bits if weight_bits is None else weight_bits
  calcium_bits = membrane_bits if calcium_bits is None else calcium_bits
  for name, b in (("membrane", membrane_bits), ("weight", weight_bits),
                  ("calcium", calcium_bits)):
    _check_bits(name, b)
  return Format(enabled=jnp.float32(1.0), membrane=_quant(membrane_bits, ranges["membrane"]),
                weight=_quant(weight_bits, ranges["weight"]),
                calcium=_quant(calcium_bits, ranges["calcium"]))


def quantize(x: jnp.ndarray, q: Quant, enabled: jnp.ndarray,
             nearest: bool = False) -> jnp.ndarray:
  """Put ``x`` on the grid (truncate, or round to nearest) and saturate; identity if disabled."""
  k = jnp.round(x / q.lsb) if nearest else jnp.floor(x / q.lsb)
  y = jnp.clip(k * q.lsb, -q.hi, q.hi - q.lsb)
  return jnp.where(enabled > 0, y, x)


def leak(x: jnp.ndarray, shift: int, q: Quant, enabled: jnp.ndarray,
         nearest: bool = False) -> jnp.ndarray:
  """One leak step x - x / 2**shift (a right shift in hardware).

  In fixed point the decrement is rounded away from zero (at least one lsb), so an idle
  state decays to exactly zero in finite time: that is what lets activity gating switch a
  quiet unit off. ``nearest`` rounds the decrement to the nearest lsb instead (unbiased;
  used for the readout calcium, whose bands a biased decay would shift at low widths). In
  float it is the exact product.
  """
  d = x * (2.0 ** -shift)
  if nearest:
    d_fixed = jnp.round(d / q.lsb) * q.lsb
  else:
    d_fixed = jnp.sign(x) * jnp.ceil(jnp.abs(d) / q.lsb) * q.lsb
  return x - jnp.where(enabled > 0, d_fixed, d)

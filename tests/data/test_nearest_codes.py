"""nearest_codes (the workers' k-means codes): the nearest codeword, in bounded memory."""

import tracemalloc

import numpy as np

from omni_jax.data import vq
from omni_jax.data.documents import nearest_codes


def test_nearest_codes_equal_the_brute_force_nearest_codeword():
  rng = np.random.default_rng(0)
  book = rng.normal(size=(37, 6)).astype(np.float32)
  x = rng.normal(size=(5, 41, 6)).astype(np.float32)
  d2 = ((x[..., None, :].astype(np.float64) - book.astype(np.float64)) ** 2).sum(-1)
  for max_bytes in (4, 4 * 37 * 7, 1 << 24):  # one row per block, 7 rows, everything at once
    got = nearest_codes(book, x, max_bytes)
    assert got.shape == (5, 41) and got.dtype == np.int32
    picked = np.take_along_axis(d2, got[..., None], -1)[..., 0]
    np.testing.assert_allclose(picked, d2.min(-1), rtol=1e-5, atol=1e-6)
    assert (got == d2.argmin(-1)).mean() == 1.0  # no near-ties in this draw
  # The same codes as the JAX quantizer of the synthetic stream (same distance form).
  np.testing.assert_array_equal(nearest_codes(book, x, 4 * 37 * 7),
                                np.asarray(vq.quantize(book, x)))
  # A codeword itself maps to its own index.
  np.testing.assert_array_equal(nearest_codes(book, book), np.arange(37))


def test_nearest_codes_memory_is_bounded_by_its_block():
  """4096 codes x 64 dims x 1000 vectors: the broadcast form needed 1 GB; blocks of 1 MB
  keep the peak of new allocations to a few blocks plus the output."""
  rng = np.random.default_rng(1)
  book = rng.normal(size=(4096, 64)).astype(np.float32)
  x = rng.normal(size=(1000, 64)).astype(np.float32)
  tracemalloc.start()
  try:
    nearest_codes(book, x[:10], 1 << 20)  # warm-up: numpy's one-time allocations
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    got = nearest_codes(book, x, 1 << 20)
    peak = tracemalloc.get_traced_memory()[1] - base
  finally:
    tracemalloc.stop()
  assert peak < 4 * (1 << 20) + book.nbytes + got.nbytes, peak
  some = rng.choice(1000, 8, replace=False)
  d2 = ((x[some, None, :] - book[None]) ** 2).sum(-1)
  np.testing.assert_allclose(d2[np.arange(8), got[some]], d2.min(-1), rtol=1e-4)

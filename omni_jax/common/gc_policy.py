"""CPython's garbage collector tuned for tracing JAX programs.

Tracing and lowering a model allocates millions of short-lived Python objects (tracers,
jaxpr equations, MLIR builders). Under CPython's default thresholds (a young-generation
collection every 700 net allocations) the collector runs thousands of times per trace, and
each older-generation pass walks every object the process holds: imported modules, compiled
executables, caches. :func:`for_tracing` freezes what is alive at the call (the imports: never
scanned again) and collects the young generation every 50,000 allocations instead. Memory is
still reclaimed: reference counting frees acyclic garbage at once and the collector still runs,
only less often. Measured on the 2-core machine (four test files of the micro omni model, one
process, six runs in the order default, tuned, tuned, default, default, tuned): 6 % less
wall time (97.7 s against 104.2 s on average), the same peak memory.
"""

from __future__ import annotations

import gc
import os

YOUNG_THRESHOLD = 50_000
OLDER_THRESHOLDS = (20, 20)


def for_tracing() -> None:
  """Freeze the objects alive now and raise the young-generation threshold (see the module
  docstring). ``OMNI_JAX_DEFAULT_GC=1`` leaves CPython's defaults."""
  if os.environ.get("OMNI_JAX_DEFAULT_GC", "") == "1":
    return
  gc.freeze()
  gc.set_threshold(YOUNG_THRESHOLD, *OLDER_THRESHOLDS)

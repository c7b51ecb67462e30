"""Result files: atomic JSON writes that anyone can read, with arrays and NaN made JSON-safe."""

from __future__ import annotations

import json
import os
import stat

import numpy as np

from omni_jax.train.metrics import write_json_atomic


def test_write_json_atomic_is_readable_sorted_and_leaves_no_temporaries(tmp_path):
  path = tmp_path / "sub" / "summary.json"
  write_json_atomic(str(path), {"b": np.float32(0.5), "a": np.arange(3), "c": float("nan")})
  assert json.loads(path.read_text()) == {"a": [0, 1, 2], "b": 0.5, "c": "nan"}
  assert list(json.loads(path.read_text())) == ["a", "b", "c"]
  # Group and others can read the result (mkstemp alone would leave it owner-only).
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
  write_json_atomic(str(path), {"a": 1})       # replacing keeps no temporary behind
  assert os.listdir(path.parent) == ["summary.json"]

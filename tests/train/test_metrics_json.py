"""Result files: atomic JSON writes that anyone can read, with arrays and NaN made JSON-safe."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest

from omni_jax.common.metrics import atomic_path, write_json_atomic


def test_write_json_atomic_is_readable_sorted_and_leaves_no_temporaries(tmp_path):
  path = tmp_path / "sub" / "summary.json"
  write_json_atomic(str(path), {"b": np.float32(0.5), "a": np.arange(3), "c": float("nan")})
  assert json.loads(path.read_text()) == {"a": [0, 1, 2], "b": 0.5, "c": "nan"}
  assert list(json.loads(path.read_text())) == ["a", "b", "c"]
  # Group and others can read the result (mkstemp alone would leave it owner-only).
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
  write_json_atomic(str(path), {"a": 1})       # replacing keeps no temporary behind
  assert os.listdir(path.parent) == ["summary.json"]


def test_atomic_path_keeps_the_extension_and_removes_the_temporary_on_error(tmp_path):
  target = tmp_path / "cache.npz"
  with atomic_path(str(target)) as tmp:
    assert tmp.endswith(".npz") and os.path.dirname(tmp) == str(tmp_path)
    np.savez(tmp, x=np.arange(4))
  np.testing.assert_array_equal(np.load(target)["x"], np.arange(4))
  with pytest.raises(RuntimeError, match="boom"):
    with atomic_path(str(tmp_path / "a.wav"), suffix=".wav.tmp") as tmp:
      assert tmp.endswith(".wav.tmp")
      open(tmp, "w").write("half")
      raise RuntimeError("boom")
  assert sorted(os.listdir(tmp_path)) == ["cache.npz"]   # nothing half-written is left

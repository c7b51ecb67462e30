"""A run without an optional peer names it and the command that installs it."""

from __future__ import annotations

import sys

import numpy as np

from omni_jax.common import peers


def test_missing_faiss_is_named_with_the_install_command(monkeypatch):
  from omni_jax.query import study as query
  monkeypatch.setitem(sys.modules, "faiss", None)           # `import faiss` -> ImportError
  ms, note, rec = query.time_faiss(None, np.zeros((4, 8), np.float32), None, None)
  assert ms is None and rec is None
  assert note.startswith("peer faiss-cpu is not installed")
  assert note.endswith("Install the peers with: pip install -e '.[peers]'")


def test_missing_pycolmap_is_named_with_the_install_command(monkeypatch, tmp_path):
  from omni_jax.visage import colmap_ref
  monkeypatch.setitem(sys.modules, "pycolmap", None)
  r = colmap_ref.run_reference(tmp_path, [], tmp_path, 100.0)
  assert r["available"] is False and r["missing_peer"] == "pycolmap"
  assert r["install"] == peers.INSTALL == "pip install -e '.[peers]'"
  assert "no COLMAP reference" in r["reason"] and not (tmp_path / "colmap_ref").exists()

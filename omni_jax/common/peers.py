"""Optional peers: other projects' implementations some runs compare against (faiss for
experiments.query, pycolmap for experiments.visage). They are one extra away:
``pip install -e '.[peers]'`` (Brian2, for experiments.lsm, needs numpy < 2.3 and so its own
interpreter: a venv experiments.lsm creates, omni_jax/lsm/brian2_env.py). A run without one
says so in its log and summary (which peer, and that command) instead of recording a bare null.
"""

from __future__ import annotations

from absl import logging

INSTALL = "pip install -e '.[peers]'"


def missing(peer: str, error: BaseException | str, left_out: str) -> dict[str, str]:
  """Logs a warning and returns the summary record for a peer that could not be imported:
  ``{"missing_peer", "install", "reason"}``; ``left_out`` says what the run goes without."""
  reason = (f"peer {peer} is not installed ({error}): {left_out}. Install the peers with: "
            f"{INSTALL}")
  logging.warning("%s", reason)
  return {"missing_peer": peer, "install": INSTALL, "reason": reason}

"""A checkpoint saved under one mesh layout resumes under another (fsdp=8 -> expert=2 x
fsdp=4) and ends where a straight run ends (its own file, so the suite's workers run it beside
tests/train/test_train_omni.py's other end-to-end runs)."""

import shutil

import pytest

from configs.omni_moe import get_config
from omni_jax.train.omni import train_omni


def test_checkpoint_restores_under_another_layout(tmp_path):
  cfg = get_config("micro")
  for name in ("audio", "video"):   # the image encoder stays: the promise at its least compile
    del cfg.model.modalities[name]
  cfg.mesh.update(data=1, fsdp=8)
  straight = train_omni(cfg, str(tmp_path / "straight"))
  # The straight run's step-2 checkpoint alone in a new workdir: what a run stopped after
  # step 2 leaves (stopping and resuming under one layout: tests/train/test_train_omni.py).
  shutil.copytree(tmp_path / "straight" / "checkpoints" / "2",
                  tmp_path / "moved" / "checkpoints" / "2")
  cfg.mesh.update(fsdp=4, expert=2)  # saved under fsdp=8, restored under expert=2 x fsdp=4
  moved = train_omni(cfg, str(tmp_path / "moved"))
  assert moved["resumed_from_step"] == 2
  assert moved["final_loss"] == pytest.approx(straight["final_loss"], rel=1e-5)

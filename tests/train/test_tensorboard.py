"""TensorBoard events beside metrics.jsonl: scalars per record, figures as images, the run's
config as text; written by the shared MetricsLog / save_figure and read back from the files."""

from __future__ import annotations

import json

import ml_collections
import numpy as np
import pytest
from PIL import Image

from omni_jax.common import tensorboard
from omni_jax.common.figures import pyplot, save_figure
from omni_jax.common.metrics import MetricsLog

plt = pyplot()


@pytest.fixture(autouse=True)
def _fresh_writers(monkeypatch):
  monkeypatch.delenv(tensorboard.ENV_DISABLE, raising=False)
  tensorboard.close_all()
  yield
  tensorboard.close_all()
  tensorboard.set_run_config(None)


def test_records_figures_and_config_are_read_back(tmp_path):
  cfg = ml_collections.ConfigDict({"model": {"width": 64}, "train": {"steps": 3, "lr": 0.5}})
  tensorboard.set_run_config(cfg)
  log = MetricsLog(str(tmp_path / "metrics.jsonl"))
  log.write({"step": 1, "loss": np.float32(2.5), "eval": {"acc": 0.25, "image:gen": {"acc": 0.5}},
             "ok": True})
  log.write({"step": 2, "loss": 1.25, "note": "warm", "tokens": np.int64(3)})
  log.write({"step": 3, "loss": float("nan")})
  fig, ax = plt.subplots(figsize=(2, 1.5), dpi=50)
  ax.plot([0, 1], [1, 0])
  save_figure(fig, tmp_path / "loss.png")
  tensorboard.close_all()

  ev = tensorboard.read_events(tmp_path)
  assert ev["loss"][:1] == [(1, 2.5)] and np.isnan(ev["loss"][1][1]) and ev["loss"][1][0] == 3
  assert ev["eval/acc"] == [(1, 0.25)]                  # nested keys joined with "/"
  assert ev["eval/image_gen/acc"] == [(1, 0.5)]         # a character tags may not hold: "_"
  assert ev["warm/loss"] == [(2, 1.25)] and ev["warm/tokens"] == [(2, 3.0)]   # string: series
  assert "ok" not in ev and "step" not in ev            # booleans and the step are no scalars
  (step, img), = ev["figures/loss"]
  assert step == 3                                       # the last step recorded there
  np.testing.assert_array_equal(img, np.asarray(Image.open(tmp_path / "loss.png").convert("RGB")))
  (_, text), = ev["config"]
  assert json.loads(text.strip().removeprefix("```").removesuffix("```")) == cfg.to_dict()
  # metrics.jsonl is unchanged by all this
  assert [r["step"] for r in log.read()] == [1, 2, 3]


def test_resume_purges_later_steps_and_non_images_are_refused(tmp_path):
  from tensorboardX.proto import event_pb2
  log = MetricsLog(str(tmp_path / "metrics.jsonl"))
  for step in (1, 2, 3):
    log.write({"step": step, "loss": float(step)})
  MetricsLog(str(tmp_path / "metrics.jsonl"), resume_step=1)   # a run restarting at step 2
  tensorboard.close_all()   # (the first run's writer was closed when the second one opened)
  newest = max(tmp_path.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime_ns)
  starts = [e.step for e in map(event_pb2.Event.FromString, tensorboard._records(str(newest)))
            if e.HasField("session_log") and e.session_log.status == e.session_log.START]
  assert starts == [2]      # TensorBoard hides the old run's events from step 2 on
  with pytest.raises(ValueError, match="TensorBoard images are"):
    tensorboard.add_figure_file(tmp_path / "plot.pdf")

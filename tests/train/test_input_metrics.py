"""The train loop's input metrics: the wait for each batch and the records read per second."""

import json
import os

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from omni_jax.train import loop as loop_lib


class CountingIterator(grain.DatasetIterator):
  """A stand-in input iterator: every batch reads ``per_batch`` records."""

  def __init__(self, per_batch: int):
    super().__init__()
    self.per_batch, self.records_read = per_batch, 0

  def __next__(self):
    self.records_read += self.per_batch
    return {"x": np.full(2, float(self.records_read))}

  def get_state(self):
    return {"records_read": self.records_read}

  def set_state(self, state):
    self.records_read = state["records_read"]


def test_input_meter_windows_and_totals_are_exact():
  it = CountingIterator(3)
  meter = loop_lib.InputMeter(it)
  meter.start()
  for _ in range(4):
    next(it)
  meter.wait = 0.5
  assert meter.window(2.0) == {"input_wait_fraction": 0.25, "records_per_sec": 6.0}
  next(it)
  meter.wait = 0.1
  assert meter.window(1.0) == pytest.approx({"input_wait_fraction": 0.1, "records_per_sec": 3})
  assert meter.summary(3.0) == pytest.approx({"input_wait_fraction": 0.6 / 3,
                                              "records_per_sec": 15 / 3})
  assert meter.summary(0.0) == {"input_wait_fraction": None, "records_per_sec": None}
  # An iterator without a record count (the synthetic stream): the wait only.
  bare = loop_lib.InputMeter(None)
  bare.start()
  bare.wait = 0.2
  assert bare.window(1.0) == {"input_wait_fraction": 0.2}
  assert bare.summary(1.0) == {"input_wait_fraction": 0.2, "records_per_sec": None}


def test_fit_records_input_wait_and_records_per_sec(tmp_path):
  """Every timed window of metrics.jsonl has both keys; its batches read 3 records each, so
  its records/s is exactly 3 per step time; the run's figures come back in FitResult."""
  loop = loop_lib.LoopConfig(steps=7, seed=0, log_every=2, eval_every=0, eval_batches=1,
                             checkpoint_every=100, keep_checkpoints=1, peak_flops=1.0)
  it = CountingIterator(3)

  def loss_fn(params, batch):
    loss = jnp.sum((params["w"] - batch["x"]) ** 2)
    return loss, {"loss": loss}
  result = loop_lib.fit(workdir=str(tmp_path), loop=loop,
                        init_params=lambda k: {"w": jnp.zeros(2)}, loss_fn=loss_fn,
                        tx=optax.sgd(1e-3), get_batch=lambda s: next(it), put_batch=lambda b: b,
                        param_sharding=lambda t: jax.tree.map(lambda _: None, t), data_iter=it)
  recs = [json.loads(x) for x in open(os.path.join(tmp_path, "metrics.jsonl"))]
  timed = [r for r in recs if "step_time_s" in r]
  assert [r["step"] for r in timed] == [2, 4, 6, 7]
  for r in timed:
    assert 0 < r["input_wait_fraction"] < 1
    assert r["records_per_sec"] == pytest.approx(3 / r["step_time_s"])
  assert 0 < result.input["input_wait_fraction"] < 1
  assert result.input["records_per_sec"] == pytest.approx(3 / result.mean_step_time)
  assert it.records_read == 21  # one batch per step, none fetched twice

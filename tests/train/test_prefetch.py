"""Batches made ahead of the step: how far ahead, in which order, which input state a
checkpoint keeps, and errors."""

import json
import threading
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from omni_jax.train import loop as loop_lib
from omni_jax.train.prefetch import BatchPrefetcher

IDLE = 30.0  # seconds a test waits for the producer thread to go idle before failing


class Recorder:
  """``produce``: records the steps asked for."""

  def __init__(self):
    self.made = []

  def __call__(self, step):
    self.made.append(step)
    return {"x": step}


@pytest.mark.parametrize("depth", [1, 3])
def test_the_producer_stays_depth_batches_ahead_and_no_further(depth):
  rec = Recorder()
  feed = BatchPrefetcher(rec, first=1, last=10, depth=depth, snapshot=lambda s: 100 + s)
  try:
    assert feed.wait_idle(IDLE)
    assert rec.made == list(range(1, depth + 1)) and feed.ahead() == depth  # nothing taken yet
    for step in range(1, 8):
      assert feed.get(step) == ({"x": step}, 100 + step)
      assert feed.wait_idle(IDLE)
      want = min(step + depth, 10)
      assert rec.made == list(range(1, want + 1)), step  # made once each, in order
      assert feed.ahead() == want - step
  finally:
    feed.close()


def test_read_host_depth_ahead_and_place_only_depth_ahead():
  """Batches are read up to host_depth steps ahead but placed (device memory) only depth
  steps ahead; each is read once and placed once, in order."""
  rec, placed = Recorder(), []

  def place(batch):
    placed.append(batch["x"])
    return {"on_device": batch["x"]}
  feed = BatchPrefetcher(rec, first=1, last=12, depth=2, snapshot=lambda s: 100 + s,
                         place=place, host_depth=5)
  try:
    assert feed.wait_idle(IDLE)
    assert rec.made == [1, 2, 3, 4, 5] and placed == [1, 2] and feed.ahead() == 5
    for step in range(1, 9):
      assert feed.get(step) == ({"on_device": step}, 100 + step)
      assert feed.wait_idle(IDLE)
      assert rec.made == list(range(1, min(step + 5, 12) + 1)), step
      assert placed == list(range(1, min(step + 2, 12) + 1)), step
  finally:
    feed.close()


@pytest.mark.parametrize("depth", [0, 2])
def test_a_long_read_does_not_hold_up_the_placement_of_batches_already_read(depth):
  """While the reading thread is inside a long read (a packing window), the batches it read
  before are placed and served: by the placing thread (depth > 0) or by the caller (0)."""
  gate, started = threading.Event(), threading.Event()

  def read(step):
    if step == 3:
      started.set()
      assert gate.wait(IDLE)
    return step
  where = {}

  def place(batch):
    where[batch] = threading.current_thread().name
    return -batch
  feed = BatchPrefetcher(read, 1, 4, depth=depth, place=place, host_depth=3)
  try:
    assert started.wait(IDLE)  # batches 1, 2 read; the reading thread is inside read(3)
    assert feed.get(1)[0] == -1 and feed.get(2)[0] == -2
    placer = "batch-place" if depth else threading.current_thread().name
    assert where == {1: placer, 2: placer}
    gate.set()
    assert feed.get(3)[0] == -3 and feed.get(4)[0] == -4
  finally:
    gate.set()
    feed.close()


def test_depth_zero_makes_each_batch_when_asked_in_the_callers_thread():
  where = []
  feed = BatchPrefetcher(lambda s: where.append(threading.get_ident()) or s, 1, 3, 0)
  assert where == []
  assert [feed.get(s)[0] for s in (1, 2, 3)] == [1, 2, 3]
  assert where == [threading.get_ident()] * 3
  feed.close()


def test_out_of_order_and_past_the_end_are_refused():
  feed = BatchPrefetcher(lambda s: s, 5, 6, 2)
  try:
    with pytest.raises(ValueError, match="asked for step 6, next is 5"):
      feed.get(6)
    feed.get(5)
    feed.get(6)
    with pytest.raises(ValueError, match="asked for step 7"):
      feed.get(7)
  finally:
    feed.close()


def test_an_input_error_reaches_the_loop_at_its_step():
  class Ran(RuntimeError):
    pass

  def produce(step):
    if step == 3:
      raise Ran("records ran out")
    return step
  feed = BatchPrefetcher(produce, 1, 5, 4)
  try:
    assert feed.get(1)[0] == 1 and feed.get(2)[0] == 2  # made before the error: still served
    with pytest.raises(Ran, match="records ran out"):
      feed.get(3)
  finally:
    feed.close()


def read_fails_while_placing(fail_at: int, hold: int, last: int, depth: int,
                             host_depth: int) -> BatchPrefetcher:
  """A prefetcher whose read of step ``fail_at`` raises while the placement of step ``hold``
  is held until that failure is recorded."""
  def produce(step):
    if step == fail_at:
      raise RuntimeError("records ran out")
    return step

  feed = None

  def place(batch):
    if batch == hold:
      while feed is None or feed.error is None:
        time.sleep(0.001)
    return batch
  feed = BatchPrefetcher(produce, 1, last, depth, place=place, host_depth=host_depth)
  return feed


def test_batches_read_before_a_failed_read_are_still_placed():
  """The placing thread goes on after the reading thread failed: a placement that outlasts
  the failure, and batches read beyond the placement depth, are all served before the
  error."""
  feed = read_fails_while_placing(fail_at=6, hold=1, last=8, depth=1, host_depth=8)
  try:
    for step in range(1, 6):
      assert feed.wait_idle(10)
      assert step in feed.ready, f"step {step} was read before the failure but not placed"
      assert feed.get(step)[0] == step
    with pytest.raises(RuntimeError, match="records ran out"):
      feed.get(6)
  finally:
    feed.close()


def test_a_batch_being_placed_when_the_read_fails_is_served():
  """The read error is not raised at a step whose batch was read and is still being placed
  (the loop would stop a step early, before that step's checkpoint)."""
  feed = read_fails_while_placing(fail_at=3, hold=2, last=5, depth=2, host_depth=4)
  try:
    assert feed.get(1)[0] == 1 and feed.get(2)[0] == 2
    with pytest.raises(RuntimeError, match="records ran out"):
      feed.get(3)
  finally:
    feed.close()


class CountingIterator(grain.DatasetIterator):
  """A stand-in input iterator whose state is the number of batches it made."""

  def __init__(self):
    super().__init__()
    self.records_read = 0

  def __next__(self):
    self.records_read += 1
    return {"x": np.full(2, float(self.records_read))}

  def get_state(self):
    return {"records_read": self.records_read}

  def set_state(self, state):
    self.records_read = state["records_read"]


def _fit(workdir, steps, it, prefetch, seen):
  loop = loop_lib.LoopConfig(steps=steps, seed=0, log_every=2, eval_every=0, eval_batches=1,
                             checkpoint_every=3, keep_checkpoints=5, peak_flops=1.0)

  def loss_fn(params, batch):
    loss = jnp.sum((params["w"] - batch["x"]) ** 2)
    return loss, {"loss": loss}

  def get_batch(step):
    seen.append(step)
    return next(it)
  return loop_lib.fit(workdir=str(workdir), loop=loop, init_params=lambda k: {"w": jnp.zeros(2)},
                      loss_fn=loss_fn, tx=optax.sgd(0.1), get_batch=get_batch,
                      put_batch=lambda b: b, data_iter=it, prefetch=prefetch,
                      param_sharding=lambda t: jax.tree.map(lambda _: None, t))


def test_a_checkpoint_keeps_the_input_state_of_the_last_batch_trained_on(tmp_path):
  """With batches made 4 ahead the iterator has read past the step; the checkpoint at step 3
  holds the state after batch 3, and resuming from it trains on exactly the straight run's
  batches (the same final weights as a run without prefetch)."""
  seen = []
  straight = _fit(tmp_path / "straight", 7, CountingIterator(), 0, seen)
  assert seen == list(range(7))
  seen = []
  it = CountingIterator()
  _fit(tmp_path / "ahead", 4, it, 4, seen)
  assert seen == list(range(4))  # never made beyond the last step
  saved = [json.loads((tmp_path / "ahead" / "checkpoints" / str(s) / "data" /
                       "process_0-of-1.json").read_text())
           for s in (3, 4)]
  assert saved == [{"records_read": 3}, {"records_read": 4}]
  seen = []
  it = CountingIterator()
  resumed = _fit(tmp_path / "ahead", 7, it, 4, seen)
  assert resumed.resumed_from == 4 and seen == [4, 5, 6]
  np.testing.assert_array_equal(np.asarray(resumed.state.params["w"]),
                                np.asarray(straight.state.params["w"]))
  assert resumed.input["records_per_sec"] == pytest.approx(1 / resumed.mean_step_time)


def test_device_prefetch_is_validated():
  from omni_jax.common.config import ConfigError
  from omni_jax.data.pipeline import pipeline_options
  assert pipeline_options({})["device_prefetch"] == 2
  assert pipeline_options({})["read_ahead"] == 8
  with pytest.raises(ConfigError, match="data.device_prefetch"):
    pipeline_options({"device_prefetch": -1})
  with pytest.raises(ConfigError, match="data.read_ahead"):
    pipeline_options({"read_ahead": 1.5})


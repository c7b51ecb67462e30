"""The reader asks for the next packing window while the current one is used: the window
after it is read in the background, with the iterator's state from just before it."""

import threading

import pytest

from omni_jax.data.reader import WindowAhead
from omni_jax.data.stream import make_stream
from omni_jax.train.spec import build_spec
from tests.data.test_input_pipeline import text_config, write_lines


class Windows:
  """A stand-in for a Grain iterator of ``n`` windows; window ``k`` is ``[k]``."""

  def __init__(self, n, fail_at=None):
    self.i, self.n, self.fail_at = 0, n, fail_at

  def get_state(self):
    return {"i": self.i}

  def set_state(self, state):
    self.i = state["i"]

  def __next__(self):
    if self.i == self.fail_at:
      raise RuntimeError(f"worker died at window {self.i}")
    if self.i >= self.n:
      raise StopIteration
    self.i += 1
    return [self.i - 1]


def test_the_next_window_is_read_while_the_current_one_is_used():
  it = Windows(3)
  ahead = WindowAhead(it)
  assert ahead.take() == ({"i": 0}, [0])
  ahead.wait()
  assert it.i == 2 and ahead.pulled == 2  # window 1 already read, window 0 in use
  assert ahead.take() == ({"i": 1}, [1])
  assert ahead.take() == ({"i": 2}, [2])
  assert ahead.take() == ({"i": 3}, None)  # the end: no further read started
  assert ahead.pulled == 4
  ahead.drop()  # a restore: the window read ahead is forgotten, the state set
  it.set_state({"i": 1})
  assert ahead.take() == ({"i": 1}, [1])
  ahead.drop()


def test_an_error_reading_ahead_is_raised_when_that_window_is_taken():
  ahead = WindowAhead(Windows(5, fail_at=1))
  assert ahead.take() == ({"i": 0}, [0])  # window 1 fails in the background ...
  with pytest.raises(RuntimeError, match="worker died at window 1"):
    ahead.take()  # ... and is raised when it is needed


def test_the_reader_has_the_next_window_before_the_current_one_runs_out(tmp_path):
  m = write_lines(tmp_path / "m.jsonl", [{"id": i, "text": f"t{i}"} for i in range(200)])
  cfg = text_config(m, pack_window=16, prefetch=0)
  s = make_stream(build_spec(cfg.model), cfg.data)
  s.bind()
  s.batch(0)
  reader = s.iterator.readers[0]
  reader.ahead.wait()
  windows = reader.read // 16  # the windows batch 0 took (counted)
  assert windows >= 1 and reader.read == 16 * windows
  assert reader.ahead.pulled == windows + 1  # and the next one, already read
  s.iterator.close()


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_shard_read_from_several_threads_gives_each_its_record(tmp_path, fmt):
  """The shards of one process read from their own threads (and the eval split from the
  main one) share a dataset's readers: concurrent reads each get their own record."""
  from omni_jax.data.convert import convert
  from omni_jax.data.records import open_dataset
  m = write_lines(tmp_path / "m.jsonl", [{"id": i, "text": "x" * (i % 97)} for i in range(400)])
  if fmt != "jsonl":
    convert(m, tmp_path / "d", fmt, shards=1)
  ds = open_dataset(m if fmt == "jsonl" else tmp_path / "d", 0.0)
  want = [ds.item(i).payload for i in range(len(ds))]
  got, errors = {}, []

  def read(k):
    try:
      for j in range(1200):
        i = (k * 7919 + j * 13) % len(ds)
        got[(k, j)] = (i, ds.item(i).payload)
    except Exception as e:  # noqa: BLE001  (reported below)
      errors.append(e)
  threads = [threading.Thread(target=read, args=(k,)) for k in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors
  assert all(payload == want[i] for i, payload in got.values())

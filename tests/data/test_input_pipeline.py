"""The Grain input pipeline: lazy records, id-hash split, packing, shards, resume, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
from absl import flags
from PIL import Image

from configs.omni_moe import get_config
from omni_jax.common import batched_rng
from omni_jax.data import packing
from omni_jax.data.pipeline import DataError, PipelineStream
from omni_jax.data.records import is_eval, open_dataset, record_id
from omni_jax.data.stream import DATA_KEYS, make_stream
from omni_jax.train.spec import build_spec


def text_config(manifest, **data):
  """The micro config on a text-only model (no codebooks to fit: fast)."""
  cfg = get_config("micro")
  cfg.model.modalities = dict(
      image=dict(kind="patch", size=(16, 16), channels=3, patch=8, codebook_size=0,
                 encoder_dim=16, encoder_layers=1, encoder_heads=2))
  cfg.data.update(source="manifest", manifest=str(manifest), on_error="skip", **data)
  return cfg


def write_lines(path, lines):
  path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
  return path


def texts_of(spec, batch):
  """The text of every document of a packed batch (bytes between <bos> and <eos>)."""
  tok = spec.tokenizer
  out = []
  for tokens, seg in zip(batch["tokens"], batch["segment_ids"], strict=True):
    for k in range(1, seg.max() + 1):
      ids = tokens[seg == k]
      out.append(tok.decode(ids[ids < tok.vocab_size]))  # codes of generate documents dropped
  return out


def test_index_is_lazy_and_split_follows_the_id(tmp_path):
  m = write_lines(tmp_path / "m.jsonl", [{"id": i, "text": f"t{i}"} for i in range(200)]
                  + ["", "   "] + [{"text": "no id"}])
  index = open_dataset(m, eval_fraction=0.25)
  assert len(index) == 201 and index.lines[0][-1] == 203
  train, ev = index.split("train"), index.split("eval")
  assert len(train) + len(ev) == 201
  assert 30 < len(ev) < 70  # ~ 0.25 of 201
  item = ev[0]
  lineno = int(item.where.rsplit(":", 1)[1])
  assert json.loads(item.payload)["text"] == f"t{lineno - 1}"
  # The split is a function of the id, not of the line's place or its other keys.
  for i in range(200):
    assert index.eval_mask[i] == is_eval(record_id(json.dumps({"text": "x", "id": i}).encode()),
                                         0.25)
  assert record_id(b'{"text": "a"}\n') == b'{"text": "a"}'
  with pytest.raises(FileNotFoundError, match="nope.jsonl"):
    open_dataset(tmp_path / "nope.jsonl", 0.1)


def doc(n, slots=(), task=0):
  toks = np.arange(10, 10 + n, dtype=np.int32)
  heads = np.ones(n, np.int32)
  heads[-1] = 0
  return packing.Doc(toks, toks + 1, heads, {m: np.arange(1, 5, dtype=np.int32) for m in slots},
                     {m: np.full((16, 16, 3), n, np.float32) for m in slots}, task)


def best_fit_reference(docs, seq_len, slots):
  """Plain best-fit decreasing: every document compared with every open row."""
  rows, room, used = [], [], []
  for i in sorted(range(len(docs)), key=lambda i: (-len(docs[i]), i)):
    d, best, best_room = docs[i], -1, seq_len + 1
    for r in range(len(rows)):
      if len(d) <= room[r] < best_room and all(used[r].get(m, 0) < slots for m in d.slots):
        best, best_room = r, room[r]
    if best < 0:
      rows.append([]), room.append(seq_len), used.append({})
    rows[best].append(d)
    room[best] -= len(d)
    for m in d.slots:
      used[best][m] = used[best].get(m, 0) + 1
  return rows


@pytest.mark.parametrize("slots", [1, 2])
def test_bucketed_packing_equals_plain_best_fit(slots):
  rng = np.random.default_rng(slots)
  kinds = [(), ("image",), ("audio",), ("image", "audio")]
  docs = [doc(int(rng.integers(1, 97)), kinds[int(rng.integers(4))]) for _ in range(400)]
  got = packing.pack(docs, 128, slots)
  want = best_fit_reference(docs, 128, slots)
  assert [[id(d) for d in r] for r in got] == [[id(d) for d in r] for r in want]
  assert len(got) < 0.6 * len(docs)  # rows hold ~2 documents: real packing happened


def test_packing_layout_and_one_slot_per_modality(tmp_path):
  spec = build_spec(text_config(tmp_path / "x").model)
  docs = [doc(20, ["image"], 1), doc(20, ["image"], 1), doc(10), doc(6), doc(18)]
  rows = packing.pack(docs, 48)
  for row in rows:
    assert sum(len(d) for d in row) <= 48
    assert sum("image" in d.slots for d in row) <= 1
  assert sorted(len(d) for r in rows for d in r) == [6, 10, 18, 20, 20]
  assert [[len(d) for d in r] for r in rows] == [[20, 18, 10], [20, 6]]  # best fit decreasing
  b = packing.collate_packed(spec, rows, 48)
  for i, row in enumerate(rows):
    at = 0
    for k, d in enumerate(row, start=1):
      sl = slice(at, at + len(d))
      np.testing.assert_array_equal(b["tokens"][i, sl], d.tokens)
      np.testing.assert_array_equal(b["segment_ids"][i, sl], k)
      np.testing.assert_array_equal(b["positions"][i, sl], np.arange(len(d)))
      assert b["target_head"][i, at + len(d) - 1] == 0  # no loss across the boundary
      if "image" in d.slots:
        np.testing.assert_array_equal(b["image_pos"][i], at + d.slots["image"])
        assert b["image_mask"][i] and b["image"][i].max() == len(d)
      at += len(d)
    assert (b["segment_ids"][i, at:] == 0).all() and (b["target_head"][i, at:] == 0).all()
    assert (b["tokens"][i, at:] == spec.tokenizer.pad_id).all()
  assert packing.efficiency(b) == (74, 96)
  with pytest.raises(ValueError, match="does not fit data.seq_len = 16"):
    packing.pack([doc(20)], 16)


def test_two_slots_per_row_pack_tighter_and_each_document_reads_as_alone(tmp_path):
  import jax
  import jax.numpy as jnp

  from omni_jax.models.omni import OmniModel
  spec = build_spec(text_config(tmp_path / "x").model)
  docs = [doc(20, ["image"], 1), doc(18, ["image"], 1), doc(16, ["image"], 1), doc(8)]
  assert len(packing.pack(docs, 48)) == 3  # one slot: every image document opens a row
  rows = packing.pack(docs, 48, slots=2)
  assert [[len(d) for d in r] for r in rows] == [[20, 18, 8], [16]]
  b = packing.collate_packed(spec, rows, 48, slots=2)
  assert b["image"].shape == (2, 2, 16, 16, 3) and b["image_pos"].shape == (2, 2, 4)
  np.testing.assert_array_equal(b["image_mask"], [[True, True], [True, False]])
  np.testing.assert_array_equal(b["image_pos"][0], [np.arange(1, 5), 20 + np.arange(1, 5)])
  assert b["image"][0, 1].max() == 18 and b["image"][1, 0].max() == 16
  with pytest.raises(ValueError, match="more than 2 document.*slots_per_row"):
    packing.collate_packed(spec, [[docs[0], docs[1], docs[2]]], 64, slots=2)
  with pytest.raises(ValueError, match="slots per row must be >= 1"):
    packing.pack(docs, 48, slots=0)
  # Against each document alone in its own one-slot row: the same logits at its tokens.
  alone = packing.collate_packed(spec, [[d] for d in rows[0]], 48)
  model = OmniModel(spec)
  params = batched_rng.init(model, jax.random.key(0), jax.tree.map(jnp.asarray, alone))
  apply = jax.jit(model.apply)
  packed_logits = apply(params, jax.tree.map(jnp.asarray, b))[0]["text"]
  alone_logits = apply(params, jax.tree.map(jnp.asarray, alone))[0]["text"]
  at = 0
  for i, d in enumerate(rows[0]):
    np.testing.assert_allclose(packed_logits[0, at:at + len(d)], alone_logits[i, :len(d)],
                               atol=2e-5, rtol=1e-5)
    at += len(d)


def test_part_filled_rows_stay_open_once():
  def doc(n):
    return packing.Doc(np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, np.int32),
                       {}, {}, 0)
  full, short, carried, tail = [doc(10), doc(9)], [doc(6)], [doc(3)], [doc(18)]
  holds = {id(carried[0]): 2, id(short[0]): 1}
  emit, hold = packing.hold_open([full, short, carried, tail], 20, holds, 0.9, max_holds=2)
  # 19 and 18 of 20 tokens are full enough; 6 (held once) is held again; 3 holds a document
  # held twice already, so its row goes out part-filled.
  assert emit == [full, carried, tail] and hold == [short]
  emit, hold = packing.hold_open([full, short, carried, tail], 20, holds, 0.9, max_holds=1)
  assert emit == [full, short, carried, tail] and hold == []
  # A window that packs the held documents with new ones fills the rows it left part-filled.
  rows = packing.pack(short + [doc(14)], 20)
  assert [sum(map(len, r)) for r in rows] == [20]


def test_shards_read_disjoint_halves_and_batches_concatenate(tmp_path):
  m = write_lines(tmp_path / "m.jsonl", [{"id": i, "text": f"record {i:03d}"} for i in range(96)])
  cfg = text_config(m, epochs=1, pack_window=8, shards=2, prefetch=0)
  spec = build_spec(cfg.model)
  halves, reads = [], []
  for shard in (0, 1):
    s = PipelineStream(spec, cfg.data, DATA_KEYS)
    per = s.batch_size // 2
    s.bind((shard * per, (shard + 1) * per))
    seen = []
    with pytest.raises(DataError, match="ran out after data.epochs = 1"):
      for step in range(100):
        seen += texts_of(spec, s.batch(step))
    halves.append(seen)
    reads.append(s.summary()["records_read"])
  src = s.train_sources[0]
  train = {f"record {json.loads(src[i].payload)['id']:03d}" for i in range(len(src))}
  a, b = set(halves[0]), set(halves[1])
  assert not a & b
  assert len(halves[0]) == len(a)  # one epoch: no record twice
  assert abs(len(a) - len(b)) <= 1
  assert sum(reads) == len(train)  # each shard read its whole half once
  # Only the docs of each shard's last, unfinished batch (4 rows of <= 4 docs) are unseen.
  assert a | b <= train and len(train - (a | b)) < 2 * 4 * 4

  # One process reading both shards builds the concatenation of the two halves' rows.
  one = PipelineStream(spec, cfg.data, DATA_KEYS)
  one.bind()
  two = []
  for shard in (0, 1):
    s = PipelineStream(spec, cfg.data, DATA_KEYS)
    s.bind((shard * 4, shard * 4 + 4))
    two.append(s)
  for step in range(2):  # 43 records per shard: 2 full batches
    whole = one.batch(step)
    parts = [s.batch(step) for s in two]
    for k, v in whole.items():
      np.testing.assert_array_equal(v, np.concatenate([p[k] for p in parts]), err_msg=k)


def test_input_state_resumes_exactly(tmp_path):
  m = write_lines(tmp_path / "m.jsonl", [{"id": i, "text": "w " * (i % 7) + str(i)}
                                         for i in range(60)])
  cfg = text_config(m, pack_window=16, prefetch=2)
  spec = build_spec(cfg.model)
  a = make_stream(spec, cfg.data)
  a.bind()
  first = [a.batch(i) for i in range(5)]
  state = json.loads(json.dumps(a.iterator.get_state()))  # what the checkpoint stores
  # The restore decodes documents of rows the previous window left open again.
  assert state["shards"]["0"]["carry"] and state["shards"]["0"]["offset"]
  rest = [a.batch(i) for i in range(5, 12)]
  b = make_stream(spec, cfg.data)
  b.bind()
  b.iterator.set_state(state)
  for i, want in enumerate(rest, start=5):
    got = b.batch(i)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k], err_msg=f"batch {i} {k}")
  assert b.summary() == a.summary()
  assert a.summary()["records_read"] >= 12 * 8 // 3  # packed: several records per row
  with pytest.raises(ValueError, match="sequential: asked for batch 3, next is 12"):
    b.batch(3)
  assert first[0]["tokens"].shape == (8, 48)


def test_eval_split_keeps_a_record_whole(tmp_path):
  rng = np.random.default_rng(0)
  lines = []
  for i in range(40):
    Image.fromarray((rng.uniform(size=(8, 8, 3)) * 255).astype(np.uint8)).save(
        tmp_path / f"{i}.png")
    lines.append({"id": f"r{i}", "text": f"pic {i:02d}", "image": f"{i}.png"})
  m = write_lines(tmp_path / "m.jsonl", lines)
  cfg = get_config("micro")
  cfg.model.modalities = dict(image=cfg.model.modalities.image)
  cfg.data.update(source="manifest", manifest=str(m), eval_fraction=0.3, codebook_samples=8,
                  epochs=1, prefetch=0)
  s = make_stream(build_spec(cfg.model), cfg.data)
  s.bind()
  spec = s.spec
  train_texts = []
  with pytest.raises(DataError, match="ran out"):
    for step in range(50):
      train_texts += texts_of(spec, s.batch(step))
  eval_texts = [t for i in range(3) for t in texts_of(spec, s.eval_batch(i))]
  train_ids = {t[:6] for t in train_texts}
  eval_ids = {t[:6] for t in eval_texts}
  assert train_ids and eval_ids and not train_ids & eval_ids
  assert len(train_ids | eval_ids) == 40
  # Each eval record gives an understand and a generate document, both held out.
  ev_tasks = {}
  for i in range(3):
    b = s.eval_batch(i)
    for text, t in zip(texts_of(spec, b), b["task"], strict=True):
      ev_tasks.setdefault(text[:6], set()).add(s.tasks[t])
  assert all(v == {"image:understand", "image:generate"} for v in ev_tasks.values())
  ev = s.eval_batch(0)
  assert (ev["segment_ids"].max(1) == 1).all()  # eval rows: one document each
  tasks = {s.tasks[t] for t in ev["task"]}
  assert tasks == {"image:understand", "image:generate"}


def test_bad_records_are_reported_counted_once_and_capped(tmp_path):
  (tmp_path / "junk.png").write_bytes(b"not a png")
  lines = [{"id": i, "text": f"good {i:02d} " + "x" * 30} for i in range(40)]  # a row each
  bad = {3: "{broken", 7: {"text": 5}, 15: {"text": "x", "image": "missing.png"},
         19: {"text": "x", "image": "junk.png"}}
  fine = {11: {"text": "x", "colour": "red"}, 23: {"text": "y" * 80}}  # metadata; chunked
  for i, line in {**bad, **fine}.items():
    lines[i] = line
  m = write_lines(tmp_path / "m.jsonl", lines)
  cfg = text_config(m, eval_fraction=0.0, epochs=3, pack_window=8, max_bad_fraction=0.2,
                    prefetch=0)
  s = make_stream(build_spec(cfg.model), cfg.data)
  with pytest.raises(DataError, match="ran out"):
    for step in range(100):
      s.batch(step)
  got = s.summary()
  # Three epochs: every record read three times, each bad one counted and listed once.
  assert got["records_read"] == 120 and got["records_distinct_read"] == 40
  assert got["records_skipped"] == 4
  msgs = s.iterator.readers[0].bad
  assert sorted(int(x.split(":")[1]) for x in msgs) == [i + 1 for i in bad]
  by_line = {int(x.split(":")[1]): x for x in msgs}
  assert all(x.startswith(f"{m}:") for x in msgs)
  assert "invalid JSON" in by_line[4]
  assert "'text' must be a string" in by_line[8]
  assert "not found" in by_line[16] and "missing.png" in by_line[16]
  assert "junk.png" in by_line[20]

  # 4 / 40 = 0.1 > 0.05: the run stops, but only at the epoch's end (the minimum count is not
  # reached), though the first bad record (line 4) made the fraction 1 / 4 at once.
  cfg.data.update(max_bad_fraction=0.05, min_records_before_cap=1000)
  s = make_stream(build_spec(cfg.model), cfg.data)
  with pytest.raises(DataError, match=r"4 of the 40 distinct records read are bad \(0.1000 > "
                     r"data.max_bad_fraction = 0.05\).*all 4\):") as info:
    for step in range(100):
      s.batch(step)
  assert all(str(info.value).count(x) == 1 for x in msgs)
  cfg.data.min_records_before_cap = 10
  s = make_stream(build_spec(cfg.model), cfg.data)
  with pytest.raises(DataError, match=r"of the \d+ distinct records read are bad"):
    for step in range(100):
      s.batch(step)
  assert 10 <= s.iterator.records_distinct_read < 40

  cfg.data.update(on_error="fatal", strict_keys=True)
  s = make_stream(build_spec(cfg.model), cfg.data)
  with pytest.raises(DataError, match=r"on_error = 'fatal'.*m.jsonl:\d+: "):
    s.batch(0)
  cfg.data.update(on_error="skip", min_records_before_cap=1000)
  s = make_stream(build_spec(cfg.model), cfg.data)
  with pytest.raises(DataError, match=r"(?s)5 of the 40 .*unknown key\(s\) \['colour'\]"):
    for step in range(100):
      s.batch(step)


@pytest.mark.slow  # spawns a worker process (~25 s on 2 cores)
def test_worker_processes_give_the_same_batches(tmp_path):
  if not flags.FLAGS.is_parsed():  # Grain's worker start-up reads its absl flags
    flags.FLAGS.mark_as_parsed()
  m = write_lines(tmp_path / "m.jsonl", [{"id": i, "text": f"rec {i}"} for i in range(50)])
  cfg = text_config(m, pack_window=8)
  spec = build_spec(cfg.model)
  got = {}
  for workers in (0, 1):
    cfg.data.workers = workers
    s = make_stream(spec, cfg.data)
    s.bind()
    got[workers] = [s.batch(i) for i in range(3)]
    s.iterator.close()
  for a, b in zip(got[0], got[1], strict=True):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.parametrize("key,value", [("slots_per_row", 0), ("pack_window", -1),
                                       ("workers", 1.5), ("eval_fraction", 1.0)])
def test_bad_pipeline_options_name_the_key(key, value):
  from omni_jax.common.config import ConfigError
  from omni_jax.data.pipeline import pipeline_options
  with pytest.raises(ConfigError, match=f"data.{key}"):
    pipeline_options({key: value})

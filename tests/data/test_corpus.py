"""Corpus-scale input: sharded formats read by index, conversion, long documents, lenient
records, mixtures."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from omni_jax.data import shards as shards_lib
from omni_jax.data.convert import convert
from omni_jax.data.documents import DocMaker
from omni_jax.data.pipeline import DataError
from omni_jax.data.records import Item, open_dataset
from omni_jax.data.stream import make_stream
from omni_jax.train.spec import build_spec
from tests.cli import run_module, stop_fork_server
from tests.data.test_input_pipeline import text_config, texts_of, write_lines


def corpus(tmp_path, n=60):
  """A manifest in ``tmp_path/in``: text records, some with a relative image path, some
  without an id, and metadata keys no modality reads."""
  src = tmp_path / "in"
  (src / "img").mkdir(parents=True)
  rng = np.random.default_rng(0)
  lines = []
  for i in range(n):
    rec = {"id": f"r{i}", "text": f"record {i:03d}", "lang": "en", "score": i / 7}
    if i % 5 == 0:
      Image.fromarray((rng.uniform(size=(8, 8, 3)) * 255).astype(np.uint8)).save(
          src / "img" / f"{i}.png")
      rec["image"] = f"img/{i}.png"
    if i % 7 == 3:
      del rec["id"]
    lines.append(rec)
  return write_lines(src / "m.jsonl", lines[:30] + [""] + lines[30:])  # a blank line too


def as_dict(payload):
  return payload if isinstance(payload, dict) else json.loads(payload)


@pytest.mark.parametrize("fmt", ["arrayrecord", "parquet", "jsonl"])
def test_converted_shards_hold_the_records_split_and_batches_of_the_manifest(tmp_path, fmt):
  m = corpus(tmp_path)
  out = tmp_path / "out"
  meta = convert(m, out, fmt, shards=3)
  assert meta["records"] == 60 and len(meta["shards"]) == 3
  assert sorted(p.name for p in out.iterdir() if shards_lib.shard_format(p)) == [
      f"part-{s:05d}-of-00003.{fmt}" for s in range(3)]
  plain = open_dataset(m, 0.3)
  for spec in (out, f"{out}/part-*.{fmt}"):  # a folder or a glob
    ds = open_dataset(spec, 0.3)
    assert ds.format == fmt and len(ds) == 60 and len(ds.shards) == 3
    np.testing.assert_array_equal(ds.eval_mask, plain.eval_mask)  # the split is kept
    for i in range(60):
      want, got = plain.item(i), ds.item(i)
      assert as_dict(got.payload) == json.loads(want.payload)
      assert got.base_dir == want.base_dir == str((tmp_path / "in").resolve())
  # Training batches, through the image decoder (relative paths still resolve), are equal.
  cfg = text_config(m, eval_fraction=0.3, pack_window=16, prefetch=0)
  spec = build_spec(cfg.model)
  a = make_stream(spec, cfg.data)
  cfg.data.manifest = str(out)
  b = make_stream(spec, cfg.data)
  for step in range(3):
    x, y = a.batch(step), b.batch(step)
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)
  assert a.summary()["records_skipped"] == b.summary()["records_skipped"] == 0
  assert b.batch(3)["image_mask"].any()


def test_start_up_reads_indexes_not_records(tmp_path, monkeypatch):
  m = corpus(tmp_path, 40)
  for fmt in ("arrayrecord", "jsonl", "parquet"):
    convert(m, tmp_path / fmt, fmt, shards=2)
  want = open_dataset(m, 0.25).eval_mask

  def forbidden(*a, **k):
    raise AssertionError("a record was read or parsed at start-up")
  for target in ("ArrayRecordReader.read", "JsonlReader.read", "ParquetReader.read",
                 "record_id", "scan_jsonl"):
    monkeypatch.setattr(f"omni_jax.data.shards.{target}", forbidden)
  for fmt in ("arrayrecord", "jsonl", "parquet"):
    ds = open_dataset(tmp_path / fmt, 0.25)
    assert len(ds) == 40
    np.testing.assert_array_equal(ds.eval_mask, want)
  monkeypatch.undo()
  # A shard changed after indexing (its size no longer matches) is scanned again, not trusted.
  shard = tmp_path / "jsonl" / "part-00001-of-00002.jsonl"
  with open(shard, "a") as f:
    f.write(json.dumps({"id": "new", "text": "appended"}) + "\n")
  ds = open_dataset(tmp_path / "jsonl", 0.25)
  assert len(ds) == 41 and json.loads(ds.item(40).payload)["text"] == "appended"
  fp = ds.fingerprint()
  assert [s["records"] for s in fp["shards"]] == [20, 21]


def test_convert_cli_and_its_errors(tmp_path):
  m = corpus(tmp_path, 12)
  r = run_module("experiments.convert_dataset", f"--input={m}", f"--output={tmp_path}/pq",
                 "--format=parquet", "--shards=2")
  assert r.returncode == 0, r.stderr
  assert len(open_dataset(tmp_path / "pq", 0.0)) == 12
  r = run_module("experiments.convert_dataset", f"--input={m}", f"--output={tmp_path}/pq",
                 "--format=parquet")
  assert r.returncode != 0 and "exists and is not empty" in r.stderr
  assert "Traceback" not in r.stderr
  mixed = write_lines(tmp_path / "mixed.jsonl", [{"id": 1, "text": "a"}, {"id": "x", "text": "b"}])
  r = run_module("experiments.convert_dataset", f"--input={mixed}", f"--output={tmp_path}/x",
                 "--format=parquet")
  assert r.returncode != 0 and "key 'id' holds string" in r.stderr and "Traceback" not in r.stderr
  convert(m, tmp_path / "ar", "arrayrecord", shards=1)
  (tmp_path / "ar" / "extra.jsonl").write_text('{"text": "x"}\n')
  with pytest.raises(ValueError, match="mixes shard formats"):
    open_dataset(tmp_path / "ar", 0.0)


@pytest.mark.parametrize("positions", ["restart", "continue"])
def test_a_document_twenty_times_seq_len_is_cut_into_windows(tmp_path, positions):
  words = " ".join(f"w{i}" for i in range(400))  # 1,889 bytes: 20x seq_len 48 and more
  m = write_lines(tmp_path / "m.jsonl", [{"id": 0, "text": words}]
                  + [{"id": i, "text": f"short {i}"} for i in range(1, 9)])
  cfg = text_config(m, eval_fraction=0.0, pack_window=16, prefetch=0, chunk_positions=positions)
  spec = build_spec(cfg.model)
  t = cfg.data.seq_len
  maker = DocMaker(spec, t, {}, ["text", "image:understand"],
                   continue_positions=positions == "continue")
  docs = maker(Item(0, 0, "m:1", str(tmp_path), json.dumps({"text": words}).encode()))["docs"]
  ids = [spec.tokenizer.bos_id, *spec.tokenizer.encode(words), spec.tokenizer.eos_id]
  assert len(ids) >= 20 * t and len(docs) == -(-len(ids) // t)
  assert all(len(d) == t for d in docs[:-1])
  np.testing.assert_array_equal(np.concatenate([d.tokens for d in docs]), ids)
  # Every token but the last predicts the next one, across window boundaries too.
  np.testing.assert_array_equal(np.concatenate([d.targets for d in docs])[:-1], ids[1:])
  heads = np.concatenate([d.target_head for d in docs])
  assert heads[-1] == 0 and (heads[:-1] == 1).all()
  assert [d.start for d in docs] == ([k * t for k in range(len(docs))]
                                     if positions == "continue" else [0] * len(docs))
  # Through the pipeline: nothing bad, every window in some row, positions as configured.
  s = make_stream(spec, cfg.data)
  seen, pos0 = [], set()
  for step in range(12):
    b = s.batch(step)
    seen += texts_of(spec, b)
    for seg, pos in zip(b["segment_ids"], b["positions"], strict=True):
      for k in range(1, seg.max() + 1):
        pos0.add(int(pos[seg == k][0]))
  assert s.summary()["records_skipped"] == 0
  tok = spec.tokenizer
  assert {tok.decode(d.tokens[d.tokens < tok.vocab_size]) for d in docs} <= set(seen)
  assert pos0 == ({0} if positions == "restart" else {k * t for k in range(len(docs))})


def test_unknown_keys_are_metadata_unless_strict(tmp_path):
  m = write_lines(tmp_path / "m.jsonl", [{"id": i, "text": f"t {i}", "lang": "de",
                                          "tags": ["a", {"b": 1}]} for i in range(20)])
  cfg = text_config(m, eval_fraction=0.0, pack_window=8, prefetch=0)
  spec = build_spec(cfg.model)
  s = make_stream(spec, cfg.data)
  s.batch(0)
  assert s.summary()["records_skipped"] == 0
  cfg.data.update(strict_keys=True, on_error="fatal")
  s = make_stream(spec, cfg.data)
  with pytest.raises(DataError, match=r"unknown key\(s\) \['lang', 'tags'\]; allowed keys"):
    s.batch(0)


@pytest.mark.parametrize("n", [2_000, pytest.param(10_000, marks=pytest.mark.slow)])
def test_mixture_batches_follow_the_weights(tmp_path, n):
  a = write_lines(tmp_path / "a.jsonl", [{"id": f"a{i}", "text": f"a{i:03d}"} for i in range(300)])
  b_in = write_lines(tmp_path / "b_in.jsonl", [{"id": f"b{i}", "text": f"b{i:03d}"}
                                                for i in range(200)])
  convert(b_in, tmp_path / "b", "arrayrecord", shards=2)
  Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "x.png")
  c = write_lines(tmp_path / "c.jsonl", [{"id": f"c{i}", "text": f"c{i:03d}", "image": "x.png"}
                                         for i in range(100)])
  weights = {"a": 0.5, "b": 0.3, "c": 0.2}  # documents of one length: packing is neutral
  cfg = text_config("", eval_fraction=0.0, pack_window=64, prefetch=0, shards=2, sources=[
      dict(path=str(a), weight=5), dict(path=str(tmp_path / "b"), weight=3.0),
      dict(path=str(c), weight=2.0, modalities=[])])  # c feeds text only: its image ignored
  spec = build_spec(cfg.model)
  s = make_stream(spec, cfg.data)
  docs = []
  step = 0
  while len(docs) < n:
    batch = s.batch(step)
    assert not batch["image_mask"].any()
    docs += texts_of(spec, batch)
    step += 1
  got = {k: sum(d[0] == k for d in docs[:n]) / n for k in weights}
  for k, w in weights.items():
    assert abs(got[k] - w) < 0.02, (k, got)
  summary = s.summary()
  assert [x["weight"] for x in summary["sources"]] == [5.0, 3.0, 2.0]
  for x, w in zip(summary["sources"], weights.values(), strict=True):
    assert abs(x["read_fraction"] - w) < 0.02 and x["records_skipped"] == 0
  assert sum(x["records_read"] for x in summary["sources"]) == summary["records_read"]


@pytest.mark.parametrize("sources,match", [
    ([dict(path="x", weight=0)], r"data.sources\[0\].weight"),
    ([dict(path="x", weight=1, colour=2)], r"unknown key\(s\) \['colour'\]"),
    ([dict(path="x", modalities=["smell"])], r"data.sources\[0\].modalities"),
])
def test_bad_sources_name_the_key(tmp_path, sources, match):
  from omni_jax.common.config import ConfigError
  cfg = text_config("", sources=sources)
  with pytest.raises(ConfigError, match=match):
    make_stream(build_spec(cfg.model), cfg.data)
  cfg = text_config(tmp_path / "m.jsonl", sources=[dict(path="x")])
  with pytest.raises(ConfigError, match="both set"):
    make_stream(build_spec(cfg.model), cfg.data)


@pytest.mark.slow  # a train_omni process (~30 s on 2 shared cores)
def test_a_run_over_bad_data_stops_with_a_message_not_a_traceback(tmp_path):
  """26 records, 2 bad files: the run stops at the end of the first pass (fewer records than
  the minimum count), naming each bad file once, with a non-zero exit code."""
  (tmp_path / "cut.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")  # truncated
  (tmp_path / "empty.mp4").write_bytes(b"")
  lines = [{"id": i, "text": f"line {i}"} for i in range(24)] + [
      {"id": "cut", "text": "a", "image": "cut.png"},
      {"id": "e", "text": "b", "image": "empty.mp4"}]
  m = write_lines(tmp_path / "m.jsonl", lines)
  r = run_module("experiments.train_omni", "--config=configs/omni_moe.py:micro",
                 f"--workdir={tmp_path}/run", "--cpu_devices=1", "--config.data.source=manifest",
                 f"--config.data.manifest={m}", "--config.data.eval_fraction=0.0",
                 "--config.model.modalities.image.codebook_size=0",
                 "--config.model.modalities.audio.codebook_size=0", "--config.train.steps=50")
  assert r.returncode != 0
  assert "Traceback" not in r.stderr
  assert "2 of the 26 distinct records read are bad" in r.stderr
  tail = r.stderr[r.stderr.index("input stopped"):]
  assert tail.count("cut.png") == 1 and tail.count("empty.mp4") == 1


@pytest.mark.parametrize("fmt", ["arrayrecord", "parquet", "jsonl"])
def test_resume_is_exact_on_the_same_data_and_refused_on_changed_data(tmp_path, fmt):
  m = write_lines(tmp_path / "m.jsonl", [{"id": i, "text": "w " * (i % 7) + str(i)}
                                         for i in range(60)])
  convert(m, tmp_path / "d", fmt, shards=2)
  cfg = text_config(tmp_path / "d", pack_window=16, prefetch=2)
  spec = build_spec(cfg.model)
  a = make_stream(spec, cfg.data)
  a.bind()
  for i in range(4):
    a.batch(i)
  state = json.loads(json.dumps(a.iterator.get_state()))  # what the checkpoint stores
  assert state["fingerprint"][0]["shards"][1]["name"] == f"part-00001-of-00002.{fmt}"
  rest = [a.batch(i) for i in range(4, 9)]
  b = make_stream(spec, cfg.data)
  b.bind()
  b.iterator.set_state(state)
  for i, want in enumerate(rest, start=4):
    got = b.batch(i)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k], err_msg=f"batch {i} {k}")
  if fmt != "jsonl":
    return
  with open(tmp_path / "d" / "part-00001-of-00002.jsonl", "a") as f:
    f.write(json.dumps({"id": "late", "text": "added later"}) + "\n")
  c = make_stream(spec, cfg.data)
  c.bind()
  with pytest.raises(DataError, match=r"data changed .*part-00001-of-00002.jsonl held 30 "
                     r"records, now 31.*allow_changed_data"):
    c.iterator.set_state(state)
  cfg.data.allow_changed_data = True
  c = make_stream(spec, cfg.data)
  c.bind()
  c.iterator.set_state(state)  # accepted (logged): the new data from its start, at batch 4
  assert c.batch(4)["tokens"].shape == rest[0]["tokens"].shape


@pytest.mark.slow  # a short training run (~1 min on 2 shared cores)
def test_a_text_only_corpus_of_long_documents_trains(tmp_path):
  rng = np.random.default_rng(0)
  words = ["alpha", "beta", "gamma", "delta", "eps"]
  docs = [{"id": i, "text": " ".join(words[(i + k) % 5] for k in range(int(rng.integers(60, 200))))}
          for i in range(40)]  # 360-1,400 bytes: 8-30 windows of 48 tokens each
  m = write_lines(tmp_path / "m.jsonl", docs)
  r = run_module("experiments.train_omni", "--config=configs/omni_moe.py:micro",
                 f"--workdir={tmp_path}/run", "--cpu_devices=1", "--config.data.source=manifest",
                 f"--config.data.manifest={m}", "--config.train.steps=30",
                 "--config.train.eval_every=0", "--config.model.modalities.image.codebook_size=0",
                 "--config.model.modalities.audio.codebook_size=0")
  assert r.returncode == 0, r.stderr[-3000:]
  summary = json.loads((tmp_path / "run" / "summary.json").read_text())
  assert summary["data"]["records_skipped"] == 0 and summary["data"]["records_read"] > 0
  assert summary["final_loss"] < summary["initial_loss"] - 0.5


def test_an_input_pass_by_record_count_reports_memory(tmp_path):
  from omni_jax.reports.input_bench import measure_records
  stop_fork_server()  # the CLI tests' fork server is a child of this process too
  m = write_lines(tmp_path / "m.jsonl", [{"id": i, "text": f"t{i}"} for i in range(500)])
  cfg = text_config(m, pack_window=32, prefetch=0)
  s = make_stream(build_spec(cfg.model), cfg.data)
  out = measure_records(s, 300)
  # It stops at the first batch that brings the count to 300: within one window of it.
  assert 300 <= out["records"] < 300 + 32 * 8
  assert out["rss_start_mb"] > 10 and np.isfinite(out["rss_growth_mb"])
  # The peak after the first tenth is one of the samples the whole pass's peak is taken over
  # (memory may dip below the start before that tenth, so the two growths do not compare).
  assert (out["rss_at_first_tenth_mb"] + out["rss_growth_after_first_tenth_mb"]
          <= out["rss_start_mb"] + out["rss_growth_mb"] + 1e-9)
  assert out["rss_growth_after_first_tenth_mb"] >= 0
  # One process (no workers): every page is its own, so PSS is at most RSS.
  assert 10 < out["pss_start_mb"] <= out["rss_start_mb"] and np.isfinite(out["pss_growth_mb"])
  # No workers: the whole figure is this process's; children are none at the start and after.
  assert out["child_processes_at_start"] == out["child_processes_max"] == 0
  assert out["rss_children_start_mb"] == out["rss_children_growth_mb"] == 0
  assert out["rss_main_start_mb"] == out["rss_start_mb"]
  assert out["rss_main_growth_mb"] == out["rss_growth_mb"]

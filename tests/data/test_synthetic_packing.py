"""The synthetic stream's packed rows (data.pack = 'documents'): layout, determinism, and
that a packed document is scored exactly as the same document alone in a row."""

import jax
import numpy as np
import pytest

from configs.omni_moe import get_config
from omni_jax.common import batched_rng
from omni_jax.common.config import ConfigError
from omni_jax.data.packing import Doc, collate_packed
from omni_jax.data.stream import OmniStream
from omni_jax.models.omni import OmniModel
from omni_jax.train.spec import build_spec


@pytest.fixture(scope="module")
def packed():
  cfg = get_config("micro")
  cfg.data.pack = "documents"
  spec = build_spec(cfg.model)
  return cfg, spec, OmniStream(spec, cfg.data)


def segments(row_seg):
  """[(segment id, start, end)] of one row's documents, in order."""
  out = []
  for k in range(1, int(row_seg.max()) + 1):
    at = np.nonzero(row_seg == k)[0]
    out.append((k, int(at[0]), int(at[-1]) + 1))
  return out


def test_packed_rows_hold_whole_documents_with_masks(packed):
  cfg, spec, stream = packed
  tok = spec.tokenizer
  b = stream.batch(3)
  t = cfg.data.seq_len
  assert b["tokens"].shape == (cfg.data.batch_size, t)
  assert max(segments(r)[-1][0] for r in b["segment_ids"]) > 1  # rows hold several documents
  for i, seg in enumerate(b["segment_ids"]):
    parts = segments(seg)
    n = parts[-1][2]
    assert [p[0] for p in parts] == list(range(1, len(parts) + 1))
    assert all(p[2] == q[1] for p, q in zip(parts, parts[1:], strict=False))  # contiguous
    assert parts[0][1] == 0 and not seg[n:].any()  # padding only at the end
    assert (b["tokens"][i, n:] == tok.pad_id).all() and not b["target_head"][i, n:].any()
    for _, a, z in parts:
      np.testing.assert_array_equal(b["positions"][i, a:z], np.arange(z - a))
      assert b["tokens"][i, a] == tok.bos_id and b["tokens"][i, z - 1] == tok.eos_id
      assert b["target_head"][i, z - 1] == 0  # no loss across a document boundary
    for m, _ in spec.modalities:
      if b[f"{m}_mask"][i]:  # one slot per modality: its positions are this row's slot tokens
        pos = b[f"{m}_pos"][i]
        assert (b["tokens"][i, pos] == tok.special(f"<{m}:slot>")).all()
        assert len(np.unique(seg[pos])) == 1
      else:
        assert not (b["tokens"][i] == tok.special(f"<{m}:slot>")).any()


def test_packed_batches_are_a_function_of_seed_and_step(packed):
  cfg, spec, stream = packed
  again = OmniStream(spec, cfg.data)
  for step in (0, 5):
    a, b = stream.batch(step), again.batch(step)
    assert sorted(a) == sorted(b)
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  assert not np.array_equal(stream.batch(1)["tokens"], stream.batch(2)["tokens"])
  ex = stream.example_batch()
  assert {k: (v.shape, v.dtype) for k, v in ex.items()} == {
      k: (v.shape, v.dtype) for k, v in stream.batch(0).items()}


def test_packing_fills_more_of_each_row_than_one_sample_per_row(packed):
  cfg, spec, stream = packed
  plain_cfg = get_config("micro")
  plain = OmniStream(spec, plain_cfg.data)
  for s in range(4):
    stream.batch(s)
    plain.batch(s)
  got, base = stream.summary(), plain.summary()
  assert got["pack"] == "documents" and base["pack"] == "none"
  assert got["packing_efficiency"] > base["packing_efficiency"]
  assert got["samples"] > base["samples"] == 4 * cfg.data.batch_size


@pytest.mark.slow  # compiles the micro model's init and forward: ~10 s quiet, 45 s loaded
def test_a_packed_document_scores_as_it_does_alone(packed):
  """Logits of every document of a packed row equal those of the document alone in a row
  (document masks and restarting positions; encoder inputs follow their slots)."""
  cfg, spec, stream = packed
  b = stream.batch(3)
  row = int(np.argmax(b["segment_ids"].max(axis=1)))  # the row with the most documents
  docs = []
  for _, a, z in segments(b["segment_ids"][row]):
    slots, inputs = {}, {}
    for m, _ in spec.modalities:
      pos = b[f"{m}_pos"][row]
      if b[f"{m}_mask"][row] and a <= pos[0] < z:
        slots[m], inputs[m] = pos - a, b[m][row]
    docs.append(Doc(b["tokens"][row, a:z], b["targets"][row, a:z], b["target_head"][row, a:z],
                    slots, inputs, 0))
  alone = collate_packed(spec, [[d] for d in docs], cfg.data.seq_len)
  # One forward over [the packed row, each document alone]: one compile.
  both = {k: np.concatenate([b[k][row:row + 1], alone[k]]) for k in alone}
  model = OmniModel(spec)
  params = batched_rng.init(model, jax.random.PRNGKey(0), both)["params"]
  logits = jax.jit(lambda p, x: model.apply({"params": p}, x)[0])(params, both)
  for k, (_, a, z) in enumerate(segments(b["segment_ids"][row])):
    for head in logits:
      np.testing.assert_allclose(np.asarray(logits[head][0, a:z]),
                                 np.asarray(logits[head][1 + k, :z - a]), rtol=2e-4, atol=2e-5)


def test_pack_mode_errors_name_the_allowed_values():
  cfg = get_config("micro")
  spec = build_spec(cfg.model)
  cfg.data.pack = "rows"
  with pytest.raises(ConfigError, match=r"data.pack = 'rows'.*'none', 'documents', 'text'"):
    OmniStream(spec, cfg.data)

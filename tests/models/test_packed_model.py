"""Packed rows: the omni model on a row of two documents equals each document alone."""

import jax
import jax.numpy as jnp
import numpy as np

from configs.omni_moe import get_config
from omni_jax.common import batched_rng
from omni_jax.models.omni import OmniModel, omni_loss
from omni_jax.train.spec import build_spec


def test_packed_row_equals_documents_alone_and_padding_carries_no_loss():
  spec = build_spec(get_config("micro").model)  # dropless MoE: routing is per token
  model = OmniModel(spec)
  rng = np.random.default_rng(0)
  la, lb, pad = 17, 23, 8
  doc_a, doc_b = rng.integers(3, 200, la), rng.integers(3, 200, lb)
  tokens = np.concatenate([doc_a, doc_b, np.zeros(pad, int)])[None].astype(np.int32)
  seg = np.array([[1] * la + [2] * lb + [0] * pad], np.int32)
  pos = np.concatenate([np.arange(la), np.arange(lb), np.arange(pad)])[None].astype(np.int32)
  params = batched_rng.init(model, jax.random.PRNGKey(0), {"tokens": tokens})["params"]
  apply = jax.jit(lambda b: model.apply({"params": params}, b))  # op by op took minutes
  packed, _ = apply({"tokens": tokens, "segment_ids": seg, "positions": pos})
  alone_a, _ = apply({"tokens": doc_a[None].astype(np.int32)})
  alone_b, _ = apply({"tokens": doc_b[None].astype(np.int32)})
  for head in packed:
    np.testing.assert_allclose(packed[head][:, :la], alone_a[head], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(packed[head][:, la:la + lb], alone_b[head], atol=2e-5, rtol=1e-5)
  # Without the segment ids document b attends to document a: the logits differ.
  crossed, _ = apply({"tokens": tokens, "positions": pos})
  assert np.abs(np.asarray(crossed["text"][:, la:la + lb] - alone_b["text"])).max() > 1e-2

  # Padding never carries loss, even where target_head names a head there.
  targets = np.roll(tokens, -1, axis=1)
  heads = np.ones_like(tokens)
  batch = {"tokens": tokens, "segment_ids": seg, "positions": pos, "targets": targets}
  logits, aux = apply(batch)
  loss = lambda h: omni_loss(spec, logits, aux, {**batch, "target_head": h})[1]["loss/text"]
  no_pad = np.where(seg > 0, heads, 0)
  np.testing.assert_allclose(loss(heads), loss(no_pad), rtol=1e-6)
  assert abs(float(loss(heads)) - float(
      omni_loss(spec, logits, aux, {"targets": targets, "target_head": heads})[1]["loss/text"])
  ) > 1e-4
  assert jnp.isfinite(logits["text"]).all()

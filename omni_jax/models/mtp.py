"""Multi-token prediction (MTP, DeepSeek-V3): ``BackboneSpec.mtp_layers`` sequential modules
after the backbone, each predicting one token further ahead.

Depth ``k`` (1-based) at position ``i`` combines the previous depth's hidden state
``h^{k-1}_i`` (``h^0``: the backbone's output, before the final norm) with the embedding of
token ``t_{i+k}``::

  h'_i    = eh_proj([enorm(Emb(t_{i+k})), hnorm(h^{k-1}_i)])      (a linear 2D -> D)
  h^k     = Block_k(h')                                           (one causal block)
  P^k_i   = Head(norm_k(h^k_i))            predicts t_{i+k+1}

``Block_k`` is a block of the backbone's kind (its attention, MLA or grouped-query; MoE when
the backbone has MoE layers), with its own causal attention over the sequence. ``Emb`` and
``Head`` are the main model's (shared); each module has its own output norm ``norm``, as the
DeepSeek-V3 checkpoints do (``shared_head.norm``). Parameter names per module ``mtp_<k-1>``:
``enorm``, ``hnorm``, ``eh_proj``, ``block/...`` (a backbone block's names), ``norm``.

The loss (:func:`mtp_loss`): depth ``k``'s cross-entropy of ``t_{i+k+1}`` over the positions
that have such a target in the same document, per output head as the main loss; the MTP
loss is the mean over depths, added to the total times ``OmniSpec.mtp_loss_weight``
(DeepSeek-V3's ``lambda / D * sum_k L_k``).

Decoding: :mod:`omni_jax.generate.speculative` drafts with the modules and verifies with the
main model; a module then runs over its own decode cache (one attention layer).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from omni_jax.models.layers import Kernel, RMSNorm
from omni_jax.models.transformer import BackboneSpec, Block


class MTPModule(nn.Module):
  """One MTP depth: ``(h_prev [B, T, D], emb_next [B, T, D], positions, segment_ids, cache)``
  -> ``(h [B, T, D], normed h, MoE aux or None[, cache])`` (the cache only when given)."""
  spec: BackboneSpec

  @nn.compact
  def __call__(self, h_prev, emb_next, positions, segment_ids=None, cache=None):
    s = self.spec
    e = RMSNorm(s.norm_eps, dtype=s.dtype, name="enorm")(emb_next)
    hp = RMSNorm(s.norm_eps, dtype=s.dtype, name="hnorm")(h_prev)
    x = jnp.concatenate([e, hp], axis=-1).astype(s.dtype) @ Kernel(
        (2 * s.d_model, s.d_model), 1, s.dtype, name="eh_proj")()
    out = Block(s, bool(s.num_moe_layers), name="block")(x, positions, segment_ids,
                                                        *([] if cache is None else [cache]))
    h, aux, *cache = out
    normed = RMSNorm(s.norm_eps, dtype=s.dtype, name="norm")(h)
    if cache:
      return h, normed, aux, cache[0].advance(h.shape[1])
    return h, normed, aux


def shift_left(x: jax.Array, k: int, fill=0) -> jax.Array:
  """``x`` [B, T, ...] moved ``k`` positions left along T (``out[:, i] = x[:, i + k]``), the
  last ``k`` positions ``fill``."""
  if k == 0:
    return x
  pad = jnp.full((x.shape[0], k, *x.shape[2:]), fill, x.dtype)
  return jnp.concatenate([x[:, k:], pad], axis=1)


def mtp_chain(spec: BackboneSpec, h, x, positions, segment_ids=None):
  """Runs the ``spec.mtp_layers`` modules (created here, named ``mtp_<k-1>``, inside the
  calling compact module) over the backbone output ``h`` and the input embeddings ``x``
  [B, T, D]. Returns (normed hidden states per depth, list of MoE aux per depth)."""
  outs, auxes = [], []
  for k in range(1, spec.mtp_layers + 1):
    h, normed, aux = MTPModule(spec, name=f"mtp_{k - 1}")(h, shift_left(x, k), positions,
                                                          segment_ids)
    outs.append(normed)
    if aux is not None:
      auxes.append(aux)
  return outs, auxes


def mtp_targets(batch: dict, k: int) -> tuple[jax.Array, jax.Array]:
  """Depth ``k``'s (targets, target_head) [B, T]: ``t_{i+k+1}`` and its head at position
  ``i``; head 0 (no loss) past the row's end and where position ``i + k`` lies in another
  document (or in padding) than ``i``."""
  tgt = shift_left(batch["targets"], k)
  head = shift_left(batch["target_head"], k)
  if "segment_ids" in batch:
    seg = batch["segment_ids"]
    head = jnp.where((shift_left(seg, k, -1) == seg) & (seg > 0), head, 0)
  return tgt, head


def head_nll(logits: jax.Array, targets: jax.Array, mask: jax.Array, size: int):
  """(sum of masked next-token NLL, sum of masked correct argmaxes) of float32 logits."""
  tgt = jnp.clip(targets, 0, size - 1)
  lg = logits.astype(jnp.float32)
  nll = jax.nn.logsumexp(lg, -1) - jnp.take_along_axis(lg, tgt[..., None], -1)[..., 0]
  return (nll * mask).sum(), ((jnp.argmax(lg, -1) == tgt) * mask).sum()


def mtp_counts(batch: dict, depths: int, num_heads: int) -> jax.Array:
  """float32 [depths, num_heads]: the MTP targets per depth and head of ``batch``."""
  rows = []
  for k in range(1, depths + 1):
    head = mtp_targets(batch, k)[1]
    rows.append(jnp.stack([(head == i).sum() for i in range(1, num_heads + 1)]))
  return jnp.stack(rows).astype(jnp.float32)


def mtp_loss(heads, mtp_logits, batch: dict, counts=None) -> tuple[jax.Array, dict]:
  """The MTP loss (mean over depths of each depth's head-weighted cross-entropy, each head's
  NLL a mean over its targets: ``counts`` [depths, heads] when given, the whole batch's under
  gradient accumulation) and its metrics ``loss/mtp``, ``loss/mtp_<k>``, ``acc/mtp_<k>``
  (the text head's accuracy when present, else the first head's)."""
  total, metrics = jnp.zeros((), jnp.float32), {}
  for k, logits in enumerate(mtp_logits, start=1):
    tgt, head_ids = mtp_targets(batch, k)
    loss_k, acc_k = jnp.zeros((), jnp.float32), None
    for i, hd in enumerate(heads, start=1):
      mask = (head_ids == i).astype(jnp.float32)
      den = jnp.maximum(mask.sum() if counts is None else counts[k - 1, i - 1], 1.0)
      nll, correct = head_nll(logits[hd.name], tgt, mask, hd.size)
      loss_k = loss_k + hd.weight * nll / den
      if acc_k is None:
        acc_k = correct / den
    metrics[f"loss/mtp_{k}"] = loss_k
    metrics[f"acc/mtp_{k}"] = acc_k
    total = total + loss_k
  total = total / max(len(mtp_logits), 1)
  metrics["loss/mtp"] = total
  return total, metrics

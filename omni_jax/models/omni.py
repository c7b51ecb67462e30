"""The omni-modal MoE LLM: modality encoders scattered into a decoder-only MoE backbone.

Batch layout (all fixed shapes, so one compile serves every mix of modalities):

* ``tokens`` int32 [B, T]: ids in the *input* vocabulary — text ids and specials of the
  tokenizer (``config.data.tokenizer``: :class:`~omni_jax.data.tokenizer.ByteTokenizer` by
  default, or a learned one from :mod:`omni_jax.data.bpe`), then each generated modality's codes
  at ``spec.code_offsets[name]``;
* ``<m>`` [B, *input_shape]: raw inputs of modality ``m``; ``<m>_pos`` int32 [B, N_m]:
  the *distinct* placeholder positions its N_m features fill; ``<m>_mask`` bool [B]: rows
  that carry ``m`` (other rows keep their token embeddings). A batch may omit ``m``
  entirely: its encoder then runs on zeros and is added times 0 (gradients stay defined);
* or, with K encoder slots per row (packed rows holding up to K inputs of ``m``,
  ``config.data.slots_per_row``): ``<m>`` [B, K, *input_shape], ``<m>_pos`` [B, K, N_m],
  ``<m>_mask`` bool [B, K] (slot k of row b is used). The encoder runs on all B·K inputs;
  positions of used slots are distinct within a row, unused slots write nothing;
* optional, for kinds with variable-length media (``frames``, ``patch``): ``<m>_valid`` int32
  [B(, K), *valid_shape] (audio: real samples; images: content (height, width)). The encoder
  honours it (padding never reaches a valid token) and encoder tokens wholly in the padding
  are not scattered: their positions keep the placeholder token's embedding, as an unused
  slot's do. Absent: every input fills its window;
* ``targets`` int32 [B, T] and ``target_head`` int32 [B, T]: the next id at each position
  and which output head predicts it (0 = no loss, 1 = text, 2.. = generated modalities);
* optional, for packed rows: ``segment_ids`` int32 [B, T] (0 = padding, 1..n = the row's
  documents; attention never crosses a document, padding carries no loss) and
  ``positions`` int32 [B, T] (rotary positions, restarting at 0 per document). Absent:
  one segment and positions 0..T-1.

Output: ``logits`` — one array [B, T, size] per head — and the backbone's MoE aux.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.modalities import MODALITY_KINDS
from omni_jax.models.encoders import ENCODERS
from omni_jax.models.layers import RMSNorm
from omni_jax.models.mtp import MTPModule, mtp_chain, mtp_counts, mtp_loss
from omni_jax.models.named_ops import named_op
from omni_jax.models.spec import OmniSpec
from omni_jax.models.transformer import Backbone


def scatter_features(x, feats, pos, mask):
  """Writes ``feats`` [B, N, D] into ``x`` [B, T, D] at ``pos`` [B, N] where ``mask`` ([B]: per
  row, or [B, N]: per feature). Positions of written features must be distinct within a row;
  masked-out features are sent past the row's end and dropped, so their positions may repeat.

  One scatter per row under ``vmap``: XLA then sees the batch as a scatter batching dimension
  and keeps it split under a batch layout, where a scatter indexed by ``(arange(B), pos)``
  made its partitioner all-gather ``x`` and the features (measured under ``data=8``)."""
  t = x.shape[1]
  if mask.ndim == 1:
    mask = jnp.broadcast_to(mask[:, None], pos.shape)
  dest = jnp.where(mask, pos, t)
  row = lambda xr, fr, dr: xr.at[dr].set(fr, mode="drop")
  return jax.vmap(row)(x, feats.astype(x.dtype), dest)


@named_op("run_encoder")
def run_encoder(enc, x):
  """``enc(x)``: a modality encoder on its input batch. A named op so that a recipe can place
  the encoder batch apart from the backbone's (:mod:`omni_jax.parallel.encoder_placement`)."""
  return enc(x)


def encode_slots(enc, x, pos, mask, valid=None, token_mask=None):
  """Runs encoder ``enc`` on one modality's batch fields; returns (feats [B, S, D], pos [B, S],
  mask [B] or [B, S]) for :func:`scatter_features`. With K slots per row (``mask`` [B, K]) the
  B*K inputs go through the encoder as one batch and each row's K feature runs are laid end
  to end. ``valid`` (the ``<m>_valid`` field) goes to the encoder, and ``token_mask(valid)``
  [*, N] keeps the tokens wholly in the padding out of the scatter."""
  lead = mask.ndim
  flat = lambda a: a.reshape(-1, *a.shape[lead:])
  if valid is None:
    feats = run_encoder(enc, flat(x))
  else:
    feats = run_encoder(functools.partial(enc, valid=flat(valid)), flat(x))
  n = feats.shape[1]
  b = mask.shape[0]
  feats, pos = feats.reshape(b, -1, feats.shape[-1]), pos.reshape(b, -1)
  if valid is None:
    return feats, pos, (mask if lead == 1 else jnp.repeat(mask, n, axis=1))
  tmask = token_mask(flat(valid)).reshape(b, -1)
  return feats, pos, jnp.repeat(mask.reshape(b, -1), n, axis=1) & tmask


class OmniModel(nn.Module):
  """The omni model: ``apply(vars, batch)`` -> (logits per head, MoE aux).

  ``apply(vars, batch, cache)`` with a :class:`~omni_jax.models.kv_cache.KVCache` is the same
  forward for decoding: ``batch["tokens"]`` [B, T] are written at the cache's next ``T`` slots
  (rotary positions from the cache unless ``batch["positions"]`` is given; modality inputs,
  if any, scatter into this call's tokens), returns (logits, aux, updated cache). Modalities
  absent from such a batch are skipped (no dummy encoder pass: nothing is differentiated).

  Multi-token prediction (``spec.backbone.mtp_layers > 0``, :mod:`omni_jax.models.mtp`): the
  training forward (no cache) adds ``logits["mtp"]``, one dict of head logits per depth,
  and averages the modules' MoE aux into ``aux``. ``hidden=True`` (with a cache) also returns
  the backbone's output before the final norm (what depth 1 reads). ``draft=(k, h_prev,
  mtp_cache)`` runs MTP depth ``k`` (0-based) alone on ``batch["tokens"]`` (the tokens one
  ahead of ``h_prev`` [B, T, D]) over its own cache: returns (logits, h^k, mtp_cache).
  """
  spec: OmniSpec

  @nn.compact
  def __call__(self, batch: dict[str, jax.Array], cache=None, *, hidden: bool = False,
               draft=None):
    s, bb = self.spec, self.spec.backbone
    tokens = batch["tokens"]
    b, t = tokens.shape
    x = nn.Embed(s.input_vocab, bb.d_model, dtype=bb.dtype,
                 embedding_init=nn.initializers.normal(1.0), name="embed")(tokens)
    for name, ms in s.modalities:
      kind = MODALITY_KINDS.get(ms["kind"])
      enc = ENCODERS.get(ms["kind"])(spec=ms, d_model=bb.d_model, dtype=bb.dtype,
                                     name=f"enc_{name}")
      if name in batch:
        valid = batch.get(f"{name}_valid")
        x = scatter_features(x, *encode_slots(
            enc, batch[name], batch[f"{name}_pos"], batch[f"{name}_mask"], valid,
            None if valid is None else functools.partial(kind.token_mask, ms)))
      elif cache is None and draft is None:  # dummy forward times 0: gradients stay defined
        dummy = jnp.zeros((b, *kind.input_shape(ms)), kind.input_dtype)
        x = x + 0.0 * run_encoder(enc, dummy).sum().astype(x.dtype)
    heads = {hd.name: nn.Dense(hd.size, use_bias=False, dtype=bb.dtype,
                               kernel_init=nn.initializers.lecun_normal(),
                               name=f"head_{hd.name}") for hd in s.heads}
    project = lambda h: {name: head(h).astype(jnp.float32) for name, head in heads.items()}
    if draft is not None:  # one MTP depth over its own decode cache
      k, h_prev, mtp_cache = draft
      h, normed, _, mtp_cache = MTPModule(bb, name=f"mtp_{k}")(
          h_prev, x, mtp_cache.positions(t), None, mtp_cache)
      return project(normed), h, mtp_cache
    positions = batch.get("positions")
    if positions is None:
      positions = (cache.positions(t) if cache is not None else
                   jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)))
    h, aux, *cache = Backbone(bb, name="backbone")(x, positions, batch.get("segment_ids"),
                                                   *([] if cache is None else [cache]))
    logits = project(RMSNorm(bb.norm_eps, dtype=bb.dtype, name="final_norm")(h))
    if bb.mtp_layers and not cache:
      outs, auxes = mtp_chain(bb, h, x, positions, batch.get("segment_ids"))
      logits["mtp"] = tuple(project(o) for o in outs)
      if auxes:  # the modules' MoE layers join the backbone's average
        n = bb.num_moe_layers
        aux = {key: (v * n + sum(a[key] for a in auxes)) / (n + len(auxes))
               for key, v in aux.items()}
    return (logits, aux, *cache, h) if hidden else (logits, aux, *cache)


def loss_norm(spec: OmniSpec):
  """``(batch, k) -> norm`` for gradient accumulation over ``k`` microbatches of ``batch``:
  the whole batch's target count per head, by which each microbatch's token sums are divided
  (see :func:`omni_loss`)."""
  def norm(batch, k: int):
    counts = jnp.stack([(batch["target_head"] == i).sum() for i in range(1, len(spec.heads) + 1)])
    out = {"counts": counts.astype(jnp.float32), "microbatches": k}
    if spec.backbone.mtp_layers:
      out["mtp_counts"] = mtp_counts(batch, spec.backbone.mtp_layers, len(spec.heads))
    return out
  return norm


def omni_loss(spec: OmniSpec, logits, aux, batch, norm=None):
  """Weighted per-head cross-entropy + MoE aux losses; returns (loss, metrics).

  ``norm`` (from :func:`loss_norm`): ``batch`` is one of ``k`` microbatches and the result is
  its additive share of the whole batch's. Cross-entropy and accuracy sums are divided by the
  whole batch's per-head target count, so the shares add up to the big batch's per-token
  means exactly (not to a mean of per-microbatch means); counts stay sums; the MoE terms are
  token means over equal-sized microbatches and count ``1/k`` each, which is exact for the
  z-loss and the expert load. The load-balancing loss ``E * sum_e f_e P_e`` is a product of
  two batch means, so accumulated it is the mean over microbatches of each microbatch's
  balance loss (Megatron's per-micro-batch form), not the big batch's: equal only when
  ``lb_coef = 0`` or with ``balance = 'bias'``. With MTP modules the total adds
  ``spec.mtp_loss_weight`` times their mean loss (:func:`omni_jax.models.mtp.mtp_loss`,
  logged as ``loss/mtp``; ``loss/lm`` stays the main heads' loss).
  """
  targets, head_ids = batch["targets"], batch["target_head"]
  total = jnp.zeros((), jnp.float32)
  metrics = {}
  for i, hd in enumerate(spec.heads, start=1):
    mask = head_ids == i
    if "segment_ids" in batch:  # padding never carries loss, whatever its target_head
      mask = mask & (batch["segment_ids"] > 0)
    mask = mask.astype(jnp.float32)
    tgt = jnp.clip(targets, 0, hd.size - 1)
    lg = logits[hd.name].astype(jnp.float32)  # softmax and loss in float32 at any dtype
    logz = jax.nn.logsumexp(lg, axis=-1)
    nll = logz - jnp.take_along_axis(lg, tgt[..., None], axis=-1)[..., 0]
    count = mask.sum()
    den = jnp.maximum(count if norm is None else norm["counts"][i - 1], 1.0)
    loss_h = (nll * mask).sum() / den
    acc_h = ((jnp.argmax(lg, -1) == tgt) * mask).sum() / den
    total = total + hd.weight * loss_h
    metrics[f"loss/{hd.name}"] = loss_h
    metrics[f"acc/{hd.name}"] = acc_h
    metrics[f"count/{hd.name}"] = count
  metrics["loss/lm"] = total
  if spec.backbone.mtp_layers:  # multi-token prediction (omni_jax.models.mtp)
    loss_mtp, m = mtp_loss(spec.heads, logits["mtp"], batch,
                           None if norm is None else norm["mtp_counts"])
    total = total + spec.mtp_loss_weight * loss_mtp
    metrics.update(m)
  if spec.backbone.num_moe_layers:
    if norm is not None:
      aux = {k: v / norm["microbatches"] for k, v in aux.items()}
    balance = spec.backbone.moe_balance
    if balance != "bias":
      total = total + spec.lb_coef * aux["lb_loss"]
    total = total + spec.z_coef * aux["z_loss"]
    if balance != "aux_loss":  # exactly 0; its gradient carries the load to routing_bias
      total = total + aux["balance_probe"]
    metrics["moe/load_max_over_mean"] = aux["load_imbalance"]
    metrics["moe/lb_loss"] = aux["lb_loss"]
    metrics["moe/z_loss"] = aux["z_loss"]
    metrics["moe/dropped_frac"] = aux["dropped_frac"]
    metrics["moe/expert_load"] = aux["expert_load"]
  metrics["loss"] = total
  return total, metrics


def count_params(spec: OmniSpec, params) -> tuple[int, int]:
  """(total, active per token): routed experts count k/E towards the active total."""
  total, routed = 0, 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    n = int(np.prod(leaf.shape))
    total += n
    names = [getattr(k, "key", str(k)) for k in path]
    if "moe" in names and names[-1] in ("wi_gate", "wi_up", "wo"):
      routed += n
  bb = spec.backbone
  inactive = routed * (1 - bb.top_k / bb.num_experts) if bb.num_experts else 0
  return total, int(round(total - inactive))

"""A KV-cached forward pass of :class:`~omni_jax.models.omni.OmniModel` on text/code tokens.

Reads the same parameter tree as the model (no new parameters, no change to the model's
modules): embed -> units of pre-norm blocks (attention, dense or MoE feed-forward) -> final
norm -> heads. :func:`init_cache` makes an empty cache of ``max_len`` positions per layer;
:func:`forward` runs ``tokens`` [B, T] at ``positions`` [B, T], writes their keys/values into
the cache and attends over every cached position <= its own. A prompt is one call (prefill,
T = prompt length); each decode step is one call with T = 1. A prefill may carry modality
*inputs* (the model batch's ``<m>``, ``<m>_pos``, ``<m>_mask``): the modality's encoder runs on
its own parameters and its features replace the slot tokens' embeddings, as in the model's
forward. The q/k-norm switch and other pretrained-checkpoint switches are refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from omni_jax.modalities import MODALITY_KINDS
from omni_jax.models.layers import rope, swiglu
from omni_jax.models.moe import MoE
from omni_jax.models.omni import scatter_features
from omni_jax.models.spec import OmniSpec


def _rms(x, scale, eps=1e-6):
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps) * scale


def check_supported(spec: OmniSpec) -> None:
  """Refuses a backbone whose pretrained-checkpoint switches this decode path does not
  implement yet (it would silently compute another model)."""
  bb = spec.backbone
  on = {k: getattr(bb, k) for k, off in (("qk_norm", False), ("qkv_bias", False),
                                          ("rope_scaling", None), ("shared_d_ff", 0),
                                          ("shared_gate", False), ("norm_eps", 1e-6))
        if getattr(bb, k) != off}
  if on:
    raise NotImplementedError(
        f"kv_cache decoding supports the native backbone only; these switches are set: {on} "
        "(decode such a model with the uncached forward, OmniModel.apply, for now)")


def init_cache(spec: OmniSpec, batch: int, max_len: int) -> dict:
  check_supported(spec)
  bb = spec.backbone
  shape = (bb.num_layers, batch, max_len, bb.num_kv_heads, bb.head_dim)
  return {"k": jnp.zeros(shape, bb.dtype), "v": jnp.zeros(shape, bb.dtype)}


def _attend(q, k_all, v_all, positions, max_len):
  """q [B, T, H, Dh] over cached k/v [B, S, KV, Dh]; key s visible to query t iff s <= pos."""
  b, t, h, dh = q.shape
  kv = k_all.shape[2]
  qg = (q.astype(jnp.float32) * dh ** -0.5).reshape(b, t, kv, h // kv, dh)
  sc = jnp.einsum("btkgd,bskd->btkgs", qg, k_all.astype(jnp.float32))
  visible = jnp.arange(max_len)[None, None, :] <= positions[:, :, None]  # [B, T, S]
  sc = jnp.where(visible[:, :, None, None, :], sc, -1e30)
  p = jax.nn.softmax(sc, axis=-1)
  out = jnp.einsum("btkgs,bskd->btkgd", p, v_all.astype(jnp.float32))
  return out.reshape(b, t, h, dh).astype(q.dtype)


def embed_inputs(spec: OmniSpec, params, x: jax.Array, inputs: dict | None) -> jax.Array:
  """Token embeddings ``x`` [B, T, D] with each modality of ``inputs`` encoded and scattered
  at its ``<m>_pos`` (indices into this call's T tokens) in the rows of ``<m>_mask``."""
  bb = spec.backbone
  for name, ms in spec.modalities:
    if not inputs or name not in inputs:
      continue
    kind = MODALITY_KINDS.get(ms["kind"])
    enc = kind.encoder(spec=ms, d_model=bb.d_model, dtype=bb.dtype)
    feats = enc.apply({"params": params[f"enc_{name}"]}, inputs[name])
    x = scatter_features(x, feats, inputs[f"{name}_pos"], inputs[f"{name}_mask"])
  unknown = set(inputs or {}) - {f"{n}{s}" for n, _ in spec.modalities
                                 for s in ("", "_pos", "_mask")}
  if unknown:
    raise ValueError(f"inputs {sorted(unknown)} are no modality of the model; modalities: "
                     f"{[n for n, _ in spec.modalities]}")
  return x


def forward(spec: OmniSpec, params, cache: dict, tokens: jax.Array, positions: jax.Array,
            inputs: dict | None = None):
  """(logits per head {name: [B, T, size]}, updated cache) for ``tokens`` at ``positions``;
  ``inputs``: modality inputs of this call's tokens (see :func:`embed_inputs`)."""
  check_supported(spec)
  bb = spec.backbone
  max_len = cache["k"].shape[2]
  x = params["embed"]["embedding"].astype(bb.dtype)[tokens]
  x = embed_inputs(spec, params, x, inputs)
  units = params["backbone"]["units"]
  rows = jnp.arange(tokens.shape[0])[:, None]
  ks, vs = [], []
  layer = 0
  for u in range(bb.num_units):
    for i in range(bb.unit_size):
      p = jax.tree.map(lambda a, u=u: a[u], units[f"layer_{i}"])
      h = _rms(x, p["ln_attn"]["scale"]).astype(bb.dtype)
      a = p["attn"]
      proj = lambda w, h=h: jnp.einsum("btd,dhk->bthk", h, w["kernel"].astype(bb.dtype))
      q = rope(proj(a["q"]), positions, bb.rope_theta)
      k = rope(proj(a["k"]), positions, bb.rope_theta)
      v = proj(a["v"])
      k_all = cache["k"][layer].at[rows, positions].set(k)
      v_all = cache["v"][layer].at[rows, positions].set(v)
      ks.append(k_all)
      vs.append(v_all)
      out = _attend(q, k_all, v_all, positions, max_len)
      x = x + jnp.einsum("bthk,hkd->btd", out, a["o"]["kernel"].astype(bb.dtype))
      h = _rms(x, p["ln_mlp"]["scale"]).astype(bb.dtype)
      if "moe" in p:
        y, _ = MoE(d_model=bb.d_model, d_ff=bb.moe_d_ff, num_experts=bb.num_experts,
                   top_k=bb.top_k, renormalize=bb.renormalize, impl=bb.moe_impl,
                   capacity_factor=bb.capacity_factor, num_shared_experts=bb.shared_experts,
                   dtype=bb.dtype).apply({"params": p["moe"]}, h)
      else:
        m = p["mlp"]
        y = swiglu(h, *(m[n]["kernel"].astype(bb.dtype) for n in ("wi_gate", "wi_up", "wo")))
      x = x + y
      layer += 1
  h = _rms(x, params["final_norm"]["scale"]).astype(bb.dtype)
  logits = {hd.name: (h @ params[f"head_{hd.name}"]["kernel"].astype(bb.dtype)
                      ).astype(jnp.float32) for hd in spec.heads}
  return logits, {"k": jnp.stack(ks), "v": jnp.stack(vs)}

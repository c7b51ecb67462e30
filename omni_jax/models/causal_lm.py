"""A plain decoder-only language model around the omni :class:`Backbone`.

Token embedding -> backbone -> final RMSNorm -> vocabulary logits, with the omni model's
parameter names (``embed/embedding``, ``backbone/...``, ``final_norm/scale``,
``head_text/kernel``), so the same parallel recipe places it and an imported Hugging Face
checkpoint (:mod:`omni_jax.hf`) maps onto either model. ``tied``: the output projection is the
transposed embedding (no ``head_text``). With ``spec.mtp_layers`` the multi-token prediction
modules ``mtp_<k>`` (:mod:`omni_jax.models.mtp`, a DeepSeek-V3 checkpoint's
``model.layers.<num_layers + k>``) are built at init and run when ``mtp=True``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from omni_jax.models.layers import RMSNorm
from omni_jax.models.mtp import mtp_chain
from omni_jax.models.transformer import Backbone, BackboneSpec


class CausalLM(nn.Module):
  spec: BackboneSpec
  vocab_size: int
  tied: bool = False

  @nn.compact
  def __call__(self, tokens: jax.Array, cache=None, mtp: bool = False):
    """``tokens`` int32 [B, T] -> float32 logits [B, T, vocab_size]. With a
    :class:`~omni_jax.models.kv_cache.KVCache` (decoding): the tokens go at the cache's next
    T slots, at its rotary positions; returns (logits, updated cache). ``mtp`` (no cache):
    returns (logits, the MTP depths' logits, a tuple)."""
    s = self.spec
    b, t = tokens.shape
    embed = nn.Embed(self.vocab_size, s.d_model, dtype=s.dtype,
                     embedding_init=nn.initializers.normal(1.0), name="embed")
    x = embed(tokens)
    if cache is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
      h, _ = Backbone(s, name="backbone")(x, positions)
    else:
      h, _, cache = Backbone(s, name="backbone")(x, cache.positions(t), None, cache)
    head = (None if self.tied else
            nn.Dense(self.vocab_size, use_bias=False, dtype=s.dtype, name="head_text"))
    project = lambda z: (embed.attend(z) if self.tied else head(z)).astype(jnp.float32)
    logits = project(RMSNorm(s.norm_eps, dtype=s.dtype, name="final_norm")(h))
    if cache is not None:
      return logits, cache
    if s.mtp_layers and (mtp or self.is_initializing()):
      outs, _ = mtp_chain(s, h, x, positions)
      if mtp:
        return logits, tuple(project(o) for o in outs)
    return (logits, ()) if mtp else logits

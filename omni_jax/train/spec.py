"""Builds the omni model's :class:`~omni_jax.models.spec.OmniSpec` from ``config.model``:
the backbone (validated by :func:`~omni_jax.models.spec.backbone_spec`, or read from a
pretrained checkpoint with ``init_from``), the modalities (resolved against their kinds) and
the text tokenizer. It sits above models, modalities, data and hf, which it wires together."""

from __future__ import annotations

from omni_jax.common.config import ConfigError, require
from omni_jax.data.bpe import make_tokenizer
from omni_jax.hf.omni_init import pretrained_backbone
from omni_jax.modalities import resolve_spec
from omni_jax.modalities.sources import check_sources
from omni_jax.models.spec import Head, OmniSpec, backbone_spec
from omni_jax.tokenizers import omni_codes


def resolve_modality(name: str, raw) -> dict:
  """A modality's config merged over its kind's defaults and validated; with ``tokenizer``
  set, its codebook size and code vectors come from that trained codec."""
  spec = resolve_spec(name, raw)
  if spec["tokenizer"]:
    omni_codes.resolve(spec, f"model.modalities.{name}.")
  return spec


def build_spec(model_cfg, tokenizer: str = "bytes") -> OmniSpec:
  """Validates ``config.model`` and returns the :class:`OmniSpec`; errors name the key.

  ``tokenizer`` is ``config.data.tokenizer``: its vocabulary size sets ``text_vocab``. With
  ``model.init_from`` the checkpoint's own tokenizer is used instead (its embedding rows only
  mean something with its ids), so ``tokenizer`` must then stay ``bytes`` (the default).
  """
  backbone, moe = backbone_spec(model_cfg)
  raw_mods = model_cfg["modalities"]
  mods = tuple((name, resolve_modality(name, raw_mods[name])) for name in sorted(raw_mods))
  check_sources(mods)
  init_from = model_cfg.get("init_from", "") or ""
  if init_from:
    require(str(tokenizer) in ("bytes", ""), "data.tokenizer", tokenizer,
            f"must stay 'bytes' when model.init_from={init_from!r}: the pretrained "
            "checkpoint's own tokenizer.json is used for text")
    backbone, tok = pretrained_backbone(init_from, backbone, [n for n, _ in mods])
  else:
    try:
      tok = make_tokenizer(tokenizer, [n for n, _ in mods])
    except ValueError as e:
      raise ConfigError(f"config.data.tokenizer: {e}") from None
  offsets, heads, nxt = [], [Head("text", tok.vocab_size, float(model_cfg["text_loss_weight"]))], \
      tok.vocab_size
  for name, ms in mods:
    if ms["codebook_size"]:
      offsets.append((name, nxt))
      heads.append(Head(name, ms["codebook_size"], float(ms["gen_loss_weight"])))
      nxt += ms["codebook_size"]
  return OmniSpec(backbone=backbone, modalities=mods, text_vocab=tok.vocab_size,
                  code_offsets=tuple(offsets), input_vocab=-(-nxt // 128) * 128,
                  heads=tuple(heads), lb_coef=moe["lb_coef"], z_coef=moe["z_coef"],
                  tokenizer_source=init_from or str(tokenizer), init_from=init_from,
                  text_tokenizer=tok,
                  bias_rate=moe["bias_rate"] if backbone.num_moe_layers
                  and moe["balance"] != "aux_loss" else 0.0,
                  ep_capacity_factor=moe["ep_capacity_factor"],
                  mtp_loss_weight=moe["mtp_loss_weight"] if backbone.mtp_layers else 0.0)



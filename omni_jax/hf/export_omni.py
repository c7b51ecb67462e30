"""Export of a trained omni model (on a pretrained backbone) as a Hugging Face checkpoint.

:func:`export_omni` writes into ``out_dir``:

* the backbone as a ``transformers`` checkpoint of the source family
  (:func:`~omni_jax.hf.export.export`: ``config.json`` + safetensors shards) whose vocabulary
  is the omni model's *extended* one: ``vocab_size = text_vocab + sum(codebook sizes)``.
  ``model.embed_tokens`` holds the embedding's first ``vocab_size`` rows (text ids, the omni
  specials, then each generated modality's codes at its ``code_offset``; the rows the
  embedding pads up to a multiple of 128 are dropped) and ``lm_head`` the text head with each
  code head after it — so transformers' logits are the omni model's joint logits
  (:func:`~omni_jax.generate.decode.joint_logits`) on the same ids. ``config.json`` also
  carries ``bos/eos/pad_token_id`` (the omni ``<bos>``; ``<eos>`` plus the source's own EOS
  ids, which end chat turns; ``<pad>``) and ``max_position_embeddings`` (the source's);
* ``tokenizer.json``: the source's with added special tokens at their omni ids
  (``<|omni_unused_i|>`` for ids the source tokenizer does not use below its embedding size,
  ``<pad> <bos> <eos>``, each modality's ``<m> </m> <m:slot> <m:gen>``, then the codes as
  ``<m:code:c>``); ``tokenizer_config.json`` with the chat template the run trained with
  (:class:`~omni_jax.data.chat.ChatFormat`); ``generation_config.json``;
* ``omni_modalities.safetensors``: every other parameter — modality encoders and projectors
  (``enc_<m>.*``) and the code heads (``head_<m>.kernel`` ``[d_model, codebook_size]``, also
  inside ``lm_head``) — named by the parameter path with ``/`` as ``.``, in our layout
  (kernels ``[in, out]``); its header metadata ``omni`` (and ``omni_config.json``) holds the
  modalities' config, ``text_vocab``, ``code_offsets`` and the special ids.
"""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import save_file

from omni_jax.data.chat import ChatFormat
from omni_jax.hf import export as export_lib
from omni_jax.hf.families import HFModel
from omni_jax.hf.load import Checkpoint

SIDECAR = "omni_modalities.safetensors"
OMNI_CONFIG = "omni_config.json"
UNUSED = "<|omni_unused_{}|>"


def code_token(m: str, c: int) -> str:
  return f"<{m}:code:{c}>"


def vocab_size(spec) -> int:
  """Text ids, specials and every code: the exported vocabulary (contiguous code offsets)."""
  nxt = spec.text_vocab
  for (name, off), hd in zip(spec.code_offsets, spec.heads[1:], strict=True):
    if off != nxt:
      raise ValueError(f"code offsets are not contiguous: {name} at {off}, expected {nxt}")
    nxt += hd.size
  return nxt


def token_names(spec) -> list[str]:
  """Names of the ids the exported tokenizer adds, from the source embedding size on."""
  tok = spec.tokenizer
  names = list(tok.special_names)
  for hd in spec.heads[1:]:
    names += [code_token(hd.name, c) for c in range(hd.size)]
  return names


def write_tokenizer(spec, ck: Checkpoint, out_dir: str, chat: ChatFormat) -> dict:
  """``tokenizer.json`` (the source's plus the omni tokens at their ids) and
  ``tokenizer_config.json``; returns the special ids."""
  from tokenizers import AddedToken, Tokenizer  # the hf extra, as for import
  tok = spec.tokenizer
  src = Tokenizer.from_file(os.path.join(ck.directory, "tokenizer.json"))
  have = src.get_vocab_size(with_added_tokens=True)
  fill = [UNUSED.format(i) for i in range(have, tok.base_vocab_size)]
  names = fill + token_names(spec)
  src.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
  for i, n in enumerate(names):
    if src.token_to_id(n) != have + i:
      raise ValueError(f"the source tokenizer gave {n!r} id {src.token_to_id(n)}, expected "
                       f"{have + i}: its added tokens are not contiguous")
  src.save(os.path.join(out_dir, "tokenizer.json"))
  cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
         "pad_token": "<pad>", "bos_token": chat.bos_token or "<bos>",
         "eos_token": chat.eos_token or "<eos>", "chat_template": chat.template,
         "model_max_length": int(ck.config.get("max_position_embeddings") or 1 << 30)}
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump(cfg, f, indent=2)
  eos = [tok.eos_id]
  src_eos = ck.config.get("eos_token_id")
  for e in (src_eos if isinstance(src_eos, list) else [src_eos]):
    if isinstance(e, int) and e not in eos:
      eos.append(e)
  return {"bos_token_id": tok.bos_id, "eos_token_id": eos, "pad_token_id": tok.pad_id}


def export_omni(spec, params: dict[str, np.ndarray], ck: Checkpoint, out_dir: str,
                dtype: str = "float32", max_shard_bytes: int = 2 << 30) -> dict:
  """Writes the files of the module docstring. ``params``: the omni model's parameters by
  ``/``-joined path (LoRA merged); ``ck``: the source checkpoint (family, tokenizer)."""
  os.makedirs(out_dir, exist_ok=True)
  v = vocab_size(spec)
  model = HFModel(ck.model.family, spec.backbone, v, False, dtype)
  heads = ["head_text/kernel"] + [f"head_{hd.name}/kernel" for hd in spec.heads[1:]]

  def get_leaf(path):
    if path == "embed/embedding":
      return np.asarray(params[path])[:v]
    if path == "head_text/kernel":
      return np.concatenate([np.asarray(params[h]) for h in heads], axis=1)
    return params[path]
  chat = ChatFormat.for_tokenizer(spec.tokenizer)
  ids = write_tokenizer(spec, ck, out_dir, chat)
  extra = {**ids, "max_position_embeddings": int(ck.config.get("max_position_embeddings")
                                                 or 1 << 15)}
  out = export_lib.export(model, get_leaf, out_dir, dtype=dtype,
                          max_shard_bytes=max_shard_bytes, extra_config=extra)
  with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
    json.dump({**ids, "do_sample": False}, f, indent=2)
  in_lm = {lf.path for lf in export_lib.leaf_table(model)}
  side = {p.replace("/", "."): np.ascontiguousarray(np.asarray(x, np.float32))
          for p, x in params.items() if p not in in_lm and p != "embed/embedding"}
  meta = {"text_vocab": spec.text_vocab, "vocab_size": v,
          "code_offsets": dict(spec.code_offsets),
          "codebook_sizes": {hd.name: hd.size for hd in spec.heads[1:]},
          "special_ids": dict(zip(spec.tokenizer.special_names,
                                  range(spec.tokenizer.base_vocab_size, spec.text_vocab),
                                  strict=True)),
          "modalities": {m: {k: (list(x) if isinstance(x, tuple) else x) for k, x in ms.items()}
                         for m, ms in spec.modalities},
          "chat_template_source": chat.source}
  text = json.dumps(meta, indent=2, default=str)
  save_file(side, os.path.join(out_dir, SIDECAR), metadata={"format": "omni_jax", "omni": text})
  with open(os.path.join(out_dir, OMNI_CONFIG), "w") as f:
    f.write(text)
  return {**out, "vocab_size": v, "sidecar_tensors": len(side),
          "files": out["files"] + [SIDECAR]}

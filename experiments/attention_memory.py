r"""Compiled memory of a long sequence's attention gradient: flash backward vs the scan.

  python -m experiments.attention_memory --workdir=/tmp/attn_mem

Compile only (nothing runs): ``jax.grad`` of causal grouped-query attention over one
sequence of --seq_len tokens, three ways — dense ``jax.nn.dot_product_attention``, blockwise
with the scan differentiated (every key block's softmax state kept), and blockwise with the
flash-style custom VJP (output and log-sum-exp kept, blocks recomputed backward). Writes
summary.json with each one's ``memory_analysis`` temp bytes and ``flash_over_scan``.
"""

from __future__ import annotations

import os

from absl import flags, logging

from experiments import common

_WORKDIR = common.define_workdir("where summary.json goes")
_SEQ = flags.DEFINE_integer("seq_len", 16384, "tokens in the sequence")
_BLOCK = flags.DEFINE_integer("block", 512, "key (and, flash, query) block size")
_HEADS = flags.DEFINE_integer("heads", 8, "query heads")
_KV = flags.DEFINE_integer("kv_heads", 2, "key/value heads")
_DH = flags.DEFINE_integer("head_dim", 64, "head dimension")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  del argv
  common.setup_devices()
  from omni_jax.common.metrics import write_json_atomic
  from omni_jax.models.blockwise import grad_memory_bytes

  shape = dict(seq_len=_SEQ.value, heads=_HEADS.value, kv_heads=_KV.value,
               head_dim=_DH.value, block=_BLOCK.value)
  out = dict(shape)
  for name, flash in (("dense", None), ("scan", False), ("flash", True)):
    out[name] = grad_memory_bytes(**shape, flash=flash)
    logging.info("%-6s temp %.3g B", name, out[name]["temp_bytes"])
  out["flash_over_scan"] = out["flash"]["temp_bytes"] / out["scan"]["temp_bytes"]
  out["flash_over_dense"] = out["flash"]["temp_bytes"] / out["dense"]["temp_bytes"]
  logging.info("flash / scan temp memory: %.4f", out["flash_over_scan"])
  os.makedirs(_WORKDIR.value, exist_ok=True)
  write_json_atomic(os.path.join(_WORKDIR.value, "summary.json"), out)


if __name__ == "__main__":
  common.run(main)

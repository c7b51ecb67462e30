r"""Convert a Hugging Face decoder checkpoint to the omni backbone and back.

  python -m experiments.convert_hf --hf_dir=DIR --workdir=W            # import
  python -m experiments.convert_hf --export --workdir=W --hf_out=DIR2  # export
  python -m experiments.convert_hf --export --workdir=RUN --hf_out=DIR3  # a train_omni run

Import writes ``W/params/`` (an orbax item per parameter, streamed: one parameter in memory
at a time), ``W/hf_config.json`` and ``W/summary.json`` with ``family``, ``params``,
``seconds``, ``peak_rss_bytes`` (measured after the conversion, before the optional check)
and ``logits_max_abs_diff_vs_transformers`` (float32 logits of the converted parameters vs
``transformers`` on random tokens; null when torch / transformers are not installed or with
``--nocheck_logits``). Export writes a checkpoint ``transformers`` loads as is, and
``W/export_summary.json``; from a ``train_omni`` workdir (one with ``checkpoints/``) it writes
the trained omni model: backbone with the extended vocabulary (LoRA merged), tokenizer files
and the modality encoders beside it (:mod:`omni_jax.hf.export_omni`).
"""

import os

from absl import app, flags, logging

from experiments import common

_HF_DIR = flags.DEFINE_string("hf_dir", None, "Hugging Face checkpoint directory to import")
_WORKDIR = common.define_workdir("where the converted checkpoint and summary.json go")
_EXPORT = flags.DEFINE_bool("export", False, "export --workdir to --hf_out instead")
_HF_OUT = flags.DEFINE_string("hf_out", None, "output directory of --export")
_DTYPE = flags.DEFINE_string("dtype", None, "export dtype (float32, bfloat16, float16; "
                             "default: the source checkpoint's)")
_SHARD_MB = flags.DEFINE_integer("max_shard_mb", 2048, "export: largest safetensors shard (MiB)")
_LAYOUT = flags.DEFINE_string("layout", "", "import placement, e.g. 'fsdp=4+expert=2' (default: "
                              "one device)")
_SKIP = flags.DEFINE_bool("skip_unmapped", False, "import: leave out checkpoint tensors the "
                          "importer has no place for (listed in summary.json) instead of "
                          "stopping with their list")
_CHECK = flags.DEFINE_bool("check_logits", True, "compare logits with transformers when "
                           "torch and transformers are installed")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  del argv
  common.setup_devices()
  from omni_jax.common.metrics import write_json_atomic
  from omni_jax.hf import convert, reference
  from omni_jax.parallel import layout
  from omni_jax.parallel import mesh as mesh_lib
  workdir = _WORKDIR.value
  if _EXPORT.value:
    if not _HF_OUT.value:
      raise app.UsageError("--export needs --hf_out=DIR")
    from omni_jax.common.config import ConfigError
    from omni_jax.train import export_hf
    if export_hf.is_train_workdir(workdir):
      try:
        out = export_hf.export_workdir(workdir, _HF_OUT.value, _DTYPE.value,
                                       _SHARD_MB.value << 20)
      except ConfigError as e:
        raise app.UsageError(str(e)) from None
    else:
      try:
        out = convert.export_from_orbax(workdir, _HF_OUT.value, _DTYPE.value,
                                        _SHARD_MB.value << 20)
      except FileNotFoundError as e:
        raise app.UsageError(f"{e}; or give a train_omni workdir (one with checkpoints/)"
                             ) from None
    out["peak_rss_bytes"] = convert.peak_rss_bytes()
    write_json_atomic(os.path.join(workdir, "export_summary.json"), out)
    logging.info("exported %d tensors in %d files to %s", out["tensors"], len(out["files"]),
                 _HF_OUT.value)
    return
  if not _HF_DIR.value:
    raise app.UsageError("import needs --hf_dir=DIR (or --export --hf_out=DIR)")
  mesh = None
  if _LAYOUT.value:
    sizes, _ = layout.parse_layout(_LAYOUT.value)
    mesh = mesh_lib.make_mesh(sizes)
  os.makedirs(workdir, exist_ok=True)
  summary = convert.import_to_orbax(_HF_DIR.value, workdir, mesh, skip_unmapped=_SKIP.value)
  summary["peak_rss_bytes"] = convert.peak_rss_bytes()
  summary["logits_max_abs_diff_vs_transformers"] = None
  if _CHECK.value and reference.available():
    import numpy as np
    ck, model, params = convert.restore_params(workdir, mesh)
    tokens = reference.check_tokens(ck.model.vocab_size)
    diff = np.abs(reference.jax_logits(model, params, tokens)
                  - reference.transformers_logits(_HF_DIR.value, tokens)).max()
    summary["logits_max_abs_diff_vs_transformers"] = float(diff)
  elif _CHECK.value:
    logging.warning("logits check skipped: torch / transformers not installed (%s)",
                    reference.INSTALL)
  write_json_atomic(os.path.join(workdir, "summary.json"), summary)
  logging.info("converted %s (%d params) in %.1f s, peak RSS %.2f GB; summary in %s",
               summary["family"], summary["params"], summary["seconds"],
               summary["peak_rss_bytes"] / 1e9, os.path.join(workdir, "summary.json"))


if __name__ == "__main__":
  common.run(main)

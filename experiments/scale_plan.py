r"""Scale on paper, checked by the compiler: the omni MoE train step at 30B for 128 devices.

  python -m experiments.scale_plan --config=configs/omni_moe.py:omni30b --workdir=/tmp/plan

For each candidate layout the train step (forward, backward, AdamW update) is lowered and
compiled — never run — from abstract inputs (``jax.ShapeDtypeStruct`` with shardings:
nothing is allocated) on 128 emulated CPU devices. The report gives per-device memory from
``compiled.memory_analysis()`` against an 80 GB and a 141 GB GPU, the model FLOPs per token
(``omni_jax.models.flops``), and a roofline step time on H100 numbers from the compiled
program's own FLOPs, HBM bytes and collective bytes (``omni_jax.reports.scale_plan``:
constants and overlap model), which gives the modelled tokens/s/GPU — beside the seed's
2,800 tokens/s/GPU on 128 GPUs.

Layouts: ``[recipe:]axis=size+...[@op]``; ``omni_zero3:`` shards the state over every data
axis; ``data=2+sequence=8+fsdp=8`` is HSDP (the state FSDP-split inside each node, whole
replicas across the ``data`` groups); every layout runs ``config.data.batch_size`` sequences
(gradient accumulation where its batch axes hold fewer); the axes are listed outermost
first, the last ones filling a node of 8 GPUs (which
links a collective crosses). CPU compilation stands in for the GPU compiler: buffer sizes
follow the same shardings, but XLA:CPU fuses differently, so treat memory and HBM bytes as
estimates (the collectives and parameter shards are exact). summary.json: ``layouts``
(``name``, ``mesh``, ``per_device_bytes``, ``fits_80gb``, ``fits_141gb``, ``flops_per_token``,
``roofline`` {``compute_s``, ``memory_s``, ``network_s``, ``step_s``, ...},
``predicted_tokens_per_sec_per_gpu``, ...), ``hardware``, ``params_total``, ``params_active``.
"""

from __future__ import annotations

import os
import re

from absl import flags, logging

from experiments import common
from omni_jax.reports.scale_plan import (
    GB,
    H100,
    OVERLAPPED_KINDS,
    SEED_TOKENS_PER_SEC_PER_GPU,
    host_batch,
    plan_layout,
    plot_plan,
)

_CONFIG = common.define_config("configs/omni_moe.py:omni30b",
                                          lock_config=False)
_WORKDIR = common.define_workdir("where summary.json and scale_plan.png go")
_LAYOUTS = flags.DEFINE_list(
    "layouts", ["fsdp=16+sequence=8", "omni_zero3:fsdp=16+sequence=8",
                "omni_zero3:fsdp=2+expert=8+sequence=8", "omni_zero3:fsdp=2+sequence=8+expert=8",
                "omni_zero3:fsdp=4+sequence=4+expert=8", "omni_zero3:tensor=4+fsdp=4+sequence=8",
                "data=2+sequence=8+fsdp=8"],  # HSDP: FSDP inside a node, replicas across
    "candidate layouts: [recipe:]'+'-joined axis=size items (outermost first: the last "
    "ones fill a node), optional '@ring'; comma-separated")
_MFU = flags.DEFINE_float("mfu", 0.35, "an assumed MFU, for the comparison figures "
                          "tokens_per_sec_per_gpu_at_mfu (the prediction is the roofline's)")
_SAVE_HLO = flags.DEFINE_bool("save_hlo", False, "also write each layout's compiled HLO text "
                              "into the workdir (to rerun the cost analysis without compiling)")
flags.mark_flags_as_required(["config", "workdir"])



def main(argv):
  del argv
  if not flags.FLAGS["cpu_devices"].present:
    flags.FLAGS.cpu_devices = 128
  common.setup_devices()
  import jax

  from omni_jax.common.metrics import write_json_atomic
  from omni_jax.models.omni import OmniModel, count_params
  from omni_jax.train.optim import make_optimizer
  from omni_jax.train.spec import build_spec

  config, workdir = _CONFIG.value, _WORKDIR.value
  if not 0 < _MFU.value <= 1:
    raise flags.ValidationError(f"--mfu={_MFU.value} must be in (0, 1]")
  if not config.train.peak_flops:
    raise flags.ValidationError("config.train.peak_flops must name the target GPU's peak "
                                "FLOP/s (e.g. 989e12 for an H100 in bf16)")
  os.makedirs(workdir, exist_ok=True)
  spec = build_spec(config.model)
  model = OmniModel(spec)
  tx = make_optimizer(config.optim, config.train.steps)
  rows = []
  for text in _LAYOUTS.value:
    logging.info("compiling %s on %d devices ...", text, jax.device_count())
    try:
      hlo = os.path.join(workdir, re.sub(r"[^\w=+@.-]", "_", text) + ".hlo.txt")
      row = plan_layout(config, text, spec, model, tx, _MFU.value,
                        hlo if _SAVE_HLO.value else None)
    except ValueError as e:  # a layout this model cannot take: say why, keep the others
      row = {"name": text, "error": str(e)}
      logging.warning("%s: %s", text, e)
    else:
      roof = row["roofline"]
      logging.info("%-40s %6.1f GB/device  fits 80GB %-5s  roofline: compute %.2f s, memory "
                   "%.2f s, network %.2f s (exposed %.2f s) -> step %.2f s, %.0f tok/s/GPU "
                   "(modelled; compiled in %.0f s)", text, row["per_device_bytes"] / GB,
                   row["fits_80gb"], roof["compute_s"], roof["memory_s"], roof["network_s"],
                   roof["network_exposed_s"], roof["step_s"],
                   row["predicted_tokens_per_sec_per_gpu"], row["compile_s"])
    rows.append(row)
    write_json_atomic(os.path.join(workdir, "summary.json"), _summary(config, spec, rows))
  summary = _summary(config, spec, rows)
  abstract_params = jax.eval_shape(lambda k, b: model.init(k, b)["params"],
                                   jax.random.PRNGKey(0), host_batch(spec, config))
  summary["params_total"], summary["params_active"] = count_params(spec, abstract_params)
  write_json_atomic(os.path.join(workdir, "summary.json"), summary)
  plot_plan([r for r in rows if "error" not in r], os.path.join(workdir, "scale_plan.png"),
            _MFU.value)
  logging.info("params: %.2fB total, %.2fB active; summary in %s",
               summary["params_total"] / 1e9, summary["params_active"] / 1e9, workdir)


def _summary(config, spec, rows) -> dict:
  return {"layouts": rows, "mfu": _MFU.value, "peak_flops_per_sec": config.train.peak_flops,
          "hardware": H100, "overlapped_kinds": list(OVERLAPPED_KINDS),
          "predicted_is": "modelled: roofline of the compiled program on H100 numbers",
          "seq_len": config.data.seq_len, "devices": flags.FLAGS.cpu_devices,
          "seed_tokens_per_sec_per_gpu": SEED_TOKENS_PER_SEC_PER_GPU,
          "config": config.to_dict()}


if __name__ == "__main__":
  common.run(main)

"""Flags and set-up shared by every experiment's absl main.

Multi-host: under SLURM (srun), Open MPI (mpirun) or on a Cloud TPU slice, start the same
command in every process with no launch flag: ``jax.distributed.initialize()`` reads the
coordinator, process count and id from the environment. Elsewhere give
``--coordinator_address=HOST:PORT --num_processes=N --process_id=I``. Each process sees its
local devices, the mesh spans all of them, and only process 0 writes records (checkpoints
are written by all, sharded). With no flag and no cluster: one process. See docs/cluster.md
and omni_jax/parallel/cluster.py.
"""

from __future__ import annotations

import logging as pylogging
import os
import sys

from absl import flags, logging
from ml_collections.config_flags import config_flags

from omni_jax.common.config import UserError
from omni_jax.parallel import cluster

_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", 8, "emulated devices per process when running on CPU (ignored on GPU/TPU)")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "HOST:PORT of process 0 for a multi-process job; 'auto': let "
    "jax.distributed.initialize() read the cluster environment; unset: auto-detect SLURM, "
    "Open MPI or Cloud TPU, else one process")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "processes in a multi-process job (with --coordinator_address; "
    "default 1)")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "this process's index in [0, num_processes) (default 0)")


class _QuietLibraries(pylogging.Filter):
  """Drops INFO chatter of libraries (orbax logs every checkpoint step in detail)."""

  def filter(self, record: pylogging.LogRecord) -> bool:
    return record.levelno >= pylogging.WARNING or "/orbax/" not in record.pathname


def register_config() -> None:
  """Hands the parsed ``--config`` (if this main has one) to the TensorBoard writers, which
  record it as text beside the job's metrics and figures."""
  if "config" in flags.FLAGS and flags.FLAGS["config"].value is not None:
    from omni_jax.common import tensorboard
    tensorboard.set_run_config(flags.FLAGS["config"].value)


def setup_devices() -> None:
  """Emulated CPU devices and multi-process initialisation; call before JAX computes. Also
  registers the run's config for TensorBoard (:func:`register_config`)."""
  import jax
  register_config()
  for handler in pylogging.getLogger().handlers + [logging.get_absl_handler()]:
    handler.addFilter(_QuietLibraries())
  n = _CPU_DEVICES.value
  if n < 1:
    raise flags.ValidationError(f"--cpu_devices must be >= 1, got {n}")
  on_cpu = os.environ.get("JAX_PLATFORMS", "") in ("", "cpu")
  if on_cpu:
    jax.config.update("jax_num_cpu_devices", n)
  # With a persistent compilation cache (JAX_COMPILATION_CACHE_DIR), a key without op-name
  # metadata would hand back another program's named scopes, which the wire-byte and
  # per-scope FLOP reports read.
  jax.config.update("jax_compilation_cache_include_metadata_in_key", True)
  try:
    launch = cluster.decide_launch(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  except ValueError as e:
    raise flags.ValidationError(str(e)) from e
  if launch.mode == "auto":
    logging.info("multi-process launch: jax.distributed.initialize() reads the %s environment",
                 launch.cluster or "cluster")
  cluster.initialize(launch, on_cpu)
  logging.info("JAX %s on %s: process %d/%d, %d local / %d global devices", jax.__version__,
               jax.default_backend(), jax.process_index(), jax.process_count(),
               jax.local_device_count(), jax.device_count())


class _SharedFlag:
  """A flag another experiment module already defined (tests import several of them into
  one process; only the ``__main__`` module's flags are ever parsed)."""

  def __init__(self, name: str):
    self.name = name

  @property
  def value(self):
    return flags.FLAGS[self.name].value


class _ConfigWithModalities:
  """``--config`` as the main reads it: the parsed config with every ``--modality`` applied
  (once, before the first read)."""

  def __init__(self):
    self._applied: int | None = None

  @property
  def value(self):
    cfg = flags.FLAGS["config"].value
    if cfg is not None and self._applied != id(cfg):
      apply_modality_flags(cfg, flags.FLAGS["modality"].value)
      self._applied = id(cfg)
    return cfg


class _CleanConfigParser(config_flags.ConfigFileFlagParser):
  """ml_collections' config-file parser, whose error for a bad ``--config`` (an unknown
  variant, a file that does not load) is the config's own message, not a traceback."""

  def parse(self, path):
    try:
      config = super().parse(path)
    except (TypeError, ValueError) as e:
      cause = e.__context__ if e.__context__ is not None else e
      raise type(e)(f"{cause}") from None
    if type(config).__name__ == "_ErrorConfig":  # the file did not load (kept for later)
      raise ValueError(f"cannot load the config file {path.split(':', 1)[0]!r}: expected "
                       "configs/<job>.py:<variant> relative to the repository root")
    return config


def define_config(help_text: str, **kwargs):
  """``--config`` (an ml_collections config file) and the repeatable ``--modality`` flag,
  defined once per process."""
  if "config" not in flags.FLAGS:
    config_flags.DEFINE_config_file("config", None, help_text, **kwargs)
    flags.FLAGS["config"].parser = _CleanConfigParser(
        name="config", lock_config=kwargs.get("lock_config", True))
    flags.DEFINE_multi_string(
        "modality", [], "NAME='{json}' adds or replaces config.model.modalities.NAME (e.g. "
        "thermal='{\"kind\": \"patch\", \"size\": [16, 16], \"channels\": 1}'); "
        "NAME=none removes it; repeatable")
  return _ConfigWithModalities()


def parse_modality_flag(text: str) -> tuple[str, dict | None]:
  """``NAME={json}`` -> (NAME, spec) and ``NAME=none`` -> (NAME, None); a malformed value is
  a ``ValueError`` naming what is wrong and the allowed forms."""
  import json
  forms = "allowed: --modality=NAME='{\"kind\": ...}' or --modality=NAME=none"
  name, sep, raw = text.partition("=")
  name = name.strip()
  if not sep or not name.isidentifier() or not name.islower():
    raise ValueError(f"--modality={text!r}: expected a lower-case NAME before '='; {forms}")
  if raw.strip().lower() == "none":
    return name, None
  try:
    spec = json.loads(raw)
  except json.JSONDecodeError as e:
    raise ValueError(f"--modality={text!r}: the value is not JSON ({e.msg} at column "
                     f"{e.colno}); {forms}") from None
  if not isinstance(spec, dict):
    raise ValueError(f"--modality={text!r}: the value must be a JSON object; {forms}")
  return name, spec


def apply_modality_flags(cfg, values: list[str]) -> None:
  """Adds, replaces or removes ``cfg.model.modalities.NAME`` for each ``--modality`` value,
  validating each new modality against its kind (unknown kind or key: one clear message,
  exit code 2, no traceback)."""
  if not values:
    return
  from omni_jax.common.config import ConfigError
  from omni_jax.modalities.base import resolve_spec
  try:
    mods = cfg.model.modalities
  except (AttributeError, KeyError):
    raise SystemExit("--modality: this job's config has no model.modalities (only jobs on an "
                     "omni config, configs/omni_moe.py, take --modality)") from None
  try:
    for text in values:
      name, spec = parse_modality_flag(text)
      with cfg.unlocked():
        if spec is None:
          if name not in mods:
            raise ValueError(f"--modality={text!r}: no modality {name!r} to remove; the "
                             f"config has {sorted(mods.keys())}")
          del mods[name]
        else:
          resolve_spec(name, spec)
          mods[name] = spec
  except (ValueError, ConfigError) as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None


def define_workdir(help_text: str = "output folder"):
  """``--workdir``, defined once per process."""
  if "workdir" in flags.FLAGS:
    return _SharedFlag("workdir")
  return flags.DEFINE_string("workdir", None, help_text)


def define_profile_steps():
  """``--profile_steps=a:b`` (a ``jax.profiler`` trace of steps a..b under WORKDIR/profile),
  defined once per process."""
  if "profile_steps" in flags.FLAGS:
    return _SharedFlag("profile_steps")
  return flags.DEFINE_string(
      "profile_steps", None, "a:b: write a jax.profiler trace of steps a..b (from 1) under "
      "WORKDIR/profile; overrides config.train.profile_steps")


def run(main) -> None:
  """``absl.app.run(main)`` for an experiment: a mistake in the user's input (a
  :class:`~omni_jax.common.config.UserError`: a config value, a file, a prompt, a checkpoint)
  ends the run with its message on stderr and exit status 2, no traceback."""
  from absl import app

  from omni_jax.common import gc_policy
  gc_policy.for_tracing()  # the main's imports are done: frozen; fewer collector passes

  def guarded(argv):
    try:
      return main(argv)
    except (UserError, flags.ValidationError) as e:
      logging.flush()
      print(f"error: {e}", file=sys.stderr)
      raise SystemExit(2) from None

  app.run(guarded)

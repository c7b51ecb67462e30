"""Every test sees 8 emulated CPU devices; set before JAX starts."""

import os
import sys
import tempfile
import time

# Bytecode: the suite writes it (in the tree's git-ignored __pycache__) even where
# PYTHONDONTWRITEBYTECODE is set, for itself and the processes it starts. Without it every
# test process recompiles the project's sources and pytest rewrites every test module again
# (measured on the 2-core machine: collection 22 s against 13 s with bytecode kept), and every
# CLI test's child process compiles the omni_jax modules it imports (~0.5 s each, dozens of
# children). The controller compiles the project once before the workers start
# (``pytest_configure`` below).
if sys.flags.dont_write_bytecode or os.environ.get("PYTHONDONTWRITEBYTECODE"):
  sys.dont_write_bytecode = False
  os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

os.environ.setdefault("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
if "collective_call_terminate_timeout" not in os.environ["XLA_FLAGS"]:
  # 8 emulated devices on 2 busy cores can wait long for each other inside a collective.
  os.environ["XLA_FLAGS"] += " --xla_cpu_collective_call_terminate_timeout_seconds=600"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite's time is mostly XLA:CPU compiling tiny models (measured: the micro omni model's
# init and train-step compiles take 2.5x less CPU at LLVM -O0 without its expensive passes,
# and three of the slowest test files 29 % less CPU in all), while the code it then runs is
# too small for LLVM's optimisations to matter. HLO passes (sharding, collectives) are
# untouched, so every test checks the same partitioned program. OMNI_JAX_TEST_FULL_XLA_OPT=1 keeps
# the default optimisation level.
# XLA:CPU's classic loop emitters instead of its MLIR fusion emitters: measured on the micro
# omni model's 8-device train run, 39 % less CPU in all (its train step's compile 2.1x
# faster, the step itself ~25 % slower; losses bit-identical).
# One LLVM module per program instead of XLA:CPU's parallel codegen split: with two test
# processes on two cores the split's threads only contend (measured: the micro model's
# one-device gradient compiles in 2.05 s against 2.2-2.5 s split; tests/parallel/test_zero3.py
# cold 35.1 / 30.2 s against 36.7 / 33.1 s, alternating runs).
if os.environ.get("OMNI_JAX_TEST_FULL_XLA_OPT", "") != "1":
  for flag in ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
               "--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1"):
    if flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
      os.environ["XLA_FLAGS"] += " " + flag
# A persistent compilation cache shared by the test processes (both xdist workers and the CLI
# subprocesses the tests start, through the environment): the suite compiles the same train
# steps many times (a resumed run, every layout's one-device reference, ...), and a hit loads
# the executable instead of compiling it again. Keys are the HLO + options + jaxlib version,
# so entries are never stale; the size cap turns on JAX's file lock (safe concurrent writes).
# Override the place with JAX_COMPILATION_CACHE_DIR, or set it to '' to compile everything.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"omni_jax-test-jax-cache-{os.getuid()}"))
# Only programs that took 1 s or more are written (measured over the suite: the 148 entries of
# 0.2-0.5 s got no hit and those of 0.5-1 s saved 5.7 s in all, while each write costs ~0.15 s).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1.0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))
# The cache key leaves out op-name metadata (JAX's named scopes) unless told otherwise: a hit
# could return the executable compiled for another test's program with the same HLO and other
# scopes, and the tests that find collectives by scope would read the other program's names.
os.environ.setdefault("JAX_COMPILATION_CACHE_INCLUDE_METADATA_IN_KEY", "1")
# ... and with metadata in the key, JAX's default of a Python traceback (up to 100 frames) in
# every op's location made the key depend on the call stack: the same train step built from
# another line of a test (a resumed run, a layout's one-device reference) never hit (measured:
# 20 hits in 6,125 compiles over the suite). No frames in the locations (the ops keep their
# scoped op_name, which the HLO readers need) lets those hit; tracebacks in error messages are
# unchanged.
os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


# System packages (tests/system_packages.py): skip with the install command, fail under CI.
import pytest  # noqa: E402

from tests.system_packages import DEJAVU_FONTS, ESPEAK_NG, require  # noqa: E402


@pytest.fixture
def needs_espeak_ng():
  require(ESPEAK_NG)


@pytest.fixture
def needs_dejavu_fonts():
  require(DEJAVU_FONTS)


# The default run's files with the most CPU time (measured on the 2-core machine, a cold
# compile cache, each at least ~20 CPU-s), heaviest first. The run hands files to its
# workers in collection order (`--no-loadscope-reorder` in pyproject.toml), so these go first
# and the small files fill in at the end, instead of one long file running alone at the end
# (xdist's default order is by test count, which put the single-test heavy files last).
HEAVY_FILES_FIRST = (
    "tests/parallel/test_multiprocess.py",
    "tests/hf/test_hf_chain.py",
    "tests/train/test_train_omni.py",
    "tests/train/test_train_omni_layout.py",
    "tests/experiments/test_modality_flag.py",
    "tests/experiments/test_every_cli.py",
    "tests/rl/test_rl_algorithms.py",
    "tests/train/test_lora.py",
    "tests/parallel/test_pipeline_composed.py",
    "tests/parallel/test_segment_attention.py",
    "tests/models/test_moe.py",
    "tests/models/test_kv_cache.py",
    "tests/dpad/test_dpad_halftone.py",
    "tests/models/test_omni_model.py",
    "tests/parallel/test_layouts.py",
    "tests/models/test_flash_attention.py",
    "tests/models/test_mla.py",
)


def pytest_configure(config):
  """The controller (not an xdist worker) compiles the project's modules to bytecode once,
  so the test processes and their children load it instead of compiling the same sources
  (see the bytecode note at the top; ~2 s)."""
  if hasattr(config, "workerinput"):
    return
  import compileall
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for package in ("omni_jax", "experiments", "configs", "tests"):
    compileall.compile_dir(os.path.join(root, package), quiet=2)


def pytest_collection_finish(session):
  """Every test module is imported: the collector's thresholds for tracing
  (:mod:`omni_jax.common.gc_policy`: ~6 % less time on the suite's model tests)."""
  from omni_jax.common import gc_policy
  gc_policy.for_tracing()


def pytest_collection_modifyitems(config, items):
  """Tests marked ``gpu`` / ``tpu`` need that backend: skipped, with the reason, elsewhere;
  the heavy files first (stable: other files keep their order)."""
  rank = {f: i for i, f in enumerate(HEAVY_FILES_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
  backend = jax.default_backend()
  for item in items:
    for platform in ("gpu", "tpu"):
      if platform in item.keywords and backend != platform:
        item.add_marker(pytest.mark.skip(
            reason=f"needs a {platform.upper()} backend; this run's JAX backend is {backend}"))


def pytest_terminal_summary(terminalreporter):
  """One line on the machine the suite ran on (cores it may use, CPU model, load, a timed
  piece of Python), so a run's time can be read against its machine: the same tests have
  taken 4 min on one fresh 2-core machine and 12 on another."""
  try:
    cpus = len(os.sched_getaffinity(0))
  except AttributeError:
    cpus = os.cpu_count()
  model = "unknown CPU"
  try:
    with open("/proc/cpuinfo") as f:
      model = next((line.split(":", 1)[1].strip() for line in f
                    if line.startswith("model name")), model)
  except OSError:
    pass
  quota = ""
  try:
    with open("/sys/fs/cgroup/cpu.max") as f:
      limit, period = f.read().split()
      quota = f", cgroup quota {'none' if limit == 'max' else f'{int(limit) / int(period):g} CPUs'}"
  except (OSError, ValueError):
    pass
  load = ", load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())
  start = time.perf_counter()
  sum(range(5_000_000))  # a fixed piece of single-core Python work, timed: the core's speed
  probe = time.perf_counter() - start
  terminalreporter.write_line(f"machine: {cpus} usable of {os.cpu_count()} CPUs ({model})"
                              f"{quota}{load}; sum(range(5e6)) took {probe:.3f} s")

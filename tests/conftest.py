"""Every test sees 8 emulated CPU devices; set before JAX starts."""

import os
import tempfile

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
if os.environ.get("OMNI_JAX_TEST_FULL_XLA_OPT", "") != "1":
  for flag in ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
               "--xla_cpu_use_fusion_emitters=false"):
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
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))
# The cache key leaves out op-name metadata (JAX's named scopes) unless told otherwise: a hit
# could return the executable compiled for another test's program with the same HLO and other
# scopes, and the tests that find collectives by scope would read the other program's names.
os.environ.setdefault("JAX_COMPILATION_CACHE_INCLUDE_METADATA_IN_KEY", "1")

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


def pytest_collection_modifyitems(config, items):
  """Tests marked ``gpu`` / ``tpu`` need that backend: skipped, with the reason, elsewhere."""
  backend = jax.default_backend()
  for item in items:
    for platform in ("gpu", "tpu"):
      if platform in item.keywords and backend != platform:
        item.add_marker(pytest.mark.skip(
            reason=f"needs a {platform.upper()} backend; this run's JAX backend is {backend}"))

"""Every test sees 8 emulated CPU devices; set before JAX starts."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
if "collective_call_terminate_timeout" not in os.environ["XLA_FLAGS"]:
  # 8 emulated devices on 2 busy cores can wait long for each other inside a collective.
  os.environ["XLA_FLAGS"] += " --xla_cpu_collective_call_terminate_timeout_seconds=600"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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

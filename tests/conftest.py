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

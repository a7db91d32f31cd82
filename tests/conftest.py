"""Test set-up: 8 XLA CPU devices in this process, 64-bit types available."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402  (must come after XLA_FLAGS)

jax.config.update("jax_enable_x64", True)

"""Loads the native engine and registers its XLA FFI targets, once."""

from __future__ import annotations

import functools

import jax

from jax_smddp import _smddp_cpu  # built by CMake (see CMakeLists.txt)

# Names of the FFI targets, by collective; the same names on every platform.
TARGETS = ("smddp_all_gather", "smddp_reduce_scatter", "smddp_all_reduce", "smddp_all_to_all")


@functools.cache
def register_cpu_targets() -> None:
  for name, capsule in _smddp_cpu.registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="cpu")


def engine():
  """The CPU engine module (settings and test entry points)."""
  return _smddp_cpu

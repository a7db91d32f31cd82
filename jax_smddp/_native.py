"""Loads the native engine and registers its XLA FFI targets, once."""

from __future__ import annotations

import functools

import jax

try:
  from jax_smddp import _smddp_cpu  # built by CMake (see CMakeLists.txt)
except ImportError as e:
  raise ImportError(
      "jax_smddp's native extension (_smddp_cpu) is missing: build and install the package "
      "with `pip install --no-build-isolation .` (after installing jax), and do not import it "
      "from an unbuilt source checkout.") from e

# Names of the FFI targets, by collective; the same names on every platform.
TARGETS = ("smddp_all_gather", "smddp_reduce_scatter", "smddp_all_reduce", "smddp_all_to_all")


@functools.cache
def register_cpu_targets() -> None:
  # Types before the handlers that use them.
  for name, registration in _smddp_cpu.type_registrations().items():
    jax.ffi.register_ffi_type(name, registration, platform="cpu")
  for name, stages in _smddp_cpu.registrations().items():
    jax.ffi.register_ffi_target(name, stages, platform="cpu")


try:
  from jax_smddp import _smddp_cuda  # built only where nvcc was found
except ImportError:
  _smddp_cuda = None
else:
  # The CUDA module has its own copy of the engine: the multi-process world
  # (jax_smddp.initialize()) is _smddp_cpu's, read through it.
  _smddp_cuda.use_world_of(_smddp_cpu.world_source())


@functools.cache
def register_cuda_targets() -> bool:
  """Registers the CUDA handlers; False when the CUDA backend was not built."""
  if _smddp_cuda is None:
    return False
  for name, registration in _smddp_cuda.type_registrations().items():
    jax.ffi.register_ffi_type(name, registration, platform="CUDA")
  for name, stages in _smddp_cuda.registrations().items():
    jax.ffi.register_ffi_target(name, stages, platform="CUDA")
  return True


def cuda_engine():
  """The CUDA engine module, or None when this install has no CUDA backend
  (built without nvcc)."""
  return _smddp_cuda


def engine():
  """The CPU engine module (settings and test entry points)."""
  return _smddp_cpu

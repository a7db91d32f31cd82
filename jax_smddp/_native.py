"""Loads the native engine and registers its XLA FFI targets, once."""

from __future__ import annotations

import functools
import glob
import os
import sys

import jax


def _how_to_build(error: ImportError) -> str:
  """What to run when the extension does not load: the exact commands for the
  interpreter that failed and the source tree it read jax_smddp from."""
  python = sys.executable
  package = os.path.dirname(os.path.abspath(__file__))
  root = os.path.dirname(package)
  folders = getattr(sys.modules.get(__package__), "__path__", None) or [package]
  missing = not any(glob.glob(os.path.join(f, "_smddp_cpu*")) for f in folders)
  what = ("is not built for this Python" if missing else f"does not load ({error})")
  text = f"jax_smddp's native extension (_smddp_cpu) {what} ({python}, jax {jax.__version__}); "
  if not os.path.exists(os.path.join(root, "CMakeLists.txt")):
    return text + (f"jax_smddp was imported from {package}: reinstall it against this jax from its "
                   f"sources: {python} -m pip install --no-build-isolation --force-reinstall "
                   "--no-deps <jax_smddp source folder>.")
  text += f"jax_smddp was imported from the source checkout {root}. "
  if missing:  # jax_smddp/__init__.py hands over to an installed one of this version
    text += ("No installed jax_smddp is on sys.path after it (one of this version would "
             "have been used instead). ")
  built = [os.path.join(root, v, "bin", "python") for v in (".venv/py311", ".venv/py312")
           if glob.glob(os.path.join(root, v, "lib", "python3*", "site-packages", "jax_smddp",
                                     "_smddp_cpu*"))
           and not os.path.samefile(os.path.join(root, v), sys.prefix)]
  if built:
    text += f"It is built for {' and '.join(built)}: run with that. "
  text += (f"To build it for the checkout's environments: cd {root} && bash scripts/run.sh "
           "(.venv/py311; then it runs the example) or bash scripts/test.sh (.venv/py311 and "
           ".venv/py312; then the tests). ")
  return text + (f"To build it into this Python's environment (editable: the checkout's Python "
                 f"files, the native modules in site-packages): cd {root} && {python} -m pip install "
                 f"nanobind scikit-build-core cmake ninja && {python} -m pip install "
                 "--no-build-isolation -e .")


try:
  from jax_smddp import _smddp_cpu  # built by CMake (see CMakeLists.txt)
except ImportError as e:
  raise ImportError(_how_to_build(e)) from e

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
    jax.ffi.register_ffi_target(name, stages, platform="CUDA", **cuda_target_traits())
  return True


def cuda_target_traits() -> dict:
  """The CUDA handlers' traits for jax.ffi.register_ffi_target: with JAX_SMDDP_GPU_GRAPHS=1 they are
  compatible with XLA's command buffers (CUDA graphs), which then capture them (captured calls take
  the replayable path: cuda/gpu_call.h); otherwise none, and XLA runs them outside its graphs."""
  if _smddp_cuda is None or not _smddp_cuda.settings()["graphs"]:
    return {}
  from jaxlib import xla_client  # the traits' enum: what register_ffi_target passes them to
  return {"traits": xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE}


def cuda_engine():
  """The CUDA engine module, or None when this install has no CUDA backend
  (built without nvcc)."""
  return _smddp_cuda


def engine():
  """The CPU engine module (settings and test entry points)."""
  return _smddp_cpu

"""What this installation can do on this machine: the facts behind
``jax_smddp.doctor`` and ``JAX_SMDDP_REQUIRE``.

Each probe is cheap, never raises, and is computed once per process: libfabric
(built? loaded from where? which providers?), the CUDA backend (built? GPUs
seen?), GDRCopy (library and driver), NVIDIA MPS, shared memory, and how
glibc's heap is kept for XLA's outputs.
"""

from __future__ import annotations

import ctypes
import functools
import os

from jax_smddp import _native


@functools.cache
def version() -> str:
  """jax_smddp's version, from the installed package's metadata (pyproject.toml's
  ``version``, the one place it is written)."""
  from importlib import metadata
  try:
    return metadata.version("jax_smddp")
  except metadata.PackageNotFoundError:  # sources on sys.path, never installed
    return "0+unknown"


@functools.cache
def build() -> dict:
  """What the extension was built against: jaxlib version and XLA FFI API."""
  return dict(_native.engine().build_info())


def heap_reuse() -> dict:
  """glibc's heap kept for XLA's large output buffers (JAX_SMDDP_HEAP_REUSE_BYTES):
  'bytes' (the mmap threshold set at the first CPU collective; 0 when left
  alone), 'reason' (why it is left alone) and 'applied' (set in this process by
  a jax_smddp custom call; under JAX_SMDDP_COLLECTIVES=xla the MPI library sets
  it when XLA starts its collectives, which this flag does not see). Not cached:
  'applied' changes when the first collective is set up."""
  return dict(_native.engine().heap_reuse())


def malloc_arenas() -> dict:
  """glibc's malloc arenas capped when jax_smddp was imported (JAX_SMDDP_MALLOC_ARENAS): 'arenas'
  (the cap; 0 when left alone) and 'reason' (why it is left alone)."""
  return dict(_native.engine().malloc_arenas())


@functools.cache
def fabric() -> dict:
  """libfabric: built (headers found), loaded (path, version), its providers
  able to open the reliable-datagram endpoints the transports use, the one an
  unset JAX_SMDDP_FABRIC_PROVIDER picks ('default_provider'), libfabric's
  own variables jax_smddp gives a default ('env_defaults': name, value in
  effect, set_by 'jax_smddp' or 'environment'), and why not when it cannot be
  used ('error')."""
  return dict(_native.engine().fabric_info())


@functools.cache
def cuda() -> dict:
  """The CUDA backend: built, driver version, and each GPU the driver shows."""
  ext = _native.cuda_engine()
  if ext is None:
    return {"built": False, "driver": 0, "devices": [],
            "error": "built without CUDA (nvcc was not found when jax_smddp was installed)"}
  driver = ext.driver_version()
  devices = []
  error = ""
  count = ext.device_count() if driver else 0
  for ordinal in range(count):
    try:
      devices.append(dict(ext.device_info(ordinal)))
    except RuntimeError as e:  # a GPU the process may not use (compute mode, MIG)
      devices.append({"error": str(e)})
  if not driver:
    error = "no CUDA driver in this process (libcuda.so.1 not found: no NVIDIA GPU or driver here)"
  elif not count:
    error = "the CUDA driver shows no GPU to this process (CUDA_VISIBLE_DEVICES?)"
  return {"built": True, "driver": driver, "devices": devices,
          "stream_memops": bool(count) and ext.have_stream_memops(), "error": error}


GDRDRV_DEVICE = "/dev/gdrdrv"


@functools.cache
def gdrcopy() -> dict:
  """GDRCopy: its user library (libgdrapi, loaded at run time) and its kernel
  driver (the gdrdrv device). Both are needed for GPU flags written by the CPU."""
  library = ""
  for name in ("libgdrapi.so.2", "libgdrapi.so"):
    try:
      ctypes.CDLL(name)
    except OSError:
      continue
    library = name
    break
  driver = os.path.exists(GDRDRV_DEVICE)
  if library and driver:
    error = ""
  elif not library:
    error = "libgdrapi.so.2 not found (install GDRCopy, or put its lib/ on LD_LIBRARY_PATH)"
  else:
    error = f"the gdrdrv kernel module is not loaded ({GDRDRV_DEVICE} missing)"
  return {"library": library, "driver": driver, "error": error}


def _mps_pipe_dir() -> str:
  return os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")


@functools.cache
def mps() -> dict:
  """NVIDIA MPS: whether a control daemon's pipe is there (processes sharing a
  GPU should run under it)."""
  pipe = os.path.join(_mps_pipe_dir(), "control")
  running = os.path.exists(pipe)
  return {"running": running, "pipe": pipe,
          "error": "" if running else f"no MPS control daemon ({pipe} missing; "
                                      "start one with nvidia-cuda-mps-control -d)"}


def shared_memory() -> dict:
  """/dev/shm, where processes on one host share their rings."""
  try:
    st = os.statvfs("/dev/shm")
  except OSError as e:
    return {"size_bytes": 0, "free_bytes": 0, "error": f"/dev/shm is not usable ({e})"}
  return {"size_bytes": st.f_blocks * st.f_frsize, "free_bytes": st.f_bavail * st.f_frsize,
          "error": ""}

"""The XLA-level swap: every collective XLA runs across processes goes to jax_smddp.

This module is the CPU side; on GPUs the same switch loads jax_smddp's NCCL API
front end (:mod:`jax_smddp.swap.nccl`); :mod:`jax_smddp.swap.clients` sets up both.

JAX's CPU client can run its cross-process collectives through MPI
(``jax_cpu_collectives_implementation='mpi'``): jaxlib links MPItrampoline,
which forwards each MPI call to the library ``MPITRAMPOLINE_LIB`` names.
jax_smddp ships such a library, ``libsmddp_mpi.so`` (xla_ffi/mpiabi/), that
serves those calls with its engine. So the all-gathers, reduce-scatters and
all-reduces that XLA's partitioner inserts into global-view ``jit`` programs
(sharded parameters, no ``shard_map``) move over jax_smddp's links and routes,
under its deadline and dead-peer detection, and count in
``jax_smddp.traffic()``. No code changes.

Selected by ``JAX_SMDDP_COLLECTIVES=xla`` (only this) or ``all`` (this and the
``shard_map`` swap of :mod:`jax_smddp.swap`), set before Python starts:

1. At interpreter start-up, ``jax_smddp.pth`` (which runs ``_startup.py``)
   sets ``MPITRAMPOLINE_LIB`` to the library. MPItrampoline reads it once,
   when jaxlib is loaded (``import jax``).
2. When JAX creates its CPU client, the plugin's wrapper of the client factory
   (:func:`jax_smddp.swap.clients.install`) sets ``jax_cpu_collectives_implementation='mpi'``,
   connects jax_smddp's processes (:func:`jax_smddp.initialize`, over the
   jax.distributed key-value store) and hands that world to the library.

What it cannot change: a process whose jaxlib was loaded without
``MPITRAMPOLINE_LIB`` (the variable set after ``import jax``, or Python run
with ``-S``) cannot be redirected, and a CPU client that exists keeps its
collectives; both raise with what to do. One-process jobs have no
cross-process collectives and are unaffected. Every device of the job must
take part in each program that communicates across processes (XLA's MPI path
splits MPI_COMM_WORLD, which here is every device of the job). Unsupported
cases raise (product reductions, 16-bit and unsigned 64-bit integer
reductions: XLA's MPI path takes no bfloat16 or float16 at all), they never
give a wrong answer.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re

import jax

from jax_smddp import _native
from jax_smddp._startup import library_path  # the library the start-up hook points at
from jax_smddp._startup import requested  # noqa: F401  (whether JAX_SMDDP_COLLECTIVES asks for it)

log = logging.getLogger("jax_smddp")


def local_devices() -> int:
  """The CPU devices JAX will create in this process (how many devices take
  part in each communicator split), from the same settings JAX reads."""
  n = getattr(jax.config, "jax_num_cpu_devices", -1)
  if n is not None and int(n) >= 0:
    return max(int(n), 1)
  m = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
  return int(m.group(1)) if m else 1


def _check_library() -> str:
  lib = library_path()
  if not os.path.exists(lib):
    raise RuntimeError(
        f"jax_smddp (JAX_SMDDP_COLLECTIVES=xla): {lib} is missing; reinstall jax_smddp "
        "(pip install --no-build-isolation .).")
  loaded = os.environ.get("MPITRAMPOLINE_LIB")
  if loaded != lib:
    raise RuntimeError(
        "jax_smddp (JAX_SMDDP_COLLECTIVES=xla): jaxlib's MPI trampoline was set up "
        + (f"with MPITRAMPOLINE_LIB={loaded!r}" if loaded else "without MPITRAMPOLINE_LIB")
        + ", and it reads that variable only once, when jaxlib loads. Set "
        "JAX_SMDDP_COLLECTIVES=xla in the environment before Python starts (jax_smddp.pth "
        f"then sets MPITRAMPOLINE_LIB), or export MPITRAMPOLINE_LIB={lib} yourself; unset "
        "JAX_SMDDP_COLLECTIVES to use gloo.")
  return lib


def check_for_client() -> str:
  """Runs as JAX creates its CPU client (jax_smddp.swap.clients), before the world
  connects: the library's path (raises where it cannot serve), and XLA's CPU
  collectives set to MPI."""
  lib = _check_library()
  jax.config.update("jax_cpu_collectives_implementation", "mpi")
  return lib


def serve(lib: str) -> None:
  """Then, with the world connected: hands the library jax_smddp's world and this
  process's devices; from here on it serves XLA's cross-process CPU collectives."""
  library = ctypes.CDLL(lib)
  library.smddp_mpi_configure.argtypes = [ctypes.c_size_t, ctypes.c_int]
  library.smddp_mpi_configure(_native.engine().world_source(), local_devices())
  log.info("jax_smddp: XLA's cross-process CPU collectives run on jax_smddp (%s)", lib)

"""The MPI ABI library (libsmddp_mpi.so) against the jaxlib installed here:
it must define every name jaxlib's MPItrampoline resolves (one missing and
the trampoline exits the process), and calls it does not implement must fail
with an MPI error that names them."""

from __future__ import annotations

import ctypes
import os
import re

import jaxlib

from jax_smddp.swap import xla as xla_swap


def _trampoline_names() -> set[str]:
  """The symbol names jaxlib's MPItrampoline looks up, read from its binary."""
  names = set()
  here = os.path.dirname(jaxlib.__file__)
  for root, _, files in os.walk(here):
    for f in files:
      if f.endswith(".so"):
        data = open(os.path.join(root, f), "rb").read()
        if b"MPITRAMPOLINE_LIB" in data:
          names |= {m.decode() for m in re.findall(
              rb"(?<=\x00)((?:MPIX?ABI_|mpiabi_version_|mpiwrapper_)\w+)(?=\x00)", data)}
  return names


def test_library_defines_every_name_the_trampoline_resolves():
  names = _trampoline_names()
  assert len(names) > 600, f"found {len(names)} MPI ABI names in jaxlib: did its layout change?"
  lib = ctypes.CDLL(xla_swap.library_path())
  missing = sorted(n for n in names if not hasattr(lib, n))
  assert not missing, missing


def test_abi_version_is_one_the_trampoline_accepts():
  lib = ctypes.CDLL(xla_swap.library_path())
  major = ctypes.c_int.in_dll(lib, "mpiabi_version_major").value
  minor = ctypes.c_int.in_dll(lib, "mpiabi_version_minor").value
  assert (major, minor) >= (2, 9) and major == 2


def test_unimplemented_call_fails_naming_the_function():
  lib = ctypes.CDLL(xla_swap.library_path())
  success = ctypes.c_int64.in_dll(lib, "MPIABI_SUCCESS").value
  unsupported = ctypes.c_int64.in_dll(lib, "MPIABI_ERR_UNSUPPORTED_OPERATION").value
  assert success == 0 and unsupported != 0
  code = lib.MPIABI_Bcast(None, 0, 0, 0, 0)
  assert code == unsupported
  buf = ctypes.create_string_buffer(1024)
  n = ctypes.c_int()
  assert lib.MPIABI_Error_string(code, buf, ctypes.byref(n)) == 0
  assert "does not implement MPI_Bcast" in buf.value.decode(), buf.value


def test_collectives_before_set_up_fail_with_a_message():
  """MPI_Comm_split before jax_smddp configured the library: an error, not a hang."""
  lib = ctypes.CDLL(xla_swap.library_path())
  world = ctypes.c_size_t.in_dll(lib, "MPIABI_COMM_WORLD").value
  comm = ctypes.c_size_t(12345)
  code = lib.MPIABI_Comm_split(ctypes.c_size_t(world), 0, 0, ctypes.byref(comm))
  assert code != 0 and comm.value == 0
  buf = ctypes.create_string_buffer(1024)
  n = ctypes.c_int()
  lib.MPIABI_Error_string(code, buf, ctypes.byref(n))
  assert "was not configured" in buf.value.decode(), buf.value

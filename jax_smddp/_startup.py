"""Run at interpreter start-up by ``jax_smddp.pth`` (site-packages), before
any ``import jax``: with ``JAX_SMDDP_COLLECTIVES=xla`` (or ``all``) it points
jaxlib's MPI trampoline at jax_smddp's MPI ABI library, which the trampoline
looks up only once, when jaxlib loads (see jax_smddp/xla_swap.py). Imports
nothing but ``os`` and ``importlib.util``; does nothing without the variable
or when ``MPITRAMPOLINE_LIB`` is already set. Imported as a module (by
xla_swap), it only defines `library_path`."""

import os

LIBRARY = "libsmddp_mpi.so"


def library_path() -> str:
  """The MPI ABI library of this installation. It lies in one of the package's
  folders: an installed package has one; an editable install (``pip install -e``)
  has the sources and, in site-packages, what the build installed."""
  import importlib.util
  spec = importlib.util.find_spec("jax_smddp")  # finds the package, imports nothing
  folders = list((spec and spec.submodule_search_locations) or [])
  folders = folders or [os.path.dirname(os.path.abspath(__file__))]
  for folder in folders:
    path = os.path.join(folder, LIBRARY)
    if os.path.exists(path):
      return path
  return os.path.join(folders[0], LIBRARY)


def _point_trampoline() -> None:
  value = os.environ.get("JAX_SMDDP_COLLECTIVES", "")
  if not any(v.strip().lower() in ("all", "1", "true", "on", "yes", "xla")
             for v in value.split(",")):
    return
  if "MPITRAMPOLINE_LIB" not in os.environ:
    os.environ["MPITRAMPOLINE_LIB"] = library_path()


if __name__ == "jax_smddp.pth":  # run by the .pth file, not imported
  _point_trampoline()

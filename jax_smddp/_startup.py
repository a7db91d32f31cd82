"""Run at interpreter start-up by ``jax_smddp.pth`` (site-packages), before
any ``import jax``: with ``JAX_SMDDP_COLLECTIVES=xla`` (or ``all``) it points
jaxlib's MPI trampoline at jax_smddp's MPI ABI library, which the trampoline
looks up only once, when jaxlib loads (see jax_smddp/xla_swap.py). Imports
nothing but ``os``; does nothing without the variable or when
``MPITRAMPOLINE_LIB`` is already set."""

import os


def _point_trampoline() -> None:
  value = os.environ.get("JAX_SMDDP_COLLECTIVES", "")
  if not any(v.strip().lower() in ("all", "1", "true", "on", "yes", "xla")
             for v in value.split(",")):
    return
  os.environ.setdefault("MPITRAMPOLINE_LIB",
                        os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                     "libsmddp_mpi.so"))


_point_trampoline()

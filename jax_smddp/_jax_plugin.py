"""JAX plugin entry point (``[project.entry-points.jax_plugins]``).

JAX imports this module and calls :func:`initialize` when its backends first
initialise (``jax._src.xla_bridge.discover_pjrt_plugins``), before it creates
any client. jax_smddp adds no PJRT backend: it only reads
``JAX_SMDDP_COLLECTIVES`` and, when it is set, lowers the named ``jax.lax``
collectives through jax_smddp (see :mod:`jax_smddp.swap`) and, for ``xla`` or
``all``, has XLA's own cross-process CPU collectives served by jax_smddp (see
:mod:`jax_smddp.swap.xla`) and, on GPUs, XLA's NCCL calls served by jax_smddp's
NCCL API front end (see :mod:`jax_smddp.swap.nccl`), so an unmodified program
uses the plugin. When the
variable is unset nothing is imported: programs that do not ask for the
plugin do not load it.
"""

from __future__ import annotations

import os

from jax_smddp import _startup  # no jax import: the variable's parser


def initialize() -> None:
  if not os.environ.get(_startup.ENV_VAR, "").strip():
    return
  from jax_smddp import swap
  from jax_smddp.swap import clients
  swap.use_from_env()
  if _startup.requested():
    clients.install()

"""The drop-in swaps: existing programs' collectives moved onto jax_smddp.

* :mod:`jax_smddp.swap.lax`: the ``jax.lax`` collectives of ``shard_map`` code
  lowered through jax_smddp (``JAX_SMDDP_COLLECTIVES=all_gather,...`` or
  :func:`use`), on CPU and CUDA.
* :mod:`jax_smddp.swap.xla`: XLA's own cross-process collectives on CPU, served
  through the MPI ABI XLA loads (``JAX_SMDDP_COLLECTIVES=xla``).
* :mod:`jax_smddp.swap.nccl`: XLA's own collectives on GPUs, served by the NCCL
  API front end (``JAX_SMDDP_COLLECTIVES=xla``).
* :mod:`jax_smddp.swap.clients`: those two set up as JAX creates its CPU and
  CUDA clients.

``jax_smddp.swap.use``, ``active``, ``parse`` and ``OPS`` are the lax swap's.
"""

from jax_smddp.swap.lax import OPS, active, parse, use, use_from_env

__all__ = ["OPS", "active", "parse", "use", "use_from_env"]

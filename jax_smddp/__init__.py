"""jax_smddp: collectives for JAX as XLA FFI custom calls.

The API mirrors ``jax.lax`` so that switching is a rename::

    import jax_smddp as smddp
    y = smddp.all_gather(x, "fsdp", axis=0, tiled=True)   # inside jax.shard_map

Collectives run on the plugin's engine on CPU: XLA CPU devices of one process,
and across the processes and hosts of a ``jax.distributed`` job (shared memory
within a host, libfabric between hosts; see ``jax_smddp.initialize``); on
CUDA GPUs where the package was built with nvcc (``jax_smddp.gpu``; run on one
H100 and one H200, each shared by several processes; never on several GPUs or
EFA: docs/status.md). A cluster job joins its launcher's job with
``jax_smddp.job.initialize()``. Cases the engine does not
handle, and other platforms, lower through jax.lax (logged at WARNING level).
``python -m jax_smddp.doctor`` says what the installation can do here.
"""

from jax_smddp.capabilities import version
from jax_smddp.all_gather import all_gather
from jax_smddp.all_reduce import all_reduce, pmax, pmean, pmin, psum
from jax_smddp.all_to_all import all_to_all
from jax_smddp.config import set_timeout, settings, timeout
from jax_smddp.ppermute import ppermute
from jax_smddp.distributed import initialize, shutdown, topology, traffic
from jax_smddp.reduce_scatter import psum_scatter, reduce_scatter
from jax_smddp.reduced import all_gather_invariant, all_gather_reduced, unreduced_psum_scatter
from jax_smddp.batched import all_gather_batched, psum_batched, psum_scatter_batched
from jax_smddp.partitioning import unshard
from jax_smddp.swap import use
from jax_smddp import hybrid, swap
from jax_smddp import fsdp
from jax_smddp import gpu
from jax_smddp import errors

__version__ = version()

__all__ = [
    "all_gather", "psum_scatter", "reduce_scatter", "psum", "pmax", "pmin", "pmean", "ppermute",
    "all_reduce", "all_to_all", "set_timeout", "timeout", "settings",
    "initialize", "shutdown", "topology", "traffic",
    "all_gather_invariant", "all_gather_reduced", "unreduced_psum_scatter",
    "all_gather_batched", "psum_scatter_batched", "psum_batched",
    "unshard", "use", "hybrid", "swap", "fsdp", "gpu", "errors",
]

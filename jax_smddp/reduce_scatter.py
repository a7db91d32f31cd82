"""psum_scatter / reduce_scatter: sum over ranks, each rank keeps one block
(the FSDP gradient reduction; the transpose of all_gather).

Its primitive, with its transpose (all_gather), is _gather_scatter's."""

from __future__ import annotations

from jax_smddp import _collective as c
from jax_smddp._gather_scatter import reduce_scatter_p


def psum_scatter(x, axis_name, *, scatter_dimension: int = 0, axis_index_groups=None,
                 tiled: bool = False):
  """Sums `x` over `axis_name` and scatters the result, like :func:`jax.lax.psum_scatter`.

  Untiled, ``x.shape[scatter_dimension]`` must equal the group size and that
  dimension is removed; tiled, it must be divisible by the group size and
  each rank keeps its ``1/size`` slice. `axis_index_groups` (as jax.lax takes
  them) splits the ranks into groups that each reduce among themselves.
  """
  return c.bind_scatter("psum_scatter", reduce_scatter_p, x, axis_name, scatter_dimension, tiled,
                        axis_index_groups)


def reduce_scatter(x, axis_name, *, scatter_dimension: int = 0, axis_index_groups=None,
                   tiled: bool = False):
  """NCCL-style name for :func:`psum_scatter` (same signature and result)."""
  return psum_scatter(x, axis_name, scatter_dimension=scatter_dimension,
                      axis_index_groups=axis_index_groups, tiled=tiled)

"""all_gather: every rank receives every rank's block (the FSDP parameter gather).

Its primitive, with its transpose (psum_scatter), is _gather_scatter's."""

from __future__ import annotations

from jax_smddp import _collective as c
from jax_smddp import reduced
from jax_smddp._gather_scatter import all_gather_p


TO = ("varying", "reduced", "invarying")  # jax.lax.all_gather's `to=`, its spelling


def all_gather(x, axis_name, *, axis_index_groups=None, axis: int = 0, tiled: bool = False,
               to: str = "varying"):
  """Gathers `x` from every rank of `axis_name`, like :func:`jax.lax.all_gather`.

  Args:
    x: array (or pytree of arrays) on this rank.
    axis_name: a mesh axis name of the enclosing ``jax.shard_map``, or a tuple
      of them (ranks ordered as ``jax.lax`` orders them).
    axis_index_groups: None, or groups of indices along `axis_name` (lists of one
      size covering every index once): each group gathers among its own ranks,
      in the group's order.
    axis: where the gathered dimension goes in the result.
    tiled: if True, concatenate along `axis` instead of stacking a new one.
    to: the result's type over `axis_name`, as jax.lax means it: "varying"
      (default), "reduced" (:func:`jax_smddp.all_gather_reduced`) or "invarying"
      (:func:`jax_smddp.all_gather_invariant`); the last two take no groups.
  """
  if to not in TO:
    raise ValueError(f"jax_smddp.all_gather: to={to!r}; use one of {', '.join(TO)} "
                     "(jax.lax.all_gather's values)")
  if to != "varying":
    if axis_index_groups is not None:
      raise NotImplementedError(f"jax_smddp.all_gather: to={to!r} with axis_index_groups "
                                "(jax.lax does not take them together either)")
    gather = reduced.all_gather_reduced if to == "reduced" else reduced.all_gather_invariant
    return gather(x, axis_name, axis=axis, tiled=tiled)
  return c.bind_gather("all_gather", all_gather_p, x, axis_name, axis, tiled,
                       axis_index_groups=c.index_groups(axis_index_groups))

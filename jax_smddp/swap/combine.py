"""Combining: the swapped jax.lax collectives of one shard_map body merged into fewer engine calls.

XLA combines independent collectives of one kind, group and element type into one (its
all-reduce, all-gather and reduce-scatter combiners), so a data-parallel step's dozen gradient
psums cost one call. Under the lax swap each primitive lowers on its own to one custom call, and
XLA does not combine custom calls: without this, every psum would pay the engine's per-call cost.

Where: when a ``jax.shard_map`` is lowered with the swap on (CPU), its body's jaxpr is rewritten
before it is lowered, after tracing and autodiff, so the calls autodiff inserts are seen too.
Candidates are the equations of the body's top level (not inside scan, cond or inner jit) of
``psum``/``pmax``/``pmin`` (with or without check_vma), ``all_gather`` and ``psum_scatter``
without ``axis_index_groups``, in element types the engine moves. Per kind, lax primitive, axes
and element type (the key), candidates are taken in program order into buckets: a bucket
closes when the next candidate depends on one of its members (through any chain of equations)
or would take it past ``JAX_SMDDP_COMBINE_BYTES``. A bucket of two or more becomes one
equation, placed where all its inputs exist (the body's equations are reordered
topologically; the keys are done one after the other, each on the graph the previous left).
Buckets are runs of independent candidates in a topological order, so the result has no cycle.
Its lowering packs the operands into one buffer (as jax_smddp.batched does: each rank's part
contiguous), makes one engine call and cuts the result back. The engine reduces each element
in rank order wherever it sits, so in one process the answers are the separate calls' bit for
bit (across processes a combined call may take another route, chosen by size, and group a float
sum differently); gradients are unaffected (the rewrite happens after differentiation). A
bucket the engine turns down at lowering is lowered call by call with lax's rules (which warn as
the swap does).
"""

from __future__ import annotations

import heapq
import importlib
from typing import Any

import numpy as np


from jax_smddp._jax_internals import hlo, lax_parallel, mlir
from jax_smddp._jax_internals import jax_core as core

from jax_smddp import _collective as c
from jax_smddp import _collectives
from jax_smddp import _gather_scatter as _gs
from jax_smddp import config
from jax_smddp import requirements

_ar = importlib.import_module("jax_smddp.all_reduce")

ENV = "JAX_SMDDP_COMBINE_BYTES"
# lax primitive name -> (the swap's collective, reduction, invariant): what may be combined.
_CANDIDATES = {
    "psum_p": ("all_reduce", "sum", False), "psum_invariant_p": ("all_reduce", "sum", True),
    "pmax_p": ("all_reduce", "max", False), "pmin_p": ("all_reduce", "min", False),
    "all_gather_p": ("all_gather", None, False),
    "all_gather_invariant_p": ("all_gather", None, False),
    "reduce_scatter_p": ("reduce_scatter", None, False),
}
KINDS = tuple(dict.fromkeys(kind for kind, _, _ in _CANDIDATES.values()))  # what combining merges


def _candidates() -> dict[Any, tuple]:
  return {getattr(lax_parallel, name): v for name, v in _CANDIDATES.items()
          if hasattr(lax_parallel, name)}


def threshold() -> int:
  """Bytes a combined call may hold at most (JAX_SMDDP_COMBINE_BYTES; 0: no combining)."""
  return int(config.value(ENV))


def _axes(params: dict) -> tuple:
  return c.axes_tuple(params["axes"] if "axes" in params else params["axis_name"])


def _nbytes(aval) -> int:
  return c.prod(aval.shape) * np.dtype(aval.dtype).itemsize


def _key(eqn, kinds: dict, active: frozenset, mesh_axes: set) -> tuple | None:
  """What one-operand `eqn` may be combined with (None: it is not a candidate)."""
  found = kinds.get(eqn.primitive)
  if found is None or found[0] not in active:
    return None
  kind, reduce, _ = found
  params = eqn.params
  if params.get("axis_index_groups") is not None:
    return None
  aval = eqn.invars[0].aval
  dtype = np.dtype(aval.dtype)
  if dtype not in c.ENGINE_DTYPES or (dtype == np.bool_ and _collectives.reduces(kind)):
    return None
  axes = _axes(params)
  if not set(axes) <= mesh_axes or len(eqn.invars) != 1:
    return None
  return (eqn.primitive, axes, dtype)


def _toposort(nodes: list, order: list[int]) -> list:
  """`nodes` (equations) in a topological order, each as near its `order` as dependencies allow."""
  producer = {}
  for n, e in enumerate(nodes):
    for v in e.outvars:
      producer[v] = n
  deps = [{producer[v] for v in e.invars if isinstance(v, core.Var) and v in producer}
          for e in nodes]
  users: list[list[int]] = [[] for _ in nodes]
  for n, ds in enumerate(deps):
    for d in ds:
      users[d].append(n)
  waiting = [len(ds) for ds in deps]
  ready = [(order[n], n) for n in range(len(nodes)) if not waiting[n]]
  heapq.heapify(ready)
  out = []
  while ready:
    _, n = heapq.heappop(ready)
    out.append(nodes[n])
    for u in users[n]:
      waiting[u] -= 1
      if not waiting[u]:
        heapq.heappush(ready, (order[u], u))
  assert len(out) == len(nodes), "jax_smddp: combining made a cycle (a bug: please report it)"
  return out


def _combine_key(eqns: list, key: tuple, keys: list, limit: int) -> list:
  """`eqns` with the candidates of `key` merged into buckets (see the module's doc)."""
  members = [n for n, k in enumerate(keys) if k == key]
  bit = {n: 1 << b for b, n in enumerate(members)}
  below: dict[Any, int] = {}  # var -> the members it depends on
  depends = {}
  for n, e in enumerate(eqns):
    mask = 0
    for v in e.invars:
      if isinstance(v, core.Var):
        mask |= below.get(v, 0)
    if n in bit:
      depends[n] = mask
      mask |= bit[n]
    for v in e.outvars:
      below[v] = mask
  buckets, current, mask, size = [], [], 0, 0
  for n in members:
    nbytes = max(_nbytes(eqns[n].invars[0].aval), _nbytes(eqns[n].outvars[0].aval))
    if current and (depends[n] & mask or size + nbytes > limit):
      buckets.append(current)
      current, mask, size = [], 0, 0
    current.append(n)
    mask |= bit[n]
    size += nbytes
  buckets.append(current)
  merged = {}
  for bucket in buckets:
    if len(bucket) > 1:
      first = eqns[bucket[0]]
      kind, reduce, invariant = _candidates()[first.primitive]
      params = dict(kind=kind, reduce=reduce, invariant=invariant, axes=_axes(first.params),
                    prim=first.primitive,
                    members=tuple(tuple(sorted(eqns[n].params.items())) for n in bucket))
      merged[bucket[-1]] = core.new_jaxpr_eqn(
          [eqns[n].invars[0] for n in bucket], [eqns[n].outvars[0] for n in bucket],
          combined_p, params, first.effects, first.source_info, first.ctx)
      merged.update({n: None for n in bucket[:-1]})
  if not merged:
    return eqns
  nodes, order = [], []
  for n, e in enumerate(eqns):
    if n in merged:
      if merged[n] is None:
        continue
      e = merged[n]
    nodes.append(e)
    order.append(n)
  return _toposort(nodes, order)


def combine(jaxpr: core.Jaxpr, active: frozenset, mesh_axes: set) -> core.Jaxpr:
  """`jaxpr` (a shard_map body over `mesh_axes`) with its combinable collectives combined."""
  limit = threshold()
  if limit <= 0 or any(not isinstance(eff, core.NamedAxisEffect)
                       for e in jaxpr.eqns for eff in e.effects):
    return jaxpr  # effects (beyond naming an axis) keep their order: left alone
  kinds = _candidates()
  if not any(e.primitive in kinds for e in jaxpr.eqns):
    return jaxpr
  eqns = list(jaxpr.eqns)
  keys = [_key(e, kinds, active, mesh_axes) for e in eqns]
  seen = list(dict.fromkeys(k for k in keys if k is not None))
  if not any(keys.count(k) > 1 for k in seen):
    return jaxpr
  for key in seen:
    keys = [_key(e, kinds, active, mesh_axes) if e.primitive is not combined_p else None
            for e in eqns]
    eqns = _combine_key(eqns, key, keys, limit)
  return jaxpr.replace(eqns=eqns)


# ---------------------------------------------------------------- the combined call's lowering

def _aval(shape, dtype):
  return core.ShapedArray(tuple(shape), dtype)


def _reshape(ctx, x, shape, dtype):
  return mlir.reshape(ctx, x, _aval(shape, dtype))


def _slice(ctx, x, shape, dtype, start, limit):
  return mlir.slice_op(ctx, x, _aval(np.subtract(limit, start), dtype), start_indices=start,
                       limit_indices=limit, strides=[1] * len(start))


def _transpose(x, perm):
  return hlo.transpose(x, mlir.dense_int_array(list(perm)))


def _concat(xs, dim: int):
  return xs[0] if len(xs) == 1 else hlo.concatenate(xs, mlir.i64_attr(dim))


def _lower(ctx, *xs, platform, kind, reduce, invariant, axes, prim, members):
  """One engine call for the bucket, or a string saying why not."""
  avals_in, avals_out = ctx.avals_in, ctx.avals_out
  dtype = avals_in[0].dtype
  params = [dict(m) for m in members]
  if kind == "all_reduce":
    flat = [_reshape(ctx, x, (c.prod(a.shape),), dtype) for x, a in zip(xs, avals_in)]
    total = sum(c.prod(a.shape) for a in avals_in)
    buf = _aval((total,), dtype)
    out = _ar._lower(ctx.replace(avals_in=[buf], avals_out=[buf]), _concat(flat, 0),
                     platform=platform, axes=axes, reduce=reduce, invariant=invariant)
    if isinstance(out, str):
      return out
    res, off = [], 0
    for a in avals_out:
      k = c.prod(a.shape)
      res.append(_reshape(ctx, _slice(ctx, out[0], (k,), dtype, [off], [off + k]), a.shape, dtype))
      off += k
    return res
  n = params[0]["axis_size"]
  if kind == "all_gather":
    flat = [_reshape(ctx, x, (c.prod(a.shape),), dtype) for x, a in zip(xs, avals_in)]
    total = sum(c.prod(a.shape) for a in avals_in)
    out = _gs.lower_gather(ctx.replace(avals_in=[_aval((total,), dtype)],
                                       avals_out=[_aval((n, total), dtype)]), _concat(flat, 0),
                           platform=platform, all_gather_dimension=0, axis_name=axes,
                           axis_index_groups=None, axis_size=n, tiled=False)
    if isinstance(out, str):
      return out
    res, off = [], 0
    for a_in, a_out, p in zip(avals_in, avals_out, params):
      k = c.prod(a_in.shape)
      piece = _slice(ctx, out[0], (n, k), dtype, [0, off], [n, off + k])
      piece = _reshape(ctx, piece, (n,) + tuple(a_in.shape), dtype)  # [rank, *shape]
      d = p["all_gather_dimension"]
      if d:  # rank axis to position d
        perm = list(range(1, d + 1)) + [0] + list(range(d + 1, len(a_in.shape) + 1))
        piece = _transpose(piece, perm)
      res.append(_reshape(ctx, piece, a_out.shape, dtype))
      off += k
    return res
  # reduce_scatter: each operand's scatter dimension first, as [rank, part]
  parts, fronts = [], []
  for x, a, p in zip(xs, avals_in, params):
    d = p["scatter_dimension"]
    perm = [d] + [i for i in range(len(a.shape)) if i != d]
    front = tuple(a.shape[i] for i in perm)
    y = _transpose(x, perm) if d else x
    parts.append(_reshape(ctx, y, (n, c.prod(front) // n), dtype))
    fronts.append((perm, front))
  total = sum(c.prod(a.shape) // n for a in avals_in)
  out = _gs.lower_scatter(ctx.replace(avals_in=[_aval((n, total), dtype)],
                                      avals_out=[_aval((total,), dtype)]), _concat(parts, 1),
                          platform=platform, scatter_dimension=0, axis_name=axes,
                          axis_index_groups=None, axis_size=n, tiled=False)
  if isinstance(out, str):
    return out
  res, off = [], 0
  for a_out, p, (perm, front) in zip(avals_out, params, fronts):
    k = c.prod(front) // n
    piece = _slice(ctx, out[0], (k,), dtype, [off], [off + k])
    off += k
    if not p["tiled"]:
      res.append(_reshape(ctx, piece, a_out.shape, dtype))
      continue
    mine = (front[0] // n,) + front[1:]
    piece = _reshape(ctx, piece, mine, dtype)
    if p["scatter_dimension"]:
      piece = _transpose(piece, list(np.argsort(perm)))
    res.append(piece)
  return res


def _one_by_one(ctx, *xs, prim, members, platform):
  """The bucket's calls lowered each by its own (lax's or the swap's) rule."""
  table = mlir._platform_specific_lowerings.get(platform, {})
  entry = table.get(prim) or mlir._lowerings[prim]
  rule = getattr(entry, "rule", entry)
  out = []
  for x, a_in, a_out, m in zip(xs, ctx.avals_in, ctx.avals_out, members):
    out += list(rule(ctx.replace(avals_in=[a_in], avals_out=[a_out]), x, **dict(m)))
  return out


def _rule(platform):
  def rule(ctx, *xs, **params):
    requirements.enforce()
    out = _lower(ctx, *xs, platform=platform, **params) if platform == "cpu" else \
        f"no combining on {platform}"
    if isinstance(out, str):
      requirements.fallback(f"jax_smddp's combined {params['kind']} lowers call by call", out)
      return _one_by_one(ctx, *xs, prim=params["prim"], members=params["members"],
                         platform=platform)
    return out
  return rule


def _never_traced(*args, **params):
  raise RuntimeError("jax_smddp's combined collective exists only while a shard_map body "
                     "is lowered; it is never traced.")


combined_p = core.Primitive("smddp_combined")
combined_p.multiple_results = True
combined_p.def_impl(_never_traced)
combined_p.def_abstract_eval(_never_traced)
mlir.register_lowering(combined_p, _rule("cpu"), platform="cpu")
mlir.register_lowering(combined_p, _rule("cuda"), platform="cuda")


# ---------------------------------------------------------------- shard_map's lowering, wrapped

_saved: dict[str, Any] = {}  # platform -> shard_map's own entry there (or None)


def install(active) -> None:
  """Combines in shard_map bodies lowered on CPU from now on; `active()`: the swapped set."""
  from jax_smddp._jax_internals import shard_map_p as prim
  if "cpu" in _saved:
    return
  table = mlir._platform_specific_lowerings["cpu"]
  _saved["cpu"] = table.get(prim)
  entry = _saved["cpu"] or mlir._lowerings[prim]

  def rule(ctx, *in_nodes, jaxpr, mesh, **params):
    manual = set(params.get("newly_manual_axes", ())) | set(getattr(mesh, "manual_axes", ()))
    if manual == set(mesh.axis_names):  # the engine takes fully manual shard_map only
      jaxpr = combine(jaxpr, active(), set(mesh.axis_names))
    return entry.rule(ctx, *in_nodes, jaxpr=jaxpr, mesh=mesh, **params)

  rule.__name__ = "smddp_combining_shard_map"
  mlir.register_lowering(prim, rule, platform="cpu", inline=entry.inline)


def uninstall() -> None:
  from jax_smddp._jax_internals import shard_map_p
  if "cpu" not in _saved:
    return
  original = _saved.pop("cpu")
  table = mlir._platform_specific_lowerings["cpu"]
  if original is None:
    table.pop(shard_map_p, None)
  else:
    table[shard_map_p] = original

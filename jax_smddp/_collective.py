"""What every jax_smddp collective shares.

Each collective is a JAX primitive whose parameters are those of the matching
``jax.lax`` primitive. Typing (shapes, varying axes under ``check_vma``, axis
checks) is delegated to jax.lax's abstract evaluation, so a jax_smddp
collective types exactly like its lax twin; the primitive's own rules are
batching, differentiation and lowering. On CPU the lowering emits the plugin's
FFI custom call; any case the engine does not handle (and every other
platform but CUDA) lowers through jax.lax's own rule. On CUDA the lowering
emits the GPU backend's custom call (jax_smddp/gpu.py sets up its
communicators), placed on XLA's collective stream by JAX's stream annotation
so XLA overlaps it with compute like its own collectives.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
from typing import Any, Callable

import numpy as np

import jax
import jax.numpy as jnp
from jax import tree_util
from jax.interpreters import batching

from jax_smddp._jax_internals import SPMDAxisContext, hlo, lax_parallel, mlir, pxla
from jax_smddp._jax_internals import jax_config
from jax_smddp._jax_internals import jax_core as core

from jax_smddp import _collectives
from jax_smddp import _native
from jax_smddp import config
from jax_smddp import requirements

log = logging.getLogger("jax_smddp")

# Element types the engine handles; others lower through jax.lax.
ENGINE_DTYPES = frozenset(np.dtype(t) for t in (
    np.bool_, np.int8, np.uint8, np.int32, np.uint32, np.int64,
    np.float16, jnp.bfloat16, np.float32, np.float64))

# Reductions, numbered as the engine's ReduceOp (exported from C++).
REDUCE_OPS = dict(_native.engine().reduce_ops())

# Lowering platforms with an engine (each its own rule), and the others, whose jax.lax
# rules are the fallback.
ENGINE_PLATFORMS = ("cpu", "cuda")
_OTHER_PLATFORMS = ("rocm", "tpu")


class _Unsupported(Exception):
  """Raised while emitting when the backend cannot take the call."""

_OP_IDS = ("jax_smddp", "op_ids")  # key of the per-module op counter
_MODULE_UID = ("jax_smddp", "module_uid")
_modules_lowered: dict[str, int] = {}  # by module name: how many lowered so far


def axes_tuple(axis_name) -> tuple:
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def check_bound(api: str, axes: tuple) -> None:
  """Raises a NameError that says what to do when an axis name is unbound."""
  env = core.get_axis_env()
  for name in axes:
    if not env.axis_exists(name):
      raise NameError(
          f"jax_smddp.{api}: axis name {name!r} is not bound here. Call jax_smddp "
          f"collectives inside jax.shard_map(f, mesh=mesh, in_specs=..., out_specs=...) "
          f"over a mesh that has an axis named {name!r}.")


def group_size(axes: tuple, axis_index_groups=None) -> int:
  """Ranks in each group of a collective over `axes` (in one of `axis_index_groups`)."""
  if axis_index_groups is not None:
    return len(axis_index_groups[0])
  env = core.get_axis_env()
  size = 1
  for name in axes:
    size *= env.axis_size(name)
  return size


def index_groups(axis_index_groups) -> tuple | None:
  """`axis_index_groups` as jax.lax keeps it in a primitive's parameters (tuples)."""
  if axis_index_groups is None:
    return None
  return tuple(tuple(int(i) for i in g) for g in axis_index_groups)


def replica_groups(axis_ctx, axes: tuple, axis_index_groups=None) -> np.ndarray:
  """The device ids of each group of a collective over `axes`, in rank order: one row
  per group. With `axis_index_groups` each group of the axes is split as jax.lax
  splits it (its members at those indices along the axes, in that order)."""
  base = pxla.axis_groups(axis_ctx, axes)
  if axis_index_groups is None:
    return np.asarray(base, dtype=np.int64)
  return np.asarray([[row[i] for i in g] for row in base for g in axis_index_groups],
                    dtype=np.int64)


def vma_checked() -> bool:
  return bool(jax_config._check_vma.value)


def pvary_for(axes: tuple, x):
  """Marks `x` as varying over `axes` where JAX would (auto_pcast), as lax does."""
  return lax_parallel.insert_collective_pvary(axes, x)


def make_primitive(name: str, op: str, to_lax: Callable[..., tuple[core.Primitive, dict]],
                   lower: Callable[..., Any]) -> core.Primitive:
  """A primitive typed like its lax twin, lowered by `lower` on CPU and CUDA.

  `op` is the collective it runs (one of _collectives.NAMES). `to_lax(**params)`
  names the lax primitive (and its parameters) that this call is equivalent to:
  used for typing and for every fallback lowering. `lower(ctx, x, *, platform,
  **params)` returns the lowered values for `platform` ("cpu" or "cuda"), or a
  string saying why the engine cannot take this case.
  """
  p = core.Primitive(f"smddp_{name}")

  def abstract_eval(x, **params):
    lax_prim, lax_params = to_lax(**params)
    return lax_prim.abstract_eval(x, **lax_params)

  def impl(*args, **params):
    raise RuntimeError(f"jax_smddp.{name} runs only inside jax.shard_map (under jax.jit).")

  p.def_effectful_abstract_eval(abstract_eval)
  p.def_impl(impl)

  def fallback(platform):
    def rule(ctx, x, **params):
      lax_prim, lax_params = to_lax(**params)
      return lax_rule(lax_prim, platform)(ctx, x, **lax_params)
    return rule

  def other_platform_rule(platform):
    def rule(ctx, x, **params):
      requirements.enforce()
      _log_fallback_once(name, f"jax_smddp has no backend for platform {platform or 'default'}")
      return fallback(platform)(ctx, x, **params)
    return rule

  def engine_rule(platform):
    def rule(ctx, x, **params):
      requirements.enforce()
      out = (lower_cuda(p, op, lower, ctx, x, params) if platform == "cuda"
             else lower(ctx, x, platform=platform, **params))
      if isinstance(out, str):
        _log_fallback_once(name, out)
        return fallback(platform)(ctx, x, **params)
      return out
    return rule

  mlir.register_lowering(p, other_platform_rule(None))
  for platform in _OTHER_PLATFORMS:
    mlir.register_lowering(p, other_platform_rule(platform), platform=platform)
  for platform in ENGINE_PLATFORMS:
    mlir.register_lowering(p, engine_rule(platform), platform=platform)
  return p


COLLECTIVE_STREAM = "gpu_stream:collective"


@functools.cache
def _stream_annotator():
  """JAX's function-form stream annotation: compute_on2 in jax 0.10.1-0.11.0,
  compute_on from 0.12 (None before 0.10.1: no annotation)."""
  from jax_smddp._jax_internals import compute_on as co
  for name in ("compute_on2", "compute_on"):
    fn = getattr(co, name, None)
    if fn is not None and "out_memory_spaces" in inspect.signature(fn).parameters:
      return fn
  return None


def collective_stream_enabled() -> bool:
  """JAX_SMDDP_GPU_STREAM=collective (default) puts every GPU collective on
  XLA's collective stream; =compute leaves it on the compute stream."""
  return config.value("JAX_SMDDP_GPU_STREAM") == "collective"


def lower_cuda(prim, op: str, lower, ctx, x, params):
  """The GPU backend's lowering of `prim` (bound with `params`; collective `op`),
  or a string saying why it does not take the call. `lower(ctx, x, *, platform,
  **params)` is the collective's lowering (it calls emit_ffi_call)."""
  if not _native.register_cuda_targets():
    return ("this jax_smddp was built without CUDA (nvcc was not found when it was installed): "
            "its collectives lower to XLA's own on GPUs")
  annotated = _on_collective_stream(prim, op, ctx, x, params)
  if annotated is not None:
    return annotated
  try:
    return lower(ctx, x, platform="cuda", **params)
  except _Unsupported as e:
    return str(e)


def _cuda_takes(ctx, op: str, params) -> bool:
  """Whether the GPU backend will take this call of `op` (checked before
  annotating, so a call that falls back to XLA's collective is never annotated)."""
  from jax_smddp import gpu
  axes = params.get("axis_name", params.get("axes"))
  if axes is None or params.get("axis_index_groups") is not None:
    return False
  axes = axes_tuple(axes)
  dtype = np.dtype(ctx.avals_in[0].dtype)
  if engine_unsupported(ctx, dtype, axes) or (_collectives.reduces(op) and dtype == np.bool_):
    return False
  groups = pxla.axis_groups(ctx.module_context.axis_context, axes)
  return gpu.unsupported(ctx.module_context.axis_context.mesh, groups, op) is None


def _group_of_one(ctx, params) -> bool:
  """Whether every group of the call has one rank: its collective is a local
  copy with no peer to wait for, so running it on the collective stream
  overlaps nothing and costs the streams' hand-off (an event each way)."""
  axes = axes_tuple(params.get("axis_name", params.get("axes")))
  groups = pxla.axis_groups(ctx.module_context.axis_context, axes)
  return len(groups[0]) == 1


def _on_collective_stream(p, op: str, ctx, x, params):
  """Lowers `p` inside JAX's stream annotation, so XLA wraps the custom call
  as an asynchronous start/done pair on its collective stream; None when
  already inside one, when disabled, when this jax has no annotation, when
  the GPU backend will not take the call, or when its groups have one rank."""
  eqn_ctx = getattr(ctx, "jaxpr_eqn_ctx", None)
  if eqn_ctx is not None and getattr(eqn_ctx, "compute_type", None):
    return None
  if not collective_stream_enabled():
    return None
  annotate = _stream_annotator()
  if annotate is None or not _cuda_takes(ctx, op, params) or _group_of_one(ctx, params):
    return None
  body = annotate(lambda v: p.bind(v, **params), compute_type=COLLECTIVE_STREAM,
                  out_memory_spaces=core.MemorySpace.Device)
  return mlir.lower_fun(body, multiple_results=False)(ctx, x)


def lax_rule(lax_prim: core.Primitive, platform: str | None):
  specific = mlir._platform_specific_lowerings.get(platform, {}) if platform else {}
  entry = specific.get(lax_prim) or mlir._lowerings[lax_prim]
  return entry.rule


def _log_fallback_once(name: str, why: str) -> None:
  """Warns once per reason (or raises, under JAX_SMDDP_REQUIRE=no-fallback)."""
  requirements.fallback(f"jax_smddp.{name} lowers through jax.lax here", why)


def engine_unsupported(ctx, dtype, axes: tuple, axis_index_groups=None) -> str | None:
  """Why the engine cannot run this call (None when it can)."""
  axis_ctx = ctx.module_context.axis_context
  if not isinstance(axis_ctx, SPMDAxisContext):
    return f"not inside jax.shard_map under jit (axis context {type(axis_ctx).__name__})"
  if set(axis_ctx.manual_axes) != set(axis_ctx.mesh.axis_names):
    return "shard_map is manual over only some mesh axes"
  if any(name not in axis_ctx.mesh.axis_names for name in axes):
    return f"axis {axes} is not a mesh axis (vmap or pmap axis)"
  if np.dtype(dtype) not in ENGINE_DTYPES:
    return f"element type {np.dtype(dtype).name} is not handled by the engine"
  if axis_index_groups is not None:
    size = group_size_of(ctx, axes)
    members = sorted(i for g in axis_index_groups for i in g)
    if members != list(range(size)) or len({len(g) for g in axis_index_groups}) != 1:
      return (f"axis_index_groups {axis_index_groups} are not groups of one size covering "
              f"the {size} indices of {axes} once")
  return None


def emit_ffi_call(ctx, platform: str, target: str, x, axes: tuple, x_aval, out_aval, *,
                  axis_index_groups=None, **attrs):
  """Emits the plugin's custom call for one collective on `platform` ("cpu", "cuda").

  Operands are the input and this device's partition id (the id XLA uses in
  replica groups); attributes are the replica groups (split by
  `axis_index_groups` as jax.lax splits them), the op's position in the module
  (with the XLA run id, the rendezvous key) and per-op layout.
  """
  if platform == "cuda":
    if axis_index_groups is not None:
      raise _Unsupported("axis_index_groups: the GPU backend takes whole mesh axes only")
    return _emit_cuda_call(ctx, target, x, axes, x_aval, out_aval, **attrs)
  _native.register_cpu_targets()
  axis_ctx = ctx.module_context.axis_context
  groups = replica_groups(axis_ctx, axes, axis_index_groups)
  processes = _processes_of(axis_ctx.mesh)
  cache = ctx.module_context.cached_primitive_lowerings
  op_ids = cache.setdefault(_OP_IDS, itertools.count())
  if _MODULE_UID not in cache:
    cache[_MODULE_UID] = _module_uid(ctx)
  op_id = next(op_ids)
  routing, chunk_bytes = _cross_process_choice(target, x_aval, groups, processes)
  partition_id = hlo.partition_id()
  pid_aval = core.ShapedArray((), np.uint32)
  call_ctx = ctx.replace(avals_in=[x_aval, pid_aval], avals_out=[out_aval])
  return jax.ffi.ffi_lowering(target)(
      call_ctx, x, partition_id,
      op_id=np.int64(op_id),
      groups=groups.reshape(-1),
      group_size=np.int64(groups.shape[1]),
      processes=processes,
      site_uid=np.int64((cache[_MODULE_UID] * 1_000_003 + op_id) & 0x7FFF_FFFF_FFFF_FFFF),
      routing=np.int64(routing),
      chunk_bytes=np.int64(chunk_bytes),
      **{k: _attribute(v) for k, v in attrs.items()})


def _attribute(v):
  """A per-op attribute as the handlers bind it: an int64, or an int64 array."""
  return np.asarray(v, np.int64) if isinstance(v, (np.ndarray, list, tuple)) else np.int64(v)


def _emit_cuda_call(ctx, target: str, x, axes: tuple, x_aval, out_aval, **attrs):
  """The GPU backend's custom call: the input only (the device's rank comes
  from its ordinal: a partition id on the GPU would need a device-to-host
  copy), with each partition's process and device ordinal."""
  from jax_smddp import gpu
  axis_ctx = ctx.module_context.axis_context
  mesh = axis_ctx.mesh
  groups = np.asarray(pxla.axis_groups(axis_ctx, axes), dtype=np.int64)
  why = gpu.unsupported(mesh, groups, target[len("smddp_"):])
  if why:
    raise _Unsupported(why)
  if target == "smddp_all_reduce" and gpu.spans_hosts(mesh, groups) and \
      prod(x_aval.shape) % groups.shape[1]:
    return _cuda_all_reduce_across_hosts(ctx, x, axes, x_aval, out_aval, groups.shape[1],
                                         attrs["reduce"])
  gpu.prepare(mesh, groups)
  devices = list(mesh.devices.flat)
  processes = np.asarray([d.process_index for d in devices], np.int64)
  ordinals = np.asarray([d.local_hardware_id if d.local_hardware_id is not None else d.id
                         for d in devices], np.int64)
  op_ids = ctx.module_context.cached_primitive_lowerings.setdefault(_OP_IDS, itertools.count())
  call_ctx = ctx.replace(avals_in=[x_aval], avals_out=[out_aval])
  return jax.ffi.ffi_lowering(target)(
      call_ctx, x,
      op_id=np.int64(next(op_ids)),
      groups=groups.reshape(-1),
      group_size=np.int64(groups.shape[1]),
      processes=processes,
      ordinals=ordinals,
      **{k: _attribute(v) for k, v in attrs.items()})


def _cuda_all_reduce_across_hosts(ctx, x, axes, x_aval, out_aval, n: int, reduce: int):
  """all_reduce over hosts on GPUs of a count that does not divide by the n
  ranks: the input padded to n equal shards for the engine's hierarchical
  all_reduce (a reduce_scatter and an all_gather,
  RunStreamHierarchicalAllReduce, which takes divisible counts as they are),
  then the padding sliced off. Padding only meets padding, so any reduction
  works."""
  count = prod(x_aval.shape)
  shard = -(-count // n)
  dtype = x_aval.dtype
  aval = lambda *shape: core.ShapedArray(shape, dtype)
  flat = mlir.reshape(ctx, x, aval(count))
  zero = mlir.ir_constant(np.zeros((), dtype))
  flat = hlo.pad(flat, zero, mlir.dense_int_array([0]), mlir.dense_int_array([n * shard - count]),
                 mlir.dense_int_array([0]))
  full, = _emit_cuda_call(ctx, "smddp_all_reduce", flat, axes, aval(n * shard), aval(n * shard),
                          reduce=reduce)
  full = hlo.slice(full, mlir.dense_int_array([0]), mlir.dense_int_array([count]),
                   mlir.dense_int_array([1]))
  return [mlir.reshape(ctx, full, out_aval)]


def _processes_of(mesh) -> np.ndarray:
  """The process of each partition id (the mesh's devices in order)."""
  if jax.process_count() == 1:
    return np.zeros(mesh.size, np.int64)
  from jax_smddp import distributed
  distributed.ensure_initialized()  # every process lowers the same program
  return np.asarray([d.process_index for d in mesh.devices.flat], np.int64)


_ROUTING = {"flat": 1, "hierarchical": 2}


def _cross_process_choice(target: str, x_aval, groups: np.ndarray, processes: np.ndarray):
  """(routing, chunk bytes) attributes for a call whose group spans processes,
  chosen by jax_smddp.tuning for this op, size and layout; (0, 0) (engine
  defaults) for groups inside one process."""
  group = groups[0]
  procs = processes[group]
  if len(set(procs.tolist())) == 1 or target == "smddp_collective_permute":
    return 0, 0  # a permute sends each block straight to its rank: no routes to choose
  from jax_smddp import distributed
  try:
    from jax_smddp import tuning
  except ImportError:  # no tuner: the engine's defaults, or the forced routes
    return _ROUTING.get(config.get("JAX_SMDDP_ALGORITHM") or "", 0), 0
  hosts = distributed.host_of_process()
  per_host: dict = {}
  per_proc: dict = {}
  for p in procs.tolist():
    per_proc[p] = per_proc.get(p, 0) + 1
  for p in per_proc:
    per_host.setdefault(hosts[p] if hosts else 0, set()).add(p)
  layout = tuning.Layout(hosts=len(per_host),
                         processes_per_host=max(len(v) for v in per_host.values()),
                         devices_per_process=max(per_proc.values()))
  op = target[len("smddp_"):]
  nbytes = prod(x_aval.shape) * np.dtype(x_aval.dtype).itemsize
  choice = tuning.choose(op, nbytes, layout)
  log.debug("jax_smddp %s, %d bytes per rank, %s: %s routes, %d-byte chunks (%s)", op, nbytes,
            layout, choice.algorithm, choice.chunk_bytes, choice.reason)
  return _ROUTING.get(choice.algorithm, 0), int(choice.chunk_bytes)


def _module_uid(ctx) -> int:
  """Names this module alike in every process of a job: its name and how many
  modules of that name this process lowered before (every process lowers the
  same programs in the same order), hashed. With the op's position, it names
  each collective instruction alike everywhere (instance numbers are local)."""
  try:
    name = str(ctx.module_context.module.operation.attributes["sym_name"])
  except (KeyError, AttributeError):
    name = "?"
  count = _modules_lowered.get(name, 0)
  _modules_lowered[name] = count + 1
  digest = 1469598103934665603
  for byte in f"{name}#{count}".encode():
    digest = ((digest ^ byte) * 1099511628211) & 0xFFFF_FFFF_FFFF
  return digest


def bind_gather(api: str, prim, x, axis_name, axis: int, tiled: bool, **extra):
  """The front end every gather shares: checks the axis names and `axis`,
  marks inputs varying as lax does, and binds `prim` on every leaf of `x`."""
  axes = axes_tuple(axis_name)
  check_bound(api, axes)
  size = group_size(axes, extra.get("axis_index_groups"))

  def bind(leaf):
    ndim = np.ndim(leaf)
    limit = ndim if tiled else ndim + 1
    if not -limit <= axis < limit:
      raise ValueError(f"jax_smddp.{api}: axis={axis} is out of range for an input of rank "
                       f"{ndim} (tiled={tiled}); use an axis in [{-limit}, {limit}).")
    return prim.bind(pvary_for(axes, leaf), all_gather_dimension=axis % limit, axis_name=axes,
                     axis_size=size, tiled=tiled, **extra)

  return tree_util.tree_map(bind, x)


def bind_scatter(api: str, prim, x, axis_name, scatter_dimension: int, tiled: bool,
                 axis_index_groups=None):
  """The front end of a summing scatter: checks the axis names, the scatter
  dimension against the group size and the dtype, marks inputs varying as lax
  does, and binds `prim` on every leaf of `x`."""
  axes = axes_tuple(axis_name)
  check_bound(api, axes)
  axis_index_groups = index_groups(axis_index_groups)
  size = group_size(axes, axis_index_groups)

  def bind(leaf):
    shape = np.shape(leaf)
    if not -len(shape) <= scatter_dimension < max(len(shape), 1):
      raise ValueError(f"jax_smddp.{api}: scatter_dimension={scatter_dimension} is out "
                       f"of range for an input of shape {shape}.")
    dim = scatter_dimension % len(shape)
    if tiled and shape[dim] % size:
      raise ValueError(
          f"jax_smddp.{api}: tiled scatter dimension {dim} has size {shape[dim]}, "
          f"which is not divisible by the {size} ranks of axis {axis_name!r}; pad that "
          f"dimension to a multiple of {size}.")
    if not tiled and shape[dim] != size:
      raise ValueError(
          f"jax_smddp.{api}: untiled scatter dimension {dim} has size {shape[dim]} "
          f"but axis {axis_name!r} has {size} ranks; they must be equal (or pass tiled=True).")
    if np.dtype(leaf.dtype) == np.bool_:
      raise TypeError(f"jax_smddp.{api} cannot sum booleans: cast to an integer "
                      "type first, e.g. x.astype(jnp.int32).")
    return prim.bind(pvary_for(axes, leaf), scatter_dimension=dim, axis_name=axes,
                     axis_index_groups=axis_index_groups, axis_size=size, tiled=tiled)

  return tree_util.tree_map(bind, x)


def lax_batcher(to_lax, axis_data, vals_in, dims_in, params):
  """vmap over the collective's own axis name: jax.lax's rule (no communication)."""
  lax_prim, lax_params = to_lax(**params)
  return batching.fancy_primitive_batchers[lax_prim](axis_data, vals_in, dims_in, **lax_params)


def bind_batched_gather(prim, x, d: int, params: dict):
  """A gather of `x` batched along `d` (not a collective axis): the gathered
  dimension moves past the batch one; returns (result, its batch dim)."""
  dim = params["all_gather_dimension"]
  if d <= dim:
    dim += 1
  elif not params["tiled"]:
    d += 1  # untiled gathers insert a dimension before the batch one
  return prim.bind(x, **{**params, "all_gather_dimension": dim}), d


def bind_batched_scatter(prim, x, d: int, params: dict):
  """A reduce-scatter of `x` batched along `d`, likewise."""
  dim = params["scatter_dimension"]
  if d <= dim:
    dim += 1
  elif not params["tiled"]:
    d -= 1  # untiled scatters remove a dimension before the batch one
  return prim.bind(x, **{**params, "scatter_dimension": dim}), d


def prod(shape) -> int:
  out = 1
  for s in shape:
    out *= int(s)
  return out


def group_size_of(ctx, axes: tuple, axis_index_groups=None) -> int:
  """Group size of a collective over `axes` (in one of `axis_index_groups`), at
  lowering time."""
  if axis_index_groups is not None:
    return len(axis_index_groups[0])
  mesh = ctx.module_context.axis_context.mesh
  return prod(mesh.shape[name] for name in axes)

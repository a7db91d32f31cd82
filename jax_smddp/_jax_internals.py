"""The one door to jax's private modules (``jax._src``): no other module of jax_smddp names them.

Checked against jax 0.10.2 (Python 3.11), jax 0.11.2 (Python 3.12, the GPU machine;
docs/gpu_measurements.md) and jax 0.12.0 (Python 3.12). A jax release may move any of these without notice;
when one is missing, importing its name from here raises :class:`JaxInternalMoved`, which names the
internal, the installed jax and the versions above (tests/build/test_jax_internals.py checks every one
against the installed jax).

Each internal is imported under a name of ours, resolved when first imported from here (so a tool's
internal that moved does not break ``import jax_smddp``). What jax offers publicly is used publicly
elsewhere (``jax.tree_util``, ``jax.interpreters.ad`` / ``batching``, ``jax.lax.squeeze``, ``jax.typeof``,
``jax.core.ShapedArray``): only what has no public home in every supported version is here.
"""
from __future__ import annotations

import importlib
from typing import NamedTuple

CHECKED = ("0.10.2", "0.11.2", "0.12.0")


class Internal(NamedTuple):
  module: str  # the jax._src module
  attr: str | None  # the one object taken from it, or None: the module itself
  uses: tuple[str, ...]  # the attributes jax_smddp reads from it (each must exist)
  why: str  # what jax_smddp uses it for
  public: str  # what public API would replace it, where one exists


INTERNALS: dict[str, Internal] = {
    "jax_core": Internal(
        "jax._src.core", None,
        ("MemorySpace", "Primitive", "ShapedArray", "get_axis_env", "Jaxpr", "NamedAxisEffect", "Var",
         "new_jaxpr_eqn"),
        "the collectives' primitives and avals; the bound axis sizes; swap/combine.py's jaxpr rewrite",
        "jax.extend.core has Primitive, Jaxpr, Var, new_jaxpr_eqn; none for get_axis_env, "
        "MemorySpace, NamedAxisEffect"),
    "jax_config": Internal(
        "jax._src.config", None, ("_check_vma",),
        "whether varying-manual-axes checking is on (the outputs' vma)", "none (jax.config has no reader)"),
    "mlir": Internal(
        "jax._src.interpreters.mlir", None,
        ("_lowerings", "_platform_specific_lowerings", "dense_int_array", "i64_attr", "ir_constant",
         "lower_fun", "register_lowering", "reshape", "slice_op"),
        "lowering the collectives; the swaps read and replace lax's lowering rules",
        "jax.interpreters.mlir has register_lowering, ir_constant, dense_int_array, lower_fun, "
        "i64_attr; none for the rule tables, reshape, slice_op"),
    "pxla": Internal(
        "jax._src.interpreters.pxla", None, ("axis_groups", "ExecuteReplicated"),
        "axis_index_groups as replica groups; jax_smddp/tools/switch_compare.py times executions", "none"),
    "lax_parallel": Internal(
        "jax._src.lax.parallel", None,
        ("all_gather_p", "all_gather_invariant_p", "all_gather_reduced_p", "all_to_all_p", "ppermute_p",
         "pbroadcast_p", "pmax_p", "pmin_p", "psum_p", "psum_invariant_p", "ragged_all_to_all_p",
         "reduce_scatter_p", "unreduced_psum_p", "unreduced_reduce_scatter_p",
         "insert_collective_pvary"),
        "lax's collective primitives (the primitives' recipes, the transposes, the swaps)",
        "none (jax.lax has the functions, not their primitives)"),
    "hlo": Internal(
        "jax._src.lib.mlir.dialects", "hlo",
        ("concatenate", "pad", "partition_id", "slice", "transpose"),
        "StableHLO ops in the lowerings", "none in jax (jaxlib ships it under jax._src.lib)"),
    "SPMDAxisContext": Internal(
        "jax._src.sharding_impls", "SPMDAxisContext", (),
        "telling a shard_map lowering from a pmap one", "none"),
    "compute_on": Internal(
        "jax._src.compute_on", None, (),
        "the GPU collective stream's annotation (compute_on2 or compute_on, chosen by signature)",
        "none"),
    "xla_bridge": Internal(
        "jax._src.xla_bridge", None,
        ("_backend_factories", "_backends", "backends_are_initialized", "make_cpu_client",
         "register_backend_factory", "register_plugin_callbacks"),
        "the XLA-level swaps wrap the CPU and CUDA client factories; bench's gloo with a hostname",
        "none (jax.extend.backend has no factory registry)"),
    "jax_distributed": Internal(
        "jax._src.distributed", None, ("global_state",),
        "the jax.distributed client (key-value store, process id, coordinator address)",
        "none (jax.distributed has initialize/shutdown only)"),
    "pjit": Internal(
        "jax._src.pjit", None, ("_get_fastpath_data",),
        "jax_smddp/tools/switch_compare.py turns off the C++ fast path to time every execution", "none"),
    "shard_map_p": Internal(
        "jax._src.shard_map", "shard_map_p", (),
        "swap/combine.py wraps shard_map's CPU lowering", "none"),
    "jaxlib_jax": Internal(
        "jax._src.lib", "_jax", ("make_gloo_tcp_collectives",),
        "bench's CPU client with gloo bound to a routable hostname", "none"),
}


class JaxInternalMoved(ImportError):
  """A jax internal that jax_smddp uses is not where jax_smddp was checked to find it."""


def _jax_version() -> str:
  try:
    import jax
    return jax.__version__
  except Exception as e:  # noqa: BLE001 - the message below still says what is missing
    return f"unknown ({e})"


def _moved(name: str, spec: Internal, missing: str, cause: str) -> JaxInternalMoved:
  return JaxInternalMoved(
      f"jax_smddp needs {missing} ({name}: {spec.why}), and jax {_jax_version()} has none ({cause}): "
      f"this jax release moved it. jax_smddp was checked against jax {', '.join(CHECKED)}; install one "
      f"of those (pip install 'jax=={CHECKED[-1]}'), or update jax_smddp/_jax_internals.py "
      f"(public replacement: {spec.public}).")


def resolve(name: str, spec: Internal | None = None):
  """The object `name` stands for, every attribute jax_smddp reads from it checked."""
  spec = spec or INTERNALS[name]
  try:
    module = importlib.import_module(spec.module)
  except ImportError as e:
    raise _moved(name, spec, spec.module, str(e)) from e
  obj = module
  if spec.attr is not None:
    if not hasattr(module, spec.attr):  # a submodule not imported yet, as `from module import attr`
      try:
        importlib.import_module(f"{spec.module}.{spec.attr}")
      except ImportError:
        pass
    if not hasattr(module, spec.attr):
      raise _moved(name, spec, f"{spec.module}.{spec.attr}", "no such attribute")
    obj = getattr(module, spec.attr)
  for attr in spec.uses:
    if not hasattr(obj, attr):
      where = spec.module if spec.attr is None else f"{spec.module}.{spec.attr}"
      raise _moved(name, spec, f"{where}.{attr}", "no such attribute")
  return obj


def __getattr__(name: str):
  if name not in INTERNALS:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  obj = resolve(name)
  globals()[name] = obj  # resolved once
  return obj

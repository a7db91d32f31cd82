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

# From a checkout's root, python -m / python -c put the current directory first on sys.path,
# so `import jax_smddp` finds the checkout's sources before an installed (not editable)
# jax_smddp. Sources whose native extension this Python cannot find hand over to an installed
# package of the same version, or fail naming both: a checkout's Python files never run with
# another version's native modules. Nothing else of the package is imported before this.
import os as _os
import sys as _sys


def _checkout_version(root: str) -> str | None:
  """The version pyproject.toml in `root` declares (the one place it is written), or None."""
  import tomllib
  try:
    with open(_os.path.join(root, "pyproject.toml"), "rb") as f:
      return str(tomllib.load(f)["project"]["version"])
  except (OSError, KeyError, TypeError, tomllib.TOMLDecodeError):
    return None


def _installed_elsewhere(package: str, path: list, cwd: str):
  """(spec, version) of the first installed jax_smddp on `path` other than the
  folder holding `package` (a jax_smddp/ folder; '' and relative entries are
  relative to `cwd`), or None. Installed: a regular package (with __init__.py)
  beside its native extension for this Python; never a namespace portion (an
  editable install's site-packages/jax_smddp/ holds only native modules) nor
  other sources (that install's .pth puts its checkout on sys.path). `version`
  is its distribution's, None without metadata."""
  from importlib import metadata
  from importlib.machinery import EXTENSION_SUFFIXES, PathFinder
  root = _os.path.realpath(_os.path.dirname(package))
  for entry in path:
    if not isinstance(entry, str) or _os.path.realpath(_os.path.join(cwd, entry)) == root:
      continue
    spec = PathFinder.find_spec("jax_smddp", [_os.path.join(cwd, entry)])
    if spec is None or not (spec.origin or "").endswith("__init__.py"):
      continue
    found = _os.path.dirname(spec.origin)
    if _os.path.realpath(found) == _os.path.realpath(package) or not any(
        _os.path.isfile(_os.path.join(found, "_smddp_cpu" + s)) for s in EXTENSION_SUFFIXES):
      continue
    dists = list(metadata.distributions(name="jax_smddp", path=[_os.path.dirname(found)]))
    return spec, (dists[0].version if dists else None)
  return None


def _installed_instead(package: str, path: list, cwd: str):
  """The spec of the package to import instead of `package` (a jax_smddp/ folder
  whose native extension this Python cannot find): an installed jax_smddp of
  the same version elsewhere on `path`; None when there is none (then
  jax_smddp._native says what to build) or when `package` is not in a checkout
  (no pyproject.toml beside it). Raises ImportError naming both folders, their
  versions and what to run when the installed one's version differs (or is
  unknown)."""
  root = _os.path.dirname(_os.path.abspath(package))
  ours = _checkout_version(root)
  found = _installed_elsewhere(package, path, cwd) if ours is not None else None
  if found is None:  # or not a checkout (a broken install): jax_smddp._native says what to do
    return None
  spec, installed = found
  if ours == installed:
    return spec
  if _os.path.realpath(root) == _os.path.realpath(cwd):
    why = f"{root} is the current directory, which python -m and python -c put first on sys.path"
    fix = (f"run from another directory than {root}, or run python -P (or set PYTHONSAFEPATH=1; "
           "Python >= 3.11), which leaves the current directory off sys.path")
  else:
    why = f"{root} is on sys.path before it (PYTHONPATH?)"
    fix = f"take {root} off sys.path"
  python = _sys.executable
  raise ImportError(
      f"jax_smddp: Python found the sources {package} (version {ours}; their native "
      f"extension is not built for this Python) before the installed jax_smddp "
      f"{_os.path.dirname(spec.origin)} (version {installed or 'unknown'}): {why}. The versions "
      f"differ, and one version's Python files never run with another's native modules. To use "
      f"the installed one: {fix}. To use the sources instead, build them into this Python "
      f"(replacing the installed one): cd {root} && {python} -m pip install nanobind "
      f"scikit-build-core cmake ninja && {python} -m pip install --no-build-isolation -e .")


def _hand_over(spec) -> None:
  """Runs the installed package `spec` as jax_smddp in this one's place. The import
  system returns what sys.modules holds when this __init__ ends, so `import
  jax_smddp`, its submodules (python -m jax_smddp.doctor) and find_spec all get
  the installed package, and nothing of the sources stays imported."""
  from importlib import util
  module = util.module_from_spec(spec)
  _sys.modules["jax_smddp"] = module
  spec.loader.exec_module(module)


def _without_native() -> bool:
  """Whether this package's native extension cannot be found (an editable
  install's finder or an installed package has it beside the Python files)."""
  from importlib import util
  return util.find_spec("jax_smddp._smddp_cpu") is None


def _cwd() -> str:
  try:
    return _os.getcwd()
  except OSError:  # removed since: '' on sys.path finds nothing there
    return "/nonexistent"


_instead = (_installed_instead(_os.path.dirname(_os.path.abspath(__file__)), _sys.path, _cwd())
            if _without_native() else None)
if _instead is not None:
  _hand_over(_instead)
else:
  from jax_smddp.capabilities import version
  from jax_smddp.all_gather import all_gather
  from jax_smddp.all_reduce import all_reduce, pmax, pmean, pmin, psum
  from jax_smddp.all_to_all import all_to_all
  from jax_smddp.ragged_all_to_all import ragged_all_to_all
  from jax_smddp.config import set_timeout, settings, timeout
  from jax_smddp.ppermute import ppermute
  from jax_smddp.pbroadcast import pbroadcast
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
    "pbroadcast", "all_reduce", "all_to_all", "ragged_all_to_all", "set_timeout", "timeout", "settings",
    "initialize", "shutdown", "topology", "traffic",
    "all_gather_invariant", "all_gather_reduced", "unreduced_psum_scatter",
    "all_gather_batched", "psum_scatter_batched", "psum_batched",
    "unshard", "use", "hybrid", "swap", "fsdp", "gpu", "errors",
]

"""Run at interpreter start-up by ``jax_smddp.pth`` (site-packages), before
any ``import jax``. With ``JAX_SMDDP_COLLECTIVES=xla`` (or ``all``) it

* points jaxlib's MPI trampoline at jax_smddp's MPI ABI library
  (``MPITRAMPOLINE_LIB``), which the trampoline looks up only once, when
  jaxlib loads (XLA's CPU collectives; see jax_smddp/swap/xla.py), unless the
  variable is already set;
* loads that front end, ``libsmddp_nccl.so`` (soname ``libnccl.so.2``), when
  ``jax`` is first imported, before JAX's CUDA plugin loads the real NCCL,
  so that the plugin's ``dlopen("libnccl.so.2")`` gets the front end (XLA's GPU
  collectives). Only where a JAX CUDA plugin is installed, ``JAX_PLATFORMS``
  does not exclude CUDA and the package has the library (a build with nvcc);
  a process that never imports jax never loads it.

It also holds the one parser of ``JAX_SMDDP_COLLECTIVES`` (:func:`parse_collectives`),
which the swaps, the plugin's entry point and ``jax_smddp.use`` call.

It never touches ``XLA_FLAGS``: the switch changes who runs the collectives,
nothing else (a program's own ``os.environ.setdefault("XLA_FLAGS", ...)`` must
still find the variable unset). The one XLA flag the GPU swap needs is added
as JAX creates its CUDA client (jax_smddp/swap/nccl.py), never on a CPU-only run.

Imports nothing but ``os``, ``sys`` and ``importlib.util`` at start-up
(``ctypes`` when it loads the front end); does nothing without the variable.
Imported as a module (by swap, xla_swap, nccl_swap, distributed, gpu and the
plugin's entry point), it only defines functions.
"""

import os
import sys

LIBRARY = "libsmddp_mpi.so"
NCCL_LIBRARY = "libsmddp_nccl.so"

# ------------------------------------------------------------------ JAX_SMDDP_COLLECTIVES
# The setting's registry entry (xla_ffi/common/settings.cc) states what it means; these are
# the names it accepts, in any case, as a comma list.
ENV_VAR = "JAX_SMDDP_COLLECTIVES"
# The collectives the cost model and the benchmarks cover, in the engine's order: the engine's
# description of them (xla_ffi/common/collective.h, read as jax_smddp._collectives.MODELLED),
# restated because start-up imports nothing native (tests/build/test_one_list.py checks both).
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
# What the lax swap can take: every collective (jax.lax.ppermute and pbroadcast too:
# collective_permute; jax.lax.ragged_all_to_all is all_to_all's).
SWAPPABLE = COLLECTIVES + ("collective_permute",)
# Each accepted name of a collective (jax_smddp's and jax.lax's) -> its jax_smddp name.
COLLECTIVE_NAMES = {
    "all_gather": "all_gather", "all_gather_invariant": "all_gather",
    "reduce_scatter": "reduce_scatter", "psum_scatter": "reduce_scatter",
    "all_reduce": "all_reduce", "psum": "all_reduce", "pmax": "all_reduce",
    "pmin": "all_reduce",
    "all_to_all": "all_to_all", "ragged_all_to_all": "all_to_all",
    "collective_permute": "collective_permute", "ppermute": "collective_permute",
    "pbroadcast": "collective_permute",
}
ALL_NAMES = ("all", "1", "true", "on", "yes")     # every collective (in the variable: and xla)
NONE_NAMES = ("none", "0", "false", "off", "no")  # none
XLA_NAME = "xla"                                  # XLA's own collectives (jax_smddp.swap.xla)


class Collectives:
  """What a ``JAX_SMDDP_COLLECTIVES`` value (or ``jax_smddp.use``'s names) asks for:
  ``ops``, the jax.lax collectives lowered through jax_smddp in shard_map (a
  frozenset of jax_smddp names); ``xla``, whether ``xla`` is named; ``all``,
  whether ``all`` (or 1, true, on, yes) is named."""

  __slots__ = ("ops", "xla", "all")

  def __init__(self, ops, xla: bool, all: bool):  # noqa: A002 (the name the variable takes)
    self.ops, self.xla, self.all = frozenset(ops), xla, all

  @property
  def xla_swap(self) -> bool:
    """Whether the variable asks for the XLA-level swap: ``xla``, or ``all`` (both swaps)."""
    return self.xla or self.all

  def __repr__(self) -> str:
    return f"Collectives(ops={sorted(self.ops)}, xla={self.xla}, all={self.all})"


def parse_collectives(value: str, strict: bool = True) -> Collectives:
  """`value`, a comma list of the names above (any case, blanks and empty items
  ignored), as a Collectives; an unknown name raises ValueError, or is ignored
  where `strict` is false (at interpreter start-up, which must never fail: the
  plugin raises when JAX starts its backends)."""
  ops, xla, every = set(), False, False
  for name in value.split(","):
    name = name.strip().lower()
    if name in ("",) + NONE_NAMES:
      continue
    if name == XLA_NAME:
      xla = True
    elif name in ALL_NAMES:
      every = True
      ops.update(SWAPPABLE)
    elif name in COLLECTIVE_NAMES:
      ops.add(COLLECTIVE_NAMES[name])
    elif strict:
      raise ValueError(
          f"jax_smddp: unknown collective {name!r}; use a comma list of {', '.join(SWAPPABLE)} "
          f"(or their jax.lax names {', '.join(n for n, op in COLLECTIVE_NAMES.items() if n != op)}), "
          f"'all' (or 1), 'xla' "
          f"(XLA's cross-process collectives only, see jax_smddp.swap.xla) or 'none' (or 0).")
  return Collectives(ops, xla, every)


def requested(value=None) -> bool:
  """Whether ``JAX_SMDDP_COLLECTIVES`` (or `value`) asks for the XLA-level swap."""
  if value is None:
    value = os.environ.get(ENV_VAR, "")
  return parse_collectives(value, strict=False).xla_swap


def library_path(library: str = LIBRARY) -> str:
  """A native library of this installation (default: the MPI ABI library). It
  lies in one of the package's folders: an installed package has one; an
  editable install (``pip install -e``) has the sources and, in site-packages,
  what the build installed."""
  import importlib.util
  spec = importlib.util.find_spec("jax_smddp")  # finds the package, imports nothing
  folders = list((spec and spec.submodule_search_locations) or [])
  folders = folders or [os.path.dirname(os.path.abspath(__file__))]
  for folder in folders:
    path = os.path.join(folder, library)
    if os.path.exists(path):
      return path
  # Sources (a checkout's root, the current directory) before an installed package: that
  # package's, which `import jax_smddp` runs in their place (jax_smddp/__init__.py).
  for entry in sys.path:
    path = os.path.join(entry or os.curdir, "jax_smddp", library) if isinstance(entry, str) else ""
    if path and os.path.exists(path):
      return os.path.abspath(path)
  return os.path.join(folders[0], library)


def cuda_plugins() -> list:
  """The JAX CUDA plugins installed here (``jax_plugins/xla_cuda12``,
  ``xla_cuda13``: what ``jax_cuda12_plugin``/``jax_cuda13_plugin`` install),
  found without importing them."""
  import importlib.util
  try:
    spec = importlib.util.find_spec("jax_plugins")
  except (ImportError, ValueError):
    return []
  found = []
  for folder in list((spec and spec.submodule_search_locations) or []):
    try:
      names = os.listdir(folder)
    except OSError:
      continue
    found += [os.path.join(folder, n) for n in sorted(names) if n.startswith("xla_cuda")]
  return found


def front_end_skipped() -> str:
  """Why this process does not load the NCCL API front end ("" when it does,
  or did): the reasons checked in this order."""
  if not requested():
    return f"{ENV_VAR} does not select xla"
  platforms = [p.strip().lower() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
  if platforms and not any(p in ("cuda", "gpu") for p in platforms):
    return f"JAX_PLATFORMS={os.environ['JAX_PLATFORMS']} excludes CUDA"
  if not cuda_plugins():
    return "no JAX CUDA plugin is installed (jax[cuda12] or jax[cuda13])"
  if not os.path.exists(library_path(NCCL_LIBRARY)):
    return (f"this build has no {NCCL_LIBRARY} (it is built where nvcc is found: "
            "pip install --no-build-isolation . on a machine with the CUDA toolkit)")
  return ""


def load_front_end():
  """Loads the NCCL API front end into this process where front_end_skipped()
  says so (RTLD_LOCAL: its symbols bind nothing else; the dynamic loader knows
  it by its soname, libnccl.so.2); returns its ctypes handle, or None."""
  if front_end_skipped():
    return None
  import ctypes
  return ctypes.CDLL(library_path(NCCL_LIBRARY), mode=os.RTLD_LOCAL)


class _LoadBeforeJax:
  """A sys.meta_path entry that loads the front end as ``jax`` is first
  imported (JAX's CUDA plugin opens the real NCCL when JAX first starts its
  backends, later), then removes itself. It finds no module itself."""

  def find_spec(self, name, path=None, target=None):
    if name == "jax":
      try:
        sys.meta_path.remove(self)
      except ValueError:
        pass
      try:
        load_front_end()
      except Exception:  # noqa: BLE001: never break `import jax` (nccl_swap loads it again
        pass             # as JAX creates its CUDA client, and says why it cannot)
    return None


def _set_up() -> None:
  if not requested():
    return
  if "MPITRAMPOLINE_LIB" not in os.environ:
    os.environ["MPITRAMPOLINE_LIB"] = library_path()
  if "jax" not in sys.modules:
    sys.meta_path.insert(0, _LoadBeforeJax())


if __name__ == "jax_smddp.pth":  # run by the .pth file, not imported
  _set_up()

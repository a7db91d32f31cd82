"""The XLA-level swap on GPUs: XLA's own NCCL calls served by jax_smddp.

JAX's CUDA plugin reaches NCCL by ``dlopen("libnccl.so.2")``, at run time (it
has no ``DT_NEEDED`` on NCCL). jax_smddp ships ``libsmddp_nccl.so``
(cuda/ncclapi/), an NCCL C API front end whose soname is ``libnccl.so.2``:
loaded into the process first, it is the library the plugin gets. It serves
``ncclAllGather``, ``ncclReduceScatter`` and ``ncclAllReduce`` on
communicators inside one host with jax_smddp's GPU engine, on the stream XLA
passes, and forwards every other call (other collectives, send/recv,
communicators across hosts, types or reductions the engine lacks) to the real
NCCL, which it opens by path. So the collectives XLA's partitioner inserts
into global-view ``jit`` programs run on jax_smddp without code changes, are
counted in ``jax_smddp.distributed.traffic_by_op()`` (as ``all-gather``,
``reduce-scatter``, ``all-reduce``) and fail naming a dead peer instead of
hanging. docs/gpu_xla_swap.md says what it does and does not do.

Selected by ``JAX_SMDDP_COLLECTIVES=xla`` (or ``all``) before Python starts,
as the CPU swap (:mod:`jax_smddp.swap.xla`):

1. At start-up ``jax_smddp.pth`` installs an import hook that, as ``jax`` is
   first imported, loads the front end (``RTLD_LOCAL``), before JAX's CUDA
   plugin loads the real NCCL (jax_smddp/_startup.py). It leaves ``XLA_FLAGS``
   alone.
2. When JAX creates its CUDA client, the plugin's wrapper of the client
   factory (:func:`jax_smddp.swap.clients.install`) connects jax_smddp's processes
   (:func:`jax_smddp.initialize`, over the jax.distributed key-value store) and
   hands the front end that world, this process's index and the real NCCL's
   path (:func:`find_real_nccl`; ``JAX_SMDDP_NCCL_LIBRARY`` overrides it).
   ``XLA_FLAGS`` stays as the program set it: XLA may capture collectives into
   its command buffers (CUDA graphs), which the front end serves as replayable
   calls (docs/gpu_xla_swap.md).

Where it cannot take over (no front end in this build, or NCCL loaded before
it), XLA's collectives stay on NCCL: logged once at WARNING, an error under
``JAX_SMDDP_REQUIRE=no-fallback``. :func:`front_end` says what the front end
served and forwarded; ``python -m jax_smddp.doctor`` shows it.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import sys

from jax_smddp import _startup
from jax_smddp import requirements
from jax_smddp._startup import NCCL_LIBRARY

log = logging.getLogger("jax_smddp")

SONAME = "libnccl.so.2"
REAL_ENV = "JAX_SMDDP_NCCL_LIBRARY"  # overrides find_real_nccl (read by the library itself)

_library = None      # the front end's ctypes handle, once set up (kept for the process's life)
_active = False      # set up as JAX created its CUDA client
_not_active = ""     # why XLA's GPU collectives stay on NCCL (after the client was created)


def library_path() -> str:
  """The front end of this installation (it may not exist: CPU-only builds)."""
  return _startup.library_path(NCCL_LIBRARY)


def find_real_nccl(path: list[str] | None = None) -> str | None:
  """The real ``libnccl.so.2``: ``nvidia/nccl/lib/libnccl.so.2`` (the layout of
  the ``nvidia-nccl-cu12`` and ``-cu13`` wheels) under the ``nvidia`` package's
  folders and then each entry of `path` (default: ``sys.path``), the first
  that exists; None when there is none. Never the front end itself."""
  candidates = []
  if path is None:
    import importlib.util
    try:
      spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
      spec = None
    for folder in list((spec and spec.submodule_search_locations) or []):
      candidates.append(os.path.join(folder, "nccl", "lib", SONAME))
    path = sys.path
  for entry in path:
    candidates.append(os.path.join(entry or os.getcwd(), "nvidia", "nccl", "lib", SONAME))
  ours = library_path()
  for c in candidates:
    if os.path.isfile(c) and not (os.path.exists(ours) and os.path.samefile(c, ours)):
      return os.path.abspath(c)
  return None


def _loaded_handle(name: str) -> int | None:
  """The handle of the object `name` (a path, or a soname) names in this
  process now, without loading anything; None when none does."""
  try:
    return ctypes.CDLL(name, mode=os.RTLD_LOCAL | getattr(os, "RTLD_NOLOAD", 4))._handle
  except OSError:
    return None


def _mapped_nccls() -> list[str]:
  """Files named libnccl.so* mapped into this process (from /proc/self/maps)."""
  try:
    with open("/proc/self/maps") as f:
      paths = {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}
  except OSError:
    return []
  return sorted(p for p in paths if os.path.basename(p).startswith("libnccl.so"))


def loaded() -> bool:
  """Whether the front end is loaded in this process (at start-up, or since)."""
  return os.path.exists(library_path()) and _loaded_handle(library_path()) is not None


def takes_over() -> str:
  """"" when ``dlopen("libnccl.so.2")`` in this process gives the front end
  (what JAX's CUDA plugin does at its first NCCL call), else why not."""
  ours = _loaded_handle(library_path()) if os.path.exists(library_path()) else None
  if ours is None:
    return "the front end is not loaded in this process"
  owner = _loaded_handle(SONAME)
  if owner == ours:
    return ""
  others = [p for p in _mapped_nccls()
            if os.path.exists(p) and not os.path.samefile(p, library_path())]
  return (f"another {SONAME} ({', '.join(others) or 'a library of that soname'}) was loaded "
          "before jax_smddp's front end, and the dynamic loader gives that one to JAX's CUDA "
          "plugin: set JAX_SMDDP_COLLECTIVES=xla before Python starts and import jax before any "
          "other library that loads NCCL (e.g. torch)")


def _open() -> tuple[ctypes.CDLL | None, str]:
  """The front end (loaded now if it was not), or None and why not."""
  path = library_path()
  if not os.path.exists(path):
    return None, (f"this jax_smddp build has no {NCCL_LIBRARY} (it is built where nvcc is found: "
                  "pip install --no-build-isolation . on a machine with the CUDA toolkit)")
  try:
    lib = ctypes.CDLL(path, mode=os.RTLD_LOCAL)  # never RTLD_GLOBAL: it must not bind NCCL's
  except OSError as e:
    return None, f"{path} does not load: {e}"
  lib.smddp_nccl_configure.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_char_p]
  lib.smddp_nccl_configure.restype = None
  lib.smddp_nccl_describe.argtypes = []
  lib.smddp_nccl_describe.restype = ctypes.c_char_p
  lib.smddp_nccl_close_at_exit.argtypes = []
  lib.smddp_nccl_close_at_exit.restype = ctypes.c_bool
  return lib, ""


def _close_at_exit(lib) -> None:
  """Tells the front end's groups' peers this process ends (it did not die),
  and closes the libfabric objects of its groups across hosts, so that
  jax_smddp's own exit hook (registered before this one, so run after it)
  closes the world's links."""
  if not lib.smddp_nccl_close_at_exit():
    log.warning("jax_smddp NCCL front end: network steps still ran at exit; libfabric endpoints "
                "left open")


def _load() -> tuple[ctypes.CDLL | None, str]:
  """The front end (loaded now if it was not), and "" or why it cannot serve."""
  lib, why = _open()
  return lib, why or takes_over()


def _configure(lib: ctypes.CDLL, process: int) -> str | None:
  """Hands the front end jax_smddp's world, `process` and the real NCCL; the
  real library's path (None when none was found)."""
  from jax_smddp import _native
  real = find_real_nccl()
  lib.smddp_nccl_configure(_native.engine().world_source(), int(process),
                           (real or "").encode())
  return real


def load_for_client() -> ctypes.CDLL | None:
  """Runs as JAX creates its CUDA client (jax_smddp.swap.clients), before the world
  connects: the front end, or None where it cannot serve; then XLA's GPU collectives
  stay on NCCL (logged once; raises under JAX_SMDDP_REQUIRE=no-fallback)."""
  global _not_active
  lib, why = _load()
  if lib is None or why:
    _not_active = why
    requirements.fallback("XLA's GPU collectives (JAX_SMDDP_COLLECTIVES=xla)",
                          f"they stay on NCCL: {why}")
    return None
  return lib


def serve(lib: ctypes.CDLL, process: int) -> None:
  """Then, with the world connected: hands the front end jax_smddp's world, `process`
  and the real NCCL; from here on it serves XLA's GPU collectives."""
  global _library, _active, _not_active
  real = _configure(lib, process)
  if not real and not os.environ.get(REAL_ENV):
    requirements.warn_once(
        "jax_smddp's NCCL front end has no real NCCL to forward to",
        f"no nvidia/nccl/lib/{SONAME} on sys.path (pip install nvidia-nccl-cu12 or -cu13, or set "
        f"{REAL_ENV}): the calls it does not serve will fail")
  if _library is None:  # peers must not mistake this process's normal exit for a death
    import atexit
    atexit.register(_close_at_exit, lib)
  _library, _active, _not_active = lib, True, ""
  log.info("jax_smddp: XLA's GPU collectives run on jax_smddp (%s; forwarding to %s)",
           library_path(), os.environ.get(REAL_ENV) or real)


def describe() -> dict | None:
  """The front end's account (None when it is not loaded in this process):
  ``{"served": {function: calls}, "captured": how many of those were captured
  into CUDA graphs (once each, however often the graph replays), "forwarded":
  {function: calls}, "reasons": [why calls were forwarded], "library": the real
  NCCL's path ("" until set), "version": its ncclGetVersion (0 when not
  loaded)}``."""
  if not loaded():
    return None
  lib, _ = _open()
  return json.loads(lib.smddp_nccl_describe().decode()) if lib is not None else None


def front_end() -> dict | None:
  """Whether XLA's GPU collectives run on jax_smddp in this process, and what
  the front end did; None when it is not loaded here. describe()'s keys, and:
  ``active`` (set up as JAX created its CUDA client, and what the CUDA plugin
  gets for libnccl.so.2), ``why_not`` ("" or why not), ``path`` (the front end),
  ``real`` (the real NCCL it forwards to, or would: the configured library,
  else JAX_SMDDP_NCCL_LIBRARY, else find_real_nccl())."""
  d = describe()
  if d is None:
    return None
  why = _not_active or takes_over()
  if not why and not _active:
    why = "JAX's CUDA client was not created in this process yet"
  d.update(active=_active and not why, why_not=why, path=library_path(),
           real=d.get("library") or os.environ.get(REAL_ENV) or find_real_nccl())
  return d


def status() -> tuple[str, str]:
  """(state, detail) for the doctor: "active", "ready" (loaded, takes over,
  the CUDA client not created yet), "off" (not selected or not applicable),
  "missing" (selected, but this build has no front end), "blocked" (loaded
  too late, or does not load)."""
  if not _startup.requested():
    return "off", ("XLA's GPU collectives run on NCCL (JAX_SMDDP_COLLECTIVES=xla before Python "
                   "starts serves them on jax_smddp)")
  f = front_end()
  if f is None:
    skipped = _startup.front_end_skipped()
    if skipped:
      missing = not os.path.exists(library_path()) and skipped.startswith("this build")
      return ("missing" if missing else "off"), (f"not loaded: {skipped}; XLA's GPU collectives "
                                                  "run on NCCL")
    _, why = _load()  # not loaded at start-up (python -S?): loads it now, as JAX's CUDA client would
    f = front_end()
    if f is None:
      return "blocked", why or "the front end does not load"
  if not f["library"] and f["real"]:
    # Tell it the real NCCL now, as JAX's CUDA client would (its version comes from there).
    from jax_smddp._jax_internals import jax_distributed
    _configure(_open()[0], int(jax_distributed.global_state.process_id or 0))
    f = front_end()
  real = f["real"] or "none found (the calls it does not serve would fail)"
  version = f.get("version") or 0
  if version:
    real += f" (NCCL {version // 10000}.{version // 100 % 100}.{version % 100})"
  forwarded = ", ".join(f"{k} {v}" for k, v in sorted(f["forwarded"].items())) or "nothing"
  served = ", ".join(f"{k} {v}" for k, v in sorted(f["served"].items())) or "nothing yet"
  if f.get("captured"):
    served += f" ({f['captured']} of them captured into CUDA graphs)"
  detail = (f"{f['path']}; real NCCL {real}; served {served}; forwarded {forwarded}"
            + (f" ({'; '.join(f['reasons'])})" if f["reasons"] else ""))
  if f["active"]:
    return "active", "active: " + detail
  if f["why_not"].startswith("JAX's CUDA client was not created"):
    return "ready", "loaded (JAX's CUDA client will use it): " + detail
  return "blocked", f"loaded, not active: {f['why_not']}; " + detail

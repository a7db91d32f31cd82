"""Run at interpreter start-up by ``jax_smddp.pth`` (site-packages), before
any ``import jax``. With ``JAX_SMDDP_COLLECTIVES=xla`` (or ``all``) it

* points jaxlib's MPI trampoline at jax_smddp's MPI ABI library
  (``MPITRAMPOLINE_LIB``), which the trampoline looks up only once, when
  jaxlib loads (XLA's CPU collectives; see jax_smddp/xla_swap.py), unless the
  variable is already set;
* adds ``--xla_gpu_enable_command_buffer=-COLLECTIVES`` to ``XLA_FLAGS``
  (unless ``XLA_FLAGS`` already sets ``--xla_gpu_enable_command_buffer``): XLA
  must not capture its GPU collectives into CUDA graphs, which the NCCL API
  front end refuses (jax_smddp/nccl_swap.py);
* loads that front end, ``libsmddp_nccl.so`` (soname ``libnccl.so.2``), when
  ``jax`` is first imported, before JAX's CUDA plugin loads the real NCCL,
  so that the plugin's ``dlopen("libnccl.so.2")`` gets the front end (XLA's GPU
  collectives). Only where a JAX CUDA plugin is installed, ``JAX_PLATFORMS``
  does not exclude CUDA and the package has the library (a build with nvcc);
  a process that never imports jax never loads it.

Imports nothing but ``os``, ``sys`` and ``importlib.util`` at start-up
(``ctypes`` when it loads the front end); does nothing without the variable.
Imported as a module (by xla_swap and nccl_swap), it only defines functions.
"""

import os
import sys

LIBRARY = "libsmddp_mpi.so"
NCCL_LIBRARY = "libsmddp_nccl.so"
# XLA's "+X/-X" form: the default command buffer types, less COLLECTIVES.
COMMAND_BUFFER_FLAG = "--xla_gpu_enable_command_buffer=-COLLECTIVES"
_ON = ("all", "1", "true", "on", "yes", "xla")


def requested(value=None) -> bool:
  """Whether ``JAX_SMDDP_COLLECTIVES`` (or `value`) asks for the XLA-level swap."""
  if value is None:
    value = os.environ.get("JAX_SMDDP_COLLECTIVES", "")
  return any(v.strip().lower() in _ON for v in value.split(","))


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
    return "JAX_SMDDP_COLLECTIVES does not select xla"
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
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_gpu_enable_command_buffer" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {COMMAND_BUFFER_FLAG}".strip()
  if "jax" not in sys.modules:
    sys.meta_path.insert(0, _LoadBeforeJax())


if __name__ == "jax_smddp.pth":  # run by the .pth file, not imported
  _set_up()

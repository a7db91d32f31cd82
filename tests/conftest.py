"""Test set-up: 8 XLA CPU devices in this process, 64-bit types available."""

import os
import sys

import pytest

# Tests live in one folder per layer (api, engine, native, multiprocess, gpu,
# tools, build); the shared helpers beside this file.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402  (must come after XLA_FLAGS)

jax.config.update("jax_enable_x64", True)

# Each test is marked with its layer's folder (pytest -m engine, -m "not multiprocess");
# `slow` marks what the fast selection (pytest -m "not slow") leaves out: jobs of
# several processes, builds, the examples, the benchmark and the native programs.
_LAYERS = ("api", "engine", "native", "multiprocess", "gpu", "tools", "build")
_SLOW_LAYERS = {"multiprocess", "build", "native"}
_SLOW_FILES = {"test_examples.py", "test_bench.py", "test_memory.py"}


def pytest_collection_modifyitems(config, items):
  for item in items:
    parts = item.path.parts
    layer = next((p for p in reversed(parts[:-1]) if p in _LAYERS), None)
    if layer:
      item.add_marker(getattr(pytest.mark, layer))
    if layer in _SLOW_LAYERS or item.path.name in _SLOW_FILES:
      item.add_marker(pytest.mark.slow)
  _check_every_layer_collected(config, items)


def _check_every_layer_collected(config, items):
  """A run of the whole tree (`pytest tests`, or no path) that collected nothing from one of
  the layers' folders fails, before -m/-k select: a collection rule had dropped a whole layer
  (pytest's default norecursedirs holds "build": tests/build never ran)."""
  here = os.path.dirname(os.path.abspath(__file__))
  if [os.path.abspath(str(a)) for a in config.args] != [here]:
    return
  found = {next((p for p in reversed(item.path.parts[:-1]) if p in _LAYERS), None)
           for item in items}
  missing = [layer for layer in _LAYERS if layer not in found]
  if missing:
    raise pytest.UsageError(f"pytest collected no test from tests/{', tests/'.join(missing)}: "
                            "a collection rule (norecursedirs, --ignore, conftest) drops them")


@pytest.fixture(scope="session")
def example_compile_cache(tmp_path_factory) -> dict:
  """The environment for the example's runs in this session: JAX's persistent compilation
  cache in one directory, for every program however quick to compile. Runs that compile the
  same programs (a configuration stopped and resumed, the same job under another launcher,
  the same mesh's initialisation) compile each once: a tiny run takes 5 s instead of 14.
  Not for a run whose compiled programs a test reads from XLA's dump (--dump-hlo): a
  program loaded from the cache is not compiled, so not dumped."""
  return {"JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("example_compile_cache")),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}

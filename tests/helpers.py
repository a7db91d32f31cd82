"""Shared test helpers: meshes, sharded inputs, and a runner that executes the
same shard_map body with jax_smddp and with jax.lax."""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding


def mesh_1d(n: int = 8):
  return jax.make_mesh((n,), ("x",))


def mesh_2d():
  return jax.make_mesh((2, 4), ("r", "s"))


def random_array(shape, dtype, seed=0):
  """Data that reveals misplaced blocks: distinct values everywhere."""
  rng = np.random.default_rng(seed)
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return rng.integers(0, 2, size=shape).astype(np.bool_)
  if np.issubdtype(dtype, np.integer):
    info = np.iinfo(dtype)
    lo, hi = max(info.min, -100), min(info.max, 100)
    return rng.integers(lo, hi, size=shape).astype(dtype)
  return rng.standard_normal(shape).astype(dtype)


def shard(x, mesh, spec):
  return jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))


def run(body, x, mesh, in_spec, out_spec, check_vma=True):
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=out_spec,
                            check_vma=check_vma))
  return f, f(shard(x, mesh, in_spec))


def lowered_text(body, x, mesh, in_spec, out_spec, check_vma=True):
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=out_spec,
                            check_vma=check_vma))
  return f.lower(shard(x, mesh, in_spec)).as_text()


def assert_same(got, want, dtype):
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
  if np.dtype(dtype) in (np.dtype(np.float16), np.dtype(jnp.bfloat16)):
    # 16-bit floats: the engine accumulates in f32, XLA may not.
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-2, atol=2e-2)
  elif np.issubdtype(np.dtype(dtype), np.floating):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  else:
    np.testing.assert_array_equal(got, want)


# Not built is a failure, here as in CI, never a skip: a skip would let a run go
# green with every engine and native test left out. To leave them out on
# purpose, deselect them: pytest -m "not engine and not native".
_NOT_BUILT = ("{what} is not built in this environment: bash scripts/build_testing.sh VENV "
              "(or leave these tests out: pytest -m \"not engine and not native\")")


def engine_probes():
  """The tests' probes into the engine (_smddp_testing, built into the test
  environment by scripts/build_testing.sh; not part of the package)."""
  try:
    import _smddp_testing
  except ImportError as e:
    raise ImportError(_NOT_BUILT.format(what="_smddp_testing")) from e
  return _smddp_testing


def faults_to_refill(nbytes: int, count: int = 1) -> int:
  """Page faults taken writing `count` fresh glibc allocations of `nbytes` each
  (all held while written, then freed): none when glibc serves them from memory
  its heap kept, one per page when it maps them afresh
  (JAX_SMDDP_HEAP_REUSE_BYTES, JAX_SMDDP_HEAP_TRIM_BYTES)."""
  import ctypes
  import resource
  libc = ctypes.CDLL(None)
  libc.malloc.restype = ctypes.c_void_p
  libc.malloc.argtypes = [ctypes.c_size_t]
  libc.free.argtypes = [ctypes.c_void_p]
  blocks = [libc.malloc(nbytes) for _ in range(count)]
  assert all(blocks), f"malloc({nbytes}) failed"
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  for p in blocks:
    ctypes.memset(p, 1, nbytes)
  taken = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
  for p in reversed(blocks):
    libc.free(p)
  return taken


def ran_in_first_suite(what: str) -> None:
  """Skips, in scripts/test.sh's second suite (SMDDP_FIRST_SUITE_RAN=1), a test of `what` whose
  subject is the same whatever the Python and jax (C++ programs, the engine through its
  probes, the transports between hosts, CMake, the sdist, the formatters): the first suite ran
  it. The second suite runs what depends on them (the API, the examples, jobs' set-up and
  faults as Python sees them). Called in a test, or at a module's top for all of its tests."""
  import os
  if os.environ.get("SMDDP_FIRST_SUITE_RAN") == "1":
    import pytest
    pytest.skip(f"{what}: the same whatever the Python and jax, run by the first suite "
                "(scripts/test.sh)", allow_module_level=True)


def native_program(name: str) -> str:
  """A native test program (tests/native) built by scripts/build_testing.sh
  into build/testing-<python tag>/ (CMake target smddp_tests); skipped in the second suite
  (ran_in_first_suite)."""
  import os
  import sys
  ran_in_first_suite("the native test programs")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
  path = os.path.join(root, "build", f"testing-{tag}", name)
  if not os.path.exists(path):
    raise FileNotFoundError(_NOT_BUILT.format(what=path))
  return path


def need_netns():
  """Skips a test that needs network namespaces where they cannot be made (fails in CI,
  which must run the two-host tests)."""
  import os
  import pytest
  from jax_smddp.tools import netns
  why = netns.available()
  if why:
    if os.environ.get("CI") == "true":
      pytest.fail(f"two-host tests must run in CI: {why}")
    pytest.skip(why)


def not_editable() -> str | None:
  """Why commands run from the checkout's root would not find the built package
  (the sources shadow it), or None when this environment has the checkout's
  editable install (scripts/setup_env.sh: pip install -e)."""
  import importlib.metadata
  import json
  import os
  import urllib.parse
  import urllib.request
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    url = json.loads(importlib.metadata.distribution("jax_smddp").read_text("direct_url.json") or "{}")
  except importlib.metadata.PackageNotFoundError:
    return "jax_smddp is not installed in this environment"
  if not url.get("dir_info", {}).get("editable"):
    return ("jax_smddp is installed here, not editable: from the checkout's root its sources shadow "
            f"it (scripts/setup_env.sh installs it editable: pip install --no-build-isolation -e {root})")
  if os.path.realpath(urllib.request.url2pathname(urllib.parse.urlparse(url.get("url", "")).path)) \
      != os.path.realpath(root):
    return f"jax_smddp is installed editable from {url.get('url')}, not from {root}"
  return None

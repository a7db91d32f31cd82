"""glibc's heap kept for XLA's large outputs (JAX_SMDDP_HEAP_REUSE_BYTES,
xla_ffi/common/heap_reuse.h): nothing changes until the process sets up its
first CPU collective; from then on an allocation above glibc's own mmap
threshold (32 MiB at most) is served again from the heap without page faults,
where glibc's default maps it afresh (one fault per 4 KiB page). The setting 0
and glibc's own environment variables leave glibc alone."""

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc",
                                reason="the heap policy is glibc's")

SCRIPT = textwrap.dedent("""
  import json, os, resource, sys
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  import numpy as np
  import jax
  from jax.sharding import PartitionSpec as P, NamedSharding
  import jax_smddp as smddp
  from jax_smddp import capabilities
  sys.path.insert(0, sys.argv[1])
  from helpers import faults_to_refill

  out = {"before": capabilities.heap_reuse()}
  mesh = jax.make_mesh((2,), ("x",))
  x = jax.device_put(np.arange(2048, dtype=np.float32), NamedSharding(mesh, P("x")))
  f = jax.jit(jax.shard_map(lambda v: smddp.all_gather(v, "x", tiled=True), mesh=mesh,
                            in_specs=P("x"), out_specs=P("x")))
  got = np.asarray(f(x))
  np.testing.assert_array_equal(got[:2048], np.arange(2048, dtype=np.float32))
  np.testing.assert_array_equal(got[2048:], np.arange(2048, dtype=np.float32))
  out["after"] = capabilities.heap_reuse()
  # above glibc's largest dynamic mmap threshold (32 MiB)
  size = int(os.environ.get("PROBE_BYTES", 40 << 20))
  faults_to_refill(size)
  out["faults"] = [faults_to_refill(size) for _ in range(4)]
  out["pages"] = size // resource.getpagesize()
  print("RESULT", json.dumps(out))
""")

GLIBC_MALLOC_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                     "GLIBC_TUNABLES")


def run_script(tmp_path, script: str, unset: tuple[str, ...], env_extra: dict[str, str]) -> str:
  """Runs `script` (given the tests' folder) in a process whose environment lacks XLA_FLAGS,
  glibc's malloc variables and `unset`, plus `env_extra`; returns what it printed after
  "RESULT "."""
  path = tmp_path / "probe.py"
  path.write_text(script)
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS",) + GLIBC_MALLOC_VARS + unset}
  env.update(env_extra)
  tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, str(path), tests], env=env, capture_output=True, text=True,
                        timeout=170)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  assert line, proc.stdout + proc.stderr
  return line[0][len("RESULT "):]


def probe(tmp_path, env_extra: dict[str, str]) -> dict:
  return json.loads(run_script(tmp_path, SCRIPT, ("JAX_SMDDP_HEAP_REUSE_BYTES",), env_extra))


@pytest.mark.timeout(180)
def test_large_allocations_are_reused_after_the_first_collective(tmp_path):
  r = probe(tmp_path, {})
  assert r["before"] == {"bytes": 64 << 20, "reason": "", "applied": False}, r
  assert r["after"] == {"bytes": 64 << 20, "reason": "", "applied": True}, r
  # Served again from the heap: no page of the 40 MiB is faulted in anew.
  assert max(r["faults"]) < r["pages"] // 100, r


@pytest.mark.timeout(180)
def test_setting_zero_leaves_glibc_alone(tmp_path):
  r = probe(tmp_path, {"JAX_SMDDP_HEAP_REUSE_BYTES": "0"})
  assert r["after"]["applied"] is False and r["after"]["bytes"] == 0, r
  assert "JAX_SMDDP_HEAP_REUSE_BYTES=0" in r["after"]["reason"], r
  # glibc's own policy: a fresh mapping, every page faulted in on each round.
  assert min(r["faults"]) >= r["pages"] // 2, r


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name,value", [("MALLOC_MMAP_THRESHOLD_", "1048576"),
                                        ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1048576")])
def test_glibc_environment_wins(tmp_path, name, value):
  r = probe(tmp_path, {name: value})
  assert r["after"]["applied"] is False and r["after"]["bytes"] == 0, r
  assert r["after"]["reason"].startswith(name), r
  assert min(r["faults"]) >= r["pages"] // 2, r


@pytest.mark.timeout(180)
@pytest.mark.parametrize("setting,kept,reused", [("16M", 16 << 20, False), ("1G", 1 << 30, True)])
def test_the_threshold_is_the_setting(tmp_path, setting, kept, reused):
  # 16M: blocks above it are mapped afresh once the heap's top cannot hold them: 96 MiB, more
  # than the policy's top pad (64 MiB) keeps there (a 40 MiB block was at times served from
  # the pad). 1G, the largest: twice it does not fit mallopt's int, so the trim threshold is
  # clamped, not wrapped.
  probe_bytes = str((40 if reused else 96) << 20)
  r = probe(tmp_path, {"JAX_SMDDP_HEAP_REUSE_BYTES": setting, "PROBE_BYTES": probe_bytes})
  assert r["after"] == {"bytes": kept, "reason": "", "applied": True}, r
  if reused:
    assert max(r["faults"]) < r["pages"] // 100, r
  else:
    assert min(r["faults"]) >= r["pages"] // 2, r


ARENAS_SCRIPT = textwrap.dedent("""
  import ctypes, os, re, sys, tempfile
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  import jax_smddp as smddp  # before jax starts its CPU client: the cap applies to its threads
  import numpy as np
  import jax
  from jax.sharding import PartitionSpec as P, NamedSharding
  from jax_smddp import capabilities
  mesh = jax.make_mesh((2,), ("x",))
  x = jax.device_put(np.arange(1 << 20, dtype=np.float32), NamedSharding(mesh, P("x")))
  f = jax.jit(jax.shard_map(lambda v: smddp.all_gather(v, "x", tiled=True), mesh=mesh,
                            in_specs=P("x"), out_specs=P("x")))
  for _ in range(5):
    f(x).block_until_ready()
  libc = ctypes.CDLL(None)
  libc.fopen.restype = ctypes.c_void_p
  libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
  libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
  libc.fclose.argtypes = [ctypes.c_void_p]
  path = os.path.join(tempfile.mkdtemp(), "malloc.xml")
  fp = libc.fopen(path.encode(), b"w")
  assert libc.malloc_info(0, fp) == 0
  libc.fclose(fp)
  arenas = len(re.findall(r"<heap nr=", open(path).read()))
  print("RESULT", arenas, capabilities.malloc_arenas())
""")


def arenas_used(tmp_path, env_extra: dict[str, str]) -> tuple[int, str]:
  n, info = run_script(tmp_path, ARENAS_SCRIPT, ("JAX_SMDDP_MALLOC_ARENAS", "MALLOC_ARENA_MAX"),
                       env_extra).split(" ", 1)
  return int(n), info


@pytest.mark.timeout(180)
def test_xla_threads_share_the_kept_heap(tmp_path):
  """JAX_SMDDP_MALLOC_ARENAS (1 by default) caps glibc's arenas when jax_smddp is imported: XLA's
  device threads, started after, allocate from the main heap (which the policy above keeps)
  rather than from heaps of their own that glibc unmaps once empty (docs/cpu_steadiness.md: the 2x2
  all_gather's outliers). With 0 each busy thread gets an arena of its own."""
  capped, info = arenas_used(tmp_path, {})
  assert capped == 1 and "'arenas': 1" in info, (capped, info)
  left, info = arenas_used(tmp_path, {"JAX_SMDDP_MALLOC_ARENAS": "0"})
  assert left > 1 and "JAX_SMDDP_MALLOC_ARENAS=0" in info, (left, info)
  env, info = arenas_used(tmp_path, {"MALLOC_ARENA_MAX": "3"})
  assert "MALLOC_ARENA_MAX is set" in info, (env, info)


THREAD_ARENA_SCRIPT = textwrap.dedent("""
  import ctypes, json, os, queue, resource, sys, threading
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  sys.path.insert(0, sys.argv[1])
  from helpers import faults_to_refill

  libc = ctypes.CDLL(None)
  libc.malloc.restype = ctypes.c_void_p
  libc.malloc.argtypes = [ctypes.c_size_t]
  libc.free.argtypes = [ctypes.c_void_p]
  jobs, results = queue.Queue(), queue.Queue()

  def thread():
    # This thread's first malloc takes an arena of its own: before jax_smddp is imported, as the
    # threads jax.distributed.initialize starts do (the arena cap comes too late for them).
    libc.free(libc.malloc(1024))
    while (size := jobs.get()) is not None:
      held = libc.malloc(size)  # fills the arena's first heap, which glibc never unmaps
      results.put([faults_to_refill(size) for _ in range(5)])  # so these come from a second
      libc.free(held)

  worker = threading.Thread(target=thread)
  worker.start()
  import numpy as np
  import jax
  from jax.sharding import PartitionSpec as P, NamedSharding
  import jax_smddp as smddp
  from jax_smddp import capabilities
  mesh = jax.make_mesh((2,), ("x",))
  x = jax.device_put(np.arange(2048, dtype=np.float32), NamedSharding(mesh, P("x")))
  f = jax.jit(jax.shard_map(lambda v: smddp.all_gather(v, "x", tiled=True), mesh=mesh,
                            in_specs=P("x"), out_specs=P("x")))
  f(x).block_until_ready()  # sets the heap policy up
  size = 40 << 20  # below the policy's threshold: from the thread's arena (64 MiB heaps)
  jobs.put(size)
  faults = results.get()
  jobs.put(None)
  worker.join()
  print("RESULT", json.dumps({"after": capabilities.heap_reuse(), "faults": faults[1:],
                              "pages": size // resource.getpagesize()}))
""")


@pytest.mark.timeout(180)
def test_a_thread_arena_keeps_its_emptied_heap(tmp_path):
  """A thread whose arena predates jax_smddp's import (the cap then does not apply to it) gets a
  40 MiB block, beside another in the arena's first heap, from a second heap, which glibc unmaps
  once the block is freed unless the policy's top pad keeps it (M_TOP_PAD): then the block is
  served again without page faults."""
  r = json.loads(run_script(tmp_path, THREAD_ARENA_SCRIPT,
                            ("JAX_SMDDP_HEAP_REUSE_BYTES", "MALLOC_ARENA_MAX"), {}))
  assert r["after"]["applied"] is True, r
  assert max(r["faults"]) < r["pages"] // 100, r


TRIM_SCRIPT = textwrap.dedent("""
  import json, os, resource, sys
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  import jax_smddp as smddp
  import numpy as np
  import jax
  from jax.sharding import PartitionSpec as P, NamedSharding
  from jax_smddp import capabilities
  sys.path.insert(0, sys.argv[1])
  from helpers import faults_to_refill

  mesh = jax.make_mesh((2,), ("x",))
  x = jax.device_put(np.arange(2048, dtype=np.float32), NamedSharding(mesh, P("x")))
  f = jax.jit(jax.shard_map(lambda v: smddp.all_gather(v, "x", tiled=True), mesh=mesh,
                            in_specs=P("x"), out_specs=P("x")))
  f(x).block_until_ready()  # the policy applies
  size, count = 40 << 20, 4  # below the policy's threshold: from the main heap
  # Blocks written through, then all freed: the heap's top grows by their 160 MiB.
  faults_to_refill(size, count)
  print("RESULT", json.dumps({"after": capabilities.heap_reuse(),
                              "faults": faults_to_refill(size, count),
                              "pages": count * size // resource.getpagesize()}))
""")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("setting,kept", [(None, True), ("128M", False)])
def test_the_heap_keeps_its_freed_top_up_to_the_trim_setting(tmp_path, setting, kept):
  """160 MiB of outputs freed together at the top of the main heap stay there under
  JAX_SMDDP_HEAP_TRIM_BYTES' default (1G), so the same blocks are written again without page
  faults; at 128M (twice the reuse threshold, the trim threshold before the setting) glibc gives
  all but its 64 MiB pad back and the blocks fault in afresh."""
  env = {} if setting is None else {"JAX_SMDDP_HEAP_TRIM_BYTES": setting}
  r = json.loads(run_script(tmp_path, TRIM_SCRIPT,
                            ("JAX_SMDDP_HEAP_REUSE_BYTES", "JAX_SMDDP_HEAP_TRIM_BYTES",
                             "MALLOC_ARENA_MAX", "JAX_SMDDP_MALLOC_ARENAS"), env))
  assert r["after"]["applied"] is True, r
  if kept:
    assert r["faults"] < r["pages"] // 100, r
  else:
    assert r["faults"] >= r["pages"] // 4, r

"""Repeated collectives do not grow the process: the engine keeps nothing
per call (a long-lived allocation per call once pinned glibc's heaps and
grew RSS by gigabytes over a few hundred steps)."""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
  import os
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  import jax, jax.numpy as jnp
  from jax.sharding import PartitionSpec as P, NamedSharding
  import jax_smddp as smddp
  mesh = jax.make_mesh((8,), ("x",))
  x = jax.device_put(jnp.ones((8 * 65536,), jnp.float32), NamedSharding(mesh, P("x")))
  f = jax.jit(jax.shard_map(
      lambda v: smddp.psum_scatter(smddp.all_gather(v, "x", tiled=True), "x", tiled=True)
                + smddp.psum(v, "x"),
      mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  def rss_mb():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024
  for _ in range(30):
    f(x).block_until_ready()
  start = rss_mb()
  for _ in range(300):
    f(x).block_until_ready()
  print("GROWTH_MB", rss_mb() - start)
""")


@pytest.mark.timeout(180)
def test_rss_stays_flat_over_many_calls(tmp_path):
  path = tmp_path / "rss.py"
  path.write_text(SCRIPT)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["MALLOC_ARENA_MAX"] = "2"   # few heaps: pinned memory shows at once
  proc = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True,
                        timeout=170)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("GROWTH_MB")]
  assert lines, proc.stdout + proc.stderr
  growth = int(lines[-1].split()[1])
  # Each call allocates 16 MiB of outputs; a per-call leak of even a few
  # percent of that would exceed this bound after 300 calls.
  assert growth < 150, f"RSS grew by {growth} MB over 300 calls"

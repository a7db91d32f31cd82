"""Large collective outputs are advised onto transparent huge pages before
the engine writes them (JAX_SMDDP_HUGE_PAGE_BYTES): the output's mapping
carries the kernel's "hg" flag (MADV_HUGEPAGE) in /proc/self/smaps; smaller
outputs, and every output with the setting 0, do not. By default the threshold
is the heap policy's (JAX_SMDDP_HEAP_REUSE_BYTES: outputs glibc maps afresh),
or 4 MiB where that policy is off."""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
  import os, sys
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  import numpy as np
  import jax, jax.numpy as jnp
  from jax.sharding import PartitionSpec as P, NamedSharding
  import jax_smddp as smddp
  mesh = jax.make_mesh((2,), ("x",))
  HUGE = 2 << 20

  def vm_flags(address):
    # The VmFlags of the mapping that holds `address`.
    inside = False
    for line in open("/proc/self/smaps"):
      head = line.split()[0]
      if "-" in head and ":" not in head:
        lo, hi = (int(v, 16) for v in head.split("-"))
        inside = lo <= address < hi
      elif inside and line.startswith("VmFlags:"):
        return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")

  count = int(sys.argv[1]) // 4   # elements per rank
  x = jax.device_put(jnp.arange(2 * count, dtype=jnp.float32), NamedSharding(mesh, P("x")))
  f = jax.jit(jax.shard_map(lambda v: smddp.all_gather(v, "x", tiled=True), mesh=mesh,
                            in_specs=P("x"), out_specs=P("x")))
  y = f(x)
  y.block_until_ready()
  want = np.arange(2 * count, dtype=np.float32)
  for shard in y.addressable_shards:
    data = shard.data
    np.testing.assert_array_equal(np.asarray(data), want)
    start = data.unsafe_buffer_pointer()
    whole = (start + HUGE - 1) // HUGE * HUGE   # the first whole 2 MiB page inside
    if whole + HUGE <= start + data.nbytes:
      print("FLAGS", " ".join(vm_flags(whole)))
    else:
      print("FLAGS none: no whole 2 MiB page inside the output")
""")

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def run_script(tmp_path, per_rank: int, setting: str | None,
               heap_reuse: str | None = None) -> list[list[str]]:
  path = tmp_path / "huge.py"
  path.write_text(SCRIPT)
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_SMDDP_HUGE_PAGE_BYTES", "JAX_SMDDP_HEAP_REUSE_BYTES")}
  if setting is not None:
    env["JAX_SMDDP_HUGE_PAGE_BYTES"] = setting
  if heap_reuse is not None:
    env["JAX_SMDDP_HEAP_REUSE_BYTES"] = heap_reuse
  proc = subprocess.run([sys.executable, str(path), str(per_rank)], env=env, capture_output=True,
                        text=True, timeout=170)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  flags = [l.split()[1:] for l in proc.stdout.splitlines() if l.startswith("FLAGS ")]
  assert len(flags) == 2, proc.stdout + proc.stderr
  return flags


@pytest.mark.timeout(180)
@pytest.mark.skipif(not os.path.exists(THP), reason="this kernel has no transparent huge pages")
def test_large_outputs_are_advised_onto_huge_pages(tmp_path):
  # 2 x 32 MiB per rank: 64 MiB outputs, at the heap policy's default threshold (64M), which
  # glibc maps afresh.
  for flags in run_script(tmp_path, 32 << 20, None):
    assert "hg" in flags, f"the output's mapping lacks MADV_HUGEPAGE: VmFlags {flags}"
  # 8 MiB outputs, from the kept heap: left alone by default, advised under a 4M setting, and
  # by default where the heap policy is off (glibc maps them afresh then).
  for flags in run_script(tmp_path, 4 << 20, None):
    assert "hg" not in flags, f"an 8 MiB output from the kept heap was advised: {flags}"
  for flags in run_script(tmp_path, 4 << 20, "4M"):
    assert "hg" in flags, f"an 8 MiB output was not advised under a 4M threshold: {flags}"
  for flags in run_script(tmp_path, 4 << 20, None, heap_reuse="0"):
    assert "hg" in flags, f"an 8 MiB output was not advised with the heap policy off: {flags}"


@pytest.mark.timeout(180)
@pytest.mark.skipif(not os.path.exists(THP), reason="this kernel has no transparent huge pages")
def test_no_advice_below_the_threshold_or_when_turned_off(tmp_path):
  # Turned off: 8 MiB outputs keep the kernel's default, the heap policy off too.
  for flags in run_script(tmp_path, 4 << 20, "0", heap_reuse="0"):
    assert "hg" not in flags, f"JAX_SMDDP_HUGE_PAGE_BYTES=0 but the output was advised: {flags}"
  # Above the outputs' size: no advice either.
  for flags in run_script(tmp_path, 4 << 20, "64M"):
    assert "hg" not in flags, f"an 8 MiB output was advised under a 64M threshold: {flags}"

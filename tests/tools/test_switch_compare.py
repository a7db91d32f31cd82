"""python -m jax_smddp.tools.switch_compare: a script run with the switch unset, all and xla,
its step's time, collective calls and bytes per step side by side."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from jax_smddp.tools import switch_compare

SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((8,), ("x",))
    def body(a, b, i):
      return jax.lax.psum(a, "x"), jax.lax.psum(b, "x"), jax.lax.psum(i, "x")
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 3,
                                 out_specs=(P(),) * 3))
    s = NamedSharding(mesh, P("x"))
    init = jax.jit(lambda: [jnp.ones((8, k), t) for k, t in ((4, "float32"), (8, "float32"),
                                                             (2, "int32"))], out_shardings=s)
    args = init()
    for _ in range(int(sys.argv[1])):
      out = step(*args)
    jax.block_until_ready(out)
""")


@pytest.mark.timeout(240)
def test_three_runs_side_by_side(tmp_path):
  script = tmp_path / "train.py"
  script.write_text(SCRIPT)
  out = tmp_path / "figures.json"
  env = {k: v for k, v in os.environ.items() if k != "JAX_SMDDP_COLLECTIVES"}
  proc = subprocess.run([sys.executable, "-m", "jax_smddp.tools.switch_compare", "--json",
                         str(out), str(script), "7"], capture_output=True, text=True, env=env,
                        timeout=220, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads(out.read_text())
  assert list(got) == ["unset", "all", "xla"]
  # Independent reference: per device and step, three psums' outputs of 4 + 8 float32 and 2
  # int32 elements, run 7 times by the loop (init once).
  for mode, r in got.items():
    assert r["step"] == "jit(body)" and r["steps"] == 7, (mode, r)
    assert r["bytes"] == (4 + 8 + 2) * 4, (mode, r)
    assert r["step_s"] > 0, (mode, r)
  assert got["all"]["by_op"] == {"smddp_all_reduce": 2}  # combined: one per element type
  assert got["all"]["engine_calls"] == 2
  for mode in ("unset", "xla"):  # one process: XLA's own, in-process
    assert set(got[mode]["by_op"]) == {"all-reduce"} and got[mode]["engine_calls"] == 0, mode
  table = proc.stdout
  assert "step time (median)" in table and "smddp_all_reduce" in table, table
  assert table.splitlines()[1].split()[-3:] == ["unset", "JAX_SMDDP_COLLECTIVES=all",
                                                "JAX_SMDDP_COLLECTIVES=xla"], table


def test_the_step_is_the_most_run_program_and_its_time_the_median_gap():
  def program(name, starts, ops):
    return {"name": name, "calls": len(starts), "seconds": 1.0, "starts": starts, "ops": ops}
  run = {"status": 0, "devices": 2, "counted": {"smddp_all_gather": {"calls": 8, "bytes": 64}},
         "programs": [
             program("jit(init)", [0.0], {}),
             program("jit(step)", [1.0, 3.0, 4.0, 4.5, 5.5, 5.7],
                     {"smddp_all_gather": {"instructions": 1, "calls": 2, "bytes": 96,
                                           "loops_known": True}})]}
  s = switch_compare.summarize(run)
  assert s["step"] == "jit(step)" and s["steps"] == 6
  assert s["step_s"] == pytest.approx(0.5)  # gaps after the first two steps: 0.5, 1.0, 0.2
  assert (s["calls"], s["bytes"], s["engine_calls"]) == (2, 96, 8 / 12)
  assert "500.000 ms" in switch_compare.format_table({"unset": s})

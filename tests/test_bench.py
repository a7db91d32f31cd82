"""Smoke test of the benchmark CLI (python -m jax_smddp.bench) in a subprocess."""

import json
import os
import subprocess
import sys

import pytest

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


@pytest.mark.timeout(300)
def test_bench_quick(tmp_path):
  out = tmp_path / "b.json"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # --devices decides
  cmd = [sys.executable, "-m", "jax_smddp.bench", "--quick", "--devices", "4",
         "--max-bytes", "64K", "--ops", ",".join(OPS), "--json", str(out),
         "--plot", str(tmp_path / "b.png")]
  proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
  assert proc.returncode == 0, proc.stdout + proc.stderr

  data = json.loads(out.read_text())
  meta, results = data["meta"], data["results"]
  assert meta["layout"] == {"processes": 1, "devices": 4, "backend": "cpu"}
  assert meta["memcpy_gbs"] > 0
  assert {r["op"] for r in results} == set(OPS)
  for r in results:
    assert r["engine"], r  # the smddp program really calls the plugin
    for impl in ("smddp", "lax"):
      assert r[impl]["time_us"] > 0 and r[impl]["algbw_gbs"] > 0 and r[impl]["busbw_gbs"] > 0
    assert r["speedup"] == pytest.approx(r["lax"]["time_us"] / r["smddp"]["time_us"])
  for op in OPS:  # one table per op in the terminal output
    assert f"# {op}: 4 ranks" in proc.stdout

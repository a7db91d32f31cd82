"""Runs a script three times, with ``JAX_SMDDP_COLLECTIVES`` unset, ``all`` and ``xla``, and prints
for each its step time, collective calls per step and bytes per step, side by side.

    python -m jax_smddp.tools.switch_compare train.py --steps 20
    python -m jax_smddp.tools.switch_compare --modes unset,all --json out.json train.py

The script runs unmodified, as ``python script.py args...`` would run it, once per mode in a
fresh process (the switch is read when the process starts). Its *step* is the compiled program
it ran most often (ties: the one that ran longest); per step and device:

* ``step time``: the median interval between the starts of consecutive steps (the first two
  steps, which compile and warm up, are left out), so it is the loop's time per step, host work
  included;
* ``collective calls`` and ``bytes``: what the compiled step holds
  (:mod:`jax_smddp.tools.step_collectives`: each collective instruction's runs, loops counted by
  their trip counts, and its output bytes), by op as the compiled program names it
  (``smddp_all_reduce``, ..., XLA's ``all-reduce``, ...);
* ``jax_smddp engine calls``: what jax_smddp's engine counted over the whole run
  (:func:`jax_smddp.distributed.traffic_by_op`), divided by the steps and the process's devices.

To see every call, the child turns off JAX's C++ dispatch fast path (every execution of a
compiled program then goes through Python): that costs some microseconds per step, the same in
every mode. A multi-process job is out of its reach: run one process's script (each mode then
needs its own launcher).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODES = ("unset", "all", "xla")
ENV = "JAX_SMDDP_COLLECTIVES"


def _child(out_path: str, script: str, args: list[str]) -> None:
  """Runs `script` here, recording every compiled program's executions; writes `out_path`."""
  import runpy

  from jax_smddp._jax_internals import pjit, pxla

  runs: dict[int, dict] = {}
  executables = {}
  original = pxla.ExecuteReplicated.__call__

  def call(self, *a):
    r = runs.get(id(self))
    if r is None:
      executables[id(self)] = self
      r = runs[id(self)] = {"name": self.name, "starts": [], "seconds": 0.0}
    t0 = time.perf_counter()
    r["starts"].append(t0)
    try:
      return original(self, *a)
    finally:
      r["seconds"] += time.perf_counter() - t0

  pxla.ExecuteReplicated.__call__ = call
  pjit._get_fastpath_data = lambda *a, **k: None  # every execution through `call`
  from jax_smddp import distributed
  before = distributed.traffic_by_op()
  sys.argv = [script] + list(args)
  sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
  status = 0
  try:
    runpy.run_path(script, run_name="__main__")
  except SystemExit as e:
    status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  finally:
    import jax
    from jax_smddp.tools import step_collectives
    after = distributed.traffic_by_op()
    programs = []
    for key, r in runs.items():
      ops = {}
      try:
        text = executables[key].xla_executable.hlo_modules()[0].to_string()
        ops = step_collectives.in_hlo(text)
      except Exception as e:  # noqa: BLE001 (a program whose text cannot be read: no ops)
        ops = {"?": {"error": str(e)}}
      programs.append({"name": r["name"], "calls": len(r["starts"]), "seconds": r["seconds"],
                       "starts": r["starts"], "ops": ops})
    counted = {op: {k: after[op][k] - before.get(op, {}).get(k, 0) for k in ("calls", "bytes")}
               for op in after}
    with open(out_path, "w") as f:
      json.dump({"status": status, "programs": programs, "counted": counted,
                 "devices": jax.local_device_count()}, f)
  sys.exit(status)


def summarize(run: dict) -> dict:
  """One mode's figures from a child's record: the step, its time, calls and bytes per step."""
  programs = run["programs"]
  if not programs:
    return {"step": None}
  step = max(programs, key=lambda p: (p["calls"], p["seconds"]))
  starts = step["starts"][2:]
  gaps = [b - a for a, b in zip(starts, starts[1:])]
  ops = {op: o for op, o in step["ops"].items() if "calls" in o}
  per = max(step["calls"], 1) * max(run["devices"], 1)
  return {
      "step": step["name"], "steps": step["calls"],
      "step_s": statistics.median(gaps) if gaps else None,
      "calls": sum(o["calls"] for o in ops.values()),
      "bytes": sum(o["bytes"] for o in ops.values()),
      "by_op": {op: o["calls"] for op, o in ops.items()},
      "engine_calls": sum(o["calls"] for o in run["counted"].values()) / per,
      "status": run["status"],
  }


def _cell_time(s):
  if s is None:
    return "-"
  return f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


def format_table(results: dict[str, dict]) -> str:
  """The modes' summaries side by side, one row per figure."""
  from jax_smddp.tools.sizes import format_bytes
  modes = list(results)
  rows = [("", [f"JAX_SMDDP_COLLECTIVES={m}" if m != "unset" else "unset" for m in modes])]
  get = lambda f: [f(results[m]) if results[m].get("step") else "-" for m in modes]  # noqa: E731
  rows += [
      ("step (most-run program)", get(lambda r: r["step"])),
      ("steps run", get(lambda r: str(r["steps"]))),
      ("step time (median)", get(lambda r: _cell_time(r["step_s"]))),
      ("collective calls / step", get(lambda r: str(r["calls"]))),
      ("collective bytes / step", get(lambda r: format_bytes(r["bytes"]))),
      ("jax_smddp engine calls / step", get(lambda r: f"{r['engine_calls']:.2f}")),
  ]
  ops = sorted({op for m in modes for op in results[m].get("by_op", {})})
  rows += [(f"  {op}", [str(results[m].get("by_op", {}).get(op, 0)) if results[m].get("step")
                         else "-" for m in modes]) for op in ops]
  width = max(len(r[0]) for r in rows)
  cols = [max(len(r[1][i]) for r in rows) for i in range(len(modes))]
  lines = ["per device; calls and bytes from the compiled step, engine calls as counted"]
  for label, cells in rows:
    lines.append(f"{label:{width}s}  " + "  ".join(f"{c:>{w}s}" for c, w in zip(cells, cols)))
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
      prog="python -m jax_smddp.tools.switch_compare",
      description="Run a script with JAX_SMDDP_COLLECTIVES unset, all and xla; print each "
                  "one's step time, collective calls and bytes per step side by side.")
  p.add_argument("--modes", default=",".join(MODES),
                 help="comma list of unset, all, xla (or any value of the switch)")
  p.add_argument("--json", help="also write the figures here")
  p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
  p.add_argument("--child", help=argparse.SUPPRESS)
  p.add_argument("script")
  p.add_argument("args", nargs=argparse.REMAINDER)
  a = p.parse_args(argv)
  if a.child:
    _child(a.child, a.script, a.args)
    return 0
  if not os.path.exists(a.script):
    p.error(f"no script {a.script!r}: give the path of the Python script to run")
  results = {}
  with tempfile.TemporaryDirectory() as tmp:
    for mode in [m.strip() for m in a.modes.split(",") if m.strip()]:
      env = dict(os.environ)
      env.pop(ENV, None)
      if mode != "unset":
        env[ENV] = mode
      out = os.path.join(tmp, f"{mode}.json")
      cmd = [sys.executable, "-m", "jax_smddp.tools.switch_compare", "--child", out, a.script,
             *a.args]
      print(f"switch_compare: {ENV}={mode if mode != 'unset' else '(unset)'}: "
            f"{' '.join([os.path.basename(sys.executable), a.script, *a.args])}", file=sys.stderr)
      proc = subprocess.run(cmd, env=env, timeout=a.timeout)
      if not os.path.exists(out):
        results[mode] = {"step": None, "status": proc.returncode}
        print(f"switch_compare: the run with {mode} ended (status {proc.returncode}) before "
              f"its figures were written; its output above says why", file=sys.stderr)
        continue
      with open(out) as f:
        results[mode] = summarize(json.load(f))
      if proc.returncode:
        print(f"switch_compare: the script exited with status {proc.returncode} under {mode}",
              file=sys.stderr)
  print(format_table(results))
  if a.json:
    with open(a.json, "w") as f:
      json.dump(results, f, indent=1)
  return 0 if all(r.get("status", 0) == 0 for r in results.values()) else 1


if __name__ == "__main__":
  sys.exit(main())

"""Calibration of jax_smddp's cost model, and its command line.

    python -m jax_smddp.tools.calibrate --calibrate [--from bench.json ...]
    python -m jax_smddp.tools.calibrate --predict all_gather --bytes 16M --layout 2x4x1
    python -m jax_smddp.tools.calibrate --validate bench.json

Microbenchmarks of this machine (copy and reduction bandwidth), fitting of the
model's latencies to recorded benchmark runs (``python -m
jax_smddp.tools.bench --json``), and the CLI that writes the calibration the
tuner reads (:func:`jax_smddp.calibration.local_machine`). A tool: ``import
jax_smddp`` does not load it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from typing import Iterable, Sequence

from jax_smddp.cost_model import (CPU_REFERENCE, GB, PRESETS, Layout, Machine, Prediction, best,
                                  default_algorithm, predict)
from jax_smddp.calibration import (calibration_path, heap_fresh_output_bytes, local_machine,
                                   save_machine)


# --------------------------------------------------------------------------- benchmark data

def layout_of_bench(meta_layout: dict) -> Layout:
  """The Layout of a benchmark JSON's meta["layout"]."""
  return Layout(int(meta_layout.get("hosts", 1)), int(meta_layout.get("processes_per_host", 1)),
                int(meta_layout.get("devices_per_process", meta_layout.get("devices", 1))))


def load_records(paths: Iterable[str], statistic: str = "min_us") -> list[dict]:
  """(layout, op, bytes_per_rank, measured seconds) from benchmark JSON files;
  `statistic`: "min_us" (fastest call, when recorded) or "time_us" (median).
  Points where jax_smddp fell back to jax.lax are skipped."""
  out = []
  for path in paths:
    with open(path) as f:
      data = json.load(f)
    layout = layout_of_bench(data["meta"]["layout"])
    for r in data["results"]:
      if not r.get("engine", True):
        continue
      s = r["smddp"]
      t = s.get(statistic, s["time_us"])
      choice = r.get("choice") or {}
      out.append({"layout": layout, "op": r["op"], "bytes_per_rank": int(r["bytes_per_rank"]),
                  "time_s": t * 1e-6, "file": os.path.basename(path),
                  "other_load": float((r.get("other_load") or {}).get("cores", 0.0)),
                  "algorithm": choice.get("algorithm"), "chunk_bytes": choice.get("chunk_bytes")})
  return out


def predict_record(r: dict, machine: Machine, algorithm: str | None = None) -> Prediction:
  """The prediction for a benchmark record: of what ran (the tuner's choice
  recorded with it), unless `algorithm` is given."""
  return predict(r["op"], r["bytes_per_rank"], r["layout"], machine,
                 algorithm or r.get("algorithm"), None if algorithm else r.get("chunk_bytes"),
                 other_load=r.get("other_load", 0.0))


def errors(records: Sequence[dict], machine: Machine) -> list[float]:
  """Relative errors (predicted - measured) / measured."""
  return [predict_record(r, machine).time_s / r["time_s"] - 1 for r in records]


def error_stats(records: Sequence[dict], machine: Machine, tolerance: float = 0.25) -> dict:
  """Per layout and overall: median |error|, share of points within `tolerance`."""
  def stats(rs):
    es = sorted(abs(e) for e in errors(rs, machine))
    if not es:
      return {"points": 0}
    mid = len(es) // 2
    med = es[mid] if len(es) % 2 else (es[mid - 1] + es[mid]) / 2
    return {"points": len(es), "median_abs_error": med, "max_abs_error": es[-1],
            "within": sum(e <= tolerance for e in es) / len(es)}
  by = {}
  for r in records:
    by.setdefault(r["layout"].spec, []).append(r)
  return {"all": stats(records), **{k: stats(v) for k, v in sorted(by.items())}}


# --------------------------------------------------------------------------- calibration

FIT_PARAMS = ("call_overhead_s", "call_overhead_per_device_s", "intra_latency_s",
              "net_latency_s", "net_kernel_bw", "oversubscribed_round_s",
              "oversubscribed_efficiency", "cache_bytes", "fault_bw", "parallel_efficiency")


def with_params(machine: Machine, **p) -> Machine:
  """`machine` with fitted parameters set (names of FIT_PARAMS, or Machine fields)."""
  m = machine
  if "intra_latency_s" in p:
    m = replace(m, intra_host=replace(m.intra_host, latency_s=p.pop("intra_latency_s")))
  if "net_latency_s" in p:
    m = replace(m, network=replace(m.network, latency_s=p.pop("net_latency_s")))
  if "net_bandwidth" in p:
    m = replace(m, network=replace(m.network, bandwidth=p.pop("net_bandwidth")))
  if "net_kernel_bw" in p:
    m = replace(m, network=replace(m.network, kernel_bw=p.pop("net_kernel_bw")))
  return replace(m, **p) if p else m


def params_of(machine: Machine) -> dict:
  return {"call_overhead_s": machine.call_overhead_s,
          "call_overhead_per_device_s": machine.call_overhead_per_device_s,
          "intra_latency_s": machine.intra_host.latency_s,
          "net_latency_s": machine.network.latency_s,
          "net_bandwidth": machine.network.bandwidth,
          "net_kernel_bw": machine.network.kernel_bw,
          "oversubscribed_round_s": machine.oversubscribed_round_s,
          "oversubscribed_efficiency": machine.oversubscribed_efficiency,
          "cache_bytes": machine.cache_bytes,
          "fault_bw": machine.fault_bw,
          "parallel_efficiency": machine.parallel_efficiency}


def fit(records: Sequence[dict], machine: Machine, params: Sequence[str] = FIT_PARAMS,
        rounds: int = 6) -> Machine:
  """Fits `params` (positive; searched on a log scale, coordinate by coordinate)
  to minimise the mean squared log error of the predictions for `records`.
  Parameters the records cannot see (no network in them, say) stay unchanged."""
  layouts = {r["layout"] for r in records}
  visible = set(params)
  if not any(l.hosts > 1 for l in layouts):
    visible -= {"net_latency_s", "net_bandwidth", "net_kernel_bw"}
  if not any(l.hosts == 1 and l.processes > 1 or (l.processes_per_host > 1 and l.hosts > 1)
             for l in layouts):
    visible -= {"intra_latency_s"}
  if not any((l.processes if machine.hosts_share_cores else l.processes_per_host) > machine.cores
             for l in layouts):
    visible -= {"oversubscribed_round_s", "oversubscribed_efficiency"}
  if not any(l.processes == 1 and l.devices_per_process > 1 for l in layouts):
    visible -= {"parallel_efficiency"}
  current = params_of(machine)

  def loss(p):
    m = with_params(machine, **p)
    return sum(math.log(predict_record(r, m).time_s / r["time_s"]) ** 2
               for r in records) / max(1, len(records))

  best_loss = loss(current)
  bounds = {"parallel_efficiency": (0.2, 1.0), "oversubscribed_efficiency": (0.2, 1.0),
            "call_overhead_s": (1e-6, 1.0), "call_overhead_per_device_s": (1e-6, 1.0),
            "intra_latency_s": (1e-6, 1.0), "net_latency_s": (1e-6, 1.0)}
  for step in [4.0, 2.0, 1.41, 1.19, 1.09, 1.04][:rounds]:
    for name in [n for n in params if n in visible]:
      for _ in range(8):
        improved = False
        for f in (step, 1 / step):
          lo, hi = bounds.get(name, (0.0, math.inf))
          value = min(hi, max(lo, current[name] * f))
          if value == current[name] or not math.isfinite(value):
            continue
          trial = dict(current, **{name: value})
          l = loss(trial)
          if l < best_loss - 1e-12:
            current, best_loss, improved = trial, l, True
            break
        if not improved:
          break
  return replace(with_params(machine, **current), source="fitted")


def _fastest_time(fn, repeats=5):
  # The fastest repeat is what the memory can do; a slower one shared the cores with other
  # work (in the test suite, the second environment's build runs beside it).
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return min(times)


def microbenchmarks(quick: bool = False) -> dict:
  """Copy bandwidth in cache and in DRAM, fresh-page write bandwidth and 3-way
  reduction bandwidth of one thread (numpy), in bytes/s; ~1 s."""
  import numpy as np
  small, big = 1 << 20, (16 << 20) if quick else (128 << 20)
  out = {}
  a, b = np.ones(small, np.uint8), np.empty(small, np.uint8)
  reps = 64
  out["copy_bw"] = small * reps / _fastest_time(lambda: [np.copyto(b, a) for _ in range(reps)])
  A, B = np.ones(big, np.uint8), np.empty(big, np.uint8)
  np.copyto(B, A)
  out["copy_bw_dram"] = big / _fastest_time(lambda: np.copyto(B, A))
  A = B = None  # both big arrays freed before the next measurement
  x = [np.ones(small // 4, np.float32) for _ in range(3)]
  y = np.empty(small // 4, np.float32)

  def red():
    for _ in range(reps):
      np.add(x[0], x[1], out=y)
      np.add(y, x[2], out=y)
  out["reduce_bw"] = 3 * small * reps / _fastest_time(red)
  X = [np.ones(big // 16, np.float32) for _ in range(3)]
  Y = np.empty(big // 16, np.float32)

  def red_big():
    np.add(X[0], X[1], out=Y)
    np.add(Y, X[2], out=Y)
  out["reduce_bw_dram"] = 3 * (big // 4) / _fastest_time(red_big)
  out["cores"] = os.cpu_count() or 1
  return out


def calibrated_machine(micro: dict, base: Machine = CPU_REFERENCE) -> Machine:
  """The CPU preset with this machine's microbenchmark figures."""
  return replace(base, name="local", description=f"this machine ({micro.get('cores')} cores), "
                 "calibrated by microbenchmarks", cores=int(micro.get("cores", base.cores)),
                 copy_bw=micro["copy_bw"], copy_bw_dram=micro["copy_bw_dram"],
                 reduce_bw=micro["reduce_bw"],
                 reduce_bw_dram=micro["reduce_bw_dram"], source="calibrated",
                 fresh_output_bytes=heap_fresh_output_bytes())


# --------------------------------------------------------------------------- CLI

def _parse_layout(text: str) -> Layout:
  parts = [int(v) for v in text.lower().split("x")]
  if len(parts) == 1:
    return Layout(1, 1, parts[0])
  if len(parts) == 2:
    return Layout(1, parts[0], parts[1])
  return Layout(*parts)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m jax_smddp.tools.calibrate",
                              description="jax_smddp's cost model: calibrate, predict, validate.")
  p.add_argument("--calibrate", action="store_true",
                 help="run microbenchmarks (and fit --from data), write the calibration cache")
  p.add_argument("--from", dest="sources", nargs="*", default=[],
                 help="benchmark JSON files (python -m jax_smddp.tools.bench --json) to fit latencies to")
  p.add_argument("--out", default=None, help="calibration file (default: the cache path)")
  p.add_argument("--preset", default=None, help=f"one of {sorted(PRESETS)} (default: this machine)")
  p.add_argument("--predict", nargs=3, metavar=("OP", "BYTES", "LAYOUT"),
                 help="print the prediction of OP at BYTES per rank on LAYOUT (N, PxD, HxPxD)")
  p.add_argument("--validate", nargs="*", metavar="JSON",
                 help="compare the model with benchmark JSON files")
  args = p.parse_args(argv)
  machine = PRESETS[args.preset] if args.preset else local_machine()
  if args.calibrate:
    micro = microbenchmarks()
    machine = calibrated_machine(micro)
    print("microbenchmarks: " + ", ".join(f"{k} {v / GB:.2f} GB/s" if k != "cores" else f"{k} {v}"
                                            for k, v in micro.items()))
    if args.sources:
      records = load_records(args.sources)
      machine = fit(records, machine)
      print(f"fitted to {len(records)} points: " +
            ", ".join(f"{k}={v:.3g}" for k, v in params_of(machine).items()))
    path = args.out or calibration_path()
    save_machine(machine, path)
    print(f"wrote {path}")
  if args.predict:
    op, size, layout = args.predict
    from jax_smddp.tools.bench import parse_size
    nbytes, lay = parse_size(size), _parse_layout(layout)
    top, cands = best(op, nbytes, lay, machine)
    for a in sorted({c.algorithm for c in cands} | {default_algorithm(lay)}):
      pr = predict(op, nbytes, lay, machine, a)
      print(f"{op} {size}/rank on {lay.spec} ({machine.name}): {a:12s} {pr.time_us:10.1f} us  "
            f"bottleneck {pr.bottleneck}; " + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in pr.terms.items()))
    print(f"best: {top.algorithm}, chunk {top.chunk_bytes}, {top.time_us:.1f} us")
  if args.validate:
    records = load_records(args.validate)
    print(json.dumps(error_stats(records, machine), indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""GPU benchmark of jax_smddp's all_gather, nccl-tests style.

    python -m jax_smddp.gpu_bench [--processes N] [--sizes 1M,16M,256M] [--json FILE]

Layouts: ``--processes 1`` uses every local GPU in one process and times
JAX's default (XLA's NCCL) in the same run; ``--processes N`` (N > 1) starts N
processes that share GPU 0 (CUDA IPC between processes on one device), where
NCCL cannot run, so the reference is the device-to-device copy bandwidth
measured in the same run. Each size runs in both data-movement modes (copy
engines, and copy kernels within JAX_SMDDP_GPU_MAX_BLOCKS blocks).

Columns: time per call (median), algbw = output bytes / time, busbw = algbw x
(n - 1) / n, and "moved" = bytes all ranks together received from peers per
second (n x busbw), the figure to compare with one device's copy bandwidth
when every rank shares that device's memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from jax_smddp import launch


def parse_size(text: str) -> int:
  text = text.strip().upper()
  scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
  return int(float(text[:-1] if text[-1:] in "KMG" else text) * scale)


def _time(f, x, iters: int) -> float:
  y = f(x)
  y.block_until_ready()
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    f(x).block_until_ready()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def worker(args) -> dict:
  import numpy as np
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  import jax_smddp
  from jax_smddp import _native
  if args.nprocs > 1:
    jax.distributed.initialize(args.coordinator, args.nprocs, args.process, local_device_ids=[0])
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("x",))
  sharding = NamedSharding(mesh, P("x"))
  ext = _native.cuda_engine()
  rows = []
  for size in args.sizes:
    count = size // 4
    x = jax.device_put(jnp.zeros((n * count,), jnp.float32), sharding)
    ours = jax.jit(jax.shard_map(lambda v: jax_smddp.all_gather(v, "x", tiled=True)[None],
                                 mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    row = {"bytes_per_rank": size, "ranks": n, "mode": os.environ.get("JAX_SMDDP_GPU_COPIES", "engine"),
           "smddp_s": _time(ours, x, args.iters),
           "copy_Bps": ext.copy_bandwidth(0, size * n, 10) if ext else None}
    if args.nprocs == 1:
      lax = jax.jit(jax.shard_map(lambda v: jax.lax.all_gather(v, "x", tiled=True)[None],
                                  mesh=mesh, in_specs=P("x"), out_specs=P("x")))
      row["xla_s"] = _time(lax, x, args.iters)
    rows.append(row)
  return {"ok": True, "rows": rows, "counters": jax_smddp.gpu.counters()}


def report(rows: list[dict]) -> str:
  out = [f"{'size/rank':>10} {'ranks':>5} {'mode':>7} {'time us':>9} {'algbw GB/s':>10} "
         f"{'busbw':>8} {'moved':>8} {'copy GB/s':>9} {'moved/copy':>10} {'XLA busbw':>9}"]
  for r in rows:
    n, t = r["ranks"], r["smddp_s"]
    alg = r["bytes_per_rank"] * n / t / 1e9
    bus = alg * (n - 1) / n if n > 1 else alg
    moved = bus * n
    copy = (r["copy_Bps"] or 0) / 1e9
    xla = ""
    if "xla_s" in r:
      xla = f"{r['bytes_per_rank'] * n / r['xla_s'] / 1e9 * (n - 1) / max(n, 1):9.1f}"
    out.append(f"{r['bytes_per_rank'] >> 10:>9}K {n:>5} {r['mode']:>7} {t * 1e6:>9.1f} {alg:>10.1f} "
               f"{bus:>8.1f} {moved:>8.1f} {copy:>9.1f} {moved / copy if copy else 0:>10.2f} {xla:>9}")
  return "\n".join(out)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--processes", type=int, default=2)
  p.add_argument("--sizes", default="1M,4M,16M,64M,256M")
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--modes", default="engine,kernel")
  p.add_argument("--json", default=None)
  p.add_argument("--timeout", type=float, default=500)
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args, rest = p.parse_known_args(argv)
  args.sizes = [parse_size(s) for s in args.sizes.split(",")]
  if args.worker:
    args.process, args.nprocs, args.coordinator = int(rest[0]), int(rest[1]), rest[2]
    try:
      print("RESULT " + json.dumps(worker(args)), flush=True)
    except Exception as e:  # reported to the launcher
      import traceback
      print("RESULT " + json.dumps({"ok": False, "error": traceback.format_exc()[-3000:]}), flush=True)
      return 1
    return 0
  rows = []
  for mode in args.modes.split(","):
    env = {"JAX_PLATFORMS": "cuda", "JAX_SMDDP_GPU_COPIES": mode,
           "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    forwarded = ["--worker", "--sizes", ",".join(str(s) for s in args.sizes), "--iters", str(args.iters)]
    procs = launch.run_job(forwarded, args.processes, 1, script=["-m", "jax_smddp.gpu_bench"],
                           timeout=args.timeout, env=env)
    if not all(q.result and q.result.get("ok") for q in procs):
      print(launch.describe(procs), file=sys.stderr)
      return 1
    rows += procs[0].result["rows"]
    print(f"mode {mode}: counters {procs[0].result['counters']}")
  print(report(rows))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"processes": args.processes, "rows": rows}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Per call of a cross-process collective: its time, and what the calling process paid besides
the copy (issue 69: a 2x2 all_gather's p90 at 4-12x its median on this 2-core machine).

P processes x D devices on this host, jax_smddp's all_gather, reduce_scatter or all_reduce
(--op; or jax.lax's: --impl lax, gloo) of --bytes per rank under jit + shard_map, the output
dropped after each call as a training step drops it. Per call and process: wall ms, page
faults (minor), involuntary and voluntary context switches, CPU ms (getrusage), marked "<=="
above 1.5x the process's median. Run it with glibc's malloc settings in the environment to
see what the faults follow, e.g.

    python scripts/call_faults.py --processes 2 --devices 2 --bytes 4M --calls 40
    MALLOC_ARENA_MAX=1 python scripts/call_faults.py --processes 2 --devices 2 --bytes 4M
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time


def worker(argv: list[str]) -> None:
  impl, op, per_rank, calls, pid, nprocs, coordinator, ndev = argv
  per_rank, calls, pid, nprocs, ndev = int(per_rank), int(calls), int(pid), int(nprocs), int(ndev)
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ndev}"
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P
  if impl == "lax":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator, nprocs, pid)
  import jax_smddp as smddp
  mesh = Mesh(np.array(jax.devices()), ("x",))
  n = len(jax.devices())
  lib = smddp if impl == "smddp" else jax.lax
  body, out_spec = {"all_gather": (lambda x: lib.all_gather(x, "x", tiled=True), P(None)),
                    "reduce_scatter": (lambda x: lib.psum_scatter(x, "x", tiled=True), P("x")),
                    "all_reduce": (lambda x: lib.psum(x, "x"), P("x"))}[op]
  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=out_spec,
                               check_vma=False))
  elems = per_rank // 4
  x = jax.make_array_from_callback((n * elems,), NamedSharding(mesh, P("x")),
                                   lambda idx: np.arange(n * elems, dtype=np.float32)[idx])
  for _ in range(3):
    step(x).block_until_ready()
  rows = []
  for _ in range(calls):
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    out = step(x)
    out.block_until_ready()
    t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    del out
    rows.append({"ms": (t1 - t0) * 1e3, "faults": r1.ru_minflt - r0.ru_minflt,
                 "involuntary": r1.ru_nivcsw - r0.ru_nivcsw, "voluntary": r1.ru_nvcsw - r0.ru_nvcsw,
                 "cpu_ms": (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) * 1e3})
  print("ROWS " + json.dumps(rows), flush=True)
  jax.distributed.shutdown()


def main() -> int:
  if len(sys.argv) > 1 and sys.argv[1] == "--worker":
    worker(sys.argv[2:])
    return 0
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--processes", type=int, default=2)
  parser.add_argument("--devices", type=int, default=2)
  parser.add_argument("--bytes", default="4M", help="input bytes per rank (K, M suffixes)")
  parser.add_argument("--calls", type=int, default=40)
  parser.add_argument("--impl", choices=["smddp", "lax"], default="smddp")
  parser.add_argument("--op", choices=["all_gather", "reduce_scatter", "all_reduce"],
                      default="all_gather")
  args = parser.parse_args()
  unit = {"K": 1 << 10, "M": 1 << 20}.get(args.bytes[-1:].upper(), 1)
  per_rank = int(args.bytes.rstrip("KMkm")) * unit
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from jax_smddp.tools import launch
  procs = launch.run_job([args.impl, args.op, str(per_rank), str(args.calls)], args.processes, args.devices,
                         script=[os.path.abspath(__file__), "--worker"], timeout=600)
  ok = True
  for p in procs:
    line = next((ln for ln in (p.output or "").splitlines() if ln.startswith("ROWS ")), None)
    if p.returncode != 0 or line is None:
      print(f"process {p.index} failed:\n{(p.output or '')[-3000:]}")
      ok = False
      continue
    rows = json.loads(line[5:])
    ms = sorted(r["ms"] for r in rows)
    med, p90 = statistics.median(ms), ms[int(0.9 * (len(ms) - 1))]
    faulted = sum(r["faults"] >= 100 for r in rows)
    print(f"process {p.index}: median {med:.1f} ms, p90 {p90:.1f} ms ({p90 / med:.2f}x), "
          f"max {ms[-1]:.1f} ms; {faulted} of {len(rows)} calls took 100+ page faults")
    for r in rows:
      mark = " <==" if r["ms"] > 1.5 * med else ""
      print(f"  {r['ms']:7.1f} ms  faults {r['faults']:5d}  involuntary {r['involuntary']:4d}  "
            f"voluntary {r['voluntary']:4d}  cpu {r['cpu_ms']:6.1f} ms{mark}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())

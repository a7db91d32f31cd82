"""A/B of JAX_SMDDP_CPU_HELPERS inside one jax.distributed job on this host (docs/cpu_floor.md,
"Helper threads on a shared host").

P processes x D devices; each times collectives over its own D devices (the in-process
rendezvous, the only place the helpers run), in blocks that alternate A
(JAX_SMDDP_CPU_HELPERS=A) and B (unset: the default, which the engine reads at each call), every
process switching together (a tiny psum across the processes between blocks), so that the
machine's other load hits both alike. Prints each op's median, p90 and mean over every
process's calls.

    python scripts/cpu_helpers_ab.py --processes 2 --devices 2 --a 1 --bytes 16M
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def worker(argv: list[str]) -> None:
  a_value, nbytes, blocks, calls, pid, nprocs, coordinator, ndev = argv
  pid, nprocs, ndev, blocks, calls = int(pid), int(nprocs), int(ndev), int(blocks), int(calls)
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ndev}"
  os.environ.pop("JAX_SMDDP_CPU_HELPERS", None)
  import jax
  import numpy as np
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator, nprocs, pid)
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  import jax_smddp as smddp
  from jax_smddp import _native
  import _smddp_testing as probes  # scripts/build_testing.sh

  smddp.initialize()
  probes.use_world_of(_native.engine().world_source())  # what the engine's default sees
  mesh = Mesh(np.array(jax.devices()).reshape(nprocs, ndev), ("proc", "local"))
  spec = P(("proc", "local"))
  n, per_rank = nprocs * ndev, int(nbytes) // 4

  def array(elements):
    return jax.make_array_from_callback((elements,), NamedSharding(mesh, spec),
                                        lambda idx: np.ones(elements, np.float32)[idx])

  def smap(body):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                                 check_vma=False))

  x, tiny = array(n * per_rank), array(n)
  ops = {"all_gather": smap(lambda v: smddp.all_gather(v, "local", axis=0, tiled=True)),
         "reduce_scatter": smap(lambda v: smddp.psum_scatter(v, "local", tiled=True)),
         "all_reduce": smap(lambda v: smddp.psum(v, "local"))}
  barrier = smap(lambda v: smddp.psum(v, "proc"))
  helpers = {"local_processes": probes.local_processes()}
  times = {op: {"A": [], "B": []} for op in ops}
  for op, f in ops.items():
    for _ in range(3):
      f(x).block_until_ready()
    for b in range(2 * blocks):
      cond = "AB"[b % 2]
      if cond == "A":
        os.environ["JAX_SMDDP_CPU_HELPERS"] = a_value
      else:
        os.environ.pop("JAX_SMDDP_CPU_HELPERS", None)
      barrier(tiny).block_until_ready()
      helpers[cond] = probes.cpu_helpers()
      for _ in range(calls):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        times[op][cond].append((time.perf_counter() - t0) * 1e3)
  print("RESULT " + json.dumps({"ok": True, "helpers": helpers, "times_ms": times}), flush=True)
  smddp.shutdown()
  jax.distributed.shutdown()


def main() -> int:
  if sys.argv[1:2] == ["--worker"]:
    worker(sys.argv[2:])
    return 0
  import numpy as np

  from jax_smddp.tools import launch
  from jax_smddp.tools.sizes import parse_size
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--processes", type=int, default=2)
  p.add_argument("--devices", type=int, default=2)
  p.add_argument("--a", default="1", help="JAX_SMDDP_CPU_HELPERS in the A blocks")
  p.add_argument("--bytes", type=parse_size, default=16 << 20, help="one rank's input")
  p.add_argument("--blocks", type=int, default=8, help="blocks of each condition per op")
  p.add_argument("--calls", type=int, default=8, help="calls per block")
  p.add_argument("--json", help="write every call's time here")
  args = p.parse_args()
  procs = launch.run_job(["--worker", args.a, str(args.bytes), str(args.blocks), str(args.calls)],
                         args.processes, args.devices, script=os.path.abspath(__file__),
                         timeout=900)
  if not all(q.result and q.result.get("ok") for q in procs):
    print(launch.describe(procs), file=sys.stderr)
    return 1
  print("helpers:", [q.result["helpers"] for q in procs])
  for op in procs[0].result["times_ms"]:
    for cond in "AB":
      t = sum((q.result["times_ms"][op][cond] for q in procs), [])
      print(f"{op:15s} {cond}: median {statistics.median(t):7.2f} ms  p90 "
            f"{np.percentile(t, 90):7.2f} ms  mean {statistics.fmean(t):7.2f} ms  calls {len(t)}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump([q.result for q in procs], f)
  return 0


if __name__ == "__main__":
  sys.exit(main())

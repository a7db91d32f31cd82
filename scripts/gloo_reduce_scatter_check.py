"""Checks JAX's own cross-process reduce_scatter (jax.lax.psum_scatter on gloo)
against numpy, without jax_smddp. Found while benchmarking: under CPU load it
returns wrong values at the tail of a shard (jax 0.10.2, 2 processes x 1 CPU
device; e.g. 65 of 65536 elements at 512 KiB per rank, 224 at 2 MiB).

    python scripts/gloo_reduce_scatter_check.py            # 3 jobs of 2 processes
    (load the cores meanwhile, e.g. two `python3 -c "while True: pass"`)

Prints, per job, the (bytes per rank, iteration, wrong elements) seen on process 0.
"""

import json
import os
import sys


def worker(pid: int, nprocs: int, coordinator: str, ndev: int) -> None:
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ndev}"
  import numpy as np
  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator, nprocs, pid)
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()), ("x",))
  n = mesh.size
  bad = []
  for nbytes in [64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20]:
    count = nbytes // 4
    host = np.random.default_rng(nbytes).standard_normal(n * count, dtype=np.float32)
    x = jax.make_array_from_callback(host.shape, NamedSharding(mesh, P("x")), lambda i: host[i])
    g = jax.jit(jax.shard_map(lambda v: jax.lax.psum_scatter(v, "x", scatter_dimension=0, tiled=True),
                              mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    want = host.reshape(n, count).sum(0)
    for it in range(15):
      for s in g(x).addressable_shards:
        got, w = np.asarray(s.data), want[s.index]
        wrong = int(np.sum(~np.isclose(got, w, atol=1e-4)))
        if wrong:
          bad.append((nbytes, it, wrong))
  print("RESULT " + json.dumps({"ok": not bad, "wrong": bad[:20]}), flush=True)
  os._exit(0)


def main() -> None:
  from jax_smddp.tools import launch
  for job in range(3):
    procs = launch.run_job(["--worker"], 2, 1, script=os.path.abspath(__file__), timeout=300)
    print(f"job {job}:", [p.result for p in procs], flush=True)


if __name__ == "__main__":
  if len(sys.argv) > 1 and sys.argv[1] == "--worker":
    worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
  else:
    main()

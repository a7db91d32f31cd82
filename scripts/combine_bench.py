"""The lax swap's combining against hand batching (docs/use.md, "Swap jax.lax collectives").

One data-parallel step of a 12-parameter MLP (value_and_grad, a psum per gradient and one of the
loss, SGD) written two ways and timed in alternating blocks on the same devices:
  swapped: plain jax.lax.psum per gradient, lowered with jax_smddp.use("all") (combining on);
  batched: jax_smddp.batched.psum_batched of the gradients and jax_smddp.psum of the loss.
Both run every collective on jax_smddp's engine. Prints each one's median and p90 step time,
the engine calls in each compiled step, and whether the new parameters agree bit for bit.

    python scripts/combine_bench.py                              # 8 devices in one process
    python scripts/combine_bench.py --processes 2 --devices 4    # 2 processes x 4 devices
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

SHAPES = [(128, 256), (256,), (256, 256), (256,), (256, 256), (256,), (256, 128), (128,),
          (128, 64), (64,), (64, 10), (10,)]


def worker(argv: list[str]) -> None:
  blocks, steps, pid, nprocs, coordinator, ndev = argv
  blocks, steps, pid, nprocs, ndev = int(blocks), int(steps), int(pid), int(nprocs), int(ndev)
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ndev}"
  import jax
  import jax.numpy as jnp
  import numpy as np
  if nprocs > 1:
    jax.distributed.initialize(coordinator, nprocs, pid)
  from jax.sharding import NamedSharding, PartitionSpec as P

  import jax_smddp as smddp
  from jax_smddp import batched
  if nprocs > 1:
    smddp.initialize()
  mesh = jax.make_mesh((nprocs * ndev,), ("x",))
  rng = np.random.default_rng(0)
  host_params = [rng.standard_normal(s).astype(np.float32) * 0.05 for s in SHAPES]
  host_x = rng.standard_normal((mesh.size * 32, 128)).astype(np.float32)

  def put(a, spec):
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])

  params = [put(p, P()) for p in host_params]
  x = put(host_x, P("x"))

  def loss(ps, x):
    h = x
    for w, b in zip(ps[0::2], ps[1::2]):
      h = jnp.tanh(h @ w + b)
    return jnp.mean(h ** 2)

  def swapped(ps, x):
    value, grads = jax.value_and_grad(loss)(ps, x)
    grads = [jax.lax.psum(g, "x") for g in grads]
    return jax.lax.psum(value, "x"), [p - 0.01 * g for p, g in zip(ps, grads)]

  def by_hand(ps, x):
    value, grads = jax.value_and_grad(loss)(ps, x)
    grads = batched.psum_batched(grads, "x")
    return smddp.psum(value, "x"), [p - 0.01 * g for p, g in zip(ps, grads)]

  def jit(body):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=([P()] * len(SHAPES), P("x")),
                                 out_specs=(P(), [P()] * len(SHAPES)), check_vma=False))

  with smddp.use("all"):
    steps_of = {"swapped": jit(swapped).lower(params, x).compile(),
                "batched": jit(by_hand).lower(params, x).compile()}
  calls = {k: len(re.findall(r'custom_call_target="smddp_', f.as_text()))
           for k, f in steps_of.items()}
  outs = {k: jax.block_until_ready(f(params, x)) for k, f in steps_of.items()}
  same = all(np.array_equal(np.asarray(a.addressable_data(0)), np.asarray(b.addressable_data(0)))
             for a, b in zip(jax.tree_util.tree_leaves(outs["swapped"]),
                             jax.tree_util.tree_leaves(outs["batched"])))
  barrier = jax.jit(jax.shard_map(lambda v: smddp.psum(v, "x"), mesh=mesh, in_specs=P("x"),
                                  out_specs=P(), check_vma=False))
  tiny = put(np.ones(mesh.size, np.float32), P("x"))
  times = {k: [] for k in steps_of}
  for b in range(2 * blocks):
    name = ("swapped", "batched")[b % 2]
    f = steps_of[name]
    barrier(tiny).block_until_ready()  # every process starts the block together
    for _ in range(steps):
      t0 = time.perf_counter()
      jax.block_until_ready(f(params, x))
      times[name].append((time.perf_counter() - t0) * 1e6)
  print("RESULT " + json.dumps({"ok": True, "calls": calls, "same": bool(same),
                                "times_us": times}), flush=True)
  if nprocs > 1:
    smddp.shutdown()
    jax.distributed.shutdown()


def main() -> int:
  if sys.argv[1:2] == ["--worker"]:
    worker(sys.argv[2:])
    return 0
  import numpy as np
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--processes", type=int, default=1)
  p.add_argument("--devices", type=int, default=8, help="per process")
  p.add_argument("--blocks", type=int, default=6, help="blocks of each variant")
  p.add_argument("--steps", type=int, default=30, help="steps per block")
  args = p.parse_args()
  if args.processes == 1:
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
      worker([str(args.blocks), str(args.steps), "0", "1", "", str(args.devices)])
    results = [json.loads(buf.getvalue().split("RESULT ", 1)[1])]
  else:
    from jax_smddp.tools import launch
    procs = launch.run_job(["--worker", str(args.blocks), str(args.steps)], args.processes,
                           args.devices, script=os.path.abspath(__file__), timeout=900)
    if not all(q.result and q.result.get("ok") for q in procs):
      print(launch.describe(procs), file=sys.stderr)
      return 1
    results = [q.result for q in procs]
  print(f"{args.processes} process(es) x {args.devices} devices, {len(SHAPES)} parameters; "
        f"engine calls per step {results[0]['calls']}; new parameters equal bit for bit: "
        f"{all(r['same'] for r in results)}")
  med = {}
  for name in ("swapped", "batched"):
    t = sum((r["times_us"][name] for r in results), [])
    med[name] = statistics.median(t)
    print(f"  {name:8s} step: median {med[name]:8.1f} us  p90 {np.percentile(t, 90):8.1f} us  "
          f"({len(t)} steps over the processes)")
  print(f"  swapped / batched: {med['swapped'] / med['batched']:.3f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

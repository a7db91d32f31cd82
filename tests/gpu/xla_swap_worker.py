"""One process of tests/gpu/test_xla_swap_gpu.py: a global-view jit FSDP step (an MLP's
parameters sharded over a 1-D mesh of every device of the job, the batch sharded,
jax.value_and_grad, no shard_map: XLA's partitioner inserts the collectives) with
JAX_SMDDP_COLLECTIVES=xla, every process on GPU 0. XLA's own NCCL refuses two ranks on one
GPU, so the step runs only if jax_smddp's NCCL API front end serves every collective.

    python tests/gpu/xla_swap_worker.py SCENARIO PROCESS NPROCS COORDINATOR DEVICES

step       3 steps; losses and gradients against the same steps on this process's device
           alone (no collectives), and what the front end served and forwarded
step_rows  the same with the parameters sharded along their rows, for which XLA adds an
           all-to-all (ncclAlltoAll, or a group of sends and receives forming one)
peer_dies  after a good step the last process kills itself (SIGKILL); the others' next
           steps must raise within 30 s naming it
permute    one jit program of permutes over a 1-D mesh of every device: jax.lax.ppermute
           (XLA's collective-permute: send/recv groups the front end serves as jax_smddp's
           collective_permute) and jax_smddp.ppermute (its custom call), a ring and a partial
           permutation each, f32 and int32, against numpy

Prints ``RESULT {"ok": ..., ...}``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # several processes per GPU
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")  # float32, not TF32: comparable

D_IN, D_HIDDEN, D_OUT, BATCH = 64, 128, 16, 16


def problem():
  import numpy as np
  rng = np.random.default_rng(0)
  params = {"w1": rng.standard_normal((D_IN, D_HIDDEN)).astype(np.float32) / 4,
            "w2": rng.standard_normal((D_HIDDEN, D_OUT)).astype(np.float32) / 4}
  return params, rng.standard_normal((BATCH, D_IN)).astype(np.float32)


def step(params, x, lr=0.1):
  import jax
  import jax.numpy as jnp

  def loss(p, x):
    h = jnp.tanh(x @ p["w1"])
    return jnp.mean((h @ p["w2"]) ** 2)

  value, grads = jax.value_and_grad(loss)(params, x)
  return value, grads, jax.tree.map(lambda w, g: w - lr * g, params, grads)


def result(**kw) -> None:
  print("RESULT " + json.dumps(kw), flush=True)


def main() -> None:
  scenario = sys.argv[1]
  process, nprocs, coordinator = int(sys.argv[-4]), int(sys.argv[-3]), sys.argv[-2]
  import numpy as np
  import jax
  if nprocs > 1:
    jax.distributed.initialize(coordinator, nprocs, process)
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from jax_smddp import distributed, errors
  from jax_smddp.swap import nccl as nccl_swap

  mesh = Mesh(np.array(jax.devices()), ("fsdp",))
  # Parameters sharded along their columns, the batch along its rows: XLA gathers the
  # parameters and all-reduces (reduce-scatters) the gradients. Row-sharded parameters
  # (step_rows) make XLA add an all-to-all too.
  pspec = P("fsdp", None) if scenario == "step_rows" else P(None, "fsdp")
  xspec = P("fsdp", None)
  params, x = problem()

  def global_array(a, spec):
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda idx: a[idx])

  sharded = {k: global_array(v, pspec) for k, v in params.items()}
  xs = global_array(x, xspec)
  replicated, by_param = NamedSharding(mesh, P()), {k: NamedSharding(mesh, pspec) for k in params}
  f = jax.jit(step, out_shardings=(replicated, by_param, by_param))
  hlo = f.lower(sharded, xs).compile().as_text()
  kinds = sorted(set(re.findall(r"\b(all-gather|reduce-scatter|all-reduce|all-to-all|"
                                r"collective-permute|collective-broadcast)(?:-start)?\(", hlo)))
  if scenario == "peer_dies":
    peer_dies(process, nprocs, f, sharded, xs, errors)
    return
  if scenario == "permute":
    permute(mesh, nprocs, distributed, nccl_swap)
    return
  losses = []
  state = sharded
  for _ in range(3):
    value, grads, state = f(state, xs)
    losses.append(float(value))
  # The reference: the same steps on this process's own device, no collectives.
  one = jax.local_devices()[0]
  ref_state, ref_x = jax.device_put(params, one), jax.device_put(x, one)
  ref_losses = []
  for _ in range(3):
    value, ref_grads, ref_state = jax.jit(step)(ref_state, ref_x)
    ref_losses.append(float(value))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  checked = 0
  for name in ("grads", "params"):
    got, want = (grads, ref_grads) if name == "grads" else (state, ref_state)
    for k in got:
      for shard in got[k].addressable_shards:
        np.testing.assert_allclose(np.asarray(shard.data), np.asarray(want[k])[shard.index],
                                   rtol=1e-5, atol=1e-6, err_msg=f"{name} {k} after 3 steps")
        checked += 1
  front = nccl_swap.front_end() or {}
  out = dict(ok=True, losses=losses, ref_losses=ref_losses, checked=checked, kinds=kinds,
             active=front.get("active"), why_not=front.get("why_not"),
             served=front.get("served"), captured=front.get("captured"),
             forwarded=front.get("forwarded"),
             reasons=front.get("reasons"), real=front.get("real"), version=front.get("version"),
             by_op=distributed.traffic_by_op(), xla_collectives=distributed.xla_collectives(),
             xla_flags=os.environ.get("XLA_FLAGS", ""))
  result(**out)
  if nprocs > 1:  # leave together (a barrier of the key-value store, not a collective)
    from jax._src import distributed as jax_distributed
    jax_distributed.global_state.client.wait_at_barrier("xla_swap_worker_done", 60_000)


def permute(mesh, nprocs: int, distributed, nccl_swap) -> None:
  import numpy as np
  import jax
  import jax_smddp
  from jax.sharding import NamedSharding, PartitionSpec as P
  n = mesh.size
  ring = [(i, (i + 1) % n) for i in range(n)]
  partial = [(0, n - 1)]  # rank 0 only sends, rank n-1 only receives, the rest do nothing

  def body(a, b):
    return (jax.lax.ppermute(a, "fsdp", ring), jax.lax.ppermute(b, "fsdp", partial),
            jax_smddp.ppermute(a, "fsdp", ring), jax_smddp.ppermute(b, "fsdp", partial))

  spec = P("fsdp")
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec,) * 4))
  rng = np.random.default_rng(3)
  A = rng.standard_normal((n * 1000, 3)).astype(np.float32)
  B = rng.integers(-1000, 1000, size=(n * 70000,)).astype(np.int32)  # 280 KB per rank
  arrays = [jax.make_array_from_callback(v.shape, NamedSharding(mesh, spec), lambda i, v=v: v[i])
            for v in (A, B)]
  hlo = f.lower(*arrays).compile().as_text()
  kinds = sorted(set(re.findall(r"\b(collective-permute|all-gather|all-reduce)(?:-start)?\(", hlo)))

  def moved(x, perm):
    blocks = np.split(x, n)
    out = [np.zeros_like(blocks[0]) for _ in range(n)]
    for s, d in perm:
      out[d] = blocks[s]
    return np.concatenate(out)

  wants = [moved(A, ring), moved(B, partial), moved(A, ring), moved(B, partial)]
  checked = 0
  for _ in range(3):  # flags, counters and slots reused across calls
    for got, want in zip(f(*arrays), wants):
      for shard in got.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
        checked += 1
  front = nccl_swap.front_end() or {}
  result(ok=True, checked=checked, kinds=kinds, custom_call="smddp_collective_permute" in hlo,
         served=front.get("served"), forwarded=front.get("forwarded"), reasons=front.get("reasons"),
         by_op=distributed.traffic_by_op(), xla_flags=os.environ.get("XLA_FLAGS", ""))
  if nprocs > 1:
    from jax._src import distributed as jax_distributed
    jax_distributed.global_state.client.wait_at_barrier("xla_swap_worker_permute_done", 60_000)


def peer_dies(process: int, nprocs: int, f, sharded, xs, errors) -> None:
  import jax
  jax.block_until_ready(f(sharded, xs))  # connected and warm
  if process == nprocs - 1:
    result(ok=True, died=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no goodbye
  t0 = time.monotonic()
  calls = 0
  try:
    while time.monotonic() - t0 < 45:
      jax.block_until_ready(f(sharded, xs))
      calls += 1
    result(ok=False, error=f"{calls} steps in 45 s after process {nprocs - 1} died, no error")
  except Exception as e:  # what the user sees
    message = str(e)
    elapsed = time.monotonic() - t0
    typed = errors.classify(e)
    result(ok=elapsed < 30 and f"process {nprocs - 1}" in message, elapsed=elapsed, calls=calls,
           error=message[-3000:], exception=type(e).__name__,
           typed=None if typed is None else {"class": type(typed).__name__, "op": typed.op,
                                             "peer_processes": list(typed.peers.processes)})
  os._exit(0)  # jax.distributed's shutdown would wait for the dead process


if __name__ == "__main__":
  import faulthandler
  faulthandler.enable()
  if os.environ.get("JAX_SMDDP_WORKER_STACKS_AFTER_S"):
    faulthandler.dump_traceback_later(float(os.environ["JAX_SMDDP_WORKER_STACKS_AFTER_S"]), exit=False)
  try:
    main()
  except Exception:
    result(ok=False, error=traceback.format_exc()[-4000:])
    sys.stdout.flush()
    os._exit(1)
  sys.stdout.flush()
  os._exit(0)  # no teardown of the GPU communicators at exit: the peer may be gone already

"""worker.py's scenarios of the XLA-level swap (jax_smddp.swap): jax.lax's collectives and an
FSDP step on jax_smddp's engine, agreement and a dying peer under the swap."""

from __future__ import annotations

import os
import sys

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
import jax_smddp as smddp

from harness import (all_to_all_reference, check, failed, gather_reference, global_array,
    last_process_dies, pid, psum_reference, result, scatter_reference, smap, values)

def scenario_swap():
  """JAX_SMDDP_COLLECTIVES=1 (set by the launcher): unmodified jax.lax code runs on jax_smddp."""
  assert os.environ.get("JAX_SMDDP_COLLECTIVES"), "the test must set JAX_SMDDP_COLLECTIVES"
  mesh = Mesh(np.array(jax.devices()), ("x",))
  x = values((mesh.size * mesh.size * 2, 5), np.float32, 4)
  xs = global_array(mesh, P("x"), x)
  g = smap(mesh, lambda v: jax.lax.all_gather(v, "x", axis=0, tiled=True), P("x"), P("x"))
  assert "smddp_all_gather" in g.lower(xs).as_text(), "jax.lax.all_gather was not swapped"
  check("swapped all_gather", g(xs), gather_reference(x, mesh, "x", "x"))
  s = smap(mesh, lambda v: jax.lax.psum_scatter(v, "x", scatter_dimension=0, tiled=True), P("x"), P("x"))
  check("swapped psum_scatter", s(xs), scatter_reference(x, mesh, "x", "x"))
  p = smap(mesh, lambda v: jax.lax.psum(v, "x"), P("x"), P("x"))
  check("swapped psum", p(xs), psum_reference(x, mesh, "x", "x"))
  n = mesh.size  # a ring shift, and two independent psums combined into one engine call
  r = smap(mesh, lambda v: jax.lax.ppermute(v, "x", [(i, (i + 1) % n) for i in range(n)]),
           P("x"), P("x"))
  text = r.lower(xs).compile().as_text()
  assert "smddp_collective_permute" in text and "collective-permute" not in text, text
  check("swapped ppermute", r(xs), np.roll(x.reshape(n, -1, 5), 1, axis=0).reshape(x.shape))
  two = smap(mesh, lambda v: (jax.lax.psum(v, "x"), jax.lax.psum(2 * v, "x")), P("x"),
             (P("x"), P("x")))
  assert two.lower(xs).as_text().count("custom_call @smddp_all_reduce") == 1, "not combined"
  a, b = two(xs)
  check("combined psum", a, psum_reference(x, mesh, "x", "x"))
  check("combined psum of 2x", b, psum_reference(2 * x, mesh, "x", "x"))
  result(ok=True)


def _xla_traffic():
  """Bytes this process moved over jax_smddp's links (0 when it never connected)."""
  if not smddp.distributed.is_initialized():
    return 0
  return sum(v["sent"] + v["received"] for v in smddp.traffic().values())


def _fsdp_problem(seed=0):
  rng = np.random.default_rng(seed)
  n = jax.device_count()
  return {"w1": rng.standard_normal((8 * n, 24)).astype(np.float32) / 4,
          "w2": rng.standard_normal((24, 6)).astype(np.float32) / 4}, \
      rng.standard_normal((4 * n, 8 * n)).astype(np.float32)


def _fsdp_step(params, x, lr=0.1):
  def loss(p, x):
    h = jnp.tanh(x @ p["w1"])
    return jnp.mean((h @ p["w2"]) ** 2)
  value, grads = jax.value_and_grad(loss)(params, x)
  return value, jax.tree.map(lambda w, g: w - lr * g, params, grads)


def scenario_xla_fsdp():
  """A global-view jit FSDP step, as MaxText writes it: parameters and batch
  sharded over every device of the job, no shard_map; XLA's partitioner
  inserts the collectives. Against the same steps on one device."""
  from jax.experimental import multihost_utils
  mesh = Mesh(np.array(jax.devices()), ("fsdp",))
  params, x = _fsdp_problem()
  sharded = {k: global_array(mesh, P("fsdp", None), v) for k, v in params.items()}
  xs = global_array(mesh, P("fsdp", None), x)
  step = jax.jit(_fsdp_step)
  hlo = step.lower(sharded, xs).compile().as_text()
  before = _xla_traffic()
  losses = []
  for _ in range(5):
    value, sharded = step(sharded, xs)
    losses.append(float(value))
  moved = _xla_traffic() - before
  final = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for k, v in sharded.items()}
  # The reference: the same steps on this process's first device, no collectives.
  one = jax.local_devices()[0]
  ref_params = jax.device_put(params, one)
  ref_x = jax.device_put(x, one)
  ref_losses = []
  for _ in range(5):
    value, ref_params = jax.jit(_fsdp_step)(ref_params, ref_x)
    ref_losses.append(float(value))
  for k in final:
    np.testing.assert_allclose(final[k], np.asarray(ref_params[k]), rtol=1e-5, atol=1e-6,
                               err_msg=f"parameter {k} after 5 steps")
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  kinds = sorted({k for k in ("all-gather", "reduce-scatter", "all-reduce") if k + "(" in hlo or k + "-start" in hlo})
  topo = smddp.topology() or {}
  result(ok=True, losses=losses, checksum=float(sum(np.abs(v).sum() for v in final.values())),
         moved=moved, swapped=smddp.distributed.is_initialized(), collectives=kinds,
         network=bool(topo.get("network_peers")))


def scenario_xla_lax():
  """Every jax.lax collective in shard_map, lowered by XLA (not swapped), with
  JAX_SMDDP_COLLECTIVES=xla: XLA's all-gather, reduce-scatter, all-reduce,
  all-to-all (MPI_Sendrecv) and collective-permute (MPI_Isend/Irecv)."""
  mesh = Mesh(np.array(jax.devices()), ("x",))
  n = mesh.size
  before = _xla_traffic()
  for dtype in (np.float32, np.int32, np.float64):
    x = values((n * n * 2, 7), dtype, 3)
    xs = global_array(mesh, P("x"), x)
    check(f"all_gather {np.dtype(dtype).name}",
          smap(mesh, lambda v: jax.lax.all_gather(v, "x", axis=0, tiled=True), P("x"), P("x"))(xs),
          gather_reference(x, mesh, "x", "x"))
    check(f"psum_scatter {np.dtype(dtype).name}",
          smap(mesh, lambda v: jax.lax.psum_scatter(v, "x", scatter_dimension=0, tiled=True),
               P("x"), P("x"))(xs), scatter_reference(x, mesh, "x", "x"))
    check(f"psum {np.dtype(dtype).name}", smap(mesh, lambda v: jax.lax.psum(v, "x"), P("x"), P("x"))(xs),
          psum_reference(x, mesh, "x", "x"))
    check(f"pmin {np.dtype(dtype).name}", smap(mesh, lambda v: jax.lax.pmin(v, "x"), P("x"), P("x"))(xs),
          psum_reference(x, mesh, "x", "x", np.minimum))
    check(f"all_to_all {np.dtype(dtype).name}",
          smap(mesh, lambda v: jax.lax.all_to_all(v, "x", 0, 0, tiled=True), P("x"), P("x"))(xs),
          all_to_all_reference(x, mesh, "x", "x"))
    perm = [(i, (i + 1) % n) for i in range(n)]
    blocks = np.split(x, n)
    want = np.concatenate([blocks[(i - 1) % n] for i in range(n)])
    check(f"ppermute {np.dtype(dtype).name}",
          smap(mesh, lambda v: jax.lax.ppermute(v, "x", perm), P("x"), P("x"))(xs),
          want)
  # XLA's collectives ran on the MPI ABI library (no jax_smddp custom call did):
  # it set glibc's heap policy too, so a 40 MiB block is reused without faults.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from helpers import faults_to_refill
  faults_to_refill(40 << 20)
  result(ok=True, moved=_xla_traffic() - before, swapped=smddp.distributed.is_initialized(),
         refill_faults=max(faults_to_refill(40 << 20) for _ in range(3)))


def scenario_xla_mismatch():
  """Process 1 reduces a differently shaped array in the same program step."""
  mesh = Mesh(np.array(jax.devices()), ("x",))
  cols = 3 if pid == 0 else 5
  x = values((mesh.size * 2, cols), np.float32, 0)
  f = smap(mesh, lambda v: jax.lax.psum(v, "x"), P("x"), P("x"))
  try:
    jax.block_until_ready(f(global_array(mesh, P("x"), x)))
  except Exception as e:  # noqa: BLE001
    failed(e)
    return
  result(ok=True)


def scenario_xla_peer_dies():
  """The last process exits instead of entering XLA's all-reduce."""
  mesh = Mesh(np.array(jax.devices()), ("x",))
  x = values((mesh.size * 2, 1000), np.float32, 0)
  f = smap(mesh, lambda v: jax.lax.psum(v, "x"), P("x"), P("x"))
  xs = global_array(mesh, P("x"), x)
  jax.block_until_ready(f(xs))  # connected and warm
  last_process_dies(f, xs, failed)

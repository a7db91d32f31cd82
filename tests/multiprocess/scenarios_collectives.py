"""worker.py's scenarios of the collectives' answers and traffic: every collective against
numpy on 1-D, 2-D and interleaved meshes, gradients, many calls in flight, independent
groups, the bytes on the wire, phases, inline calls and permutes."""

from __future__ import annotations

import os
import time

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
import jax_smddp as smddp

from harness import (blocks_apply, check, gather_reference, global_array, ndev, nprocs, pid,
    psum_reference, result, run_collectives, scatter_reference, smap, values)

def scenario_collectives():
  devs = np.array(jax.devices())
  mesh = Mesh(devs, ("x",))
  # The engine runs these (not a fallback to jax.lax).
  x = global_array(mesh, P("x"), values((mesh.size, 4), np.float32, 0))
  hlo = smap(mesh, lambda v: smddp.all_gather(v, "x", axis=0, tiled=True), P("x"), P("x")).lower(x).as_text()
  assert "smddp_all_gather" in hlo, "all_gather did not lower to jax_smddp's custom call"
  run_collectives(mesh, "x", "1-D mesh")
  if nprocs > 1 and ndev > 1:
    # Hybrid: ("proc", "local"): groups over "proc" span processes with one
    # rank each; groups over "local" stay inside a process.
    mesh2 = Mesh(devs.reshape(nprocs, ndev), ("proc", "local"))
    run_collectives(mesh2, "proc", "2-D mesh, across processes", sizes=(5,))
    run_collectives(mesh2, "local", "2-D mesh, within processes", sizes=(5,))
    # Interleaved: a group's ranks alternate between processes.
    inter = Mesh(devs.reshape(nprocs, ndev).T.reshape(-1), ("x",))
    run_collectives(inter, "x", "interleaved 1-D mesh", sizes=(5,))
  result(ok=True, topology=smddp.topology(), traffic=smddp.traffic())


def scenario_grad():
  """FSDP-style: gather parameters, loss, gradient reduce-scattered; against jax.lax."""
  mesh = Mesh(np.array(jax.devices()), ("x",))
  n = mesh.size
  w = values((n * 4, 6), np.float32, 1) / 10
  xb = values((n * 2, 6), np.float32, 2) / 10

  def loss(gather):
    def body(w_shard, x_shard):
      full = gather(w_shard)
      y = jnp.tanh(x_shard @ full.T)
      return jax.lax.psum(jnp.sum(y * y), "x")
    return body

  def grad_fn(gather):
    f = jax.shard_map(loss(gather), mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P())
    return jax.jit(jax.grad(f))

  ws, xs = global_array(mesh, P("x"), w), global_array(mesh, P("x"), xb)
  g_smddp = grad_fn(lambda v: smddp.all_gather(v, "x", axis=0, tiled=True))(ws, xs)
  g_lax = grad_fn(lambda v: jax.lax.all_gather(v, "x", axis=0, tiled=True))(ws, xs)
  for a, b in zip(g_smddp.addressable_shards, g_lax.addressable_shards):
    np.testing.assert_allclose(np.asarray(a.data), np.asarray(b.data), rtol=1e-5, atol=1e-6)
  result(ok=True)


def scenario_stress():
  """Many large calls on fresh data, interleaved with jax.lax (gloo) calls as
  the benchmark does; every result against numpy."""
  mesh = Mesh(np.array(jax.devices()), ("x",))
  n = mesh.size
  iters = int(os.environ.get("STRESS_ITERS", "20"))
  ops = os.environ.get("STRESS_OPS", "reduce_scatter,all_gather,all_reduce").split(",")
  fns = {
      "reduce_scatter": (lambda v: smddp.psum_scatter(v, "x", scatter_dimension=0, tiled=True),
                         lambda v: jax.lax.psum_scatter(v, "x", scatter_dimension=0, tiled=True),
                         scatter_reference),
      "all_gather": (lambda v: smddp.all_gather(v, "x", axis=0, tiled=True),
                     lambda v: jax.lax.all_gather(v, "x", axis=0, tiled=True), gather_reference),
      "all_reduce": (lambda v: smddp.psum(v, "x"), lambda v: jax.lax.psum(v, "x"), psum_reference),
  }
  for per_rank in (512 << 10, 2 << 20):
    rows = per_rank // 4 // 256
    for op in ops:
      mine, lax, ref = fns[op]
      f = smap(mesh, mine, P("x"), P("x"))
      g = smap(mesh, lax, P("x"), P("x"))
      for it in range(iters):
        x = values((n * rows, 256), np.float32, 1000 + it)
        xs = global_array(mesh, P("x"), x)
        y = f(xs)
        z = g(xs)
        check(f"{op} {per_rank} bytes/rank iteration {it}", y, ref(x, mesh, "x", "x"))
        jax.block_until_ready(z)
  result(ok=True)


def scenario_independent():
  """One program of several independent collectives that stage what they receive (reductions,
  strided gathers), run again and again on fresh data of growing and shrinking sizes, every
  result against numpy: staging memory is reused across unequal calls."""
  mesh = Mesh(np.array(jax.devices()), ("x",))
  n, k = mesh.size, 3
  gather1 = lambda bl: [np.concatenate(bl, 1)] * len(bl)  # noqa: E731

  def body(*vs):
    scattered = [smddp.psum_scatter(v, "x", scatter_dimension=0, tiled=True) for v in vs[:k]]
    gathered = [smddp.all_gather(v, "x", axis=1, tiled=True) for v in vs[k:2 * k]]
    return (*scattered, *gathered, smddp.psum(vs[-1], "x"))

  for it, rows in enumerate((64, 4096, 16, 1024)):
    xs = [values((n * n * rows, 32 + j), np.float32, 100 * it + j) for j in range(k)]
    xs += [values((n * 2, 5 + j, rows), np.float32, 100 * it + 10 + j) for j in range(k)]
    xs.append(values((n * rows, 8), np.float32, 100 * it + 20))
    f = smap(mesh, body, (P("x"),) * len(xs), (P("x"),) * len(xs))
    for rep in range(3):
      ys = f(*[global_array(mesh, P("x"), x) for x in xs])
      for j in range(k):
        check(f"psum_scatter {j}, {rows} rows", ys[j], scatter_reference(xs[j], mesh, "x", "x"))
        check(f"all_gather axis=1 {j}, {rows} rows", ys[k + j],
              blocks_apply(xs[k + j], mesh, "x", "x", gather1))
      check(f"psum, {rows} rows", ys[-1], psum_reference(xs[-1], mesh, "x", "x"))
  result(ok=True)


def scenario_traffic():
  """Bytes over each link for one all_gather, reported for the test to check
  the routes (hierarchical between hosts: each byte crosses once per host)."""
  mesh = Mesh(np.array(jax.devices()), ("x",))
  per_rank = 1 << 20
  x = values((mesh.size * per_rank // 4 // 64, 64), np.float32, 5)
  xs = global_array(mesh, P("x"), x)
  f = smap(mesh, lambda v: smddp.all_gather(v, "x", axis=0, tiled=True), P("x"), P("x"))
  jax.block_until_ready(f(xs))  # initializes
  before = smddp.traffic()
  check("all_gather", f(xs), gather_reference(x, mesh, "x", "x"))
  after = smddp.traffic()
  delta = {str(p): {"link": v["link"], "sent": v["sent"] - before[p]["sent"]} for p, v in after.items()}
  result(ok=True, traffic=delta, per_rank=per_rank, header=0)


def scenario_capped_exchange():
  """all_gather of 4 MiB per rank between two hosts over a capped link, 8 timed calls (then
  each checked against numpy): the wall time and this process's CPU time of each, for the test to
  hold against the link's rate."""
  mesh = Mesh(np.array(jax.devices()), ("x",))
  per_rank = 4 << 20
  x = values((mesh.size * per_rank // 4 // 64, 64), np.float32, 7)
  xs = global_array(mesh, P("x"), x)
  f = smap(mesh, lambda v: smddp.all_gather(v, "x", axis=0, tiled=True), P("x"), P("x"))
  want = gather_reference(x, mesh, "x", "x")
  for _ in range(2):
    check("all_gather", f(xs), want)
  from jax._src import distributed
  client = distributed.global_state.client
  walls, cpus, ys = [], [], []
  for i in range(8):
    # Started together, as the benchmark's solo timing starts them: calls back to back
    # queue a call's first (small, per-call agreement) message behind the last one's bytes.
    client.wait_at_barrier(f"capped_exchange_{i}", 60_000)
    w, c = time.perf_counter(), time.process_time()
    ys.append(jax.block_until_ready(f(xs)))
    walls.append(time.perf_counter() - w)
    cpus.append(time.process_time() - c)
  for y in ys:
    check("all_gather", y, want)
  result(ok=True, walls=walls, cpus=cpus, per_rank=per_rank)


def scenario_phases():
  """Where the calls' time goes (distributed.call_phases()): 20 all_gathers, then one that the
  last process reaches 0.3 s late; the phases of each part, the loop's wall time."""
  from jax_smddp import distributed
  mesh = Mesh(np.array(jax.devices()), ("x",))
  x = values((mesh.size * 64, 16), np.float32, 7)
  xs = global_array(mesh, P("x"), x)
  f = smap(mesh, lambda v: smddp.all_gather(v, "x", axis=0, tiled=True), P("x"), P("x"))
  check("all_gather", f(xs), gather_reference(x, mesh, "x", "x"))  # compiles, initializes
  before = distributed.call_phases()
  t0 = time.monotonic()
  for _ in range(20):
    jax.block_until_ready(f(xs))
  loop_s = time.monotonic() - t0
  middle = distributed.call_phases()
  if pid == nprocs - 1:
    time.sleep(0.3)
  jax.block_until_ready(f(xs))
  after = distributed.call_phases()

  def delta(a, b):
    return {k: b["all_gather"][k] - a.get("all_gather", {}).get(k, 0) for k in b["all_gather"]}

  result(ok=True, loop=delta(before, middle), late=delta(middle, after), loop_s=loop_s,
         ops=sorted(after))


def scenario_inline():
  """Small calls run on XLA's thread once every peer process is in them, larger ones on an
  engine worker (distributed.call_phases()'s inline_calls), both right against numpy: 20
  small all_gathers, each followed in the same program by an XLA psum over every device (XLA
  continues the program after a call that ended on its own thread), then 5 all_gathers whose
  output in this process reaches JAX_SMDDP_INLINE_BYTES (the test sets the thresholds)."""
  from jax_smddp import distributed
  mesh = Mesh(np.array(jax.devices()), ("x",))
  small = values((mesh.size * 8, 16), np.float32, 11)
  big = values((mesh.size * 4096, 16), np.float32, 12)
  f = smap(mesh, lambda v: (smddp.all_gather(v, "x", axis=0, tiled=True), jax.lax.psum(v, "x")),
           P("x"), (P("x"), P("x")))
  g = smap(mesh, lambda v: smddp.all_gather(v, "x", axis=0, tiled=True), P("x"), P("x"))
  xs, xb = global_array(mesh, P("x"), small), global_array(mesh, P("x"), big)
  want_g, want_s = gather_reference(small, mesh, "x", "x"), psum_reference(small, mesh, "x", "x")
  jax.block_until_ready(g(xb))  # compiles both and initializes before counting
  jax.block_until_ready(f(xs))
  before = distributed.call_phases()["all_gather"]
  for _ in range(20):
    gathered, summed = f(xs)
    check("small all_gather", gathered, want_g)
    check("psum after it", summed, want_s)
  middle = distributed.call_phases()["all_gather"]
  for _ in range(5):
    check("large all_gather", g(xb), gather_reference(big, mesh, "x", "x"))
  after = distributed.call_phases()["all_gather"]
  delta = lambda a, b: {k: b[k] - a[k] for k in ("calls", "inline_calls")}  # noqa: E731
  result(ok=True, small=delta(before, middle), large=delta(middle, after),
         output_bytes=int(big.nbytes * jax.local_device_count()))


def scenario_permute():
  """ppermute on the engine across processes: a ring and a partial permutation (ranks that
  receive nothing get zeros) on a 1-D mesh and on one whose ranks alternate between
  processes, against numpy; its gradient against jax.lax's."""
  devs = np.array(jax.devices())
  n = devs.size
  meshes = [Mesh(devs, ("x",)), Mesh(devs.reshape(nprocs, ndev).T.reshape(-1), ("x",))]
  perms = {"ring": [(i, (i + 1) % n) for i in range(n)],
           "partial": [(0, n - 1), (n - 1, 1)] if n > 2 else [(1, 0)]}
  for mesh in meshes:
    for pname, perm in perms.items():
      for dtype in (np.float32, jnp.bfloat16, np.int32):
        x = values((n * 3, 5), dtype, 4)
        f = smap(mesh, lambda v, perm=perm: smddp.ppermute(v, "x", perm), P("x"), P("x"))
        xs = global_array(mesh, P("x"), x)
        assert "smddp_collective_permute" in f.lower(xs).as_text(), "ppermute fell back to lax"
        blocks = np.split(x, n)
        want = [np.zeros_like(blocks[0]) for _ in range(n)]
        for src, dst in perm:
          want[dst] = blocks[src]
        check(f"ppermute {pname} {np.dtype(dtype).name}", f(xs), np.concatenate(want))
  mesh = meshes[0]
  w = global_array(mesh, P("x"), values((n * 2, 3), np.float32, 5) / 10)

  def grad(permute):
    body = lambda v: jax.lax.psum(jnp.sum(jnp.tanh(permute(v * v, "x", perms["partial"])) *
                                          jnp.arange(3.0)), "x")
    return jax.jit(jax.grad(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P())))(w)

  for a, b in zip(grad(smddp.ppermute).addressable_shards, grad(jax.lax.ppermute).addressable_shards):
    np.testing.assert_allclose(np.asarray(a.data), np.asarray(b.data), rtol=1e-5, atol=1e-6)
  result(ok=True, traffic=smddp.traffic())


def scenario_pbroadcast():
  """pbroadcast on the engine across processes (one collective_permute whose every rank reads
  the source): first, last and a middle source, on a 1-D mesh and on one whose ranks alternate
  between processes, three dtypes, against numpy; its gradient against numpy."""
  devs = np.array(jax.devices())
  n = devs.size
  meshes = [Mesh(devs, ("x",)), Mesh(devs.reshape(nprocs, ndev).T.reshape(-1), ("x",))]
  for mesh in meshes:
    for source in sorted({0, n // 2, n - 1}):
      for dtype in (np.float32, jnp.bfloat16, np.int32):
        x = values((n * 3, 5), dtype, 6)
        f = smap(mesh, lambda v, s=source: smddp.pbroadcast(v, "x", s), P("x"), P("x"))
        xs = global_array(mesh, P("x"), x)
        assert "smddp_collective_permute" in f.lower(xs).as_text(), "pbroadcast fell back"
        check(f"pbroadcast from {source} {np.dtype(dtype).name}", f(xs),
              np.concatenate([np.split(x, n)[source]] * n))
  mesh, source = meshes[1], n - 1
  x = values((n * 2, 3), np.float32, 7) / 10
  w = np.arange(6.0, dtype=np.float32).reshape(2, 3)
  body = lambda v: jax.lax.psum(jnp.sum(jnp.sin(smddp.pbroadcast(v * v, "x", source)) * w *
                                        (1 + jax.lax.axis_index("x"))), "x")
  g = jax.jit(jax.grad(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P())))
  v = np.split(x, n)[source].astype(np.float64)
  want = np.zeros(x.shape)
  want[source * 2:(source + 1) * 2] = 2 * v * np.cos(v * v) * w * (n * (n + 1) // 2)
  for s in g(global_array(mesh, P("x"), x)).addressable_shards:
    np.testing.assert_allclose(np.asarray(s.data), want[s.index], rtol=1e-4, atol=1e-4)
  result(ok=True, traffic=smddp.traffic())


def scenario_ragged_all_to_all():
  """ragged_all_to_all on the engine across processes (its all_to_alls of padded slots and of
  output offsets): random sizes from 0 and offsets that overlap, two slices per rank, on a 1-D
  mesh and an interleaved one, against numpy running jax.lax's documented pseudocode."""
  devs = np.array(jax.devices())
  n, s, rows, out_rows = devs.size, 2, 6, 9
  k = n * s
  rng = np.random.default_rng(8)
  ops = [rng.integers(-32, 32, (rows, 3)).astype(np.float32) for _ in range(n)]
  outs = [rng.integers(-32, 32, (out_rows, 3)).astype(np.float32) for _ in range(n)]
  sss = [rng.integers(0, rows + 1, k) for _ in range(n)]
  ios = [np.array([rng.integers(0, rows - z + 1) for z in ss]) for ss in sss]
  oos = [np.array([rng.integers(0, out_rows - z + 1) for z in ss]) for ss in sss]
  rss = [np.array([sss[i // s][r * s + i % s] for i in range(k)]) for r in range(n)]
  want = [o.copy() for o in outs]
  for r in range(n):
    for i in range(k):
      q, j = divmod(i, s)
      src = r * s + j
      want[r][oos[q][src]:oos[q][src] + rss[r][i]] = ops[q][ios[q][src]:][:rss[r][i]]
  body = lambda *a: smddp.ragged_all_to_all(*a, axis_name="x")
  for mesh in (Mesh(devs, ("x",)), Mesh(devs.reshape(nprocs, ndev).T.reshape(-1), ("x",))):
    args = [global_array(mesh, P("x"), np.concatenate(v).astype(np.int32 if i > 1 else np.float32))
            for i, v in enumerate((ops, outs, ios, sss, oos, rss))]
    f = smap(mesh, body, P("x"), P("x"))
    assert "smddp_all_to_all" in f.lower(*args).as_text(), "ragged_all_to_all fell back"
    check("ragged_all_to_all", f(*args), np.concatenate(want))
  result(ok=True, traffic=smddp.traffic())

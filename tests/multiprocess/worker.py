"""One process of a multi-process test job (started by jax_smddp.tools.launch).

Usage: worker.py SCENARIO PROCESS_ID NUM_PROCESSES COORDINATOR DEVICES_PER_PROCESS

Prints one line `RESULT <json>` at the end: {"ok": true} or {"ok": false,
"error": "..."}. Scenarios check jax_smddp's collectives against numpy on
data that reveals misplaced blocks (every element distinct).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback

scenario, pid, nprocs, coordinator, ndev = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ndev}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def forbid_reading_this_process():
  """Ptrace rules as on a locked-down host: this process (root here) drops
  CAP_SYS_PTRACE and becomes non-dumpable, so no peer may read its memory
  (process_vm_readv fails with EPERM) and it may read no peer's. Before any
  thread starts (capabilities are per thread; new threads inherit them)."""
  import ctypes
  libc = ctypes.CDLL(None, use_errno=True)

  class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

  class Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]

  header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
  assert libc.capget(ctypes.byref(header), data) == 0, ctypes.get_errno()
  cap_sys_ptrace = 1 << 19
  data[0].effective &= ~cap_sys_ptrace
  data[0].permitted &= ~cap_sys_ptrace
  assert libc.capset(ctypes.byref(header), data) == 0, ctypes.get_errno()
  assert libc.prctl(4, 0, 0, 0, 0) == 0, ctypes.get_errno()  # PR_SET_DUMPABLE 0


if os.environ.get("SMDDP_TEST_FORBID_PTRACE") == "1":
  forbid_reading_this_process()

import numpy as np  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator, nprocs, pid)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_smddp as smddp  # noqa: E402
from jax_smddp import _native  # noqa: E402


def result(**kw):
  print("RESULT " + json.dumps(kw), flush=True)


def failed(e: Exception, **kw):
  """The RESULT of a scenario whose collective raised `e`: its text, and what
  jax_smddp.errors makes of it (the typed error and the engine's record)."""
  err = smddp.errors.classify(e)
  last = smddp.errors.last_failure()
  typed = None if err is None else {
      "class": type(err).__name__, "code": err.code, "op": err.op, "devices": list(err.devices),
      "peer_ranks": list(err.peers.ranks), "peer_devices": list(err.peers.devices),
      "peer_processes": list(err.peers.processes), "remedy": err.remedy,
      "from_record": err.failure is not None, "original": err.original is e,
      "original_type": type(e).__name__, "jax_status": err.jax_status}
  result(ok=False, error=str(e), typed=typed,
         last_failure=None if last is None else {"code": last.code, "op": last.op}, **kw)


def global_array(mesh, spec, x: np.ndarray):
  return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx: x[idx])


def check(name, y, want):
  for s in y.addressable_shards:
    got = np.asarray(s.data)
    exp = want[s.index]
    if got.shape != exp.shape or not np.array_equal(got, exp):
      bad = np.argwhere(got != exp) if got.shape == exp.shape else "shape"
      raise AssertionError(f"{name}: device {s.device.id} shard {s.index} differs from numpy "
                           f"(first bad index {bad[:3] if not isinstance(bad, str) else bad})")


def values(shape, dtype, seed):
  """Small integers, exact in every dtype and every summation order for up to 8 ranks: every
  partial sum stays within bfloat16's exact integers (|s| <= 256), so a ring that rounds its
  partials at each hop (Routes::ring) must still match numpy bit for bit."""
  rng = np.random.default_rng(seed)
  return rng.integers(-32, 32, size=shape).astype(dtype)


def smap(mesh, body, in_spec, out_spec, check_vma=False):
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=out_spec,
                               check_vma=check_vma))


def run_collectives(mesh, axis, label, sizes=(1, 3000)):
  """Every collective over `axis` of `mesh`, against numpy."""
  n = mesh.shape[axis]
  other = [a for a in mesh.axis_names if a != axis]
  lead = (axis, *other) if other else axis  # shard the first dimension over every mesh axis
  m = int(np.prod([mesh.shape[a] for a in other])) if other else 1
  for k, cols in enumerate(sizes):
    for dtype in (np.float32, np.int32, jnp.bfloat16):
      tag = f"{label} cols={cols} {np.dtype(dtype).name}"
      # all_gather, tiled along 0 and untiled.
      x = values((m * n * 2, cols), dtype, seed=k)
      xs = global_array(mesh, P(lead), x)
      y = smap(mesh, lambda v: smddp.all_gather(v, axis, axis=0, tiled=True), P(lead), P(lead))(xs)
      # device (a, b) holds rows of group a gathered over axis: a group = fixed other-coords.
      want = _gather_reference(x, mesh, axis, lead)
      check(f"all_gather {tag}", y, want)
      # psum_scatter.
      x = values((m * n * n * 2, cols), dtype, seed=10 + k)
      xs = global_array(mesh, P(lead), x)
      y = smap(mesh, lambda v: smddp.psum_scatter(v, axis, scatter_dimension=0, tiled=True),
               P(lead), P(lead))(xs)
      check(f"psum_scatter {tag}", y, _scatter_reference(x, mesh, axis, lead))
      # psum (sum of every block of the group, on every member).
      x = values((m * n * 3, cols), dtype, seed=20 + k)
      xs = global_array(mesh, P(lead), x)
      y = smap(mesh, lambda v: smddp.psum(v, axis), P(lead), P(lead))(xs)
      check(f"psum {tag}", y, _psum_reference(x, mesh, axis, lead))
    # all_to_all and pmax on f32 only.
    x = values((m * n * n, cols), np.float32, seed=30 + k)
    xs = global_array(mesh, P(lead), x)
    y = smap(mesh, lambda v: smddp.all_to_all(v, axis, 0, 0, tiled=True), P(lead), P(lead))(xs)
    check(f"all_to_all {label} cols={cols}", y, _all_to_all_reference(x, mesh, axis, lead))
    y = smap(mesh, lambda v: smddp.pmax(v, axis), P(lead), P(lead))(global_array(mesh, P(lead), x))
    check(f"pmax {label} cols={cols}", y, _psum_reference(x, mesh, axis, lead, np.maximum))
    # Gather along dimension 1 of a 3-D array: strided blocks ([outer, ranks, inner]).
    x = values((m * n * 2, 3, cols), np.float32, seed=40 + k)
    xs = global_array(mesh, P(lead), x)
    y = smap(mesh, lambda v: smddp.all_gather(v, axis, axis=1, tiled=True), P(lead), P(lead))(xs)
    want = _blocks_apply(x, mesh, axis, lead, lambda blocks: [np.concatenate(blocks, 1)] * len(blocks))
    check(f"all_gather axis=1 {label} cols={cols}", y, want)
    # all_to_all along dimension 1: strided blocks both ways ([outer, ranks, inner]).
    x = values((m * n * 2, n * 2, cols), np.float32, seed=50 + k)
    xs = global_array(mesh, P(lead), x)
    y = smap(mesh, lambda v: smddp.all_to_all(v, axis, 1, 1, tiled=True), P(lead), P(lead))(xs)
    check(f"all_to_all axis=1 {label} cols={cols}", y,
          _blocks_apply(x, mesh, axis, lead, lambda bl: _exchange(bl, 1)))


def _groups(mesh, axis, lead):
  """Row blocks of the global array, by device position, grouped by `axis`:
  returns a list of groups, each a list of block indices in axis order."""
  names = lead if isinstance(lead, tuple) else (lead,)
  shape = [mesh.shape[a] for a in names]
  total = int(np.prod(shape))
  coords = np.array(np.unravel_index(np.arange(total), shape)).T  # block b -> coords in `names` order
  ax = names.index(axis)
  groups = {}
  for b, c in enumerate(coords):
    key = tuple(v for i, v in enumerate(c) if i != ax)
    groups.setdefault(key, []).append((c[ax], b))
  return [[b for _, b in sorted(g)] for g in groups.values()], total


def _blocks_apply(x, mesh, axis, lead, fn):
  groups, total = _groups(mesh, axis, lead)
  blocks = np.split(x, total, 0)
  out = [None] * total
  for g in groups:
    res = fn([blocks[b] for b in g])
    for b, r in zip(g, res):
      out[b] = r
  return np.concatenate(out, 0)


def _gather_reference(x, mesh, axis, lead):
  return _blocks_apply(x, mesh, axis, lead, lambda bl: [np.concatenate(bl, 0)] * len(bl))


def _scatter_reference(x, mesh, axis, lead):
  def fn(bl):
    s = np.sum(np.stack([b.astype(np.float64) for b in bl]), 0).astype(bl[0].dtype)
    return np.split(s, len(bl), 0)
  return _blocks_apply(x, mesh, axis, lead, fn)


def _psum_reference(x, mesh, axis, lead, op=None):
  def fn(bl):
    if op is None:
      s = np.sum(np.stack([b.astype(np.float64) for b in bl]), 0).astype(bl[0].dtype)
    else:
      s = bl[0]
      for b in bl[1:]:
        s = op(s, b)
    return [s] * len(bl)
  return _blocks_apply(x, mesh, axis, lead, fn)


def _exchange(blocks, dim):
  """all_to_all of a group's blocks along `dim`: r gets sender s's part r, in sender order."""
  n = len(blocks)
  parts = [np.split(b, n, dim) for b in blocks]  # parts[s][r]: sender s's part for r
  return [np.concatenate([parts[s][r] for s in range(n)], dim) for r in range(n)]


def _all_to_all_reference(x, mesh, axis, lead):
  return _blocks_apply(x, mesh, axis, lead, lambda bl: _exchange(bl, 0))


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
                         _scatter_reference),
      "all_gather": (lambda v: smddp.all_gather(v, "x", axis=0, tiled=True),
                     lambda v: jax.lax.all_gather(v, "x", axis=0, tiled=True), _gather_reference),
      "all_reduce": (lambda v: smddp.psum(v, "x"), lambda v: jax.lax.psum(v, "x"), _psum_reference),
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
        check(f"psum_scatter {j}, {rows} rows", ys[j], _scatter_reference(xs[j], mesh, "x", "x"))
        check(f"all_gather axis=1 {j}, {rows} rows", ys[k + j],
              _blocks_apply(xs[k + j], mesh, "x", "x", gather1))
      check(f"psum, {rows} rows", ys[-1], _psum_reference(xs[-1], mesh, "x", "x"))
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
  check("all_gather", f(xs), _gather_reference(x, mesh, "x", "x"))
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
  want = _gather_reference(x, mesh, "x", "x")
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
  check("all_gather", f(xs), _gather_reference(x, mesh, "x", "x"))  # compiles, initializes
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
  output in this process reaches JAX_SMDDP_INLINE_BYTES."""
  from jax_smddp import distributed
  mesh = Mesh(np.array(jax.devices()), ("x",))
  small = values((mesh.size * 8, 16), np.float32, 11)
  big = values((mesh.size * 4096, 16), np.float32, 12)
  f = smap(mesh, lambda v: (smddp.all_gather(v, "x", axis=0, tiled=True), jax.lax.psum(v, "x")),
           P("x"), (P("x"), P("x")))
  g = smap(mesh, lambda v: smddp.all_gather(v, "x", axis=0, tiled=True), P("x"), P("x"))
  xs, xb = global_array(mesh, P("x"), small), global_array(mesh, P("x"), big)
  want_g, want_s = _gather_reference(small, mesh, "x", "x"), _psum_reference(small, mesh, "x", "x")
  jax.block_until_ready(g(xb))  # compiles both and initializes before counting
  jax.block_until_ready(f(xs))
  before = distributed.call_phases()["all_gather"]
  for _ in range(20):
    gathered, summed = f(xs)
    check("small all_gather", gathered, want_g)
    check("psum after it", summed, want_s)
  middle = distributed.call_phases()["all_gather"]
  for _ in range(5):
    check("large all_gather", g(xb), _gather_reference(big, mesh, "x", "x"))
  after = distributed.call_phases()["all_gather"]
  delta = lambda a, b: {k: b[k] - a[k] for k in ("calls", "inline_calls")}  # noqa: E731
  result(ok=True, small=delta(before, middle), large=delta(middle, after),
         output_bytes=int(big.nbytes * jax.local_device_count()))


def _psum_over_every_device():
  """A psum over every device of the job: the compiled program, its input, numpy's result."""
  mesh = Mesh(np.array(jax.devices()), ("x",))
  x = values((mesh.size * 2, 7), np.float32, 3)
  f = smap(mesh, lambda v: smddp.psum(v, "x"), P("x"), P("x"))
  return f, global_array(mesh, P("x"), x), _psum_reference(x, mesh, "x", "x")


def scenario_reinitialize():
  """initialize() is idempotent; after shutdown() and initialize() the same
  compiled programs run again over the new links."""
  f, xs, want = _psum_over_every_device()
  check("psum before", f(xs), want)
  smddp.initialize()
  smddp.initialize()
  cuda = _native.cuda_engine()  # its own engine copy reads this world (groups across hosts)
  assert cuda is None or cuda.world_processes() == jax.process_count(), cuda.world_processes()
  smddp.shutdown()
  assert smddp.topology() is None
  assert cuda is None or cuda.world_processes() == 0
  smddp.initialize()
  check("psum after re-initialize", f(xs), want)
  result(ok=True)


def scenario_swap():
  """JAX_SMDDP_COLLECTIVES=1 (set by the launcher): unmodified jax.lax code runs on jax_smddp."""
  assert os.environ.get("JAX_SMDDP_COLLECTIVES"), "the test must set JAX_SMDDP_COLLECTIVES"
  mesh = Mesh(np.array(jax.devices()), ("x",))
  x = values((mesh.size * mesh.size * 2, 5), np.float32, 4)
  xs = global_array(mesh, P("x"), x)
  g = smap(mesh, lambda v: jax.lax.all_gather(v, "x", axis=0, tiled=True), P("x"), P("x"))
  assert "smddp_all_gather" in g.lower(xs).as_text(), "jax.lax.all_gather was not swapped"
  check("swapped all_gather", g(xs), _gather_reference(x, mesh, "x", "x"))
  s = smap(mesh, lambda v: jax.lax.psum_scatter(v, "x", scatter_dimension=0, tiled=True), P("x"), P("x"))
  check("swapped psum_scatter", s(xs), _scatter_reference(x, mesh, "x", "x"))
  p = smap(mesh, lambda v: jax.lax.psum(v, "x"), P("x"), P("x"))
  check("swapped psum", p(xs), _psum_reference(x, mesh, "x", "x"))
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
  check("combined psum", a, _psum_reference(x, mesh, "x", "x"))
  check("combined psum of 2x", b, _psum_reference(2 * x, mesh, "x", "x"))
  result(ok=True)


def scenario_mismatch():
  """Process 1 runs the collective on a differently shaped input."""
  mesh = Mesh(np.array(jax.devices()), ("x",))
  cols = 3 if pid == 0 else 5
  x = values((mesh.size * 2, cols), np.float32, 0)
  f = smap(mesh, lambda v: smddp.all_gather(v, "x", axis=0, tiled=True), P("x"), P("x"))
  try:
    jax.block_until_ready(f(global_array(mesh, P("x"), x)))
  except Exception as e:  # noqa: BLE001
    failed(e)
    return
  result(ok=True)


def scenario_mismatch_op():
  """Process 0 runs all_gather where process 1 runs all_to_all on the same input: process 1
  waits for a message process 0 never sends (their messages' names differ), process 0 gets
  one of the wrong size. Both must say the calls disagree, at once, not time out."""
  mesh = Mesh(np.array(jax.devices()), ("x",))
  x = values((mesh.size * 4, 3), np.float32, 0)
  if pid == 0:
    body = lambda v: smddp.all_gather(v, "x", axis=0, tiled=True)  # noqa: E731
  else:
    body = lambda v: smddp.all_to_all(v, "x", 0, 0, tiled=True)  # noqa: E731
  f = smap(mesh, body, P("x"), P("x"))
  t0 = time.monotonic()
  try:
    jax.block_until_ready(f(global_array(mesh, P("x"), x)))
  except Exception as e:  # noqa: BLE001
    seconds = time.monotonic() - t0
    # Alive until both failed: process 1 may not learn it from process 0's exit.
    from jax._src import distributed
    distributed.global_state.client.wait_at_barrier("mismatch_op_failed", 120_000)
    failed(e, seconds=seconds)
    return
  result(ok=True)


def scenario_mismatch_dtype():
  """Process 1 runs the collective on int32 where process 0 has float32 (same bytes)."""
  mesh = Mesh(np.array(jax.devices()), ("x",))
  x = values((mesh.size * 2, 3), np.float32 if pid == 0 else np.int32, 0)
  f = smap(mesh, lambda v: smddp.psum(v, "x"), P("x"), P("x"))
  try:
    jax.block_until_ready(f(global_array(mesh, P("x"), x)))
  except Exception as e:  # noqa: BLE001
    failed(e)
    return
  result(ok=True)


def scenario_build_mismatch():
  """Processes whose builds differ (the test makes some pose as another wire
  protocol version): initialize() must raise in every process concerned,
  naming both sides, before any link exists."""
  t0 = time.monotonic()
  try:
    smddp.initialize()
  except smddp.errors.BuildMismatchError as e:
    result(ok=False, cls=type(e).__name__, message=str(e), process=e.process,
           peer_processes=list(e.peers.processes), remedy=e.remedy,
           differences={str(q): {f: list(v) for f, v in d.items()} for q, d in e.differences.items()},
           initialized=smddp.distributed.is_initialized(), topology=smddp.distributed.topology(),
           seconds=time.monotonic() - t0)
    return  # every process raised: jax.distributed shuts down cleanly
  result(ok=True, build=smddp.distributed.build_id())


def scenario_provider_mismatch():
  """Processes whose libfabric offers them different default providers (the
  test hides one from some with libfabric's own FI_PROVIDER): initialize()
  must raise in every process concerned, naming both providers, before any
  link exists, instead of hanging on endpoints that cannot reach each other."""
  t0 = time.monotonic()
  try:
    smddp.initialize()
  except RuntimeError as e:
    result(ok=False, message=str(e), initialized=smddp.distributed.is_initialized(),
           seconds=time.monotonic() - t0)
    return  # every process raised: jax.distributed shuts down cleanly
  result(ok=True, topology=smddp.distributed.topology())


def scenario_malformed_chunks():
  """One all_gather between hosts, where a process sends malformed chunks
  (JAX_SMDDP_FABRIC_TEST_CORRUPT): its receivers must fail the call with a
  protocol error naming it, at once (not at the deadline)."""
  mesh = Mesh(np.array(jax.devices()), ("x",))
  x = values((mesh.size * 2, 100), np.float32, 0)
  f = smap(mesh, lambda v: smddp.all_gather(v, "x", axis=0, tiled=True), P("x"), P("x"))
  xs = global_array(mesh, P("x"), x)
  smddp.initialize()
  t0 = time.monotonic()
  try:
    jax.block_until_ready(f(xs))
  except Exception as e:  # noqa: BLE001
    failed(e, seconds=time.monotonic() - t0)
    os._exit(0)  # jax.distributed's shutdown would wait for the peer
  result(ok=True, seconds=time.monotonic() - t0)
  os._exit(0)


def scenario_peer_dies():
  """The last process dies (SIGKILL-like) instead of entering the collective;
  the others must raise naming it, well within the timeout."""
  mesh = Mesh(np.array(jax.devices()), ("x",))
  x = values((mesh.size * 2, 1000), np.float32, 0)
  f = smap(mesh, lambda v: smddp.psum(v, "x"), P("x"), P("x"))
  xs = global_array(mesh, P("x"), x)
  jax.block_until_ready(f(xs))  # connected and warm
  smddp.initialize()
  _last_process_dies(f, xs, failed)


def _last_process_dies(f, xs, report):
  """The last process exits; the others run f(xs) and `report` how it failed."""
  if pid == nprocs - 1:
    result(ok=True, dying=True)
    os._exit(17)
  time.sleep(0.5)
  t0 = time.monotonic()
  try:
    jax.block_until_ready(f(xs))
  except Exception as e:  # noqa: BLE001
    report(e, seconds=time.monotonic() - t0)
    os._exit(0)  # jax.distributed's shutdown would wait for the dead peer
  result(ok=True, seconds=time.monotonic() - t0)
  os._exit(0)


def scenario_peer_killed_midway():
  """The last process is SIGKILLed while large collectives are in flight."""
  import signal
  import threading
  mesh = Mesh(np.array(jax.devices()), ("x",))
  x = values((mesh.size * 64, 16384), np.float32, 0)  # 4 MiB per device
  f = smap(mesh, lambda v: smddp.psum(v, "x"), P("x"), P("x"))
  xs = global_array(mesh, P("x"), x)
  jax.block_until_ready(f(xs))
  if pid == nprocs - 1:
    threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
  t0 = time.monotonic()
  try:
    for _ in range(100000):
      xs = f(xs) * 0.0 + xs
      jax.block_until_ready(xs)
      if time.monotonic() - t0 > 60:
        break
  except Exception as e:  # noqa: BLE001
    failed(e, seconds=time.monotonic() - t0)
    if nprocs > 2:
      time.sleep(2)  # process 0's exit ends the others (jax.distributed): let them report
    os._exit(0)
  result(ok=True, seconds=time.monotonic() - t0)
  os._exit(0)


def scenario_farewell():
  """Shutting down between hosts: a process's shutdown() waits until its peers there shut down
  too (their collectives may still be reading what it sent), and a peer left alone in a
  collective by a process that shut down names it."""
  f, xs, want = _psum_over_every_device()
  check("psum", f(xs), want)
  last = pid == nprocs - 1
  if last:
    time.sleep(3.0)  # late to shut down
  t0 = time.monotonic()
  smddp.shutdown()
  waited = time.monotonic() - t0
  smddp.initialize()
  check("psum after re-initialize", f(xs), want)
  if last:  # shuts down (waiting 1 s for the others) while they run a psum without it
    smddp.set_timeout(1.0)
    t0 = time.monotonic()
    smddp.shutdown()
    result(ok=True, waited=waited, alone=time.monotonic() - t0)
    os._exit(0)
  t0 = time.monotonic()
  try:
    jax.block_until_ready(f(xs))
  except Exception as e:  # noqa: BLE001
    failed(e, waited=waited, seconds=time.monotonic() - t0)
    os._exit(0)
  result(ok=True, waited=waited, seconds=time.monotonic() - t0)
  os._exit(0)


def scenario_peer_stalls():
  """The last process stalls; the others must time out naming it."""
  mesh = Mesh(np.array(jax.devices()), ("x",))
  x = values((mesh.size * 2, 100), np.float32, 0)
  f = smap(mesh, lambda v: smddp.all_gather(v, "x", axis=0, tiled=True), P("x"), P("x"))
  xs = global_array(mesh, P("x"), x)
  jax.block_until_ready(f(xs))
  smddp.set_timeout(3.0)
  if pid == nprocs - 1:
    result(ok=True, stalling=True)
    time.sleep(30)
    os._exit(0)
  t0 = time.monotonic()
  try:
    jax.block_until_ready(f(xs))
  except Exception as e:  # noqa: BLE001
    failed(e, seconds=time.monotonic() - t0)
    os._exit(0)
  result(ok=True, seconds=time.monotonic() - t0)
  os._exit(0)


def scenario_tuner_inputs():
  """Processes started with different calibration files and tuner settings
  (set per process by the test) still agree on every call, and on every
  choice of the tuner."""
  from jax_smddp import tuning
  mesh = Mesh(np.array(jax.devices()), ("x",))
  for k, cols in enumerate((100, 50_000)):
    x = values((mesh.size * 2, cols), np.float32, k)
    y = smap(mesh, lambda v: smddp.all_gather(v, "x", axis=0, tiled=True), P("x"), P("x"))(
        global_array(mesh, P("x"), x))
    check(f"all_gather cols={cols}", y, _gather_reference(x, mesh, "x", "x"))
    y = smap(mesh, lambda v: smddp.psum(v, "x"), P("x"), P("x"))(global_array(mesh, P("x"), x))
    check(f"psum cols={cols}", y, _psum_reference(x, mesh, "x", "x"))
  layout = tuning.Layout(2, 2, 1)
  choices = [dataclasses.asdict(tuning.choose(op, 1 << n, layout))
             for op in ("all_gather", "reduce_scatter", "all_reduce") for n in (12, 20, 24)]
  result(ok=True, choices=choices)


def scenario_agreed_settings():
  """Process 1 starts with other values of settings that must agree: after
  initialize() every process runs with process 0's, and collectives agree."""
  smddp.initialize()
  mesh = Mesh(np.array(jax.devices()), ("x",))
  x = values((mesh.size * 2, 5000), np.float32, 3)
  y = smap(mesh, lambda v: smddp.psum(v, "x"), P("x"), P("x"))(global_array(mesh, P("x"), x))
  check("psum", y, _psum_reference(x, mesh, "x", "x"))
  names = ("JAX_SMDDP_FABRIC_CHUNK_BYTES", "JAX_SMDDP_HIERARCHICAL", "JAX_SMDDP_GPU_SLOT_BYTES")
  result(ok=True, values={k: smddp.settings()[k]["value"] for k in names})


def scenario_require():
  """JAX_SMDDP_REQUIRE (set by the launcher) names what this machine lacks:
  the first collective must raise RequirementError, never run on a fallback."""
  from jax_smddp import requirements
  mesh = Mesh(np.array(jax.devices()), ("x",))
  x = values((mesh.size * 2, 3), np.float32, 0)
  f = smap(mesh, lambda v: smddp.all_gather(v, "x", axis=0, tiled=True), P("x"), P("x"))
  try:
    jax.block_until_ready(f(global_array(mesh, P("x"), x)))
  except requirements.RequirementError as e:
    result(ok=True, error=str(e))
    return
  result(ok=False, error="the collective ran although JAX_SMDDP_REQUIRE is not met")


def scenario_doctor():
  """jax_smddp.doctor.report(job=True) in every process: the topology rows."""
  from jax_smddp import doctor
  r = doctor.report(job=True)
  result(ok=r.usable, rows=[[row.component, row.status, row.detail] for row in r.rows])


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
          _gather_reference(x, mesh, "x", "x"))
    check(f"psum_scatter {np.dtype(dtype).name}",
          smap(mesh, lambda v: jax.lax.psum_scatter(v, "x", scatter_dimension=0, tiled=True),
               P("x"), P("x"))(xs), _scatter_reference(x, mesh, "x", "x"))
    check(f"psum {np.dtype(dtype).name}", smap(mesh, lambda v: jax.lax.psum(v, "x"), P("x"), P("x"))(xs),
          _psum_reference(x, mesh, "x", "x"))
    check(f"pmin {np.dtype(dtype).name}", smap(mesh, lambda v: jax.lax.pmin(v, "x"), P("x"), P("x"))(xs),
          _psum_reference(x, mesh, "x", "x", np.minimum))
    check(f"all_to_all {np.dtype(dtype).name}",
          smap(mesh, lambda v: jax.lax.all_to_all(v, "x", 0, 0, tiled=True), P("x"), P("x"))(xs),
          _all_to_all_reference(x, mesh, "x", "x"))
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
  _last_process_dies(f, xs, failed)


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


def scenario_cpu_helpers():
  """What the engine's helpers' default (JAX_SMDDP_CPU_HELPERS unset) sees once jax_smddp has
  started this job's world: the job's processes on this host and the helpers of each."""
  import _smddp_testing as probes
  os.environ.pop("JAX_SMDDP_CPU_HELPERS", None)
  smddp.initialize()
  probes.use_world_of(_native.engine().world_source())
  result(ok=True, local_processes=probes.local_processes(), helpers=probes.cpu_helpers(),
         cores=probes.cores_available())


SCENARIOS = {name[len("scenario_"):]: fn for name, fn in globals().items() if name.startswith("scenario_")}

if __name__ == "__main__":
  try:
    SCENARIOS[scenario]()
  except Exception as e:  # noqa: BLE001
    traceback.print_exc()
    result(ok=False, error=f"{type(e).__name__}: {e}")
    sys.stdout.flush()
    os._exit(1)
  smddp.shutdown()
  jax.distributed.shutdown()

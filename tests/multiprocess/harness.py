"""The harness of worker.py's scenarios (one process of a multi-process test job).

Imported first, it sets the process up from worker.py's arguments (SCENARIO PROCESS_ID
NUM_PROCESSES COORDINATOR DEVICES_PER_PROCESS): XLA_FLAGS, the ptrace rules a test asks for,
jax.distributed. Then the helpers every scenario file (scenarios_*.py) shares: the RESULT line,
global arrays, data that reveals misplaced blocks (every element distinct) and numpy's
answers.
"""

from __future__ import annotations

import json
import os
import sys
import time

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
      want = gather_reference(x, mesh, axis, lead)
      check(f"all_gather {tag}", y, want)
      # psum_scatter.
      x = values((m * n * n * 2, cols), dtype, seed=10 + k)
      xs = global_array(mesh, P(lead), x)
      y = smap(mesh, lambda v: smddp.psum_scatter(v, axis, scatter_dimension=0, tiled=True),
               P(lead), P(lead))(xs)
      check(f"psum_scatter {tag}", y, scatter_reference(x, mesh, axis, lead))
      # psum (sum of every block of the group, on every member).
      x = values((m * n * 3, cols), dtype, seed=20 + k)
      xs = global_array(mesh, P(lead), x)
      y = smap(mesh, lambda v: smddp.psum(v, axis), P(lead), P(lead))(xs)
      check(f"psum {tag}", y, psum_reference(x, mesh, axis, lead))
    # all_to_all and pmax on f32 only.
    x = values((m * n * n, cols), np.float32, seed=30 + k)
    xs = global_array(mesh, P(lead), x)
    y = smap(mesh, lambda v: smddp.all_to_all(v, axis, 0, 0, tiled=True), P(lead), P(lead))(xs)
    check(f"all_to_all {label} cols={cols}", y, all_to_all_reference(x, mesh, axis, lead))
    y = smap(mesh, lambda v: smddp.pmax(v, axis), P(lead), P(lead))(global_array(mesh, P(lead), x))
    check(f"pmax {label} cols={cols}", y, psum_reference(x, mesh, axis, lead, np.maximum))
    # Gather along dimension 1 of a 3-D array: strided blocks ([outer, ranks, inner]).
    x = values((m * n * 2, 3, cols), np.float32, seed=40 + k)
    xs = global_array(mesh, P(lead), x)
    y = smap(mesh, lambda v: smddp.all_gather(v, axis, axis=1, tiled=True), P(lead), P(lead))(xs)
    want = blocks_apply(x, mesh, axis, lead, lambda blocks: [np.concatenate(blocks, 1)] * len(blocks))
    check(f"all_gather axis=1 {label} cols={cols}", y, want)
    # all_to_all along dimension 1: strided blocks both ways ([outer, ranks, inner]).
    x = values((m * n * 2, n * 2, cols), np.float32, seed=50 + k)
    xs = global_array(mesh, P(lead), x)
    y = smap(mesh, lambda v: smddp.all_to_all(v, axis, 1, 1, tiled=True), P(lead), P(lead))(xs)
    check(f"all_to_all axis=1 {label} cols={cols}", y,
          blocks_apply(x, mesh, axis, lead, lambda bl: exchange(bl, 1)))


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


def blocks_apply(x, mesh, axis, lead, fn):
  groups, total = _groups(mesh, axis, lead)
  blocks = np.split(x, total, 0)
  out = [None] * total
  for g in groups:
    res = fn([blocks[b] for b in g])
    for b, r in zip(g, res):
      out[b] = r
  return np.concatenate(out, 0)


def gather_reference(x, mesh, axis, lead):
  return blocks_apply(x, mesh, axis, lead, lambda bl: [np.concatenate(bl, 0)] * len(bl))


def scatter_reference(x, mesh, axis, lead):
  def fn(bl):
    s = np.sum(np.stack([b.astype(np.float64) for b in bl]), 0).astype(bl[0].dtype)
    return np.split(s, len(bl), 0)
  return blocks_apply(x, mesh, axis, lead, fn)


def psum_reference(x, mesh, axis, lead, op=None):
  def fn(bl):
    if op is None:
      s = np.sum(np.stack([b.astype(np.float64) for b in bl]), 0).astype(bl[0].dtype)
    else:
      s = bl[0]
      for b in bl[1:]:
        s = op(s, b)
    return [s] * len(bl)
  return blocks_apply(x, mesh, axis, lead, fn)


def exchange(blocks, dim):
  """all_to_all of a group's blocks along `dim`: r gets sender s's part r, in sender order."""
  n = len(blocks)
  parts = [np.split(b, n, dim) for b in blocks]  # parts[s][r]: sender s's part for r
  return [np.concatenate([parts[s][r] for s in range(n)], dim) for r in range(n)]


def all_to_all_reference(x, mesh, axis, lead):
  return blocks_apply(x, mesh, axis, lead, lambda bl: exchange(bl, 0))


def psum_over_every_device():
  """A psum over every device of the job: the compiled program, its input, numpy's result."""
  mesh = Mesh(np.array(jax.devices()), ("x",))
  x = values((mesh.size * 2, 7), np.float32, 3)
  f = smap(mesh, lambda v: smddp.psum(v, "x"), P("x"), P("x"))
  return f, global_array(mesh, P("x"), x), psum_reference(x, mesh, "x", "x")


def last_process_dies(f, xs, report):
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

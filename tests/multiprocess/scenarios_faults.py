"""worker.py's scenarios of faults: processes that disagree (shapes, ops, dtypes, builds,
providers, chunk settings) and peers that die, are killed midway, leave or stall."""

from __future__ import annotations

import os
import time

import numpy as np
import jax
from jax.sharding import Mesh, PartitionSpec as P
import jax_smddp as smddp

from harness import (check, failed, global_array, last_process_dies, nprocs, pid,
    psum_over_every_device, result, smap, values)

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
  last_process_dies(f, xs, failed)


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
  f, xs, want = psum_over_every_device()
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
    # Stay a while: the survivors' deadlines differ by how far apart they started, and one
    # that exits at its own would be named, rightly, as a failed peer by one still waiting.
    time.sleep(5)
    os._exit(0)
  result(ok=True, seconds=time.monotonic() - t0)
  os._exit(0)

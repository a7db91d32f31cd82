"""The GPU data movers without JAX: the stream algorithms on one GPU with
CudaStreamOps, every rank a process of its own (regions shared by CUDA IPC),
in each copy and flag mode and SM budget, against numpy. Isolates the kernels,
copy engines and stream memory operations from XLA. Skipped without a GPU.

Ranks are processes, not threads: ranks on streams of one CUDA context wait on
each other through flags the CUDA scheduler cannot see, and it may serialise a
waiting stream ahead of the one that would release it (threads hung on an
H100)."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time

import numpy as np
import pytest

import ml_dtypes

from jax_smddp import _native

# The protocol's references and cases, shared with its CPU test (tests/engine).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine"))
from test_stream_protocol import ALL_REDUCE, ALL_TO_ALL, DTYPES, GATHER, OPS, SCATTER, combine, inputs  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stream_rank  # noqa: E402  (the child's entry point)

EXT = _native.cuda_engine()
WAIT_S = float(os.environ.get("JAX_SMDDP_GPU_TEST_TIMEOUT", "120")) / 2  # per case: a hang fails
pytestmark = [pytest.mark.skipif(EXT is None or EXT.device_count() == 0, reason="no GPU"),
              pytest.mark.skipif(EXT is not None and not hasattr(EXT, "stream_run"),
                                 reason="the CUDA module's test entry is built only with "
                                        "-DJAX_SMDDP_TESTING=ON (scripts/gpu_check.sh builds so)"),
              pytest.mark.timeout(int(os.environ.get("JAX_SMDDP_GPU_TEST_TIMEOUT", "120")) * 3)]

# (copies, flags, SM budget)
MODES = [("engine", "memops", 8), ("kernel", "memops", 1), ("kernel", "kernel", 8),
         ("engine", "kernel", 2)]
SLOTS = [256, 4096, 8192, 65536, 1 << 20, 8 << 20]  # the last: the default slot (8 MiB)


def cases(size, seed=0):
  """(name, job params, per-rank inputs, per-rank expected outputs); `seed` draws other inputs."""
  out = []
  for outer, inner, slot in [(1, 300_000, 1 << 20), (5, 37, 256), (3, 1000, 4096)]:
    xs = inputs(size, (outer, inner), np.float32, seed=seed + size + inner)
    want = np.stack(xs, axis=1)
    out.append((f"all_gather {outer}x{inner} slot {slot}",
                dict(kind=GATHER, dtype=np.float32, op="sum", outer=outer, inner=inner * 4, count=0,
                     slot=slot), xs, [want] * size))
    xs = inputs(size, (outer, size, inner), np.int32, seed=seed + size * 2 + inner)
    out.append((f"all_to_all {outer}x{inner} slot {slot}",
                dict(kind=ALL_TO_ALL, dtype=np.int32, op="sum", outer=outer, inner=inner * 4,
                     count=0, slot=slot), xs,
                [np.stack([x[:, r, :] for x in xs], axis=1) for r in range(size)]))
  for dtype, op in [(np.float32, "sum"), (np.int32, "max"), (ml_dtypes.bfloat16, "sum"),
                    (np.float16, "min")]:
    name = np.dtype(dtype).name
    xs = inputs(size, (3, size, 2000), dtype, seed=seed + size)
    out.append((f"reduce_scatter {name} {op}",
                dict(kind=SCATTER, dtype=dtype, op=op, outer=3, inner=2000, count=0, slot=8192), xs,
                [combine([x[:, r, :] for x in xs], op, dtype) for r in range(size)]))
    # 2000 elements: rows of 16-byte multiples (vector loads); 1999: one element at a time.
    xs = inputs(size, (2, size, 1999), dtype, seed=seed + size + 2)
    out.append((f"reduce_scatter {name} {op} odd rows",
                dict(kind=SCATTER, dtype=dtype, op=op, outer=2, inner=1999, count=0, slot=8192), xs,
                [combine([x[:, r, :] for x in xs], op, dtype) for r in range(size)]))
    xs = inputs(size, (100_003,), dtype, seed=seed + size + 1)
    out.append((f"all_reduce {name} {op}",
                dict(kind=ALL_REDUCE, dtype=dtype, op=op, outer=1, inner=0, count=100_003,
                     slot=65536), xs, [combine(xs, op, dtype)] * size))
  return out


class Ranks:
  """`size` rank processes with their communicators connected."""

  def __init__(self, size, flag_memory="device", direct=False):
    """`direct`: every call reads the peers' buffers in place (StreamRank::inputs and, for
    all_reduce, outputs), each rank's send and receive buffers shared by CUDA IPC."""
    ctx = multiprocessing.get_context("spawn")
    self.size, self.direct = size, direct
    self.members = {slot: [i * 64 + r for r in range(size)] for i, slot in enumerate(SLOTS)}
    self.conns, self.procs = [], []
    for r in range(size):
      parent, child = ctx.Pipe()
      p = ctx.Process(target=stream_rank.serve, args=(r, child, flag_memory), daemon=True)
      p.start()
      self.conns.append(parent)
      self.procs.append(p)
    try:
      groups = [(self.members[s], s) for s in SLOTS]
      for c in self.conns:
        c.send(groups)
      handles = self._gather("IPC handles")
      for r, c in enumerate(self.conns):
        c.send([[h for q in range(size) if q != r for h in handles[q][g]]
                for g in range(len(SLOTS))])
      self._gather("connect")
    except BaseException:
      self.close()
      raise

  def _gather(self, what, only=None):
    got = []
    for r, c in enumerate(self.conns):
      if only is not None and r not in only:
        continue
      if not c.poll(WAIT_S):
        raise AssertionError(f"rank {r} did not finish {what} within {WAIT_S:.0f} s (a hang)")
      reply = c.recv()
      if isinstance(reply, tuple) and reply[0] == "error":
        raise AssertionError(reply[1])
      got.append(reply[1] if isinstance(reply, tuple) else reply)
    return got

  def run(self, name, params, xs, wants, mode, calls=3, only=None):
    """Every rank (of `only`) runs `calls` calls of the case; returns
    [(output, counters)] by rank."""
    dtype = np.dtype(params["dtype"])
    self.send(params, xs, wants, mode, calls, only)
    return [(np.frombuffer(out, dtype=dtype).reshape(wants[r].shape), counters)
            for r, (out, counters) in zip(only or range(self.size), self._gather(name, only))]

  def send(self, params, xs, wants, mode, calls=3, only=None, phases=False, graph_replays=0):
    """`graph_replays`: xs[r] holds one input per launch (stacked) and wants[r] one output."""
    copies, flags, blocks = mode
    dtype = np.dtype(params["dtype"])
    peers = []
    if self.direct:  # every rank's buffers of this case's sizes, then their handles to all
      if only is not None or graph_replays:
        raise ValueError("direct reads need every rank and no graph replays")
      for r, c in enumerate(self.conns):
        c.send(("buffers", xs[r].nbytes, wants[r].nbytes))
      peers = self._gather("direct-read buffers")
    for r, c in enumerate(self.conns):
      if only is not None and r not in only:
        continue
      c.send(dict(peers=peers,members=self.members[params["slot"]], rank=r, kind=params["kind"],
                  dtype=DTYPES[dtype], op=OPS[params["op"]], outer=params["outer"],
                  inner=params["inner"], count=params["count"], input=xs[r].tobytes(),
                  out_bytes=wants[r].nbytes, calls=calls, copies=copies, flags=flags,
                  max_blocks=blocks, phases=phases, graph_replays=graph_replays))

  def close(self):
    for c in self.conns:
      try:
        c.send(None)
      except OSError:
        pass
    for p in self.procs:
      p.join(5)
      if p.is_alive():
        p.kill()


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: f"{m[0]} copies, {m[1]} flags, {m[2]} blocks")
def test_collectives(mode, size):
  check_collectives(Ranks(size), size, mode)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("mode", [MODES[0], MODES[2]],
                         ids=lambda m: f"{m[0]} copies, {m[1]} flags, {m[2]} blocks")
def test_collectives_reading_in_place(mode, size):
  """Direct reads (the default for XLA's buffers): every case with each rank's input (and for
  all_reduce its output) read or written in place by its peers: all_gather and all_to_all
  copied on lanes, reduce_scatter in one kernel, all_reduce in one round (each rank's shard
  reduced into every output)."""
  check_collectives(Ranks(size, direct=True), size, mode)


@pytest.mark.parametrize("mode", [MODES[0], MODES[2]],
                         ids=lambda m: f"{m[0]} copies, {m[1]} flags, {m[2]} blocks")
def test_collectives_with_step_flags_in_host_memory(mode):
  """JAX_SMDDP_GPU_FLAG_MEMORY=host: each rank's flags in a shared-memory
  block every rank's GPU addresses (what the dead-peer watchdog releases)."""
  check_collectives(Ranks(4, "host"), 4, mode)


def test_dead_rank_releases_its_peers_and_fails_their_next_call():
  """Ranks 0 and 1 start an all_gather; rank 2's process is killed a second
  later. The watchdog sees it, sets the flags only rank 2 would have written,
  and the two streams finish (undefined output) instead of waiting forever;
  their next call fails naming rank 2 and its process."""
  ranks = Ranks(3, "host")
  try:
    name, params, xs, wants = cases(3)[0]
    t0 = time.monotonic()
    ranks.send(params, xs, wants, MODES[0], calls=1, only=(0, 1))
    time.sleep(1.0)
    ranks.procs[2].kill()
    ranks._gather(name + " after rank 2 died", only=(0, 1))  # released, not hung
    assert time.monotonic() - t0 < 15
    with pytest.raises(AssertionError, match=r"rank 2 \(process 2, pid \d+\) of GPU group .* is gone"):
      ranks.run(name, params, xs, wants, MODES[0], calls=1, only=(0, 1))
  finally:
    ranks.close()


@pytest.mark.parametrize("mode", [MODES[0], MODES[2]],
                         ids=lambda m: f"{m[0]} copies, {m[1]} flags, {m[2]} blocks")
def test_replayable_calls_captured_into_cuda_graphs(mode):
  """One call of each case captured into a CUDA graph as the NCCL API front end enqueues a
  captured call (stream_algorithms.h: staged, by tokens), the graph launched 3 times on
  fresh inputs in the same buffers (its output cleared before each launch): every launch's
  output right. Ranks of their own, whose communicators run no uncaptured call."""
  size, launches = 2, 3
  ranks = Ranks(size, "host")  # the front end's flag memory
  try:
    draws = [cases(size, seed=1000 * (k + 1)) for k in range(launches)]  # inputs per launch
    for i, (name, params, _, _) in enumerate(draws[0]):
      stacked = [np.stack([d[i][2][r] for d in draws]) for r in range(size)]
      ranks.send(params, stacked, draws[0][i][3], mode, graph_replays=launches)
      for r, (out, _) in enumerate(ranks._gather(name + " in a CUDA graph")):
        got = np.frombuffer(out, dtype=np.dtype(params["dtype"]))
        got = got.reshape((launches,) + draws[0][i][3][r].shape)
        for k, d in enumerate(draws):
          np.testing.assert_array_equal(got[k], d[i][3][r], err_msg=f"{name}, rank {r}, launch {k}")
  finally:
    ranks.close()


def check_collectives(ranks, size, mode):
  try:
    counters = None
    for name, params, xs, wants in cases(size):
      for r, (got, counters) in enumerate(ranks.run(name, params, xs, wants, mode)):
        np.testing.assert_array_equal(got, wants[r], err_msg=f"{name}, rank {r} of {size}")
  finally:
    ranks.close()
  # What moved the data (rank size-1's counters, all cases): copy engines launch no copy
  # kernel, and stream memory operations no flag kernel.
  copies, flags, _ = mode
  if copies == "engine":
    assert counters["copy_kernels"] == 0 and counters["engine_copies"] > 0, counters
  else:
    assert counters["engine_copies"] == 0 and counters["copy_kernels"] > 0, counters
  assert counters["reduce_kernels"] > 0, counters
  if flags == "kernel":
    assert counters["flag_memops"] == 0 and counters["flag_kernels"] > 0, counters
  elif EXT.have_stream_memops():
    assert counters["flag_kernels"] == 0 and counters["flag_memops"] > 0, counters


def phase_line(blocks, rank, phases):
  """One rank's phase timing (stream_run(phases=True)): each phase's count and mean time."""
  return (f"{blocks:>4} blocks rank {rank}: total {phases['total'] * 1e3:.3f} ms = " +
          ", ".join(f"{k} {phases[k][0]} x {phases[k][1] * 1e3 / max(phases[k][0], 1):.3f} ms"
                    for k in ("copy", "reduce", "wait", "signal")))


def test_where_a_64mib_reduce_scatter_spends_its_time():
  """2 ranks (processes sharing the GPU), 64 MiB of f32 each, staged through the default 8 MiB
  slots, copy engines and stream memory operations; the last of 3 calls timed with CUDA
  events around every operation (phase_timer.h), at 8, 32 and 1024 blocks. Checked against
  numpy; prints each rank's copy, reduction, wait and signal time beside one bare reduction
  kernel of the same bytes (what the budget allows) and the copy rate, for docs/gpu_measurements.md."""
  size, inner = 2, 8 << 20  # elements per rank's block: 32 MiB, so 64 MiB per rank's input
  xs = inputs(size, (1, size, inner), np.float32, seed=3)
  wants = [combine([x[:, r, :] for x in xs], "sum", np.float32) for r in range(size)]
  params = dict(kind=SCATTER, dtype=np.float32, op="sum", outer=1, inner=inner, count=0,
                slot=8 << 20)
  ranks = Ranks(size)
  lines = [f"copy rate {EXT.copy_bandwidth(0, 64 << 20) / 1e9:.0f} GB/s (64 MiB, alone)"]
  try:
    for blocks in (8, 32, 1024):
      ranks.send(params, xs, wants, ("engine", "memops", blocks), calls=3, phases=True)
      bare = EXT.reduce_seconds(0, 4 << 20, size, blocks)  # one step's reduction: 2 x 4 MiB
      for r, ((out, phases), _) in enumerate(ranks._gather(f"reduce_scatter, {blocks} blocks")):
        got = np.frombuffer(out, np.float32).reshape(wants[r].shape)
        np.testing.assert_array_equal(got, wants[r], err_msg=f"rank {r}, {blocks} blocks")
        steps = phases["reduce"][0]
        assert steps == 8 and phases["copy"][0] == 8, phases  # 8 tiles of 2 x 4 MiB
        lines.append(phase_line(blocks, r, phases) +
                     f"; bare reduction of one step {bare * 1e3:.3f} ms")
  finally:
    ranks.close()
  print("\n".join(lines))


def test_where_a_16mib_all_gather_spends_its_time():
  """2 ranks (processes sharing the GPU), 8 MiB of f32 each gathered into 16 MiB, staged
  through the default 8 MiB slots, copy engines and stream memory operations; the last of 3
  calls timed with CUDA events around every operation. Checked against numpy; prints each
  rank's copy, wait and signal time beside the copy rate: where the all_gather's fixed cost
  per call goes at the size where #35 wants 0.8 of the copy rate."""
  size, elements = 2, 2 << 20
  xs = inputs(size, (1, elements), np.float32, seed=5)
  want = np.stack(xs, axis=1)
  params = dict(kind=GATHER, dtype=np.float32, op="sum", outer=1, inner=elements * 4, count=0,
                slot=8 << 20)
  ranks = Ranks(size)
  lines = [f"copy rate {EXT.copy_bandwidth(0, 16 << 20) / 1e9:.0f} GB/s (16 MiB, alone)"]
  try:
    for blocks in (8, 1024):
      ranks.send(params, xs, [want] * size, ("engine", "memops", blocks), calls=3, phases=True)
      for r, ((out, phases), _) in enumerate(ranks._gather(f"all_gather, {blocks} blocks")):
        got = np.frombuffer(out, np.float32).reshape(want.shape)
        np.testing.assert_array_equal(got, want, err_msg=f"rank {r}, {blocks} blocks")
        assert phases["copy"][0] > 0, phases
        lines.append(phase_line(blocks, r, phases))
  finally:
    ranks.close()
  print("\n".join(lines))


def test_where_a_direct_call_spends_its_time():
  """Direct reads, 2 ranks (processes sharing the GPU), copy engines and stream memory
  operations: a 16 MiB all_gather (8 MiB per rank), a 64 MiB reduce_scatter and a 64 MiB
  all_reduce of f32, at 8, 16 and 32 blocks; the last of 3 calls timed with CUDA events around
  every operation (on one stream: the phase clock does not follow lanes). Checked against
  numpy; prints each rank's copy, reduction, wait and signal time beside the bare kernel and
  the copy rate: where the direct path's time goes, for docs/gpu_measurements.md."""
  size = 2
  xs_ag = inputs(size, (1, 2 << 20), np.float32, seed=7)
  xs_rs = inputs(size, (1, size, 8 << 20), np.float32, seed=8)
  xs_ar = inputs(size, (16 << 20,), np.float32, seed=9)
  runs = [("all_gather 16 MiB", dict(kind=GATHER, dtype=np.float32, op="sum", outer=1,
                                     inner=(2 << 20) * 4, count=0, slot=8 << 20),
           xs_ag, [np.stack(xs_ag, axis=1)] * size, 0),
          ("reduce_scatter 64 MiB", dict(kind=SCATTER, dtype=np.float32, op="sum", outer=1,
                                         inner=8 << 20, count=0, slot=8 << 20),
           xs_rs, [combine([x[:, r, :] for x in xs_rs], "sum", np.float32) for r in range(size)],
           32 << 20),
          ("all_reduce 64 MiB", dict(kind=ALL_REDUCE, dtype=np.float32, op="sum", outer=1,
                                     inner=0, count=16 << 20, slot=8 << 20),
           xs_ar, [combine(xs_ar, "sum", np.float32)] * size, 32 << 20)]
  ranks = Ranks(size, direct=True)
  lines = [f"copy rate {EXT.copy_bandwidth(0, 64 << 20) / 1e9:.0f} GB/s (64 MiB, alone)"]
  try:
    for name, params, xs, wants, reduced in runs:
      for blocks in (8, 16, 32):
        ranks.send(params, xs, wants, ("engine", "memops", blocks), calls=3, phases=True)
        bare = EXT.reduce_seconds(0, reduced, size, blocks) if reduced else 0.0
        for r, ((out, phases), _) in enumerate(ranks._gather(f"{name}, {blocks} blocks")):
          got = np.frombuffer(out, np.float32).reshape(wants[r].shape)
          np.testing.assert_array_equal(got, wants[r], err_msg=f"{name}, rank {r}, {blocks} blocks")
          lines.append(f"{name} direct: " + phase_line(blocks, r, phases) +
                       (f"; bare reduction {bare * 1e3:.3f} ms" if reduced else ""))
  finally:
    ranks.close()
  print("\n".join(lines))

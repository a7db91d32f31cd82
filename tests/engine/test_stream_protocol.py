"""The stream-ordered protocol of the GPU backend (staging slots, posted and
consumed flags, tiling), run on host threads through the same C++ algorithms
(xla_ffi/algorithms/stream_*.cc) with host memory instead of a stream,
against numpy. Small slots force every tiling path: whole rows per step,
pieces of one row, and slots reused within and across calls; the
direct-read form, where ranks read each other's buffers in place; and calls
as CUDA graphs replay them (by tokens)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from helpers import engine_probes, ran_in_first_suite

ran_in_first_suite("the engine's C++, through its probes")

ENGINE = engine_probes()
# The engine's own numbering (exported from C++, never mirrored by hand).
DTYPES = {np.dtype(name if name != "bfloat16" else ml_dtypes.bfloat16): code
          for name, code in ENGINE.dtypes().items()}
OPS = ENGINE.reduce_ops()
_KINDS = ENGINE.plan_kinds()
GATHER, SCATTER, ALL_REDUCE, ALL_TO_ALL = (_KINDS[k] for k in (
    "all_gather", "reduce_scatter", "all_reduce", "all_to_all"))

pytestmark = pytest.mark.timeout(60)


def inputs(size, shape, dtype, seed):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(size):
    if np.issubdtype(np.dtype(dtype), np.integer):
      out.append(rng.integers(-1000, 1000, size=shape).astype(dtype))
    else:
      out.append(rng.standard_normal(shape).astype(dtype))
  return out


def combine(blocks, op, dtype):
  """Reference reduction: sources in rank order, 16-bit floats in f32, one rounding."""
  wide = np.float32 if np.dtype(dtype) in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)) \
      else dtype
  acc = blocks[0].astype(wide)
  for b in blocks[1:]:
    b = b.astype(wide)
    acc = acc + b if op == "sum" else (np.maximum(acc, b) if op == "max" else np.minimum(acc, b))
  return acc.astype(dtype)


def probe(kind, xs, out_shape, dtype, *, op="sum", outer=1, inner=0, count=0, slot=4096, calls=3,
          flag_blocks=False, direct=0, first_step=0):
  """`direct`: 0 stages every call, 1 reads peers' buffers in place, 2 alternates;
  `first_step`: the steps the group ran before (its flags and counters there)."""
  outs = ENGINE.stream_probe(kind, DTYPES[np.dtype(dtype)], OPS[op], outer, inner, count, slot,
                             [x.tobytes() for x in xs],
                             int(np.prod(out_shape)) * np.dtype(dtype).itemsize, calls,
                             flag_blocks=flag_blocks, direct=direct, first_step=first_step)
  return [np.frombuffer(o, dtype=dtype).reshape(out_shape) for o in outs]


# Flags in the staging regions (JAX_SMDDP_GPU_FLAG_MEMORY=device) or in flag
# blocks of their own (=host, the blocks the watchdog can release).
FLAG_PLACES = pytest.mark.parametrize("flag_blocks", [False, True], ids=["flags-in-regions",
                                                                         "flag-blocks"])


@FLAG_PLACES
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("outer,inner,slot", [(1, 300, 4096), (5, 37, 256), (3, 1000, 512),
                                              (4, 64, 1 << 20)])
def test_all_gather(size, outer, inner, slot, flag_blocks):
  xs = inputs(size, (outer, inner), np.float32, seed=size * 7 + inner)
  want = np.stack(xs, axis=1)  # [outer, size, inner]
  for r, got in enumerate(probe(GATHER, xs, want.shape, np.float32, outer=outer, inner=inner * 4,
                                slot=slot, flag_blocks=flag_blocks)):
    np.testing.assert_array_equal(got, want, err_msg=f"rank {r}")


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("outer,inner,slot", [(1, 300, 4096), (5, 37, 256), (2, 1000, 512)])
def test_all_to_all(size, outer, inner, slot):
  xs = inputs(size, (outer, size, inner), np.int32, seed=size + inner)
  for r, got in enumerate(probe(ALL_TO_ALL, xs, (outer, size, inner), np.int32, outer=outer,
                                inner=inner * 4, slot=slot)):
    want = np.stack([xs[q][:, r, :] for q in range(size)], axis=1)
    np.testing.assert_array_equal(got, want, err_msg=f"rank {r}")


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype,op", [(np.float32, "sum"), (np.float32, "max"), (np.int32, "min"),
                                      (ml_dtypes.bfloat16, "sum"), (np.float16, "sum"),
                                      (np.float64, "sum")])
@pytest.mark.parametrize("outer,inner,slot", [(1, 333, 1024), (6, 21, 512), (2, 2048, 1 << 16)])
def test_reduce_scatter(size, dtype, op, outer, inner, slot):
  xs = inputs(size, (outer, size, inner), dtype, seed=size * 3 + inner)
  for r, got in enumerate(probe(SCATTER, xs, (outer, inner), dtype, op=op, outer=outer,
                                inner=inner, slot=slot)):
    want = combine([x[:, r, :] for x in xs], op, dtype)
    np.testing.assert_array_equal(got, want, err_msg=f"rank {r}")


@FLAG_PLACES
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype,op", [(np.float32, "sum"), (np.int32, "max"),
                                      (ml_dtypes.bfloat16, "sum")])
@pytest.mark.parametrize("count,slot", [(1001, 1024), (3, 256), (10000, 1 << 20), (4096, 256)])
def test_all_reduce(size, dtype, op, count, slot, flag_blocks):
  xs = inputs(size, (count,), dtype, seed=size + count)
  want = combine(xs, op, dtype)
  for r, got in enumerate(probe(ALL_REDUCE, xs, (count,), dtype, op=op, count=count, slot=slot,
                                flag_blocks=flag_blocks)):
    np.testing.assert_array_equal(got, want, err_msg=f"rank {r}")


def test_many_calls_reuse_slots_safely():
  """Forty calls through two slots: a rank that overwrote a slot before its
  peers read it would corrupt later calls' results."""
  xs = inputs(4, (8, 4, 100), np.float32, seed=1)
  for r, got in enumerate(probe(SCATTER, xs, (8, 100), np.float32, outer=8, inner=100, slot=256,
                                calls=40)):
    np.testing.assert_array_equal(got, combine([x[:, r, :] for x in xs], "sum", np.float32))


@FLAG_PLACES
@pytest.mark.parametrize("direct", [0, 2], ids=["staged", "alternating"])
def test_step_counters_wrap_around(flag_blocks, direct):
  """A long job's step counters pass 2^32 (64 KiB slots: 4096 steps per
  256 MiB call). Flags compare cyclically, as CUDA's stream memory
  operations do (CU_STREAM_WAIT_VALUE_GEQ), so the calls across the wrap
  stay right; a plain `<` would let a rank overwrite slots its peers have
  not read, or wait forever."""
  xs = inputs(3, (8, 3, 100), np.float32, seed=5)
  for r, got in enumerate(probe(SCATTER, xs, (8, 100), np.float32, outer=8, inner=100, slot=256,
                                calls=6, flag_blocks=flag_blocks, direct=direct,
                                first_step=(1 << 32) - 5)):
    np.testing.assert_array_equal(got, combine([x[:, r, :] for x in xs], "sum", np.float32))


# --- direct reads: peers' inputs read in place (StreamRank::inputs) --------

DIRECT = pytest.mark.parametrize("direct", [1, 2], ids=["direct", "alternating"])


@DIRECT
@FLAG_PLACES
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("outer,inner", [(1, 300), (5, 37), (3, 1000), (0, 8)])
def test_all_gather_direct(size, outer, inner, direct, flag_blocks):
  xs = inputs(size, (outer, inner), np.float32, seed=size * 5 + inner)
  want = np.stack(xs, axis=1)
  for r, got in enumerate(probe(GATHER, xs, want.shape, np.float32, outer=outer, inner=inner * 4,
                                slot=256, flag_blocks=flag_blocks, direct=direct)):
    np.testing.assert_array_equal(got, want, err_msg=f"rank {r}")


@DIRECT
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("outer,inner", [(1, 300), (5, 37)])
def test_all_to_all_direct(size, outer, inner, direct):
  xs = inputs(size, (outer, size, inner), np.int32, seed=size + inner + 1)
  for r, got in enumerate(probe(ALL_TO_ALL, xs, (outer, size, inner), np.int32, outer=outer,
                                inner=inner * 4, slot=256, direct=direct)):
    want = np.stack([xs[q][:, r, :] for q in range(size)], axis=1)
    np.testing.assert_array_equal(got, want, err_msg=f"rank {r}")


@DIRECT
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype,op", [(np.float32, "sum"), (np.int32, "min"),
                                      (ml_dtypes.bfloat16, "sum"), (np.float16, "max")])
@pytest.mark.parametrize("outer,inner", [(1, 333), (6, 21)])
def test_reduce_scatter_direct(size, dtype, op, outer, inner, direct):
  xs = inputs(size, (outer, size, inner), dtype, seed=size * 11 + inner)
  for r, got in enumerate(probe(SCATTER, xs, (outer, inner), dtype, op=op, outer=outer,
                                inner=inner, slot=256, direct=direct)):
    np.testing.assert_array_equal(got, combine([x[:, r, :] for x in xs], op, dtype),
                                  err_msg=f"rank {r}")


@DIRECT
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype,op", [(np.float32, "sum"), (np.int32, "max"),
                                      (ml_dtypes.bfloat16, "sum")])
@pytest.mark.parametrize("count", [1001, 3, 4096])
def test_all_reduce_direct(size, dtype, op, count, direct):
  """Rank r reduces shard r of every input into its own output, peers copy
  it from there: uneven shards, shards empty for some ranks (count 3 of 4)."""
  xs = inputs(size, (count,), dtype, seed=size * 13 + count)
  want = combine(xs, op, dtype)
  for r, got in enumerate(probe(ALL_REDUCE, xs, (count,), dtype, op=op, count=count, slot=256,
                                direct=direct)):
    np.testing.assert_array_equal(got, want, err_msg=f"rank {r}")


@pytest.mark.parametrize("kind", [GATHER, SCATTER, ALL_TO_ALL, ALL_REDUCE])
@pytest.mark.parametrize("direct", [1, 2], ids=["direct", "alternating"])
def test_direct_reads_finish_before_the_owner_reuses_its_input(kind, direct):
  """Each rank writes new data into its one input buffer before every call, and
  overwrites its one output buffer after copying each call's result out (as
  XLA reuses buffers): a rank whose stream went on before its peers had read
  its input (or, for all_reduce, its reduced shard in its output) would hand
  them wrong data. Every call's output is checked; slow readers are likely
  with 4 threads on 2 cores."""
  check_varying_calls(kind, 4, calls=30, outer=3, inner=257, slot=1024, seed=kind,
                      direct=direct)


def check_varying_calls(kind, size, *, calls, outer, inner, slot, seed, **probe_args):
  """`calls` calls of `kind` over int32 data, each rank writing fresh inputs into its one
  input buffer before every call and reusing its one output buffer (as XLA reuses
  buffers); every call's output against numpy."""
  rng = np.random.default_rng(seed)
  shape = {GATHER: (outer, inner), ALL_REDUCE: (outer * inner,)}.get(kind, (outer, size, inner))
  xs = [[rng.integers(-1000, 1000, size=shape).astype(np.int32) for _ in range(size)]
        for _ in range(calls)]
  out_shape = {GATHER: (outer, size, inner), SCATTER: (outer, inner),
               ALL_TO_ALL: (outer, size, inner), ALL_REDUCE: (outer * inner,)}[kind]
  outs = ENGINE.stream_probe(kind, DTYPES[np.dtype(np.int32)], OPS["sum"], outer,
                             inner if kind == SCATTER else inner * 4,
                             outer * inner if kind == ALL_REDUCE else 0, slot,
                             [x.tobytes() for call in xs for x in call],
                             int(np.prod(out_shape)) * 4, calls, vary=True, **probe_args)
  for r, out in enumerate(outs):
    got = np.frombuffer(out, np.int32).reshape((calls,) + out_shape)
    for c in range(calls):
      if kind == GATHER:
        want = np.stack(xs[c], axis=1)
      elif kind == SCATTER:
        want = combine([x[:, r, :] for x in xs[c]], "sum", np.int32)
      elif kind == ALL_REDUCE:
        want = combine(xs[c], "sum", np.int32)
      else:
        want = np.stack([x[:, r, :] for x in xs[c]], axis=1)
      np.testing.assert_array_equal(got[c], want, err_msg=f"rank {r}, call {c}")


# --- calls captured into CUDA graphs: replayable, by tokens ----------------

@FLAG_PLACES
@pytest.mark.parametrize("kind", [GATHER, SCATTER, ALL_TO_ALL, ALL_REDUCE])
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("replayable,direct", [(1, 0), (2, 0), (2, 1)],
                         ids=["every-call", "between-staged", "between-direct"])
def test_replayable_calls(kind, size, replayable, direct, flag_blocks):
  """Calls as a CUDA graph replays them (stream_algorithms.h: steps numbered within the
  call, slots handed over by tokens that each call leaves clear): every call, or every
  other one between uncaptured calls that stage (the group drains each call) or read in
  place. Fresh inputs in the same buffers before every call, outputs reused: a call that
  did not wait for its peers, or reused a slot a peer still reads, gives wrong values.
  256-byte slots: up to a dozen steps per call, each slot reused within and across calls."""
  check_varying_calls(kind, size, calls=7, outer=3, inner=37, slot=256, seed=100 * kind + size,
                      flag_blocks=flag_blocks, direct=direct, replayable=replayable)


# --- across hosts: the hierarchical all_gather with its network proxy ------

def hierarchical(hosts, local, xs, rank_of, *, outer, slot, calls=3, timeout=20.0, kill_host=-1,
                 scatter=None, rail="", swap=False):
  """all_gather, or reduce_scatter with `scatter=op`, or all_to_all with
  `swap` (inputs [outer, P, inner] for both). `rail`: a libfabric provider
  whose FabricRails move the slots' bytes (registered memory, no bounce
  buffers) instead of the links."""
  if swap:
    return ENGINE.stream_hierarchical_probe(hosts, local, outer, xs[0].nbytes // outer // len(xs),
                                            slot, rank_of, [x.tobytes() for x in xs], calls,
                                            timeout, kill_host, kind=ALL_TO_ALL, rail_provider=rail)
  if scatter is None:
    return ENGINE.stream_hierarchical_probe(hosts, local, outer, xs[0].nbytes // outer, slot,
                                            rank_of, [x.tobytes() for x in xs], calls, timeout,
                                            kill_host, rail_provider=rail)
  inner = xs[0].shape[-1]
  return ENGINE.stream_hierarchical_probe(hosts, local, outer, inner, slot, rank_of,
                                          [x.tobytes() for x in xs], calls, timeout, kill_host,
                                          kind=1, dtype=DTYPES[xs[0].dtype], op=OPS[scatter],
                                          rail_provider=rail)


@pytest.mark.parametrize("hosts,local", [(2, 1), (2, 2), (3, 2), (2, 4), (4, 1)])
@pytest.mark.parametrize("order", ["host-major", "interleaved"])
@pytest.mark.parametrize("outer,inner,slot", [(1, 1000, 1024), (5, 37, 256), (4, 64, 1 << 20)])
def test_hierarchical_all_gather(hosts, local, order, outer, inner, slot):
  """Rails between hosts, slots inside them; group ranks either host-major or
  interleaved across hosts (as a 2-D mesh's other axis orders them)."""
  P = hosts * local
  if order == "host-major":
    rank_of = list(range(P))
  else:
    rank_of = [j * hosts + g for g in range(hosts) for j in range(local)]
  xs = inputs(P, (outer, inner), np.float32, seed=P + inner)
  want = np.stack(xs, axis=1)
  outs = hierarchical(hosts, local, xs, rank_of, outer=outer, slot=slot)
  for x, o in enumerate(outs):
    got = np.frombuffer(o, np.float32).reshape(outer, P, inner)
    np.testing.assert_array_equal(got, want, err_msg=f"host {x // local} rank {x % local}")


def test_hierarchical_many_calls_through_two_slots():
  xs = inputs(6, (3, 500), np.int32, seed=3)
  outs = hierarchical(3, 2, xs, list(range(6)), outer=3, slot=256, calls=25)
  for o in outs:
    np.testing.assert_array_equal(np.frombuffer(o, np.int32).reshape(3, 6, 500), np.stack(xs, 1))


def _rail_missing():
  """Why FabricRails cannot run here (shm provider with FI_HMEM), or None."""
  try:
    why = ENGINE.rail_probe("shm")
  except Exception as e:  # noqa: BLE001 - any failure to open is a reason to skip
    why = str(e)
  return why or None


@pytest.mark.parametrize("rail", ["", "shm"], ids=["links", "rails"])
@pytest.mark.parametrize("kind", ["all_gather", "all_to_all"])
def test_hierarchical_dead_host_is_an_error_naming_the_peer(rail, kind):
  """A host whose links closed: every rank that talks to it over the network
  fails its call naming the peer process, in well under the deadline, and no
  stream waits forever (the proxy releases its flags). Over rails the failure
  comes from the world's link to that process (an RDM endpoint does not see
  a peer exit)."""
  import time
  if rail and _rail_missing():
    pytest.skip(_rail_missing())
  swap = kind == "all_to_all"
  xs = inputs(6, (1, 6, 250) if swap else (1, 1000), np.float32, seed=4)
  t0 = time.monotonic()
  got = hierarchical(3, 2, xs, list(range(6)), outer=1, slot=1024, calls=2, timeout=30,
                     kill_host=1, rail=rail, swap=swap)
  elapsed = time.monotonic() - t0
  assert elapsed < 10, elapsed
  errors, outs = got[:6], got[6:]
  for x, e in enumerate(errors):
    e = e.decode()
    if x // 2 == 1:
      assert e == ""  # the dead host's ranks never ran
      continue
    assert "exited" in e and f"peer process {2 + x % 2}" in e, (x, e)
    # The failed call's output: what never arrived is poisoned (all-ones bytes: NaN),
    # never stale or zero; this host's parts and the tiles that did arrive are right.
    out = np.frombuffer(outs[x], np.uint8).reshape(6, -1)
    for q in range(6):
      want = (xs[q][0, x] if swap else xs[q][0]).view(np.uint8)
      if q // 2 == 1:
        assert (out[q] == 0xFF).all(), (x, q, out[q][:16])
      elif q // 2 == x // 2:
        np.testing.assert_array_equal(out[q], want, err_msg=f"rank {x}, local part {q}")
      else:  # by byte: tiles may split elements (170 B for all_to_all here)
        assert ((out[q] == 0xFF) | (out[q] == want)).all(), (x, q)


@pytest.mark.parametrize("hosts,local", [(2, 2), (3, 1)])
@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_to_all"])
@pytest.mark.parametrize("outer,inner,slot", [(5, 37, 256), (4, 3000, 1 << 20)])
def test_hierarchical_over_fabric_rails(hosts, local, kind, outer, inner, slot):
  """The proxy's other transport: tagged libfabric messages straight from and
  into registered slots (FI_HMEM; shm registers host memory here, EFA would
  register device memory). 12 calls through the two slots of each kind."""
  why = _rail_missing()
  if why:
    pytest.skip(f"no libfabric rail here: {why}")
  P = hosts * local
  rank_of = [j * hosts + g for g in range(hosts) for j in range(local)]
  if kind == "all_gather":
    xs = inputs(P, (outer, inner), np.float32, seed=P + inner)
    outs = hierarchical(hosts, local, xs, rank_of, outer=outer, slot=slot, calls=12, rail="shm")
    for x, o in enumerate(outs):
      np.testing.assert_array_equal(np.frombuffer(o, np.float32).reshape(outer, P, inner),
                                    np.stack(xs, axis=1), err_msg=f"thread {x}")
    return
  xs = inputs(P, (outer, P, inner), np.int32, seed=P * 7 + inner)
  if kind == "all_to_all":
    outs = hierarchical(hosts, local, xs, rank_of, outer=outer, slot=slot, calls=12, swap=True,
                        rail="shm")
    for x, o in enumerate(outs):
      r = rank_of[x]
      np.testing.assert_array_equal(np.frombuffer(o, np.int32).reshape(outer, P, inner),
                                    np.stack([xs[q][:, r, :] for q in range(P)], 1),
                                    err_msg=f"rank {r}")
    return
  outs = hierarchical(hosts, local, xs, rank_of, outer=outer, slot=slot, calls=12,
                      scatter="sum", rail="shm")
  for x, o in enumerate(outs):
    r = rank_of[x]
    np.testing.assert_array_equal(np.frombuffer(o, np.int32).reshape(outer, inner),
                                  combine([xs[q][:, r, :] for q in range(P)], "sum", np.int32),
                                  err_msg=f"rank {r}")


@pytest.mark.parametrize("hosts,local", [(2, 1), (2, 2), (3, 2), (2, 4), (4, 1)])
@pytest.mark.parametrize("order", ["host-major", "interleaved"])
@pytest.mark.parametrize("outer,inner,slot", [(1, 1000, 1024), (5, 37, 256), (3, 64, 1 << 20)])
def test_hierarchical_all_to_all(hosts, local, order, outer, inner, slot):
  """Blocks for other hosts gathered per rail through the slots, one network
  message per host pair and rail, then unpacked: every block lands where
  jax.lax.all_to_all puts it (distinct values everywhere, so a misplaced
  block shows). Small slots split rows into pieces (256 B: 32 B per block
  with 8 ranks)."""
  P = hosts * local
  rank_of = list(range(P)) if order == "host-major" else \
      [j * hosts + g for g in range(hosts) for j in range(local)]
  xs = inputs(P, (outer, P, inner), np.int32, seed=P * 3 + inner)
  outs = hierarchical(hosts, local, xs, rank_of, outer=outer, slot=slot, swap=True)
  for x, o in enumerate(outs):
    r = rank_of[x]
    want = np.stack([xs[q][:, r, :] for q in range(P)], axis=1)
    np.testing.assert_array_equal(np.frombuffer(o, np.int32).reshape(outer, P, inner), want,
                                  err_msg=f"rank {r} (host {x // local}, rail {x % local})")


def test_hierarchical_all_to_all_many_calls_through_two_slots():
  """25 calls of 3 x 2 ranks whose tiles wrap the two network and staging slots many times."""
  xs = inputs(6, (3, 6, 130), np.float32, seed=5)
  outs = hierarchical(3, 2, xs, list(range(6)), outer=3, slot=512, calls=25, swap=True)
  for r, o in enumerate(outs):
    np.testing.assert_array_equal(np.frombuffer(o, np.float32).reshape(3, 6, 130),
                                  np.stack([xs[q][:, r, :] for q in range(6)], 1))


def test_rail_refused_by_a_provider_without_fi_hmem_says_why():
  """Debian's tcp;ofi_rxm cannot move registered device memory: opening a
  rail fails naming FI_HMEM (and the GPU backend then stages through host
  memory)."""
  why = ENGINE.rail_probe("tcp;ofi_rxm")
  if "cannot load libfabric" in why or "without libfabric" in why:
    pytest.skip(why)
  assert "FI_HMEM" in why and "tcp;ofi_rxm" in why, why


@pytest.mark.parametrize("hosts,local", [(2, 1), (2, 2), (3, 2), (2, 4), (4, 1)])
@pytest.mark.parametrize("order", ["host-major", "interleaved"])
@pytest.mark.parametrize("dtype,op", [(np.int32, "sum"), (np.float32, "max"), (np.float32, "sum"),
                                      (ml_dtypes.bfloat16, "sum")])
@pytest.mark.parametrize("outer,inner,slot", [(1, 1000, 1024), (5, 37, 512), (3, 64, 1 << 20)])
def test_hierarchical_reduce_scatter(hosts, local, order, dtype, op, outer, inner, slot):
  """Partials per host, then across hosts; ints and max exactly, float sums
  within rounding of the two-level order (16-bit floats round per level)."""
  P = hosts * local
  rank_of = list(range(P)) if order == "host-major" else \
      [j * hosts + g for g in range(hosts) for j in range(local)]
  xs = inputs(P, (outer, P, inner), dtype, seed=P * 5 + inner)
  outs = hierarchical(hosts, local, xs, rank_of, outer=outer, slot=slot, scatter=op)
  host_of_rank = {rank_of[g * local + j]: (g, j) for g in range(hosts) for j in range(local)}
  ranks_in_thread_order = [rank_of[g * local + j] for g in range(hosts) for j in range(local)]
  for x, o in enumerate(outs):
    r = ranks_in_thread_order[x]
    got = np.frombuffer(o, dtype).reshape(outer, inner)
    want = combine([xs[q][:, r, :] for q in range(P)], op, dtype)
    if np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16):
      np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=3e-2,
                                 atol=3e-2, err_msg=f"rank {r} {host_of_rank[r]}")
    elif op == "sum" and np.dtype(dtype).kind == "f":
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"rank {r}")
    else:
      np.testing.assert_array_equal(got, want, err_msg=f"rank {r}")


# --- where a call's time goes (xla_ffi/algorithms/phase_timer.h) ------------------------

def phase_probe(xs, outer, inner, slot, direct, calls=1):
  outs, phases = ENGINE.stream_phase_probe(SCATTER, DTYPES[np.dtype(np.float32)], OPS["sum"], outer,
                                           inner, 0, slot, [x.tobytes() for x in xs],
                                           outer * inner * 4, calls, direct)
  for r, o in enumerate(outs):
    got = np.frombuffer(o, np.float32).reshape(outer, inner)
    np.testing.assert_array_equal(got, combine([x[:, r, :] for x in xs], "sum", np.float32))
  return phases


@pytest.mark.parametrize("direct", [1, 0], ids=["direct", "staged"])
def test_reduce_scatter_time_is_charged_to_its_phases(direct):
  """Every StreamOps call of a reduce_scatter of 3 ranks, timed on host threads and charged
  to its phase. Direct reads, one call: 1 reduction; waits for the peers' posts and for
  their reads (2, each one batch for both peers); signals: its post and the peers'
  releases (2: the releases one batch). Staged through slots of
  3 KiB, 4 tiles (steps) of [3 ranks x 1 KiB]: per step a copy into the slot, a reduction, a
  post and 2 releases, 2 waits for posts, and from step 3 on (2 slots) 2 waits for the slot.
  The phases' time adds up to no more than the call's."""
  xs = inputs(3, (4, 3, 256), np.float32, seed=5)
  phases = phase_probe(xs, outer=4, inner=256, slot=3 * 1024, direct=direct)
  want = ({"copy": 0, "reduce": 1, "wait": 2, "signal": 2} if direct else
          {"copy": 4, "reduce": 4, "wait": 4 * 2 + 2 * 2, "signal": 4 * 3})
  for r, p in enumerate(phases):
    assert {k: p[k][0] for k in want} == want, (r, p)
    spent = sum(p[k][1] for k in want)
    assert p["reduce"][1] > 0 and 0 < spent <= p["total"] + 1e-6, (r, p)


def test_every_call_is_charged():
  """Five calls of a larger reduce_scatter of 2 ranks, direct reads: each call's reduction,
  waits and signals are counted (5 x 1, 5 x 2, 5 x 2), and the span from the first mark to
  the last holds the reductions' and the waits' time."""
  xs = inputs(2, (1, 2, 1 << 16), np.float32, seed=9)
  phases = phase_probe(xs, outer=1, inner=1 << 16, slot=1 << 20, direct=1, calls=5)
  for p in phases:
    assert (p["reduce"][0], p["wait"][0], p["signal"][0]) == (5, 10, 10), p
    assert p["reduce"][1] > 0 and p["total"] >= p["reduce"][1] + p["wait"][1]

"""One process of a GPU test job (tests/gpu/test_gpu.py): every process uses
GPU 0, joins jax.distributed, runs every collective through jax_smddp over a
1-D mesh of all processes' devices and checks its own shard against numpy
(XLA's NCCL cannot run several ranks on one GPU, so numpy is the reference).

    python tests/gpu/worker.py SCENARIO PROCESS NPROCS COORDINATOR DEVICES

Prints ``RESULT {"ok": ..., "checked": N, "counters": {...}}``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # several processes per GPU
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.1")


def cases(n: int):
  """(name, body, reference(X) -> per-rank rows, input columns, dtype)."""
  import numpy as np
  import jax_smddp

  def gather(x):
    return jax_smddp.all_gather(x[0], "x", tiled=True)[None]

  def gather_strided(x):  # gathered dimension in the middle: [4, n * k / 4]
    return jax_smddp.all_gather(x[0].reshape(4, -1), "x", axis=1, tiled=True).reshape(-1)[None]

  def scatter(x):
    return jax_smddp.psum_scatter(x[0], "x", tiled=True)[None]

  def reduce_sum(x):
    return jax_smddp.psum(x[0], "x")[None]

  def reduce_max(x):
    return jax_smddp.pmax(x[0], "x")[None]

  def exchange(x):
    return jax_smddp.all_to_all(x[0].reshape(n, -1), "x", 0, 0, tiled=True).reshape(-1)[None]

  def ref_gather(X):
    return [X.reshape(-1)] * n

  def ref_gather_strided(X):
    return [np.concatenate([X[q].reshape(4, -1) for q in range(n)], axis=1).reshape(-1)] * n

  def total(X, op):
    acc = X[0].astype(np.float32) if X.dtype.itemsize == 2 and X.dtype.kind != "i" else X[0]
    for q in range(1, n):
      b = X[q].astype(acc.dtype)
      acc = acc + b if op == "sum" else np.maximum(acc, b)
    return acc.astype(X.dtype)

  def ref_scatter(X):
    k = X.shape[1] // n
    s = total(X, "sum")
    return [s[r * k:(r + 1) * k] for r in range(n)]

  def ref_exchange(X):
    return [np.concatenate([X[q].reshape(n, -1)[r] for q in range(n)]) for r in range(n)]

  import ml_dtypes
  out = []
  for dtype in (np.float32, ml_dtypes.bfloat16, np.int32):
    for cols in (n * 4 * 8, n * 4 * 300_000):  # small, and larger than a default slot
      out += [
          ("all_gather", gather, ref_gather, cols, dtype),
          ("all_gather axis 1", gather_strided, ref_gather_strided, cols, dtype),
          ("psum_scatter", scatter, ref_scatter, cols, dtype),
          ("psum", reduce_sum, lambda X: [total(X, "sum")] * n, cols, dtype),
          ("pmax", reduce_max, lambda X: [total(X, "max")] * n, cols, dtype),
          ("all_to_all", exchange, ref_exchange, cols, dtype),
      ]
  return out


def main() -> None:
  scenario = sys.argv[1]
  process, nprocs, coordinator = int(sys.argv[-4]), int(sys.argv[-3]), sys.argv[-2]
  import numpy as np
  import jax
  jax.distributed.initialize(coordinator, nprocs, process, local_device_ids=[0])
  from jax.sharding import NamedSharding, PartitionSpec as P
  from jax_smddp import gpu
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("x",))
  sharding = NamedSharding(mesh, P("x"))
  import ml_dtypes
  if scenario == "dead_peer":
    dead_peer(process, nprocs, mesh, sharding)
    return
  if scenario == "mismatch":
    mismatch(process, nprocs, mesh)
    return
  checked = 0
  rng = np.random.default_rng(7)
  todo = cases(n)
  if scenario == "hosts":  # simulated hosts (JAX_SMDDP_HOST_ID): every op crosses them
    import jax_smddp
    jax_smddp.initialize()
  for name, body, ref, cols, dtype in todo:
    if np.issubdtype(np.dtype(dtype), np.integer):
      X = rng.integers(-1000, 1000, size=(n, cols)).astype(dtype)
    else:
      X = rng.standard_normal((n, cols)).astype(dtype)
    x = jax.make_array_from_callback(X.shape, sharding, lambda idx: X[idx])
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    want = ref(X)
    for repeat in range(3):  # slots and flags reused across calls
      y = f(x)
      for shard in y.addressable_shards:
        rank = shard.index[0].start or 0  # None where one device holds all
        got = np.asarray(shard.data)[0]
        what = f"{name} {np.dtype(dtype).name} {cols} rank {rank}"
        if np.dtype(dtype) == np.dtype(np.float32) and name in ("psum", "psum_scatter"):
          np.testing.assert_allclose(got, want[rank], rtol=1e-5, atol=1e-5, err_msg=what)
        elif scenario == "hosts" and name in ("psum", "psum_scatter") and \
            np.dtype(dtype).itemsize == 2:
          # Across hosts 16-bit floats round per level (host partials, then the
          # total): each rounding errs by at most half an ulp of what it rounds,
          # so the bound scales with the sum of magnitudes, not with the result.
          absum = np.abs(X.astype(np.float32)).sum(0)
          if name == "psum_scatter":
            k = absum.size // n
            absum = absum[rank * k:(rank + 1) * k]
          unit = 2.0 ** -8 if np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16) else 2.0 ** -11
          err = np.abs(got.astype(np.float32) - want[rank].astype(np.float32))
          bad = np.flatnonzero(err > 3 * unit * absum + 1e-6)
          assert bad.size == 0, f"{what}: {bad.size} elements off, first {bad[:5]}: " \
              f"{got[bad[:5]]} vs {want[rank][bad[:5]]}"
        else:
          np.testing.assert_array_equal(got, want[rank],
                                        err_msg=f"{name} {np.dtype(dtype).name} {cols} rank {rank}")
        checked += 1
  across = {str(list(k)): v for k, v in gpu.groups_across_hosts().items()}
  print("RESULT " + json.dumps({"ok": True, "checked": checked, "scenario": scenario,
                                "counters": gpu.counters(), "across_hosts": across,
                                "direct_staged_because": gpu.direct_reads_staged_because()}), flush=True)


def dead_peer(process: int, nprocs: int, mesh, sharding) -> None:
  """The last process dies after one good all_gather; the others keep calling
  it. The watchdog must release their streams and fail a call within seconds
  with an error naming the dead rank (flags in host memory)."""
  import time
  import numpy as np
  import jax
  import jax_smddp
  from jax.sharding import PartitionSpec as P
  n = jax.device_count()
  X = np.arange(n * 1024, dtype=np.float32).reshape(n, 1024)
  x = jax.make_array_from_callback(X.shape, sharding, lambda idx: X[idx])
  f = jax.jit(jax.shard_map(lambda v: jax_smddp.all_gather(v[0], "x", tiled=True)[None],
                            mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  for shard in f(x).addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data)[0], X.reshape(-1))
  if process == nprocs - 1:
    print("RESULT " + json.dumps({"ok": True, "died": True}), flush=True)
    os._exit(0)  # no goodbye: as if killed
  t0 = time.monotonic()
  calls = 0
  try:
    while time.monotonic() - t0 < 60:
      f(x).block_until_ready()
      calls += 1
    result = {"ok": False, "error": f"{calls} calls in 60 s after the peer died, no error"}
  except Exception as e:  # what the user sees
    message = str(e)
    elapsed = time.monotonic() - t0
    named = f"rank {nprocs - 1} (process {nprocs - 1}" in message and "is gone" in message
    result = {"ok": named and elapsed < 20, "elapsed": elapsed, "calls": calls,
              "error": message[-2000:]}
  print("RESULT " + json.dumps(result), flush=True)
  os._exit(0)  # jax.distributed's shutdown would wait for the dead process


def mismatch(process: int, nprocs: int, mesh) -> None:
  """Process 1 gathers twice as much as the others in its second call: the
  process that enqueues that call second must fail it naming both calls;
  then it exits, and the watchdog fails the others (flags in host memory)."""
  import time
  import numpy as np
  import jax
  import jax_smddp
  from jax.sharding import NamedSharding, PartitionSpec as P
  n = jax.device_count()
  f = jax.jit(jax.shard_map(lambda v: jax_smddp.all_gather(v[0], "x", tiled=True)[None],
                            mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  def call(cols):
    X = np.ones((n, cols), np.float32)
    x = jax.make_array_from_callback(X.shape, NamedSharding(mesh, P("x")), lambda idx: X[idx])
    return f(x).block_until_ready()
  call(256)
  t0 = time.monotonic()
  try:
    call(512 if process == 1 else 256)
    for _ in range(1000):
      call(256)
      if time.monotonic() - t0 > 60:
        break
    result = {"ok": False, "error": "no error after the calls disagreed"}
  except Exception as e:
    message = str(e)
    result = {"ok": "disagree on call #1" in message or "is gone" in message,
              "disagree": "disagree on call #1" in message, "elapsed": time.monotonic() - t0,
              "error": message[-2000:]}
  print("RESULT " + json.dumps(result), flush=True)
  os._exit(0)


if __name__ == "__main__":
  import faulthandler
  faulthandler.enable()  # a crash shows its Python stack in the test's output
  if os.environ.get("JAX_SMDDP_WORKER_STACKS_AFTER_S"):  # a hang shows where every thread waits
    faulthandler.dump_traceback_later(float(os.environ["JAX_SMDDP_WORKER_STACKS_AFTER_S"]), exit=False)
  try:
    main()
  except Exception:  # reported to the launcher, which fails the test with it
    print("RESULT " + json.dumps({"ok": False, "error": traceback.format_exc()[-3000:]}),
          flush=True)
    sys.exit(1)

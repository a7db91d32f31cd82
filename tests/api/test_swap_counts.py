"""A one-process job counts its jax_smddp calls (traffic_by_op) as a multi-process job does:
no world, yet every device's call of a swapped shard_map program is counted with the bytes
it delivered (the main example's table: test_examples.check_summary)."""

import numpy as np
import pytest

import jax
from jax.sharding import PartitionSpec as P

import jax_smddp as smddp
from jax_smddp import distributed
from helpers import mesh_1d, shard


def _delta(before, after):
  return {op: {k: after[op][k] - before.get(op, {}).get(k, 0) for k in ("calls", "bytes")}
          for op in after if after[op] != before.get(op)}


@pytest.mark.timeout(120)
def test_one_process_counts_what_the_program_ran():
  assert jax.process_count() == 1 and not distributed.is_initialized()
  mesh = mesh_1d()
  n = mesh.size

  def body(x, y):
    s = jax.lax.psum(x, "x")                                  # all_reduce: 4x16 f32 out
    g = jax.lax.all_gather(y, "x", axis=0, tiled=True)        # all_gather: 8*2x3 i32 out
    r = jax.lax.psum_scatter(x, "x", scatter_dimension=1, tiled=True)  # 4x2 f32 out
    return s, g, r

  x = np.arange(n * 4 * 16, dtype=np.float32).reshape(n * 4, 16)
  y = np.arange(n * 2 * 3, dtype=np.int32).reshape(n * 2, 3)
  with smddp.use("all"):
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")),
                              out_specs=(P("x"), P("x"), P("x"))))
    args = shard(x, mesh, P("x")), shard(y, mesh, P("x"))
    jax.block_until_ready(f(*args))  # compiled, and counted once
    runs = 3
    before = distributed.traffic_by_op()
    for _ in range(runs):
      out = jax.block_until_ready(f(*args))
    after = distributed.traffic_by_op()
  # Independent reference: what each device's call delivers, from the shapes alone.
  per_run = {"smddp_all_reduce": 4 * 16 * 4, "smddp_all_gather": n * 2 * 3 * 4,
             "smddp_reduce_scatter": 4 * (16 // n) * 4}
  want = {op: {"calls": runs * n, "bytes": runs * n * b} for op, b in per_run.items()}
  assert _delta(before, after) == want
  np.testing.assert_array_equal(np.asarray(out[1])[: n * 2], y)  # it did run them


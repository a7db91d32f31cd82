"""jax_smddp's functions against the installed jax's jax.lax: the same parameters with the
same defaults, and the same answers (exact on integers) on 8 CPU devices, axis_index_groups
(two groups of four, in order and shuffled) included, each compiled program calling
jax_smddp's custom call instead of XLA's collective; ppermute (ring and partial permutations)
likewise, to the engine's collective_permute."""

from __future__ import annotations

import inspect
import re

import numpy as np
import pytest

import jax
from jax.sharding import PartitionSpec as P

import jax_smddp as smddp
from helpers import mesh_1d, shard

NAMES = ("all_gather", "psum_scatter", "psum", "pmax", "pmin", "pmean", "all_to_all", "ppermute")
GROUPS = {"none": None, "halves": [[0, 1, 2, 3], [4, 5, 6, 7]],
          "shuffled": [[6, 0, 4, 2], [1, 7, 3, 5]]}
# Each call, with jax.lax's keyword arguments; the custom call it must compile to.
CALLS = {
    "all_gather": (lambda m, x, g: m.all_gather(x, "x", axis_index_groups=g), "smddp_all_gather"),
    "all_gather_tiled": (lambda m, x, g: m.all_gather(x, "x", axis_index_groups=g, axis=1,
                                                      tiled=True), "smddp_all_gather"),
    "psum_scatter": (lambda m, x, g: m.psum_scatter(x, "x", scatter_dimension=0,
                                                    axis_index_groups=g, tiled=True),
                     "smddp_reduce_scatter"),
    "psum": (lambda m, x, g: m.psum(x, "x", axis_index_groups=g), "smddp_all_reduce"),
    "pmax": (lambda m, x, g: m.pmax(x, "x", axis_index_groups=g), "smddp_all_reduce"),
    "pmin": (lambda m, x, g: m.pmin(x, "x", axis_index_groups=g), "smddp_all_reduce"),
    "pmean": (lambda m, x, g: m.pmean(x, "x", axis_index_groups=g), "smddp_all_reduce"),
    "all_to_all": (lambda m, x, g: m.all_to_all(x, "x", 0, 1, axis_index_groups=g, tiled=True),
                   "smddp_all_to_all"),
}
XLA_OPS = {"smddp_all_gather": "all-gather", "smddp_reduce_scatter": "reduce-scatter",
           "smddp_all_reduce": "all-reduce", "smddp_all_to_all": "all-to-all",
           "smddp_collective_permute": "collective-permute"}


def _params(fn) -> list[tuple]:
  return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", NAMES)
def test_signature_is_jax_laxs(name):
  """Parameter names, kinds and defaults as the installed jax.lax has them."""
  assert _params(getattr(smddp, name)) == _params(getattr(jax.lax, name))


def _data(dtype):
  # Every element distinct, so that a block from the wrong rank or a wrong group shows.
  x = (np.arange(8 * 8 * 6) * 7 % 389 - 190).reshape(8 * 8, 6)
  return x.astype(dtype)


def _run(module, call, x, groups):
  mesh = mesh_1d()
  f = jax.jit(jax.shard_map(lambda b: call(module, b, groups), mesh=mesh, in_specs=P("x"),
                            out_specs=P("x"), check_vma=False))
  xs = shard(x, mesh, P("x"))
  return np.asarray(f(xs)), f.lower(xs).compile().as_text()


@pytest.mark.parametrize("groups", list(GROUPS))
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
@pytest.mark.parametrize("name", list(CALLS))
def test_answers_are_jax_laxs_on_the_engine(name, dtype, groups):
  call, target = CALLS[name]
  x = _data(dtype)
  want, lax_text = _run(jax.lax, call, x, GROUPS[groups])
  got, text = _run(smddp, call, x, GROUPS[groups])
  assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape)
  if np.issubdtype(want.dtype, np.floating):
    np.testing.assert_allclose(got, want, rtol=1e-6)
  else:
    np.testing.assert_array_equal(got, want)
  assert re.search(rf'custom_call_target="{target}"', text), text[-3000:]
  xla_op = XLA_OPS[target]
  assert not re.search(rf" {xla_op}(-start)?\(", text), text[-3000:]
  assert re.search(rf" {xla_op}(-start)?\(", lax_text), "the reference must be XLA's"


def test_groups_reach_the_engine_as_lax_forms_them():
  """A planted mismatch would hide in sums that happen to agree: check one group's
  gather by hand (shuffled groups: each gathers its members in the group's order)."""
  x = _data(np.int32)
  got, _ = _run(smddp, CALLS["all_gather"][0], x, GROUPS["shuffled"])
  blocks = x.reshape(8, 8, 6)
  per_device = got.reshape(8, 4, 8, 6)  # device, member, block rows, columns
  for group in GROUPS["shuffled"]:
    for d in group:
      np.testing.assert_array_equal(per_device[d], blocks[group])


@pytest.mark.parametrize("perm", [[(i, (i + 1) % 8) for i in range(8)], [(0, 3), (5, 1)]],
                         ids=["ring", "partial"])
def test_ppermute_is_jax_laxs_on_the_engine(perm):
  call = lambda m, b, g: m.ppermute(b, "x", perm)
  x = _data(np.int32)
  want, lax_text = _run(jax.lax, call, x, None)
  got, text = _run(smddp, call, x, None)
  np.testing.assert_array_equal(got, want)
  assert 'custom_call_target="smddp_collective_permute"' in text, text[-3000:]
  assert not re.search(r" collective-permute(-start)?\(", text), text[-3000:]
  assert re.search(r" collective-permute(-start)?\(", lax_text), "the reference must be XLA's"
  blocks = x.reshape(8, 8, 6)
  expect = np.zeros_like(blocks)
  for src, dst in perm:
    expect[dst] = blocks[src]
  np.testing.assert_array_equal(got.reshape(8, 8, 6), expect)


def test_all_gather_to_as_jax_lax_means_it():
  """to="varying" (default), "invarying" and "reduced" are jax.lax's values; another is a
  ValueError, and groups with a typed result are refused, as jax.lax refuses them."""
  with pytest.raises(ValueError, match="to='bogus'"):
    smddp.all_gather(np.zeros(2), "x", to="bogus")
  mesh = mesh_1d()
  x = _data(np.float32)
  f = lambda m: jax.jit(jax.shard_map(lambda b: m.all_gather(b, "x", tiled=True, to="invarying"),
                                      mesh=mesh, in_specs=P("x"), out_specs=P()))
  xs = shard(x, mesh, P("x"))
  np.testing.assert_array_equal(np.asarray(f(smddp)(xs)), np.asarray(f(jax.lax)(xs)))
  assert "smddp_all_gather" in f(smddp).lower(xs).as_text()
  with pytest.raises(NotImplementedError):
    jax.jit(jax.shard_map(lambda b: smddp.all_gather(b, "x", axis_index_groups=GROUPS["halves"],
                                                     to="invarying"),
                          mesh=mesh, in_specs=P("x"), out_specs=P()))(xs)

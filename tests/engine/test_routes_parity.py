"""The cost model's routes (cost_model._Routes, which it counts traffic along)
are the engine's (ComputeRoutes in xla_ffi/algorithms/routes.cc): every
field, for every process of every layout below, flat and hierarchical."""

from __future__ import annotations

import itertools

import pytest

from jax_smddp import cost_model
from helpers import engine_probes, ran_in_first_suite

ran_in_first_suite("the engine's C++, through its probes")

LAYOUTS = [cost_model.Layout(h, p, d) for h, p, d in itertools.product((1, 2, 3), (1, 2, 4), (1, 2))
           if h * p > 1]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.spec)
@pytest.mark.parametrize("hierarchical", [True, False])
def test_cost_model_routes_are_the_engines(layout, hierarchical):
  engine = engine_probes()
  model = cost_model._Routes(layout, hierarchical)
  process_of_rank = [model.proc(s) for s in range(model.n)]
  hosts = [f"host{model.host(q)}" for q in range(model.Pt)]
  for p in range(model.Pt):
    r = engine.routes(process_of_rank, p, hosts, hierarchical)
    where = f"process {p} of {layout.spec}, hierarchical={hierarchical}"
    assert r["hierarchical"] == model.hier, where
    assert sorted(r["gather_targets"]) == sorted(model.gather_targets(p)), where
    for s in range(model.n):
      assert r["gather_source"][s] == model.gather_source(p, s), (where, "rank", s)
      assert sorted(r["gather_relay"][s]) == sorted(model.gather_relay(p, s)), (where, "rank", s)
      assert sorted(r["reduce_sources"][s]) == sorted(model.reduce_sources(p, s)), (where, "rank", s)
      assert r["reduce_dest"][s] == model.reduce_dest(p, s), (where, "rank", s)


@pytest.mark.parametrize("layout", [cost_model.Layout(h, p, d)
                                    for h, p, d in itertools.product((2, 3, 4, 5), (1, 2), (1, 2))],
                         ids=lambda l: l.spec)
@pytest.mark.parametrize("hierarchical", [True, False])
def test_staggered_rounds_pair_every_host_once(layout, hierarchical):
  """Staggered rounds (JAX_SMDDP_STAGGER_CHUNK_BYTES): with more than 2 hosts and
  one peer per other host, a process sends in round k to host h+k and receives
  from host h-k, its round-k target receives from it in the same round, and
  every other host comes once; otherwise (2 hosts, several peers on a host, or
  rounds off) there are none."""
  engine = engine_probes()
  model = cost_model._Routes(layout, hierarchical)
  H = layout.hosts
  process_of_rank = [model.proc(s) for s in range(model.n)]
  hosts = [f"host{model.host(q)}" for q in range(model.Pt)]
  routes = [engine.routes(process_of_rank, p, hosts, hierarchical, True) for p in range(model.Pt)]
  for p in range(model.Pt):
    assert engine.routes(process_of_rank, p, hosts, hierarchical, False)["stagger_to"] == []
    r, h = routes[p], model.host(p)
    across = [q for q in model.gather_targets(p) if model.host(q) != h]
    one_each = len(across) == H - 1 == len({model.host(q) for q in across})
    where = f"process {p} of {layout.spec}, hierarchical={hierarchical}"
    if H <= 2 or not one_each:
      assert r["stagger_to"] == r["stagger_from"] == [], where
      continue
    assert [model.host(q) for q in r["stagger_to"]] == [(h + k) % H for k in range(1, H)], where
    assert [model.host(q) for q in r["stagger_from"]] == [(h - k) % H for k in range(1, H)], where
    assert sorted(r["stagger_to"]) == sorted(across), where
    for k, q in enumerate(r["stagger_to"]):
      assert routes[q]["stagger_from"][k] == p, (where, "round", k + 1)

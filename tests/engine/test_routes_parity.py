"""The cost model's routes (cost_model._Routes, which it counts traffic along)
are the engine's (ComputeRoutes in xla_ffi/algorithms/routes.cc): every
field, for every process of every layout below, flat and hierarchical."""

from __future__ import annotations

import itertools

import pytest

from jax_smddp import cost_model
from helpers import engine_probes

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

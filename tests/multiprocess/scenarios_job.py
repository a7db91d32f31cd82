"""worker.py's scenarios of the job around the collectives: re-initialising, the tuner's
inputs, agreed settings, requirements, the doctor and the engine's CPU helpers."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import jax
from jax.sharding import Mesh, PartitionSpec as P
import jax_smddp as smddp
from jax_smddp import _native

from harness import (check, gather_reference, global_array, psum_over_every_device, psum_reference,
    result, smap, values)

def scenario_reinitialize():
  """initialize() is idempotent; after shutdown() and initialize() the same
  compiled programs run again over the new links."""
  f, xs, want = psum_over_every_device()
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
    check(f"all_gather cols={cols}", y, gather_reference(x, mesh, "x", "x"))
    y = smap(mesh, lambda v: smddp.psum(v, "x"), P("x"), P("x"))(global_array(mesh, P("x"), x))
    check(f"psum cols={cols}", y, psum_reference(x, mesh, "x", "x"))
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
  check("psum", y, psum_reference(x, mesh, "x", "x"))
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


def scenario_cpu_helpers():
  """What the engine's helpers' default (JAX_SMDDP_CPU_HELPERS unset) sees once jax_smddp has
  started this job's world: the job's processes on this host and the helpers of each."""
  import _smddp_testing as probes
  os.environ.pop("JAX_SMDDP_CPU_HELPERS", None)
  smddp.initialize()
  probes.use_world_of(_native.engine().world_source())
  result(ok=True, local_processes=probes.local_processes(), helpers=probes.cpu_helpers(),
         cores=probes.cores_available())

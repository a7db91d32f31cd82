"""jax_smddp.doctor and JAX_SMDDP_REQUIRE: what the installation can do here,
requirements that fail the doctor and a job's first collective, fallbacks
logged at WARNING level."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_smddp
from jax_smddp import capabilities, requirements
from jax_smddp.swap import xla as xla_swap
from jax_smddp.tools import launch

WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "multiprocess", "worker.py")
IN_CI = os.environ.get("CI") == "true"


def doctor(tmp_path, *args, env=None):
  full = {k: v for k, v in os.environ.items() if not k.startswith("JAX_SMDDP_")}
  full.update(env or {})
  # Run outside the source tree, so the installed package (with its extension) loads.
  return subprocess.run([sys.executable, "-m", "jax_smddp.doctor", *args], cwd=tmp_path,
                        env=full, capture_output=True, text=True, timeout=120)


def rows(run) -> dict:
  return {r["component"].strip(): r for r in json.loads(run.stdout)["rows"]}


def libfabric_with_tcp() -> bool:
  f = capabilities.fabric()
  return f["loaded"] and "tcp;ofi_rxm" in f["providers"]


needs_tcp = pytest.mark.skipif(not libfabric_with_tcp() and not IN_CI,
                               reason="libfabric with its tcp provider is not installed")


@pytest.mark.timeout(150)
def test_doctor_reports_the_xla_level_swap(tmp_path):
  """Off by default; on with JAX_SMDDP_COLLECTIVES=xla (jax_smddp.pth points the trampoline
  at the library); a FAIL naming the variable when the trampoline was pointed elsewhere."""
  off = rows(doctor(tmp_path, "--json"))["XLA collectives"]
  assert off["status"] == "info" and "gloo" in off["detail"], off
  on = doctor(tmp_path, "--json", env={"JAX_SMDDP_COLLECTIVES": "xla"})
  assert on.returncode == 0, on.stdout + on.stderr
  assert rows(on)["XLA collectives"]["status"] == "ok", rows(on)["XLA collectives"]
  assert "libsmddp_mpi.so" in rows(on)["XLA collectives"]["detail"]
  # Another MPI wrapper (a copy of jax_smddp's: MPItrampoline exits on a library it cannot load).
  elsewhere = os.path.join(str(tmp_path), "libmpiwrapper.so")
  shutil.copy(xla_swap.library_path(), elsewhere)
  bad = doctor(tmp_path, "--json", env={"JAX_SMDDP_COLLECTIVES": "xla", "MPITRAMPOLINE_LIB": elsewhere})
  assert bad.returncode != 0
  row = rows(bad)["XLA collectives"]
  assert row["status"] == "FAIL" and "MPITRAMPOLINE_LIB" in row["detail"], row


@pytest.mark.timeout(150)
def test_doctor_reports_the_gpu_swap(tmp_path):
  """The NCCL API front end's row (jax_smddp.swap.nccl): NCCL without the switch; with it,
  whether the front end is loaded in this process and why not (a machine without a JAX CUDA
  plugin, JAX_PLATFORMS without CUDA), never a failure of a machine it does not apply to.
  tests/build/test_nccl_swap.py checks the row where it is loaded (a stand-in CUDA plugin)."""
  from jax_smddp import _startup
  off = rows(doctor(tmp_path, "--json"))["XLA GPU collectives"]
  assert off["status"] == "info" and "run on NCCL" in off["detail"], off
  assert "JAX_SMDDP_COLLECTIVES=xla" in off["detail"], off
  cpu = doctor(tmp_path, "--json", env={"JAX_SMDDP_COLLECTIVES": "xla", "JAX_PLATFORMS": "cpu"})
  assert cpu.returncode == 0, cpu.stdout + cpu.stderr
  row = rows(cpu)["XLA GPU collectives"]
  assert row["status"] == "info" and "JAX_PLATFORMS=cpu excludes CUDA" in row["detail"], row
  if not _startup.cuda_plugins():
    on = doctor(tmp_path, "--json", env={"JAX_SMDDP_COLLECTIVES": "xla"})
    assert on.returncode == 0, on.stdout + on.stderr
    row = rows(on)["XLA GPU collectives"]
    assert row["status"] == "info" and "no JAX CUDA plugin is installed" in row["detail"], row
  table = doctor(tmp_path, env={"JAX_SMDDP_COLLECTIVES": "xla", "JAX_PLATFORMS": "cpu"})
  assert "XLA GPU collectives" in table.stdout, table.stdout


@pytest.mark.timeout(150)
@needs_tcp
def test_doctor_exits_0_and_reports_libfabric_with_tcp(tmp_path):
  run = doctor(tmp_path, "--json")
  assert run.returncode == 0, run.stdout + run.stderr
  r = rows(run)
  assert r["libfabric"]["status"] == "ok", r["libfabric"]
  assert "tcp;ofi_rxm" in r["providers"]["detail"].split(", "), r["providers"]
  # Without efa, the efa row names the provider an unset JAX_SMDDP_FABRIC_PROVIDER picks.
  default = capabilities.fabric()["default_provider"]
  assert default in r["providers"]["detail"].split(", "), (default, r["providers"])
  if default != "efa":
    assert f"between hosts jax_smddp uses {default} " in r["efa"]["detail"], r["efa"]
  # libfabric's own variables that jax_smddp gives a default, with whose value is in effect.
  prefetch = r["FI_NET_PREFETCH_RBUF_SIZE"]["detail"]
  if "FI_NET_PREFETCH_RBUF_SIZE" in os.environ:
    assert prefetch == f"{os.environ['FI_NET_PREFETCH_RBUF_SIZE']} (set in the environment)"
  else:
    assert prefetch == "0 (jax_smddp's default)", prefetch
  assert r["extension"]["status"] == "ok"
  assert jax.__version__ in r["jax"]["detail"]
  table = doctor(tmp_path)
  assert table.returncode == 0 and "usable here" in table.stdout, table.stdout


@pytest.mark.timeout(150)
@needs_tcp
def test_doctor_with_an_unmet_requirement_exits_non_zero_naming_it(tmp_path):
  if "efa" in capabilities.fabric()["providers"]:
    pytest.skip("this machine has EFA")
  run = doctor(tmp_path, "--json", env={"JAX_SMDDP_REQUIRE": "efa"})
  assert run.returncode == 1, run.stdout + run.stderr
  r = rows(run)
  assert r["require efa"]["status"] == "FAIL"
  assert "no efa provider" in r["require efa"]["detail"], r["require efa"]
  # Met requirements pass; names are checked strictly.
  assert doctor(tmp_path, env={"JAX_SMDDP_REQUIRE": "libfabric"}).returncode == 0
  bad = doctor(tmp_path, env={"JAX_SMDDP_REQUIRE": "libfabric,efaa"})
  assert bad.returncode == 1, bad.stdout + bad.stderr
  assert "JAX_SMDDP_REQUIRE='libfabric,efaa' is not valid: it takes a comma list of" in bad.stdout


def test_requirements_are_the_registry_choices():
  spec = next(s for s in jax_smddp.config.specs() if s["name"] == requirements.ENV)
  assert spec["choices"].split("|") == list(requirements.REQUIREMENTS)


@pytest.mark.timeout(300)
@needs_tcp
def test_job_with_an_unmet_requirement_fails_at_its_first_collective(monkeypatch):
  if "efa" in capabilities.fabric()["providers"]:
    pytest.skip("this machine has EFA")
  procs = launch.run_job(["require"], 2, 1, script=WORKER, timeout=240,
                         env={"JAX_SMDDP_REQUIRE": "efa"})
  monkeypatch.setenv(requirements.ENV, "efa")
  expected = requirements.describe(requirements.unmet())  # what the doctor says
  for p in procs:
    assert p.result and p.result["ok"], launch.describe(procs)
    assert p.result["error"] == expected, (p.result["error"], expected)


@pytest.mark.timeout(300)
def test_doctor_in_a_job_shows_the_topology():
  procs = launch.run_job(["doctor"], 2, 2, script=WORKER, timeout=240)
  for p in procs:
    assert p.result and p.result["ok"], launch.describe(procs)
    found = {c.strip(): d for c, _, d in p.result["rows"]}
    assert found["job"].startswith(f"process {p.index} of 2, 1 host(s), 4 devices"), found["job"]
    assert found["links"] == f"process {p.index} -> {1 - p.index}: shared memory", found["links"]


def _gather_complex(x):
  mesh = jax.make_mesh((8,), ("x",))
  f = jax.jit(jax.shard_map(lambda v: jax_smddp.all_gather(v, "x", tiled=True), mesh=mesh,
                            in_specs=P("x"), out_specs=P(), check_vma=False))
  return f(jax.device_put(x, NamedSharding(mesh, P("x"))))


@pytest.mark.timeout(120)
def test_fallback_is_logged_once_at_warning_level(caplog, monkeypatch):
  monkeypatch.delenv(requirements.ENV, raising=False)
  requirements._warned.clear()
  x = (jnp.arange(16) + 1j * jnp.arange(16)).astype(jnp.complex64)
  with caplog.at_level(logging.WARNING, logger="jax_smddp"):
    y = _gather_complex(x)
    _gather_complex(x * 2)  # the same reason again: not logged again
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
  warnings = [r for r in caplog.records if "lowers through jax.lax" in r.getMessage()]
  assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING, caplog.text
  assert "complex64" in warnings[0].getMessage()


@pytest.mark.timeout(120)
def test_no_fallback_requirement_turns_a_fallback_into_an_error(monkeypatch):
  monkeypatch.setenv(requirements.ENV, "no-fallback")
  x = (jnp.arange(16) + 1j * jnp.arange(16)).astype(jnp.complex128)
  with pytest.raises(requirements.RequirementError, match="complex128.*no-fallback"):
    _gather_complex(x)
  # A call the engine takes still runs.
  y = _gather_complex(jnp.arange(16, dtype=jnp.float32) * 3)
  np.testing.assert_array_equal(np.asarray(y), np.arange(16) * 3)

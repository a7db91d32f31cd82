"""The build as a user meets it: libfabric found where it lives (a prefix laid
out like AWS's /opt/amazon/efa), headers installed after a first build picked
up by the next one in the same build directory, and an sdist whose wheel installs
into a fresh virtual environment and runs a two-process collective, and runs from
the repository's root too (where the checkout's sources come first on sys.path)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import jax
import jaxlib.version

from jax_smddp import capabilities
from jax_smddp.tools import launch

from helpers import ran_in_first_suite

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IN_CI = os.environ.get("CI") == "true"


def _tool(name):
  here = os.path.join(os.path.dirname(sys.executable), name)
  return here if os.path.exists(here) else shutil.which(name)


def _system_libfabric():
  """(headers directory, libfabric.so.1) of the libfabric this install was built with."""
  f = capabilities.fabric()
  if not (f["built"] and f["loaded"] and os.path.exists(os.path.join(f["include_dir"], "rdma"))):
    return None
  return f["include_dir"], f["path"]


def _configure_and_build(build_dir, env):
  cmake = _tool("cmake")
  configure = subprocess.run(
      [cmake, "-S", REPO, "-B", str(build_dir), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={_tool('ninja')}",
       f"-DPython_EXECUTABLE={sys.executable}", "-DJAX_SMDDP_CUDA=OFF"],
      env=env, capture_output=True, text=True, timeout=300)
  assert configure.returncode == 0, configure.stdout[-3000:] + configure.stderr[-3000:]
  build = subprocess.run([cmake, "--build", str(build_dir), "--target", "_smddp_cpu"],
                         env=env, capture_output=True, text=True, timeout=900)
  assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
  return configure.stdout, build.stdout


def _module_fabric_info(build_dir):
  probe = ("import json, sys; sys.path.insert(0, sys.argv[1]); import _smddp_cpu; "
           "print(json.dumps(_smddp_cpu.fabric_info()))")
  run = subprocess.run([sys.executable, "-c", probe, str(build_dir)], capture_output=True,
                       text=True, timeout=120, cwd=build_dir)
  assert run.returncode == 0, run.stderr
  return json.loads(run.stdout)


@pytest.mark.compiles
@pytest.mark.timeout(1200)
def test_libfabric_under_a_non_default_prefix_and_installed_after_a_first_build(tmp_path):
  ran_in_first_suite("CMake's libfabric discovery")
  found = _system_libfabric()
  if found is None:
    assert not IN_CI, "CI must have libfabric-dev (scripts/system_packages.sh installs it)"
    pytest.skip("libfabric's headers are not installed here")
  include, library = found
  if not _tool("cmake") or not _tool("ninja"):
    pytest.skip("cmake and ninja come with the test environment (scripts/setup_env.sh)")
  prefix = tmp_path / "efa"  # laid out like /opt/amazon/efa: include/, lib/
  (prefix / "include").mkdir(parents=True)
  (prefix / "lib").mkdir()
  env = dict(os.environ, JAX_SMDDP_LIBFABRIC_ROOT=str(prefix))
  env.pop("LIBFABRIC_ROOT", None)
  build_dir = tmp_path / "build"

  # First build: the prefix is still empty, so libfabric is left out, and says so.
  configured, _ = _configure_and_build(build_dir, env)
  assert f"libfabric  NOT FOUND (searched the root {prefix})" in configured, configured
  info = _module_fabric_info(build_dir)
  assert not info["built"] and "built without libfabric headers" in info["error"], info

  # The headers and the library arrive; the same build directory rebuilds with them.
  shutil.copytree(os.path.join(include, "rdma"), prefix / "include" / "rdma")
  shutil.copy(library, prefix / "lib" / "libfabric.so.1")
  configured, built = _configure_and_build(build_dir, env)
  assert f"libfabric  headers in {prefix}/include, found by the root {prefix}" in configured, configured
  assert "fabric_link.cc" in built, built  # recompiled, not reused
  info = _module_fabric_info(build_dir)
  assert info["built"] and info["include_dir"] == f"{prefix}/include", info
  assert info["library_dir"] == f"{prefix}/lib", info
  assert info["loaded"] and "tcp;ofi_rxm" in info["providers"], info


TWO_PROCESS_JOB = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import numpy as np, jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    pid, n, coordinator = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(coordinator, n, pid)
    import jax_smddp
    mesh = jax.make_mesh((4,), ("x",))
    x = np.arange(4 * 3 * 5, dtype=np.float32).reshape(12, 5)
    xs = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("x")), lambda i: x[i])
    f = jax.jit(jax.shard_map(lambda v: jax_smddp.psum(v * v, "x"), mesh=mesh,
                              in_specs=P("x"), out_specs=P("x"), check_vma=False))
    want = sum((x * x)[3 * r:3 * r + 3] for r in range(4))
    for shard in f(xs).addressable_shards:
      assert np.array_equal(np.asarray(shard.data), want), shard.index
    assert jax_smddp.traffic()[1 - pid]["sent"] > 0, jax_smddp.traffic()
    print("RESULT {\\"ok\\": true, \\"file\\": \\"" + jax_smddp.__file__ + "\\"}", flush=True)
    jax_smddp.shutdown()
    jax.distributed.shutdown()
    """)


@pytest.fixture(scope="module")
def installed_venv(tmp_path_factory):
  """The sdist (as PyPI would get it), a wheel built from it alone (CPU only, to bound the
  time: the CUDA parts compile in the suite's own build), then a new virtual environment with
  only jax and the wheel (not editable): its folder. Built once for this module's tests."""
  # The second suite's own environment is a build from this source for its Python too.
  ran_in_first_suite("the sdist and a wheel built from it")
  tmp_path = tmp_path_factory.mktemp("sdist")
  dist = tmp_path / "dist"
  sdist = subprocess.run(
      [sys.executable, "-c", "import sys, scikit_build_core.build as b; print(b.build_sdist(sys.argv[1]))",
       str(dist)], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert sdist.returncode == 0, sdist.stdout[-3000:] + sdist.stderr[-3000:]
  (archive,) = glob.glob(str(dist / "jax_smddp-*.tar.gz"))
  shutil.unpack_archive(archive, tmp_path / "src")
  (source,) = glob.glob(str(tmp_path / "src" / "jax_smddp-*"))
  for needed in ("LICENSE", "CHANGELOG.md", "CMakeLists.txt", "pyproject.toml"):
    assert os.path.exists(os.path.join(source, needed)), needed
  wheel = subprocess.run(
      [sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
       "--config-settings=cmake.define.JAX_SMDDP_CUDA=OFF", "-w", str(dist), source],
      capture_output=True, text=True, timeout=1200)
  assert wheel.returncode == 0, wheel.stdout[-3000:] + wheel.stderr[-3000:]
  (built,) = glob.glob(str(dist / "jax_smddp-*.whl"))
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
  python = str(venv / "bin" / "python")
  install = subprocess.run(
      [python, "-m", "pip", "install", "-q", "--disable-pip-version-check",
       f"jax=={jax.__version__}", f"jaxlib=={jaxlib.version.__version__}", built],
      capture_output=True, text=True, timeout=900)
  assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
  return venv


@pytest.mark.compiles
@pytest.mark.timeout(1500)
def test_sdist_builds_a_wheel_that_installs_into_a_fresh_venv_and_runs_two_processes(installed_venv,
                                                                                     tmp_path):
  venv = installed_venv
  python = str(venv / "bin" / "python")
  script = tmp_path / "job.py"
  script.write_text(TWO_PROCESS_JOB)
  procs = launch.run_job([], 2, 2, script=str(script), timeout=300, python=python)
  for p in procs:
    assert p.result and p.result["ok"], launch.describe(procs)
    assert p.result["file"].startswith(str(venv)), p.result  # the wheel's, not the source's


ONE_PROCESS_PSUM = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import numpy as np, jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jax_smddp
    from jax_smddp import _native
    mesh = jax.make_mesh((2,), ("x",))
    x = np.arange(2 * 3, dtype=np.float32).reshape(2, 3)
    f = jax.jit(jax.shard_map(lambda v: jax_smddp.psum(v, "x"), mesh=mesh, in_specs=P("x"),
                              out_specs=P(), check_vma=False))
    got = np.asarray(f(jax.device_put(x, NamedSharding(mesh, P("x")))))
    assert np.array_equal(got, x.sum(0, keepdims=True)), got
    print(jax_smddp.__file__, _native.engine().__file__, jax_smddp.__version__)
    """)


@pytest.mark.compiles
@pytest.mark.timeout(1500)  # the fixture's build when this test runs alone
def test_the_installed_package_runs_from_the_repository_root(installed_venv):
  """From the root python -m and -c import the checkout's jax_smddp/ first (the current
  directory leads sys.path); it has no native extension, and hands over to the install."""
  python = str(installed_venv / "bin" / "python")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("JAX_SMDDP_")}
  env.pop("PYTHONSAFEPATH", None)

  def run(*args, **extra):
    done = subprocess.run([python, *args], cwd=REPO, env=dict(env, **extra), capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout

  package, engine, version = run("-c", ONE_PROCESS_PSUM).split()
  assert package.startswith(str(installed_venv)) and engine.startswith(str(installed_venv)), package
  assert version == capabilities.version(), version
  assert f"jax_smddp {version}" in run("-m", "jax_smddp.doctor")
  assert "usage:" in run("-m", "jax_smddp.tools.bench", "--help")
  # The start-up hook (jax_smddp.pth, run before the current directory joins sys.path).
  trampoline = run("-c", "import os; print(os.environ['MPITRAMPOLINE_LIB'])", JAX_SMDDP_COLLECTIVES="xla")
  assert trampoline.strip().startswith(str(installed_venv)), trampoline

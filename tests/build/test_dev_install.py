"""The development install (scripts/setup_env.sh: pip install -e, scikit-build-core's
redirect mode): from the checkout's root, where the source folder jax_smddp/ is
the first thing Python sees, and from anywhere else, the package loads with its
native modules, and the README's commands run; a checkout that is not built says
exactly what to run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import helpers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = """
import os, jax_smddp
from jax_smddp import _native
from jax_smddp.swap import xla as xla_swap
print(os.environ.get("MPITRAMPOLINE_LIB"))
print(os.path.realpath(jax_smddp.__file__))
print(os.path.realpath(_native.engine().__file__))
print(os.path.realpath(xla_swap.library_path()))
"""


@pytest.fixture(autouse=True)
def editable():
  why = helpers.not_editable()
  if why:
    assert os.environ.get("CI") != "true", why
    pytest.skip(why)


def _env(**extra):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("JAX_SMDDP_")}
  env.update(extra)
  return env


@pytest.mark.timeout(200)
@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_the_package_loads_its_native_modules_from_the_root_and_elsewhere(where, tmp_path):
  cwd = REPO if where == "root" else tmp_path
  # With the XLA-level swap asked for, jax_smddp.pth points the trampoline at the
  # MPI ABI library before Python runs anything: the built one, in site-packages.
  run = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=_env(JAX_SMDDP_COLLECTIVES="xla"),
                       capture_output=True, text=True, timeout=180)
  assert run.returncode == 0, run.stderr[-4000:]
  trampoline, package, engine, library = run.stdout.split()
  assert package == os.path.realpath(os.path.join(REPO, "jax_smddp", "__init__.py"))  # the sources
  site = os.path.realpath(sys.prefix)
  assert engine.startswith(site) and os.path.basename(engine).startswith("_smddp_cpu."), engine
  assert library.startswith(site) and os.path.isfile(library), library
  assert os.path.realpath(trampoline) == library
  # One build per environment: nothing built lands in the sources.
  built = [f for f in os.listdir(os.path.join(REPO, "jax_smddp")) if f.endswith(".so")]
  assert not built, built


@pytest.mark.timeout(200)
@pytest.mark.parametrize("where", ["root", "elsewhere"])
@pytest.mark.parametrize("command", [["-m", "jax_smddp.doctor"], ["-m", "jax_smddp.tools.bench", "--help"],
                                     [os.path.join(REPO, "examples", "fsdp_train.py"), "--help"]],
                         ids=["doctor", "bench --help", "example --help"])
def test_commands_run_from_the_root_and_elsewhere(command, where, tmp_path):
  cwd = REPO if where == "root" else tmp_path
  run = subprocess.run([sys.executable, *command], cwd=cwd, env=_env(), capture_output=True,
                       text=True, timeout=180)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  assert run.stdout.strip(), run.stderr[-3000:]


@pytest.mark.timeout(120)
def test_an_unbuilt_checkout_says_what_to_run(tmp_path):
  """A copy of the checkout's sources, nothing built, imported from its root by an
  interpreter without jax_smddp (this one, with the editable install's finder removed)."""
  checkout = tmp_path / "checkout"
  shutil.copytree(os.path.join(REPO, "jax_smddp"), checkout / "jax_smddp",
                  ignore=shutil.ignore_patterns("*.so", "__pycache__"))
  for f in ("CMakeLists.txt", "pyproject.toml"):
    shutil.copy(os.path.join(REPO, f), checkout / f)
  probe = ("import sys\n"
           "sys.meta_path[:] = [f for f in sys.meta_path if 'ScikitBuild' not in type(f).__name__]\n"
           "sys.path.insert(0, '')\n"
           "import jax_smddp\n")
  run = subprocess.run([sys.executable, "-c", probe], cwd=checkout, env=_env(), capture_output=True,
                       text=True, timeout=110)
  assert run.returncode != 0
  message = run.stderr.strip().splitlines()[-1]
  assert "native extension (_smddp_cpu) is not built for this Python" in message, message
  assert f"imported from the source checkout {checkout}" in message, message
  assert f"cd {checkout} && bash scripts/run.sh" in message, message
  assert f"{sys.executable} -m pip install --no-build-isolation -e ." in message, message

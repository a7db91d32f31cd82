"""An installed (not editable) jax_smddp run from the checkout's root, where python -m and
python -c put the current directory first on sys.path and so find the checkout's jax_smddp/
(Python files only) before site-packages: the sources hand over to an installed package of
the same version, and fail at once naming both when the versions differ
(jax_smddp/__init__.py). Here the installed package is a stub in a scratch folder and the
interpreter runs without site-packages (-S: no editable install's finder), so nothing compiles;
tests/build/test_build.py runs a real wheel's install from the root."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from importlib.machinery import EXTENSION_SUFFIXES

import pytest

import jax_smddp

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
with open(os.path.join(REPO, "pyproject.toml"), "rb") as _f:
  VERSION = tomllib.load(_f)["project"]["version"]

# The stub's submodule `probe`: what `python -m` runs below, and what a spawned
# multiprocessing worker imports again (its __main__).
PROBE = textwrap.dedent("""
    import multiprocessing, sys
    import jax_smddp

    def where(_):
      import jax_smddp
      return jax_smddp.__file__

    if __name__ == "__main__":
      ours = sorted(m for m in sys.modules if m.split(".")[0] == "jax_smddp")
      print("MAIN", jax_smddp.__file__, sys.modules["jax_smddp"] is jax_smddp, ",".join(ours))
      with multiprocessing.get_context("spawn").Pool(1) as pool:
        print("WORKER", pool.map(where, [0])[0])
    """)


def _install_stub(site, version, metadata=True):
  """A package named jax_smddp in `site`, as pip lays one out: the package folder
  (a submodule, a file named as the native extension, never loaded) and, where
  `metadata`, its dist-info with `version`."""
  package = site / "jax_smddp"
  package.mkdir(parents=True)
  (package / "__init__.py").write_text("STUB = True\n")
  (package / f"_smddp_cpu{EXTENSION_SUFFIXES[0]}").write_text("")
  (package / "probe.py").write_text(PROBE)
  if metadata:
    info = site / f"jax_smddp-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: jax_smddp\nVersion: {version}\n")
  return package


def _checkout(tmp_path, version=VERSION, name="checkout"):
  """A checkout's layout: jax_smddp/ without native modules beside pyproject.toml."""
  root = tmp_path / name
  (root / "jax_smddp").mkdir(parents=True)
  (root / "jax_smddp" / "__init__.py").write_text("")
  (root / "pyproject.toml").write_text(f'[project]\nname = "jax_smddp"\nversion = "{version}"\n')
  return root


def _python(*args, cwd=REPO, pythonpath=None, extra_env=None):
  env = {k: v for k, v in os.environ.items()
         if k not in ("PYTHONPATH", "PYTHONSAFEPATH", "XLA_FLAGS") and not k.startswith("JAX_SMDDP_")}
  if pythonpath:
    env["PYTHONPATH"] = str(pythonpath)
  env.update(extra_env or {})
  return subprocess.run([sys.executable, "-S", *args], cwd=cwd, env=env, capture_output=True,
                        text=True, timeout=100)


# ------------------------------------------------------------------ the decision, in process

@pytest.mark.timeout(60)
def test_the_installed_package_of_the_same_version_is_chosen(tmp_path):
  root = _checkout(tmp_path)
  site = tmp_path / "site"
  installed = _install_stub(site, VERSION)
  # An editable install's site-packages/jax_smddp/ (native modules, no __init__.py) before it.
  portion = tmp_path / "editable_site" / "jax_smddp"
  portion.mkdir(parents=True)
  (portion / f"_smddp_cpu{EXTENSION_SUFFIXES[0]}").write_text("")
  # And another checkout's sources (the editable install's .pth puts its root on sys.path).
  other = _checkout(tmp_path, name="other")
  package = str(root / "jax_smddp")
  spec = jax_smddp._installed_instead(package, ["", str(portion.parent), str(other), str(site)],
                                      cwd=str(root))
  assert spec is not None and spec.origin == str(installed / "__init__.py"), spec
  # The root as a relative or absolute entry is the sources too, not an installed package.
  for entry in (".", str(root), str(root) + "/"):
    spec = jax_smddp._installed_instead(package, [entry, str(site)], cwd=str(root))
    assert spec is not None and spec.origin == str(installed / "__init__.py"), (entry, spec)


@pytest.mark.timeout(60)
def test_nothing_is_chosen_without_an_installed_package(tmp_path):
  root = _checkout(tmp_path)
  package = str(root / "jax_smddp")
  portion = tmp_path / "editable_site" / "jax_smddp"
  portion.mkdir(parents=True)
  (portion / f"_smddp_cpu{EXTENSION_SUFFIXES[0]}").write_text("")
  other = _checkout(tmp_path, version="0.0.1", name="other")  # other sources, not built
  (tmp_path / "link").symlink_to(root)  # the sources again, under another name
  for path in ([""], ["", str(portion.parent)], ["", str(other)], ["", str(tmp_path / "link")]):
    assert jax_smddp._installed_instead(package, path, cwd=str(root)) is None, path
  # Not a checkout (no pyproject.toml: a broken install before another): left to jax_smddp._native.
  site = tmp_path / "site"
  _install_stub(site, VERSION)
  assert jax_smddp._installed_instead(package, ["", str(site)], cwd=str(root)) is not None
  (root / "pyproject.toml").unlink()
  assert jax_smddp._installed_instead(package, ["", str(site)], cwd=str(root)) is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("installed", ["0.0.1", None], ids=["other version", "no metadata"])
def test_another_version_fails_naming_both_and_the_fixes(installed, tmp_path):
  root = _checkout(tmp_path)
  site = tmp_path / "site"
  stub = _install_stub(site, installed, metadata=installed is not None)
  package = str(root / "jax_smddp")
  with pytest.raises(ImportError) as e:
    jax_smddp._installed_instead(package, ["", str(site)], cwd=str(root))
  text = str(e.value)
  assert f"the sources {package} (version {VERSION};" in text, text
  assert f"the installed jax_smddp {stub} (version {installed or 'unknown'})" in text, text
  assert f"{root} is the current directory" in text, text
  assert f"run from another directory than {root}, or run python -P (or set PYTHONSAFEPATH=1" in text, text
  assert f"cd {root} && {sys.executable} -m pip install" in text, text
  assert "--no-build-isolation -e ." in text, text


@pytest.mark.timeout(60)
def test_sources_put_on_the_path_by_pythonpath_are_named_so(tmp_path):
  root = _checkout(tmp_path, version="0.0.2")  # the installed one is VERSION
  site = tmp_path / "site"
  _install_stub(site, VERSION)
  with pytest.raises(ImportError) as e:
    jax_smddp._installed_instead(str(root / "jax_smddp"), [str(root), str(site)], cwd=str(tmp_path))
  text = str(e.value)
  assert "(version 0.0.2;" in text and f"(version {VERSION})" in text, text
  assert f"{root} is on sys.path before it (PYTHONPATH?)" in text, text
  assert f"To use the installed one: take {root} off sys.path." in text, text


# ------------------------------------------------------------------ from the repository's root

@pytest.mark.timeout(120)
def test_from_the_root_the_installed_package_runs_in_place_of_the_sources(tmp_path):
  site = tmp_path / "site"
  stub = _install_stub(site, VERSION)
  run = _python("-c", "import sys, jax_smddp; print(jax_smddp.__file__, jax_smddp.STUB, "
                "sorted(m for m in sys.modules if m.startswith('jax_smddp')))", pythonpath=site)
  assert run.returncode == 0, run.stderr[-3000:]
  assert run.stdout.split() == [str(stub / "__init__.py"), "True", "['jax_smddp']"], run.stdout
  # python -m of a submodule, and a spawned worker (which imports __main__ again), too.
  run = _python("-m", "jax_smddp.probe", pythonpath=site)
  assert run.returncode == 0, run.stderr[-3000:]
  assert f"MAIN {stub / '__init__.py'} True jax_smddp\n" in run.stdout, run.stdout
  assert f"WORKER {stub / '__init__.py'}\n" in run.stdout, run.stdout


@pytest.mark.timeout(120)
def test_from_the_root_another_version_fails_at_once_and_python_p_runs_it(tmp_path):
  site = tmp_path / "site"
  stub = _install_stub(site, "0.0.1")
  for args in (["-c", "import jax_smddp"], ["-m", "jax_smddp.probe"]):
    run = _python(*args, pythonpath=site)
    assert run.returncode != 0, run.stdout
    message = run.stderr.strip().splitlines()[-1]
    assert message.startswith("ImportError: jax_smddp: Python found the sources "
                              f"{os.path.join(REPO, 'jax_smddp')} (version {VERSION};"), message
    assert f"the installed jax_smddp {stub} (version 0.0.1)" in message, message
  # The fix the message names: the current directory off sys.path.
  for args, env in ((["-P"], {}), ([], {"PYTHONSAFEPATH": "1"})):
    run = _python(*args, "-c", "import jax_smddp; print(jax_smddp.__file__)", pythonpath=site,
                  extra_env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == str(stub / "__init__.py"), run.stdout


@pytest.mark.timeout(60)
def test_from_the_root_the_native_libraries_are_the_installed_packages(tmp_path):
  """jax_smddp/_startup.py finds the MPI ABI and NCCL front-end libraries without importing
  jax_smddp (as `import jax` loads the front end, before any import of jax_smddp): from the
  root, the installed package's, not the sources' (which have none)."""
  site = tmp_path / "site"
  stub = _install_stub(site, VERSION)
  for library in ("libsmddp_mpi.so", "libsmddp_nccl.so"):
    (stub / library).write_text("")
  probe = ("import importlib.util, sys\n"
           f"spec = importlib.util.spec_from_file_location('startup', {os.path.join(REPO, 'jax_smddp', '_startup.py')!r})\n"
           "startup = importlib.util.module_from_spec(spec)\n"
           "spec.loader.exec_module(startup)\n"
           "print(startup.library_path(), startup.library_path(startup.NCCL_LIBRARY))\n"
           "print(importlib.util.find_spec('jax_smddp').origin, 'jax_smddp' in sys.modules)\n")
  run = _python("-c", probe, pythonpath=site)
  assert run.returncode == 0, run.stderr[-3000:]
  libraries, found = run.stdout.splitlines()
  assert libraries.split() == [str(stub / "libsmddp_mpi.so"), str(stub / "libsmddp_nccl.so")], libraries
  assert found == f"{os.path.join(REPO, 'jax_smddp', '__init__.py')} False", found  # the sources first

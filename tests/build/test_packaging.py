"""What a user checks first about a package: one version (pyproject.toml's) everywhere it is
shown, the license and the changelog, the supported jax range stated as a bound that holds the
versions scripts/test.sh tests, and the platform. The sdist is built and a wheel built from it:
tests/build/test_build.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib

import jax

import jax_smddp
from jax_smddp import capabilities

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pyproject() -> dict:
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)


def _version_tuple(text: str) -> tuple[int, ...]:
  return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def test_one_version_shown_everywhere(tmp_path):
  """pyproject.toml's version is the package's, the native build's and the doctor's; no other
  file of the package writes a version literal."""
  version = _pyproject()["project"]["version"]
  assert jax_smddp.__version__ == version
  assert capabilities.build()["version"] == version
  run = subprocess.run([sys.executable, "-m", "jax_smddp.doctor", "--json"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
  rows = {r["component"]: r for r in json.loads(run.stdout)["rows"]}
  assert rows["jax_smddp"]["detail"].startswith(f"jax_smddp {version} (Linux "), rows["jax_smddp"]
  for root, _, files in os.walk(os.path.join(REPO, "jax_smddp")):
    for f in files:
      if f.endswith(".py"):
        text = open(os.path.join(root, f)).read()
        assert not re.search(r"__version__\s*=\s*['\"]", text), os.path.join(root, f)


def test_license_and_changelog():
  text = open(os.path.join(REPO, "LICENSE")).read()
  assert "Apache License" in text and "Version 2.0, January 2004" in text
  assert _pyproject()["project"]["license"] == {"text": "Apache-2.0"}
  changelog = open(os.path.join(REPO, "CHANGELOG.md")).read()
  assert changelog.startswith("# Changelog") and "## Unreleased" in changelog
  assert f"## {_pyproject()['project']['version']} " in changelog


def test_the_supported_jax_range_is_a_bound_holding_the_tested_versions():
  """The extension is built against one jaxlib's FFI: the dependency has an upper bound, and
  the versions scripts/test.sh tests (its jax specs) lie inside it, as does the jax running."""
  deps = [d for d in _pyproject()["project"]["dependencies"] if re.match(r"jax\b", d)]
  assert len(deps) == 1, deps
  low = re.search(r">=\s*([\d.]+)", deps[0])
  high = re.search(r"<\s*([\d.]+)", deps[0])
  assert low and high, f"{deps[0]}: no lower and upper bound"
  inside = lambda v: _version_tuple(low.group(1)) <= _version_tuple(v) < _version_tuple(high.group(1))
  assert inside(jax.__version__), (deps[0], jax.__version__)
  script = open(os.path.join(REPO, "scripts", "test.sh")).read()
  tested = re.findall(r'"jax(?:==|>=)([\d.]+)', script)
  assert len(tested) == 2 and all(inside(v) for v in tested), (tested, deps[0])
  build_requires = [d for d in _pyproject()["build-system"]["requires"] if re.match(r"jax\b", d)]
  assert build_requires == deps, (build_requires, deps)


def test_the_platform_is_stated():
  classifiers = _pyproject()["project"]["classifiers"]
  assert "Operating System :: POSIX :: Linux" in classifiers
  readme = open(os.path.join(REPO, "README.md")).read()
  assert re.search(r"Linux.{0,20}x86-64|x86-64.{0,20}Linux", readme), \
      "README.md must say the platform (Linux, x86-64)"

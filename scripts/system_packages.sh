#!/usr/bin/env bash
# The system packages jax_smddp's build and tests use, installed with apt when
# missing and we can: libfabric (headers at build time, so the transports
# between hosts are built; library at run time), fi_info, iproute2 (network
# namespaces: two simulated hosts in the tests), shellcheck (the job scripts'
# test, tests/build/test_job_scripts.py) and libpmix-dev (Slurm's mpi/pmix
# plugin loads its libpmix.so: srun --mpi=pmix in the p4d/p5 job script's test
# under the local Slurm, scripts/slurm_local.sh). Both README commands
# run this before building, so their order does not matter. Elsewhere (no
# root, no apt) it says what is missing and goes on; under CI=true it fails.
set -euo pipefail
missing=()
if ! { [ -e /usr/include/rdma/fabric.h ] || [ -n "${LIBFABRIC_ROOT:-${JAX_SMDDP_LIBFABRIC_ROOT:-}}" ] \
       || [ -e /opt/amazon/efa/include/rdma/fabric.h ]; }; then
  missing+=(libfabric-dev)
fi
command -v fi_info >/dev/null || [ -x /opt/amazon/efa/bin/fi_info ] || missing+=(libfabric-bin)
command -v ip >/dev/null || missing+=(iproute2)
command -v shellcheck >/dev/null || missing+=(shellcheck)
if command -v dpkg-query >/dev/null && ! dpkg-query -W -f='${Status}' libpmix-dev 2>/dev/null | grep -q "ok installed"; then
  missing+=(libpmix-dev)
fi
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "=== installing ${missing[*]}"
  (apt-get install -y -q "${missing[@]}" || (apt-get update -q && apt-get install -y -q "${missing[@]}")) >/dev/null
elif [ "${CI:-}" = "true" ]; then
  echo "CI needs ${missing[*]} (apt-get install ${missing[*]})" >&2
  exit 1
else
  echo "=== ${missing[*]} missing: jax_smddp builds without libfabric (one host only), and the" \
       "tests that need them (two hosts, shellcheck, srun --mpi=pmix) are skipped or reduced;" \
       "install them (apt-get install ${missing[*]}) and rerun"
fi

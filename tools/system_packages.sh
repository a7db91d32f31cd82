#!/usr/bin/env bash
# The system packages jax_smddp's build and tests use, installed with apt when
# missing and we can: libfabric (headers at build time, so the transports
# between hosts are built; library at run time), fi_info, and iproute2
# (network namespaces: two simulated hosts in the tests). Both README commands
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
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "=== installing ${missing[*]}"
  (apt-get install -y -q "${missing[@]}" || (apt-get update -q && apt-get install -y -q "${missing[@]}")) >/dev/null
elif [ "${CI:-}" = "true" ]; then
  echo "CI needs ${missing[*]} (apt-get install ${missing[*]})" >&2
  exit 1
else
  echo "=== ${missing[*]} missing: jax_smddp builds without libfabric (one host only), and the" \
       "two-host tests are skipped; install them (apt-get install ${missing[*]}) and rerun"
fi

#!/usr/bin/env bash
# On a GPU machine with jax[cuda] installed: builds jax_smddp against that jax
# and runs the GPU stages (scripts/gpu_check.py says which, in what order, under
# what limits; the results and a one-page summary land in OUT as they come).
#   bash scripts/gpu_check.sh                        # STAGES=all inside GPU_CHECK_BUDGET_S=540
#   STAGES=build,kernels bash scripts/gpu_check.sh   # some stages (a run without build uses
#                                                  # what an earlier run built on that machine)
#   bash scripts/gpu_check.sh --dry-run              # the plan only
# PYTHON (default python3) is resolved here to an absolute interpreter: the
# build installs into its environment. A libfabric carried in .fab/
# (scripts/carry_libfabric.sh) reaches the build through JAX_SMDDP_LIBFABRIC_ROOT.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
if [[ "$py" != /* ]]; then
  resolved=$(command -v "$py" 2>/dev/null) || { echo "gpu_check: PYTHON=$py is not a command" >&2; exit 2; }
  [[ "$resolved" == /* ]] || resolved="$(cd "$(dirname "$resolved")" && pwd)/$(basename "$resolved")"
  py=$resolved
fi
if [ -f "$root/.fab/CUDA_BUILD" ]; then  # scripts/build_libfabric_cuda.sh: FI_HMEM_CUDA
  # That libfabric opens "libcudart.so" and "libcuda.so" by these names; an
  # image may have them only versioned (libcuda.so alone may be the toolkit's stub).
  names="$root/.fab/cuda_names"
  mkdir -p "$names"
  cudart=$(ls "${CUDA_HOME:-/usr/local/cuda}"/lib64/libcudart.so.* 2>/dev/null | sed -n 1p)
  libcuda=$(ldconfig -p | awk '/libcuda\.so\.1 / && !f {f = $NF} END {print f}')
  [ -n "$cudart" ] && ln -sf "$cudart" "$names/libcudart.so"
  [ -n "$libcuda" ] && ln -sf "$libcuda" "$names/libcuda.so"
  export LD_LIBRARY_PATH="$names${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
exec "$py" "$root/scripts/gpu_check.py" "$@"

#!/usr/bin/env bash
# On a fresh GPU machine (jax with CUDA already installed): builds jax_smddp
# against that jax, then runs tests/gpu and the GPU benchmark. Output goes to
# stdout; with OUT set, the benchmark's JSON and the pytest log land there.
#   bash tools/gpu_check.sh            # PYTHON=python3 by default
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
PY=${PYTHON:-python3}
out=${OUT:-/tmp/jax_smddp_gpu_check}
mkdir -p "$out"
status=0
echo "=== machine"
nvidia-smi -L || { echo "no GPU: nothing to check"; exit 1; }
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
echo "=== build (nvcc: $(command -v nvcc || echo /usr/local/cuda/bin/nvcc))"
"$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e . \
  || { echo "build failed"; exit 1; }
(cd / && "$PY" -c "import jax_smddp.gpu as g, jax_smddp._native as n; e = n.cuda_engine(); \
print('CUDA backend:', g.available(), 'GPUs:', e.device_count() if e else 0, \
'stream memops:', e.have_stream_memops() if e else None)")
echo "=== tests/gpu"
"$PY" -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$out/pytest_gpu.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
echo "=== protocol and lowering tests (CPU devices)"
JAX_PLATFORMS=cpu "$PY" -m pytest -q -p no:cacheprovider tests/test_stream_protocol.py \
  tests/test_cuda_backend.py 2>&1 | tee "$out/pytest_cpu.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
echo "=== GPU benchmark: 2 and 4 processes sharing GPU 0"
for n in 2 4; do
  "$PY" -m jax_smddp.gpu_bench --processes "$n" --sizes 1M,4M,16M,64M,256M \
    --json "$out/gpu_bench_${n}proc.json" || status=1
done
echo "=== GPU benchmark: one process, every local GPU, against XLA's NCCL"
"$PY" -m jax_smddp.gpu_bench --processes 1 --sizes 1M,16M,256M --json "$out/gpu_bench_1proc.json" \
  || status=1
exit $status

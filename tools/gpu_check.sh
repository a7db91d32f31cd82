#!/usr/bin/env bash
# On a fresh GPU machine (jax with CUDA already installed): builds jax_smddp
# against that jax, then runs tests/gpu and the GPU benchmark. Output goes to
# stdout; with OUT set, the logs and the benchmark's JSON land there.
#   bash tools/gpu_check.sh              # everything
#   QUICK=1 bash tools/gpu_check.sh      # kernels, one test per scenario, small benchmark
#   CPU_TESTS=0 bash tools/gpu_check.sh  # without the CPU-device tests (CI runs those)
#   STAGES=build,kernels bash tools/gpu_check.sh   # only these stages, e.g. one device call each
# Stages: build memory kernels jax bench blocks slots64 mps hosts nccl overlap (default: all). A run
# without "build" uses what an earlier run built on the same machine.
# PYTHON=python3 by default. Every stage runs under a time limit: a hang is a failure.
# Where the GPU image has no libfabric, run tools/carry_libfabric.sh on a machine
# that has it and carry .fab/ along: it is used when present. For device memory
# on the rails (FI_HMEM_CUDA), carry tools/build_libfabric_cuda.sh's .fab/ instead.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
PY=${PYTHON:-python3}
out=${OUT:-/tmp/jax_smddp_gpu_check}
quick=${QUICK:-0}
stages=${STAGES:-build,memory,kernels,jax,bench,blocks,slots64,mps,hosts,nccl,overlap}
want() { [[ ",$stages," == *",$1,"* ]]; }
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d "$root/.fab" ]; then  # libfabric carried by tools/carry_libfabric.sh
  export LD_LIBRARY_PATH="$root/.fab${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export CPATH="$root/.fab/include${CPATH:+:$CPATH}"
fi
if [ -f "$root/.fab/CUDA_BUILD" ]; then  # tools/build_libfabric_cuda.sh: FI_HMEM_CUDA
  # That libfabric opens "libcudart.so" and "libcuda.so" by these names; an
  # image may have them only versioned (libcuda.so alone may be the toolkit's stub).
  names="$root/.fab/cuda_names"
  mkdir -p "$names"
  cudart=$(ls "${CUDA_HOME:-/usr/local/cuda}"/lib64/libcudart.so.* 2>/dev/null | head -1)
  libcuda=$(ldconfig -p | awk '/libcuda\.so\.1 /{print $NF; exit}')
  [ -n "$cudart" ] && ln -sf "$cudart" "$names/libcudart.so"
  [ -n "$libcuda" ] && ln -sf "$libcuda" "$names/libcuda.so"
  export LD_LIBRARY_PATH="$names:$LD_LIBRARY_PATH"
fi
status=0
echo "=== machine"
nvidia-smi -L || { echo "no GPU: nothing to check"; exit 1; }
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
ls -l /dev/gdrdrv 2>/dev/null || echo "no /dev/gdrdrv (GDRCopy driver not loaded)"
"$PY" -c "import ctypes; ctypes.CDLL('libfabric.so.1'); print('libfabric: found')" 2>/dev/null \
  || echo "libfabric: not found (tests across simulated hosts skip)"
if [ -x "$root/.fab/fi_info" ]; then  # whether shm can move device memory here (FI_HMEM_CUDA)
  echo "libfabric: $(cat "$root/.fab/CUDA_BUILD"); libcudart: ${cudart:-none}; libcuda: ${libcuda:-none}"
  FI_LOG_LEVEL=warn "$root/.fab/fi_info" -p shm -c FI_HMEM 2>&1 | grep -iE "hmem|cuda|provider" | head -5
fi
if want build; then
  echo "=== build (nvcc: $(command -v nvcc || echo /usr/local/cuda/bin/nvcc))"
  start=$(date +%s)
  timeout 420 "$PY" -m pip install -v --disable-pip-version-check --no-build-isolation --no-deps \
    --config-settings=cmake.define.JAX_SMDDP_TESTING=ON -e . \
    >"$out/build.log" 2>&1 || { tail -60 "$out/build.log"; echo "build failed"; exit 1; }
  # The tests' probes and native programs (tests/engine, tests/native), beside the package.
  bash tools/build_testing.sh "$(dirname "$(dirname "$PY")")" >>"$out/build.log" 2>&1 \
    || echo "tools/build_testing.sh failed (see build.log): the CPU protocol tests will fail"
  echo "built in $(( $(date +%s) - start )) s"
fi
(cd / && "$PY" -c "import jax_smddp.gpu as g, jax_smddp._native as n; e = n.cuda_engine(); \
print('CUDA backend:', g.available(), 'GPUs:', e.device_count() if e else 0, \
'stream memops:', e.have_stream_memops() if e else None)")
if want memory; then
  echo "=== XLA's device memory as the driver sees it (how direct reads can share it)"
  timeout 300 "$PY" tools/gpu_memory_kinds.py || status=1
fi
if want kernels; then
  echo "=== tests/gpu/test_kernels.py (stream algorithms on one GPU, no JAX)"
  timeout 420 "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py 2>&1 \
    | tee "$out/pytest_kernels.log" | tail -40
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if want jax; then
  echo "=== tests/gpu/test_gpu.py (JAX processes sharing the GPU)"
  select=()
  if [ "$quick" = 1 ]; then
    export JAX_SMDDP_GPU_TEST_TIMEOUT=${JAX_SMDDP_GPU_TEST_TIMEOUT:-150}
    select=(-k "single_process or (sharing and engines and 2) or (sharing and direct and 2) or (hosts and engines) or (hosts and HMEM and 2-1) or hmem_required or (dead_peer and 2) or disagree or (sharing and host and 2)")
  fi
  timeout 900 "$PY" -m pytest -q -p no:cacheprovider -rsP tests/gpu/test_gpu.py "${select[@]}" 2>&1 \
    | tee "$out/pytest_gpu.log" | tail -80
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if want jax && [ "$quick" != 1 ] && [ "${CPU_TESTS:-1}" = 1 ]; then
  echo "=== protocol and lowering tests (CPU devices)"
  JAX_PLATFORMS=cpu timeout 600 "$PY" -m pytest -q -p no:cacheprovider tests/engine/test_stream_protocol.py \
    tests/engine/test_stream_watchdog.py tests/gpu/test_cuda_backend.py 2>&1 | tee "$out/pytest_cpu.log" | tail -5
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
sizes=1M,4M,16M,64M,256M; counts="2 4"
[ "$quick" = 1 ] && { sizes=1M,16M,64M; counts=2; }
if want bench; then
  echo "=== GPU benchmark: processes sharing GPU 0"
  # Staged and direct reads (peers read each other's XLA buffers in place) in one run.
  for n in $counts; do
    timeout 540 "$PY" -m jax_smddp.tools.gpu_bench --processes "$n" --sizes "$sizes" --direct-reads 0,1 \
      --json "$out/gpu_bench_${n}proc.json" || status=1
  done
fi
if want blocks; then
  # The reductions run within the SM budget (JAX_SMDDP_GPU_MAX_BLOCKS, 8 by
  # default); reduce_scatter and all_reduce measured 24-45 GB/s on an H100.
  echo "=== GPU benchmark: reductions with 8 and 32 blocks, direct reads"
  for blocks in 8 32; do
    echo "--- JAX_SMDDP_GPU_MAX_BLOCKS=$blocks"
    JAX_SMDDP_GPU_MAX_BLOCKS=$blocks timeout 300 "$PY" -m jax_smddp.tools.gpu_bench --processes 2 \
      --ops reduce_scatter,all_reduce --sizes 16M,64M --modes engine --direct-reads 1 \
      --json "$out/gpu_bench_2proc_${blocks}blocks.json" || status=1
  done
fi
# Processes sharing one GPU time-slice it unless MPS runs them concurrently:
# the same benchmark with 64 MiB slots (fewer steps per call), then under MPS.
if want slots64; then
  echo "=== GPU benchmark: 2 processes, 64 MiB slots"
  JAX_SMDDP_GPU_SLOT_BYTES=$((64 << 20)) timeout 420 "$PY" -m jax_smddp.tools.gpu_bench --processes 2 \
    --sizes "$sizes" --json "$out/gpu_bench_2proc_64M_slots.json" || status=1
fi
if ! want mps; then
  :
elif command -v nvidia-cuda-mps-control >/dev/null; then
  echo "=== GPU benchmark: 2 processes under MPS"
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/jax_smddp_mps CUDA_MPS_LOG_DIRECTORY=/tmp/jax_smddp_mps_log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    # MPS removes the context switch per hand-off, direct reads most hand-offs
    # and a copy: the pair the all_gather target most depends on.
    timeout 420 "$PY" -m jax_smddp.tools.gpu_bench --processes 2 --sizes "$sizes" --direct-reads 0,1 \
      --json "$out/gpu_bench_2proc_mps.json" || status=1
    echo quit | nvidia-cuda-mps-control
  else
    echo "MPS did not start"
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
else
  echo "(no nvidia-cuda-mps-control: MPS comparison skipped)"
fi
if want hosts && "$PY" -c 'import ctypes; ctypes.CDLL("libfabric.so.1")' 2>/dev/null; then
  # Groups across 2 simulated hosts: the network proxy, slots staged through
  # host memory (0) or in device memory where this libfabric can (auto).
  echo "=== GPU benchmark: 2 processes as 2 hosts (libfabric shm), staged vs FI_HMEM slots"
  JAX_SMDDP_FABRIC_PROVIDER=shm timeout 420 "$PY" -m jax_smddp.tools.gpu_bench --processes 2 --hosts 2 \
    --fabric-hmem 0,auto --modes engine --sizes 1M,16M,64M \
    --ops all_gather,reduce_scatter,all_reduce,all_to_all \
    --json "$out/gpu_bench_2hosts.json" || status=1
fi
if want nccl; then
  echo "=== GPU benchmark: one process, every local GPU, against XLA's NCCL"
  timeout 300 "$PY" -m jax_smddp.tools.gpu_bench --processes 1 --sizes 1M,16M,256M \
    --ops all_gather,reduce_scatter,all_reduce,all_to_all \
    --json "$out/gpu_bench_1proc.json" || status=1
fi
if want overlap; then
  # The Flax example on the GPU: its losses against XLA's collectives (1 process) and against
  # the CPU (2 processes), step times with and without the stream annotation, and a trace of 3
  # steps per run, summarised by jax_smddp.tools.trace_summary (which stream each collective
  # ran on, and how long compute ran beside it). float32 matmuls at full precision on the GPU
  # (not TF32), so that the losses compare.
  echo "=== The Flax example on the GPU: losses, step times, where the collectives ran"
  example() {  # name, then the example's arguments
    local name=$1; shift
    echo "--- $name: $*"
    timeout 300 "$PY" examples/fsdp_train.py --steps 40 --no-progress --log-every 10 \
      --eval-batches 2 --metrics "$out/example_$name.jsonl" --profile "$out/trace_$name" "$@" \
      >"$out/example_$name.json" 2>"$out/example_$name.log" || { status=1; tail -30 "$out/example_$name.log"; return; }
    grep -v "^step " "$out/example_$name.log" | tail -40
  }
  export JAX_DEFAULT_MATMUL_PRECISION=highest XLA_PYTHON_CLIENT_PREALLOCATE=false
  lhs="--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_experimental_stream_annotation=true"
  XLA_FLAGS="$lhs" example gpu1_smddp --platform cuda --mesh 1
  XLA_FLAGS="$lhs" JAX_SMDDP_GPU_STREAM=compute example gpu1_smddp_compute_stream --platform cuda --mesh 1
  XLA_FLAGS="$lhs" example gpu1_xla --platform cuda --mesh 1 --collectives xla
  mps=0
  if command -v nvidia-cuda-mps-control >/dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/jax_smddp_mps CUDA_MPS_LOG_DIRECTORY=/tmp/jax_smddp_mps_log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && mps=1 || echo "MPS did not start: 2 processes time-slice the GPU"
  fi
  XLA_FLAGS="$lhs" example gpu2_smddp --platform cuda --mesh 2 --processes 2
  XLA_FLAGS="$lhs" JAX_SMDDP_GPU_STREAM=compute example gpu2_smddp_compute_stream --platform cuda \
    --mesh 2 --processes 2
  [ "$mps" = 1 ] && echo quit | nvidia-cuda-mps-control
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  JAX_PLATFORMS=cpu example cpu2_smddp --platform cpu --mesh 2 --processes 2
  "$PY" - "$out" <<'PYEOF' || status=1
import json, sys
out = sys.argv[1]
def run(name):
  try:
    losses = [json.loads(l)["loss"] for l in open(f"{out}/example_{name}.jsonl")]
    summary = json.loads(open(f"{out}/example_{name}.json").read().strip().splitlines()[-1])
    return losses, summary
  except (OSError, ValueError, IndexError) as e:
    print(f"{name}: no result ({e})")
    return None, None
runs = {n: run(n) for n in ("gpu1_smddp", "gpu1_smddp_compute_stream", "gpu1_xla", "gpu2_smddp",
                            "gpu2_smddp_compute_stream", "cpu2_smddp")}
for name, (losses, s) in runs.items():
  if s:
    print(f"{name:28s} final loss {s['final_loss']:.6f}  step {s['step_time_s'] * 1e3:8.2f} ms  "
          f"collectives alone {s['collectives_time_s'] * 1e3:8.2f} ms")
ok = True
for a, b in (("gpu1_smddp", "gpu1_xla"), ("gpu1_smddp_compute_stream", "gpu1_xla"),
             ("gpu2_smddp", "cpu2_smddp"), ("gpu2_smddp_compute_stream", "gpu2_smddp")):
  la, lb = runs[a][0], runs[b][0]
  if not la or not lb or len(la) != len(lb):
    print(f"{a} vs {b}: not comparable"); ok = False; continue
  rel = max(abs(x - y) / abs(y) for x, y in zip(la, lb))
  print(f"{a} vs {b}: losses differ by at most {rel:.2e} relative over {len(la)} steps "
        f"({'within' if rel <= 1e-4 else 'OVER'} the CPU tests' 1e-4)")
  ok &= rel <= 1e-4
sys.exit(0 if ok else 1)
PYEOF
fi
exit $status

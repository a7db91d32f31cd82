#include "cuda/microbenchmarks.h"

#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "cuda/device_scope.h"
#include "cuda/kernels.h"

namespace smddp {
namespace cuda {

namespace {

// The message the bindings always gave: the call, then CUDA's words.
Status Failed(cudaError_t err, const char* what) {
  return Status::Error(std::string(what) + ": " + cudaGetErrorString(err));
}

#define SMDDP_CUDA_OR_RETURN(expr, what)                \
  do {                                                  \
    const cudaError_t err_ = (expr);                    \
    if (err_ != cudaSuccess) return Failed(err_, what); \
  } while (0)

// A stream of its own and two events, destroyed with it.
struct Timing {
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  ~Timing() {
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    if (stream) cudaStreamDestroy(stream);
  }
};

// Best seconds of `iters` runs (after two warm-ups) of what `enqueue(stream)`
// puts on a stream of its own on device `ordinal`, timed by CUDA events.
template <typename F>
Status BestSeconds(int ordinal, int iters, F&& enqueue, double* seconds) {
  SMDDP_CUDA_OR_RETURN(cudaSetDevice(ordinal), "cudaSetDevice");
  Timing t;
  SMDDP_CUDA_OR_RETURN(cudaStreamCreateWithFlags(&t.stream, cudaStreamNonBlocking),
                       "cudaStreamCreate");
  SMDDP_CUDA_OR_RETURN(cudaEventCreate(&t.start), "cudaEventCreate");
  SMDDP_CUDA_OR_RETURN(cudaEventCreate(&t.stop), "cudaEventCreate");
  float best_ms = 0;
  for (int i = 0; i < iters + 2; ++i) {
    SMDDP_CUDA_OR_RETURN(cudaEventRecord(t.start, t.stream), "cudaEventRecord");
    SMDDP_RETURN_IF_ERROR(enqueue(t.stream));
    SMDDP_CUDA_OR_RETURN(cudaEventRecord(t.stop, t.stream), "cudaEventRecord");
    SMDDP_CUDA_OR_RETURN(cudaEventSynchronize(t.stop), "cudaEventSynchronize");
    float ms = 0;
    SMDDP_CUDA_OR_RETURN(cudaEventElapsedTime(&ms, t.start, t.stop), "cudaEventElapsedTime");
    if (i >= 2 && (best_ms == 0 || ms < best_ms)) best_ms = ms;
  }
  *seconds = best_ms * 1e-3;
  return Status::Ok();
}

// `count` zeroed buffers of `bytes` each on `ordinal`, the current device
// while they live (the caller's again after).
struct DeviceBuffers {
  explicit DeviceBuffers(int ordinal) : scope(ordinal) {}
  ~DeviceBuffers() {
    for (void* b : p) cudaFree(b);
  }
  Status Allocate(int ordinal, int count, size_t bytes) {
    SMDDP_CUDA_OR_RETURN(cudaSetDevice(ordinal), "cudaSetDevice");
    p.assign(size_t(count), nullptr);
    for (void*& b : p) SMDDP_CUDA_OR_RETURN(cudaMalloc(&b, bytes), "cudaMalloc");
    for (void* b : p) SMDDP_CUDA_OR_RETURN(cudaMemset(b, 0, bytes), "cudaMemset");
    return Status::Ok();
  }
  DeviceScope scope;
  std::vector<void*> p;
};

}  // namespace

Status CopyBandwidth(int ordinal, size_t bytes, int iters, double* bytes_per_second) {
  DeviceBuffers m(ordinal);
  SMDDP_RETURN_IF_ERROR(m.Allocate(ordinal, 2, bytes));
  double s = 0;
  SMDDP_RETURN_IF_ERROR(BestSeconds(
      ordinal, iters,
      [&](cudaStream_t stream) {
        SMDDP_CUDA_OR_RETURN(
            cudaMemcpyAsync(m.p[1], m.p[0], bytes, cudaMemcpyDeviceToDevice, stream),
            "cudaMemcpyAsync");
        return Status::Ok();
      },
      &s));
  *bytes_per_second = s > 0 ? double(bytes) / s : 0.0;
  return Status::Ok();
}

Status ReduceSeconds(int ordinal, size_t bytes, int sources, int max_blocks, int iters, int unroll,
                     double* seconds) {
  if (sources < 1 || sources > kMaxSources)
    return Status::InvalidArgument("reduce_seconds: sources must be 1.." +
                                   std::to_string(kMaxSources));
  DeviceBuffers m(ordinal);  // the sources, then the destination
  SMDDP_RETURN_IF_ERROR(m.Allocate(ordinal, sources + 1, bytes));
  return BestSeconds(
      ordinal, iters,
      [&](cudaStream_t stream) {
        SMDDP_CUDA_OR_RETURN(
            LaunchReduce(m.p[size_t(sources)], bytes, m.p.data(), sources, bytes, bytes / 4, 1,
                         DType::kFloat32, ReduceOp::kSum, max_blocks, stream, unroll),
            "reduction kernel");
        return Status::Ok();
      },
      seconds);
}

#undef SMDDP_CUDA_OR_RETURN

}  // namespace cuda
}  // namespace smddp

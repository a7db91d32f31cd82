#include "cuda/cuda_stream_ops.h"

#include <cstdlib>
#include <mutex>
#include <string>

#include <cuda.h>

#include "cuda/device_scope.h"
#include "cuda/kernels.h"
#include "xla_ffi/common/settings.h"

namespace smddp {
namespace cuda {
namespace {

using WaitValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using WriteValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

struct MemOps {
  WaitValueFn wait = nullptr;
  WriteValueFn write = nullptr;
};

const MemOps& DriverMemOps() {
  static const MemOps ops = [] {
    MemOps m;
    m.wait = Driver<WaitValueFn>("cuStreamWaitValue32");
    m.write = Driver<WriteValueFn>("cuStreamWriteValue32");
    if (!m.wait || !m.write) m = MemOps();  // both or neither
    return m;
  }();
  return ops;
}

}  // namespace

GpuSettings GpuSettings::FromEnvironment() {
  GpuSettings s;
  if (TextSetting("JAX_SMDDP_GPU_COPIES") == "kernel") s.copies = Copies::kKernel;
  if (TextSetting("JAX_SMDDP_GPU_FLAGS") == "kernel") s.flags = Flags::kKernel;
  s.max_blocks = int(IntSetting("JAX_SMDDP_GPU_MAX_BLOCKS"));
  return s;
}

GpuCounters& Counters() {
  static GpuCounters* counters = new GpuCounters();
  return *counters;
}

bool HaveStreamMemOps() { return DriverMemOps().wait != nullptr; }

CudaStreamOps::CudaStreamOps(cudaStream_t stream, const GpuSettings& settings)
    : stream_(stream),
      settings_(settings),
      memops_(settings.flags == GpuSettings::Flags::kMemOps && HaveStreamMemOps()) {}

Status CudaStreamOps::Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                             size_t rows) {
  if (width == 0 || rows == 0) return Status::Ok();
  cudaError_t err;
  if (settings_.copies == GpuSettings::Copies::kEngine) {
    Counters().engine_copies++;
    err = rows == 1 ? cudaMemcpyAsync(dst, src, width, cudaMemcpyDefault, stream_)
                    : cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, rows, cudaMemcpyDefault,
                                        stream_);
  } else {
    Counters().copy_kernels++;
    err = LaunchCopy2D(dst, dpitch, src, spitch, width, rows, settings_.max_blocks, stream_);
  }
  return err == cudaSuccess ? Status::Ok() : CudaError("copy failed", err);
}

Status CudaStreamOps::Reduce(void* dst, size_t dpitch, const void* const* srcs, int n,
                             size_t spitch, size_t count, size_t rows, DType dtype, ReduceOp op) {
  Counters().reduce_kernels++;
  const cudaError_t err = LaunchReduce(dst, dpitch, srcs, n, spitch, count, rows, dtype, op,
                                       settings_.max_blocks, stream_);
  if (err == cudaErrorInvalidValue)
    return Status::Unsupported(std::string("jax_smddp (GPU): cannot reduce ") + DTypeName(dtype) +
                               " with " + ReduceOpName(op) + " in this layout");
  return err == cudaSuccess ? Status::Ok() : CudaError("reduction kernel failed", err);
}

Status CudaStreamOps::WaitAtLeast(const uint32_t* flag, uint32_t value) {
  if (memops_) {
    Counters().flag_memops++;
    const CUresult r = DriverMemOps().wait(reinterpret_cast<CUstream>(stream_), CUdeviceptr(flag),
                                           value, CU_STREAM_WAIT_VALUE_GEQ);
    if (r == CUDA_SUCCESS) return Status::Ok();
    return Status::Error("jax_smddp (GPU): cuStreamWaitValue32 failed (error " +
                         std::to_string(int(r)) +
                         "); set JAX_SMDDP_GPU_FLAGS=kernel to use flag kernels");
  }
  Counters().flag_kernels++;
  const cudaError_t err = LaunchWaitFlag(flag, value, stream_);
  return err == cudaSuccess ? Status::Ok() : CudaError("flag wait kernel failed", err);
}

Status CudaStreamOps::Write(uint32_t* flag, uint32_t value) {
  if (memops_) {
    Counters().flag_memops++;
    // The default flags order the write after earlier work with a memory barrier.
    const CUresult r = DriverMemOps().write(reinterpret_cast<CUstream>(stream_), CUdeviceptr(flag),
                                            value, CU_STREAM_WRITE_VALUE_DEFAULT);
    if (r == CUDA_SUCCESS) return Status::Ok();
    return Status::Error("jax_smddp (GPU): cuStreamWriteValue32 failed (error " +
                         std::to_string(int(r)) +
                         "); set JAX_SMDDP_GPU_FLAGS=kernel to use flag kernels");
  }
  Counters().flag_kernels++;
  const cudaError_t err = LaunchWriteFlag(flag, value, stream_);
  return err == cudaSuccess ? Status::Ok() : CudaError("flag write kernel failed", err);
}

}  // namespace cuda
}  // namespace smddp

#include "cuda/cuda_stream_ops.h"

#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include <cuda.h>

#include "cuda/device_scope.h"
#include "cuda/kernels.h"
#include "xla_ffi/common/settings.h"

namespace smddp {
namespace cuda {
namespace {

using WaitValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using WriteValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using BatchFn = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);

struct MemOps {
  WaitValueFn wait = nullptr;
  WriteValueFn write = nullptr;
  BatchFn batch = nullptr;  // optional: several waits or writes as one operation
};

const MemOps& DriverMemOps() {
  static const MemOps ops = [] {
    MemOps m;
    m.wait = Driver<WaitValueFn>("cuStreamWaitValue32");
    m.write = Driver<WriteValueFn>("cuStreamWriteValue32");
    m.batch = Driver<BatchFn>("cuStreamBatchMemOp");
    if (!m.wait || !m.write) m = MemOps();  // both or neither
    return m;
  }();
  return ops;
}

// Flags per batch of stream memory operations (more go in several).
constexpr int kBatch = 32;

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

namespace {

// Whether `stream` is being captured into a CUDA graph (what runs on it is
// recorded, not run).
bool StreamCapturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace

CudaStreamOps::CudaStreamOps(cudaStream_t stream, const GpuSettings& settings)
    : stream_(stream),
      settings_(settings),
      memops_(settings.flags == GpuSettings::Flags::kMemOps && HaveStreamMemOps()),
      capturing_(StreamCapturing(stream)),
      copy_engines_(settings.copies == GpuSettings::Copies::kEngine && !capturing_) {}

struct CudaStreamOps::Lanes {
  cudaEvent_t fork = nullptr;
  cudaStream_t streams[kMaxLanes] = {};
  cudaEvent_t done[kMaxLanes] = {};
  std::unique_ptr<CudaStreamOps> ops[kMaxLanes];
};

namespace {

// The lanes of `stream` (made on its device at first use, kept for the
// process: XLA's streams live as long), or null if they cannot be made.
CudaStreamOps::Lanes* LanesOf(cudaStream_t stream, const GpuSettings& settings) {
  static std::mutex mu;
  static auto* all =
      new std::map<std::pair<cudaStream_t, int>, std::unique_ptr<CudaStreamOps::Lanes>>();
  int device = -1;
  if (cudaStreamGetDevice(stream, &device) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  // A call's ops are made afresh on XLA's thread for its device, which calls on one stream:
  // the last lanes this thread found serve it without the lock and the map.
  thread_local std::pair<cudaStream_t, int> last_key{nullptr, -1};
  thread_local CudaStreamOps::Lanes* last = nullptr;
  if (last != nullptr && last_key == std::make_pair(stream, device)) return last;
  std::lock_guard<std::mutex> lock(mu);
  auto& lanes = (*all)[{stream, device}];
  if (lanes) {
    last_key = {stream, device};
    return last = lanes.get();
  }
  auto made = std::make_unique<CudaStreamOps::Lanes>();
  DeviceScope scope(device);
  cudaError_t err = cudaEventCreateWithFlags(&made->fork, cudaEventDisableTiming);
  for (int i = 0; i < CudaStreamOps::kMaxLanes && err == cudaSuccess; ++i) {
    err = cudaStreamCreateWithFlags(&made->streams[i], cudaStreamNonBlocking);
    if (err == cudaSuccess) err = cudaEventCreateWithFlags(&made->done[i], cudaEventDisableTiming);
    made->ops[i] = std::make_unique<CudaStreamOps>(made->streams[i], settings);
  }
  if (err != cudaSuccess) {
    cudaGetLastError();
    return nullptr;  // leaked: a failure to make streams is not worth more
  }
  lanes = std::move(made);
  last_key = {stream, device};
  return last = lanes.get();
}

}  // namespace

Status CudaStreamOps::Fork(int lanes) {
  forked_ = 0;
  if (lanes <= 1) return Status::Ok();
  if (!lanes_) lanes_ = LanesOf(stream_, settings_);
  if (!lanes_) return Status::Ok();  // no lanes: everything in order on the stream
  const int n = lanes < kMaxLanes ? lanes : kMaxLanes;
  cudaError_t err = cudaEventRecord(lanes_->fork, stream_);
  for (int i = 0; i < n && err == cudaSuccess; ++i)
    err = cudaStreamWaitEvent(lanes_->streams[i], lanes_->fork, 0);
  if (err != cudaSuccess) return CudaError("forking lanes", err);
  forked_ = n;
  return Status::Ok();
}

StreamOps& CudaStreamOps::Lane(int i) {
  if (forked_ == 0) return *this;
  return *lanes_->ops[i % forked_];
}

Status CudaStreamOps::Join() {
  cudaError_t err = cudaSuccess;
  for (int i = 0; i < forked_ && err == cudaSuccess; ++i) {
    err = cudaEventRecord(lanes_->done[i], lanes_->streams[i]);
    if (err == cudaSuccess) err = cudaStreamWaitEvent(stream_, lanes_->done[i], 0);
  }
  forked_ = 0;
  return err == cudaSuccess ? Status::Ok() : CudaError("joining lanes", err);
}

Status CudaStreamOps::Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                             size_t rows) {
  if (width == 0 || rows == 0) return Status::Ok();
  cudaError_t err;
  if (copy_engines_) {
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

Status CudaStreamOps::WriteWords(uint64_t* dst, const uint64_t* values, int n) {
  const cudaError_t err = LaunchWriteWords(dst, values, n, stream_);
  return err == cudaSuccess ? Status::Ok() : CudaError("mailbox write failed", err);
}

Status CudaStreamOps::Resolve(uint64_t* out, const uint64_t* entry, uint64_t stamp, int which,
                              const uint64_t* table, const uint32_t* released,
                              const uint32_t* posted) {
  const cudaError_t err = LaunchResolve(out, entry, stamp, which, table, released, posted, stream_);
  return err == cudaSuccess ? Status::Ok() : CudaError("address resolution failed", err);
}

Status CudaStreamOps::Copy2DFrom(void* dst, size_t dpitch, const uint64_t* src_at, size_t src_add,
                                 size_t spitch, size_t width, size_t rows) {
  if (width == 0 || rows == 0) return Status::Ok();
  Counters().copy_kernels++;
  const cudaError_t err = LaunchCopy2DFrom(dst, dpitch, src_at, src_add, spitch, width, rows,
                                           settings_.max_blocks, stream_);
  return err == cudaSuccess ? Status::Ok() : CudaError("copy failed", err);
}

Status CudaStreamOps::ReduceFrom(const uint64_t* dsts_at, int nd, size_t dst_add, size_t dpitch,
                                 const uint64_t* srcs_at, int n, size_t src_add, size_t spitch,
                                 size_t count, size_t rows, DType dtype, ReduceOp op) {
  Counters().reduce_kernels++;
  const cudaError_t err =
      LaunchReduceFrom(dsts_at, nd, dst_add, dpitch, srcs_at, n, src_add, spitch, count, rows,
                       dtype, op, settings_.max_blocks, stream_);
  if (err == cudaErrorInvalidValue)
    return Status::Unsupported(std::string("jax_smddp (GPU): cannot reduce ") + DTypeName(dtype) +
                               " with " + ReduceOpName(op) + " from " + std::to_string(n) +
                               " sources into " + std::to_string(nd));
  return err == cudaSuccess ? Status::Ok() : CudaError("reduction kernel failed", err);
}

Status CudaStreamOps::Zero(void* dst, size_t bytes) {
  if (bytes == 0) return Status::Ok();
  const cudaError_t err = cudaMemsetAsync(dst, 0, bytes, stream_);
  return err == cudaSuccess ? Status::Ok() : CudaError("memset failed", err);
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

Status CudaStreamOps::ReduceToEach(void* const* dsts, int nd, const void* const* srcs, int n,
                                   size_t count, DType dtype, ReduceOp op) {
  if (nd > kMaxSources) return StreamOps::ReduceToEach(dsts, nd, srcs, n, count, dtype, op);
  Counters().reduce_kernels++;
  const size_t bytes = count * ElementSize(dtype);
  const cudaError_t err = LaunchReduceToEach(dsts, nd, bytes, srcs, n, bytes, count, 1, dtype, op,
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

namespace {

// `n` waits (kWait) or writes of `value` to `flags` as batches of stream
// memory operations, kBatch at a time.
enum class BatchOp { kWait, kWrite };
Status EnqueueBatches(cudaStream_t stream, BatchOp op, const uint32_t* const* flags, int n,
                      uint32_t value) {
  for (int at = 0; at < n; at += kBatch) {
    CUstreamBatchMemOpParams p[kBatch] = {};
    const int m = n - at < kBatch ? n - at : kBatch;
    for (int i = 0; i < m; ++i) {
      const CUdeviceptr address = CUdeviceptr(flags[at + i]);
      if (op == BatchOp::kWait) {  // GEQ, as WaitAtLeast
        p[i].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
        p[i].waitValue.address = address;
        p[i].waitValue.value = value;
        p[i].waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
      } else {  // the default write orders after earlier work, as Write
        p[i].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
        p[i].writeValue.address = address;
        p[i].writeValue.value = value;
        p[i].writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
      }
    }
    Counters().flag_memops++;
    const CUresult r = DriverMemOps().batch(reinterpret_cast<CUstream>(stream), unsigned(m), p, 0);
    if (r != CUDA_SUCCESS)
      return Status::Error(std::string("jax_smddp (GPU): cuStreamBatchMemOp (") +
                           (op == BatchOp::kWait ? "waits" : "writes") + ") failed (error " +
                           std::to_string(int(r)) +
                           "); set JAX_SMDDP_GPU_FLAGS=kernel to use flag kernels");
  }
  return Status::Ok();
}

}  // namespace

Status CudaStreamOps::WaitAllAtLeast(const uint32_t* const* flags, int n, uint32_t value) {
  if (!memops_ || !DriverMemOps().batch || n < 2) return StreamOps::WaitAllAtLeast(flags, n, value);
  return EnqueueBatches(stream_, BatchOp::kWait, flags, n, value);
}

Status CudaStreamOps::WriteAll(uint32_t* const* flags, int n, uint32_t value) {
  if (!memops_ || !DriverMemOps().batch || n < 2) return StreamOps::WriteAll(flags, n, value);
  return EnqueueBatches(stream_, BatchOp::kWrite, flags, n, value);
}

}  // namespace cuda
}  // namespace smddp

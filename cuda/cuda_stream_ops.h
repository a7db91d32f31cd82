// StreamOps on CUDA streams: every call enqueues on the stream XLA gave the
// handler and returns at once. Copies go to the copy engines
// (cudaMemcpy2DAsync, no SMs) or to a kernel of at most `max_blocks` blocks
// (always while the stream is captured into a CUDA graph);
// reductions always run as kernels within that budget; flags use the driver's
// stream memory operations (cuStreamWaitValue32 / cuStreamWriteValue32, no
// kernel) when the driver has them, else one-thread kernels.
#ifndef JAX_SMDDP_CUDA_CUDA_STREAM_OPS_H_
#define JAX_SMDDP_CUDA_CUDA_STREAM_OPS_H_

#include <atomic>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "xla_ffi/algorithms/stream_ops.h"

namespace smddp {
namespace cuda {

struct GpuSettings {
  enum class Copies : uint8_t { kEngine, kKernel };
  enum class Flags : uint8_t { kMemOps, kKernel };
  Copies copies = Copies::kEngine;
  Flags flags = Flags::kMemOps;
  int max_blocks = 0;  // a kernel's thread blocks: set by FromEnvironment or the caller

  // JAX_SMDDP_GPU_COPIES=engine|kernel, JAX_SMDDP_GPU_FLAGS=memops|kernel,
  // JAX_SMDDP_GPU_MAX_BLOCKS=N (defaults: the settings registry's).
  static GpuSettings FromEnvironment();
};

// What the ops enqueued, process-wide (tests check the copy-engine mode
// launches no data-movement kernel).
struct GpuCounters {
  std::atomic<uint64_t> copy_kernels{0};
  std::atomic<uint64_t> engine_copies{0};
  std::atomic<uint64_t> reduce_kernels{0};
  std::atomic<uint64_t> flag_kernels{0};
  std::atomic<uint64_t> flag_memops{0};
  std::atomic<uint64_t> direct_reads{0};  // calls that read their peers' inputs in place
  // The custom calls' handlers on the host: calls, and nanoseconds from entry
  // to return (the buffer exchange with the peers and every enqueue).
  std::atomic<uint64_t> handler_calls{0};
  std::atomic<uint64_t> handler_ns{0};
};
GpuCounters& Counters();

// Whether the driver provides stream memory operations (resolved once).
bool HaveStreamMemOps();

class CudaStreamOps : public StreamOps {
 public:
  CudaStreamOps(cudaStream_t stream, const GpuSettings& settings);
  // Whether the stream was being captured into a CUDA graph when these were made.
  bool capturing() const { return capturing_; }

  Status Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                size_t rows) override;
  Status Reduce(void* dst, size_t dpitch, const void* const* srcs, int n, size_t spitch,
                size_t count, size_t rows, DType dtype, ReduceOp op) override;
  Status ReduceToEach(void* const* dsts, int nd, const void* const* srcs, int n, size_t count,
                      DType dtype, ReduceOp op) override;
  Status Zero(void* dst, size_t bytes) override;
  Status WaitAtLeast(const uint32_t* flag, uint32_t value) override;
  Status Write(uint32_t* flag, uint32_t value) override;
  // One cuStreamBatchMemOp per 32 flags where the driver has it.
  Status WaitAllAtLeast(const uint32_t* const* flags, int n, uint32_t value) override;
  Status WriteAll(uint32_t* const* flags, int n, uint32_t value) override;
  // The device exchange's: kernels (cuda/kernels.h).
  Status WriteWords(uint64_t* dst, const uint64_t* values, int n) override;
  Status Resolve(uint64_t* out, const uint64_t* entry, uint64_t stamp, int which,
                 const uint64_t* table, const uint32_t* released, const uint32_t* posted) override;
  Status Copy2DFrom(void* dst, size_t dpitch, const uint64_t* src_at, size_t src_add, size_t spitch,
                    size_t width, size_t rows) override;
  Status ReduceFrom(const uint64_t* dsts_at, int nd, size_t dst_add, size_t dpitch,
                    const uint64_t* srcs_at, int n, size_t src_add, size_t spitch, size_t count,
                    size_t rows, DType dtype, ReduceOp op) override;
  // Lanes: up to kMaxLanes streams of the stream's device, made once per
  // stream and kept; Fork records an event that they wait for, Join one per
  // lane that the stream waits for. More lanes than that share them in turn.
  static constexpr int kMaxLanes = 8;
  Status Fork(int lanes) override;
  StreamOps& Lane(int i) override;
  Status Join() override;
  struct Lanes;  // a stream's lanes (cuda_stream_ops.cc)

 private:
  cudaStream_t stream_;
  Lanes* lanes_ = nullptr;
  int forked_ = 0;  // lanes in use since Fork
  GpuSettings settings_;
  bool memops_;
  bool capturing_;
  // Copies on the copy engines unless the stream is being captured into a
  // CUDA graph: XLA updates its command buffers' graphs when their buffers
  // move, which a kernel node allows and a memcpy node between two of XLA's
  // (cuMemMap'd) allocations does not (CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE,
  // seen on the H200), so captured copies run as kernels.
  bool copy_engines_;
};

}  // namespace cuda
}  // namespace smddp

#endif  // JAX_SMDDP_CUDA_CUDA_STREAM_OPS_H_

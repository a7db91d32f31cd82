// Data-movement and flag kernels for the GPU backend. Each launch uses at most
// `max_blocks` thread blocks (the SM budget: one block runs on one SM) and
// only enqueues on `stream`. Knows nothing of XLA or of the engine's plans.
#ifndef JAX_SMDDP_CUDA_KERNELS_H_
#define JAX_SMDDP_CUDA_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "xla_ffi/common/dtype.h"  // DType, ReduceOp: the engine's, as it passes them

namespace smddp {
namespace cuda {

// Sources one reduction kernel reads; more are combined in passes.
constexpr int kMaxSources = 32;

// `rows` rows of `width` bytes: dst + i * dpitch <- src + i * spitch.
cudaError_t LaunchCopy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                         size_t rows, int max_blocks, cudaStream_t stream);

// dst row i = op over srcs[k] row i (k in order), rows `count` elements long,
// pitches in bytes. 16-bit floats are combined in f32 and rounded once (per
// pass of kMaxSources). Returns cudaErrorInvalidValue for unsupported types.
// `unroll` 2 (the default): twice the loads in flight per thread for 4- and
// 8-byte elements, which the H200 read 1.15-1.35x faster within 4 to 32
// blocks (scripts/gpu_block_sweep.py, docs/gpu_measurements.md); 1: as 16-bit types always.
cudaError_t LaunchReduce(void* dst, size_t dpitch, const void* const* srcs, int n, size_t spitch,
                         size_t count, size_t rows, DType type, ReduceOp op, int max_blocks,
                         cudaStream_t stream, int unroll = 2);

// The same reduction written into each of `nd` (<= kMaxSources) destinations
// of one pitch: all_reduce in one round, each rank's reduced shard stored
// into every rank's output by the kernel that reduces it.
cudaError_t LaunchReduceToEach(void* const* dsts, int nd, size_t dpitch, const void* const* srcs,
                               int n, size_t spitch, size_t count, size_t rows, DType type,
                               ReduceOp op, int max_blocks, cudaStream_t stream, int unroll = 2);

// How long Resolve waits, on reading another call's mailbox entry, for the
// group's failure to be seen in this process (a peer's process may release
// its streams first, which then run ahead) before it traps as a protocol bug.
constexpr uint64_t kStaleEntryGraceNs = 10'000'000'000ull;

// Addresses read on the device (StreamOps::WriteWords, Resolve, Copy2DFrom,
// ReduceFrom, xla_ffi/algorithms/stream_ops.h; the same meanings).
cudaError_t LaunchWriteWords(uint64_t* dst, const uint64_t* values, int n, cudaStream_t stream);
cudaError_t LaunchResolve(uint64_t* out, const uint64_t* entry, uint64_t stamp, int which,
                          const uint64_t* table, const uint32_t* released, const uint32_t* posted,
                          cudaStream_t stream);
cudaError_t LaunchCopy2DFrom(void* dst, size_t dpitch, const uint64_t* src_at, size_t src_add,
                             size_t spitch, size_t width, size_t rows, int max_blocks,
                             cudaStream_t stream);
cudaError_t LaunchReduceFrom(const uint64_t* dsts_at, int nd, size_t dst_add, size_t dpitch,
                             const uint64_t* srcs_at, int n, size_t src_add, size_t spitch,
                             size_t count, size_t rows, DType type, ReduceOp op, int max_blocks,
                             cudaStream_t stream);

// One-thread kernels: later work waits for *flag >= value; *flag = value
// after earlier work, with a system-wide fence. The fallback when the
// driver's stream memory operations are unavailable.
cudaError_t LaunchWaitFlag(const uint32_t* flag, uint32_t value, cudaStream_t stream);
cudaError_t LaunchWriteFlag(uint32_t* flag, uint32_t value, cudaStream_t stream);

}  // namespace cuda
}  // namespace smddp

#endif  // JAX_SMDDP_CUDA_KERNELS_H_

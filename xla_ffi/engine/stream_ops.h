// What a stream-ordered collective asks of the memory it runs on: copies,
// reductions and 32-bit flags that peers can read and write. On a GPU every
// call only enqueues work on the caller's stream and returns
// (cuda/cuda_stream_ops.h); the host implementation (host_stream_ops.h) runs
// each call at once, so the same algorithms (stream_algorithms.h) are tested
// on CPU threads.
#ifndef JAX_SMDDP_ENGINE_STREAM_OPS_H_
#define JAX_SMDDP_ENGINE_STREAM_OPS_H_

#include <cstddef>
#include <cstdint>

#include "xla_ffi/engine/dtype.h"
#include "xla_ffi/engine/status.h"

namespace smddp {

class StreamOps {
 public:
  virtual ~StreamOps() = default;

  // `rows` rows of `width` bytes: dst + i * dpitch <- src + i * spitch.
  // Either side may be a peer's memory.
  virtual Status Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                        size_t rows) = 0;

  // For each of `rows` rows of `count` elements:
  //   dst[row] = op(srcs[0][row], ..., srcs[n - 1][row])
  // combined in source order; row i of source k starts at srcs[k] + i * spitch
  // bytes, of dst at dst + i * dpitch. Sources may be peers' memory; 16-bit
  // floats are combined in f32 and rounded once.
  virtual Status Reduce(void* dst, size_t dpitch, const void* const* srcs, int n, size_t spitch,
                        size_t count, size_t rows, DType dtype, ReduceOp op) = 0;

  // Later work waits until *flag >= value (the flag may be a peer's).
  virtual Status WaitAtLeast(const uint32_t* flag, uint32_t value) = 0;

  // *flag = value once all earlier work is done and visible to peers.
  virtual Status Write(uint32_t* flag, uint32_t value) = 0;

  Status Copy(void* dst, const void* src, size_t bytes) {
    return Copy2D(dst, bytes, src, bytes, bytes, 1);
  }
};

}  // namespace smddp

#endif  // JAX_SMDDP_ENGINE_STREAM_OPS_H_

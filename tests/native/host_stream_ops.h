// StreamOps on host memory that run each operation at once: the stream
// algorithms on CPU threads, for tests of the protocol without a GPU (a test
// double: built into the test programs and the _smddp_testing module only). Waits
// spin with the engine's deadline, so a missing peer is an error, not a hang.
#ifndef JAX_SMDDP_TESTS_NATIVE_HOST_STREAM_OPS_H_
#define JAX_SMDDP_TESTS_NATIVE_HOST_STREAM_OPS_H_

#include "xla_ffi/algorithms/stream_ops.h"

namespace smddp {

class HostStreamOps : public StreamOps {
 public:
  explicit HostStreamOps(double timeout_s) : timeout_s_(timeout_s) {}
  Status Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                size_t rows) override;
  Status Reduce(void* dst, size_t dpitch, const void* const* srcs, int n, size_t spitch,
                size_t count, size_t rows, DType dtype, ReduceOp op) override;
  Status Zero(void* dst, size_t bytes) override;
  Status WaitAtLeast(const uint32_t* flag, uint32_t value) override;
  Status Write(uint32_t* flag, uint32_t value) override;
  Status WriteWords(uint64_t* dst, const uint64_t* values, int n) override;
  Status Resolve(uint64_t* out, const uint64_t* entry, uint64_t stamp, int which,
                 const uint64_t* table, const uint32_t* released, const uint32_t* posted) override;
  Status Copy2DFrom(void* dst, size_t dpitch, const uint64_t* src_at, size_t src_add, size_t spitch,
                    size_t width, size_t rows) override;
  Status ReduceFrom(const uint64_t* dsts_at, int nd, size_t dst_add, size_t dpitch,
                    const uint64_t* srcs_at, int n, size_t src_add, size_t spitch, size_t count,
                    size_t rows, DType dtype, ReduceOp op) override;

 private:
  double timeout_s_;
};

}  // namespace smddp

#endif  // JAX_SMDDP_TESTS_NATIVE_HOST_STREAM_OPS_H_

// Element-wise reductions on host memory, used by every reducing algorithm.
// 16-bit floats are accumulated in f32 and rounded once at the end.
#ifndef JAX_SMDDP_ALGORITHMS_REDUCE_H_
#define JAX_SMDDP_ALGORITHMS_REDUCE_H_

#include <cstddef>

#include "xla_ffi/common/dtype.h"

namespace smddp {

bool SupportsReduce(DType dtype, ReduceOp op);

// out[i] = op(srcs[0][i], srcs[1][i], ..., srcs[n-1][i]) for i < count,
// combined in source order (so results match a sequential reference bit for
// bit). `out` must not alias any source.
void Reduce(DType dtype, ReduceOp op, const void* const* srcs, int n, void* out, size_t count);

}  // namespace smddp

#endif  // JAX_SMDDP_ALGORITHMS_REDUCE_H_

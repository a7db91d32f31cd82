// The reduction kernels compiled for AVX2 (this file alone gets -mavx2; see
// reduce_kernels.h): Reduce() calls them where the CPU has AVX2.
#include "xla_ffi/algorithms/reduce_kernels.h"

namespace smddp {

#if defined(__x86_64__) && defined(__AVX2__)
bool ReduceAvx2(DType dtype, ReduceOp op, const void* const* srcs, int n, void* out, size_t count) {
  return ReduceHere(dtype, op, srcs, n, out, count);
}
#else
bool ReduceAvx2(DType, ReduceOp, const void* const*, int, void*, size_t) { return false; }
#endif

}  // namespace smddp

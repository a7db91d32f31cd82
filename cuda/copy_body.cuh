// What one thread of the copy kernel does (cuda/kernels.cu), written once for
// the GPU and for the host: tests/native/copy_body_test.cu, built by nvcc and
// run on the CPU, runs every thread of a launch in turn against numpy.
//
// Why unrolled: within the SM budget (8 blocks of 512 threads) a thread that
// copies one 16-byte unit at a time keeps 64 KiB in flight for the whole
// launch, ~100 GB/s at HBM latency (Little's law); kUnroll independent loads
// per thread before their stores multiply that.
#ifndef JAX_SMDDP_CUDA_COPY_BODY_CUH_
#define JAX_SMDDP_CUDA_COPY_BODY_CUH_

#include <cstddef>
#include <cstdint>

namespace smddp {
namespace cuda {

constexpr int kCopyUnroll = 4;

// Thread `t` of `threads`: rows of `units_per_row` units of type V, row r of
// dst (dpitch bytes apart) <- row r of src (spitch bytes apart). Thread t
// moves units t, t + threads, ... : kCopyUnroll of them loaded before any is
// stored.
template <typename V>
__host__ __device__ inline void CopyThread(size_t t, size_t threads, char* dst, size_t dpitch,
                                           const char* src, size_t spitch, size_t units_per_row,
                                           size_t rows) {
  const size_t total = units_per_row * rows;
  for (size_t base = t; base < total; base += kCopyUnroll * threads) {
    V v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const size_t i = base + u * threads;
      if (i < total) {
        const size_t row = i / units_per_row, unit = i % units_per_row;
        v[u] = reinterpret_cast<const V*>(src + row * spitch)[unit];
      }
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const size_t i = base + u * threads;
      if (i < total) {
        const size_t row = i / units_per_row, unit = i % units_per_row;
        reinterpret_cast<V*>(dst + row * dpitch)[unit] = v[u];
      }
    }
  }
}

// The widest unit (16, 4 or 1 bytes) that every address, the row width and
// (with several rows) the pitches are multiples of.
inline size_t CopyUnitBytes(const void* dst, size_t dpitch, const void* src, size_t spitch,
                            size_t width, size_t rows) {
  for (size_t a : {size_t(16), size_t(4)}) {
    if (uintptr_t(dst) % a == 0 && uintptr_t(src) % a == 0 && width % a == 0 &&
        (rows <= 1 || (dpitch % a == 0 && spitch % a == 0)))
      return a;
  }
  return 1;
}

}  // namespace cuda
}  // namespace smddp

#endif  // JAX_SMDDP_CUDA_COPY_BODY_CUH_

// What one thread of a reduction kernel does (cuda/kernels.cu), written once
// for the GPU and for the host: a host test (tests/native/reduce_body_test.cu,
// built by nvcc and run on the CPU) runs every thread of a launch in turn and
// checks the indexing, vector widths and tails against numpy.
//
// Why vectors: a thread keeps one load per source in flight, so within the SM
// budget (8 blocks of 512 threads) the bytes in flight, and by Little's law
// the bandwidth, grow with the load's width. 4-byte loads allow ~32 KiB in
// flight for two sources, ~50 GB/s at HBM latency, which is about what the
// H100 measured for reduce_scatter (24 to 45 GB/s); 16-byte loads allow 4x
// that (8x for 16-bit floats).
#ifndef JAX_SMDDP_CUDA_REDUCE_BODY_CUH_
#define JAX_SMDDP_CUDA_REDUCE_BODY_CUH_

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/kernels.h"  // Reduction, kMaxSources

namespace smddp {
namespace cuda {

struct Sources {
  const void* p[kMaxSources];
};

// 16-bit floats are loaded into f32 and rounded once when stored.
template <typename T, typename A>
struct Convert {
  __host__ __device__ static A Load(T v) { return A(v); }
  __host__ __device__ static T Store(A v) { return T(v); }
};
template <>
struct Convert<__half, float> {
  __host__ __device__ static float Load(__half v) { return __half2float(v); }
  __host__ __device__ static __half Store(float v) { return __float2half_rn(v); }
};
template <>
struct Convert<__nv_bfloat16, float> {
  __host__ __device__ static float Load(__nv_bfloat16 v) { return __bfloat162float(v); }
  __host__ __device__ static __nv_bfloat16 Store(float v) { return __float2bfloat16_rn(v); }
};

template <Reduction R>
struct Combine {
  template <typename A>
  __host__ __device__ static A Apply(A a, A b) {
    if (R == Reduction::kSum) return a + b;
    if (R == Reduction::kMax) return b > a ? b : a;
    return b < a ? b : a;
  }
};

// V elements moved as one load or store (16 bytes when V * sizeof(T) is).
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

// Thread `t` of `threads`: dst row r = op over srcs[k] row r, rows of
// `count` elements, V at a time. V > 1 needs every address and pitch, and
// count * sizeof(T), to be multiples of V * sizeof(T) (VectorWidth).
template <typename T, typename A, Reduction R, int V>
__host__ __device__ inline void ReduceThread(size_t t, size_t threads, char* dst, size_t dpitch,
                                             const Sources& srcs, int n, size_t spitch,
                                             size_t count, size_t rows) {
  const size_t per_row = count / V;  // vectors per row
  const size_t total = per_row * rows;
  for (size_t i = t; i < total; i += threads) {
    const size_t row = i / per_row, e = (i % per_row) * V;
    const size_t offset = row * spitch + e * sizeof(T);
    const Vec<T, V> first = *reinterpret_cast<const Vec<T, V>*>(
        static_cast<const char*>(srcs.p[0]) + offset);
    A acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = Convert<T, A>::Load(first.v[j]);
#pragma unroll 4
    for (int k = 1; k < n; ++k) {  // unrolled: several sources' loads in flight at once
      const Vec<T, V> v = *reinterpret_cast<const Vec<T, V>*>(
          static_cast<const char*>(srcs.p[k]) + offset);
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] = Combine<R>::Apply(acc[j], Convert<T, A>::Load(v.v[j]));
    }
    Vec<T, V> out;
#pragma unroll
    for (int j = 0; j < V; ++j) out.v[j] = Convert<T, A>::Store(acc[j]);
    *reinterpret_cast<Vec<T, V>*>(dst + row * dpitch + e * sizeof(T)) = out;
  }
}

// The widest vector (in elements of `element_bytes`) that a reduction's
// addresses, pitches and row length allow: 16 bytes' worth, or 1.
// (Pitches matter only with several rows.)
inline int VectorWidth(const void* dst, size_t dpitch, const Sources& srcs, int n, size_t spitch,
                       size_t count, size_t rows, size_t element_bytes) {
  constexpr size_t kBytes = 16;
  if (element_bytes == 0 || element_bytes >= kBytes || kBytes % element_bytes) return 1;
  bool ok = uintptr_t(dst) % kBytes == 0 && (count * element_bytes) % kBytes == 0 &&
            (rows <= 1 || (dpitch % kBytes == 0 && spitch % kBytes == 0));
  for (int k = 0; ok && k < n; ++k) ok = uintptr_t(srcs.p[k]) % kBytes == 0;
  return ok ? int(kBytes / element_bytes) : 1;
}

}  // namespace cuda
}  // namespace smddp

#endif  // JAX_SMDDP_CUDA_REDUCE_BODY_CUH_

// What one thread of a reduction kernel does (cuda/kernels.cu), written once
// for the GPU and for the host: a host test (tests/native/reduce_body_test.cu,
// built by nvcc and run on the CPU) runs every thread of a launch in turn and
// checks the indexing, vector widths and tails against numpy.
//
// Why vectors and unrolling: within the SM budget (8 blocks of 512 threads)
// the bytes in flight, and by Little's law the bandwidth, grow with the
// loads each thread has outstanding. 4-byte loads, one per source, allow
// ~32 KiB in flight for two sources, ~50 GB/s at HBM latency (the H100
// measured 24 to 45 GB/s); 16-byte loads allow 4x that, and ReduceUnroll
// vectors per thread at once up to 4x again.
#ifndef JAX_SMDDP_CUDA_REDUCE_BODY_CUH_
#define JAX_SMDDP_CUDA_REDUCE_BODY_CUH_

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/kernels.h"  // kMaxSources (and DType, ReduceOp)

namespace smddp {
namespace cuda {

struct Sources {
  const void* p[kMaxSources];
};

// Where one reduction's result goes: every destination gets the same rows
// (all_reduce in one round writes each rank's output at once).
struct Destinations {
  void* p[kMaxSources];
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

template <ReduceOp R>
struct Combine {
  template <typename A>
  __host__ __device__ static A Apply(A a, A b) {
    if (R == ReduceOp::kSum) return a + b;
    if (R == ReduceOp::kMax) return b > a ? b : a;
    return b < a ? b : a;
  }
};

// V elements moved as one load or store (16 bytes when V * sizeof(T) is).
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

// Vectors a thread reduces at once: 4, fewer for the widest vectors (16
// int8 per load), so that its accumulators (U x V) stay in registers within
// the launch bound of 512 threads per block.
template <int V>
__host__ __device__ constexpr int ReduceUnroll() {
  return V * 4 <= 32 ? 4 : 32 / V;
}

// Thread `t` of `threads`: dst row r = op over srcs[k] row r, rows of
// `count` elements, V at a time. V > 1 needs every address and pitch, and
// count * sizeof(T), to be multiples of V * sizeof(T) (VectorWidth).
// Thread t reduces vectors t, t + threads, ..., ReduceUnroll<V>() of them at
// once: each source's loads are issued before any is combined,
// so a thread keeps ReduceUnroll x (sources in the unrolled loop) loads in
// flight instead of one per source (H200: 8 blocks reached 75 GB/s with one).
// ReduceThreadTo writes the result into each of `nd` destinations of one
// pitch (the loads are made once, the stores nd times).
template <typename T, typename A, ReduceOp R, int V, int U = ReduceUnroll<V>()>
__host__ __device__ inline void ReduceThreadTo(size_t t, size_t threads, const Destinations& dsts,
                                               int nd, size_t dpitch, const Sources& srcs, int n,
                                               size_t spitch, size_t count, size_t rows) {
  const size_t per_row = count / V;  // vectors per row
  const size_t total = per_row * rows;
  for (size_t base = t; base < total; base += U * threads) {
    size_t soff[U], doff[U];  // byte offsets of this thread's vectors; rows == 1 needs no division
    bool live[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t i = base + u * threads;
      live[u] = i < total;
      const size_t row = rows == 1 ? 0 : i / per_row, e = (rows == 1 ? i : i % per_row) * V;
      soff[u] = row * spitch + e * sizeof(T);
      doff[u] = row * dpitch + e * sizeof(T);
    }
    A acc[U][V];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (!live[u]) continue;
      const Vec<T, V> first =
          *reinterpret_cast<const Vec<T, V>*>(static_cast<const char*>(srcs.p[0]) + soff[u]);
#pragma unroll
      for (int j = 0; j < V; ++j) acc[u][j] = Convert<T, A>::Load(first.v[j]);
    }
#pragma unroll 2
    for (int k = 1; k < n; ++k) {
      const char* src = static_cast<const char*>(srcs.p[k]);
      Vec<T, V> v[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (live[u]) v[u] = *reinterpret_cast<const Vec<T, V>*>(src + soff[u]);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (!live[u]) continue;
#pragma unroll
        for (int j = 0; j < V; ++j)
          acc[u][j] = Combine<R>::Apply(acc[u][j], Convert<T, A>::Load(v[u].v[j]));
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (!live[u]) continue;
      Vec<T, V> out;
#pragma unroll
      for (int j = 0; j < V; ++j) out.v[j] = Convert<T, A>::Store(acc[u][j]);
      for (int d = 0; d < nd; ++d)
        *reinterpret_cast<Vec<T, V>*>(static_cast<char*>(dsts.p[d]) + doff[u]) = out;
    }
  }
}

template <typename T, typename A, ReduceOp R, int V, int U = ReduceUnroll<V>()>
__host__ __device__ inline void ReduceThread(size_t t, size_t threads, char* dst, size_t dpitch,
                                             const Sources& srcs, int n, size_t spitch,
                                             size_t count, size_t rows) {
  Destinations one{};
  one.p[0] = dst;
  ReduceThreadTo<T, A, R, V, U>(t, threads, one, 1, dpitch, srcs, n, spitch, count, rows);
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

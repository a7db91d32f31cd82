#include "cuda/kernels.h"

#include <algorithm>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace smddp {
namespace cuda {
namespace {

constexpr int kThreads = 512;

int Blocks(size_t work, int max_blocks) {
  const size_t wanted = (work + kThreads - 1) / kThreads;
  return int(std::max<size_t>(1, std::min<size_t>(wanted, size_t(std::max(1, max_blocks)))));
}

// Grid-stride copy in units of V (16, 4 or 1 bytes, whatever all addresses
// and pitches allow).
template <typename V>
__global__ void Copy2DKernel(char* dst, size_t dpitch, const char* src, size_t spitch,
                             size_t units_per_row, size_t rows) {
  const size_t total = units_per_row * rows;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total;
       i += size_t(gridDim.x) * blockDim.x) {
    const size_t row = i / units_per_row, unit = i % units_per_row;
    reinterpret_cast<V*>(dst + row * dpitch)[unit] =
        reinterpret_cast<const V*>(src + row * spitch)[unit];
  }
}

bool Aligned(size_t v, size_t a) { return v % a == 0; }

struct Sources {
  const void* p[kMaxSources];
};

template <typename T, typename A>
struct Convert {
  __device__ static A Load(T v) { return A(v); }
  __device__ static T Store(A v) { return T(v); }
};
template <>
struct Convert<__half, float> {
  __device__ static float Load(__half v) { return __half2float(v); }
  __device__ static __half Store(float v) { return __float2half_rn(v); }
};
template <>
struct Convert<__nv_bfloat16, float> {
  __device__ static float Load(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 Store(float v) { return __float2bfloat16_rn(v); }
};

template <Reduction R>
struct Combine {
  template <typename A>
  __device__ static A Apply(A a, A b) {
    if (R == Reduction::kSum) return a + b;
    if (R == Reduction::kMax) return b > a ? b : a;
    return b < a ? b : a;
  }
};

template <typename T, typename A, Reduction R>
__global__ void ReduceKernel(char* dst, size_t dpitch, Sources srcs, int n, size_t spitch,
                             size_t count, size_t rows) {
  const size_t total = count * rows;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total;
       i += size_t(gridDim.x) * blockDim.x) {
    const size_t row = i / count, e = i % count;
    const size_t offset = row * spitch;
    A acc = Convert<T, A>::Load(reinterpret_cast<const T*>(static_cast<const char*>(srcs.p[0]) + offset)[e]);
    for (int k = 1; k < n; ++k) {
      const T v = reinterpret_cast<const T*>(static_cast<const char*>(srcs.p[k]) + offset)[e];
      acc = Combine<R>::Apply(acc, Convert<T, A>::Load(v));
    }
    reinterpret_cast<T*>(dst + row * dpitch)[e] = Convert<T, A>::Store(acc);
  }
}

template <typename T, typename A>
cudaError_t ReduceTyped(void* dst, size_t dpitch, const Sources& s, int n, size_t spitch,
                        size_t count, size_t rows, Reduction op, int blocks, cudaStream_t stream) {
  char* d = static_cast<char*>(dst);
  switch (op) {
    case Reduction::kSum:
      ReduceKernel<T, A, Reduction::kSum><<<blocks, kThreads, 0, stream>>>(d, dpitch, s, n, spitch, count, rows);
      break;
    case Reduction::kMax:
      ReduceKernel<T, A, Reduction::kMax><<<blocks, kThreads, 0, stream>>>(d, dpitch, s, n, spitch, count, rows);
      break;
    case Reduction::kMin:
      ReduceKernel<T, A, Reduction::kMin><<<blocks, kThreads, 0, stream>>>(d, dpitch, s, n, spitch, count, rows);
      break;
  }
  return cudaGetLastError();
}

cudaError_t ReducePass(void* dst, size_t dpitch, const Sources& s, int n, size_t spitch,
                       size_t count, size_t rows, ElementType type, Reduction op, int blocks,
                       cudaStream_t stream) {
  switch (type) {
    case ElementType::kInt8: return ReduceTyped<int8_t, int32_t>(dst, dpitch, s, n, spitch, count, rows, op, blocks, stream);
    case ElementType::kUInt8: return ReduceTyped<uint8_t, uint32_t>(dst, dpitch, s, n, spitch, count, rows, op, blocks, stream);
    case ElementType::kInt32: return ReduceTyped<int32_t, int32_t>(dst, dpitch, s, n, spitch, count, rows, op, blocks, stream);
    case ElementType::kUInt32: return ReduceTyped<uint32_t, uint32_t>(dst, dpitch, s, n, spitch, count, rows, op, blocks, stream);
    case ElementType::kInt64: return ReduceTyped<int64_t, int64_t>(dst, dpitch, s, n, spitch, count, rows, op, blocks, stream);
    case ElementType::kFloat16: return ReduceTyped<__half, float>(dst, dpitch, s, n, spitch, count, rows, op, blocks, stream);
    case ElementType::kBFloat16: return ReduceTyped<__nv_bfloat16, float>(dst, dpitch, s, n, spitch, count, rows, op, blocks, stream);
    case ElementType::kFloat32: return ReduceTyped<float, float>(dst, dpitch, s, n, spitch, count, rows, op, blocks, stream);
    case ElementType::kFloat64: return ReduceTyped<double, double>(dst, dpitch, s, n, spitch, count, rows, op, blocks, stream);
    case ElementType::kBool: break;
  }
  return cudaErrorInvalidValue;
}

__global__ void WaitFlagKernel(const volatile uint32_t* flag, uint32_t value) {
  while (int32_t(*flag - value) < 0) __nanosleep(200);  // as CU_STREAM_WAIT_VALUE_GEQ: cyclic
  __threadfence_system();  // later reads see what the flag's writer published
}

__global__ void WriteFlagKernel(volatile uint32_t* flag, uint32_t value) {
  __threadfence_system();
  *flag = value;
}

}  // namespace

cudaError_t LaunchCopy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                         size_t rows, int max_blocks, cudaStream_t stream) {
  if (width == 0 || rows == 0) return cudaSuccess;
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  auto all = [&](size_t a) {
    return Aligned(uintptr_t(d), a) && Aligned(uintptr_t(s), a) && Aligned(dpitch, a) &&
           Aligned(spitch, a) && Aligned(width, a);
  };
  if (all(16)) {
    Copy2DKernel<uint4><<<Blocks(width / 16 * rows, max_blocks), kThreads, 0, stream>>>(d, dpitch, s, spitch, width / 16, rows);
  } else if (all(4)) {
    Copy2DKernel<uint32_t><<<Blocks(width / 4 * rows, max_blocks), kThreads, 0, stream>>>(d, dpitch, s, spitch, width / 4, rows);
  } else {
    Copy2DKernel<uint8_t><<<Blocks(width * rows, max_blocks), kThreads, 0, stream>>>(d, dpitch, s, spitch, width, rows);
  }
  return cudaGetLastError();
}

cudaError_t LaunchReduce(void* dst, size_t dpitch, const void* const* srcs, int n, size_t spitch,
                         size_t count, size_t rows, ElementType type, Reduction op, int max_blocks,
                         cudaStream_t stream) {
  if (count == 0 || rows == 0) return cudaSuccess;
  if (n <= 0) return cudaErrorInvalidValue;
  const int blocks = Blocks(count * rows, max_blocks);
  // First pass: up to kMaxSources sources; later passes fold dst in first.
  Sources s{};
  int used = std::min(n, kMaxSources);
  for (int k = 0; k < used; ++k) s.p[k] = srcs[k];
  cudaError_t err = ReducePass(dst, dpitch, s, used, spitch, count, rows, type, op, blocks, stream);
  while (err == cudaSuccess && used < n) {
    // dst has its own pitch: only row-contiguous layouts (rows == 1 or equal
    // pitches) can fold it in as a source.
    if (rows > 1 && dpitch != spitch) return cudaErrorInvalidValue;
    const int take = std::min(n - used, kMaxSources - 1);
    s.p[0] = dst;
    for (int k = 0; k < take; ++k) s.p[1 + k] = srcs[used + k];
    err = ReducePass(dst, dpitch, s, 1 + take, spitch, count, rows, type, op, blocks, stream);
    used += take;
  }
  return err;
}

cudaError_t LaunchWaitFlag(const uint32_t* flag, uint32_t value, cudaStream_t stream) {
  WaitFlagKernel<<<1, 1, 0, stream>>>(flag, value);
  return cudaGetLastError();
}

cudaError_t LaunchWriteFlag(uint32_t* flag, uint32_t value, cudaStream_t stream) {
  WriteFlagKernel<<<1, 1, 0, stream>>>(flag, value);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace smddp

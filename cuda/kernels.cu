#include "cuda/kernels.h"

#include <algorithm>

#include "cuda/copy_body.cuh"
#include "cuda/reduce_body.cuh"

namespace smddp {
namespace cuda {
namespace {

constexpr int kThreads = 512;

int Blocks(size_t work, int max_blocks) {
  const size_t wanted = (work + kThreads - 1) / kThreads;
  return int(std::max<size_t>(1, std::min<size_t>(wanted, size_t(std::max(1, max_blocks)))));
}

// Grid-stride copy in units of V (cuda/copy_body.cuh).
template <typename V>
__global__ void __launch_bounds__(kThreads)
    Copy2DKernel(char* dst, size_t dpitch, const char* src, size_t spitch, size_t units_per_row,
                 size_t rows) {
  CopyThread<V>(blockIdx.x * size_t(blockDim.x) + threadIdx.x, size_t(gridDim.x) * blockDim.x, dst,
                dpitch, src, spitch, units_per_row, rows);
}

template <typename T, typename A, ReduceOp R, int V>
__global__ void __launch_bounds__(kThreads)
    ReduceKernel(char* dst, size_t dpitch, Sources srcs, int n, size_t spitch, size_t count,
                 size_t rows) {
  ReduceThread<T, A, R, V>(blockIdx.x * size_t(blockDim.x) + threadIdx.x,
                           size_t(gridDim.x) * blockDim.x, dst, dpitch, srcs, n, spitch, count,
                           rows);
}

// One launch of op over the sources, V elements per load where the layout
// allows 16-byte vectors, else one (cuda/reduce_body.cuh).
template <typename T, typename A, ReduceOp R>
void LaunchReduceOp(char* d, size_t dpitch, const Sources& s, int n, size_t spitch, size_t count,
                    size_t rows, int max_blocks, cudaStream_t stream) {
  constexpr int kVector = sizeof(T) < 16 ? int(16 / sizeof(T)) : 1;
  if (kVector > 1 && VectorWidth(d, dpitch, s, n, spitch, count, rows, sizeof(T)) == kVector) {
    const size_t vectors = count / kVector * rows;
    ReduceKernel<T, A, R, kVector>
        <<<Blocks((vectors + ReduceUnroll<kVector>() - 1) / ReduceUnroll<kVector>(), max_blocks),
           kThreads, 0, stream>>>(d, dpitch, s, n, spitch, count, rows);
  } else {
    ReduceKernel<T, A, R, 1>
        <<<Blocks((count * rows + ReduceUnroll<1>() - 1) / ReduceUnroll<1>(), max_blocks), kThreads,
           0, stream>>>(d, dpitch, s, n, spitch, count, rows);
  }
}

template <typename T, typename A>
cudaError_t ReduceTyped(void* dst, size_t dpitch, const Sources& s, int n, size_t spitch,
                        size_t count, size_t rows, ReduceOp op, int max_blocks,
                        cudaStream_t stream) {
  char* d = static_cast<char*>(dst);
  switch (op) {
    case ReduceOp::kSum:
      LaunchReduceOp<T, A, ReduceOp::kSum>(d, dpitch, s, n, spitch, count, rows, max_blocks,
                                           stream);
      break;
    case ReduceOp::kMax:
      LaunchReduceOp<T, A, ReduceOp::kMax>(d, dpitch, s, n, spitch, count, rows, max_blocks,
                                           stream);
      break;
    case ReduceOp::kMin:
      LaunchReduceOp<T, A, ReduceOp::kMin>(d, dpitch, s, n, spitch, count, rows, max_blocks,
                                           stream);
      break;
  }
  return cudaGetLastError();
}

cudaError_t ReducePass(void* dst, size_t dpitch, const Sources& s, int n, size_t spitch,
                       size_t count, size_t rows, DType type, ReduceOp op, int max_blocks,
                       cudaStream_t stream) {
  switch (type) {
    case DType::kInt8:
      return ReduceTyped<int8_t, int32_t>(dst, dpitch, s, n, spitch, count, rows, op, max_blocks,
                                          stream);
    case DType::kUInt8:
      return ReduceTyped<uint8_t, uint32_t>(dst, dpitch, s, n, spitch, count, rows, op, max_blocks,
                                            stream);
    case DType::kInt32:
      return ReduceTyped<int32_t, int32_t>(dst, dpitch, s, n, spitch, count, rows, op, max_blocks,
                                           stream);
    case DType::kUInt32:
      return ReduceTyped<uint32_t, uint32_t>(dst, dpitch, s, n, spitch, count, rows, op, max_blocks,
                                             stream);
    case DType::kInt64:
      return ReduceTyped<int64_t, int64_t>(dst, dpitch, s, n, spitch, count, rows, op, max_blocks,
                                           stream);
    case DType::kFloat16:
      return ReduceTyped<__half, float>(dst, dpitch, s, n, spitch, count, rows, op, max_blocks,
                                        stream);
    case DType::kBFloat16:
      return ReduceTyped<__nv_bfloat16, float>(dst, dpitch, s, n, spitch, count, rows, op,
                                               max_blocks, stream);
    case DType::kFloat32:
      return ReduceTyped<float, float>(dst, dpitch, s, n, spitch, count, rows, op, max_blocks,
                                       stream);
    case DType::kFloat64:
      return ReduceTyped<double, double>(dst, dpitch, s, n, spitch, count, rows, op, max_blocks,
                                         stream);
    case DType::kBool:
      break;
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
  const size_t unit = CopyUnitBytes(d, dpitch, s, spitch, width, rows);
  const size_t units = width / unit * rows;
  const int blocks = Blocks((units + kCopyUnroll - 1) / kCopyUnroll, max_blocks);
  if (unit == 16) {
    Copy2DKernel<uint4><<<blocks, kThreads, 0, stream>>>(d, dpitch, s, spitch, width / 16, rows);
  } else if (unit == 4) {
    Copy2DKernel<uint32_t><<<blocks, kThreads, 0, stream>>>(d, dpitch, s, spitch, width / 4, rows);
  } else {
    Copy2DKernel<uint8_t><<<blocks, kThreads, 0, stream>>>(d, dpitch, s, spitch, width, rows);
  }
  return cudaGetLastError();
}

cudaError_t LaunchReduce(void* dst, size_t dpitch, const void* const* srcs, int n, size_t spitch,
                         size_t count, size_t rows, DType type, ReduceOp op, int max_blocks,
                         cudaStream_t stream) {
  if (count == 0 || rows == 0) return cudaSuccess;
  if (n <= 0) return cudaErrorInvalidValue;
  // First pass: up to kMaxSources sources; later passes fold dst in first.
  Sources s{};
  int used = std::min(n, kMaxSources);
  for (int k = 0; k < used; ++k) s.p[k] = srcs[k];
  cudaError_t err =
      ReducePass(dst, dpitch, s, used, spitch, count, rows, type, op, max_blocks, stream);
  while (err == cudaSuccess && used < n) {
    // dst has its own pitch: only row-contiguous layouts (rows == 1 or equal
    // pitches) can fold it in as a source.
    if (rows > 1 && dpitch != spitch) return cudaErrorInvalidValue;
    const int take = std::min(n - used, kMaxSources - 1);
    s.p[0] = dst;
    for (int k = 0; k < take; ++k) s.p[1 + k] = srcs[used + k];
    err = ReducePass(dst, dpitch, s, 1 + take, spitch, count, rows, type, op, max_blocks, stream);
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

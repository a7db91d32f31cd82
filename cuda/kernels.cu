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

template <typename T, typename A, ReduceOp R, int V, int U>
__global__ void __launch_bounds__(kThreads)
    ReduceKernel(Destinations dsts, int nd, size_t dpitch, Sources srcs, int n, size_t spitch,
                 size_t count, size_t rows) {
  ReduceThreadTo<T, A, R, V, U>(blockIdx.x * size_t(blockDim.x) + threadIdx.x,
                                size_t(gridDim.x) * blockDim.x, dsts, nd, dpitch, srcs, n, spitch,
                                count, rows);
}

// One launch of op over the sources into each destination, V elements per
// load where the layout allows 16-byte vectors, else one
// (cuda/reduce_body.cuh). `unroll` 2: twice the vectors in flight per thread
// (only where the accumulators still fit in registers; else as 1).
template <typename T, typename A, ReduceOp R>
void LaunchReduceOp(const Destinations& d, int nd, size_t dpitch, const Sources& s, int n,
                    size_t spitch, size_t count, size_t rows, int max_blocks, int unroll,
                    cudaStream_t stream) {
  constexpr int kVector = sizeof(T) < 16 ? int(16 / sizeof(T)) : 1;
  bool vector = kVector > 1;
  for (int k = 0; vector && k < nd; ++k)
    vector = VectorWidth(d.p[k], dpitch, s, n, spitch, count, rows, sizeof(T)) == kVector;
  if (vector) {
    constexpr int U = ReduceUnroll<kVector>();
    const size_t vectors = count / kVector * rows;
    if constexpr (U * kVector <= 16) {  // 4- and 8-byte elements
      if (unroll == 2) {
        ReduceKernel<T, A, R, kVector, 2 * U>
            <<<Blocks((vectors + 2 * U - 1) / (2 * U), max_blocks), kThreads, 0, stream>>>(
                d, nd, dpitch, s, n, spitch, count, rows);
        return;
      }
    }
    ReduceKernel<T, A, R, kVector, U>
        <<<Blocks((vectors + U - 1) / U, max_blocks), kThreads, 0, stream>>>(d, nd, dpitch, s, n,
                                                                             spitch, count, rows);
  } else {
    constexpr int U = ReduceUnroll<1>();
    ReduceKernel<T, A, R, 1, U>
        <<<Blocks((count * rows + U - 1) / U, max_blocks), kThreads, 0, stream>>>(
            d, nd, dpitch, s, n, spitch, count, rows);
  }
}

template <typename T, typename A>
cudaError_t ReduceTyped(const Destinations& d, int nd, size_t dpitch, const Sources& s, int n,
                        size_t spitch, size_t count, size_t rows, ReduceOp op, int max_blocks,
                        int unroll, cudaStream_t stream) {
  switch (op) {
    case ReduceOp::kSum:
      LaunchReduceOp<T, A, ReduceOp::kSum>(d, nd, dpitch, s, n, spitch, count, rows, max_blocks,
                                           unroll, stream);
      break;
    case ReduceOp::kMax:
      LaunchReduceOp<T, A, ReduceOp::kMax>(d, nd, dpitch, s, n, spitch, count, rows, max_blocks,
                                           unroll, stream);
      break;
    case ReduceOp::kMin:
      LaunchReduceOp<T, A, ReduceOp::kMin>(d, nd, dpitch, s, n, spitch, count, rows, max_blocks,
                                           unroll, stream);
      break;
  }
  return cudaGetLastError();
}

cudaError_t ReducePass(const Destinations& d, int nd, size_t dpitch, const Sources& s, int n,
                       size_t spitch, size_t count, size_t rows, DType type, ReduceOp op,
                       int max_blocks, int unroll, cudaStream_t stream) {
#define SMDDP_REDUCE_AS(T, A) \
  ReduceTyped<T, A>(d, nd, dpitch, s, n, spitch, count, rows, op, max_blocks, unroll, stream)
  switch (type) {
    case DType::kInt8:
      return SMDDP_REDUCE_AS(int8_t, int32_t);
    case DType::kUInt8:
      return SMDDP_REDUCE_AS(uint8_t, uint32_t);
    case DType::kInt32:
      return SMDDP_REDUCE_AS(int32_t, int32_t);
    case DType::kUInt32:
      return SMDDP_REDUCE_AS(uint32_t, uint32_t);
    case DType::kInt64:
      return SMDDP_REDUCE_AS(int64_t, int64_t);
    case DType::kFloat16:
      return SMDDP_REDUCE_AS(__half, float);
    case DType::kBFloat16:
      return SMDDP_REDUCE_AS(__nv_bfloat16, float);
    case DType::kFloat32:
      return SMDDP_REDUCE_AS(float, float);
    case DType::kFloat64:
      return SMDDP_REDUCE_AS(double, double);
    case DType::kBool:
      break;
  }
#undef SMDDP_REDUCE_AS
  return cudaErrorInvalidValue;
}

// The device exchange's kernels (kernels.h: LaunchWriteWords, ...).
struct Words {
  uint64_t w[8];
};

__global__ void WriteWordsKernel(volatile uint64_t* dst, Words v, int n) {
  for (int i = 0; i < n; ++i) dst[i] = v.w[i];
  __threadfence_system();  // before the post that follows on the stream
}

__global__ void ResolveKernel(volatile uint64_t* out, const volatile uint64_t* entry,
                              uint64_t stamp, int which, const volatile uint64_t* table,
                              const volatile uint32_t* released, const volatile uint32_t* posted) {
  if (entry[0] != stamp) {
    // Another call's entry: the group failed (a watchdog released the peer's
    // flags, and the peer ran ahead), or a protocol bug. The peer's process
    // may have seen the failure first: this one's watchdog releases within
    // ~50 ms, so wait for it a while before calling it a bug.
    uint64_t t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    for (;;) {
      if ((released && *released) ||
          (posted && int32_t(*posted - uint32_t(stamp)) >= int32_t(1u << 29))) {
        *out = 0;
        return;
      }
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
      if (t - t0 > kStaleEntryGraceNs) __trap();  // never read a stale address
      __nanosleep(1000);
    }
  }
  const uint64_t id1 = entry[1 + 3 * which], offset = entry[2 + 3 * which];
  if (!table || id1 == 0) {
    *out = entry[3 + 3 * which];
    return;
  }
  const volatile uint64_t* slot = table + 2 * (id1 - 1);
  while (*slot != id1) {  // the mapper thread maps it, or the group failed
    if ((released && *released) ||
        (posted && int32_t(*posted - uint32_t(stamp)) >= int32_t(1u << 29))) {
      *out = 0;
      return;
    }
    __nanosleep(500);
  }
  __threadfence_system();
  *out = slot[1] + offset;
}

// The unit chosen per launch from the address read (the same for every thread).
__global__ void __launch_bounds__(kThreads)
    Copy2DFromKernel(char* dst, size_t dpitch, const uint64_t* src_at, size_t src_add,
                     size_t spitch, size_t width, size_t rows) {
  const uint64_t at = *src_at;
  if (at == 0) return;  // released
  const char* src = reinterpret_cast<const char*>(at + src_add);
  const size_t t = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  const size_t threads = size_t(gridDim.x) * blockDim.x;
  const uintptr_t all = uintptr_t(dst) | uintptr_t(src) | dpitch | spitch | width;
  if (all % 16 == 0) {
    CopyThread<uint4>(t, threads, dst, dpitch, src, spitch, width / 16, rows);
  } else if (all % 4 == 0) {
    CopyThread<uint32_t>(t, threads, dst, dpitch, src, spitch, width / 4, rows);
  } else {
    CopyThread<uint8_t>(t, threads, dst, dpitch, src, spitch, width, rows);
  }
}

template <typename T, typename A, ReduceOp R>
__global__ void __launch_bounds__(kThreads)
    ReduceFromKernel(const uint64_t* dsts_at, int nd, size_t dst_add, size_t dpitch,
                     const uint64_t* srcs_at, int n, size_t src_add, size_t spitch, size_t count,
                     size_t rows) {
  Sources s;
  Destinations d;
  for (int k = 0; k < n; ++k) {
    if (srcs_at[k] == 0) return;  // released
    s.p[k] = reinterpret_cast<const void*>(srcs_at[k] + src_add);
  }
  if (!dsts_at) {
    d.p[0] = reinterpret_cast<void*>(dst_add);
    nd = 1;
  }
  for (int k = 0; dsts_at && k < nd; ++k) {
    if (dsts_at[k] == 0) return;
    d.p[k] = reinterpret_cast<void*>(dsts_at[k] + dst_add);
  }
  ReduceThreadTo<T, A, R, 1, 1>(blockIdx.x * size_t(blockDim.x) + threadIdx.x,
                                size_t(gridDim.x) * blockDim.x, d, nd, dpitch, s, n, spitch, count,
                                rows);
}

template <typename T, typename A>
cudaError_t ReduceFromTyped(const uint64_t* dsts_at, int nd, size_t dst_add, size_t dpitch,
                            const uint64_t* srcs_at, int n, size_t src_add, size_t spitch,
                            size_t count, size_t rows, ReduceOp op, int max_blocks,
                            cudaStream_t stream) {
  const int blocks = Blocks(count * rows, max_blocks);
#define SMDDP_REDUCE_FROM(R)                                  \
  ReduceFromKernel<T, A, R><<<blocks, kThreads, 0, stream>>>( \
      dsts_at, nd, dst_add, dpitch, srcs_at, n, src_add, spitch, count, rows)
  switch (op) {
    case ReduceOp::kSum:
      SMDDP_REDUCE_FROM(ReduceOp::kSum);
      break;
    case ReduceOp::kMax:
      SMDDP_REDUCE_FROM(ReduceOp::kMax);
      break;
    case ReduceOp::kMin:
      SMDDP_REDUCE_FROM(ReduceOp::kMin);
      break;
  }
#undef SMDDP_REDUCE_FROM
  return cudaGetLastError();
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
                         cudaStream_t stream, int unroll) {
  return LaunchReduceToEach(&dst, 1, dpitch, srcs, n, spitch, count, rows, type, op, max_blocks,
                            stream, unroll);
}

cudaError_t LaunchReduceToEach(void* const* dsts, int nd, size_t dpitch, const void* const* srcs,
                               int n, size_t spitch, size_t count, size_t rows, DType type,
                               ReduceOp op, int max_blocks, cudaStream_t stream, int unroll) {
  if (count == 0 || rows == 0 || nd == 0) return cudaSuccess;
  if (n <= 0 || nd < 0 || nd > kMaxSources) return cudaErrorInvalidValue;
  Destinations d{};
  for (int k = 0; k < nd; ++k) d.p[k] = dsts[k];
  // More sources than one pass reads: the earlier passes fold into the first
  // destination alone, the last one writes them all.
  Destinations first{};
  first.p[0] = dsts[0];
  Sources s{};
  int used = std::min(n, kMaxSources);
  for (int k = 0; k < used; ++k) s.p[k] = srcs[k];
  cudaError_t err = ReducePass(used == n ? d : first, used == n ? nd : 1, dpitch, s, used, spitch,
                               count, rows, type, op, max_blocks, unroll, stream);
  while (err == cudaSuccess && used < n) {
    // dst has its own pitch: only row-contiguous layouts (rows == 1 or equal
    // pitches) can fold it in as a source.
    if (rows > 1 && dpitch != spitch) return cudaErrorInvalidValue;
    const int take = std::min(n - used, kMaxSources - 1);
    s.p[0] = dsts[0];
    for (int k = 0; k < take; ++k) s.p[1 + k] = srcs[used + k];
    used += take;
    err = ReducePass(used == n ? d : first, used == n ? nd : 1, dpitch, s, 1 + take, spitch, count,
                     rows, type, op, max_blocks, unroll, stream);
  }
  return err;
}

cudaError_t LaunchWriteWords(uint64_t* dst, const uint64_t* values, int n, cudaStream_t stream) {
  if (n < 0 || n > 8) return cudaErrorInvalidValue;
  Words v{};
  for (int i = 0; i < n; ++i) v.w[i] = values[i];
  WriteWordsKernel<<<1, 1, 0, stream>>>(dst, v, n);
  return cudaGetLastError();
}

cudaError_t LaunchResolve(uint64_t* out, const uint64_t* entry, uint64_t stamp, int which,
                          const uint64_t* table, const uint32_t* released, const uint32_t* posted,
                          cudaStream_t stream) {
  ResolveKernel<<<1, 1, 0, stream>>>(out, entry, stamp, which, table, released, posted);
  return cudaGetLastError();
}

cudaError_t LaunchCopy2DFrom(void* dst, size_t dpitch, const uint64_t* src_at, size_t src_add,
                             size_t spitch, size_t width, size_t rows, int max_blocks,
                             cudaStream_t stream) {
  if (width == 0 || rows == 0) return cudaSuccess;
  const int blocks = Blocks((width / 16 * rows + kCopyUnroll - 1) / kCopyUnroll, max_blocks);
  Copy2DFromKernel<<<blocks, kThreads, 0, stream>>>(static_cast<char*>(dst), dpitch, src_at,
                                                    src_add, spitch, width, rows);
  return cudaGetLastError();
}

cudaError_t LaunchReduceFrom(const uint64_t* dsts_at, int nd, size_t dst_add, size_t dpitch,
                             const uint64_t* srcs_at, int n, size_t src_add, size_t spitch,
                             size_t count, size_t rows, DType type, ReduceOp op, int max_blocks,
                             cudaStream_t stream) {
  if (count == 0 || rows == 0) return cudaSuccess;
  if (n <= 0 || n > kMaxSources || nd <= 0 || nd > kMaxSources) return cudaErrorInvalidValue;
#define SMDDP_REDUCE_FROM_AS(T, A)                                                              \
  ReduceFromTyped<T, A>(dsts_at, nd, dst_add, dpitch, srcs_at, n, src_add, spitch, count, rows, \
                        op, max_blocks, stream)
  switch (type) {
    case DType::kInt8:
      return SMDDP_REDUCE_FROM_AS(int8_t, int32_t);
    case DType::kUInt8:
      return SMDDP_REDUCE_FROM_AS(uint8_t, uint32_t);
    case DType::kInt32:
      return SMDDP_REDUCE_FROM_AS(int32_t, int32_t);
    case DType::kUInt32:
      return SMDDP_REDUCE_FROM_AS(uint32_t, uint32_t);
    case DType::kInt64:
      return SMDDP_REDUCE_FROM_AS(int64_t, int64_t);
    case DType::kFloat16:
      return SMDDP_REDUCE_FROM_AS(__half, float);
    case DType::kBFloat16:
      return SMDDP_REDUCE_FROM_AS(__nv_bfloat16, float);
    case DType::kFloat32:
      return SMDDP_REDUCE_FROM_AS(float, float);
    case DType::kFloat64:
      return SMDDP_REDUCE_FROM_AS(double, double);
    case DType::kBool:
      break;
  }
#undef SMDDP_REDUCE_FROM_AS
  return cudaErrorInvalidValue;
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

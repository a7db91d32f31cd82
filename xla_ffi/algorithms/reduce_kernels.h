// The host reduction kernels, as templates, for the two translation units
// that compile them: reduce.cc (any CPU) and reduce_avx2.cc (compiled with
// -mavx2, called where the CPU has AVX2). Everything here has internal
// linkage (an unnamed namespace), so each unit keeps its own copy and the
// linker can never hand the baseline path a function built for AVX2; for the
// same reason this file calls no out-of-line std:: template.
#ifndef JAX_SMDDP_ALGORITHMS_REDUCE_KERNELS_H_
#define JAX_SMDDP_ALGORITHMS_REDUCE_KERNELS_H_

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "xla_ffi/common/dtype.h"

namespace smddp {

// Reduce() on a CPU with AVX2 (reduce_avx2.cc); false where this build has
// no AVX2 copy (not x86-64).
bool ReduceAvx2(DType dtype, ReduceOp op, const void* const* srcs, int n, void* out, size_t count);
// Reduce() with the baseline copy whatever the CPU (for the tests that
// compare the two).
void ReduceBaseline(DType dtype, ReduceOp op, const void* const* srcs, int n, void* out,
                    size_t count);

namespace {

inline float BitsToF32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t F32ToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float LoadBF16(uint16_t h) { return BitsToF32(uint32_t(h) << 16); }
inline uint16_t StoreBF16(float f) {
  uint32_t u = F32ToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                         // round to nearest even
  return uint16_t(u >> 16);
}

inline float LoadF16(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    float f = float(man) * (1.0f / 16777216.0f);
    return BitsToF32(F32ToBits(f) | sign);
  }
  if (exp == 31) return BitsToF32(sign | 0x7f800000u | (man << 13));
  return BitsToF32(sign | ((exp + 112u) << 23) | (man << 13));
}
inline uint16_t StoreF16(float f) {
  uint32_t x = F32ToBits(f);
  uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | 0x7c00u | (x > 0x7f800000u ? 0x200u : 0u);
  if (x >= 0x477ff000u) return sign | 0x7c00u;  // rounds to infinity
  if (x < 0x38800000u) {                        // below the smallest normal half: subnormal or zero
    return sign | uint16_t(std::lrintf(BitsToF32(x) * 16777216.0f));
  }
  x += 0xc8000fffu + ((x >> 13) & 1u);  // rebias exponent, round to nearest even
  return sign | uint16_t(x >> 13);
}

template <typename T>
inline T Identity(T v) {
  return v;
}

struct Sum {
  template <typename A>
  A operator()(A a, A b) const {
    return a + b;
  }
};
// Float max/min propagate NaN, as XLA's maximum/minimum do.
struct Max {
  template <typename A>
  A operator()(A a, A b) const {
    if constexpr (std::is_floating_point_v<A>) {
      if (a != a) return a;
      if (b != b) return b;
    }
    return a > b ? a : b;
  }
};
struct Min {
  template <typename A>
  A operator()(A a, A b) const {
    if constexpr (std::is_floating_point_v<A>) {
      if (a != a) return a;
      if (b != b) return b;
    }
    return a < b ? a : b;
  }
};

// Combines the sources block by block, three sources per pass over the block
// (fewer passes over the accumulator, few enough streams for the prefetcher),
// always in source order. When no conversion is needed the output block is
// the accumulator; otherwise an f32 stage in L1 is.
template <typename S, typename A, A (*Load)(S), S (*Store)(A), typename Op>
void ReduceBlocks(const void* const* srcs, int n, void* out, size_t count) {
  constexpr bool kInPlace = std::is_same_v<S, A>;
  constexpr size_t kBlock = kInPlace ? 16384 : 4096;
  A stage[kInPlace ? 1 : kBlock];
  Op op;
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t m = kBlock < count - base ? kBlock : count - base;
    A* __restrict__ acc = kInPlace ? reinterpret_cast<A*>(static_cast<S*>(out) + base) : stage;
    auto src = [&](int p) { return static_cast<const S*>(srcs[p]) + base; };
    const S* __restrict__ s0 = src(0);
    int p = 1;
    if (n >= 2) {
      const S* __restrict__ s1 = src(1);
      for (size_t i = 0; i < m; ++i) acc[i] = op(Load(s0[i]), Load(s1[i]));
      p = 2;
    } else {
      for (size_t i = 0; i < m; ++i) acc[i] = Load(s0[i]);
    }
    for (; p + 2 < n; p += 3) {
      const S* __restrict__ a = src(p);
      const S* __restrict__ b = src(p + 1);
      const S* __restrict__ c = src(p + 2);
      for (size_t i = 0; i < m; ++i)
        acc[i] = op(op(op(acc[i], Load(a[i])), Load(b[i])), Load(c[i]));
    }
    for (; p < n; ++p) {
      const S* __restrict__ a = src(p);
      for (size_t i = 0; i < m; ++i) acc[i] = op(acc[i], Load(a[i]));
    }
    if constexpr (!kInPlace) {
      S* __restrict__ o = static_cast<S*>(out) + base;
      for (size_t i = 0; i < m; ++i) o[i] = Store(acc[i]);
    }
  }
}

// Picks the accumulator: f32 for 16-bit floats; for integer sums the unsigned
// type of the same width (two's-complement wrap-around, no undefined
// overflow); the storage type otherwise.
template <typename Op>
bool ReduceWith(DType dtype, const void* const* srcs, int n, void* out, size_t count) {
  constexpr bool kSum = std::is_same_v<Op, Sum>;
#define SMDDP_SAME(T) ReduceBlocks<T, T, Identity<T>, Identity<T>, Op>(srcs, n, out, count)
  switch (dtype) {
    case DType::kFloat32:
      SMDDP_SAME(float);
      return true;
    case DType::kFloat64:
      SMDDP_SAME(double);
      return true;
    case DType::kBFloat16:
      ReduceBlocks<uint16_t, float, LoadBF16, StoreBF16, Op>(srcs, n, out, count);
      return true;
    case DType::kFloat16:
      ReduceBlocks<uint16_t, float, LoadF16, StoreF16, Op>(srcs, n, out, count);
      return true;
    case DType::kInt8:
      if constexpr (kSum)
        SMDDP_SAME(uint8_t);
      else
        SMDDP_SAME(int8_t);
      return true;
    case DType::kUInt8:
      SMDDP_SAME(uint8_t);
      return true;
    case DType::kInt32:
      if constexpr (kSum)
        SMDDP_SAME(uint32_t);
      else
        SMDDP_SAME(int32_t);
      return true;
    case DType::kUInt32:
      SMDDP_SAME(uint32_t);
      return true;
    case DType::kInt64:
      if constexpr (kSum)
        SMDDP_SAME(uint64_t);
      else
        SMDDP_SAME(int64_t);
      return true;
    case DType::kBool:
      return false;
  }
#undef SMDDP_SAME
  return false;
}

// out = op over srcs, with this unit's copy of the kernels.
inline bool ReduceHere(DType dtype, ReduceOp op, const void* const* srcs, int n, void* out,
                       size_t count) {
  switch (op) {
    case ReduceOp::kSum:
      return ReduceWith<Sum>(dtype, srcs, n, out, count);
    case ReduceOp::kMax:
      return ReduceWith<Max>(dtype, srcs, n, out, count);
    case ReduceOp::kMin:
      return ReduceWith<Min>(dtype, srcs, n, out, count);
  }
  return false;
}

}  // namespace
}  // namespace smddp

#endif  // JAX_SMDDP_ALGORITHMS_REDUCE_KERNELS_H_

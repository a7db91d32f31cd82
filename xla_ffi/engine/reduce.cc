#include "xla_ffi/engine/reduce.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace smddp {

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kBool: return "bool";
    case DType::kInt8: return "int8";
    case DType::kUInt8: return "uint8";
    case DType::kInt32: return "int32";
    case DType::kUInt32: return "uint32";
    case DType::kInt64: return "int64";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
  }
  return "?";
}

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

namespace {

inline float BitsToF32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t F32ToBits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float LoadBF16(uint16_t h) { return BitsToF32(uint32_t(h) << 16); }
inline uint16_t StoreBF16(float f) {
  uint32_t u = F32ToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
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
  if (x < 0x38800000u) {  // below the smallest normal half: subnormal or zero
    return sign | uint16_t(std::lrintf(BitsToF32(x) * 16777216.0f));
  }
  x += 0xc8000fffu + ((x >> 13) & 1u);  // rebias exponent, round to nearest even
  return sign | uint16_t(x >> 13);
}

template <typename T> inline T Identity(T v) { return v; }
template <typename T, typename A> inline A Widen(T v) { return A(v); }
template <typename T, typename A> inline T Narrow(A v) { return T(v); }

struct Sum { template <typename A> A operator()(A a, A b) const { return a + b; } };
// Float max/min propagate NaN, as XLA's maximum/minimum do.
struct Max {
  template <typename A> A operator()(A a, A b) const {
    if constexpr (std::is_floating_point_v<A>) { if (a != a) return a; if (b != b) return b; }
    return a > b ? a : b;
  }
};
struct Min {
  template <typename A> A operator()(A a, A b) const {
    if constexpr (std::is_floating_point_v<A>) { if (a != a) return a; if (b != b) return b; }
    return a < b ? a : b;
  }
};

// Combines the sources block by block so the accumulator stays in L1.
template <typename S, typename A, A (*Load)(S), S (*Store)(A), typename Op>
void ReduceBlocks(const void* const* srcs, int n, void* out, size_t count) {
  constexpr size_t kBlock = 2048;
  A acc[kBlock];
  Op op;
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t m = std::min(kBlock, count - base);
    const S* s0 = static_cast<const S*>(srcs[0]) + base;
    for (size_t i = 0; i < m; ++i) acc[i] = Load(s0[i]);
    for (int p = 1; p < n; ++p) {
      const S* sp = static_cast<const S*>(srcs[p]) + base;
      for (size_t i = 0; i < m; ++i) acc[i] = op(acc[i], Load(sp[i]));
    }
    S* o = static_cast<S*>(out) + base;
    for (size_t i = 0; i < m; ++i) o[i] = Store(acc[i]);
  }
}

// Picks the accumulator: f32 for 16-bit floats, unsigned (wrapping) for
// integer sums, the storage type otherwise.
template <typename Op>
bool Dispatch(DType dtype, const void* const* srcs, int n, void* out, size_t count) {
  constexpr bool kSum = std::is_same_v<Op, Sum>;
  switch (dtype) {
    case DType::kFloat32:
      ReduceBlocks<float, float, Identity<float>, Identity<float>, Op>(srcs, n, out, count);
      return true;
    case DType::kFloat64:
      ReduceBlocks<double, double, Identity<double>, Identity<double>, Op>(srcs, n, out, count);
      return true;
    case DType::kBFloat16:
      ReduceBlocks<uint16_t, float, LoadBF16, StoreBF16, Op>(srcs, n, out, count);
      return true;
    case DType::kFloat16:
      ReduceBlocks<uint16_t, float, LoadF16, StoreF16, Op>(srcs, n, out, count);
      return true;
    case DType::kInt8:
      if constexpr (kSum) ReduceBlocks<int8_t, uint32_t, Widen<int8_t, uint32_t>, Narrow<int8_t, uint32_t>, Op>(srcs, n, out, count);
      else ReduceBlocks<int8_t, int8_t, Identity<int8_t>, Identity<int8_t>, Op>(srcs, n, out, count);
      return true;
    case DType::kUInt8:
      ReduceBlocks<uint8_t, uint32_t, Widen<uint8_t, uint32_t>, Narrow<uint8_t, uint32_t>, Op>(srcs, n, out, count);
      return true;
    case DType::kInt32:
      if constexpr (kSum) ReduceBlocks<int32_t, uint32_t, Widen<int32_t, uint32_t>, Narrow<int32_t, uint32_t>, Op>(srcs, n, out, count);
      else ReduceBlocks<int32_t, int32_t, Identity<int32_t>, Identity<int32_t>, Op>(srcs, n, out, count);
      return true;
    case DType::kUInt32:
      ReduceBlocks<uint32_t, uint32_t, Identity<uint32_t>, Identity<uint32_t>, Op>(srcs, n, out, count);
      return true;
    case DType::kInt64:
      if constexpr (kSum) ReduceBlocks<int64_t, uint64_t, Widen<int64_t, uint64_t>, Narrow<int64_t, uint64_t>, Op>(srcs, n, out, count);
      else ReduceBlocks<int64_t, int64_t, Identity<int64_t>, Identity<int64_t>, Op>(srcs, n, out, count);
      return true;
    case DType::kBool:
      return false;
  }
  return false;
}

}  // namespace

bool SupportsReduce(DType dtype, ReduceOp) { return dtype != DType::kBool; }

void Reduce(DType dtype, ReduceOp op, const void* const* srcs, int n, void* out,
            size_t count) {
  if (count == 0 || n <= 0) return;
  switch (op) {
    case ReduceOp::kSum: Dispatch<Sum>(dtype, srcs, n, out, count); return;
    case ReduceOp::kMax: Dispatch<Max>(dtype, srcs, n, out, count); return;
    case ReduceOp::kMin: Dispatch<Min>(dtype, srcs, n, out, count); return;
  }
}

}  // namespace smddp

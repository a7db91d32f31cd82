// Element types the engine moves and reduces. Mirrors the subset of XLA types
// the plugin supports; the FFI handlers map XLA's enum onto this one.
#ifndef JAX_SMDDP_COMMON_DTYPE_H_
#define JAX_SMDDP_COMMON_DTYPE_H_

#include <cstddef>
#include <cstdint>

namespace smddp {

enum class DType : uint8_t {
  kBool,
  kInt8,
  kUInt8,
  kInt32,
  kUInt32,
  kInt64,
  kFloat16,
  kBFloat16,
  kFloat32,
  kFloat64,
};

enum class ReduceOp : uint8_t { kSum = 0, kMax = 1, kMin = 2 };

inline size_t ElementSize(DType t) {
  switch (t) {
    case DType::kBool:
    case DType::kInt8:
    case DType::kUInt8:
      return 1;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kInt32:
    case DType::kUInt32:
    case DType::kFloat32:
      return 4;
    case DType::kInt64:
    case DType::kFloat64:
      return 8;
  }
  return 0;
}

const char* DTypeName(DType t);
const char* ReduceOpName(ReduceOp op);

}  // namespace smddp

#endif  // JAX_SMDDP_COMMON_DTYPE_H_

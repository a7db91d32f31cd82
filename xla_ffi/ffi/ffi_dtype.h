// XLA FFI element types as the engine's DType (shared by the CPU and CUDA
// handlers).
#ifndef JAX_SMDDP_FFI_FFI_DTYPE_H_
#define JAX_SMDDP_FFI_FFI_DTYPE_H_

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/common/dtype.h"

namespace smddp {

// False for types the engine does not move (the lowering never sends them).
inline bool ToDType(xla::ffi::DataType t, DType* out) {
  using xla::ffi::DataType;
  switch (t) {
    case DataType::PRED:
      *out = DType::kBool;
      return true;
    case DataType::S8:
      *out = DType::kInt8;
      return true;
    case DataType::U8:
      *out = DType::kUInt8;
      return true;
    case DataType::S32:
      *out = DType::kInt32;
      return true;
    case DataType::U32:
      *out = DType::kUInt32;
      return true;
    case DataType::S64:
      *out = DType::kInt64;
      return true;
    case DataType::F16:
      *out = DType::kFloat16;
      return true;
    case DataType::BF16:
      *out = DType::kBFloat16;
      return true;
    case DataType::F32:
      *out = DType::kFloat32;
      return true;
    case DataType::F64:
      *out = DType::kFloat64;
      return true;
    default:
      return false;
  }
}

}  // namespace smddp

#endif  // JAX_SMDDP_FFI_FFI_DTYPE_H_

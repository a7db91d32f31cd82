#include "xla_ffi/algorithms/reduce.h"
#include "xla_ffi/algorithms/reduce_kernels.h"

namespace smddp {

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kBool:
      return "bool";
    case DType::kInt8:
      return "int8";
    case DType::kUInt8:
      return "uint8";
    case DType::kInt32:
      return "int32";
    case DType::kUInt32:
      return "uint32";
    case DType::kInt64:
      return "int64";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
  }
  return "?";
}

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
  }
  return "?";
}

namespace {

bool HasAvx2() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  return __builtin_cpu_supports("avx2");
#else
  return false;
#endif
}

}  // namespace

bool SupportsReduce(DType dtype, ReduceOp) { return dtype != DType::kBool; }

void Reduce(DType dtype, ReduceOp op, const void* const* srcs, int n, void* out, size_t count) {
  if (count == 0 || n <= 0) return;
  // Twice the elements per instruction, in the same order (the same bits).
  // Measured on this project's VM, 8 sources: float32 1.6x faster in cache,
  // 1.0-1.1x from memory; bfloat16, whose conversions cost more than its
  // loads, 1.2-1.6x.
  static const bool avx2 = HasAvx2();
  if (avx2 && ReduceAvx2(dtype, op, srcs, n, out, count)) return;
  ReduceHere(dtype, op, srcs, n, out, count);
}

void ReduceBaseline(DType dtype, ReduceOp op, const void* const* srcs, int n, void* out,
                    size_t count) {
  if (count == 0 || n <= 0) return;
  ReduceHere(dtype, op, srcs, n, out, count);
}

}  // namespace smddp

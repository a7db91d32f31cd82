// The reduction kernel's per-thread work (cuda/reduce_body.cuh) run on the
// CPU: built by nvcc as host code (no GPU needed), it runs every thread of a
// launch one after another, with the vector width the launcher would choose.
// tests/native/test_reduce_body.py feeds it numpy data and checks the output.
//
//   reduce_body_test DTYPE OP N COUNT ROWS SPITCH DPITCH MISALIGN THREADS IN OUT [DESTS [UNROLL]]
//
// DTYPE: f32 f16 bf16 f64 i8 u8 i32 u32 i64; OP: sum max min. IN holds N
// sources (one after another, each placed in a buffer of its own) of ROWS
// rows each SPITCH elements apart; OUT holds the destination
// (ROWS rows DPITCH elements apart) before the call and receives it after.
// MISALIGN shifts every buffer by that many bytes from a 64-byte boundary.
// DESTS (default 1): the result stored into that many destinations (all
// laid out as OUT, each a buffer of its own; exit 3 if they differ); UNROLL
// 2: twice the vectors per thread, as kernels.cu launches for 4- and 8-byte
// elements on request. Prints the vector width used (elements per load).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/reduce_body.cuh"
#include "tests/native/host_buffers.h"

using smddp::ReduceOp;
using smddp::cuda::Destinations;
using smddp::cuda::Sources;

namespace {

struct Args {
  int n;
  size_t count, rows, spitch, dpitch, misalign, threads;
  const char *in, *out;
  int dests = 1, unroll = 1;
};

template <typename T, typename A, ReduceOp R>
int Run(const Args& a) {
  const std::vector<char> in = smddp_test::ReadFile(a.in), out = smddp_test::ReadFile(a.out);
  const size_t E = sizeof(T);
  if (in.size() != size_t(a.n) * a.rows * a.spitch * E || out.size() != a.rows * a.dpitch * E) {
    std::fprintf(stderr, "file sizes do not match the shape\n");
    return 2;
  }
  // Each source in a buffer of its own (MISALIGN past a 64-byte boundary).
  const size_t source_bytes = a.rows * a.spitch * E;
  Destinations d{};
  for (int k = 0; k < a.dests; ++k) d.p[k] = smddp_test::Placed(out, a.misalign);
  char* dst = static_cast<char*>(d.p[0]);
  Sources s{};
  for (int k = 0; k < a.n; ++k) {
    s.p[k] = smddp_test::Placed(
        std::vector<char>(in.begin() + k * source_bytes, in.begin() + (k + 1) * source_bytes),
        a.misalign);
  }
  constexpr int kVector = sizeof(T) < 16 ? int(16 / sizeof(T)) : 1;  // as cuda/kernels.cu
  constexpr int U = smddp::cuda::ReduceUnroll<kVector>();
  const bool vector =
      kVector > 1 && smddp::cuda::VectorWidth(dst, a.dpitch * E, s, a.n, a.spitch * E, a.count,
                                              a.rows, E) == kVector;
  const bool twice = a.unroll == 2 && U * kVector <= 16;  // as kernels.cu allows it
  for (size_t t = 0; t < a.threads; ++t) {
    if (vector && twice) {
      smddp::cuda::ReduceThreadTo<T, A, R, kVector, 2 * U>(t, a.threads, d, a.dests, a.dpitch * E,
                                                           s, a.n, a.spitch * E, a.count, a.rows);
    } else if (vector) {
      smddp::cuda::ReduceThreadTo<T, A, R, kVector>(t, a.threads, d, a.dests, a.dpitch * E, s, a.n,
                                                    a.spitch * E, a.count, a.rows);
    } else {
      smddp::cuda::ReduceThreadTo<T, A, R, 1>(t, a.threads, d, a.dests, a.dpitch * E, s, a.n,
                                              a.spitch * E, a.count, a.rows);
    }
  }
  for (int k = 1; k < a.dests; ++k) {
    if (std::memcmp(d.p[k], dst, out.size()) != 0) {
      std::fprintf(stderr, "destination %d differs from destination 0\n", k);
      return 3;
    }
  }
  if (!smddp_test::WriteFile(a.out, dst, out.size())) return 2;
  std::printf("vector %d\n", vector ? kVector : 1);
  return 0;
}

template <typename T, typename A>
int ByOp(const std::string& op, const Args& a) {
  if (op == "sum") return Run<T, A, ReduceOp::kSum>(a);
  if (op == "max") return Run<T, A, ReduceOp::kMax>(a);
  if (op == "min") return Run<T, A, ReduceOp::kMin>(a);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 12 || argc > 14) {
    std::fprintf(stderr,
                 "usage: %s DTYPE OP N COUNT ROWS SPITCH DPITCH MISALIGN THREADS IN OUT "
                 "[DESTS [UNROLL]]\n",
                 argv[0]);
    return 2;
  }
  const std::string dtype = argv[1], op = argv[2];
  Args a{std::atoi(argv[3]),
         std::strtoull(argv[4], nullptr, 10),
         std::strtoull(argv[5], nullptr, 10),
         std::strtoull(argv[6], nullptr, 10),
         std::strtoull(argv[7], nullptr, 10),
         std::strtoull(argv[8], nullptr, 10),
         std::strtoull(argv[9], nullptr, 10),
         argv[10],
         argv[11]};
  if (argc > 12) a.dests = std::atoi(argv[12]);
  if (argc > 13) a.unroll = std::atoi(argv[13]);
  if (a.n < 1 || a.n > smddp::cuda::kMaxSources || a.threads == 0) return 2;
  if (a.dests < 1 || a.dests > smddp::cuda::kMaxSources) return 2;
  if (dtype == "f32") return ByOp<float, float>(op, a);
  if (dtype == "f64") return ByOp<double, double>(op, a);
  if (dtype == "f16") return ByOp<__half, float>(op, a);
  if (dtype == "bf16") return ByOp<__nv_bfloat16, float>(op, a);
  if (dtype == "i8") return ByOp<int8_t, int32_t>(op, a);
  if (dtype == "u8") return ByOp<uint8_t, uint32_t>(op, a);
  if (dtype == "i32") return ByOp<int32_t, int32_t>(op, a);
  if (dtype == "u32") return ByOp<uint32_t, uint32_t>(op, a);
  if (dtype == "i64") return ByOp<int64_t, int64_t>(op, a);
  return 2;
}

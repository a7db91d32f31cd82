// The copy kernel's per-thread work (cuda/copy_body.cuh) run on the CPU:
// built by nvcc as host code (no GPU needed), it runs every thread of a launch
// one after another, in the unit the launcher would choose.
// tests/native/test_reduce_body.py feeds it numpy data and checks the output.
//
//   copy_body_test WIDTH ROWS SPITCH DPITCH SRC_MISALIGN DST_MISALIGN THREADS IN OUT
//
// Copies ROWS rows of WIDTH bytes from IN (rows SPITCH bytes apart) into OUT
// (DPITCH apart; its bytes before the call are read from OUT, the result
// written back). The buffers start that many bytes past a 64-byte boundary.
// Prints the unit used (bytes per load).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <vector_types.h>  // uint4, as on the GPU

#include "cuda/copy_body.cuh"
#include "tests/native/host_buffers.h"

int main(int argc, char** argv) {
  if (argc != 10) {
    std::fprintf(stderr,
                 "usage: %s WIDTH ROWS SPITCH DPITCH SRC_MISALIGN DST_MISALIGN THREADS IN OUT\n",
                 argv[0]);
    return 2;
  }
  size_t v[7];
  for (int i = 0; i < 7; ++i) v[i] = std::strtoull(argv[1 + i], nullptr, 10);
  const size_t width = v[0], rows = v[1], spitch = v[2], dpitch = v[3], threads = v[6];
  const std::vector<char> in = smddp_test::ReadFile(argv[8]), out = smddp_test::ReadFile(argv[9]);
  if (threads == 0 || in.size() != rows * spitch || out.size() != rows * dpitch) return 2;
  const char* src = smddp_test::Placed(in, v[4]);
  char* dst = smddp_test::Placed(out, v[5]);
  const size_t unit = smddp::cuda::CopyUnitBytes(dst, dpitch, src, spitch, width, rows);
  for (size_t t = 0; t < threads; ++t) {
    if (unit == 16) {
      smddp::cuda::CopyThread<uint4>(t, threads, dst, dpitch, src, spitch, width / 16, rows);
    } else if (unit == 4) {
      smddp::cuda::CopyThread<uint32_t>(t, threads, dst, dpitch, src, spitch, width / 4, rows);
    } else {
      smddp::cuda::CopyThread<uint8_t>(t, threads, dst, dpitch, src, spitch, width, rows);
    }
  }
  if (!smddp_test::WriteFile(argv[9], dst, out.size())) return 2;
  std::printf("unit %zu\n", unit);
  return 0;
}

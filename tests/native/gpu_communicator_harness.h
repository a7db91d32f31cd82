// What the GPU communicators' native tests share (gpu_communicator_test.cc,
// gpu_hosts_test.cc): built against the mock node's CUDA runtime
// (tests/native/mock_node; no GPU here or in CI), ranks as forked processes
// that talk to the parent through pipes (Spawn, WriteBytes/ReadBytes), their
// inputs (Input) and, with direct reads, their buffers in mock device memory
// (DeviceBuffers). One translation unit per program: everything here is
// inline.
#ifndef JAX_SMDDP_TESTS_NATIVE_GPU_COMMUNICATOR_HARNESS_H_
#define JAX_SMDDP_TESTS_NATIVE_GPU_COMMUNICATOR_HARNESS_H_

#include <sys/types.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>  // the mock node: inputs in "device memory"

#include "cuda/gpu_communicator.h"
#include "tests/native/check.h"
#include "xla_ffi/algorithms/plan.h"
#include "xla_ffi/common/collective.h"
#include "xla_ffi/common/status.h"

namespace gpu_test {

using smddp::Collective;
using smddp::Plan;
using smddp::Status;
namespace gpu = smddp::gpu;

inline constexpr int kRanks = 3;
inline const std::vector<int64_t> kMembers = {10, 11, 12};

// A failed expectation of `rank`: the shared check (tests/native/check.h).
#define Expect(rank, ok, what)                          \
  do {                                                  \
    smddp_test::Who() = "rank " + std::to_string(rank); \
    CHECK_MSG(ok, what);                                \
  } while (0)

inline bool WriteAll(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t k = write(fd, c, n);
    if (k <= 0) return false;
    c += k;
    n -= size_t(k);
  }
  return true;
}

inline bool ReadAll(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t k = read(fd, c, n);
    if (k <= 0) return false;
    c += k;
    n -= size_t(k);
  }
  return true;
}

inline bool WriteBytes(int fd, const std::string& s) {
  const uint32_t n = uint32_t(s.size());
  return WriteAll(fd, &n, 4) && WriteAll(fd, s.data(), n);
}

inline bool ReadBytes(int fd, std::string* s) {
  uint32_t n = 0;
  if (!ReadAll(fd, &n, 4) || n > (1u << 20)) return false;
  s->assign(n, '\0');
  return ReadAll(fd, s->data(), n);
}

// Rank q's input element i: small integers, exact in float sums.
inline float Input(int q, size_t i) { return float((q + 1) * 1000 + int(i % 997)); }

inline Plan MakePlan(Collective kind, size_t outer, size_t inner, size_t count) {
  Plan p;
  p.kind = kind;
  p.dtype = smddp::DType::kFloat32;
  p.outer = outer;
  p.inner = inner;
  p.count = count;
  return p;
}

inline const char* Name(Collective k) {
  switch (k) {
    case Collective::kAllGather:
      return "all_gather";
    case Collective::kReduceScatter:
      return "reduce_scatter";
    case Collective::kAllReduce:
      return "all_reduce";
    case Collective::kAllToAll:
      return "all_to_all";
  }
  return "?";
}

// Forked children, each with a pipe to the parent (up) and one from it (down).
struct Children {
  std::vector<pid_t> pids;
  std::vector<int> ups, downs;  // the parent's ends
};

// Forks `n` children; child i exits with body(i, its up end, its down end).
template <typename Body>
inline bool Spawn(int n, Body body, Children* c) {
  for (int i = 0; i < n; ++i) {
    int up[2], down[2];
    if (pipe(up) != 0 || pipe(down) != 0) return false;
    const pid_t pid = fork();
    if (pid < 0) return false;
    if (pid == 0) {
      close(up[0]);
      close(down[1]);
      _exit(body(i, up[1], down[0]));
    }
    close(up[1]);
    close(down[0]);
    c->pids.push_back(pid);
    c->ups.push_back(up[0]);
    c->downs.push_back(down[1]);
  }
  return true;
}

// With direct reads, a rank's buffers are in its (mock) device memory, as
// XLA's are: inputs and outputs in two allocations in turn, at offsets that
// change from call to call, inputs rewritten every call.
struct DeviceBuffers {
  static constexpr size_t kBytes = 1 << 20, kOutputs = kBytes / 2;  // inputs below, outputs above
  void* allocation[2] = {nullptr, nullptr};
  int calls = 0;
  bool heap_input = false;  // the next call's input is ordinary host memory (cannot be shared)
  bool staged = false;      // some rank's is: the next call stages
  void Free() {             // children leave by _exit: no destructors
    for (void*& a : allocation)
      if (a) cudaFree(a), a = nullptr;
  }
};
inline DeviceBuffers device_buffers[4];  // by rank: a process's ranks run on threads of their own

}  // namespace gpu_test

#endif  // JAX_SMDDP_TESTS_NATIVE_GPU_COMMUNICATOR_HARNESS_H_

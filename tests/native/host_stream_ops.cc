#include "tests/native/host_stream_ops.h"

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "xla_ffi/algorithms/reduce.h"

namespace smddp {

Status HostStreamOps::Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                             size_t rows) {
  for (size_t i = 0; i < rows; ++i) {
    std::memcpy(static_cast<char*>(dst) + i * dpitch, static_cast<const char*>(src) + i * spitch,
                width);
  }
  return Status::Ok();
}

Status HostStreamOps::Zero(void* dst, size_t bytes) {
  if (bytes) std::memset(dst, 0, bytes);
  return Status::Ok();
}

Status HostStreamOps::Reduce(void* dst, size_t dpitch, const void* const* srcs, int n,
                             size_t spitch, size_t count, size_t rows, DType dtype, ReduceOp op) {
  std::vector<const void*> row(n);
  for (size_t i = 0; i < rows; ++i) {
    for (int k = 0; k < n; ++k) row[k] = static_cast<const char*>(srcs[k]) + i * spitch;
    smddp::Reduce(dtype, op, row.data(), n, static_cast<char*>(dst) + i * dpitch, count);
  }
  return Status::Ok();
}

Status HostStreamOps::WaitAtLeast(const uint32_t* flag, uint32_t value) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
  for (int spins = 0; !FlagReached(__atomic_load_n(flag, __ATOMIC_ACQUIRE), value); ++spins) {
    if (spins > 1000) std::this_thread::yield();
    if ((spins & 1023) == 0 && std::chrono::steady_clock::now() > deadline)
      return Status::Timeout("jax_smddp: timed out waiting for a peer's flag to reach " +
                             std::to_string(value));
  }
  return Status::Ok();
}

Status HostStreamOps::Write(uint32_t* flag, uint32_t value) {
  __atomic_store_n(flag, value, __ATOMIC_RELEASE);
  return Status::Ok();
}

}  // namespace smddp

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

Status HostStreamOps::WriteWords(uint64_t* dst, const uint64_t* values, int n) {
  for (int i = 0; i < n; ++i) __atomic_store_n(dst + i, values[i], __ATOMIC_RELEASE);
  return Status::Ok();
}

Status HostStreamOps::Resolve(uint64_t* out, const uint64_t* entry, uint64_t stamp, int which,
                              const uint64_t* table, const uint32_t* released,
                              const uint32_t* posted) {
  auto load = [](const uint64_t* w) { return __atomic_load_n(w, __ATOMIC_ACQUIRE); };
  const bool gone =
      (released && __atomic_load_n(released, __ATOMIC_ACQUIRE)) ||
      (posted && ReleasedPast(__atomic_load_n(posted, __ATOMIC_ACQUIRE), uint32_t(stamp)));
  if (load(entry) != stamp && gone) {
    *out = 0;  // the group failed: the peer's flags were released
    return Status::Ok();
  }
  if (load(entry) != stamp)
    return Status::Error("jax_smddp: a mailbox entry of call " + std::to_string(load(entry)) +
                         " read for call " + std::to_string(stamp));
  const uint64_t id1 = load(entry + 1 + 3 * which), offset = load(entry + 2 + 3 * which);
  if (!table || id1 == 0) {
    *out = load(entry + 3 + 3 * which);
    return Status::Ok();
  }
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
  while (load(table + 2 * (id1 - 1)) != id1) {
    if ((released && __atomic_load_n(released, __ATOMIC_ACQUIRE)) ||
        (posted && ReleasedPast(__atomic_load_n(posted, __ATOMIC_ACQUIRE), uint32_t(stamp)))) {
      *out = 0;
      return Status::Ok();
    }
    if (std::chrono::steady_clock::now() > deadline)
      return Status::Timeout("jax_smddp: timed out waiting for a peer's allocation to be mapped");
    std::this_thread::yield();
  }
  *out = load(table + 2 * (id1 - 1) + 1) + offset;
  return Status::Ok();
}

Status HostStreamOps::Copy2DFrom(void* dst, size_t dpitch, const uint64_t* src_at, size_t src_add,
                                 size_t spitch, size_t width, size_t rows) {
  if (*src_at == 0) return Status::Ok();  // released
  return Copy2D(dst, dpitch, reinterpret_cast<const void*>(*src_at + src_add), spitch, width, rows);
}

Status HostStreamOps::ReduceFrom(const uint64_t* dsts_at, int nd, size_t dst_add, size_t dpitch,
                                 const uint64_t* srcs_at, int n, size_t src_add, size_t spitch,
                                 size_t count, size_t rows, DType dtype, ReduceOp op) {
  std::vector<const void*> srcs(n);
  for (int k = 0; k < n; ++k) {
    if (srcs_at[k] == 0) return Status::Ok();
    srcs[k] = reinterpret_cast<const void*>(srcs_at[k] + src_add);
  }
  void* first =
      dsts_at ? reinterpret_cast<void*>(dsts_at[0] + dst_add) : reinterpret_cast<void*>(dst_add);
  if (dsts_at && dsts_at[0] == 0) return Status::Ok();
  SMDDP_RETURN_IF_ERROR(Reduce(first, dpitch, srcs.data(), n, spitch, count, rows, dtype, op));
  const size_t row_bytes = count * ElementSize(dtype);
  for (int d = 1; dsts_at && d < nd; ++d) {
    if (dsts_at[d] == 0) return Status::Ok();
    SMDDP_RETURN_IF_ERROR(Copy2D(reinterpret_cast<void*>(dsts_at[d] + dst_add), dpitch, first,
                                 dpitch, row_bytes, rows));
  }
  return Status::Ok();
}

}  // namespace smddp

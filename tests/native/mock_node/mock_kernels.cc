// The mock node's kernels: those of cuda/kernels.h as stream operations that
// run on the host, on the mock runtime's streams (mock_node.cc; mock_node.h
// says what they share).
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "cuda/kernels.h"
#include "mock_node.h"
#include "xla_ffi/algorithms/reduce.h"
#include "xla_ffi/algorithms/stream_ops.h"

// cuda/kernels.h: the kernels as stream operations of the host.
namespace smddp {
namespace cuda {

cudaError_t LaunchCopy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                         size_t rows, int, cudaStream_t stream) {
  return mock_node::Copy2D(dst, dpitch, src, spitch, width, rows, stream, "copy kernel");
}

namespace {
// A reduction kernel's work, on its stream: the sources into each target.
void RunReduce(int dev, const std::vector<const void*>& sources, size_t spitch,
               const std::vector<void*>& targets, size_t dpitch, size_t count, size_t rows,
               DType type, ReduceOp op) {
  const size_t row_bytes = count * ElementSize(type);
  const int n = int(sources.size());
  for (const void* s : sources) {
    if (!mock_node::Touch(dev, "reduction kernel", {{s, (rows - 1) * spitch + row_bytes}}, false))
      return;
  }
  for (void* d : targets) {
    if (!mock_node::Touch(dev, "reduction kernel", {{d, (rows - 1) * dpitch + row_bytes}}, false))
      return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  const double us = mock_node::Cfg().latency_us +
                    double(row_bytes * rows * size_t(n)) / mock_node::Cfg().bytes_per_us;
  std::this_thread::sleep_until(t0 + std::chrono::duration<double, std::micro>(us));
  std::vector<const void*> row(sources.size());
  for (size_t i = 0; i < rows; ++i) {
    for (int k = 0; k < n; ++k) row[k] = static_cast<const char*>(sources[k]) + i * spitch;
    char* first = static_cast<char*>(targets[0]) + i * dpitch;
    smddp::Reduce(type, op, row.data(), n, first, count);
    for (size_t d = 1; d < targets.size(); ++d)
      std::memcpy(static_cast<char*>(targets[d]) + i * dpitch, first, row_bytes);
  }
}

uint64_t Load(const uint64_t* word) { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }
}  // namespace

cudaError_t LaunchReduceToEach(void* const* dsts, int nd, size_t dpitch, const void* const* srcs,
                               int n, size_t spitch, size_t count, size_t rows, DType type,
                               ReduceOp op, int, cudaStream_t stream, int) {
  if (!SupportsReduce(type, op) || n <= 0 || nd < 0) return cudaErrorInvalidValue;
  if (count == 0 || rows == 0 || nd == 0) return cudaSuccess;
  const int dev = mock_node::Of(stream)->device;
  std::vector<const void*> sources(srcs, srcs + n);  // the caller's arrays are not kept
  std::vector<void*> targets(dsts, dsts + nd);
  return mock_node::Enqueue(
      stream, [=] { RunReduce(dev, sources, spitch, targets, dpitch, count, rows, type, op); });
}

// The device exchange's kernels: addresses read when they run.
cudaError_t LaunchWriteWords(uint64_t* dst, const uint64_t* values, int n, cudaStream_t stream) {
  const int dev = mock_node::Of(stream)->device;
  std::vector<uint64_t> words(values, values + n);
  return mock_node::Enqueue(stream, [=] {
    if (!mock_node::Touch(dev, "mailbox write kernel", {{dst, words.size() * 8}}, false)) return;
    // A kernel's start-up: a reader that did not wait for the post sees the old words.
    std::this_thread::sleep_for(
        std::chrono::duration<double, std::micro>(mock_node::Cfg().latency_us));
    for (size_t i = 0; i < words.size(); ++i) __atomic_store_n(dst + i, words[i], __ATOMIC_RELEASE);
  });
}

cudaError_t LaunchResolve(uint64_t* out, const uint64_t* entry, uint64_t stamp, int which,
                          const uint64_t* table, const uint32_t* released, const uint32_t* posted,
                          cudaStream_t stream) {
  const int dev = mock_node::Of(stream)->device;
  return mock_node::Enqueue(stream, [=] {
    if (!mock_node::Touch(dev, "resolve kernel", {{entry, 64}, {out, 8}}, false)) return;
    char text[160];
    auto failed = [&] {  // a watchdog of some process released the group's flags
      return (released && __atomic_load_n(released, __ATOMIC_ACQUIRE)) ||
             (posted &&
              smddp::ReleasedPast(__atomic_load_n(posted, __ATOMIC_ACQUIRE), uint32_t(stamp)));
    };
    if (Load(entry) != stamp) {
      // As the kernel: another call's entry is a failed group's (once this
      // process's watchdog says so too) or a protocol bug.
      const auto grace = mock_node::Clock::now() + std::chrono::nanoseconds(kStaleEntryGraceNs);
      while (mock_node::Clock::now() < grace) {
        if (failed()) return __atomic_store_n(out, uint64_t(0), __ATOMIC_RELEASE);
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
      std::snprintf(text, sizeof(text),
                    "resolve kernel read a mailbox entry of call %llu for call %llu",
                    (unsigned long long)Load(entry), (unsigned long long)stamp);
      return mock_node::Poison(dev, text);
    }
    const uint64_t id1 = Load(entry + 1 + 3 * which), offset = Load(entry + 2 + 3 * which);
    if (!table || id1 == 0)
      return __atomic_store_n(out, Load(entry + 3 + 3 * which), __ATOMIC_RELEASE);
    const uint64_t* slot = table + 2 * (id1 - 1);
    const auto deadline =
        mock_node::Clock::now() + std::chrono::duration<double>(mock_node::Cfg().wait_s);
    while (Load(slot) != id1) {
      if (failed()) return __atomic_store_n(out, uint64_t(0), __ATOMIC_RELEASE);
      if (mock_node::Clock::now() > deadline) {
        std::snprintf(text, sizeof(text), "resolve kernel waited %.0f s for allocation %llu mapped",
                      mock_node::Cfg().wait_s, (unsigned long long)(id1 - 1));
        return mock_node::Poison(dev, text);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    __atomic_store_n(out, Load(slot + 1) + offset, __ATOMIC_RELEASE);
  });
}

cudaError_t LaunchCopy2DFrom(void* dst, size_t dpitch, const uint64_t* src_at, size_t src_add,
                             size_t spitch, size_t width, size_t rows, int, cudaStream_t stream) {
  if (width == 0 || rows == 0) return cudaSuccess;
  const int dev = mock_node::Of(stream)->device;
  return mock_node::Enqueue(stream, [=] {
    if (!mock_node::Touch(dev, "copy kernel", {{src_at, 8}}, false)) return;
    const uint64_t at = Load(src_at);
    if (at == 0) return;  // released: the group failed
    const auto* src = reinterpret_cast<const uint8_t*>(at + src_add);
    if (!mock_node::Touch(dev, "copy kernel",
                          {{dst, (rows - 1) * dpitch + width}, {src, (rows - 1) * spitch + width}},
                          false))
      return;
    mock_node::TimedCopy(dev, static_cast<uint8_t*>(dst), dpitch, src, spitch, width, rows);
  });
}

cudaError_t LaunchReduceFrom(const uint64_t* dsts_at, int nd, size_t dst_add, size_t dpitch,
                             const uint64_t* srcs_at, int n, size_t src_add, size_t spitch,
                             size_t count, size_t rows, DType type, ReduceOp op, int,
                             cudaStream_t stream) {
  if (!SupportsReduce(type, op) || n <= 0 || nd <= 0) return cudaErrorInvalidValue;
  if (count == 0 || rows == 0) return cudaSuccess;
  const int dev = mock_node::Of(stream)->device;
  return mock_node::Enqueue(stream, [=] {
    std::vector<const void*> sources;
    std::vector<void*> targets;
    for (int k = 0; k < n; ++k) {
      if (!mock_node::Touch(dev, "reduction kernel", {{srcs_at + k, 8}}, false)) return;
      if (!Load(srcs_at + k)) return;  // released
      sources.push_back(reinterpret_cast<const void*>(Load(srcs_at + k) + src_add));
    }
    for (int d = 0; d < nd; ++d) {
      if (!dsts_at) {
        targets.push_back(reinterpret_cast<void*>(dst_add));
        break;
      }
      if (!mock_node::Touch(dev, "reduction kernel", {{dsts_at + d, 8}}, false)) return;
      if (!Load(dsts_at + d)) return;
      targets.push_back(reinterpret_cast<void*>(Load(dsts_at + d) + dst_add));
    }
    RunReduce(dev, sources, spitch, targets, dpitch, count, rows, type, op);
  });
}

cudaError_t LaunchReduce(void* dst, size_t dpitch, const void* const* srcs, int n, size_t spitch,
                         size_t count, size_t rows, DType type, ReduceOp op, int blocks,
                         cudaStream_t stream, int unroll) {
  return LaunchReduceToEach(&dst, 1, dpitch, srcs, n, spitch, count, rows, type, op, blocks, stream,
                            unroll);
}

cudaError_t LaunchWaitFlag(const uint32_t* flag, uint32_t value, cudaStream_t stream) {
  return mock_node::WaitValue(stream, flag, value, "flag wait kernel");
}
cudaError_t LaunchWriteFlag(uint32_t* flag, uint32_t value, cudaStream_t stream) {
  return mock_node::WriteValue(stream, flag, value, "flag write kernel");
}

}  // namespace cuda
}  // namespace smddp

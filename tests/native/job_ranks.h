// What the mock node's multi-process test programs share about their ranks
// (gpu_node_test, gpu_node_steady.cc, nccl_windows_test): each process runs
// one thread per device, and every rank's data is known to every other.
#ifndef JAX_SMDDP_TESTS_NATIVE_JOB_RANKS_H_
#define JAX_SMDDP_TESTS_NATIVE_JOB_RANKS_H_

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

namespace smddp_test {

// Small integers (exact in float32 sums), different per rank, op and call.
inline std::vector<int32_t> RankData(int rank, int op, int call, size_t n) {
  std::vector<int32_t> v(n);
  uint64_t x = 0x9e3779b97f4a7c15ull * uint64_t(1 + rank + 64 * (op + 8 * call));
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    v[i] = int32_t(x % 41) - 20;
  }
  return v;
}

// Every rank of the job: this process's `threads` rank threads meet, then
// the last of them runs `processes` (the processes' barrier) for all.
class ThreadsThenProcesses {
 public:
  void Wait(int threads, const std::function<void()>& processes) {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t generation = generation_;
    if (++arrived_ < threads) {
      cv_.wait(lock, [&] { return generation_ != generation; });
      return;
    }
    processes();
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
};

}  // namespace smddp_test

#endif  // JAX_SMDDP_TESTS_NATIVE_JOB_RANKS_H_

#include "tests/native/scheduler_probes.h"

#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>

#include "xla_ffi/engine/scheduler.h"

namespace smddp {

std::vector<int> AllowedCpus() {
  cpu_set_t set;
  std::vector<int> out;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return out;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) out.push_back(c);
  return out;
}

std::pair<int, std::vector<int>> OffCpuProbe(int cpu) {
  OffCpu away(cpu);
  return {sched_getcpu(), AllowedCpus()};
}

std::pair<std::vector<int>, std::vector<std::vector<int>>> OffCpuSpawnProbe(int cpu, int tasks) {
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<std::vector<int>> masks;
  };
  auto shared = std::make_shared<Shared>();
  const auto all_in = [shared, tasks] { return int(shared->masks.size()) >= tasks; };
  std::vector<int> guarded;
  {
    OffCpu away(cpu);
    guarded = AllowedCpus();
    for (int i = 0; i < tasks; ++i) {
      Post([shared, all_in] {
        std::unique_lock<std::mutex> lock(shared->mu);
        shared->masks.push_back(AllowedCpus());
        shared->cv.notify_all();
        shared->cv.wait_for(lock, std::chrono::seconds(10), all_in);
      });
    }
  }
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait_for(lock, std::chrono::seconds(10), all_in);
  return {guarded, shared->masks};
}

std::vector<double> TimerProbe(std::vector<double> delays_ms, std::vector<bool> cancel,
                               double wait_ms) {
  using Clock = std::chrono::steady_clock;
  const size_t n = delays_ms.size();
  auto fired = std::make_shared<std::vector<std::atomic<int64_t>>>(n);
  for (auto& f : *fired) f.store(-1);
  const Clock::time_point start = Clock::now();
  std::vector<Timer> timers;
  for (size_t i = 0; i < n; ++i) {
    const auto at = start + std::chrono::microseconds(int64_t(delays_ms[i] * 1000));
    timers.push_back(PostAt(at, [fired, i, start] {
      (*fired)[i].store(
          std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start).count());
    }));
    if (i < cancel.size() && cancel[i]) Cancel(timers.back());
  }
  const Clock::time_point end = start + std::chrono::microseconds(int64_t(wait_ms * 1000));
  for (;;) {
    bool all = true;
    for (size_t i = 0; i < n; ++i)
      all = all && ((i < cancel.size() && cancel[i]) || (*fired)[i].load() >= 0);
    if (all || Clock::now() >= end) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::vector<double> out;
  for (auto& f : *fired) out.push_back(f.load() < 0 ? -1.0 : double(f.load()) / 1000.0);
  return out;
}

}  // namespace smddp

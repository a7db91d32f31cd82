#include "xla_ffi/engine/scheduler.h"

#include <sched.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

namespace smddp {

int CoresAvailable() {
  cpu_set_t set;
  int cores = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 0;
  if (cores <= 0) cores = int(std::thread::hardware_concurrency());
  return std::max(cores, 1);
}

namespace {
// The mask the calling thread had before its innermost OffCpu, while one holds:
// a thread it starts takes that one, not the narrowed one.
thread_local const cpu_set_t* t_home_mask = nullptr;
}  // namespace

OffCpu::OffCpu(int cpu) {
  if (cpu < 0 || cpu >= CPU_SETSIZE || sched_getcpu() != cpu) return;
  if (sched_getaffinity(0, sizeof(saved_), &saved_) != 0 || CPU_COUNT(&saved_) < 2) return;
  cpu_set_t away = saved_;
  CPU_CLR(cpu, &away);
  moved_ = sched_setaffinity(0, sizeof(away), &away) == 0;
  if (moved_) {
    outer_home_ = t_home_mask;
    if (outer_home_ == nullptr) t_home_mask = &saved_;  // nested: the outermost's stays
  }
}

OffCpu::~OffCpu() {
  if (!moved_) return;
  sched_setaffinity(0, sizeof(saved_), &saved_);
  t_home_mask = outer_home_;
}

namespace {

class Scheduler {
 public:
  Scheduler() : workers_(std::max(2, CoresAvailable())) {
    std::thread([this] { Time(); }).detach();
  }

  void Post(Task task) {
    bool spawn;
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
      // Every queued task gets a worker of its own: an idle one, or a new one.
      spawn = idle_ < int(tasks_.size());
      if (spawn) ++threads_;
    }
    if (spawn) {
      // A thread inherits its creator's mask: one started by a helper kept off a
      // core (OffCpu) would stay off it for life, and so would every device
      // program it continues (1x8 all_reduce on 2 cores: calls at one core's speed).
      const bool narrowed = t_home_mask != nullptr;
      const cpu_set_t home = narrowed ? *t_home_mask : cpu_set_t{};
      std::thread([this, narrowed, home] {
        if (narrowed) sched_setaffinity(0, sizeof(home), &home);
        Work();
      }).detach();
    } else {
      cv_.notify_one();
    }
  }

  Timer PostAt(std::chrono::steady_clock::time_point at, Task task) {
    Timer timer;
    bool before_next_look;
    {
      std::lock_guard<std::mutex> lock(timer_mu_);
      timer = Timer{at, ++next_timer_};
      timers_.emplace(std::make_pair(at, timer.id), std::move(task));
      last_added_ = std::chrono::steady_clock::now();
      before_next_look = at < next_look_;
    }
    // Every call adds a deadline and cancels it when it is over: waking the
    // timer thread for each would cost every call a context switch, so the
    // thread looks on its own at least every kTimerTick while calls come, and
    // is woken only for a deadline due before its next look.
    if (before_next_look) timer_cv_.notify_one();
    return timer;
  }

  void Cancel(const Timer& timer) {
    if (timer.id == 0) return;  // a default Timer: none was added
    std::lock_guard<std::mutex> lock(timer_mu_);
    timers_.erase(std::make_pair(timer.deadline, timer.id));
  }

  int workers() const { return workers_; }

 private:
  void Work() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      ++idle_;
      const bool got =
          cv_.wait_for(lock, std::chrono::seconds(30), [&] { return !tasks_.empty(); });
      --idle_;
      if (!got) {
        if (threads_ > workers_) {  // idle for long: give the thread back
          --threads_;
          return;
        }
        continue;
      }
      Task task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      task();
      lock.lock();
    }
  }

  void Time() {
    using Clock = std::chrono::steady_clock;
    std::unique_lock<std::mutex> lock(timer_mu_);
    for (;;) {
      const Clock::time_point now = Clock::now();
      if (!timers_.empty() && timers_.begin()->first.first <= now) {
        auto first = timers_.begin();
        Task task = std::move(first->second);
        timers_.erase(first);
        lock.unlock();
        Post(std::move(task));
        lock.lock();
        continue;
      }
      // With no deadline pending and none added for a while, sleep until one is.
      next_look_ = timers_.empty() && now - last_added_ > kTimerIdle ? Clock::time_point::max()
                                                                     : now + kTimerTick;
      if (!timers_.empty()) next_look_ = std::min(next_look_, timers_.begin()->first.first);
      if (next_look_ == Clock::time_point::max()) {
        timer_cv_.wait(lock);
      } else {
        timer_cv_.wait_until(lock, next_look_);
      }
    }
  }

  static constexpr std::chrono::milliseconds kTimerTick{200};
  static constexpr std::chrono::seconds kTimerIdle{10};

  const int workers_;
  std::mutex mu_;
  int threads_ = 0;  // worker threads alive
  int idle_ = 0;     // of which waiting for a task
  std::condition_variable cv_;
  std::deque<Task> tasks_;
  std::mutex timer_mu_;
  std::condition_variable timer_cv_;
  uint64_t next_timer_ = 0;
  // When the timer thread looks next on its own (max: only when woken).
  std::chrono::steady_clock::time_point next_look_ = std::chrono::steady_clock::time_point::max();
  std::chrono::steady_clock::time_point last_added_{};
  std::map<std::pair<std::chrono::steady_clock::time_point, uint64_t>, Task> timers_;
};

// Threads live for the process (detached): never destroyed at exit, while
// XLA may still be completing calls.
Scheduler& Get() {
  static Scheduler* scheduler = new Scheduler();
  return *scheduler;
}

}  // namespace

void Post(Task task) { Get().Post(std::move(task)); }
Timer PostAt(std::chrono::steady_clock::time_point deadline, Task task) {
  return Get().PostAt(deadline, std::move(task));
}
void Cancel(const Timer& timer) { Get().Cancel(timer); }
int WorkerCount() { return Get().workers(); }

}  // namespace smddp

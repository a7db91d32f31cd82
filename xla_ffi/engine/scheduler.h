// The engine's own threads: a pool that runs collective bodies beside the
// rank that started them and completes ranks' calls, and a timer for
// deadlines. Collectives never block an XLA thread while waiting for peers
// that are not in the call yet: XLA may run several independent collectives
// of one device at once, and blocked handlers would exhaust its thread pool
// (a deadlock). (A small call across processes whose peers have all
// announced it runs on XLA's thread: process_rendezvous.h.)
//
// Completing a rank's call makes XLA continue that device's program on the
// completing thread, and that program may block (in XLA's own collectives,
// say). So the pool never lets a task wait for a busy worker: when none is
// idle it starts another thread; threads idle for a while exit, down to the
// base count.
#ifndef JAX_SMDDP_ENGINE_SCHEDULER_H_
#define JAX_SMDDP_ENGINE_SCHEDULER_H_

#include <sched.h>

#include <chrono>
#include <cstdint>
#include <functional>

namespace smddp {

using Task = std::function<void()>;

// Runs `task` on one of the engine's worker threads.
void Post(Task task);

// Runs `task` on a worker thread once `deadline` has passed, unless the
// returned timer is cancelled first.
// Cancelling a default Timer (id 0: never added) does nothing.
struct Timer {
  std::chrono::steady_clock::time_point deadline;
  uint64_t id = 0;
};
Timer PostAt(std::chrono::steady_clock::time_point deadline, Task task);
void Cancel(const Timer& timer);

// The cores this process may use (its affinity mask; at least 1).
int CoresAvailable();

// While alive, keeps the calling thread off core `cpu` if it runs there and
// may run elsewhere (its affinity mask without `cpu`; restored when done):
// a helper woken onto the core of the thread it helps shares that core, the
// kernel slow to move it to an idle one (1x8 all_gather on 2 cores: 2 in 5
// calls at one core's speed). A worker thread the engine starts meanwhile
// (Post) takes the mask from before the guard.
class OffCpu {
 public:
  explicit OffCpu(int cpu);
  ~OffCpu();
  OffCpu(const OffCpu&) = delete;
  OffCpu& operator=(const OffCpu&) = delete;

 private:
  bool moved_ = false;
  cpu_set_t saved_;
  const cpu_set_t* outer_home_ = nullptr;  // an enclosing guard's saved mask
};

// Worker threads the engine keeps (the cores this process may use, at least
// 2); it starts more while all are busy.
int WorkerCount();

}  // namespace smddp

#endif  // JAX_SMDDP_ENGINE_SCHEDULER_H_

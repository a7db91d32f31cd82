// The engine's scheduler probed on its own, for tests/engine/test_scheduler.py
// through _smddp_testing (a test double's companion: built into that module
// only).
#ifndef JAX_SMDDP_TESTS_NATIVE_SCHEDULER_PROBES_H_
#define JAX_SMDDP_TESTS_NATIVE_SCHEDULER_PROBES_H_

#include <utility>
#include <vector>

namespace smddp {

// The CPUs a thread may run on (its affinity mask), in order.
std::vector<int> AllowedCpus();
// OffCpu(cpu) on the calling thread: the CPU it then runs on and its mask
// while the guard lives (the caller reads the mask it leaves behind).
std::pair<int, std::vector<int>> OffCpuProbe(int cpu);
// Under OffCpu(cpu), posts `tasks` engine tasks that each wait for all the
// others (each needs a worker of its own: more than are idle start new threads
// from this one); returns the calling thread's CPUs under the guard, and each
// task's.
std::pair<std::vector<int>, std::vector<std::vector<int>>> OffCpuSpawnProbe(int cpu, int tasks);
// Posts one engine timer per entry of `delays_ms` (from now), cancels those
// marked in `cancel` at once, and returns when each fired, in ms from the
// start (-1: it never fired within `wait_ms`).
std::vector<double> TimerProbe(std::vector<double> delays_ms, std::vector<bool> cancel,
                               double wait_ms);

}  // namespace smddp

#endif  // JAX_SMDDP_TESTS_NATIVE_SCHEDULER_PROBES_H_

#include "xla_ffi/algorithms/wait_polls.h"

#include <algorithm>
#include <cstdint>

#include "xla_ffi/common/settings.h"

namespace smddp {
namespace {

// The defaults the registry describes: {spin, yield} polls with cores to
// spare, and where they are oversubscribed (measured on a 2-core VM, 4
// processes: docs/cpu_floor.md, "Waiting on an oversubscribed
// machine").
constexpr WaitPolls kSpareCores{256, 4096};
constexpr WaitPolls kOversubscribed{16, 32};

int64_t GivenOr(const char* name) {
  int64_t v = -1;
  IntSettingIfSet(name, &v);
  return v;
}

}  // namespace

WaitPolls WaitPollsOnArrival(WaitPolls polls) {
  constexpr WaitPolls kMost{1, 2};
  return {std::min(polls.yield_after, kMost.yield_after),
          std::min(polls.sleep_after, kMost.sleep_after)};
}

unsigned SleepBoundUs(unsigned floor_us, int64_t waited_us) {
  const int64_t grown = std::min<int64_t>(kLongWaitSleepUs, std::max<int64_t>(0, waited_us) / 8);
  return std::max<unsigned>(floor_us, unsigned(grown));
}

WaitPolls WaitPollsFor(bool oversubscribed) {
  static const int64_t spin = GivenOr("JAX_SMDDP_SPIN");
  static const int64_t yield = GivenOr("JAX_SMDDP_YIELD");
  const WaitPolls d = oversubscribed ? kOversubscribed : kSpareCores;
  return {spin >= 0 ? unsigned(spin) : d.yield_after, yield >= 0 ? unsigned(yield) : d.sleep_after};
}

}  // namespace smddp

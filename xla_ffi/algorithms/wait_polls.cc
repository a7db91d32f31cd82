#include "xla_ffi/algorithms/wait_polls.h"

#include <atomic>
#include <cstdint>

#include "xla_ffi/common/settings.h"

namespace smddp {
namespace {

// The defaults the registry describes: {spin, yield} polls with cores to
// spare, and where they are oversubscribed (measured on a 2-core VM, 4
// processes: docs/performance_model.md, "Waiting on an oversubscribed
// machine").
constexpr WaitPolls kSpareCores{256, 4096};
constexpr WaitPolls kOversubscribed{16, 32};

std::atomic<bool> oversubscribed{false};

}  // namespace

WaitPolls CurrentWaitPolls() {
  static const int64_t spin = [] {
    int64_t v = -1;
    IntSettingIfSet("JAX_SMDDP_SPIN", &v);
    return v;
  }();
  static const int64_t yield = [] {
    int64_t v = -1;
    IntSettingIfSet("JAX_SMDDP_YIELD", &v);
    return v;
  }();
  const WaitPolls d =
      oversubscribed.load(std::memory_order_relaxed) ? kOversubscribed : kSpareCores;
  return {spin >= 0 ? unsigned(spin) : d.yield_after, yield >= 0 ? unsigned(yield) : d.sleep_after};
}

void SetOversubscribed(bool value) { oversubscribed.store(value, std::memory_order_relaxed); }

}  // namespace smddp

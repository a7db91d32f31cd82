#include "xla_ffi/algorithms/call_phases.h"

#include <mutex>

namespace smddp {
namespace {

constexpr int kKinds = kCollectives;
std::mutex totals_mu;
CallPhaseTotals totals[kKinds];

}  // namespace

CallPhases& CallPhases::operator+=(const CallPhases& o) {
  local_s += o.local_s;
  queue_s += o.queue_s;
  agree_s += o.agree_s;
  body_s += o.body_s;
  wait_s += o.wait_s;
  sleep_s += o.sleep_s;
  sleeps += o.sleeps;
  inline_calls += o.inline_calls;
  return *this;
}

void TallyCallPhases(Collective kind, const CallPhases& call) {
  std::lock_guard<std::mutex> lock(totals_mu);  // once per call, after its work
  CallPhaseTotals& t = totals[int(kind)];
  t.calls++;
  t.sum += call;
}

CallPhaseTotals CallPhaseTotal(Collective kind) {
  std::lock_guard<std::mutex> lock(totals_mu);
  return totals[int(kind)];
}

}  // namespace smddp

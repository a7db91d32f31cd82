// Where a cross-process call's time goes, for finding what a call waits on
// (between hosts above all): the engine and the cross-process bodies fill one
// record per call, and the process sums them per collective
// (jax_smddp.distributed.call_phases(), the benchmark's --phases).
#ifndef JAX_SMDDP_ALGORITHMS_CALL_PHASES_H_
#define JAX_SMDDP_ALGORITHMS_CALL_PHASES_H_

#include <cstdint>

#include "xla_ffi/algorithms/plan.h"

namespace smddp {

// One call, in seconds. local + queue + agree + body is the call's time from
// the first of this process's devices arriving to its completion.
struct CallPhases {
  double local_s = 0;  // the first local device's arrival to the last's
  double queue_s = 0;  // the last arrival to its XLA thread starting the call
  double agree_s = 0;  // the agreement check outside the body: between the
                       // body's start and its rest (the inline wait for the
                       // peers' views, the hand-off to a worker), and the
                       // wait for views still in flight after the body
  double body_s = 0;   // the collective's own messages, copies and reductions,
                       // begun at once: a peer that comes late shows here
  double wait_s = 0;   // of agree and body: waiting for links to finish transfers
  double sleep_s = 0;  // of wait: asleep (the link's activity, or a timed sleep)
  uint64_t sleeps = 0;
  uint64_t inline_calls = 0;  // 1: run on the last arrival's XLA thread, no hand-off

  CallPhases& operator+=(const CallPhases& o);
};

// Adds a completed call of `kind` to this process's totals.
void TallyCallPhases(Collective kind, const CallPhases& call);

// The calls of `kind` tallied so far, and their phases summed.
struct CallPhaseTotals {
  uint64_t calls = 0;
  CallPhases sum;
};
CallPhaseTotals CallPhaseTotal(Collective kind);

}  // namespace smddp

#endif  // JAX_SMDDP_ALGORITHMS_CALL_PHASES_H_

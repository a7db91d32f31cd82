// Collective algorithms for groups that span processes (and hosts), written
// once over links (shared memory, libfabric): what one process does, on
// behalf of all of its ranks, once they have all arrived.
//
// Hierarchical, in the SMDDP manner: every process exchanges with every other
// process directly (an all-to-all between processes rather than a ring: fewer
// hops, and suited to networks such as EFA that spread traffic over many
// paths), while the exchange among the process's own ranks runs in memory;
// messages are chunked so copies and reductions of what has arrived overlap
// with what is still in flight. Reductions are balanced: each output shard
// is reduced exactly once, by the process that owns it, from one partial per
// process (the process's own ranks are reduced locally first, so only one
// copy of each shard crosses each link).
#ifndef JAX_SMDDP_ALGORITHMS_PROCESS_ALGORITHMS_H_
#define JAX_SMDDP_ALGORITHMS_PROCESS_ALGORITHMS_H_

#include <memory>

#include "xla_ffi/algorithms/plan.h"
#include "xla_ffi/algorithms/process_call.h"

namespace smddp {

// Runs `plan` for every rank of this process, in two parts so that the caller
// may choose the thread of the second. Constructing it never waits: it posts
// the agreement check (this process's view of the call: op, dtype, sizes,
// routes, to every peer process, and the receives of theirs) and starts the
// body (posts its messages, sends what needs nothing received). Once every
// peer's view is in, every process of the group is in this call, and what
// remains of it waits only on them (what PeersArrived tells).
class ProcessRun {
 public:
  // `call` must outlive the run.
  ProcessRun(const Plan& plan, ProcessCall& call);
  ~ProcessRun();

  // Whether every peer's view of the call has arrived, polling the links
  // (never sleeping) until `until` at the latest.
  bool PeersArrived(Clock::time_point until);

  // Runs the rest of the call, comparing the peers' views with this process's
  // as they arrive, and all of them before it succeeds (with the call's
  // deadline, peers watched): a process that runs another call fails every
  // process with an error naming both calls, whatever its data did to this
  // one. Called once.
  Status Finish();

 private:
  struct Parts;
  // The body's `timeout` told of a peer that never reached the call, or Ok.
  Status NeverArrived(const Status& timeout);
  ProcessCall& call_;
  Clock::time_point start_, started_;  // constructed; the body started
  std::unique_ptr<Parts> parts_;
};

}  // namespace smddp

#endif  // JAX_SMDDP_ALGORITHMS_PROCESS_ALGORITHMS_H_

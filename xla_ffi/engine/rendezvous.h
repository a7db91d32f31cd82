// The engine's rendezvous: where every rank of a communicator starts a
// collective call, and what decides where the algorithm's bodies run and when
// buffers are free. Completion is reported asynchronously: no caller ever
// blocks waiting for a peer. Two implementations: in one process
// (inprocess_rendezvous.h) the host bodies (host_algorithms.h) run over an Exchange
// per rank; across processes (process_rendezvous.h) the ranks of each process
// meet in memory and the cross-process bodies (process_algorithms.h) run over
// links.
#ifndef JAX_SMDDP_ENGINE_RENDEZVOUS_H_
#define JAX_SMDDP_ENGINE_RENDEZVOUS_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "xla_ffi/algorithms/call_info.h"
#include "xla_ffi/common/status.h"

namespace smddp {

// Identifies one call instance of one collective across all ranks.
struct CallKey {
  uint64_t communicator = 0;
  int64_t run_id = 0;       // the XLA execution (equal on every device)
  int64_t instance = 0;     // the collective instruction
  uint64_t invocation = 0;  // how many times it already ran in this run (loops)
  int64_t op_id = 0;        // its position in the program: for messages only
  uint64_t site = 0;        // the instruction, named alike in every process
                            // (instance numbers are per process)
  uint64_t sequence = 0;    // calls of it before this one, over all runs:
                            // with `site`, names the call across processes
  bool operator==(const CallKey& o) const {
    return communicator == o.communicator && run_id == o.run_id && instance == o.instance &&
           invocation == o.invocation;
  }
};

struct CallKeyHash {
  size_t operator()(const CallKey& k) const {
    uint64_t h = k.communicator * 0x9e3779b97f4a7c15ull;
    h ^= uint64_t(k.run_id) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h ^= uint64_t(k.instance) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h ^= k.invocation + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    return size_t(h);
  }
};

// Called once per rank when its part of a call is over: no peer will touch
// its buffers again.
using Done = std::function<void(const Status&)>;

struct Plan;

// Describes a communicator to its rendezvous, for error messages.
struct GroupInfo {
  uint64_t id = 0;
  std::string description;  // e.g. "devices [0 1 2 3]"
};

class Rendezvous {
 public:
  virtual ~Rendezvous() = default;
  // Starts the call `key` for `rank` and returns without waiting: once
  // every rank of the group has started it (by `deadline`, else every rank
  // fails), `plan` runs as every rank, and each rank's `done` is called with
  // the call's status (the same for every rank), on an engine thread.
  virtual void Start(const GroupInfo& group, int size, const CallKey& key, int rank,
                     const void* send, void* recv, const CallInfo& info, Clock::time_point deadline,
                     const Plan& plan, Done done) = 0;
};

}  // namespace smddp

#endif  // JAX_SMDDP_ENGINE_RENDEZVOUS_H_

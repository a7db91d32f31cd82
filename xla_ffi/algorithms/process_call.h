// One collective call as a process sees it when the group spans processes:
// which ranks live where, this process's ranks' buffers, and the links to the
// other processes. What the cross-process algorithms run on.
#ifndef JAX_SMDDP_ALGORITHMS_PROCESS_CALL_H_
#define JAX_SMDDP_ALGORITHMS_PROCESS_CALL_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "xla_ffi/algorithms/call_info.h"
#include "xla_ffi/algorithms/call_phases.h"
#include "xla_ffi/common/hashing.h"  // MixTag, used with calls' tags
#include "xla_ffi/common/streaming_copy.h"
#include "xla_ffi/transports/world.h"

namespace smddp {

// Which process sends this process what, for a group that spans processes.
// Flat: every process exchanges with every other directly. Hierarchical (the
// group spans hosts, each with the same number P >= 2 of its processes): the
// processes of a host are numbered 0..P-1 (their rail), and only processes of
// the same rail exchange between hosts, so each byte crosses the network
// once per host instead of once per process; within a host, shared memory
// spreads it (gathers) or combines it first (reductions).
struct Routes {
  bool hierarchical = false;
  // Gathers: for each rank not in this process, the process its block comes
  // from (its own, or this host's process of its rail, which relays it), and
  // the processes this process relays that rank's block to.
  std::vector<int> gather_source;
  std::vector<std::vector<int>> gather_relay;
  // The processes that receive this process's own blocks directly.
  std::vector<int> gather_targets;
  // Reductions: for each rank, the processes whose contributions to it this
  // process receives (to combine with its own), and the process it sends the
  // combination to (-1 for its own ranks, which it completes).
  std::vector<std::vector<int>> reduce_sources;
  std::vector<int> reduce_dest;
  // Remote ranks in the order gathers await their blocks: those this process
  // relays first, so no process waits on a relay that waits on it.
  std::vector<int> gather_order;
  // Ranks in the order reductions handle them: remote ranks that need
  // nothing received (this process's partial only), then remote ranks this
  // process combines for its host, then its own ranks; each stage waits only
  // on earlier stages of other processes, so none waits in a cycle.
  std::vector<int> reduce_order;
  // Staggered rounds between hosts (more than 2 hosts, this process
  // exchanging with one process on each other host): in round k = 1..H-1
  // it sends to stagger_to[k-1], on host (h+k) mod H, and receives from
  // stagger_from[k-1], on host (h-k) mod H, so that each host's link carries
  // one flow at a time, as a ring's does; all at once, TCP flows share a
  // capped link unevenly and the call waits for the slowest. A round's sends
  // wait for the previous round's receive, chunk by chunk (Messages::Hold).
  // Empty: no rounds.
  std::vector<int> stagger_to, stagger_from;
  // One process on each of more than 2 hosts (and rounds allowed): the
  // hosts form a ring instead (in the rounds' host order), and every byte
  // between them goes round it, relayed and combined chunk by chunk: each
  // link carries one flow, and every process sends to one peer and receives
  // from one, whichever process is ahead; rounds lose ~5 % of a capped link
  // to their gates (issue #50). The gather and reduce routes above say so
  // (one target, the ring's next; every source its previous), and
  // gather_order and reduce_order follow the ring's distance. A reduction's
  // partial is rounded to the dtype at every hop, as in NCCL's and gloo's
  // rings (the all-to-all sums every host's part at once at its end).
  bool ring = false;
};

// Routes for `process` in a group with `process_of_rank`, given each
// process's host (any ids; equal = same host). `allow_hierarchy`: false
// forces flat routes (JAX_SMDDP_HIERARCHICAL=0); `stagger`: whether to
// stagger rounds between hosts, or run a ring where a ring applies
// (JAX_SMDDP_STAGGER_CHUNK_BYTES).
Routes ComputeRoutes(const std::vector<int>& process_of_rank, int process,
                     const std::vector<std::string>& host_of_process, bool allow_hierarchy,
                     bool stagger = false);

// What a call checks while its messages are waited for, beside the peers'
// liveness: a failure it returns fails the call.
class CallWatch {
 public:
  virtual Status Check() const = 0;

 protected:
  ~CallWatch() = default;
};

struct ProcessCall {
  const World* world = nullptr;
  int size = 0;                             // ranks in the group
  const std::vector<int64_t>* members;      // device (partition) id per rank
  const std::vector<int>* process_of_rank;  // process per rank
  // The group's processes as this one sees them: fixed for a communicator,
  // so a call points at its owner's (no per-call copies on XLA's thread).
  const std::vector<int>* local = nullptr;  // this process's ranks, ascending
  std::vector<const void*> send;            // per local rank
  std::vector<void*> recv;                  // per local rank
  const std::vector<int>* peers = nullptr;  // the group's other processes, ascending
  const std::vector<std::vector<int>>* peer_ranks = nullptr;  // per peer, its ranks, ascending
  const Routes* routes = nullptr;
  size_t chunk_bytes = 0;  // message chunk; 0: the default
  uint64_t tag = 0;        // this call's; equal on every process
  Clock::time_point start, deadline;
  CallPhases* phases = nullptr;  // where the call's time goes, if wanted
  // The agreement check, as the peers' views of the call arrive during the
  // body; none outside it.
  const CallWatch* watch = nullptr;
  // "jax_smddp all_gather (op 3 of ...)", for errors: made only when one is
  // reported, not on every call (its owner's state, captured by pointer).
  std::function<std::string()> where;
  CallInfo info;

  // Whether the call's copies into outputs use non-temporal stores: by what
  // it writes in this process, all local outputs (streaming_copy.h).
  bool StreamOutputs() const { return StreamStores(info.recv_bytes * local->size()); }
  // "process 1 (devices [2 3])"
  std::string DescribeProcess(int process) const;
  // `process`'s ranks in the group, ascending (for a failure's peers).
  std::vector<int> RanksOf(int process) const;
  // `status` with `process` and its ranks as the peers it concerns.
  Status Concerning(int process, Status status) const {
    return status.SetPeers(RanksOf(process), {process});
  }
};

}  // namespace smddp

#endif  // JAX_SMDDP_ALGORITHMS_PROCESS_CALL_H_

// A communicator: an ordered group of ranks (the XLA devices of one replica
// group, named by their global device ids) and the transport that joins them.
// It turns (run id, op id) into a call key: an op that runs several times in
// one execution (inside a loop) is told apart by its invocation count, which
// every rank advances identically because all ranks run the same program.
#ifndef JAX_SMDDP_ENGINE_COMMUNICATOR_H_
#define JAX_SMDDP_ENGINE_COMMUNICATOR_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "xla_ffi/engine/transport.h"

namespace smddp {

class Communicator {
 public:
  Communicator(uint64_t id, std::vector<int64_t> members, Transport* transport);

  int size() const { return int(members_.size()); }
  const std::vector<int64_t>& members() const { return members_; }
  const GroupInfo& info() const { return info_; }

  // Runs one collective call for `rank` (see Transport::Run), waiting for
  // all peers until the engine's timeout. `instance` identifies the
  // instruction (equal on every rank); `op_id` is its position in the
  // program, for messages.
  Status Run(int64_t run_id, int64_t instance, int64_t op_id, int rank, const void* send,
             void* recv, const CallInfo& call, const Body& body);

 private:
  uint64_t NextInvocation(int64_t run_id, int64_t op_id, int rank);

  std::vector<int64_t> members_;
  GroupInfo info_;
  Transport* transport_;

  struct CounterKey {
    int64_t run_id, op_id;
    int rank;
    bool operator==(const CounterKey& o) const {
      return run_id == o.run_id && op_id == o.op_id && rank == o.rank;
    }
  };
  struct CounterKeyHash {
    size_t operator()(const CounterKey& k) const {
      return size_t(k.run_id * 0x9e3779b97f4a7c15ull ^ (k.op_id << 20) ^ k.rank);
    }
  };
  std::mutex mu_;
  std::unordered_map<CounterKey, uint64_t, CounterKeyHash> invocations_;
  std::deque<int64_t> recent_runs_;  // bounds `invocations_` to recent runs
};

// The engine's communicators, created on first use and kept for the process.
Communicator* FindOrCreateCommunicator(const int64_t* members, int size);

// Deadline for every wait of a collective, in seconds.
void SetTimeoutSeconds(double seconds);
double TimeoutSeconds();

}  // namespace smddp

#endif  // JAX_SMDDP_ENGINE_COMMUNICATOR_H_

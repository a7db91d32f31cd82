// The interface the host algorithms (algorithms.h) are written against.
//
// Every rank of a communicator starts a collective call through the
// transport. A host algorithm is a body: what one rank does, given an Exchange
// (that rank's view of all ranks' buffers for the call, with the moves it may
// make between them). The transport decides where bodies run and when buffers
// are free, and reports completion asynchronously: no caller ever blocks
// waiting for a peer. Two transports implement it (engine/): in one process
// (inprocess_transport.h) the bodies run as they are; across processes
// (process_transport.h) the ranks of each process meet through it, and the
// cross-process part runs process_algorithms.h over links instead. The GPU
// backend runs stream_algorithms.h over StreamOps. What the three families
// share is the Plan (algorithms.h), the reductions (reduce.h) and the element
// types; each collective has one body per family (docs/architecture.md).
#ifndef JAX_SMDDP_ALGORITHMS_TRANSPORT_H_
#define JAX_SMDDP_ALGORITHMS_TRANSPORT_H_

#include <chrono>
#include <functional>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "xla_ffi/common/dtype.h"
#include "xla_ffi/common/status.h"

namespace smddp {

using Clock = std::chrono::steady_clock;

// What every rank of one call must agree on; checked when the call opens so
// that mismatched programs fail loudly instead of mixing data.
struct CallInfo {
  const char* op = "";
  DType dtype = DType::kFloat32;
  ReduceOp reduce = ReduceOp::kSum;
  uint64_t send_bytes = 0;
  uint64_t recv_bytes = 0;
  bool operator==(const CallInfo& o) const {
    return std::string(op) == o.op && dtype == o.dtype && reduce == o.reduce &&
           send_bytes == o.send_bytes && recv_bytes == o.recv_bytes;
  }
};

// Identifies one call instance of one collective across all ranks.
struct CallKey {
  uint64_t communicator = 0;
  int64_t run_id = 0;      // the XLA execution (equal on every device)
  int64_t instance = 0;    // the collective instruction
  uint64_t invocation = 0; // how many times it already ran in this run (loops)
  int64_t op_id = 0;       // its position in the program: for messages only
  uint64_t site = 0;       // the instruction, named alike in every process
                           // (instance numbers are per process)
  uint64_t sequence = 0;   // calls of it before this one, over all runs:
                           // with `site`, names the call across processes
  bool operator==(const CallKey& o) const {
    return communicator == o.communicator && run_id == o.run_id &&
           instance == o.instance && invocation == o.invocation;
  }
};

class Exchange {
 public:
  virtual ~Exchange() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Direct pointer to `peer`'s send buffer when it is addressable from this
  // rank (always for peer == rank), else nullptr.
  virtual const void* PeerSend(int peer) = 0;
  // Copies `bytes` of `peer`'s send buffer, from `offset`, into local `dst`.
  virtual Status Get(int peer, size_t offset, void* dst, size_t bytes) = 0;
  // Copies local `src` into `peer`'s receive buffer at `offset`.
  virtual Status Put(int peer, size_t offset, const void* src, size_t bytes) = 0;
  // This rank's receive buffer.
  virtual void* Recv() = 0;
};

// Called once per rank when its part of a call is over: no peer will touch
// its buffers again.
using Done = std::function<void(const Status&)>;

struct Plan;

// Describes a communicator to its transport, for error messages.
struct GroupInfo {
  uint64_t id = 0;
  std::string description;  // e.g. "devices [0 1 2 3]"
};

class Transport {
 public:
  virtual ~Transport() = default;
  // Starts the call `key` for `rank` and returns without waiting: once
  // every rank of the group has started it (by `deadline`, else every rank
  // fails), `plan` runs as every rank, and each rank's `done` is called with
  // the call's status (the same for every rank), on an engine thread.
  virtual void Start(const GroupInfo& group, int size, const CallKey& key, int rank,
                     const void* send, void* recv, const CallInfo& info,
                     Clock::time_point deadline, const Plan& plan, Done done) = 0;
};

}  // namespace smddp

#endif  // JAX_SMDDP_ALGORITHMS_TRANSPORT_H_

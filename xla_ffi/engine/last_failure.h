// The collectives that failed in this process, kept in a structured form (op,
// communicator, kind, peers, message, what to do), so that Python can give a
// user a typed error with its peers instead of text to parse
// (jax_smddp.errors.last_failure). XLA hands a handler's error on as text
// only; this record is the rest of it.
//
// Header-only on purpose: each native module (_smddp_cpu, _smddp_cuda) has
// its own copy of the engine, and so its own record of the failures it saw.
#ifndef JAX_SMDDP_ENGINE_LAST_FAILURE_H_
#define JAX_SMDDP_ENGINE_LAST_FAILURE_H_

#include <chrono>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "xla_ffi/common/status.h"

namespace smddp {

struct FailureRecord {
  uint64_t sequence = 0;         // 1, 2, ... in the order this module recorded them
  double unix_time = 0;          // when (seconds since the epoch)
  std::string op;                // "all_gather", ...
  std::vector<int64_t> devices;  // the communicator: its ranks' device ids
  int rank = -1;                 // the rank (of `devices`) whose call failed
  StatusCode code = StatusCode::kInternal;
  std::vector<int> peer_ranks;      // the peers it concerns, as ranks of `devices`
  std::vector<int> peer_processes;  // ... and as process indices
  std::string message;
  std::string remedy;
};

// What a user can do about a failure of kind `code`.
inline const char* Remedy(StatusCode code) {
  switch (code) {
    case StatusCode::kTimeout:
      return "A peer did not reach this collective before the deadline. Check that every process "
             "runs the same program and that none failed or stalled earlier (look at the named "
             "peers' logs); if they are only slow, raise JAX_SMDDP_TIMEOUT_S or call "
             "jax_smddp.set_timeout(seconds).";
    case StatusCode::kPeerFailed:
      return "A peer process died, closed its link or failed an earlier collective. Its own log "
             "has the first error; this process's collectives on that group cannot complete: "
             "save what you need and restart the job (from the last checkpoint).";
    case StatusCode::kMismatch:
      return "The ranks or processes ran different calls. Make every process run the same "
             "collectives in the same order with the same shapes, dtypes and reduction; look for "
             "code that branches on the process index or on data-dependent shapes.";
    case StatusCode::kUnsupported:
      return "jax_smddp's engine does not take this case: use jax.lax's collective for it, or "
             "let jax_smddp fall back (unset JAX_SMDDP_REQUIRE=no-fallback).";
    case StatusCode::kInvalidArgument:
      return "The call or the set-up is invalid as the message says: check the replica groups, "
             "the JAX_SMDDP_* settings and that jax.distributed.initialize() and "
             "jax_smddp.initialize() ran in every process.";
    case StatusCode::kProtocol:
      return "A peer sent data this process cannot parse (a malformed chunk header: another wire "
             "protocol version, a wrong magic, a length past its end, a sender outside the job). "
             "The processes most likely run different jax_smddp builds (hosts with different "
             "images): install the same jax_smddp, built against the same jaxlib, on every host "
             "and restart the job; if they do, the named peer's memory or network is corrupting "
             "data.";
    case StatusCode::kOk:
    case StatusCode::kInternal:
      break;
  }
  return "An internal error in jax_smddp or the system (memory, CUDA): please report it with "
         "this message and the output of `python -m jax_smddp.doctor`.";
}

namespace last_failure_internal {
constexpr size_t kKept = 32;  // enough for every device of a process failing one call
struct Store {
  std::mutex mu;
  uint64_t next = 1;
  std::deque<FailureRecord> records;  // oldest first
};
inline Store& TheStore() {
  static Store* store = new Store();  // never destroyed: engine threads may record at exit
  return *store;
}
}  // namespace last_failure_internal

// Records that `rank` of the communicator `devices` failed its `op` with `st`.
inline void RecordFailure(const char* op, const std::vector<int64_t>& devices, int rank,
                          const Status& st) {
  if (st.ok()) return;
  FailureRecord r;
  r.unix_time =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  r.op = op ? op : "collective";
  r.devices = devices;
  r.rank = rank;
  r.code = st.code();
  r.peer_ranks = st.peer_ranks();
  r.peer_processes = st.peer_processes();
  r.message = st.message();
  r.remedy = Remedy(st.code());
  auto& s = last_failure_internal::TheStore();
  std::lock_guard<std::mutex> lock(s.mu);
  r.sequence = s.next++;
  s.records.push_back(std::move(r));
  while (s.records.size() > last_failure_internal::kKept) s.records.pop_front();
}

// The failures recorded lately, oldest first (the last is the last failure).
inline std::vector<FailureRecord> RecentFailures() {
  auto& s = last_failure_internal::TheStore();
  std::lock_guard<std::mutex> lock(s.mu);
  return std::vector<FailureRecord>(s.records.begin(), s.records.end());
}

}  // namespace smddp

#endif  // JAX_SMDDP_ENGINE_LAST_FAILURE_H_

// The calls each rank of a stream-ordered group enqueued, kept in host
// memory that every process of the group maps, so that processes running
// different collectives or shapes on a group fail instead of exchanging
// mismatched data. The GPU handlers only enqueue, so they cannot trade a
// header with their peers before the data as the CPU path does
// (process_algorithms.cc); instead, when a rank enqueues its k-th call, it
// records it in its ring and compares it with every peer's k-th call already
// recorded. Of two ranks that disagree, the one that records second sees the
// other's entry (both store, then load, sequentially consistent) and fails
// its call before enqueuing it; only a peer more than kEntries calls ahead
// escapes the check (its entry was overwritten), and nothing is ever
// reported that did not differ.
#ifndef JAX_SMDDP_ENGINE_CALL_LOG_H_
#define JAX_SMDDP_ENGINE_CALL_LOG_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "xla_ffi/algorithms/plan.h"
#include "xla_ffi/common/status.h"

namespace smddp {

class CallLog {
 public:
  static constexpr size_t kEntries = 64;
  struct Entry {
    std::atomic<uint64_t> w[8];  // w[0]: call + 1 once the rest is written (0: being written)
  };
  static_assert(sizeof(Entry) == 64, "one cache line per entry");
  static constexpr size_t kBytes = kEntries * sizeof(Entry);  // one rank's ring (zeroed)

  // `rings`: every rank's ring as this process addresses it (null: not
  // checked). Records `rank`'s call number `call` (0, 1, ...) of `op` with
  // `plan`, then compares it with the peers' entries for that call.
  // `who(q)` names rank q in messages ("rank 1 (process 1)").
  // How many calls `ring`'s rank has logged (its latest entry's number + 1).
  static uint64_t Calls(const uint8_t* ring);
  // Call `call` of `ring` ("all_gather of float32 (...)"); "" if not there.
  static std::string Describe(const uint8_t* ring, uint64_t call);

  static Status RecordAndCheck(const std::vector<uint8_t*>& rings, int rank, uint64_t call,
                               const char* op, const Plan& plan,
                               const std::function<std::string(int)>& who);
};

}  // namespace smddp

#endif  // JAX_SMDDP_ENGINE_CALL_LOG_H_

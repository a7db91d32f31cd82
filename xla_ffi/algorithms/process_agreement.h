// The agreement check of a call across processes (process_algorithms.h):
// each process sends every peer its view of the call ahead of the data, and
// compares the views that arrive with its own, so that a peer running
// another call is named as such rather than by what its data did.
#ifndef JAX_SMDDP_ALGORITHMS_PROCESS_AGREEMENT_H_
#define JAX_SMDDP_ALGORITHMS_PROCESS_AGREEMENT_H_

#include <cstdint>
#include <vector>

#include "xla_ffi/algorithms/messages.h"
#include "xla_ffi/algorithms/plan.h"
#include "xla_ffi/algorithms/process_call.h"

namespace smddp {

// A call's message rounds: the agreement's headers, then the bodies' data
// and results.
enum Round : uint64_t { kHeader = 1, kData = 2, kResult = 3 };

// A message id, unique within a call.
inline uint64_t Msg(uint64_t round, uint64_t a = 0, uint64_t b = 0) {
  return (round << 56) ^ (a << 28) ^ b;
}

// What every process must agree on, sent to every peer ahead of the call's data.
struct ProcessCallHeader {
  char op[16];
  uint64_t dtype, reduce, send_bytes, recv_bytes, size, kind, outer, inner, count;
  uint64_t hierarchical, chunk_bytes;  // how the call moves data: must agree too
  uint64_t permutation;                // collective_permute's sources, hashed (0 otherwise)
};

// The agreement check's messages: this process's header, posted to every
// peer, and the receives of theirs (declared last: destroyed first, it
// withdraws what is still in flight before the headers go). Peer i's header
// is transfer i of `m`: posted first, and one chunk (a chunk is >= 4 KiB).
class ProcessAgreement final : public CallWatch {
 public:
  ProcessAgreement(const ProcessCall& call, const Plan& plan);
  // Compares this process's view of the call with every peer's that arrived.
  Status Check() const override;

  const ProcessCall& c;
  const ProcessCallHeader mine;
  std::vector<ProcessCallHeader> theirs;
  Messages m;
};

}  // namespace smddp

#endif  // JAX_SMDDP_ALGORITHMS_PROCESS_AGREEMENT_H_

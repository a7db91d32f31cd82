// The NCCL API front end's communicators inside the library: what set-up
// (nccl_comm.cc) shares with the real side (nccl_real_comm.cc), the exchange
// of one communicator's creation or split as this process takes part in it.
#ifndef JAX_SMDDP_CUDA_NCCLAPI_NCCL_JOINING_H_
#define JAX_SMDDP_CUDA_NCCLAPI_NCCL_JOINING_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/ncclapi/nccl_comm.h"
#include "xla_ffi/transports/link.h"

namespace smddp {
namespace nccl {

using Clock = std::chrono::steady_clock;

// The real library's id of a communicator as rank 0's process sends it to the
// others: `has` 0 when the library made none that fits the front end's id.
struct RealId {
  uint32_t has = 0;
  uint8_t id[kRealIdBytes] = {};
};

// What one rank tells the root when a communicator is created or split.
struct Entry {
  int32_t rank;  // in the communicator created (InitRank) or split (its parent's)
  int32_t nranks;
  int32_t process;
  int32_t ordinal;
  int32_t color;  // splits only
  int32_t key;
};

enum : uint64_t { kJoin = 1, kTable = 2, kHandleSize = 3, kHandles = 4, kRealId = 5 };

// A real library's id for a new communicator, when the library is there and
// its id fits the front end's (the bytes past kRealIdBytes are zero).
bool NewRealId(uint8_t out[kRealIdBytes]);
uint64_t Tag(const uint64_t nonce[2], uint64_t what, uint64_t a, uint64_t b);
// Waits for `req` on `link` (to `peer`) within the deadline.
Status Await(const World& world, int peer, Request& req, const std::string& what,
             Clock::time_point deadline);

// One exchange of entries (a communicator's creation, or a split) as this
// process takes part in it: the root collects, the others wait for the table.
struct Joining {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Entry> table;  // by rank, once complete
  int arrived = 0;           // entries in `table` (the root) / local ranks here
  int sent = 0;              // join messages this process sent (their sequence)
  bool working = false;      // a thread of this process collects or receives
  bool done = false;
  Status status;
  // The GPU communicator's set-up, once per process (after the table).
  bool set_up = false;
  bool setting_up = false;
  Status set_up_status;
  // The real library's id, agreed once per process at the communicator's
  // first forwarded call (AgreeRealId).
  bool real_id_agreed = false;
  bool agreeing_real_id = false;
  Status real_id_status;
  RealId real_id;
};

// The Joining of the communicator `nonce` names, made at its first use.
std::shared_ptr<Joining> JoiningOf(const uint64_t nonce[2]);

}  // namespace nccl
}  // namespace smddp

#endif  // JAX_SMDDP_CUDA_NCCLAPI_NCCL_JOINING_H_

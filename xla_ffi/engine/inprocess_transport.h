// Transport between XLA devices of one process: ranks share the address space,
// so a call's buffers are exchanged as pointers through a rendezvous slot and
// data moves with memcpy (or is read in place by the algorithm).
//
// XLA runs each device's program on its own thread, and there are usually
// more devices than cores. So the bodies of a call are not tied to their
// ranks' threads: once every rank has arrived, the last one to arrive runs
// bodies, waking only as many sleeping ranks as there are spare cores to help,
// and every rank leaves when all bodies are done. That is one sleep and one
// wake-up per rank, and no more threads competing than there are cores.
#ifndef JAX_SMDDP_ENGINE_INPROCESS_TRANSPORT_H_
#define JAX_SMDDP_ENGINE_INPROCESS_TRANSPORT_H_

#include <memory>
#include <mutex>
#include <unordered_map>

#include "xla_ffi/engine/transport.h"

namespace smddp {

struct CallKeyHash {
  size_t operator()(const CallKey& k) const {
    uint64_t h = k.communicator * 0x9e3779b97f4a7c15ull;
    h ^= uint64_t(k.run_id) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h ^= uint64_t(k.instance) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h ^= k.invocation + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    return size_t(h);
  }
};

class InProcessTransport : public Transport {
 public:
  struct Slot;

  // `helpers`: how many sleeping ranks the last arrival wakes to run bodies
  // alongside it (cores to spare); 0 means it runs every body itself.
  explicit InProcessTransport(int helpers);

  Status Run(const GroupInfo& group, int size, const CallKey& key, int rank,
             const void* send, void* recv, const CallInfo& info,
             Clock::time_point deadline, const Body& body) override;

 private:
  std::shared_ptr<Slot> GetOrCreate(const CallKey& key, int size);
  // Drops `slot` from the table once its last rank has left it.
  void Release(const CallKey& key, const Slot* slot);

  int helpers_;
  std::mutex mu_;
  std::unordered_map<CallKey, std::shared_ptr<Slot>, CallKeyHash> slots_;
};

}  // namespace smddp

#endif  // JAX_SMDDP_ENGINE_INPROCESS_TRANSPORT_H_

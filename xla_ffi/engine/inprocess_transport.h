// Transport between XLA devices of one process: ranks share the address space,
// so a call's buffers are exchanged as pointers through a rendezvous slot and
// data moves with memcpy (or is read in place by the algorithm).
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

  Status Open(const GroupInfo& group, int size, const CallKey& key, int rank,
              const void* send, void* recv, const CallInfo& info,
              Clock::time_point deadline,
              std::unique_ptr<Exchange>* exchange) override;

  // Drops `slot` from the table once its last rank has left it.
  void Release(const CallKey& key, const Slot* slot);

 private:
  std::shared_ptr<Slot> GetOrCreate(const CallKey& key, int size);

  std::mutex mu_;
  std::unordered_map<CallKey, std::shared_ptr<Slot>, CallKeyHash> slots_;
};

}  // namespace smddp

#endif  // JAX_SMDDP_ENGINE_INPROCESS_TRANSPORT_H_

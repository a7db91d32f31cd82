// Zero-copy libfabric transfers between registered buffers: the network side
// of GPU collectives across hosts when the provider moves device memory
// itself (FI_HMEM; on AWS, EFA with GPUDirect RDMA).
//
// A FabricLink copies every byte through its own host bounce buffers, so a
// GPU's network slots must live in host memory (one staging copy each way).
// A rail link instead hands the caller's buffer, which must lie in memory
// registered with the rail (Register), to the provider as one tagged message
// (fi_tsend / fi_trecv): a GPU's send and receive slots stay in device memory
// and the NIC reads and writes them directly.
//
// Tags: the caller's tag mixed with the direction (sender's and receiver's
// addresses), so a receive matches only its peer's send of that tag; the
// provider matches them, in posting order. Progress is manual (Progress()).
#ifndef JAX_SMDDP_TRANSPORTS_FABRIC_RAIL_H_
#define JAX_SMDDP_TRANSPORTS_FABRIC_RAIL_H_

#include <cstddef>
#include <memory>
#include <string>

#include "xla_ffi/common/status.h"
#include "xla_ffi/transports/link.h"

namespace smddp {

// Where registered memory lives (libfabric's FI_HMEM interface).
enum class MemoryIface { kHost, kCuda };
const char* IfaceName(MemoryIface iface);

class FabricRail {
 public:
  class Impl;

  // Opens an FI_EP_RDM endpoint of `provider` (the world's: "efa",
  // "tcp;ofi_rxm", "shm") with tagged messages and FI_HMEM, bound to `node`
  // ("" = the provider's default). Fails, saying why, when the provider cannot
  // move memory of `iface` (Debian's tcp;ofi_rxm offers no FI_HMEM; shm moves
  // host memory through FI_HMEM_SYSTEM).
  static Status Open(const std::string& provider, const std::string& node, MemoryIface iface,
                     std::unique_ptr<FabricRail>* out);
  ~FabricRail();
  FabricRail(const FabricRail&) = delete;
  FabricRail& operator=(const FabricRail&) = delete;

  std::string Address() const;
  std::string Provider() const;
  MemoryIface iface() const;
  // The largest message the provider carries; a slot must fit in one.
  size_t max_message() const;

  // A registration, undone when destroyed (destroy it before freeing the
  // memory, after the links stopped using it).
  class Region {
   public:
    virtual ~Region() = default;
  };
  // Registers [base, base + bytes) for sends and receives. `device`: the CUDA
  // ordinal for MemoryIface::kCuda. Errors say what the provider refused.
  Status Register(void* base, size_t bytes, int device, std::unique_ptr<Region>* out);

  // A Link to the rail endpoint at `peer_address`. Its Send and Recv take only
  // buffers inside a registered region (otherwise the request fails at once).
  // `control`, if not null, is another link to the same process (the world's),
  // whose PeerFailure this link reports too: an RDM endpoint does not notice
  // a peer's exit. Cancel withdraws the request at once; a receive's buffer
  // may still be written until the provider drops it, which is why only
  // registered slots that outlive their links are handed to a rail.
  Status Connect(const std::string& peer_address, const std::string& peer_name, Link* control,
                 std::unique_ptr<Link>* out);

 private:
  explicit FabricRail(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

}  // namespace smddp

#endif  // JAX_SMDDP_TRANSPORTS_FABRIC_RAIL_H_

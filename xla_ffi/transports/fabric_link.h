// Links between processes on different hosts, over libfabric reliable
// datagram (FI_EP_RDM) endpoints: EFA on AWS, tcp;ofi_rxm elsewhere, shm for
// tests on one host.
//
// libfabric is loaded with dlopen("libfabric.so.1") when an endpoint opens, so
// the package neither links nor needs it unless a job uses this transport.
// Without libfabric's headers at build time everything here still compiles
// and Open() fails with a message saying how to get them.
//
// Design (details in fabric_eager.cc and fabric_direct.cc): every process has one FabricEndpoint
// (one endpoint, completion queue and address vector) shared by all of its
// links. Messages smaller than JAX_SMDDP_FABRIC_DIRECT_BYTES go through
// endpoint-owned bounce buffers (posted receive buffers and send buffers,
// registered once where the provider wants FI_MR_LOCAL), in chunks that each
// carry {sender, sequence, tag, total, offset, length}; the link matches tags
// itself, in send order per tag whatever order chunks arrive in. Larger
// messages go direct: the sender sends a header in the message's place, and
// once the receiver has matched it to a Recv and posted tagged receives into
// that Recv's buffer, the sender posts tagged sends from its own buffer: no
// copy on either side. An announced send (Link::Announce) sends its header
// at once and posts its pieces once both the receiver's answer and its
// bytes (SendAnnounced) are there. Cancel is safe on both paths: once it returns,
// nothing writes to or reads from the caller's buffer. Progress is manual:
// waiting callers poll the CQ. A Send completes once the provider reports all
// its chunks or pieces sent, so a caller that waits for its Sends keeps them
// moving.
#ifndef JAX_SMDDP_TRANSPORTS_FABRIC_LINK_H_
#define JAX_SMDDP_TRANSPORTS_FABRIC_LINK_H_

#include <memory>
#include <string>

#include "xla_ffi/common/status.h"
#include "xla_ffi/transports/link.h"

namespace smddp {

// Whether libfabric can be used in this process (dlopen of "libfabric.so.1"
// succeeded and the build had its headers); else why not, in `*why`.
bool FabricAvailable(std::string* why);

// The provider to use: `requested` if non-empty, else the environment's
// JAX_SMDDP_FABRIC_PROVIDER, else DefaultFabricProvider(): the first of
// "efa" and "net" that fi_getinfo finds, else "tcp;ofi_rxm".
std::string ChooseFabricProvider(const std::string& requested);
// What an unset JAX_SMDDP_FABRIC_PROVIDER picks.
std::string DefaultFabricProvider();

// Environment knobs, read at Open (both ends must agree on the chunk size;
// defaults in the registry, xla_ffi/common/settings.cc):
//   JAX_SMDDP_FABRIC_CHUNK_BYTES  bytes per chunk, header included
//   JAX_SMDDP_FABRIC_BUFFERS      receive buffers, and send buffers (as many of each)
//   JAX_SMDDP_FABRIC_DIRECT_BYTES smallest message sent direct (0 = none)
//   JAX_SMDDP_FABRIC_TEST_REORDER if set, chunks are sent out of order (tests only)
//   JAX_SMDDP_FABRIC_TEST_REGISTER if set, direct buffers are registered even
//                                 where the provider does not ask (tests only)

// One per process; every Link of it shares its endpoint, CQ and AV. Links
// keep the endpoint's resources alive, so they may outlive this object.
class FabricEndpoint {
 public:
  class Impl;

  // Opens an FI_EP_RDM endpoint of `provider` (e.g. "efa", "tcp;ofi_rxm",
  // "shm"), bound to the local address `node` ("" = the provider's default;
  // ignored for shm). Errors say what failed and how to fix it.
  static Status Open(const std::string& provider, const std::string& node,
                     std::unique_ptr<FabricEndpoint>* out);
  ~FabricEndpoint();
  FabricEndpoint(const FabricEndpoint&) = delete;
  FabricEndpoint& operator=(const FabricEndpoint&) = delete;

  // This endpoint's address (raw fi_getname bytes), to publish to peers.
  std::string Address() const;
  // The provider actually opened, e.g. "tcp;ofi_rxm".
  std::string Provider() const;
  // How a call waiting on this endpoint's links sleeps once it stops
  // polling: "fd" (on the completion queue's descriptor, woken when data
  // arrives) or "sleep" (JAX_SMDDP_SLEEP_US at a time; JAX_SMDDP_FABRIC_WAIT).
  std::string WaitKind() const;
  // Bytes of drain receives posted now: a cancelled direct receive's withdrawn
  // pieces, reposted so that the sender's posted pieces complete
  // (fabric_direct.cc). Zero once those landed or the sender aborted. Tests.
  size_t DrainBytes() const;

  // A Link to the peer whose Address() is `peer_address`. `peer_name` names
  // it in messages (e.g. "process 3"). Connecting twice to one peer gives
  // two handles on the same channel.
  Status Connect(const std::string& peer_address, const std::string& peer_name,
                 std::unique_ptr<Link>* out);

 private:
  explicit FabricEndpoint(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

}  // namespace smddp

#endif  // JAX_SMDDP_TRANSPORTS_FABRIC_LINK_H_

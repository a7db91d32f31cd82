// Notices at once when a process on another host exits. Every pair of
// processes on different hosts keeps one idle TCP connection open; when either
// process dies, its kernel closes the connection and the other sees it
// within milliseconds (as JAX's gloo path does), where a network link alone
// would notice only at the deadline (a receive waits for data, not for a
// peer). A host that vanishes without closing its sockets is still caught by
// the deadline.
#ifndef JAX_SMDDP_TRANSPORTS_PEER_WATCH_H_
#define JAX_SMDDP_TRANSPORTS_PEER_WATCH_H_

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "xla_ffi/common/status.h"
#include "xla_ffi/transports/link.h"

namespace smddp {

class PeerWatch {
 public:
  // Listens on `node` (an IP address; "" = every interface), any port.
  static Status Listen(const std::string& node, std::unique_ptr<PeerWatch>* out);
  ~PeerWatch();

  // "ip:port" for peers to connect to.
  std::string Address() const { return address_; }
  // Connects to peer `peer`'s Address() and says who this process is.
  Status Connect(int self, int peer, const std::string& address, double timeout_s);
  // Accepts one connection from each process in `peers`.
  Status AcceptFrom(const std::vector<int>& peers, double timeout_s);
  // Hands over the connection to `peer` (-1 when there is none).
  int TakeFd(int peer);

 private:
  int listen_fd_ = -1;
  std::string address_;
  std::map<int, int> fds_;
};

// Says farewell over each connection of `fds` (peer -> its watch connection) and waits until
// every peer has said it too or exited, at most `timeout`; returns the peers that did neither.
// A process that ends its program closes its links only after this: its peers on other hosts
// may still be finishing collectives that read what it sent (its last bytes can still be in
// the network, and a connection closed with data unread is reset, which drops them).
std::vector<int> Farewell(const std::map<int, int>& fds, std::chrono::milliseconds timeout);

// `inner`, with PeerFailure() also reporting when the connection `fd` to the
// peer closes. Owns `fd`.
std::unique_ptr<Link> WatchLink(std::unique_ptr<Link> inner, int fd, std::string peer_name);

}  // namespace smddp

#endif  // JAX_SMDDP_TRANSPORTS_PEER_WATCH_H_

#include "xla_ffi/transports/peer_watch.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <string>

namespace smddp {

namespace {

std::string Errno(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

// Parses "ip:port" (IPv4 or [IPv6]:port).
bool ParseAddress(const std::string& address, sockaddr_storage* out, socklen_t* len) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return false;
  std::string host = address.substr(0, colon);
  const int port = std::atoi(address.c_str() + colon + 1);
  if (port <= 0 || port > 65535) return false;
  if (host.size() > 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  std::memset(out, 0, sizeof(*out));
  auto* v4 = reinterpret_cast<sockaddr_in*>(out);
  if (inet_pton(AF_INET, host.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(uint16_t(port));
    *len = sizeof(sockaddr_in);
    return true;
  }
  auto* v6 = reinterpret_cast<sockaddr_in6*>(out);
  if (inet_pton(AF_INET6, host.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(uint16_t(port));
    *len = sizeof(sockaddr_in6);
    return true;
  }
  return false;
}

bool ReadFull(int fd, void* buf, size_t n, int timeout_ms) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    pollfd pfd{fd, POLLIN, 0};
    if (poll(&pfd, 1, timeout_ms) <= 0) return false;
    const ssize_t got = read(fd, p, n);
    if (got <= 0) return false;
    p += got;
    n -= size_t(got);
  }
  return true;
}

// The one byte a process sends over each connection when it shuts down (Farewell); nothing
// else is ever sent after the connection's set-up.
constexpr char kFarewell = 'F';

// Why the peer named `name` is gone, once its end of the connection `fd`
// closed; "" while it is open (its farewell alone does not end it: what it
// sent before may still be on the way).
std::string Closed(int fd, const std::string& name) {
  pollfd pfd{fd, POLLIN | POLLRDHUP, 0};
  if (poll(&pfd, 1, 0) > 0) {
    char c = 0;
    const ssize_t got = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (got == 0 || (pfd.revents & (POLLHUP | POLLERR | POLLRDHUP)) ||
        (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
      if (got == 1 && c == kFarewell)
        return name +
               " shut jax_smddp down (its program ended) and closed its connection after "
               "waiting for this process to shut down too: do all processes run the same "
               "collectives?";
      return name + " closed its connection (the process exited or was killed)";
    }
  }
  return "";
}

class WatchedLink : public Link {
 public:
  WatchedLink(std::unique_ptr<Link> inner, int fd, std::string name)
      : inner_(std::move(inner)), fd_(fd), name_(std::move(name)) {
    // The link's own waits watch the connection too (a Cancel waiting on the peer's pieces).
    if (fd_ >= 0) inner_->WatchPeer([fd = fd_, name = name_] { return Closed(fd, name); });
  }
  ~WatchedLink() override {
    if (fd_ >= 0) inner_->WatchPeer(nullptr);  // before the descriptor it reads closes
    inner_.reset();
    if (fd_ >= 0) close(fd_);
  }
  void Send(uint64_t tag, const void* src, size_t bytes, Request* req) override {
    inner_->Send(tag, src, bytes, req);
  }
  void Recv(uint64_t tag, void* dst, size_t bytes, Request* req) override {
    inner_->Recv(tag, dst, bytes, req);
  }
  bool Announce(uint64_t tag, size_t bytes, Request* req) override {
    return inner_->Announce(tag, bytes, req);
  }
  void SendAnnounced(Request* req, const void* src) override { inner_->SendAnnounced(req, src); }
  void Progress() override { inner_->Progress(); }
  const void* ProgressKey() const override { return inner_->ProgressKey(); }
  // A dead peer never finishes what it had started: the link's Cancel asks the watch handed
  // to it (WatchPeer) before and while it waits.
  void Cancel(Request* req) override { inner_->Cancel(req); }
  void WatchPeer(std::function<std::string()> failure) override {
    inner_->WatchPeer(std::move(failure));
  }
  std::string Kind() const override { return inner_->Kind(); }
  uint64_t SingleCopyBytes() const override { return inner_->SingleCopyBytes(); }
  std::string SingleCopy() const override { return inner_->SingleCopy(); }
  uint32_t Activity() const override { return inner_->Activity(); }
  void AwaitActivity(uint32_t seen, unsigned max_us) override {
    inner_->AwaitActivity(seen, max_us);
  }
  bool SleepsOnArrival() const override { return inner_->SleepsOnArrival(); }
  bool SleepsOnEveryArrival() const override { return inner_->SleepsOnEveryArrival(); }
  StatusCode PeerFailureCode() override {
    return inner_->PeerFailure().empty() ? StatusCode::kPeerFailed : inner_->PeerFailureCode();
  }
  std::string PeerFailure() override {
    std::string why = inner_->PeerFailure();
    if (!why.empty() || fd_ < 0) return why;
    return Closed(fd_, name_);
  }

 private:
  std::unique_ptr<Link> inner_;
  int fd_;
  std::string name_;
};

}  // namespace

Status PeerWatch::Listen(const std::string& node, std::unique_ptr<PeerWatch>* out) {
  sockaddr_storage addr;
  socklen_t len = 0;
  if (!ParseAddress((node.empty() ? std::string("0.0.0.0") : node) + ":1", &addr, &len))
    return Status::InvalidArgument("jax_smddp: cannot listen on '" + node + "': not an IP address");
  reinterpret_cast<sockaddr_in*>(&addr)->sin_port = 0;  // same offset for v6
  if (addr.ss_family == AF_INET6) reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port = 0;
  const int fd = socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Status::Error(Errno("jax_smddp: socket"));
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 || listen(fd, 128) != 0) {
    Status st = Status::Error(Errno(("jax_smddp: cannot listen on " + node).c_str()));
    close(fd);
    return st;
  }
  sockaddr_storage bound;
  socklen_t blen = sizeof(bound);
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &blen);
  char host[INET6_ADDRSTRLEN] = {0};
  int port;
  if (bound.ss_family == AF_INET) {
    auto* v4 = reinterpret_cast<sockaddr_in*>(&bound);
    inet_ntop(AF_INET, &v4->sin_addr, host, sizeof(host));
    port = ntohs(v4->sin_port);
  } else {
    auto* v6 = reinterpret_cast<sockaddr_in6*>(&bound);
    inet_ntop(AF_INET6, &v6->sin6_addr, host, sizeof(host));
    port = ntohs(v6->sin6_port);
  }
  auto watch = std::make_unique<PeerWatch>();
  watch->listen_fd_ = fd;
  watch->address_ =
      (bound.ss_family == AF_INET6 ? "[" + std::string(host) + "]" : std::string(host)) + ":" +
      std::to_string(port);
  *out = std::move(watch);
  return Status::Ok();
}

PeerWatch::~PeerWatch() {
  if (listen_fd_ >= 0) close(listen_fd_);
  for (auto& [peer, fd] : fds_) close(fd);
}

Status PeerWatch::Connect(int self, int peer, const std::string& address, double timeout_s) {
  sockaddr_storage addr;
  socklen_t len = 0;
  if (!ParseAddress(address, &addr, &len))
    return Status::InvalidArgument("jax_smddp: process " + std::to_string(peer) +
                                   " published a bad address '" + address + "'");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (true) {
    const int fd = socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return Status::Error(Errno("jax_smddp: socket"));
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), len) == 0) {
      const int32_t me = self;
      if (write(fd, &me, sizeof(me)) == ssize_t(sizeof(me))) {
        fds_[peer] = fd;
        return Status::Ok();
      }
    }
    const std::string why = std::strerror(errno);
    close(fd);
    if (std::chrono::steady_clock::now() > deadline)
      return Status::PeerFailed("jax_smddp: cannot connect to process " + std::to_string(peer) +
                                " at " + address + ": " + why);
    usleep(100000);
  }
}

Status PeerWatch::AcceptFrom(const std::vector<int>& peers, double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  size_t pending = 0;
  for (int p : peers) pending += fds_.count(p) ? 0 : 1;
  while (pending > 0) {
    const int left_ms = int(std::chrono::duration_cast<std::chrono::milliseconds>(
                                deadline - std::chrono::steady_clock::now())
                                .count());
    pollfd pfd{listen_fd_, POLLIN, 0};
    if (left_ms <= 0 || poll(&pfd, 1, left_ms) <= 0)
      return Status::Timeout(
          "jax_smddp: timed out waiting for processes on other hosts to connect to " + address_ +
          " (a firewall between hosts, or a peer that failed to start)");
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    int32_t who = -1;
    if (!ReadFull(fd, &who, sizeof(who), 10000)) {
      close(fd);
      continue;
    }
    bool expected = false;
    for (int p : peers) expected |= p == who;
    if (!expected || fds_.count(who)) {
      close(fd);
      continue;
    }
    fds_[who] = fd;
    --pending;
  }
  return Status::Ok();
}

int PeerWatch::TakeFd(int peer) {
  auto it = fds_.find(peer);
  if (it == fds_.end()) return -1;
  const int fd = it->second;
  fds_.erase(it);
  return fd;
}

std::vector<int> Farewell(const std::map<int, int>& fds, std::chrono::milliseconds timeout) {
  std::vector<pollfd> waiting;
  std::vector<int> peers;
  for (const auto& [peer, fd] : fds) {
    // A peer that is gone cannot be told (MSG_NOSIGNAL: no SIGPIPE); its end reads as closed.
    (void)send(fd, &kFarewell, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
    waiting.push_back(pollfd{fd, POLLIN | POLLRDHUP, 0});
    peers.push_back(peer);
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!waiting.empty()) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    const int ready = poll(waiting.data(), waiting.size(), int(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) break;
    for (size_t i = waiting.size(); i-- > 0;) {
      if (waiting[i].revents == 0) continue;
      // The peer's farewell (taken: the connection reads as before), or its end closed: either
      // way it reads nothing more from here.
      char c;
      (void)recv(waiting[i].fd, &c, 1, MSG_DONTWAIT);
      waiting.erase(waiting.begin() + long(i));
      peers.erase(peers.begin() + long(i));
    }
  }
  return peers;
}

std::unique_ptr<Link> WatchLink(std::unique_ptr<Link> inner, int fd, std::string peer_name) {
  return std::make_unique<WatchedLink>(std::move(inner), fd, std::move(peer_name));
}

}  // namespace smddp

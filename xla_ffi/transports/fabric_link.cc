// The Link over a libfabric endpoint, and opening one (fabric_link.h);
// the endpoint itself is fabric_link_impl.h's.
#include "xla_ffi/transports/fabric_link.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "xla_ffi/common/protocol.h"
#include "xla_ffi/transports/fabric_link_impl.h"

#ifdef SMDDP_HAVE_LIBFABRIC

namespace smddp {

namespace {

class FabricLink : public Link {
 public:
  FabricLink(std::shared_ptr<FabricEndpoint::Impl> ep, Peer* peer)
      : ep_(std::move(ep)), peer_(peer), kind_("libfabric " + ep_->provider()) {}
  void Send(uint64_t tag, const void* src, size_t bytes, Request* req) override {
    ep_->Send(peer_, tag, src, bytes, req);
  }
  void Recv(uint64_t tag, void* dst, size_t bytes, Request* req) override {
    ep_->Recv(peer_, tag, dst, bytes, req);
  }
  bool Announce(uint64_t tag, size_t bytes, Request* req) override {
    return ep_->Announce(peer_, tag, bytes, req);
  }
  void SendAnnounced(Request* req, const void* src) override {
    ep_->SendAnnounced(peer_, req, src);
  }
  void Progress() override { ep_->Progress(); }
  const void* ProgressKey() const override { return ep_.get(); }
  uint32_t Activity() const override { return ep_->Activity(); }
  void AwaitActivity(uint32_t seen, unsigned max_us) override { ep_->AwaitActivity(seen, max_us); }
  bool SleepsOnArrival() const override { return std::string(ep_->wait_kind()) == "fd"; }
  void Cancel(Request* req) override { ep_->Cancel(peer_, req); }
  std::string PeerFailure() override { return ep_->Failure(peer_); }
  StatusCode PeerFailureCode() override { return ep_->FailureCode(peer_); }
  void WatchPeer(std::function<std::string()> failure) override {
    ep_->SetWatch(peer_, std::move(failure));
  }
  std::string Kind() const override { return kind_; }
  uint64_t SingleCopyBytes() const override {
    return peer_->direct_received.load(std::memory_order_relaxed);
  }
  std::string SingleCopy() const override { return ep_->direct_state(); }

 private:
  std::shared_ptr<FabricEndpoint::Impl> ep_;
  Peer* peer_;  // owned by ep_
  std::string kind_;
};

}  // namespace

bool FabricAvailable(std::string* why) {
  const Api& a = GetApi();
  if (!a.error.empty()) {
    if (why) *why = a.error;
    return false;
  }
  return true;
}

namespace {

// Whether fi_getinfo finds a reliable-datagram endpoint of exactly the
// provider `name` (not a utility provider layered over it).
bool Offers(const Api& a, const char* name) {
  struct fi_info* info = nullptr;
  if (GetRdmInfo(a, name, "", FI_MSG, kRdmMrModes, &info) != 0) return false;
  bool found = false;
  for (struct fi_info* i = info; i && !found; i = i->next)
    found = i->fabric_attr && i->fabric_attr->prov_name &&
            std::strcmp(i->fabric_attr->prov_name, name) == 0;
  if (info) a.freeinfo(info);
  return found;
}

}  // namespace

std::string DefaultFabricProvider() {
  const Api& a = GetApi();
  if (!a.error.empty()) return kDefaultProvider;
  // net: libfabric 1.17's TCP provider with its own reliable datagrams (1.18
  // renamed it tcp), which carries small messages in half the time of
  // tcp;ofi_rxm here and wakes a sleeping waiter as fast as a polling one
  // (docs/cpu_floor_between_hosts.md, "The net provider").
  for (const char* name : {"efa", "net"}) {
    if (Offers(a, name)) return name;
  }
  return kDefaultProvider;
}

Status FabricEndpoint::Open(const std::string& provider, const std::string& node,
                            std::unique_ptr<FabricEndpoint>* out) {
  std::string why;
  if (!FabricAvailable(&why)) {
    return Status::Error("cannot open a libfabric endpoint: " + why);
  }
  if (provider.empty()) return Status::InvalidArgument("no libfabric provider named");
  auto impl = std::make_shared<Impl>(GetApi());
  Status st = impl->Init(provider, node);
  if (!st.ok()) return st;
  out->reset(new FabricEndpoint(std::move(impl)));
  return Status::Ok();
}

FabricEndpoint::FabricEndpoint(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
FabricEndpoint::~FabricEndpoint() = default;
std::string FabricEndpoint::Address() const { return impl_->address(); }
std::string FabricEndpoint::Provider() const { return impl_->provider(); }
std::string FabricEndpoint::WaitKind() const { return impl_->wait_kind(); }
size_t FabricEndpoint::DrainBytes() const { return impl_->DrainBytes(); }

Status FabricEndpoint::Connect(const std::string& peer_address, const std::string& peer_name,
                               std::unique_ptr<Link>* out) {
  Peer* p = nullptr;
  SMDDP_RETURN_IF_ERROR(impl_->Connect(peer_address, peer_name, &p));
  out->reset(new FabricLink(impl_, p));
  return Status::Ok();
}

}  // namespace smddp

#endif  // SMDDP_HAVE_LIBFABRIC

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
#include "xla_ffi/common/settings.h"
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
  void Progress() override { ep_->Progress(); }
  uint32_t Activity() const override { return ep_->Activity(); }
  void AwaitActivity(uint32_t seen, unsigned max_us) override { ep_->AwaitActivity(seen, max_us); }
  void Cancel(Request* req) override { ep_->Cancel(peer_, req); }
  std::string PeerFailure() override { return ep_->Failure(peer_); }
  StatusCode PeerFailureCode() override { return ep_->FailureCode(peer_); }
  void SetPeerFailure(const std::string& why) override { ep_->SetFailure(peer_, why); }
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

std::string ChooseFabricProvider(const std::string& requested) {
  if (!requested.empty()) return requested;
  std::string env = TextSetting("JAX_SMDDP_FABRIC_PROVIDER");
  if (!env.empty()) return env;
  const Api& a = GetApi();
  if (!a.error.empty()) return kDefaultProvider;
  struct fi_info* hints = a.dupinfo(nullptr);
  if (hints == nullptr) return kDefaultProvider;
  hints->caps = FI_MSG;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->ep_attr->type = FI_EP_RDM;
  hints->domain_attr->mr_mode =
      FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
  hints->fabric_attr->prov_name = strdup("efa");
  struct fi_info* info = nullptr;
  int ret = a.getinfo(RequestedVersion(a), nullptr, nullptr, 0, hints, &info);
  a.freeinfo(hints);
  if (info) a.freeinfo(info);
  return ret == 0 && info != nullptr ? "efa" : kDefaultProvider;
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

Status FabricEndpoint::Connect(const std::string& peer_address, const std::string& peer_name,
                               std::unique_ptr<Link>* out) {
  Peer* p = nullptr;
  SMDDP_RETURN_IF_ERROR(impl_->Connect(peer_address, peer_name, &p));
  out->reset(new FabricLink(impl_, p));
  return Status::Ok();
}

}  // namespace smddp

#endif  // SMDDP_HAVE_LIBFABRIC

// Rail links over tagged libfabric messages; see fabric_rail.h.
//
// Every posted transfer is a RailOp whose fi_context2 libfabric hands back
// in its completion. Ops the provider refused for now (-FI_EAGAIN) wait in a
// queue that Progress() retries, one for sends and one for receives: a send
// the provider holds back until the peer receives must not hold back this
// side's receives (both sides would wait on each other). A cancelled op
// loses its Request at once and is freed when its completion (or its
// cancellation) comes out of the CQ. Finished RailOps are kept for reuse: a
// step allocates nothing once warm. One mutex guards the endpoint;
// Progress() only try_locks it.
#include "xla_ffi/transports/fabric_rail.h"

#include <sys/uio.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "xla_ffi/common/hashing.h"
#include "xla_ffi/transports/fabric_api.h"

namespace smddp {

const char* IfaceName(MemoryIface iface) {
  return iface == MemoryIface::kCuda ? "CUDA device" : "host";
}

#ifndef SMDDP_HAVE_LIBFABRIC

class FabricRail::Impl {};

Status FabricRail::Open(const std::string&, const std::string&, MemoryIface,
                        std::unique_ptr<FabricRail>*) {
  return Status::Unsupported(std::string("cannot open a libfabric rail: jax_smddp was ") +
                             kFabricNoHeaders);
}
FabricRail::FabricRail(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
FabricRail::~FabricRail() = default;
std::string FabricRail::Address() const { return std::string(); }
std::string FabricRail::Provider() const { return std::string(); }
MemoryIface FabricRail::iface() const { return MemoryIface::kHost; }
size_t FabricRail::max_message() const { return 0; }
Status FabricRail::Register(void*, size_t, int, std::unique_ptr<Region>*) {
  return Status::Unsupported("jax_smddp was built without libfabric headers");
}
Status FabricRail::Connect(const std::string&, const std::string&, Link*, std::unique_ptr<Link>*) {
  return Status::Unsupported("jax_smddp was built without libfabric headers");
}

#else  // SMDDP_HAVE_LIBFABRIC

namespace {

// Tags stay below the top byte: some providers keep high tag bits for themselves.
constexpr uint64_t kTagMask = 0x00FFFFFFFFFFFFFFull;

struct RailPeer {
  fi_addr_t addr = FI_ADDR_NOTAVAIL;
  std::string name;
  uint64_t send_salt = 0, recv_salt = 0;
  std::string failure;  // a send to it failed
};

struct RailOp {
  struct fi_context2 ctx;  // handed to libfabric and back
  Request* req = nullptr;  // null once cancelled
  RailPeer* peer = nullptr;
  void* buf = nullptr;
  void* desc = nullptr;
  size_t bytes = 0;
  uint64_t tag = 0;
  bool recv = false;
  bool posted = false;
};

}  // namespace

class FabricRail::Impl : public std::enable_shared_from_this<FabricRail::Impl> {
 public:
  explicit Impl(const FabricApi& api) : api_(api) {}
  ~Impl();

  Status Init(const std::string& provider, const std::string& node, MemoryIface iface);
  Status Register(void* base, size_t bytes, int device);
  void Deregister(uintptr_t base);
  Status Connect(const std::string& address, const std::string& name, RailPeer** out);
  void Post(RailPeer* p, bool recv, uint64_t tag, void* buf, size_t bytes, Request* req);
  void Progress();
  void Cancel(Request* req);
  std::string Failure(RailPeer* p);

  const std::string& address() const { return address_; }
  const std::string& provider() const { return provider_; }
  MemoryIface iface() const { return iface_; }
  size_t max_message() const { return max_msg_; }

 private:
  struct Registered {
    size_t bytes;
    struct fid_mr* mr;
    void* desc;
  };
  bool TryPost(RailOp* op);  // false: the provider said "again later"
  void Finish(RailOp* op, Status st);
  RailOp* NewOp();
  void FreeOp(RailOp* op);
  void ForgetLive(RailOp* op) {
    auto it = std::find(live_.begin(), live_.end(), op);
    if (it == live_.end()) return;
    *it = live_.back();
    live_.pop_back();
  }
  void ReadError();
  std::string Text(int ret) const { return api_.Err(ret); }

  const FabricApi& api_;
  std::mutex mu_;
  MemoryIface iface_ = MemoryIface::kHost;
  struct fi_info* info_ = nullptr;
  RdmObjects o_;
  std::string address_, provider_;
  size_t max_msg_ = 0;
  uint64_t next_key_ = 1;
  std::map<uintptr_t, Registered> regions_;                            // by base address
  std::unordered_map<std::string, std::unique_ptr<RailPeer> > peers_;  // by address
  // Not done, not cancelled: few (a port's sends and receives), so a vector
  // searched on Finish and Cancel, which allocates nothing once warm.
  std::vector<RailOp*> live_;
  std::deque<RailOp*> pending_[2];  // not yet accepted by the provider: sends, receives
  std::vector<std::unique_ptr<RailOp> > spare_;  // finished, for reuse
  std::string endpoint_error_;                   // a failure no peer can be blamed for
};

namespace {

class RailRegion : public FabricRail::Region {
 public:
  RailRegion(std::shared_ptr<FabricRail::Impl> impl, uintptr_t base)
      : impl_(std::move(impl)), base_(base) {}
  ~RailRegion() override { impl_->Deregister(base_); }

 private:
  std::shared_ptr<FabricRail::Impl> impl_;
  uintptr_t base_;
};

class RailLink : public Link {
 public:
  RailLink(std::shared_ptr<FabricRail::Impl> impl, RailPeer* peer, Link* control)
      : impl_(std::move(impl)), peer_(peer), control_(control) {}
  void Send(uint64_t tag, const void* src, size_t bytes, Request* req) override {
    impl_->Post(peer_, false, tag, const_cast<void*>(src), bytes, req);
  }
  void Recv(uint64_t tag, void* dst, size_t bytes, Request* req) override {
    impl_->Post(peer_, true, tag, dst, bytes, req);
  }
  void Progress() override { impl_->Progress(); }
  const void* ProgressKey() const override { return impl_.get(); }
  void Cancel(Request* req) override { impl_->Cancel(req); }
  std::string PeerFailure() override {
    std::string failure = impl_->Failure(peer_);
    return failure.empty() && control_ ? control_->PeerFailure() : failure;
  }
  StatusCode PeerFailureCode() override {
    return impl_->Failure(peer_).empty() && control_ ? control_->PeerFailureCode()
                                                     : StatusCode::kPeerFailed;
  }
  std::string Kind() const override {
    return "libfabric " + impl_->provider() + " (registered " + IfaceName(impl_->iface()) +
           " memory, no staging)";
  }

 private:
  std::shared_ptr<FabricRail::Impl> impl_;
  RailPeer* peer_;
  Link* control_;
};

}  // namespace

Status FabricRail::Impl::Init(const std::string& provider, const std::string& node,
                              MemoryIface iface) {
  const FabricApi& a = api_;
  iface_ = iface;
  if (a.version() < FI_VERSION(1, 10)) {
    return Status::Unsupported("libfabric " + std::to_string(FI_MAJOR(a.version())) + "." +
                               std::to_string(FI_MINOR(a.version())) +
                               " has no FI_HMEM (registered device memory needs 1.10 or newer)");
  }
  int ret = GetRdmInfo(a, provider, node, FI_TAGGED | FI_HMEM,
                       FI_MR_LOCAL | FI_MR_HMEM | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED |
                           FI_MR_PROV_KEY | FI_MR_ENDPOINT,
                       &info_);
  if (ret == -FI_ENODATA) {
    return Status::Error("libfabric provider '" + provider +
                         "' offers no endpoint here that sends from and receives into registered "
                         "memory itself (FI_HMEM with tagged messages)");
  }
  if (ret != 0)
    return Status::Error("fi_getinfo (FI_HMEM) for '" + provider + "' failed: " + Text(ret));
  provider_ = info_->fabric_attr->prov_name ? info_->fabric_attr->prov_name : provider;
  max_msg_ = info_->ep_attr->max_msg_size ? info_->ep_attr->max_msg_size : SIZE_MAX;
  SMDDP_RETURN_IF_ERROR(OpenRdmObjects(api_, info_,
                                       "libfabric provider '" + provider_ + "' (FI_HMEM endpoint)",
                                       FI_CQ_FORMAT_TAGGED, 1024, &o_));
  address_ = o_.address;
  return Status::Ok();
}

FabricRail::Impl::~Impl() {
  if (o_.ep) fi_close(&o_.ep->fid);
  o_.ep = nullptr;
  for (auto& [base, r] : regions_) fi_close(&r.mr->fid);
  CloseRdmObjects(&o_);
  if (info_) api_.freeinfo(info_);
  for (auto& queue : pending_)
    for (RailOp* op : queue) delete op;
  spare_.clear();
  // Posted ops died with the endpoint; their RailOps leak rather than risk a
  // double free of ones also listed in live_.
}

Status FabricRail::Impl::Register(void* base, size_t bytes, int device) {
  std::lock_guard<std::mutex> lock(mu_);
  struct iovec iov;
  iov.iov_base = base;
  iov.iov_len = bytes;
  struct fi_mr_attr attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.mr_iov = &iov;
  attr.iov_count = 1;
  attr.access = FI_SEND | FI_RECV;
  attr.requested_key = next_key_++;
  attr.iface = iface_ == MemoryIface::kCuda ? FI_HMEM_CUDA : FI_HMEM_SYSTEM;
  if (iface_ == MemoryIface::kCuda) attr.device.cuda = device;
  struct fid_mr* mr = nullptr;
  int ret = fi_mr_regattr(o_.domain, &attr, 0, &mr);
  if (ret != 0) {
    return Status::Error(
        "libfabric (" + provider_ + ") cannot register " + std::to_string(bytes) + " bytes of " +
        IfaceName(iface_) + " memory: " + Text(ret) +
        (iface_ == MemoryIface::kCuda
             ? " (GPUDirect RDMA needs the nvidia-peermem module or dma-buf support, and a "
               "libfabric built with CUDA)"
             : ""));
  }
  if (info_->domain_attr->mr_mode & FI_MR_ENDPOINT) {
    if ((ret = fi_mr_bind(mr, &o_.ep->fid, 0)) != 0 || (ret = fi_mr_enable(mr)) != 0) {
      fi_close(&mr->fid);
      return Status::Error("libfabric (" + provider_ +
                           ") cannot bind a registration to its "
                           "endpoint: " +
                           Text(ret));
    }
  }
  regions_[reinterpret_cast<uintptr_t>(base)] = Registered{bytes, mr, fi_mr_desc(mr)};
  return Status::Ok();
}

void FabricRail::Impl::Deregister(uintptr_t base) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(base);
  if (it == regions_.end()) return;
  fi_close(&it->second.mr->fid);
  regions_.erase(it);
}

Status FabricRail::Impl::Connect(const std::string& address, const std::string& name,
                                 RailPeer** out) {
  std::lock_guard<std::mutex> lock(mu_);
  if (address.empty())
    return Status::Error("cannot connect to " + name + ": its rail address is empty");
  auto& slot = peers_[address];
  if (!slot) {
    auto p = std::make_unique<RailPeer>();
    int n = fi_av_insert(o_.av, address.data(), 1, &p->addr, 0, nullptr);
    if (n != 1) {
      peers_.erase(address);
      return Status::Error(
          "libfabric (" + provider_ + ") rejected the rail address of " + name +
          " (fi_av_insert: " + (n < 0 ? Text(n) : std::to_string(n) + " inserted") +
          "): do all processes use the same provider?");
    }
    const uint64_t self = Fnv1a(address_), peer = Fnv1a(address);
    p->send_salt = MixTag(self, peer);
    p->recv_salt = MixTag(peer, self);
    slot = std::move(p);
  }
  slot->name = name;
  *out = slot.get();
  return Status::Ok();
}

void FabricRail::Impl::Post(RailPeer* p, bool recv, uint64_t tag, void* buf, size_t bytes,
                            Request* req) {
  std::lock_guard<std::mutex> lock(mu_);
  const uintptr_t at = reinterpret_cast<uintptr_t>(buf);
  auto it = regions_.upper_bound(at);
  if (it == regions_.begin() || (--it, at + bytes > it->first + it->second.bytes)) {
    req->Complete(Status::Error("jax_smddp: a rail link was handed " + std::to_string(bytes) +
                                " bytes outside its registered memory"));
    return;
  }
  if (bytes > max_msg_) {
    req->Complete(Status::InvalidArgument(
        "libfabric (" + provider_ + ") carries at most " + std::to_string(max_msg_) +
        " bytes per message, not " + std::to_string(bytes) + "; lower JAX_SMDDP_GPU_SLOT_BYTES"));
    return;
  }
  RailOp* op = NewOp();
  op->req = req;
  op->peer = p;
  op->buf = buf;
  op->desc = it->second.desc;
  op->bytes = bytes;
  op->tag = MixTag(tag, recv ? p->recv_salt : p->send_salt) & kTagMask;
  op->recv = recv;
  live_.push_back(op);
  auto& queue = pending_[recv];
  if (!queue.empty() || !TryPost(op)) queue.push_back(op);
}

bool FabricRail::Impl::TryPost(RailOp* op) {
  ssize_t r =
      op->recv ? fi_trecv(o_.ep, op->buf, op->bytes, op->desc, FI_ADDR_UNSPEC, op->tag, 0, &op->ctx)
               : fi_tsend(o_.ep, op->buf, op->bytes, op->desc, op->peer->addr, op->tag, &op->ctx);
  if (r == -FI_EAGAIN) return false;
  if (r != 0) {
    Finish(op, Status::Error("libfabric (" + provider_ + ") refused to " +
                             (op->recv ? "receive from " : "send to ") + op->peer->name + ": " +
                             Text(int(r))));
    return true;
  }
  op->posted = true;
  return true;
}

void FabricRail::Impl::Finish(RailOp* op, Status st) {
  if (op->req) {
    ForgetLive(op);
    op->req->Complete(std::move(st));
  }
  FreeOp(op);
}

RailOp* FabricRail::Impl::NewOp() {
  RailOp* op;
  if (spare_.empty()) {
    op = new RailOp;
  } else {
    op = spare_.back().release();
    spare_.pop_back();
  }
  *op = RailOp();
  std::memset(&op->ctx, 0, sizeof(op->ctx));
  return op;
}

void FabricRail::Impl::FreeOp(RailOp* op) {
  if (spare_.size() < 256) {
    spare_.emplace_back(op);
  } else {
    delete op;
  }
}

void FabricRail::Impl::Progress() {
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  if (!lock.owns_lock()) return;  // another thread is progressing
  for (int round = 0; round < 16; ++round) {
    struct fi_cq_tagged_entry entries[16];
    ssize_t n = fi_cq_read(o_.cq, entries, 16);
    if (n == -FI_EAVAIL) {
      ReadError();
    } else if (n < 0 && n != -FI_EAGAIN && endpoint_error_.empty()) {
      endpoint_error_ = "libfabric (" + provider_ + ") fi_cq_read failed: " + Text(int(n));
    }
    for (ssize_t i = 0; i < n; ++i) {
      auto* op = static_cast<RailOp*>(entries[i].op_context);
      if (op->recv && entries[i].len != op->bytes) {
        Finish(op, Status::Mismatch("received " + std::to_string(entries[i].len) + " bytes from " +
                                    op->peer->name + " where " + std::to_string(op->bytes) +
                                    " were expected (a peer running a different program?)"));
      } else {
        Finish(op, Status::Ok());
      }
    }
    for (auto& queue : pending_)
      while (!queue.empty() && TryPost(queue.front())) queue.pop_front();
    if (n <= 0 && n != -FI_EAVAIL) break;
  }
}

void FabricRail::Impl::ReadError() {
  struct fi_cq_err_entry err;
  std::memset(&err, 0, sizeof(err));
  if (fi_cq_readerr(o_.cq, &err, 0) < 0) return;
  auto* op = static_cast<RailOp*>(err.op_context);
  if (op == nullptr) {
    if (endpoint_error_.empty())
      endpoint_error_ = "libfabric (" + provider_ + ") reported an error: " + Text(-err.err);
    return;
  }
  char buf[256] = {0};
  const char* detail = fi_cq_strerror(o_.cq, err.prov_errno, err.err_data, buf, sizeof(buf));
  const int code = err.err < 0 ? -err.err : err.err;  // providers differ in its sign
  std::string text = Text(-code);
  if (detail && *detail) text += "; provider: " + std::string(detail);
  std::string what;
  if (code == FI_ECANCELED) {
    what = "cancelled";
  } else if (code == FI_ETRUNC) {
    what = "a message from " + op->peer->name + " was longer than the " +
           std::to_string(op->bytes) + " bytes expected" +
           (err.olen ? " (by " + std::to_string(err.olen) + " bytes)" : std::string()) +
           " (a peer running a different program?)";
  } else {
    what = "libfabric (" + provider_ + ") failed to " + (op->recv ? "receive from " : "send to ") +
           op->peer->name + ": " + text;
    if (!op->recv && op->peer->failure.empty()) op->peer->failure = what;
  }
  // A longer message: the peer runs another call; a failed transfer: the peer
  // (or the path to it) is gone; a cancellation is this process's own.
  Finish(op, code == FI_ETRUNC      ? Status::Mismatch(what)
             : code == FI_ECANCELED ? Status::Error(what)
                                    : Status::PeerFailed(what));
}

void FabricRail::Impl::Cancel(Request* req) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = std::find_if(live_.begin(), live_.end(), [req](RailOp* op) { return op->req == req; });
  if (it == live_.end()) return;  // done already
  RailOp* op = *it;
  ForgetLive(op);
  op->req = nullptr;
  if (!op->posted) {
    auto& queue = pending_[op->recv];
    for (auto p = queue.begin(); p != queue.end(); ++p) {
      if (*p == op) {
        queue.erase(p);
        break;
      }
    }
    FreeOp(op);
    return;
  }
  fi_cancel(&o_.ep->fid, &op->ctx);  // its completion frees it
}

std::string FabricRail::Impl::Failure(RailPeer* p) {
  std::lock_guard<std::mutex> lock(mu_);
  return !p->failure.empty() ? p->failure : endpoint_error_;
}

Status FabricRail::Open(const std::string& provider, const std::string& node, MemoryIface iface,
                        std::unique_ptr<FabricRail>* out) {
  const FabricApi& a = GetFabricApi();
  if (!a.error.empty()) return Status::Error("cannot open a libfabric rail: " + a.error);
  auto impl = std::make_shared<Impl>(a);
  SMDDP_RETURN_IF_ERROR(impl->Init(provider, node, iface));
  out->reset(new FabricRail(std::move(impl)));
  return Status::Ok();
}

FabricRail::FabricRail(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
FabricRail::~FabricRail() = default;
std::string FabricRail::Address() const { return impl_->address(); }
std::string FabricRail::Provider() const { return impl_->provider(); }
MemoryIface FabricRail::iface() const { return impl_->iface(); }
size_t FabricRail::max_message() const { return impl_->max_message(); }

Status FabricRail::Register(void* base, size_t bytes, int device, std::unique_ptr<Region>* out) {
  SMDDP_RETURN_IF_ERROR(impl_->Register(base, bytes, device));
  out->reset(new RailRegion(impl_, reinterpret_cast<uintptr_t>(base)));
  return Status::Ok();
}

Status FabricRail::Connect(const std::string& peer_address, const std::string& peer_name,
                           Link* control, std::unique_ptr<Link>* out) {
  RailPeer* p = nullptr;
  SMDDP_RETURN_IF_ERROR(impl_->Connect(peer_address, peer_name, &p));
  out->reset(new RailLink(impl_, p, control));
  return Status::Ok();
}

#endif  // SMDDP_HAVE_LIBFABRIC

}  // namespace smddp

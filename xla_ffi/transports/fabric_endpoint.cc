// The libfabric endpoint (fabric_link.h): opening it (provider, queues,
// buffers, settings), closing it, and connecting peers.
#include <sys/eventfd.h>
#include <unistd.h>

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

Status FabricEndpoint::Impl::Init(const std::string& provider, const std::string& node) {
  const Api& a = api_;
  const char* where = (node.empty() || provider == "shm") ? nullptr : node.c_str();
  const std::string what =
      "libfabric provider '" + provider + "'" + (where ? " on " + node : std::string());

  // Tagged messages with directed receives carry direct transfers; a
  // provider without them still carries everything through bounce buffers.
  int ret =
      GetRdmInfo(a, provider, node, FI_MSG | FI_TAGGED | FI_DIRECTED_RECV, kRdmMrModes, &info_);
  tagged_ = ret == 0;
  if (ret == -FI_ENODATA) ret = GetRdmInfo(a, provider, node, FI_MSG, kRdmMrModes, &info_);
  if (ret == -FI_ENODATA) {
    return Status::Error(
        what + " offers no reliable-datagram (FI_EP_RDM) endpoint here (fi_getinfo: " + a.Err(ret) +
        "). `fi_info -l` lists this host's providers; choose one with "
        "JAX_SMDDP_FABRIC_PROVIDER (e.g. \"tcp;ofi_rxm\", or \"efa\" on AWS EFA instances)" +
        (where ? ", and check that " + node + " is an address of this host" : std::string()));
  }
  if (ret != 0) return Status::Error("fi_getinfo for " + what + " failed: " + a.Err(ret));
  provider_ = info_->fabric_attr->prov_name ? info_->fabric_attr->prov_name : provider;

  auto fail = [&](const char* call, int r) {
    return Status::Error(std::string(call) + " failed for libfabric provider '" + provider_ +
                         "': " + a.Err(r));
  };

  // Buffers.
  size_t max_msg = info_->ep_attr->max_msg_size ? info_->ep_attr->max_msg_size : SIZE_MAX;
  piece_bytes_ = std::max<uint64_t>(1, std::min<uint64_t>(kDirectPiece, max_msg));
  direct_min_ = uint64_t(IntSetting("JAX_SMDDP_FABRIC_DIRECT_BYTES"));
  register_buffers_ = (info_->domain_attr->mr_mode & FI_MR_LOCAL) ||
                      TextSetting("JAX_SMDDP_FABRIC_TEST_REGISTER") == "1";
  if (direct_min_ == 0) {
    direct_state_ = "off: JAX_SMDDP_FABRIC_DIRECT_BYTES=0";
  } else if (!tagged_) {
    direct_min_ = 0;
    direct_state_ =
        "off: provider '" + provider_ + "' has no tagged messages with directed receives";
  } else {
    direct_state_ = "on";
  }
  chunk_bytes_ = size_t(IntSetting("JAX_SMDDP_FABRIC_CHUNK_BYTES"));
  chunk_bytes_ = std::min(std::max<size_t>(chunk_bytes_, 4096), max_msg) / 64 * 64;
  if (chunk_bytes_ < 4096) {
    return Status::Error("libfabric provider '" + provider_ + "' carries messages of at most " +
                         std::to_string(max_msg) + " bytes; jax_smddp needs 4096");
  }
  payload_ = chunk_bytes_ - kHeaderBytes;
  size_t nbuf = std::min<size_t>(size_t(IntSetting("JAX_SMDDP_FABRIC_BUFFERS")), 4096);
  size_t nrecv = nbuf, nsend = nbuf;
  if (info_->rx_attr->size) nrecv = std::min<size_t>(nrecv, info_->rx_attr->size);
  if (info_->tx_attr->size) nsend = std::min<size_t>(nsend, info_->tx_attr->size);

  SMDDP_RETURN_IF_ERROR(OpenRdmObjects(a, info_, "libfabric provider '" + provider_ + "'",
                                       FI_CQ_FORMAT_MSG, nrecv + nsend + 64, &o_,
                                       TextSetting("JAX_SMDDP_FABRIC_WAIT") != "sleep"));
  address_ = o_.address;
  if (o_.wait_fd >= 0) kick_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK | EFD_SEMAPHORE);
  self_id_ = Fnv1a(address_);
  if (TextSetting("JAX_SMDDP_FABRIC_TEST_REORDER") == "1") {
    shuffle_ = 0x9e3779b97f4a7c15ull ^ (self_id_ | 1);
  }
  version_ = WireProtocolVersion();
  corrupt_ = TextSetting("JAX_SMDDP_FABRIC_TEST_CORRUPT");

  const size_t pool_bytes = chunk_bytes_ * (nrecv + nsend);
  pool_ = static_cast<char*>(std::aligned_alloc(4096, (pool_bytes + 4095) / 4096 * 4096));
  if (pool_ == nullptr) {
    return Status::Error("cannot allocate " + std::to_string(pool_bytes) +
                         " bytes of libfabric bounce buffers; lower JAX_SMDDP_FABRIC_BUFFERS "
                         "or JAX_SMDDP_FABRIC_CHUNK_BYTES");
  }
  if (info_->domain_attr->mr_mode & FI_MR_LOCAL) {
    ret = fi_mr_reg(o_.domain, pool_, pool_bytes, FI_SEND | FI_RECV, 0, 0, 0, &mr_, nullptr);
    if (ret != 0) return fail("fi_mr_reg of the bounce buffers", ret);
    if (info_->domain_attr->mr_mode & FI_MR_ENDPOINT) {
      if ((ret = fi_mr_bind(mr_, &o_.ep->fid, 0)) != 0) return fail("fi_mr_bind", ret);
      if ((ret = fi_mr_enable(mr_)) != 0) return fail("fi_mr_enable", ret);
    }
    desc_ = fi_mr_desc(mr_);
  }
  slots_.resize(nrecv + nsend);
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = slots_[i];
    std::memset(&s.ctx, 0, sizeof(s.ctx));
    s.buf = pool_ + i * chunk_bytes_;
    s.index = static_cast<int>(i);
    s.recv = i < nrecv;
    if (s.recv) {
      pending_recv_.push_back(s.index);
    } else {
      free_send_.push_back(s.index);
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  FlushRecvs();
  if (!endpoint_error_.empty()) return Status::Error(endpoint_error_);
  return Status::Ok();
}

FabricEndpoint::Impl::~Impl() {
  closing_.store(true, std::memory_order_release);
  if (drainer_.joinable()) drainer_.join();
  // The endpoint first: closing it retires every posted operation, so the
  // bounce buffers are free afterwards.
  if (o_.ep) fi_close(&o_.ep->fid);
  o_.ep = nullptr;
  ForLiveOps([](DirectOp* op) {
    if (op->mr) fi_close(&op->mr->fid);
  });
  for (auto& [id, p] : peers_) {
    for (auto& [seq, in] : p->direct_in) delete in;
  }
  if (mr_) fi_close(&mr_->fid);
  CloseRdmObjects(&o_);
  std::free(pool_);
  if (kick_fd_ >= 0) ::close(kick_fd_);
  if (info_) api_.freeinfo(info_);
  for (SendTrack* t : tracks_) delete t;
}

Peer* FabricEndpoint::Impl::FindOrAddPeer(uint64_t id) {
  auto it = peers_.find(id);
  if (it != peers_.end()) return it->second.get();
  if (peers_.size() >= kMaxPeers) return nullptr;
  auto p = std::make_unique<Peer>();
  p->id = id;
  char buf[64];
  std::snprintf(buf, sizeof(buf), "peer %016llx", static_cast<unsigned long long>(id));
  p->name = buf;
  Peer* raw = p.get();
  peers_.emplace(id, std::move(p));
  peer_list_.push_back(raw);
  return raw;
}

Status FabricEndpoint::Impl::Connect(const std::string& address, const std::string& name,
                                     Peer** out) {
  std::lock_guard<std::mutex> lock(mu_);
  if (address.empty()) {
    return Status::Error("cannot connect to " + name + ": its libfabric address is empty");
  }
  Peer* p = FindOrAddPeer(Fnv1a(address));
  if (p == nullptr) return Status::Error("cannot connect to " + name + ": too many peers");
  if (p->connected) {
    if (p->address != address) {
      return Status::Error("cannot connect to " + name + ": its address hashes like that of " +
                           p->name + "'s");
    }
    *out = p;
    return Status::Ok();
  }
  fi_addr_t fa = FI_ADDR_NOTAVAIL;
  int n = fi_av_insert(o_.av, address.data(), 1, &fa, 0, nullptr);
  if (n != 1) {
    return Status::Error("libfabric (" + provider_ + ") rejected the address of " + name + " (" +
                         std::to_string(address.size()) + " bytes; fi_av_insert: " +
                         (n < 0 ? api_.Err(n) : std::to_string(n) + " inserted") +
                         "): do all processes use the same provider?");
  }
  p->addr = fa;
  p->address = address;
  p->name = name;
  p->connected = true;
  *out = p;
  return Status::Ok();
}

}  // namespace smddp

#endif  // SMDDP_HAVE_LIBFABRIC

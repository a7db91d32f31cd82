// Links over libfabric RDM endpoints; see fabric_link.h for the outline.
//
// Wire format (fabric_wire.h): every libfabric message is one chunk of at
// most chunk_bytes, a 64-byte header followed by up to chunk_bytes - 64
// payload bytes. Every chunk received is read through ParseFabricChunk: one
// that does not parse (another protocol version, a wrong magic, a length past
// its end, a sender this endpoint is not connected to) is dropped, and the
// link to its sender (the whole endpoint when the sender is unknown) fails
// with a protocol error naming it.
// A Link message of `total` bytes travels as ceil(total / payload) data
// chunks (one empty chunk when total is 0). Each chunk names its sender (a
// hash of the sender's address, so the receiver routes it without FI_SOURCE;
// only peers it has connected to count: the bootstrap connects every pair
// before any call), the message's sequence number on that sender->receiver
// channel, its tag, total size and offset.
//
// Matching: the receiver "passes" messages in sequence order (the order the
// sender posted them); a passed message binds the oldest posted Recv of its
// tag, or waits in the tag's unexpected queue. Chunks of a message not yet
// bound are kept in a heap buffer and copied over when it binds. So
// receives match sends first-come-first-served per tag however the provider
// reorders chunks. A Send cancelled after some of its chunks went out is
// followed by an abort chunk saying how many bytes were sent, so that the
// receiver fails the matching Recv instead of waiting for the rest.
//
// Buffers: a fixed pool of receive buffers stays posted (reposted after each
// completion) and a pool of send buffers is filled from queued Sends; both
// are registered once when the provider asks for FI_MR_LOCAL. libfabric only
// ever sees this pool, never a caller's buffer. A Send completes when the
// provider reports all of its chunks sent (not merely copied: with manual
// progress, a sender that stopped calling Progress() after its Send
// completed could otherwise strand its last chunks); a Recv when its last
// byte arrived. One mutex guards the endpoint; Progress() only try_locks it.
//
// Direct transfers: a message of JAX_SMDDP_FABRIC_DIRECT_BYTES or more moves
// between the callers' buffers without bounce copies, where the provider has
// tagged messages with directed receives (tcp;ofi_rxm, shm, efa). The sender
// sends only a header chunk (kRts) in the message's place in the sequence;
// the message passes and binds like any other, and once bound the receiver
// posts tagged receives (FI_DIRECTED_RECV from that peer, tag = the message's
// sequence number and piece) straight into the Recv's buffer and answers
// kCts; only then does the sender post its tagged sends from the Send's
// buffer. A receiver that cannot take the message (size mismatch, the sender
// already gone) answers a refusal instead and the Send completes unsent. So
// a caller's buffer is handed to libfabric only when the other side's is
// already posted, and Cancel stays safe: a sender cancelled before kCts sends
// an abort as for chunks; a cancelled receive withdraws its posted pieces
// (fi_cancel), waits for those already matched, and reposts the withdrawn
// ones into drain buffers so that the sender's pieces still complete; a
// cancelled send whose pieces are posted waits for them (the receiver's are
// posted, so they complete unless the connection fails, which fails them).
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
#include "xla_ffi/transports/fabric_api.h"
#include "xla_ffi/transports/fabric_wire.h"

namespace smddp {
namespace {

const char kDefaultProvider[] = "tcp;ofi_rxm";

}  // namespace

#ifndef SMDDP_HAVE_LIBFABRIC

// ---------------------------------------------------------------------------
// Built without libfabric's headers: the transport exists but cannot open.

class FabricEndpoint::Impl {};

bool FabricAvailable(std::string* why) {
  if (why) *why = kFabricNoHeaders;
  return false;
}

std::string ChooseFabricProvider(const std::string& requested) {
  if (!requested.empty()) return requested;
  std::string env = TextSetting("JAX_SMDDP_FABRIC_PROVIDER");
  return env.empty() ? kDefaultProvider : env;
}

Status FabricEndpoint::Open(const std::string&, const std::string&,
                            std::unique_ptr<FabricEndpoint>*) {
  std::string why;
  FabricAvailable(&why);
  return Status::Error("cannot open a libfabric endpoint: jax_smddp was " + why);
}

FabricEndpoint::FabricEndpoint(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
FabricEndpoint::~FabricEndpoint() = default;
std::string FabricEndpoint::Address() const { return std::string(); }
std::string FabricEndpoint::Provider() const { return std::string(); }
Status FabricEndpoint::Connect(const std::string&, const std::string&, std::unique_ptr<Link>*) {
  return Status::Unsupported("jax_smddp was built without libfabric headers");
}

#else  // SMDDP_HAVE_LIBFABRIC

namespace {

using Api = FabricApi;
const Api& GetApi() { return GetFabricApi(); }
uint32_t RequestedVersion(const Api& a) { return a.RequestedVersion(); }

// The chunk kinds and header of fabric_wire.h.
constexpr uint32_t kData = kFabricData;
constexpr uint32_t kAbort = kFabricAbort;
constexpr uint32_t kRts = kFabricRts;
constexpr uint32_t kCts = kFabricCts;
using ChunkHeader = FabricChunkHeader;
constexpr size_t kHeaderBytes = kFabricHeaderBytes;

constexpr uint64_t kMaxSeqAhead = 1ull << 24;        // messages in flight, per channel
constexpr uint64_t kMaxUnexpectedBytes = 1ull << 38; // one buffered message
constexpr size_t kMaxPeers = 1 << 16;
// Direct transfers move in tagged pieces of at most this many bytes (and the
// provider's max_msg_size): both ends cut a message the same way.
constexpr uint64_t kDirectPiece = 4ull << 20;
constexpr uint64_t kMaxDirectPieces = 1ull << 16;
// How long a cancelled direct transfer may wait for libfabric to give back a
// buffer it is already writing or reading.
constexpr double kCancelWaitSeconds = 30.0;

struct Peer;
struct DirectIn;

// A Send whose bytes are all or partly in send buffers: it completes once
// the provider has reported every one of its chunks sent.
struct SendTrack {
  Request* req;  // null once cancelled
  Peer* peer;
  uint64_t inflight = 0;  // chunks and direct pieces posted, not yet completed
  bool copied = false;    // every chunk is in a send buffer / every piece posted
  std::string error;
};

// One tagged send or receive of a caller's buffer (a piece of a direct
// transfer), or a drain receive that owns its buffer. `ctx` first, as in Slot.
// Ops are kept in a pool and reused: a transfer allocates none in the steady state.
struct DirectOp {
  struct fi_context2 ctx;
  bool live = false;  // in use (else on the free list)
  Peer* peer = nullptr;
  bool recv = false;
  char* buf = nullptr;
  uint64_t bytes = 0;
  uint64_t ftag = 0;
  uint64_t id = 0;  // unique: what a waiter looks for (addresses get reused)
  struct fid_mr* mr = nullptr;  // where the provider wants buffers registered
  void* desc = nullptr;
  bool posted = false;  // handed to libfabric, completion not yet read
  SendTrack* track = nullptr;  // sends
  DirectIn* in = nullptr;      // receives into a caller's buffer
  std::unique_ptr<char[]> drain;  // drain receives
};

// A bound direct message whose pieces are posted into a Recv's buffer.
struct DirectIn {
  Request* req = nullptr;  // null once cancelled
  uint64_t seq = 0;
  uint64_t tag = 0;
  bool cancelling = false;  // a canceller owns it now
  bool drain = false;       // withdrawn pieces are reposted into drain buffers
  uint64_t pending = 0;  // pieces not yet completed
  std::string error;
};

// A direct message whose header went out, waiting for the receiver's kCts.
struct DirectOut {
  SendTrack* track;
  const char* src;
  uint64_t tag;
  uint64_t total;
};

// One bounce buffer. `ctx` first: libfabric gets &ctx as operation context
// (and may use it, FI_CONTEXT/FI_CONTEXT2), which is also the Slot's address.
struct Slot {
  struct fi_context2 ctx;
  char* buf = nullptr;
  size_t len = 0;  // bytes to send
  Peer* peer = nullptr;
  SendTrack* track = nullptr;  // send buffers: the Send this chunk belongs to
  int index = 0;
  bool recv = false;
};

struct PostedRecv {
  Request* req;
  char* dst;
  uint64_t bytes;
};

struct InMsg {
  uint64_t tag = 0;
  uint64_t total = 0;
  uint64_t received = 0;
  uint64_t limit = 0;  // bytes that will arrive: total, or less once aborted
  bool passed = false;
  bool aborted = false;
  bool direct = false;   // announced by kRts: its bytes come as tagged pieces once bound
  bool discard = false;  // consumed by a failed or cancelled Recv: drop its bytes
  Request* req = nullptr;  // bound Recv
  char* dst = nullptr;
  std::unique_ptr<char[]> heap;  // bytes of a message not yet bound
};

struct OutMsg {
  SendTrack* track;  // null for an abort
  const char* src;
  uint32_t kind;
  uint64_t tag;
  uint64_t total;
  uint64_t seq;
  uint64_t offset;  // bytes already copied out (kCts: 1 = posted, 0 = refused)
};

struct Peer {
  uint64_t id = 0;
  bool connected = false;
  fi_addr_t addr = FI_ADDR_NOTAVAIL;
  std::string address;
  std::string name;
  std::string failure;
  StatusCode failure_code = StatusCode::kPeerFailed;  // kProtocol: it sent a malformed chunk
  // Sending.
  uint64_t next_send_seq = 0;
  std::deque<OutMsg> sendq;                        // not yet all copied
  std::unordered_map<Request*, SendTrack*> sending;  // posted, not yet complete
  std::unordered_map<uint64_t, DirectOut> awaiting_cts;  // by seq
  // Receiving.
  uint64_t cursor = 0;  // next sequence number to pass
  std::map<uint64_t, InMsg> incoming;
  std::unordered_map<uint64_t, std::deque<PostedRecv>> posted;
  std::unordered_map<uint64_t, std::deque<uint64_t>> unexpected;  // passed, unbound seqs
  std::unordered_map<uint64_t, DirectIn*> direct_in;  // bound direct messages, by seq
  std::atomic<uint64_t> direct_received{0};            // bytes, for traffic()
};

std::string TagText(uint64_t tag) { return "message tag " + std::to_string(tag); }

}  // namespace

class FabricEndpoint::Impl {
 public:
  explicit Impl(const Api& api) : api_(api) {}
  ~Impl();
  Status Init(const std::string& provider, const std::string& node);
  Status Connect(const std::string& address, const std::string& name, Peer** out);

  void Send(Peer* p, uint64_t tag, const void* src, size_t bytes, Request* req);
  void Recv(Peer* p, uint64_t tag, void* dst, size_t bytes, Request* req);
  void Progress();
  void Cancel(Peer* p, Request* req);
  std::string Failure(Peer* p);
  StatusCode FailureCode(Peer* p);
  void SetFailure(Peer* p, const std::string& why);

  const std::string& address() const { return address_; }
  const std::string& provider() const { return provider_; }
  // "on", or "off: <why>": whether large messages move direct.
  const std::string& direct_state() const { return direct_state_; }

 private:
  Peer* FindOrAddPeer(uint64_t id);
  void HandleChunk(Slot& slot, size_t len);
  void ProtocolError(Peer* p, const std::string& what);
  void DropChunk(Peer* p, const std::string& why);
  // A request that cannot start because the link to `p` failed.
  Status FailedOn(Peer* p, const std::string& what);
  void Corrupt(ChunkHeader* h, Slot* s) const;
  void Advance(Peer* p);
  void Bind(Peer* p, std::map<uint64_t, InMsg>::iterator it, const PostedRecv& r);
  void Finish(Peer* p, std::map<uint64_t, InMsg>::iterator it);
  void ReadError();
  void Pump();
  void PostChunk(Peer* p);
  void FlushSends();
  void FlushRecvs();
  void SendDone(Slot& s, const std::string& error);
  void Retire(SendTrack* t);
  Slot* SlotOf(void* context);
  void Poll();  // one round of Progress, mu_ held

  // Direct transfers.
  bool FitsDirect(uint64_t bytes) const {
    return (bytes + piece_bytes_ - 1) / piece_bytes_ <= kMaxDirectPieces;
  }
  uint64_t PieceTag(uint64_t seq, uint64_t piece) const { return (seq << 16) | piece; }
  DirectOp* NewOp(Peer* p, bool recv, char* buf, uint64_t bytes, uint64_t ftag);
  DirectOp* OpOf(void* context);
  void DeleteOp(DirectOp* op);
  template <typename F>
  void ForLiveOps(F f) {
    for (auto& op : op_pool_) {
      if (op->live) f(op.get());
    }
  }
  void PostDirect(DirectOp* op);
  void PostPieces(Peer* p, char* buf, uint64_t total, uint64_t seq, SendTrack* t, DirectIn* in);
  void FlushDirect();
  void DirectDone(DirectOp* op, const std::string& error, bool cancelled);
  void FinishDirectIn(Peer* p, DirectIn* in);
  void BindDirect(Peer* p, uint64_t seq, const InMsg& m, const PostedRecv& r);
  void StartDirectSend(Peer* p, uint64_t seq);
  void QueueControl(Peer* p, uint32_t kind, uint64_t seq, uint64_t tag, uint64_t total,
                    uint64_t offset);
  void CancelDirectIn(Peer* p, DirectIn* in, bool drain);
  bool AwaitOps(const std::vector<uint64_t>& ids);

  const Api& api_;
  std::mutex mu_;
  struct fi_info* info_ = nullptr;
  RdmObjects o_;
  struct fid_mr* mr_ = nullptr;
  void* desc_ = nullptr;
  std::string address_;
  std::string provider_;
  uint64_t self_id_ = 0;

  size_t chunk_bytes_ = 0;
  size_t payload_ = 0;
  char* pool_ = nullptr;
  std::vector<Slot> slots_;         // never resized after Init
  std::vector<int> free_send_;
  std::deque<int> pending_send_;    // filled, to post (fi_send said -FI_EAGAIN)
  std::deque<int> pending_recv_;    // to (re)post
  std::unordered_set<SendTrack*> tracks_;  // owned

  std::unordered_map<uint64_t, std::unique_ptr<Peer>> peers_;
  std::vector<Peer*> peer_list_;
  size_t rr_ = 0;
  std::string endpoint_error_;  // a CQ error or a chunk no peer can be blamed for
  StatusCode endpoint_error_code_ = StatusCode::kPeerFailed;
  uint32_t version_ = 0;  // WireProtocolVersion(): written into every chunk, required of every chunk
  std::string corrupt_;   // tests: how every chunk sent is malformed (JAX_SMDDP_FABRIC_TEST_CORRUPT)
  uint64_t shuffle_ = 0;  // tests: nonzero = post send chunks out of order (xorshift state)

  bool tagged_ = false;      // direct transfers can be received
  uint64_t direct_min_ = 0;  // 0: this process sends none
  std::string direct_state_;
  uint64_t piece_bytes_ = 1;  // kDirectPiece, or less where the provider's messages are shorter
  bool register_buffers_ = false;  // FI_MR_LOCAL (or the test setting)
  std::vector<std::unique_ptr<DirectOp>> op_pool_;  // every op made, live or free
  std::vector<DirectOp*> free_ops_;
  uint64_t next_op_id_ = 1;
  std::deque<DirectOp*> pending_direct_;  // to post (-FI_EAGAIN)
};

// ---------------------------------------------------------------------------
// Opening and closing.

Status FabricEndpoint::Impl::Init(const std::string& provider, const std::string& node) {
  const Api& a = api_;
  const char* where = (node.empty() || provider == "shm") ? nullptr : node.c_str();
  const std::string what = "libfabric provider '" + provider + "'" +
                           (where ? " on " + node : std::string());

  const uint64_t mr_modes =
      FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
  // Tagged messages with directed receives carry direct transfers; a
  // provider without them still carries everything through bounce buffers.
  int ret = GetRdmInfo(a, provider, node, FI_MSG | FI_TAGGED | FI_DIRECTED_RECV, mr_modes, &info_);
  tagged_ = ret == 0;
  if (ret == -FI_ENODATA) ret = GetRdmInfo(a, provider, node, FI_MSG, mr_modes, &info_);
  if (ret == -FI_ENODATA) {
    return Status::Error(
        what + " offers no reliable-datagram (FI_EP_RDM) endpoint here (fi_getinfo: " +
        a.Err(ret) + "). `fi_info -l` lists this host's providers; choose one with "
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
    direct_state_ = "off: provider '" + provider_ + "' has no tagged messages with directed receives";
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
                                       FI_CQ_FORMAT_MSG, nrecv + nsend + 64, &o_));
  address_ = o_.address;
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

// ---------------------------------------------------------------------------
// Posting.

void FabricEndpoint::Impl::Send(Peer* p, uint64_t tag, const void* src, size_t bytes,
                                Request* req) {
  std::lock_guard<std::mutex> lock(mu_);
  req->Reset();
  if (!p->failure.empty()) {
    req->Complete(FailedOn(p, "cannot send " + TagText(tag) + " to " + p->name + ": " + p->failure));
    return;
  }
  SendTrack* t = new SendTrack{req, p, 0, false, std::string()};
  tracks_.insert(t);
  p->sending[req] = t;
  const uint64_t seq = p->next_send_seq++;
  const bool direct = direct_min_ != 0 && bytes >= direct_min_ && FitsDirect(bytes);
  if (direct) p->awaiting_cts[seq] = DirectOut{t, static_cast<const char*>(src), tag, bytes};
  p->sendq.push_back(OutMsg{t, static_cast<const char*>(src), direct ? uint32_t(kRts) : kData,
                            tag, bytes, seq, 0});
  Pump();
  FlushSends();
}

void FabricEndpoint::Impl::Recv(Peer* p, uint64_t tag, void* dst, size_t bytes, Request* req) {
  std::lock_guard<std::mutex> lock(mu_);
  req->Reset();
  PostedRecv r{req, static_cast<char*>(dst), bytes};
  auto u = p->unexpected.find(tag);
  if (u != p->unexpected.end()) {
    uint64_t seq = u->second.front();
    u->second.pop_front();
    if (u->second.empty()) p->unexpected.erase(u);
    auto it = p->incoming.find(seq);
    if (it != p->incoming.end()) {
      Bind(p, it, r);
      Pump();  // a direct message's kCts
      FlushSends();
      return;
    }
  }
  if (!p->failure.empty()) {
    req->Complete(FailedOn(p, "cannot receive " + TagText(tag) + " from " + p->name + ": " +
                              p->failure));
    return;
  }
  p->posted[tag].push_back(r);
}

void FabricEndpoint::Impl::Cancel(Peer* p, Request* req) {
  std::lock_guard<std::mutex> lock(mu_);
  if (req->done()) return;
  for (auto it = p->posted.begin(); it != p->posted.end();) {
    auto& q = it->second;
    q.erase(std::remove_if(q.begin(), q.end(), [&](const PostedRecv& r) { return r.req == req; }),
            q.end());
    it = q.empty() ? p->posted.erase(it) : std::next(it);
  }
  for (auto& [seq, m] : p->incoming) {
    if (m.req == req) {  // bound, partly arrived: drop the rest of its bytes
      m.req = nullptr;
      m.dst = nullptr;
      m.discard = true;
    }
  }
  for (auto& [seq, in] : p->direct_in) {
    if (in->req == req) {  // pieces posted into the caller's buffer: withdraw them
      in->req = nullptr;
      CancelDirectIn(p, in, /*drain=*/true);
      break;
    }
  }
  auto st = p->sending.find(req);
  if (st != p->sending.end()) {
    SendTrack* t = st->second;
    p->sending.erase(st);
    t->req = nullptr;
    bool queued = false;
    for (size_t i = 0; i < p->sendq.size(); ++i) {
      OutMsg& o = p->sendq[i];
      if (o.track != t) continue;
      // Not all of it was copied: tell the receiver how much will arrive.
      OutMsg abort{nullptr, nullptr, kAbort, o.tag, o.total, o.seq, o.offset};
      p->awaiting_cts.erase(o.seq);
      p->sendq.erase(p->sendq.begin() + i);
      p->sendq.push_front(abort);
      t->copied = true;  // no more chunks of it
      queued = true;
      break;
    }
    if (!queued) {
      for (auto a = p->awaiting_cts.begin(); a != p->awaiting_cts.end(); ++a) {
        if (a->second.track != t) continue;
        // Its header went out, its bytes did not: none will.
        p->sendq.push_front(OutMsg{nullptr, nullptr, kAbort, a->second.tag, a->second.total,
                                   a->first, 0});
        p->awaiting_cts.erase(a);
        t->copied = true;
        break;
      }
    }
    // Direct pieces already posted (the receiver's are too): wait until
    // libfabric is done with the caller's buffer; their completions retire
    // the track.
    std::vector<uint64_t> ids;
    ForLiveOps([&](DirectOp* op) {
      if (op->track == t) ids.push_back(op->id);
    });
    if (ids.empty()) {
      Retire(t);
    } else {
      AwaitOps(ids);
    }
  }
  Pump();
  FlushSends();
}

void FabricEndpoint::Impl::SetFailure(Peer* p, const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (p->failure.empty()) p->failure = why;
}

std::string FabricEndpoint::Impl::Failure(Peer* p) {
  std::lock_guard<std::mutex> lock(mu_);
  return p->failure.empty() ? endpoint_error_ : p->failure;
}

StatusCode FabricEndpoint::Impl::FailureCode(Peer* p) {
  std::lock_guard<std::mutex> lock(mu_);
  return p->failure.empty() ? endpoint_error_code_ : p->failure_code;
}

Status FabricEndpoint::Impl::FailedOn(Peer* p, const std::string& what) {
  return Status::WithCode(p->failure_code, what);
}

// ---------------------------------------------------------------------------
// Sending: queued messages -> send buffers -> fi_send.

void FabricEndpoint::Impl::Pump() {
  if (peer_list_.empty()) return;
  bool moved = true;
  while (moved && !free_send_.empty()) {
    moved = false;
    for (size_t k = 0; k < peer_list_.size() && !free_send_.empty(); ++k) {
      Peer* p = peer_list_[(rr_ + k) % peer_list_.size()];
      if (p->sendq.empty() || !p->failure.empty()) continue;
      PostChunk(p);
      moved = true;
    }
    rr_ = (rr_ + 1) % peer_list_.size();
  }
}

void FabricEndpoint::Impl::PostChunk(Peer* p) {
  OutMsg& o = p->sendq.front();
  Slot& s = slots_[free_send_.back()];
  free_send_.pop_back();
  ChunkHeader h;
  std::memset(&h, 0, sizeof(h));
  h.magic = kFabricChunkMagic;
  h.version = version_;
  h.kind = o.kind;
  h.sender = self_id_;
  h.seq = o.seq;
  h.tag = o.tag;
  h.total = o.total;
  h.offset = o.offset;
  if (o.kind == kData) {
    h.len = std::min<uint64_t>(payload_, o.total - o.offset);
    if (h.len > 0) std::memcpy(s.buf + kHeaderBytes, o.src + o.offset, h.len);
    o.offset += h.len;
  }
  s.len = kHeaderBytes + h.len;
  if (!corrupt_.empty()) Corrupt(&h, &s);
  std::memcpy(s.buf, &h, sizeof(h));
  s.peer = p;
  s.track = o.track;
  if (o.track) ++o.track->inflight;
  pending_send_.push_back(s.index);
  if (o.kind != kData || o.offset == o.total) {
    // A kRts's track is done with once its pieces are posted (StartDirectSend).
    if (o.track && o.kind == kData) o.track->copied = true;
    p->sendq.pop_front();
  }
}

// A chunk's send completed (or failed with `error`).
void FabricEndpoint::Impl::SendDone(Slot& s, const std::string& error) {
  SendTrack* t = s.track;
  s.track = nullptr;
  free_send_.push_back(s.index);
  if (t == nullptr) return;
  if (!error.empty() && t->error.empty()) t->error = error;
  --t->inflight;
  Retire(t);
}

// Completes and frees a Send once nothing of it is left in flight.
void FabricEndpoint::Impl::Retire(SendTrack* t) {
  if (!t->copied || t->inflight > 0) return;
  Request* req = t->req;
  std::string error = std::move(t->error);
  if (req) t->peer->sending.erase(req);
  tracks_.erase(t);
  delete t;
  if (req) req->Complete(error.empty() ? Status::Ok() : Status::PeerFailed(error));
}

void FabricEndpoint::Impl::FlushSends() {
  FlushDirect();
  while (!pending_send_.empty()) {
    if (shuffle_ != 0 && pending_send_.size() > 1) {
      // Tests of the receiver's reordering: post a random waiting chunk first.
      shuffle_ ^= shuffle_ << 13;
      shuffle_ ^= shuffle_ >> 7;
      shuffle_ ^= shuffle_ << 17;
      std::swap(pending_send_.front(), pending_send_[shuffle_ % pending_send_.size()]);
    }
    Slot& s = slots_[pending_send_.front()];
    ssize_t ret = fi_send(o_.ep, s.buf, s.len, desc_, s.peer->addr, &s.ctx);
    if (ret == -FI_EAGAIN) return;  // the CQ must be read first: Progress retries
    pending_send_.pop_front();
    if (ret != 0) {
      std::string error = "libfabric (" + provider_ + ") cannot send to " + s.peer->name +
                          ": fi_send: " + api_.Err(static_cast<int>(ret));
      if (s.peer->failure.empty()) s.peer->failure = error;
      SendDone(s, error);
    }
  }
}

void FabricEndpoint::Impl::FlushRecvs() {
  while (!pending_recv_.empty()) {
    Slot& s = slots_[pending_recv_.front()];
    ssize_t ret = fi_recv(o_.ep, s.buf, chunk_bytes_, desc_, FI_ADDR_UNSPEC, &s.ctx);
    if (ret == -FI_EAGAIN) return;
    pending_recv_.pop_front();
    if (ret != 0) {
      endpoint_error_ = "libfabric (" + provider_ + ") cannot post a receive buffer: fi_recv: " +
                        api_.Err(static_cast<int>(ret));
    }
  }
}

// ---------------------------------------------------------------------------
// Progress: completions -> chunks -> matching.

Slot* FabricEndpoint::Impl::SlotOf(void* context) {
  if (context == nullptr || slots_.empty()) return nullptr;
  Slot* s = reinterpret_cast<Slot*>(context);
  if (s < slots_.data() || s >= slots_.data() + slots_.size()) return nullptr;
  return s;
}

void FabricEndpoint::Impl::Progress() {
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  if (!lock.owns_lock()) return;  // another thread is progressing
  Poll();
}

void FabricEndpoint::Impl::Poll() {
  for (int round = 0; round < 16; ++round) {
    struct fi_cq_msg_entry entries[16];
    ssize_t n = fi_cq_read(o_.cq, entries, 16);
    if (n == -FI_EAVAIL) {
      ReadError();
    } else if (n < 0 && n != -FI_EAGAIN) {
      endpoint_error_ = "libfabric (" + provider_ + ") fi_cq_read failed: " +
                        api_.Err(static_cast<int>(n));
    }
    for (ssize_t i = 0; i < n; ++i) {
      Slot* s = SlotOf(entries[i].op_context);
      if (s == nullptr) {
        if (DirectOp* op = OpOf(entries[i].op_context)) {
          std::string error;
          if (op->recv && entries[i].len != op->bytes) {
            error = "libfabric (" + provider_ + ") delivered " + std::to_string(entries[i].len) +
                    " bytes of a " + std::to_string(op->bytes) + "-byte piece from " +
                    op->peer->name;
          }
          DirectDone(op, error, false);
        }
        continue;
      }
      if (s->recv) {
        HandleChunk(*s, entries[i].len);
        pending_recv_.push_back(s->index);
      } else {
        SendDone(*s, std::string());
      }
    }
    FlushRecvs();
    Pump();
    FlushSends();
    if (n <= 0 && n != -FI_EAVAIL) break;
  }
}

void FabricEndpoint::Impl::ReadError() {
  struct fi_cq_err_entry err;
  std::memset(&err, 0, sizeof(err));
  if (fi_cq_readerr(o_.cq, &err, 0) < 0) return;
  char buf[256] = {0};
  const char* detail = fi_cq_strerror(o_.cq, err.prov_errno, err.err_data, buf, sizeof(buf));
  std::string text = api_.Err(-err.err);
  if (detail && *detail) text += "; provider: " + std::string(detail);
  Slot* s = SlotOf(err.op_context);
  if (s == nullptr) {
    if (DirectOp* op = OpOf(err.op_context)) {
      const bool cancelled = err.err == FI_ECANCELED;
      std::string error = "libfabric (" + provider_ + ") failed to " +
                          (op->recv ? "receive from " : "send to ") + op->peer->name + ": " + text;
      if (!cancelled && op->peer->failure.empty()) op->peer->failure = error;
      DirectDone(op, error, cancelled);
      return;
    }
  }
  if (s != nullptr && !s->recv) {
    std::string error =
        "libfabric (" + provider_ + ") failed to send to " + s->peer->name + ": " + text;
    if (s->peer->failure.empty()) s->peer->failure = error;
    SendDone(*s, error);
  } else {
    if (s != nullptr) pending_recv_.push_back(s->index);
    if (err.err != FI_ECANCELED && endpoint_error_.empty()) {
      endpoint_error_ = "libfabric (" + provider_ + ") receive failed, peer unknown: " + text;
    }
  }
}

// Records a protocol failure: the link to `p` (every link of the endpoint
// when the sender is unknown) fails with a kProtocol error saying `why`; the
// first failure stays.
void FabricEndpoint::Impl::DropChunk(Peer* p, const std::string& why) {
  std::string msg = "libfabric (" + provider_ + "): " + why +
                    "; the chunk was dropped (do all processes run the same jax_smddp build, "
                    "with the same JAX_SMDDP_FABRIC_CHUNK_BYTES?)";
  std::string& slot = p ? p->failure : endpoint_error_;
  if (!slot.empty()) return;
  slot = std::move(msg);
  (p ? p->failure_code : endpoint_error_code_) = StatusCode::kProtocol;
}

void FabricEndpoint::Impl::ProtocolError(Peer* p, const std::string& what) {
  DropChunk(p, "protocol error from " + (p ? p->name : std::string("an unknown peer")) + ": " + what);
}

// Tests (JAX_SMDDP_FABRIC_TEST_CORRUPT): the chunk about to be sent made
// malformed in the named way.
void FabricEndpoint::Impl::Corrupt(ChunkHeader* h, Slot* s) const {
  if (corrupt_ == "magic") {
    h->magic ^= 0x20;
  } else if (corrupt_ == "version") {
    h->version += 1;
  } else if (corrupt_ == "sender") {
    h->sender = ~h->sender;
  } else if (corrupt_ == "length") {
    h->len += chunk_bytes_;  // past the end of any receive buffer
  } else if (corrupt_ == "short") {
    s->len = kHeaderBytes / 2;
  }
}

void FabricEndpoint::Impl::HandleChunk(Slot& slot, size_t len) {
  ChunkHeader h;
  uint64_t blame = 0;
  Status parsed = ParseFabricChunk(
      slot.buf, len, chunk_bytes_, version_,
      [this](uint64_t id, std::string* name) {
        auto it = peers_.find(id);
        if (it == peers_.end() || !it->second->connected) return false;
        *name = it->second->name;
        return true;
      },
      &h, &blame);
  if (!parsed.ok()) {
    DropChunk(blame != 0 ? peers_.at(blame).get() : nullptr, parsed.message());
    return;
  }
  Peer* p = peers_.at(h.sender).get();
  if (h.kind == kAbort) {
    auto d = p->direct_in.find(h.seq);
    if (d != p->direct_in.end()) {
      // Cancelled after this side posted its pieces: it will send none.
      DirectIn* in = d->second;
      if (in->req != nullptr) {
        in->req->Complete(Status::PeerFailed(p->name + " cancelled sending " + TagText(in->tag) +
                                             " before any of its bytes went out"));
        in->req = nullptr;
      }
      CancelDirectIn(p, in, /*drain=*/false);
      return;
    }
    // A late abort of a message this side already retired (refused).
    if (h.seq < p->cursor && p->incoming.find(h.seq) == p->incoming.end()) return;
  } else if (h.kind == kCts) {
    auto a = p->awaiting_cts.find(h.seq);
    if (a == p->awaiting_cts.end()) return;  // that send was cancelled meanwhile
    if (a->second.tag != h.tag || a->second.total != h.total) {
      ProtocolError(p, "a clear-to-send for message " + std::to_string(h.seq) +
                           " with another tag or size");
      return;
    }
    if (h.offset == 1) {
      StartDirectSend(p, h.seq);
    } else {  // refused: the receiver reported why; the bytes are not wanted
      SendTrack* t = a->second.track;
      p->awaiting_cts.erase(a);
      t->copied = true;
      Retire(t);
    }
    return;
  } else if (h.kind == kRts) {
    if (!tagged_) {
      ProtocolError(p, TagText(h.tag) + " comes as a direct transfer, but provider '" + provider_ +
                           "' here has no tagged messages with directed receives");
      return;
    }
    if (!FitsDirect(h.total)) {
      ProtocolError(p, TagText(h.tag) + ": a direct transfer of " + std::to_string(h.total) +
                           " bytes, more pieces than allowed");
      return;
    }
  }

  auto it = p->incoming.find(h.seq);
  if (it == p->incoming.end()) {
    if (h.seq < p->cursor || h.seq - p->cursor > kMaxSeqAhead) {
      ProtocolError(p, TagText(h.tag) + ": unexpected sequence number " + std::to_string(h.seq) +
                           " (next is " + std::to_string(p->cursor) + ")");
      return;
    }
    InMsg m;
    m.tag = h.tag;
    m.total = h.total;
    m.limit = h.total;
    it = p->incoming.emplace(h.seq, std::move(m)).first;
  } else if (h.kind == kRts && it->second.aborted) {
    return;  // its abort overtook it
  } else if (it->second.tag != h.tag || it->second.total != h.total ||
             h.kind == kRts || (h.kind == kData && it->second.direct)) {
    ProtocolError(p, "message " + std::to_string(h.seq) + " changed its tag, size or kind");
    return;
  }
  InMsg& m = it->second;
  if (h.kind == kRts) {
    m.direct = true;
    if (h.seq == p->cursor) Advance(p);
    return;
  }
  if (h.kind == kAbort) {
    if (m.aborted || h.offset < m.received) {
      ProtocolError(p, TagText(h.tag) + ": inconsistent abort");
      return;
    }
    m.aborted = true;
    m.limit = h.offset;
    m.heap.reset();
    if (m.req != nullptr) {
      Request* req = m.req;
      m.req = nullptr;
      m.dst = nullptr;
      m.discard = true;
      req->Complete(Status::PeerFailed(p->name + " cancelled sending " + TagText(m.tag) + " after " +
                                  std::to_string(h.offset) + " of " + std::to_string(m.total) +
                                  " bytes"));
    }
  } else {
    if (h.len > m.limit - m.received) {
      ProtocolError(p, TagText(h.tag) + ": more bytes than announced");
      return;
    }
    m.received += h.len;
    const char* src = slot.buf + kHeaderBytes;
    if (m.dst != nullptr) {
      std::memcpy(m.dst + h.offset, src, h.len);
    } else if (!m.discard && !m.aborted && h.len > 0) {
      if (!m.heap) {
        if (m.total > kMaxUnexpectedBytes) {
          ProtocolError(p, TagText(h.tag) + " announces " + std::to_string(m.total) + " bytes");
          return;
        }
        m.heap.reset(new (std::nothrow) char[m.total]);
        if (!m.heap) {
          if (p->failure.empty()) {
            p->failure = "out of memory buffering " + TagText(h.tag) + " (" +
                         std::to_string(m.total) + " bytes) from " + p->name;
          }
          return;
        }
      }
      std::memcpy(m.heap.get() + h.offset, src, h.len);
    }
  }
  if (m.passed) {
    Finish(p, it);
  } else if (h.seq == p->cursor) {
    Advance(p);
  }
}

// Passes every message whose turn has come: binds it to the oldest posted
// Recv of its tag, or queues it as unexpected.
void FabricEndpoint::Impl::Advance(Peer* p) {
  for (;;) {
    auto it = p->incoming.find(p->cursor);
    if (it == p->incoming.end()) return;
    ++p->cursor;
    InMsg& m = it->second;
    m.passed = true;
    auto q = p->posted.find(m.tag);
    if (q != p->posted.end()) {
      PostedRecv r = q->second.front();
      q->second.pop_front();
      if (q->second.empty()) p->posted.erase(q);
      Bind(p, it, r);
    } else {
      p->unexpected[m.tag].push_back(it->first);
    }
  }
}

void FabricEndpoint::Impl::Bind(Peer* p, std::map<uint64_t, InMsg>::iterator it,
                                const PostedRecv& r) {
  InMsg& m = it->second;
  if (m.direct) {
    const uint64_t seq = it->first;
    InMsg msg = std::move(m);
    p->incoming.erase(it);
    BindDirect(p, seq, msg, r);
    return;
  }
  if (m.total != r.bytes) {
    m.discard = true;
    m.heap.reset();
    r.req->Complete(Status::Mismatch(
        TagText(m.tag) + " from " + p->name + " has " + std::to_string(m.total) +
        " bytes but the receive expects " + std::to_string(r.bytes) +
        " (do the processes run the same program?)"));
  } else if (m.aborted) {
    m.discard = true;
    r.req->Complete(Status::PeerFailed(p->name + " cancelled sending " + TagText(m.tag) + " after " +
                                  std::to_string(m.limit) + " of " + std::to_string(m.total) +
                                  " bytes"));
  } else {
    if (m.heap && m.received > 0) std::memcpy(r.dst, m.heap.get(), m.total);
    m.heap.reset();
    m.req = r.req;
    m.dst = r.dst;
  }
  Finish(p, it);
}

// Retires a passed message once all its bytes are in.
void FabricEndpoint::Impl::Finish(Peer* p, std::map<uint64_t, InMsg>::iterator it) {
  InMsg& m = it->second;
  if (!m.passed || m.received != m.limit) return;
  if (m.req != nullptr) {
    Request* req = m.req;
    p->incoming.erase(it);
    req->Complete(Status::Ok());
  } else if (m.discard) {
    p->incoming.erase(it);
  }
  // else: complete but unmatched; waits in p->unexpected.
}

// ---------------------------------------------------------------------------
// Direct transfers: tagged pieces between the callers' buffers.

DirectOp* FabricEndpoint::Impl::NewOp(Peer* p, bool recv, char* buf, uint64_t bytes,
                                      uint64_t ftag) {
  DirectOp* op;
  if (free_ops_.empty()) {
    op_pool_.push_back(std::make_unique<DirectOp>());
    op = op_pool_.back().get();
  } else {
    op = free_ops_.back();
    free_ops_.pop_back();
    *op = DirectOp();
  }
  std::memset(&op->ctx, 0, sizeof(op->ctx));
  op->live = true;
  op->peer = p;
  op->recv = recv;
  op->buf = buf;
  op->bytes = bytes;
  op->ftag = ftag;
  op->id = next_op_id_++;
  return op;
}

// A completion's context that is not a slot is an op: nothing else is posted.
DirectOp* FabricEndpoint::Impl::OpOf(void* context) {
  DirectOp* op = static_cast<DirectOp*>(context);
  return op != nullptr && op->live ? op : nullptr;
}

void FabricEndpoint::Impl::DeleteOp(DirectOp* op) {
  if (op->mr) fi_close(&op->mr->fid);
  op->mr = nullptr;
  op->drain.reset();
  op->live = false;
  free_ops_.push_back(op);
}

// Registers the op's buffer where the provider wants that, then posts it (or
// queues it behind others that met -FI_EAGAIN, keeping their order).
void FabricEndpoint::Impl::PostDirect(DirectOp* op) {
  if (register_buffers_ && op->mr == nullptr) {
    // Keys must differ where the provider does not choose them (no FI_MR_PROV_KEY).
    int ret = fi_mr_reg(o_.domain, op->buf, op->bytes, op->recv ? FI_RECV : FI_SEND, 0,
                        (1ull << 62) | op->id, 0, &op->mr, nullptr);
    if (ret == 0 && (info_->domain_attr->mr_mode & FI_MR_ENDPOINT)) {
      ret = fi_mr_bind(op->mr, &o_.ep->fid, 0);
      if (ret == 0) ret = fi_mr_enable(op->mr);
    }
    if (ret != 0) {
      DirectDone(op, "libfabric (" + provider_ + ") cannot register " +
                         std::to_string(op->bytes) + " bytes for a direct transfer with " +
                         op->peer->name + ": " + api_.Err(ret),
                 false);
      return;
    }
    op->desc = fi_mr_desc(op->mr);
  }
  pending_direct_.push_back(op);
  FlushDirect();
}

void FabricEndpoint::Impl::FlushDirect() {
  while (!pending_direct_.empty()) {
    DirectOp* op = pending_direct_.front();
    Peer* p = op->peer;
    ssize_t ret = op->recv ? fi_trecv(o_.ep, op->buf, op->bytes, op->desc, p->addr, op->ftag, 0,
                                      &op->ctx)
                           : fi_tsend(o_.ep, op->buf, op->bytes, op->desc, p->addr, op->ftag,
                                      &op->ctx);
    if (ret == -FI_EAGAIN) return;  // the CQ must be read first: Progress retries
    pending_direct_.pop_front();
    if (ret == 0) {
      op->posted = true;
      continue;
    }
    std::string error = "libfabric (" + provider_ + ") cannot " +
                        (op->recv ? "post a receive from " : "send to ") + p->name + ": " +
                        (op->recv ? "fi_trecv: " : "fi_tsend: ") + api_.Err(static_cast<int>(ret));
    if (p->failure.empty()) p->failure = error;
    DirectDone(op, error, false);
  }
}

// An op completed (error empty), failed, or was withdrawn (`cancelled`).
void FabricEndpoint::Impl::DirectDone(DirectOp* op, const std::string& error, bool cancelled) {
  Peer* p = op->peer;
  if (!op->recv) {
    SendTrack* t = op->track;
    DeleteOp(op);
    if (!error.empty() && t->error.empty()) t->error = error;
    --t->inflight;
    Retire(t);
    return;
  }
  if (op->drain) {  // bytes nobody wants any more
    DeleteOp(op);
    return;
  }
  DirectIn* in = op->in;
  const uint64_t bytes = op->bytes, ftag = op->ftag;
  DeleteOp(op);
  if (in == nullptr) return;
  if (cancelled && in->drain && p->failure.empty()) {
    // The sender's piece is (or will be) posted: give it somewhere to land.
    DirectOp* drain = NewOp(p, true, nullptr, bytes, ftag);
    drain->drain.reset(new (std::nothrow) char[bytes]);
    if (drain->drain) {
      drain->buf = drain->drain.get();
      PostDirect(drain);
    } else {
      DeleteOp(drain);
    }
  }
  if (!error.empty()) {
    if (in->error.empty()) in->error = error;
  } else if (!cancelled) {
    p->direct_received.fetch_add(bytes, std::memory_order_relaxed);
  }
  --in->pending;
  if (in->pending == 0 && !in->cancelling) FinishDirectIn(p, in);
}

// Completes a direct receive whose pieces are all done (or failed to post).
void FabricEndpoint::Impl::FinishDirectIn(Peer* p, DirectIn* in) {
  Request* req = in->req;
  std::string why = std::move(in->error);
  p->direct_in.erase(in->seq);
  delete in;
  if (req) req->Complete(why.empty() ? Status::Ok() : Status::PeerFailed(why));
}

// A direct message met its Recv: post the pieces into the Recv's buffer and
// tell the sender (or refuse it, as Bind fails chunked messages).
void FabricEndpoint::Impl::BindDirect(Peer* p, uint64_t seq, const InMsg& m, const PostedRecv& r) {
  if (m.total != r.bytes) {
    QueueControl(p, kCts, seq, m.tag, m.total, 0);
    r.req->Complete(Status::Mismatch(
        TagText(m.tag) + " from " + p->name + " has " + std::to_string(m.total) +
        " bytes but the receive expects " + std::to_string(r.bytes) +
        " (do the processes run the same program?)"));
    return;
  }
  if (m.aborted) {
    r.req->Complete(Status::PeerFailed(p->name + " cancelled sending " + TagText(m.tag) +
                                       " before any of its bytes went out"));
    return;
  }
  if (!p->connected) {  // cannot happen: Recvs are posted on connected links
    QueueControl(p, kCts, seq, m.tag, m.total, 0);
    r.req->Complete(Status::Error("cannot receive " + TagText(m.tag) + " from " + p->name +
                                  ": not connected"));
    return;
  }
  DirectIn* in = new DirectIn;
  in->req = r.req;
  in->seq = seq;
  in->tag = m.tag;
  p->direct_in[seq] = in;
  // A post that fails completes its piece at once: keep `in` until all are out.
  in->cancelling = true;
  PostPieces(p, r.dst, m.total, seq, nullptr, in);
  in->cancelling = false;
  QueueControl(p, kCts, seq, m.tag, m.total, 1);
  if (in->pending == 0) FinishDirectIn(p, in);  // every post failed
}

// The receiver posted message `seq`'s pieces: post ours.
void FabricEndpoint::Impl::StartDirectSend(Peer* p, uint64_t seq) {
  auto a = p->awaiting_cts.find(seq);
  DirectOut out = a->second;
  p->awaiting_cts.erase(a);
  // Not `copied` until every piece is posted: a failed post cannot retire it early.
  PostPieces(p, const_cast<char*>(out.src), out.total, seq, out.track, nullptr);
  out.track->copied = true;
  Retire(out.track);
}

// Cuts a direct message into its tagged pieces (the same cut on both ends)
// and posts each, counted in the send's track `t` or the receive `in`.
void FabricEndpoint::Impl::PostPieces(Peer* p, char* buf, uint64_t total, uint64_t seq,
                                      SendTrack* t, DirectIn* in) {
  for (uint64_t off = 0, i = 0; off < total; off += piece_bytes_, ++i) {
    DirectOp* op = NewOp(p, in != nullptr, buf + off, std::min(piece_bytes_, total - off),
                         PieceTag(seq, i));
    op->track = t;
    op->in = in;
    if (t) ++t->inflight;
    if (in) ++in->pending;
    PostDirect(op);
  }
}

void FabricEndpoint::Impl::QueueControl(Peer* p, uint32_t kind, uint64_t seq, uint64_t tag,
                                        uint64_t total, uint64_t offset) {
  // First in line: a control chunk never waits behind bulk chunks.
  p->sendq.push_front(OutMsg{nullptr, nullptr, kind, tag, total, seq, offset});
}

// Withdraws a bound direct message's pieces: none writes into the caller's
// buffer once this returns (short of kCancelWaitSeconds spent waiting on one
// libfabric already writes into). With `drain`, withdrawn pieces are reposted
// into buffers of their own, so that the sender's posted pieces complete.
void FabricEndpoint::Impl::CancelDirectIn(Peer* p, DirectIn* in, bool drain) {
  in->cancelling = true;
  in->drain = drain;
  std::vector<uint64_t> ids;
  std::vector<DirectOp*> unposted;
  ForLiveOps([&](DirectOp* op) {
    if (op->in != in) return;
    ids.push_back(op->id);
    if (op->posted) {
      fi_cancel(&o_.ep->fid, &op->ctx);  // completes it with FI_ECANCELED unless matched
    } else {
      unposted.push_back(op);
    }
  });
  for (DirectOp* op : unposted) {
    // Never posted (waiting behind -FI_EAGAIN): withdrawn here.
    pending_direct_.erase(std::remove(pending_direct_.begin(), pending_direct_.end(), op),
                          pending_direct_.end());
    DirectDone(op, "cancelled", true);
  }
  AwaitOps(ids);
  ForLiveOps([&](DirectOp* op) {
    if (op->in == in) op->in = nullptr;  // still held by libfabric: detached
  });
  p->direct_in.erase(in->seq);
  delete in;
}

// Progresses (mu_ held) until none of the ops `ids` is left, or only ops
// with failed peers are (a dead peer finishes nothing it started, and reads
// or writes nothing more: its ops are abandoned to the endpoint's close), or
// kCancelWaitSeconds passed. Returns whether all completed.
bool FabricEndpoint::Impl::AwaitOps(const std::vector<uint64_t>& ids) {
  const auto until = std::chrono::steady_clock::now() +
                     std::chrono::duration<double>(kCancelWaitSeconds);
  for (;;) {
    size_t left = 0, live_peer = 0;
    ForLiveOps([&](DirectOp* op) {
      if (std::find(ids.begin(), ids.end(), op->id) == ids.end()) return;
      ++left;
      live_peer += op->peer->failure.empty();
    });
    if (left == 0) return true;
    if (live_peer == 0 || std::chrono::steady_clock::now() > until) return false;
    Poll();
    ::usleep(20);
  }
}

// ---------------------------------------------------------------------------
// The Link handed to algorithms.

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

Status FabricEndpoint::Connect(const std::string& peer_address, const std::string& peer_name,
                               std::unique_ptr<Link>* out) {
  Peer* p = nullptr;
  SMDDP_RETURN_IF_ERROR(impl_->Connect(peer_address, peer_name, &p));
  out->reset(new FabricLink(impl_, p));
  return Status::Ok();
}

#endif  // SMDDP_HAVE_LIBFABRIC

}  // namespace smddp

// What the files of the libfabric links (fabric_link.h) share, private to
// xla_ffi/transports/fabric_*.cc: the endpoint (FabricEndpoint::Impl), its
// peers, buffers and direct operations. Its methods are defined by concept:
// opening, closing and connecting (fabric_endpoint.cc), requests and the
// eager chunk protocol (fabric_eager.cc), direct transfers (fabric_direct.cc);
// the Link over it in fabric_link.cc, and the build without libfabric's
// headers in fabric_link_stub.cc.
#ifndef JAX_SMDDP_TRANSPORTS_FABRIC_LINK_IMPL_H_
#define JAX_SMDDP_TRANSPORTS_FABRIC_LINK_IMPL_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "xla_ffi/common/status.h"
#include "xla_ffi/transports/fabric_api.h"  // defines SMDDP_HAVE_LIBFABRIC where the headers are
#include "xla_ffi/transports/fabric_link.h"
#include "xla_ffi/transports/fabric_wire.h"

namespace smddp {
namespace fabric {

// The provider when none is named and efa is not found (ChooseFabricProvider).
constexpr char kDefaultProvider[] = "tcp;ofi_rxm";

}  // namespace fabric
}  // namespace smddp

#ifdef SMDDP_HAVE_LIBFABRIC

namespace smddp {
namespace fabric {

using Api = FabricApi;
inline const Api& GetApi() { return GetFabricApi(); }
inline uint32_t RequestedVersion(const Api& a) { return a.RequestedVersion(); }

// The chunk kinds and header of fabric_wire.h.
constexpr uint32_t kData = kFabricData;
constexpr uint32_t kAbort = kFabricAbort;
constexpr uint32_t kRts = kFabricRts;
constexpr uint32_t kCts = kFabricCts;
using ChunkHeader = FabricChunkHeader;
constexpr size_t kHeaderBytes = kFabricHeaderBytes;

constexpr uint64_t kMaxSeqAhead = 1ull << 24;         // messages in flight, per channel
constexpr uint64_t kMaxUnexpectedBytes = 1ull << 38;  // one buffered message
constexpr size_t kMaxPeers = 1 << 16;
// Direct transfers move in tagged pieces of at most this many bytes (and the
// provider's max_msg_size): both ends cut a message the same way.
constexpr uint64_t kDirectPiece = 4ull << 20;
constexpr uint64_t kMaxDirectPieces = 1ull << 16;
// How long a cancelled direct transfer may wait for libfabric to give back a
// buffer it is already writing or reading.
constexpr double kCancelWaitSeconds = 30.0;
// A cancel still waiting after this long says so (AwaitOps).
constexpr double kCancelWarnSeconds = 2.0;

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
  uint64_t seq = 0;  // its message's sequence number (SendAnnounced finds it by this)
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
  uint64_t id = 0;              // unique: what a waiter looks for (addresses get reused)
  struct fid_mr* mr = nullptr;  // where the provider wants buffers registered
  void* desc = nullptr;
  bool posted = false;            // handed to libfabric, completion not yet read
  SendTrack* track = nullptr;     // sends
  DirectIn* in = nullptr;         // receives into a caller's buffer
  std::unique_ptr<char[]> drain;  // drain receives
};

// A bound direct message whose pieces are posted into a Recv's buffer.
struct DirectIn {
  Request* req = nullptr;  // null once cancelled
  uint64_t seq = 0;
  uint64_t tag = 0;
  bool cancelling = false;  // a canceller owns it now
  bool drain = false;       // withdrawn pieces are reposted into drain buffers
  uint64_t pending = 0;     // pieces not yet completed
  std::string error;
};

// A direct message whose header went out, waiting for the receiver's kCts;
// an announced one (Announce) also for its bytes: `src` null until
// SendAnnounced, `cleared` once a kCts came first.
struct DirectOut {
  SendTrack* track;
  const char* src;
  uint64_t tag;
  uint64_t total;
  bool cleared = false;
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
  bool direct = false;     // announced by kRts: its bytes come as tagged pieces once bound
  bool discard = false;    // consumed by a failed or cancelled Recv: drop its bytes
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
  std::function<std::string()> watch;  // Link::WatchPeer's: AwaitOps asks it while it waits
  // Sending.
  uint64_t next_send_seq = 0;
  std::deque<OutMsg> sendq;                              // not yet all copied
  std::unordered_map<Request*, SendTrack*> sending;      // posted, not yet complete
  std::unordered_map<uint64_t, DirectOut> awaiting_cts;  // by seq
  // Receiving.
  uint64_t cursor = 0;  // next sequence number to pass
  std::map<uint64_t, InMsg> incoming;
  std::unordered_map<uint64_t, std::deque<PostedRecv>> posted;
  std::unordered_map<uint64_t, std::deque<uint64_t>> unexpected;  // passed, unbound seqs
  std::unordered_map<uint64_t, DirectIn*> direct_in;              // bound direct messages, by seq
  std::atomic<uint64_t> direct_received{0};                       // bytes, for traffic()
};

inline std::string TagText(uint64_t tag) { return "message tag " + std::to_string(tag); }

}  // namespace fabric

// The endpoint's files use these names unqualified.
using fabric::Api;
using fabric::ChunkHeader;
using fabric::DirectIn;
using fabric::DirectOp;
using fabric::DirectOut;
using fabric::GetApi;
using fabric::InMsg;
using fabric::kAbort;
using fabric::kCancelWaitSeconds;
using fabric::kCancelWarnSeconds;
using fabric::kCts;
using fabric::kData;
using fabric::kDefaultProvider;
using fabric::kDirectPiece;
using fabric::kHeaderBytes;
using fabric::kMaxDirectPieces;
using fabric::kMaxPeers;
using fabric::kMaxSeqAhead;
using fabric::kMaxUnexpectedBytes;
using fabric::kRts;
using fabric::OutMsg;
using fabric::Peer;
using fabric::PostedRecv;
using fabric::RequestedVersion;
using fabric::SendTrack;
using fabric::Slot;
using fabric::TagText;

class FabricEndpoint::Impl {
 public:
  explicit Impl(const Api& api) : api_(api) {}
  ~Impl();
  Status Init(const std::string& provider, const std::string& node);
  Status Connect(const std::string& address, const std::string& name, Peer** out);

  void Send(Peer* p, uint64_t tag, const void* src, size_t bytes, Request* req);
  void Recv(Peer* p, uint64_t tag, void* dst, size_t bytes, Request* req);
  // Link::Announce / SendAnnounced: a direct send whose kRts goes out now and
  // whose pieces are posted once both the kCts and its bytes are here.
  bool Announce(Peer* p, uint64_t tag, size_t bytes, Request* req);
  void SendAnnounced(Peer* p, Request* req, const void* src);
  void Progress();
  // Link::Activity / AwaitActivity: changes when a Poll handled completions
  // (after handling them: a waiter that read it while another thread polls
  // either sees it change or finds its request done); a waiter sleeps on the
  // completion queue's descriptor where there is one, and on kick_fd_.
  uint32_t Activity() const { return activity_.load(std::memory_order_acquire); }
  void AwaitActivity(uint32_t seen, unsigned max_us);
  // "fd" when waiters sleep on the completion queue's descriptor, else "sleep".
  const char* wait_kind() const { return o_.wait_fd >= 0 ? "fd" : "sleep"; }
  size_t DrainBytes();  // FabricEndpoint::DrainBytes
  void Cancel(Peer* p, Request* req);
  std::string Failure(Peer* p);
  StatusCode FailureCode(Peer* p);
  void SetWatch(Peer* p, std::function<std::string()> watch);

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
  bool GoesDirect(uint64_t bytes) const {
    return direct_min_ != 0 && bytes >= direct_min_ && FitsDirect(bytes);
  }
  // A Send's (or Announce's) track, or null once `req` failed at once on a
  // failed link; mu_ held.
  SendTrack* StartTrack(Peer* p, uint64_t tag, Request* req);
  // Queues a direct message's kRts (Send, Announce); `src` null: announced.
  void StartDirect(Peer* p, SendTrack* t, const char* src, uint64_t tag, uint64_t bytes);
  uint64_t PieceTag(uint64_t seq, uint64_t piece) const { return (seq << 16) | piece; }
  uint64_t PieceSeq(uint64_t ftag) const { return ftag >> 16; }
  DirectOp* NewOp(Peer* p, bool recv, char* buf, uint64_t bytes, uint64_t ftag);
  DirectOp* OpOf(void* context);
  void DeleteOp(DirectOp* op);
  template <typename F>
  void ForLiveOps(F f) {
    for (auto& op : op_pool_) {
      if (op->live) f(op.get());
    }
  }
  // Withdraws the receive ops `match` picks: posted ones are cancelled (FI_ECANCELED
  // completes them unless matched), ones never posted (behind -FI_EAGAIN) are done here,
  // as cancelled. Returns the ids of those it cancelled in libfabric.
  template <typename F>
  std::vector<uint64_t> WithdrawOps(F match) {
    std::vector<uint64_t> ids;
    std::vector<DirectOp*> unposted;
    ForLiveOps([&](DirectOp* op) {
      if (!match(op)) return;
      if (op->posted) {
        ids.push_back(op->id);
        fi_cancel(&o_.ep->fid, &op->ctx);
      } else {
        unposted.push_back(op);
      }
    });
    for (DirectOp* op : unposted) {
      pending_direct_.erase(std::remove(pending_direct_.begin(), pending_direct_.end(), op),
                            pending_direct_.end());
      DirectDone(op, "cancelled", true);
    }
    return ids;
  }
  void PostDirect(DirectOp* op);
  void PostPieces(Peer* p, char* buf, uint64_t total, uint64_t seq, SendTrack* t, DirectIn* in);
  void FlushDirect();
  void DirectDone(DirectOp* op, const std::string& error, bool cancelled);
  void FinishDirectIn(Peer* p, DirectIn* in);
  void BindDirect(Peer* p, uint64_t seq, const InMsg& m, const PostedRecv& r);
  void StartDirectSend(Peer* p, uint64_t seq);
  void StartClearedSends();
  void QueueControl(Peer* p, uint32_t kind, uint64_t seq, uint64_t tag, uint64_t total,
                    uint64_t offset);
  void CancelDirectIn(Peer* p, DirectIn* in, bool drain);
  bool AwaitOps(const std::vector<uint64_t>& ids);
  // Asks `p`'s watch (Link::WatchPeer), if any, whether it is gone, unless it is known to
  // be; marks it failed if so. Cancels ask first (a dead peer finishes nothing: nothing
  // waits on it, no drain is posted for it) and AwaitOps while it waits (mu_ held).
  void AskWatch(Peer* p) {
    if (p->failure.empty() && p->watch) p->failure = p->watch();
  }
  // Drain receives (a cancelled receive's withdrawn pieces, reposted) complete only while
  // this endpoint progresses: the drainer thread progresses it until none of a live peer
  // is left (or kCancelWaitSeconds passed), so that the sender's cancel does not wait on
  // a process that left its failed call. KeepDraining (mu_ held) starts it.
  void KeepDraining();
  void Drain();
  // Drains of message `seq` from `p` whose sender will post no pieces (its abort came):
  // withdrawn, their buffers freed.
  void WithdrawDrains(Peer* p, uint64_t seq);
  // Poll handled completions: counts it in activity_ and wakes the sleepers.
  void Signal();

  const Api& api_;
  std::mutex mu_;
  std::atomic<uint32_t> activity_{0};
  // Waiters asleep in AwaitActivity, and an eventfd (semaphore mode) that Signal writes one
  // count per sleeper to: a Poll of another thread (a concurrent call, the drainer) may read
  // the completions the sleeper's descriptor announced, and its own with them.
  std::atomic<int> sleepers_{0};
  int kick_fd_ = -1;
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
  std::vector<Slot> slots_;  // never resized after Init
  std::vector<int> free_send_;
  std::deque<int> pending_send_;           // filled, to post (fi_send said -FI_EAGAIN)
  std::deque<int> pending_recv_;           // to (re)post
  std::unordered_set<SendTrack*> tracks_;  // owned

  std::unordered_map<uint64_t, std::unique_ptr<Peer>> peers_;
  std::vector<Peer*> peer_list_;
  size_t rr_ = 0;
  std::string endpoint_error_;  // a CQ error or a chunk no peer can be blamed for
  StatusCode endpoint_error_code_ = StatusCode::kPeerFailed;
  uint32_t version_ =
      0;                 // WireProtocolVersion(): written into every chunk, required of every chunk
  std::string corrupt_;  // tests: how every chunk sent is malformed (JAX_SMDDP_FABRIC_TEST_CORRUPT)
  uint64_t shuffle_ = 0;  // tests: nonzero = post send chunks out of order (xorshift state)

  bool tagged_ = false;      // direct transfers can be received
  uint64_t direct_min_ = 0;  // 0: this process sends none
  std::string direct_state_;
  uint64_t piece_bytes_ = 1;  // kDirectPiece, or less where the provider's messages are shorter
  bool register_buffers_ = false;                   // FI_MR_LOCAL (or the test setting)
  std::vector<std::unique_ptr<DirectOp>> op_pool_;  // every op made, live or free
  std::vector<DirectOp*> free_ops_;
  uint64_t next_op_id_ = 1;
  std::deque<DirectOp*> pending_direct_;  // to post (-FI_EAGAIN)
  // Direct sends whose kCts came in this round of Poll: their pieces are
  // posted once the round's own control chunks went out (StartClearedSends).
  std::vector<std::pair<Peer*, uint64_t>> cleared_;
  std::thread drainer_;
  bool draining_ = false;  // mu_: the drainer runs
  std::atomic<bool> closing_{false};
};

}  // namespace smddp

#endif  // SMDDP_HAVE_LIBFABRIC

#endif  // JAX_SMDDP_TRANSPORTS_FABRIC_LINK_IMPL_H_

// The libfabric links' direct transfers (fabric_link.h).
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
// ones into drain buffers so that the sender's pieces still complete (a
// thread of the endpoint, the drainer, progresses it while drains are left:
// the process may have left its failed call, and progress is manual); a
// cancelled send whose pieces are posted waits for them (the receiver's are
// posted, so they complete unless the peer dies: the providers here report
// no dead peer, so these waits ask the link's watch, Link::WatchPeer).
// Drains of a message whose sender then aborts (it posted no pieces: both
// sides cancelled) are withdrawn when its abort arrives.
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
      DirectDone(op,
                 "libfabric (" + provider_ + ") cannot register " + std::to_string(op->bytes) +
                     " bytes for a direct transfer with " + op->peer->name + ": " + api_.Err(ret),
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
    ssize_t ret =
        op->recv ? fi_trecv(o_.ep, op->buf, op->bytes, op->desc, p->addr, op->ftag, 0, &op->ctx)
                 : fi_tsend(o_.ep, op->buf, op->bytes, op->desc, p->addr, op->ftag, &op->ctx);
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
      KeepDraining();
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
    r.req->Complete(Status::Mismatch(TagText(m.tag) + " from " + p->name + " has " +
                                     std::to_string(m.total) + " bytes but the receive expects " +
                                     std::to_string(r.bytes) +
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
    r.req->Complete(
        Status::Error("cannot receive " + TagText(m.tag) + " from " + p->name + ": not connected"));
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
  if (a->second.src == nullptr) {  // announced, its bytes not handed over yet
    a->second.cleared = true;
    return;
  }
  DirectOut out = a->second;
  p->awaiting_cts.erase(a);
  // Not `copied` until every piece is posted: a failed post cannot retire it early.
  PostPieces(p, const_cast<char*>(out.src), out.total, seq, out.track, nullptr);
  out.track->copied = true;
  Retire(out.track);
}

// Posts the pieces of the direct sends cleared in this Poll, once the
// completion queue is drained and the control chunks it called for (Pump,
// FlushSends) were handed to libfabric: on
// a stream transport (tcp;ofi_rxm) a control chunk posted after a message's
// bytes reaches the peer only after them, and a kCts that waits there holds
// the peer's own bytes back by that long (every other call of a bidirectional
// exchange ran at half the link's rate).
void FabricEndpoint::Impl::StartClearedSends() {
  if (cleared_.empty()) return;
  std::vector<std::pair<Peer*, uint64_t>> cleared;
  cleared.swap(cleared_);
  for (auto& [p, seq] : cleared) {
    if (p->awaiting_cts.count(seq)) StartDirectSend(p, seq);
  }
  FlushDirect();
}

// Cuts a direct message into its tagged pieces (the same cut on both ends)
// and posts each, counted in the send's track `t` or the receive `in`.
void FabricEndpoint::Impl::PostPieces(Peer* p, char* buf, uint64_t total, uint64_t seq,
                                      SendTrack* t, DirectIn* in) {
  for (uint64_t off = 0, i = 0; off < total; off += piece_bytes_, ++i) {
    DirectOp* op =
        NewOp(p, in != nullptr, buf + off, std::min(piece_bytes_, total - off), PieceTag(seq, i));
    op->track = t;
    op->in = in;
    if (t) ++t->inflight;
    if (in) ++in->pending;
    PostDirect(op);
  }
}

void FabricEndpoint::Impl::QueueControl(Peer* p, uint32_t kind, uint64_t seq, uint64_t tag,
                                        uint64_t total, uint64_t offset) {
  // A control chunk never waits behind bulk chunks; a kCts goes after the
  // kRts queued at the front (see Send).
  auto at = p->sendq.begin();
  if (kind == kCts) {
    while (at != p->sendq.end() && at->kind == kRts) ++at;
  }
  p->sendq.insert(at, OutMsg{nullptr, nullptr, kind, tag, total, seq, offset});
}

// Withdraws a bound direct message's pieces: none writes into the caller's
// buffer once this returns (short of kCancelWaitSeconds spent waiting on one
// libfabric already writes into). With `drain`, withdrawn pieces are reposted
// into buffers of their own, so that the sender's posted pieces complete.
void FabricEndpoint::Impl::CancelDirectIn(Peer* p, DirectIn* in, bool drain) {
  in->cancelling = true;
  in->drain = drain;
  AwaitOps(WithdrawOps([in](const DirectOp* op) { return op->in == in; }));
  ForLiveOps([&](DirectOp* op) {
    if (op->in == in) op->in = nullptr;  // still held by libfabric: detached
  });
  p->direct_in.erase(in->seq);
  delete in;
}

// Progresses (mu_ held) until none of the ops `ids` is left, or only ops
// with failed peers are (a dead peer finishes nothing it started, and reads
// or writes nothing more: its ops are abandoned to the endpoint's close), or
// kCancelWaitSeconds passed. Returns whether all completed. A peer that dies
// during the wait is seen through its watch (Link::WatchPeer), asked every
// kWatchEvery: the providers here report no dead peer, and a survivor's
// cancel waited out kCancelWaitSeconds on one that exited mid-wait. A wait past
// kCancelWarnSeconds says so on stderr, once: the process is stuck outside any
// call's deadline, on a peer that does not finish what it matched.
bool FabricEndpoint::Impl::AwaitOps(const std::vector<uint64_t>& ids) {
  constexpr auto kWatchEvery = std::chrono::milliseconds(2);
  const auto start = std::chrono::steady_clock::now();
  const auto until = start + std::chrono::duration<double>(kCancelWaitSeconds);
  const auto warn_at = start + std::chrono::duration<double>(kCancelWarnSeconds);
  auto watch_at = start;
  bool warned = false;
  std::vector<Peer*> watched;
  for (;;) {
    const auto now = std::chrono::steady_clock::now();
    const bool watch = now >= watch_at;
    if (watch) watch_at = now + kWatchEvery;
    watched.clear();
    size_t left = 0, live_peer = 0;
    ForLiveOps([&](DirectOp* op) {
      if (std::find(ids.begin(), ids.end(), op->id) == ids.end()) return;
      ++left;
      Peer* p = op->peer;
      if (watch && std::find(watched.begin(), watched.end(), p) == watched.end()) {
        watched.push_back(p);
        AskWatch(p);
      }
      live_peer += p->failure.empty();
    });
    if (left == 0) return true;
    if (live_peer == 0 || now > until) return false;
    if (!warned && now > warn_at) {
      warned = true;
      size_t sends = 0;
      std::string peers;
      ForLiveOps([&](DirectOp* op) {
        if (std::find(ids.begin(), ids.end(), op->id) == ids.end()) return;
        if (!op->peer->failure.empty()) return;
        sends += !op->recv;
        if (peers.find(op->peer->name) == std::string::npos)
          peers += (peers.empty() ? "" : ", ") + op->peer->name;
      });
      std::fprintf(stderr,
                   "jax_smddp: a cancelled libfabric transfer still waits, after %.0f s, for %zu "
                   "direct pieces (%zu sends) with %s to finish before libfabric lets go of the "
                   "buffer (at most %.0f s)\n",
                   kCancelWarnSeconds, live_peer, sends, peers.c_str(), kCancelWaitSeconds);
    }
    Poll();
    ::usleep(20);
  }
}

void FabricEndpoint::Impl::WithdrawDrains(Peer* p, uint64_t seq) {
  // Their FI_ECANCELED completions free them (DirectDone); nothing waits for those.
  WithdrawOps(
      [&](const DirectOp* op) { return op->drain && op->peer == p && PieceSeq(op->ftag) == seq; });
}

size_t FabricEndpoint::Impl::DrainBytes() {
  std::lock_guard<std::mutex> lock(mu_);
  size_t bytes = 0;
  ForLiveOps([&](DirectOp* op) { bytes += op->drain ? op->bytes : 0; });
  return bytes;
}

void FabricEndpoint::Impl::KeepDraining() {
  if (draining_) return;
  // A drainer that finished cleared draining_ holding mu_, which this caller holds now: it is
  // past its last use of the endpoint.
  if (drainer_.joinable()) drainer_.join();
  draining_ = true;
  drainer_ = std::thread([this] { Drain(); });
}

void FabricEndpoint::Impl::Drain() {
  const auto until =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(kCancelWaitSeconds);
  while (!closing_.load(std::memory_order_acquire)) {
    ::usleep(1000);
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (!lock.owns_lock()) continue;  // a caller is progressing it
    bool left = false;
    ForLiveOps([&](DirectOp* op) { left |= op->drain != nullptr && op->peer->failure.empty(); });
    if (!left || std::chrono::steady_clock::now() > until) {
      draining_ = false;  // under mu_: a drain posted from now on starts a new drainer
      return;
    }
    Poll();
  }
}

}  // namespace smddp

#endif  // SMDDP_HAVE_LIBFABRIC

// The libfabric links' requests and eager chunk protocol (fabric_link.h).
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

// ---------------------------------------------------------------------------
// Posting.

void FabricEndpoint::Impl::Send(Peer* p, uint64_t tag, const void* src, size_t bytes,
                                Request* req) {
  std::lock_guard<std::mutex> lock(mu_);
  SendTrack* t = StartTrack(p, tag, req);
  if (t == nullptr) return;
  if (GoesDirect(bytes)) {
    StartDirect(p, t, static_cast<const char*>(src), tag, bytes);
  } else {
    t->seq = p->next_send_seq++;
    p->sendq.push_back(OutMsg{t, static_cast<const char*>(src), kData, tag, bytes, t->seq, 0});
  }
  Pump();
  FlushSends();
}

SendTrack* FabricEndpoint::Impl::StartTrack(Peer* p, uint64_t tag, Request* req) {
  req->Reset();
  if (!p->failure.empty()) {
    req->Complete(
        FailedOn(p, "cannot send " + TagText(tag) + " to " + p->name + ": " + p->failure));
    return nullptr;
  }
  SendTrack* t = new SendTrack{req, p, 0, false, std::string()};
  tracks_.insert(t);
  p->sending[req] = t;
  return t;
}

void FabricEndpoint::Impl::StartDirect(Peer* p, SendTrack* t, const char* src, uint64_t tag,
                                       uint64_t bytes) {
  const uint64_t seq = t->seq = p->next_send_seq++;
  p->awaiting_cts[seq] = DirectOut{t, src, tag, bytes};
  // Ahead of everything queued (the receiver passes messages in sequence
  // order whatever order they arrive in): the peer learns of it before it
  // reads this process's kCts and posts its own bytes (StartClearedSends).
  p->sendq.push_front(OutMsg{t, src, kRts, tag, bytes, seq, 0});
}

bool FabricEndpoint::Impl::Announce(Peer* p, uint64_t tag, size_t bytes, Request* req) {
  // Only a direct message has a handshake to start; a chunked one announced
  // early would hold back every later message of the channel (the receiver
  // passes them in sequence order) until its bytes came.
  if (!GoesDirect(bytes)) return false;
  std::lock_guard<std::mutex> lock(mu_);
  SendTrack* t = StartTrack(p, tag, req);
  if (t == nullptr) return true;  // failed at once, as a Send would
  StartDirect(p, t, nullptr, tag, bytes);
  Pump();
  FlushSends();
  return true;
}

void FabricEndpoint::Impl::SendAnnounced(Peer* p, Request* req, const void* src) {
  std::lock_guard<std::mutex> lock(mu_);
  auto st = p->sending.find(req);
  if (st == p->sending.end()) return;  // done already: refused, failed or cancelled
  const uint64_t seq = st->second->seq;
  auto a = p->awaiting_cts.find(seq);
  if (a == p->awaiting_cts.end()) return;  // cancelled: its abort went out
  a->second.src = static_cast<const char*>(src);
  if (a->second.cleared) {
    StartDirectSend(p, seq);
    FlushDirect();
  }
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
      // A direct message's kCts waits for the next Progress (or Send): a
      // Send posted right after this Recv puts its kRts ahead of it, so the
      // peer reads of this process's message before it may post its own
      // bytes (StartClearedSends).
      Bind(p, it, r);
      return;
    }
  }
  if (!p->failure.empty()) {
    req->Complete(
        FailedOn(p, "cannot receive " + TagText(tag) + " from " + p->name + ": " + p->failure));
    return;
  }
  p->posted[tag].push_back(r);
}

void FabricEndpoint::Impl::Cancel(Peer* p, Request* req) {
  std::lock_guard<std::mutex> lock(mu_);
  if (req->done()) return;
  AskWatch(p);
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
        p->sendq.push_front(
            OutMsg{nullptr, nullptr, kAbort, a->second.tag, a->second.total, a->first, 0});
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

void FabricEndpoint::Impl::SetWatch(Peer* p, std::function<std::string()> watch) {
  std::lock_guard<std::mutex> lock(mu_);
  p->watch = std::move(watch);
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

void FabricEndpoint::Impl::AwaitActivity(uint32_t seen, unsigned max_us) {
  if (o_.wait_fd < 0) {
    ::usleep(max_us);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Something happened since the waiter looked, or this process has sends
    // or receives to retry (they need progress, not an arrival): no sleep.
    if (activity_.load(std::memory_order_acquire) != seen || !pending_send_.empty() ||
        !pending_recv_.empty() || !pending_direct_.empty() || !MaySleep(o_))
      return;
    sleepers_.fetch_add(1, std::memory_order_acq_rel);  // before mu_ is released: Signal sees it
  }
  SleepOnCompletions(o_, kick_fd_, max_us);
  sleepers_.fetch_sub(1, std::memory_order_acq_rel);
}

void FabricEndpoint::Impl::Signal() {
  activity_.fetch_add(1, std::memory_order_acq_rel);
  const int sleepers = sleepers_.load(std::memory_order_acquire);
  if (sleepers > 0 && kick_fd_ >= 0) {
    const uint64_t count = uint64_t(sleepers);
    (void)!::write(kick_fd_, &count, sizeof(count));
  }
}

void FabricEndpoint::Impl::Poll() {
  bool active = false;
  for (int round = 0; round < 16; ++round) {
    struct fi_cq_msg_entry entries[16];
    ssize_t n = fi_cq_read(o_.cq, entries, 16);
    active |= n > 0 || n == -FI_EAVAIL;
    if (n == -FI_EAVAIL) {
      ReadError();
    } else if (n < 0 && n != -FI_EAGAIN) {
      endpoint_error_ =
          "libfabric (" + provider_ + ") fi_cq_read failed: " + api_.Err(static_cast<int>(n));
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
  StartClearedSends();
  if (active) Signal();
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
  DropChunk(p,
            "protocol error from " + (p ? p->name : std::string("an unknown peer")) + ": " + what);
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
    WithdrawDrains(p, h.seq);  // its sender posts none of its pieces
    auto d = p->direct_in.find(h.seq);
    if (d != p->direct_in.end()) {
      // Cancelled after this side posted its pieces: it will send none.
      DirectIn* in = d->second;
      if (in->req != nullptr) {
        in->req->Complete(Status::PeerFailed(p->name + " cancelled sending " + TagText(in->tag) +
                                             " before any of its bytes went out"));
        in->req = nullptr;
      }
      if (in->cancelling) {
        // This side's cancel owns it (read while it withdraws the pieces, up
        // the stack): it deletes it; none of the sender's pieces will come.
        in->drain = false;
        return;
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
      ProtocolError(
          p, "a clear-to-send for message " + std::to_string(h.seq) + " with another tag or size");
      return;
    }
    if (h.offset == 1) {
      // Not yet: a kCts this round answers (a peer's kRts read in the same
      // round) must go out ahead of this message's bytes, or it waits behind
      // them on the wire and the peer's bytes follow ours instead of flowing
      // alongside (StartClearedSends).
      cleared_.emplace_back(p, h.seq);
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
  } else if (it->second.tag != h.tag || it->second.total != h.total || h.kind == kRts ||
             (h.kind == kData && it->second.direct)) {
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
      req->Complete(Status::PeerFailed(p->name + " cancelled sending " + TagText(m.tag) +
                                       " after " + std::to_string(h.offset) + " of " +
                                       std::to_string(m.total) + " bytes"));
    }
  } else {
    if (h.len > m.limit - m.received) {
      ProtocolError(p, TagText(h.tag) + ": more bytes than announced");
      return;
    }
    // Its turn has come: bound first (its Recv is usually posted), its bytes go straight to the
    // Recv, not through the heap and a second copy. (h.len > 0: Advance then cannot retire it.)
    if (!m.passed && h.seq == p->cursor && h.len > 0) Advance(p);
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
    r.req->Complete(Status::Mismatch(TagText(m.tag) + " from " + p->name + " has " +
                                     std::to_string(m.total) + " bytes but the receive expects " +
                                     std::to_string(r.bytes) +
                                     " (do the processes run the same program?)"));
  } else if (m.aborted) {
    m.discard = true;
    r.req->Complete(Status::PeerFailed(p->name + " cancelled sending " + TagText(m.tag) +
                                       " after " + std::to_string(m.limit) + " of " +
                                       std::to_string(m.total) + " bytes"));
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

}  // namespace smddp

#endif  // SMDDP_HAVE_LIBFABRIC

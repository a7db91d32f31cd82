// A link: the channel from this process to one peer process, over which the
// cross-process algorithms move data. Implemented over POSIX shared memory
// (peers on the same host, shm_link.h) and libfabric (peers on other hosts,
// fabric_link.h); the algorithms see only this interface.
//
// Messages are tagged: a receive matches the send with the same tag, whatever
// the order in which the two were posted or the bytes arrived. Both calls only
// post the transfer; the link moves data when a waiting thread calls
// Progress() (there is no progress thread: waiting callers drive it). Several
// threads may use one link at once (concurrent collectives).
#ifndef JAX_SMDDP_TRANSPORTS_LINK_H_
#define JAX_SMDDP_TRANSPORTS_LINK_H_

#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "xla_ffi/common/status.h"

namespace smddp {

// One posted transfer. Owned by the caller, who keeps it alive (and its
// buffer valid) until it is done or cancelled.
class Request {
 public:
  bool done() const { return done_.load(std::memory_order_acquire); }
  // Valid once done().
  const Status& status() const { return status_; }
  // Called by the link, once.
  void Complete(Status status) {
    status_ = std::move(status);
    done_.store(true, std::memory_order_release);
  }
  void Reset() {
    done_.store(false, std::memory_order_relaxed);
    status_ = Status::Ok();
  }

 private:
  std::atomic<bool> done_{false};
  Status status_;
};

class Link {
 public:
  virtual ~Link() = default;

  // Posts sending `bytes` of `src` as message `tag`. `req` completes once
  // `src` is no longer needed (the bytes were copied out or delivered).
  virtual void Send(uint64_t tag, const void* src, size_t bytes, Request* req) = 0;

  // Posts receiving message `tag` into `dst`. `req` completes once all bytes
  // are in `dst`; it fails if the message that arrives under `tag` has any
  // other size (a peer running a different program).
  virtual void Recv(uint64_t tag, void* dst, size_t bytes, Request* req) = 0;

  // Announces a Send whose bytes are not ready yet (a result still being
  // computed): the link may start now what sending `bytes` as message `tag`
  // needs from the peer, so that the bytes move as soon as SendAnnounced
  // hands them over. On libfabric a direct transfer's announce and the
  // peer's clear-to-send then cross the network at the call's start, while
  // the links are quiet, instead of behind a link's worth of bulk bytes.
  // Returns false where the link has nothing to start (the caller then posts
  // an ordinary Send later). Once true, `req` is that send's: it completes as
  // Send's does, after SendAnnounced (or earlier where the peer refused the
  // message); Cancel withdraws it.
  virtual bool Announce(uint64_t /*tag*/, size_t /*bytes*/, Request* /*req*/) { return false; }
  // The bytes of an announced send (Announce returned true for `req`);
  // `src` stays valid until `req` completes.
  virtual void SendAnnounced(Request* /*req*/, const void* /*src*/) {}

  // Moves whatever data can move now without blocking. Thread-safe; returns
  // quickly when another thread is already progressing this link.
  virtual void Progress() = 0;

  // Links whose Progress() moves the same thing (one libfabric endpoint
  // serves every peer of a process) share a key: a caller that waits on
  // several links progresses each key once per round, not once per peer.
  virtual const void* ProgressKey() const { return this; }

  // Withdraws a request that is not done (after a timeout or a peer's
  // failure): once this returns, the link never touches the request or its
  // buffer again. A no-op for a request that is done.
  virtual void Cancel(Request* req) = 0;

  // Empty while the peer looks alive; otherwise why it is not (its process
  // exited, the connection closed). Cheap enough to call every few ms.
  virtual std::string PeerFailure() = 0;

  // The kind of that failure, once PeerFailure() is not empty: kPeerFailed
  // (the peer exited, its connection closed), or kProtocol (it sent a chunk
  // this process cannot parse: another jax_smddp build, or corruption).
  virtual StatusCode PeerFailureCode() { return StatusCode::kPeerFailed; }

  // Hands the link another watch of the peer (the engine's connection to it,
  // peer_watch.h), for the link's own waits that no caller watches: a
  // libfabric Cancel asks it first, and while it waits for direct pieces
  // already posted, and stops waiting on a peer that is gone. `failure`
  // returns why the peer is gone, or "" while it looks alive; cheap, called
  // from any thread under the link's lock. Null removes it.
  virtual void WatchPeer(std::function<std::string()> /*failure*/) {}

  // What carries this link, for messages: "shared memory",
  // "libfabric tcp;ofi_rxm".
  virtual std::string Kind() const = 0;

  // Waiting without burning a core: Activity() is a number that changes
  // whenever something a waiter on this link may need has happened (the peer
  // wrote into the link or made room in it, or another thread of this process
  // completed requests); AwaitActivity(seen, max_us) sleeps until it differs
  // from `seen` (read before the waiter's last Progress) or max_us passed.
  // Links without such a signal just sleep max_us.
  virtual uint32_t Activity() const { return 0; }
  virtual void AwaitActivity(uint32_t /*seen*/, unsigned max_us) { ::usleep(max_us); }
  // True where AwaitActivity sleeps on a descriptor that the transport
  // signals as soon as data arrives or room frees (libfabric's completion
  // queue), and where a poll costs system calls: a waiter gains nothing by
  // polling such a link and sleeps after a poll or two (wait_polls.h). On a
  // capped link between hosts, polling cost 3-4x gloo's CPU time per call.
  virtual bool SleepsOnArrival() const { return false; }
  // True where that descriptor is signalled by everything the link carries
  // (a striped link sleeps on one NIC's alone): a waiter that polls no other
  // link then needs no timed wake-up to keep the link moving, and sleeps long
  // (wait_polls.h, kOneDescriptorSleepUs).
  virtual bool SleepsOnEveryArrival() const { return SleepsOnArrival(); }

  // Bytes received from the peer without an intermediate copy (shared
  // memory: read in place from the peer's memory; libfabric: tagged straight
  // into the destination), and how that path stands: "on", "off: <why>", or
  // "" where the link has no such path.
  virtual uint64_t SingleCopyBytes() const { return 0; }
  virtual std::string SingleCopy() const { return ""; }
};

}  // namespace smddp

#endif  // JAX_SMDDP_TRANSPORTS_LINK_H_

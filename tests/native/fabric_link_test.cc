// Standalone test of FabricEndpoint / FabricLink (no jax): forks a child,
// both open an endpoint of the provider named in argv[1], exchange addresses
// through pipes, connect, and run the phases below in lockstep. Where the
// provider offers FI_HMEM (shm here), the same for FabricRail links over
// registered host memory. Exits 0 on success; prints GB/s for 64 MiB messages.
//
//   fabric_link_test <provider> [node]      e.g. "tcp;ofi_rxm" 127.0.0.1, or shm
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/native/check.h"
#include "tests/native/fabric_data.h"
#include "tests/native/fabric_farewell.h"
#include "tests/native/fabric_harness.h"
#include "tests/native/fabric_regions.h"
#include "xla_ffi/common/settings.h"
#include "xla_ffi/transports/fabric_link.h"
#include "xla_ffi/transports/fabric_rail.h"
#include "xla_ffi/transports/peer_watch.h"

using smddp::FabricEndpoint;
using smddp::Link;
using smddp::Request;
using smddp::Status;
using Clock = std::chrono::steady_clock;
using fabric_data::AllBytes;
using fabric_data::Fill;
using fabric_data::Verify;
using fabric_harness::Barrier;
using fabric_harness::CheckOk;
using fabric_harness::g_rd;
using fabric_harness::g_wr;
using fabric_harness::Log;
using fabric_harness::ProgressFor;
using fabric_harness::ProgressUntil;
using fabric_harness::ReadAll;
using fabric_harness::Wait;
using fabric_harness::WriteAll;

namespace {

int g_watch_fd = -1;     // the parent's end of a connection the child's exit closes (WatchLink)
int g_farewell_fd = -1;  // this process's end of a second one (fabric_farewell.h)

// A message of `bytes` each way, tag `tag`, arrives whole after `what`: the
// link still works.
void StillFlows(Link* link, int me, uint64_t tag, size_t bytes, const char* what) {
  std::vector<char> out(bytes), in(bytes);
  Fill(out, tag, me);
  Request s, r;
  link->Send(tag, out.data(), out.size(), &s);
  link->Recv(tag, in.data(), in.size(), &r);
  Wait(link, {&s, &r}, 30, what);
  CheckOk(r, what);
  CHECK(Verify(in, tag, 1 - me) < 0, "wrong data %s", what);
}

const size_t kMiB = 1 << 20;

// Whether a message of `bytes` goes direct (tagged between the callers'
// buffers) rather than through bounce buffers.
bool Direct(Link* link, size_t bytes) {
  return link->SingleCopy() == "on" &&
         bytes >= size_t(smddp::IntSetting("JAX_SMDDP_FABRIC_DIRECT_BYTES"));
}

const std::vector<size_t> kSizes = {0, 1, 7, 4096, kMiB + 3, 64 * kMiB};

// Every size both ways at once. Receives posted before the peer sends
// (after_arrival = false), or after its data had time to arrive.
void ExchangeSizes(Link* link, int me, uint64_t tag0, bool after_arrival) {
  const int peer = 1 - me;
  size_t n = kSizes.size();
  std::vector<std::vector<char>> out(n), in(n);
  std::vector<Request> sreq(n), rreq(n);
  std::vector<Request*> all;
  for (size_t i = 0; i < n; ++i) {
    out[i].resize(kSizes[i]);
    Fill(out[i], tag0 + i, me);
    in[i].assign(kSizes[i], '\xEE');
  }
  auto post_recvs = [&] {
    for (size_t i = 0; i < n; ++i) {
      link->Recv(tag0 + i, in[i].data(), in[i].size(), &rreq[i]);
      all.push_back(&rreq[i]);
    }
  };
  if (!after_arrival) post_recvs();
  Barrier();
  auto t0 = Clock::now();
  for (size_t i = 0; i < n; ++i) {
    link->Send(tag0 + i, out[i].data(), out[i].size(), &sreq[i]);
    all.push_back(&sreq[i]);
  }
  const uint64_t direct_before = link->SingleCopyBytes();
  if (after_arrival) {
    // Messages through bounce buffers are sent whole before their receives
    // exist; a direct one waits for its receive (its bytes leave the
    // sender's buffer only for the receiver's).
    std::vector<Request*> sends;
    for (size_t i = 0; i < n; ++i) {
      if (!Direct(link, kSizes[i])) sends.push_back(&sreq[i]);
    }
    Wait(link, sends, 60, "sends before the receives");
    ProgressFor(link, 0.3);
    for (size_t i = 0; i < n; ++i) {
      CHECK(!Direct(link, kSizes[i]) || !sreq[i].done(),
            "a direct send of %zu bytes completed before its receive was posted", kSizes[i]);
    }
    Barrier();
    ProgressFor(link, 0.1);
    post_recvs();
  }
  Wait(link, all, 60,
       after_arrival ? "sizes, receives posted late" : "sizes, receives posted early");
  uint64_t direct_bytes = 0;
  for (size_t i = 0; i < n; ++i) direct_bytes += Direct(link, kSizes[i]) ? kSizes[i] : 0;
  CHECK(link->SingleCopyBytes() - direct_before == direct_bytes,
        "%llu bytes received direct, expected %llu (direct transfers: %s)",
        static_cast<unsigned long long>(link->SingleCopyBytes() - direct_before),
        static_cast<unsigned long long>(direct_bytes), link->SingleCopy().c_str());
  double s = std::chrono::duration<double>(Clock::now() - t0).count();
  for (size_t i = 0; i < n; ++i) {
    CheckOk(sreq[i], "send");
    CheckOk(rreq[i], "recv");
    long long bad = Verify(in[i], tag0 + i, peer);
    CHECK(bad < 0, "message of %zu bytes (tag %llu): wrong byte at offset %lld", kSizes[i],
          static_cast<unsigned long long>(tag0 + i), bad);
  }
  Log("sizes 0..64 MiB both ways, receives posted %s arrival: ok (%.3f s)",
      after_arrival ? "after" : "before", s);
}

// 8 tags sent in one order, received in another (half posted before the
// sends, half after); then one tag used twice: receives match in send order.
void TagOrder(Link* link, int me) {
  const int peer = 1 - me;
  const int order[8] = {5, 2, 7, 0, 3, 6, 1, 4};
  std::vector<std::vector<char>> out(8), in(8);
  std::vector<Request> sreq(8), rreq(8);
  std::vector<Request*> all;
  for (int k = 0; k < 8; ++k) {
    size_t bytes = 1000 * (k + 1) + k + (k == 6 ? 3 * kMiB : 0);
    out[k].resize(bytes);
    Fill(out[k], 300 + k, me);
    in[k].assign(bytes, '\xEE');
  }
  for (int j = 0; j < 4; ++j) {
    int k = order[j];
    link->Recv(300 + k, in[k].data(), in[k].size(), &rreq[k]);
  }
  Barrier();
  for (int k = 0; k < 8; ++k) link->Send(300 + k, out[k].data(), out[k].size(), &sreq[k]);
  ProgressFor(link, 0.05);
  for (int j = 4; j < 8; ++j) {
    int k = order[j];
    link->Recv(300 + k, in[k].data(), in[k].size(), &rreq[k]);
  }
  for (int k = 0; k < 8; ++k) {
    all.push_back(&sreq[k]);
    all.push_back(&rreq[k]);
  }
  // The same tag twice: the first receive gets the first message.
  std::vector<char> a(300), b(2 * kMiB + 5), ra(300, '\xEE'), rb(2 * kMiB + 5, '\xEE');
  Fill(a, 1310, me);
  Fill(b, 2310, me);
  Request sa, sb, qa, qb;
  link->Send(310, a.data(), a.size(), &sa);
  link->Send(310, b.data(), b.size(), &sb);
  link->Recv(310, ra.data(), ra.size(), &qa);
  link->Recv(310, rb.data(), rb.size(), &qb);
  all.insert(all.end(), {&sa, &sb, &qa, &qb});
  Wait(link, all, 60, "tag order");
  for (int k = 0; k < 8; ++k) {
    CheckOk(sreq[k], "send");
    CheckOk(rreq[k], "recv");
    CHECK(Verify(in[k], 300 + k, peer) < 0, "tag %d: wrong data", 300 + k);
  }
  CheckOk(qa, "first receive of a reused tag");
  CheckOk(qb, "second receive of a reused tag");
  CHECK(Verify(ra, 1310, peer) < 0 && Verify(rb, 2310, peer) < 0, "reused tag: wrong data");
  Log("8 tags received in another order, and a reused tag: ok");
}

// A receive of the wrong size fails with a message; the link still works.
void SizeMismatch(Link* link, int me) {
  std::vector<char> out(100), in(64, '\xEE');
  Fill(out, 400, me);
  Request s, r;
  link->Recv(400, in.data(), in.size(), &r);
  Barrier();
  link->Send(400, out.data(), out.size(), &s);
  Wait(link, {&s, &r}, 30, "size mismatch");
  CheckOk(s, "send of the mismatched message");
  CHECK(!r.status().ok(), "a 64-byte receive of a 100-byte message succeeded");
  const std::string& m = r.status().message();
  CHECK(m.find("100") != std::string::npos && m.find("64") != std::string::npos,
        "unclear size mismatch message: %s", m.c_str());
  CHECK(AllBytes(in, '\xEE'), "a failed receive wrote into its buffer");
  StillFlows(link, me, 401, 50, "after a size mismatch");
  Log("size mismatch: ok (\"%s\")", m.c_str());
}

void Cancels(Link* link, int me) {
  const int peer = 1 - me;
  // (a) A receive cancelled before its message arrives: the buffer stays
  // untouched and the message goes to the next receive of the tag.
  {
    std::vector<char> out(4096), in(4096, '\xEE'), in2(4096, '\xEE');
    Fill(out, 500, me);
    Request s, r, r2;
    link->Recv(500, in.data(), in.size(), &r);
    link->Cancel(&r);
    Barrier();
    link->Send(500, out.data(), out.size(), &s);
    // Through bounce buffers the send completes at once; a direct one only
    // once the next receive of the tag takes it.
    if (!Direct(link, out.size())) Wait(link, {&s}, 30, "send to a cancelled receive");
    ProgressFor(link, 0.3);
    CHECK(!r.done(), "a cancelled receive completed");
    CHECK(AllBytes(in, '\xEE'), "a cancelled receive's buffer was written");
    link->Recv(500, in2.data(), in2.size(), &r2);
    Wait(link, {&r2, &s}, 30, "receive after a cancelled one");
    CheckOk(s, "send to a cancelled receive");
    CheckOk(r2, "receive after a cancelled one");
    CHECK(Verify(in2, 500, peer) < 0, "wrong data after a cancelled receive");
  }
  Barrier();
  // (b) A receive cancelled while its 64 MiB arrive: nothing is written
  // after Cancel returns; later messages still flow.
  {
    std::vector<char> out(64 * kMiB), in(64 * kMiB, '\xEE');
    Fill(out, 501, me);
    Request s, r;
    link->Recv(501, in.data(), in.size(), &r);
    Barrier();
    link->Send(501, out.data(), out.size(), &s);
    for (int i = 0; i < 40 && !r.done(); ++i) link->Progress();
    link->Cancel(&r);
    bool was_done = r.done();
    if (!was_done) std::memset(in.data(), 0x5A, in.size());
    if (Direct(link, out.size())) {
      // A direct send completes if the peer's receive was cancelled after
      // its pieces were posted (they are drained); if it was cancelled
      // before the message reached it, nothing takes the message: cancel.
      if (!ProgressUntil(link, s, 1.0)) link->Cancel(&s);
    } else {
      Wait(link, {&s}, 60, "send of a message whose receive is cancelled");
    }
    ProgressFor(link, 0.3);
    if (was_done) {
      CheckOk(r, "receive that completed before its Cancel");
      CHECK(Verify(in, 501, peer) < 0, "wrong data");
    } else {
      CHECK(!r.done(), "a cancelled receive completed");
      CHECK(AllBytes(in, 0x5A), "the link wrote into a receive buffer after Cancel");
    }
    StillFlows(link, me, 502, 5000, "after a cancel mid-transfer");
    Log("cancel of a receive mid-transfer: ok (%s)",
        was_done ? "it had completed already" : "cancelled");
  }
  Barrier();
  // (c) A send cancelled before all its bytes went out: the receiver's
  // receive fails (or, if it all went out, gets the right bytes even though
  // the source is overwritten right after Cancel).
  {
    std::vector<char> out(64 * kMiB), in(64 * kMiB, '\xEE');
    Fill(out, 503, me);
    Request s, r;
    link->Recv(503, in.data(), in.size(), &r);
    Barrier();
    link->Send(503, out.data(), out.size(), &s);
    link->Cancel(&s);
    bool sent = s.done();
    std::memset(out.data(), 0x33, out.size());
    Wait(link, {&r}, 60, "receive of a cancelled send");
    if (r.status().ok()) {
      CHECK(Verify(in, 503, peer) < 0, "a cancelled send delivered wrong data");
    } else {
      CHECK(r.status().message().find("cancelled") != std::string::npos, "unclear: %s",
            r.status().message().c_str());
    }
    StillFlows(link, me, 504, 7, "after a cancelled send");
    Log("cancel of a send: ok (%s; the peer's receive: %s)",
        sent ? "it had been copied" : "cancelled",
        r.status().ok() ? "ok" : r.status().message().c_str());
  }
}

// Announced sends (Link::Announce): the handshake of a direct message goes
// out before its bytes exist; the bytes move once handed over, whether the
// peer's clear-to-send came first or not; later messages are not held back
// by an announced one; one cancelled before its bytes came fails the peer's
// receive; a message that does not go direct is not announced.
void Announced(Link* link, int me) {
  const int peer = 1 - me;
  const size_t big = 2 * kMiB + 64, small = 4096;
  Request probe;
  const bool probed = link->Announce(609, small, &probe);
  if (probed) link->Cancel(&probe);
  CHECK(probed == Direct(link, small),
        "Announce of %zu bytes returned %d where direct transfers are %s", small, int(probed),
        link->SingleCopy().c_str());
  if (!Direct(link, big)) {
    Request s;
    CHECK(!link->Announce(610, big, &s), "Announce returned true with direct transfers %s",
          link->SingleCopy().c_str());
    Log("announced sends: not announced (direct transfers %s)", link->SingleCopy().c_str());
    return;
  }
  // (a) Bytes handed over after the clear-to-send came, and (b) at once;
  // a small message sent after (a)'s announce arrives before (a)'s bytes.
  std::vector<char> out_a(big), out_b(big), out_c(small), in_a(big, '\xEE'), in_b(big, '\xEE'),
      in_c(small, '\xEE');
  Fill(out_a, 610, me);
  Fill(out_b, 611, me);
  Fill(out_c, 612, me);
  Request sa, sb, sc, ra, rb, rc;
  link->Recv(610, in_a.data(), in_a.size(), &ra);
  link->Recv(611, in_b.data(), in_b.size(), &rb);
  link->Recv(612, in_c.data(), in_c.size(), &rc);
  Barrier();
  CHECK(link->Announce(610, big, &sa), "a direct message of %zu bytes was not announced", big);
  link->Send(612, out_c.data(), out_c.size(), &sc);
  CHECK(link->Announce(611, big, &sb), "a direct message of %zu bytes was not announced", big);
  link->SendAnnounced(&sb, out_b.data());
  Wait(link, {&rc, &sc, &rb, &sb}, 30, "messages around an announced one");
  ProgressFor(link, 0.2);
  CHECK(!sa.done() && !ra.done(), "an announced send completed before its bytes were given");
  CHECK(AllBytes(in_a, '\xEE'), "an announced message's receive was written before its bytes came");
  Barrier();  // the peer checked its own before either hands its bytes over
  link->SendAnnounced(&sa, out_a.data());
  Wait(link, {&sa, &ra}, 30, "an announced send, bytes after the clear-to-send");
  for (auto* r : {&sa, &sb, &sc, &ra, &rb, &rc}) CheckOk(*r, "announced sends");
  CHECK(Verify(in_a, 610, peer) < 0, "wrong data: announced, bytes given late");
  CHECK(Verify(in_b, 611, peer) < 0, "wrong data: announced, bytes given at once");
  CHECK(Verify(in_c, 612, peer) < 0, "wrong data: sent after an announced message");
  Barrier();
  // (c) Cancelled before its bytes came: the peer's receive fails, saying so.
  std::vector<char> in_d(big, '\xEE');
  Request sd, rd;
  link->Recv(613, in_d.data(), in_d.size(), &rd);
  Barrier();
  CHECK(link->Announce(613, big, &sd), "not announced");
  ProgressFor(link, 0.1);
  link->Cancel(&sd);
  Wait(link, {&rd}, 30, "receive of a cancelled announced send");
  CHECK(!rd.status().ok() && rd.status().message().find("cancelled") != std::string::npos,
        "receive of a cancelled announced send: %s",
        rd.status().ok() ? "succeeded" : rd.status().message().c_str());
  CHECK(AllBytes(in_d, '\xEE'), "a cancelled announced send wrote into the peer's buffer");
  StillFlows(link, me, 614, 77, "after a cancelled announced send");
  Barrier();
  // (d) Both sides cancel at once (a call failing on both): the receiver's
  // cancel reads the sender's abort while it withdraws its posted pieces.
  std::vector<char> in_f(big, '\xEE');
  Request sf, rf;
  link->Recv(615, in_f.data(), in_f.size(), &rf);
  Barrier();
  CHECK(link->Announce(615, big, &sf), "not announced");
  ProgressFor(link, 0.2);  // the handshake: the receivers' pieces posted
  link->Cancel(&sf);
  Barrier();
  usleep(50000);  // the peer's abort is in (not read: nothing progresses)
  link->Cancel(&rf);
  CHECK(!rf.done() || !rf.status().ok(), "a receive cancelled before any bytes succeeded");
  CHECK(AllBytes(in_f, '\xEE'), "a receive cancelled on both sides was written");
  StillFlows(link, me, 616, 77, "after a transfer cancelled on both sides");
  Log("announced sends: ok (bytes late, at once, cancelled: \"%s\", on both sides)",
      rd.status().message().c_str());
}

// Several threads send, receive and progress the same link at once.
void Threads(Link* link, int me) {
  const int peer = 1 - me;
  const int kThreads = 4, kMsgs = 40;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([=] {
      std::vector<std::vector<char>> out(kMsgs), in(kMsgs);
      std::vector<Request> sreq(kMsgs), rreq(kMsgs);
      std::vector<Request*> all;
      for (int i = 0; i < kMsgs; ++i) {
        uint64_t tag = 1000 + 100 * t + i;
        size_t bytes = (static_cast<size_t>(i) * 7919 + t * 104729) % 600000;
        out[i].resize(bytes);
        Fill(out[i], tag, me);
        in[i].assign(bytes, '\xEE');
        if (i % 2) link->Recv(tag, in[i].data(), bytes, &rreq[i]);
        link->Send(tag, out[i].data(), bytes, &sreq[i]);
        if (i % 2 == 0) link->Recv(tag, in[i].data(), bytes, &rreq[i]);
        all.push_back(&sreq[i]);
        all.push_back(&rreq[i]);
      }
      Wait(link, all, 60, "threads");
      for (int i = 0; i < kMsgs; ++i) {
        CheckOk(sreq[i], "send from a thread");
        CheckOk(rreq[i], "recv in a thread");
        CHECK(Verify(in[i], 1000 + 100 * t + i, peer) < 0, "thread %d message %d: wrong data", t,
              i);
      }
    });
  }
  for (auto& th : threads) th.join();
  Log("%d threads x %d messages each way on one link: ok", kThreads, kMsgs);
}

// A waiter asleep on the link (AwaitActivity, as the engine's calls wait,
// with a bound of 2 s here) is woken by the peer's data, and only then, when
// the endpoint sleeps on its completion queue's descriptor; otherwise it
// sleeps the bound. tcp;ofi_rxm must give the descriptor (JAX_SMDDP_FABRIC_WAIT=fd, the
// default), and "sleep" must sleep. Then 20 more wake-ups while another thread
// progresses the link (a concurrent call, the drainer) and may read what the
// waiter's descriptor announced: the waiter must still wake.
void Wakes(Link* link, int me, const FabricEndpoint& ep) {
  const std::string kind = ep.WaitKind();
  const char* setting = std::getenv("JAX_SMDDP_FABRIC_WAIT");
  const bool asked_sleep = setting && std::string(setting) == "sleep";
  CHECK(kind == (asked_sleep ? "sleep" : "fd") || (!asked_sleep && ep.Provider() != "tcp;ofi_rxm"),
        "%s waits by %s (JAX_SMDDP_FABRIC_WAIT=%s)", ep.Provider().c_str(), kind.c_str(),
        setting ? setting : "");
  std::atomic<bool> helping{false}, stop{false};
  std::thread helper([&] {
    for (; !stop.load(); ::usleep(100))
      if (helping.load()) link->Progress();
  });
  double worst = 0;  // of the wake-ups with the helper
  // The bound of each wait: a waiter by fd wakes well before it, one that sleeps sleeps it whole
  // (the sender sends after 0.2 s either way).
  const unsigned bound_us = kind == "fd" ? 2000000 : 500000;
  for (int i = 0; i < (kind == "fd" ? 22 : 2); ++i) {
    const size_t bytes = i == 1 ? 300000 : 64;  // a bounce chunk; a direct transfer
    helping = i >= 2 && kind == "fd";
    Barrier();
    std::vector<char> out(bytes), in(bytes, '\xEE');
    Fill(out, 950, me);
    if (me == 1) {
      usleep(i < 2 ? 200000 : 20000);  // the parent is asleep by now
      Request s;
      link->Send(950, out.data(), bytes, &s);
      Wait(link, {&s}, 30, "wake-up send");
      continue;
    }
    Request r;
    link->Recv(950, in.data(), bytes, &r);
    const auto t0 = Clock::now();
    int sleeps = 0;
    for (;;) {
      const uint32_t seen = link->Activity();
      link->Progress();
      if (r.done()) break;
      CHECK(Clock::now() - t0 < std::chrono::seconds(20), "wake-up receive not done");
      link->AwaitActivity(seen, bound_us);
      sleeps++;
    }
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    CheckOk(r, "wake-up receive");
    CHECK(Verify(in, 950, 1) < 0, "wake-up receive: wrong data");
    if (helping) worst = std::max(worst, s);
    if (kind == "fd") {
      CHECK(s < 1.5,
            "%zu bytes sent after %.2f s arrived after %.3f s: the waiter slept its bound%s", bytes,
            i < 2 ? 0.2 : 0.02, s, helping ? " (another thread progressing the link)" : "");
      // It slept: a descriptor that stays ready (a provider's signal never
      // cleared) turns each sleep into a poll, hundreds of thousands in 0.2 s.
      CHECK(sleeps <= 100, "%zu bytes: the waiter woke %d times in %.3f s instead of sleeping",
            bytes, sleeps, s);
    } else {
      CHECK(s >= 0.95 * bound_us / 1e6, "%zu bytes: a waiter that sleeps %.1f s woke after %.3f s",
            bytes, bound_us / 1e6, s);
    }
    if (i < 2) {
      Log("waits by %s: %zu bytes sent after 0.2 s received after %.3f s (%d sleeps)", kind.c_str(),
          bytes, s, sleeps);
    }
  }
  stop = true;
  helper.join();
  if (kind == "fd")
    Log("waits by fd, another thread progressing: 20 wake-ups, slowest %.3f s", worst);
}

void Throughput(Link* link, int me, const std::string& provider) {
  const size_t bytes = 64 * kMiB;
  const int kMsgs = 4;
  std::vector<std::vector<char>> buf(kMsgs, std::vector<char>(bytes, 1));
  double best_uni = 0, best_bi = 0;
  for (int rep = 0; rep < 3; ++rep) {
    // One way: parent -> child, 4 x 64 MiB in flight.
    Barrier();
    std::vector<Request> reqs(kMsgs);
    std::vector<Request*> ptrs;
    auto t0 = Clock::now();
    for (int k = 0; k < kMsgs; ++k) {
      if (me == 0) {
        link->Send(600 + k, buf[k].data(), bytes, &reqs[k]);
      } else {
        link->Recv(600 + k, buf[k].data(), bytes, &reqs[k]);
      }
      ptrs.push_back(&reqs[k]);
    }
    Wait(link, ptrs, 120, "throughput, one way");
    double s = std::chrono::duration<double>(Clock::now() - t0).count();
    for (auto& r : reqs) CheckOk(r, "throughput");
    if (me == 1) best_uni = std::max(best_uni, kMsgs * bytes / s / 1e9);
    // Both ways: 64 MiB each.
    Barrier();
    Request sr, rr;
    t0 = Clock::now();
    link->Send(700, buf[0].data(), bytes, &sr);
    link->Recv(700, buf[1].data(), bytes, &rr);
    Wait(link, {&sr, &rr}, 120, "throughput, both ways");
    s = std::chrono::duration<double>(Clock::now() - t0).count();
    CheckOk(rr, "throughput");
    best_bi = std::max(best_bi, bytes / s / 1e9);
  }
  if (me == 1) {
    std::printf(
        "THROUGHPUT %s: 64 MiB messages one way %.2f GB/s; both ways at once %.2f GB/s "
        "each way\n",
        provider.c_str(), best_uni, best_bi);
    std::fflush(stdout);
  }
  Barrier();
}

// The time of one exchange (both processes send `bytes` and receive the
// other's at once), the pattern of a 2-process all_gather, at the sizes where
// the benchmark finds the engine slower than gloo between hosts: median and
// minimum of 40 rounds, waiting by spinning on Progress, and by sleeping on
// the link's activity (AwaitActivity, as the engine's calls wait once their
// spin is over). Printed for docs/cpu_floor.md; checked for the data
// only. What the transport alone costs, without XLA or the engine.
void Latency(Link* link, int me) {
  const int kRounds = 40;
  for (size_t bytes : {size_t(16) << 10, size_t(64) << 10, size_t(128) << 10, size_t(256) << 10,
                       size_t(512) << 10, size_t(1) << 20}) {
    std::vector<char> out(bytes), in(bytes);
    Fill(out, 970, me);
    double med[2], low[2];
    for (int sleeps = 0; sleeps < 2; ++sleeps) {
      std::vector<double> us;
      for (int round = 0; round < kRounds; ++round) {
        std::fill(in.begin(), in.end(), '\0');  // a round that moved nothing fails
        Barrier();
        Request s, r;
        const auto t0 = Clock::now();
        link->Recv(970, in.data(), bytes, &r);
        link->Send(970, out.data(), bytes, &s);
        if (!sleeps) {
          Wait(link, {&s, &r}, 30, "exchange");
        } else {
          const auto deadline = t0 + std::chrono::seconds(30);
          while (!(s.done() && r.done())) {
            const uint32_t seen = link->Activity();
            link->Progress();
            if (s.done() && r.done()) break;
            CHECK(Clock::now() < deadline, "exchange (sleeping) not done after 30 s");
            link->AwaitActivity(seen, 1000);
          }
        }
        us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
        CheckOk(r, "exchange");
        CHECK(Verify(in, 970, 1 - me) < 0, "exchange of %zu bytes: wrong data", bytes);
      }
      std::sort(us.begin(), us.end());
      med[sleeps] = us[us.size() / 2];
      low[sleeps] = us[0];
    }
    if (me == 0)
      std::printf(
          "EXCHANGE %7zu bytes both ways: spinning median %.0f us (min %.0f), sleeping on "
          "activity median %.0f us (min %.0f)%s\n",
          bytes, med[0], low[0], med[1], low[1], Direct(link, bytes) ? ", direct" : "");
  }
  std::fflush(stdout);
  Barrier();
}

std::unique_ptr<FabricEndpoint> OpenEndpoint(const std::string& provider, const std::string& node) {
  std::unique_ptr<FabricEndpoint> ep;
  Status st = FabricEndpoint::Open(provider, node, &ep);
  CHECK(st.ok(), "Open(%s): %s", provider.c_str(), st.message().c_str());
  return ep;
}

// Sends this process's address (or any string) and returns the other's.
std::string SwapStrings(const std::string& mine) {
  uint32_t n = static_cast<uint32_t>(mine.size());
  WriteAll(&n, 4);
  WriteAll(mine.data(), n);
  ReadAll(&n, 4);
  CHECK(n > 0 && n < 4096, "bad address length %u", n);
  std::string theirs(n, '\0');
  ReadAll(&theirs[0], n);
  return theirs;
}

std::unique_ptr<Link> Handshake(FabricEndpoint* ep, const char* peer_name) {
  const std::string theirs = SwapStrings(ep->Address());
  std::unique_ptr<Link> link;
  Status st = ep->Connect(theirs, peer_name, &link);
  CHECK(st.ok(), "Connect: %s", st.message().c_str());
  return link;
}

// --- FabricRail: tagged zero-copy messages between registered buffers -------

// Both processes register one arena and carve every buffer out of it.
struct Arena {
  std::vector<char> bytes;
  size_t used = 0;
  char* Take(size_t n) {
    char* p = bytes.data() + used;
    used += (n + 63) / 64 * 64;
    CHECK(used <= bytes.size(), "arena too small");
    return p;
  }
};

void FillAt(char* p, size_t n, uint64_t tag, int from) {
  std::vector<char> v(n);
  Fill(v, tag, from);
  std::memcpy(p, v.data(), n);
}
long long VerifyAt(const char* p, size_t n, uint64_t tag, int from) {
  return Verify(std::vector<char>(p, p + n), tag, from);
}

void RailTests(Link* control, int me, const std::string& provider, const std::string& node) {
  const int peer = 1 - me;
  std::unique_ptr<smddp::FabricRail> rail;
  Status st = smddp::FabricRail::Open(provider, node, smddp::MemoryIface::kHost, &rail);
  // Both sides agree on whether the provider can (same library, same host).
  char can = st.ok() ? 'y' : 'n', theirs_can = 0;
  WriteAll(&can, 1);
  ReadAll(&theirs_can, 1);
  CHECK(can == theirs_can, "the two processes disagree on FI_HMEM");
  if (!st.ok()) {
    CHECK(st.message().find("FI_HMEM") != std::string::npos, "unclear rail error: %s",
          st.message().c_str());
    Log("rail: %s offers no FI_HMEM, as expected of it: \"%s\"", provider.c_str(),
        st.message().c_str());
    return;
  }
  Arena arena;
  arena.bytes.resize(3 * 64 * kMiB + 16 * kMiB);
  std::unique_ptr<smddp::FabricRail::Region> region;
  st = rail->Register(arena.bytes.data(), arena.bytes.size(), 0, &region);
  CHECK(st.ok(), "Register: %s", st.message().c_str());
  std::unique_ptr<Link> link;
  st = rail->Connect(SwapStrings(rail->Address()), me == 0 ? "the child" : "the parent", control,
                     &link);
  CHECK(st.ok(), "rail Connect: %s", st.message().c_str());
  CHECK(link->Kind().find("no staging") != std::string::npos, "Kind() is %s", link->Kind().c_str());

  // Every size both ways, receives posted before and after the sends.
  for (int late = 0; late < 2; ++late) {
    arena.used = 0;
    const size_t n = kSizes.size();
    std::vector<char*> out(n), in(n);
    std::vector<Request> sreq(n), rreq(n);
    std::vector<Request*> all;
    for (size_t i = 0; i < n; ++i) {
      out[i] = arena.Take(kSizes[i]);
      in[i] = arena.Take(kSizes[i]);
      FillAt(out[i], kSizes[i], 900 + i, me);
      std::memset(in[i], 0xEE, kSizes[i]);
    }
    auto post_recvs = [&] {
      for (size_t i = 0; i < n; ++i) {
        link->Recv(900 + i, in[i], kSizes[i], &rreq[i]);
        all.push_back(&rreq[i]);
      }
    };
    if (!late) post_recvs();
    Barrier();
    for (size_t i = 0; i < n; ++i) {
      link->Send(900 + i, out[i], kSizes[i], &sreq[i]);
      all.push_back(&sreq[i]);
    }
    if (late) {
      ProgressFor(link.get(), 0.2);
      Barrier();
      post_recvs();
    }
    Wait(link.get(), all, 60, "rail sizes");
    for (size_t i = 0; i < n; ++i) {
      CheckOk(sreq[i], "rail send");
      CheckOk(rreq[i], "rail recv");
      long long bad = VerifyAt(in[i], kSizes[i], 900 + i, peer);
      CHECK(bad < 0, "rail message of %zu bytes: wrong byte at offset %lld", kSizes[i], bad);
    }
    Barrier();
  }
  Log("rail: sizes 0..64 MiB both ways, receives posted before and after: ok");

  // One tag twice: receives match in send order. Then a receive too small
  // and one too large each fail, naming the sizes; the link still works.
  arena.used = 0;
  char *a = arena.Take(300), *b = arena.Take(5000), *ra = arena.Take(300), *rb = arena.Take(5000);
  FillAt(a, 300, 1900, me);
  FillAt(b, 5000, 2900, me);
  Request sa, sb, qa, qb;
  link->Recv(910, ra, 300, &qa);
  link->Recv(910, rb, 5000, &qb);
  Barrier();
  link->Send(910, a, 300, &sa);
  link->Send(910, b, 5000, &sb);
  Wait(link.get(), {&sa, &sb, &qa, &qb}, 30, "rail reused tag");
  CheckOk(qa, "first receive of a reused tag");
  CheckOk(qb, "second receive of a reused tag");
  CHECK(VerifyAt(ra, 300, 1900, peer) < 0 && VerifyAt(rb, 5000, 2900, peer) < 0,
        "rail reused tag: wrong data");
  Request s1, r1, s2, r2;
  char *big = arena.Take(100), *small_in = arena.Take(64), *short_out = arena.Take(50),
       *long_in = arena.Take(80);
  link->Recv(911, small_in, 64, &r1);
  link->Recv(912, long_in, 80, &r2);
  Barrier();
  link->Send(911, big, 100, &s1);
  link->Send(912, short_out, 50, &s2);
  Wait(link.get(), {&s1, &r1, &s2, &r2}, 30, "rail size mismatch");
  CHECK(!r1.status().ok() && !r2.status().ok(), "a rail receive of the wrong size succeeded");
  CHECK(r1.status().message().find("64") != std::string::npos, "unclear: %s",
        r1.status().message().c_str());
  CHECK(r2.status().message().find("50") != std::string::npos &&
            r2.status().message().find("80") != std::string::npos,
        "unclear: %s", r2.status().message().c_str());
  Log("rail: reused tag in order; size mismatches: \"%s\" / \"%s\"", r1.status().message().c_str(),
      r2.status().message().c_str());

  // Memory outside the registration fails at once; a cancelled receive lets
  // the next receive of its tag take the message.
  std::vector<char> outside(64);
  Request bad;
  link->Send(913, outside.data(), outside.size(), &bad);
  CHECK(bad.done() && !bad.status().ok() &&
            bad.status().message().find("registered") != std::string::npos,
        "unregistered memory not refused");
  char *c_out = arena.Take(4096), *c_in = arena.Take(4096), *c_in2 = arena.Take(4096);
  FillAt(c_out, 4096, 914, me);
  std::memset(c_in, 0xEE, 4096);
  Request cr, cs, cr2;
  link->Recv(914, c_in, 4096, &cr);
  ProgressFor(link.get(), 0.02);
  link->Cancel(&cr);
  Barrier();
  link->Send(914, c_out, 4096, &cs);
  link->Recv(914, c_in2, 4096, &cr2);
  Wait(link.get(), {&cs, &cr2}, 30, "rail after a cancel");
  CheckOk(cr2, "receive after a cancelled one");
  CHECK(VerifyAt(c_in2, 4096, 914, peer) < 0, "rail: wrong data after a cancel");
  CHECK(!cr.done(), "a cancelled rail receive completed");
  bool untouched = true;
  for (int i = 0; i < 4096; ++i) untouched = untouched && c_in[i] == '\xEE';
  CHECK(untouched, "a cancelled rail receive wrote into its buffer");
  Log("rail: unregistered memory refused; cancel: ok");

  // Throughput, as for the link: 4 x 64 MiB one way.
  Barrier();
  arena.used = 0;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<Request> reqs(4);
    std::vector<Request*> ptrs;
    Barrier();
    auto t0 = Clock::now();
    for (int k = 0; k < 4; ++k) {
      char* buf = arena.bytes.data() + (k % 3) * 64 * kMiB;
      if (me == 0) {
        link->Send(920 + k, buf, 64 * kMiB, &reqs[k]);
      } else {
        link->Recv(920 + k, buf, 64 * kMiB, &reqs[k]);
      }
      ptrs.push_back(&reqs[k]);
    }
    Wait(link.get(), ptrs, 120, "rail throughput");
    for (auto& r : reqs) CheckOk(r, "rail throughput");
    best = std::max(best,
                    4 * 64 * kMiB / std::chrono::duration<double>(Clock::now() - t0).count() / 1e9);
  }
  if (me == 1) {
    std::printf("THROUGHPUT %s rail (registered host memory): 64 MiB messages one way %.2f GB/s\n",
                provider.c_str(), best);
    std::fflush(stdout);
  }
  Barrier();
  link.reset();
  region.reset();
  rail.reset();
  Log("rail tests passed");
}

// A direct receive cancelled mid-transfer, whose process then stops progressing (its call
// failed and it left): the sender's pieces still land, in drain buffers the endpoint's drainer
// progresses, so the sender's send completes while the receiver's caller is away.
void DrainedWithoutCaller(Link* link, int me) {
  const size_t big = 64 * kMiB;
  if (!Direct(link, big)) return;
  std::vector<char> out(big, 1), in(big);
  Request s, r;
  if (me == 0) link->Recv(505, in.data(), in.size(), &r);
  Barrier();
  char b = 'c';
  if (me == 0) {
    const uint64_t before = link->SingleCopyBytes();
    while (!r.done() && link->SingleCopyBytes() == before) link->Progress();  // a piece landed
    link->Cancel(&r);
    const bool mid = !r.done();
    WriteAll(&b, 1);
    ::usleep(1200000);  // away, as a process back in Python after its call failed
    Log("drains: %s", mid ? "cancelled mid-transfer" : "it had completed already");
  } else {
    link->Send(505, out.data(), out.size(), &s);
    for (struct pollfd pfd = {g_rd, POLLIN, 0}; poll(&pfd, 1, 0) == 0;) link->Progress();
    ReadAll(&b, 1);
    Wait(link, {&s}, 1.0, "a send whose receive was cancelled while its receiver is away");
  }
  Barrier();
}

// No drain receive is left `what`: each landed, or was withdrawn when its sender aborted.
void NoDrainsLeft(Link* link, const FabricEndpoint& ep, const char* what) {
  const auto until = Clock::now() + std::chrono::seconds(2);
  while (ep.DrainBytes() > 0 && Clock::now() < until) link->Progress();
  CHECK(ep.DrainBytes() == 0, "%zu bytes of drain receives still posted 2 s %s", ep.DrainBytes(),
        what);
}

int Run(int me, const std::string& provider, const std::string& node, pid_t child) {
  std::unique_ptr<FabricEndpoint> ep = OpenEndpoint(provider, node);
  std::unique_ptr<Link> link = Handshake(ep.get(), me == 0 ? "the child" : "the parent");
  CHECK(link->Kind() == "libfabric " + ep->Provider(), "Kind() is %s", link->Kind().c_str());
  if (me == 0) Log("%s, address %zu bytes", link->Kind().c_str(), ep->Address().size());

  ExchangeSizes(link.get(), me, 100, false);
  ExchangeSizes(link.get(), me, 200, true);
  TagOrder(link.get(), me);
  SizeMismatch(link.get(), me);
  Cancels(link.get(), me);
  Barrier();
  Announced(link.get(), me);
  NoDrainsLeft(link.get(), *ep, "after a transfer cancelled on both sides");
  Barrier();
  DrainedWithoutCaller(link.get(), me);
  NoDrainsLeft(link.get(), *ep, "after the sender's pieces landed in them");
  Threads(link.get(), me);
  Wakes(link.get(), me, *ep);
  Throughput(link.get(), me, provider);
  Latency(link.get(), me);
  RailTests(link.get(), me, provider, node);
  Barrier();
  link = smddp::WatchLink(std::move(link), g_farewell_fd, me == 0 ? "the child" : "the parent");
  fabric_farewell::Farewells(link.get(), me, g_farewell_fd);

  // The child is killed during the parent's Cancel of a direct send: the child's receive took
  // the pieces (posted), then the child stopped progressing. The Cancel must return soon after
  // the kill (the link's own watch, Link::WatchPeer: the providers here report no dead peer,
  // and it waited kCancelWaitSeconds) and the link name the failure; then close cleanly.
  Barrier();
  if (me == 1) {
    std::vector<char> in(64 * kMiB, 0);
    Request r;
    link->Recv(801, in.data(), in.size(), &r);
    while (in[0] == 0 && !r.done()) link->Progress();  // its first bytes landed
    WriteAll("s", 1);
    for (;;) pause();  // until killed, progressing nothing more
  }
  std::unique_ptr<Link> watched = smddp::WatchLink(std::move(link), g_watch_fd, "the child");
  std::vector<char> out(64 * kMiB, 7), in(4096);
  Request s, r;
  watched->Recv(800, in.data(), in.size(), &r);
  watched->Send(801, out.data(), out.size(), &s);
  for (pollfd pfd{g_rd, POLLIN, 0}; poll(&pfd, 1, 0) == 0;) watched->Progress();
  char stalled;
  ReadAll(&stalled, 1);
  const bool waits = !s.done();  // else the provider finished it without the child's progress
  std::thread killer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    kill(child, SIGKILL);
  });
  const auto t0 = Clock::now();
  watched->Cancel(&s);
  const double cancel_s = std::chrono::duration<double>(Clock::now() - t0).count();
  killer.join();
  int status = 0;
  waitpid(child, &status, 0);
  RemoveFabricRegionsOf(child);
  smddp_test::Peer() = 0;
  CHECK(cancel_s < 2.0,
        "cancelling a direct send took %.1f s: its peer, killed 0.3 s into the wait, went "
        "unnoticed",
        cancel_s);
  const std::string failure = watched->PeerFailure();
  CHECK(!failure.empty(), "the link reports no failure of a killed peer");
  watched->Cancel(&r);
  CHECK(!r.done(), "a receive from a killed process completed");
  Log("killed child: %s after %.2f s; PeerFailure: %s",
      waits ? "a cancel waiting on its pieces returned" : "(send done before) cancel", cancel_s,
      failure.c_str());
  watched.reset();
  ep.reset();

  // Errors name the problem and the way out.
  std::unique_ptr<FabricEndpoint> bad;
  Status st = FabricEndpoint::Open("no_such_provider", "", &bad);
  CHECK(!st.ok() && st.message().find("fi_info") != std::string::npos &&
            st.message().find("JAX_SMDDP_FABRIC_PROVIDER") != std::string::npos,
        "unhelpful error for a missing provider: %s", st.message().c_str());
  CHECK(smddp::ChooseFabricProvider("shm") == "shm", "ChooseFabricProvider ignores its argument");
  unsetenv("JAX_SMDDP_FABRIC_PROVIDER");
  std::string dflt = smddp::ChooseFabricProvider("");
  CHECK(dflt == "efa" || dflt == "net" || dflt == "tcp;ofi_rxm", "default provider %s",
        dflt.c_str());
  CHECK(dflt == smddp::DefaultFabricProvider(), "default provider %s, DefaultFabricProvider %s",
        dflt.c_str(), smddp::DefaultFabricProvider().c_str());
  setenv("JAX_SMDDP_FABRIC_PROVIDER", "shm", 1);
  CHECK(smddp::ChooseFabricProvider("") == "shm", "JAX_SMDDP_FABRIC_PROVIDER ignored");
  std::string why;
  CHECK(smddp::FabricAvailable(&why), "FabricAvailable: %s", why.c_str());
  Log("all fabric link tests passed");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s <provider> [node]\n", argv[0]);
    return 2;
  }
  std::string provider = argv[1];
  std::string node = argc > 2 ? argv[2] : "";
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  int p2c[2], c2p[2], watch[2], farewell[2];
  CHECK(pipe(p2c) == 0 && pipe(c2p) == 0, "pipe");
  CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, watch) == 0 &&
            socketpair(AF_UNIX, SOCK_STREAM, 0, farewell) == 0,
        "socketpair");
  pid_t child = fork();
  CHECK(child >= 0, "fork");
  if (child == 0) {
    smddp_test::Who() = "child";
    g_rd = p2c[0];
    g_wr = c2p[1];
    close(p2c[1]);
    close(c2p[0]);
    close(watch[0]);
    close(farewell[0]);
    g_farewell_fd = farewell[1];
    return Run(1, provider, node, 0);
  }
  smddp_test::Peer() = child;
  g_rd = c2p[0];
  g_wr = p2c[1];
  close(p2c[0]);
  close(c2p[1]);
  close(watch[1]);
  close(farewell[1]);
  g_watch_fd = watch[0];
  g_farewell_fd = farewell[0];
  int rc = Run(0, provider, node, child);
  return rc;
}

// fabric_link_test.cc's phases of messages over one link: every size both ways, tags in order,
// a size mismatch, cancels, sizes announced after the answer, threads. No jax; inline, one
// translation unit per program.
#ifndef JAX_SMDDP_TESTS_NATIVE_FABRIC_MESSAGES_H_
#define JAX_SMDDP_TESTS_NATIVE_FABRIC_MESSAGES_H_

#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/native/check.h"
#include "tests/native/fabric_data.h"
#include "tests/native/fabric_harness.h"
#include "xla_ffi/common/settings.h"
#include "xla_ffi/transports/fabric_link.h"

namespace fabric_messages {

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

// A message of `bytes` each way, tag `tag`, arrives whole after `what`: the
// link still works.
inline void StillFlows(Link* link, int me, uint64_t tag, size_t bytes, const char* what) {
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
inline bool Direct(Link* link, size_t bytes) {
  return link->SingleCopy() == "on" &&
         bytes >= size_t(smddp::IntSetting("JAX_SMDDP_FABRIC_DIRECT_BYTES"));
}

const std::vector<size_t> kSizes = {0, 1, 7, 4096, kMiB + 3, 64 * kMiB};

// Every size both ways at once. Receives posted before the peer sends
// (after_arrival = false), or after its data had time to arrive.
inline void ExchangeSizes(Link* link, int me, uint64_t tag0, bool after_arrival) {
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
inline void TagOrder(Link* link, int me) {
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
inline void SizeMismatch(Link* link, int me) {
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

inline void Cancels(Link* link, int me) {
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
inline void Announced(Link* link, int me) {
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
inline void Threads(Link* link, int me) {
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

}  // namespace fabric_messages

#endif  // JAX_SMDDP_TESTS_NATIVE_FABRIC_MESSAGES_H_

// Standalone test of the shared-memory link (xla_ffi/transports/shm_link.h): no
// jax. The parent creates two segments, forks, passes their names to the
// child through a pipe; both map them, the parent unlinks them; then both run
// the same script of transfers, kept in step by one-byte messages over pipes.
// Exit code 0 on success; on failure a message and exit code 1 (the other
// process is killed). Every wait has a deadline, so a bug fails, never hangs.
// The ring's defences against a corrupt peer: shm_corruption_test.cc.
//
// Build (from the repository root):
//   c++ -std=c++17 -O2 -I. xla_ffi/transports/shm_{segment,ring,single_copy,link}.cc \
//       xla_ffi/transports/shm_file.cc xla_ffi/transports/process_liveness.cc \
//       xla_ffi/common/settings.cc xla_ffi/common/protocol.cc tests/native/shm_link_test.cc \
//       -o t -lpthread -lrt
#include "tests/native/shm_harness.h"

#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

using namespace shm_test;  // NOLINT: the harness is this test's vocabulary

namespace {

// ---- the script; `me` is 0 in the parent (creator), 1 in the child ----

// Every size, both directions at once, receives posted before the data.
void TestSizesPostedFirst(Link* l, int me) {
  Msgs recvs, sends;
  for (size_t i = 0; i < kSizes.size(); ++i) {
    recvs.push_back(std::make_unique<Msg>(100 + i, kSizes[i]));
    l->Recv(recvs.back()->tag, recvs.back()->buf.data(), kSizes[i], &recvs.back()->req);
  }
  Barrier("sizes: receives posted");
  for (size_t i = 0; i < kSizes.size(); ++i) {
    sends.push_back(std::make_unique<Msg>(100 + i, kSizes[i]));
    PostSend(l, sends.back().get(), me);
  }
  Wait(l, Reqs(sends), "sizes: sends");
  Wait(l, Reqs(recvs), "sizes: receives");
  for (auto& m : sends) CheckSent(m.get(), "sizes");
  for (auto& m : recvs) CheckRecv(m.get(), 1 - me, "sizes (posted first)");
}

// Every size, both directions, receives posted after all the data arrived
// (taken over from the unexpected store: complete at once, no Progress).
void TestSizesPostedLate(Link* l, int me) {
  Msgs sends;
  for (size_t i = 0; i < kSizes.size(); ++i) {
    sends.push_back(std::make_unique<Msg>(200 + i, kSizes[i]));
    PostSend(l, sends.back().get(), me);
  }
  Wait(l, Reqs(sends), "late: sends");  // all bytes are in the ring (or read)
  Put('s');
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  while (!Ready(0)) {
    l->Progress();
    CHECK_MSG(Clock::now() < deadline, "late: peer's sends never completed");
  }
  Expect('s', "late: peer sends done");
  Spin(l, 50);  // take in the rest
  Msgs recvs;
  for (size_t i = kSizes.size(); i-- > 0;) {
    recvs.push_back(std::make_unique<Msg>(200 + i, kSizes[i]));
    Msg* m = recvs.back().get();
    l->Recv(m->tag, m->buf.data(), m->n, &m->req);
    CHECK_MSG(m->req.done(), "late: receive of " + std::to_string(m->n) +
                                 " bytes after arrival did not complete at once");
    CheckRecv(m, 1 - me, "sizes (posted after arrival)");
  }
  Barrier("late: done");
}

// A receive posted while its message is part-way into the unexpected store
// takes over the rest.
void TestPartialTakeover(Link* l, int me) {
  const uint64_t tag = 250;
  const size_t n = 32 * kMiB + 5;
  if (me == 0) {
    Msg m(tag, n);
    PostSend(l, &m, 0);
    Spin(l, 100);  // fills the ring; the child is not reading
    CHECK(!m.req.done());
    Put('p');
    Expect('q', "takeover: child posted");
    Wait1(l, &m.req, "takeover: send");
    CheckSent(&m, "takeover");
  } else {
    Expect('p', "takeover: ring full");
    l->Progress();  // the parent is idle: at most one ring's worth arrives
    Msg m(tag, n);
    l->Recv(tag, m.buf.data(), n, &m.req);
    // (Read in place, it arrived whole: single copy has no partial messages.)
    CHECK_MSG(SingleCopy() || !m.req.done(),
              "takeover: a 32 MiB message cannot have fully arrived");
    Put('q');
    Wait1(l, &m.req, "takeover: receive");
    CheckRecv(&m, 0, "takeover");
  }
  Barrier("takeover: done");
}

// 8 tags per direction, sent by 4 (parent) / 2 (child) threads at once,
// received in another order, some receives posted after arrival, while
// helper threads drive Progress too.
void TestTagsAndThreads(Link* l, int me) {
  const int kTags = 8;
  auto size_of = [](int dir, int k) -> size_t {
    static const size_t s[] = {3, 1000, 65536 + 1, 3 * kMiB + 17, 0, 12345, 8 * kMiB + 64, 777};
    return s[(k + 3 * dir) % 8];
  };
  const uint64_t send_base = me == 0 ? 300 : 310, recv_base = me == 0 ? 310 : 300;
  Msgs sends, recvs;
  for (int k = 0; k < kTags; ++k)
    sends.push_back(std::make_unique<Msg>(send_base + k, size_of(me, k)));
  for (int k = 0; k < kTags; ++k)
    recvs.push_back(std::make_unique<Msg>(recv_base + k, size_of(1 - me, k)));
  const int order[kTags] = {5, 1, 7, 0, 3, 6, 2, 4};
  // Half the receives before the data can arrive.
  for (int i = 0; i < kTags / 2; ++i) {
    Msg* m = recvs[order[i]].get();
    l->Recv(m->tag, m->buf.data(), m->n, &m->req);
  }
  Barrier("tags: first receives posted");
  std::atomic<bool> stop{false};
  std::vector<std::thread> helpers;
  for (int h = 0; h < 2; ++h) {
    helpers.emplace_back([&] {
      while (!stop.load()) {
        l->Progress();
        sched_yield();
      }
    });
  }
  const int threads = me == 0 ? 4 : 2;
  std::vector<std::thread> senders;
  for (int t = 0; t < threads; ++t) {
    senders.emplace_back([&, t] {
      std::vector<Request*> mine;
      for (int k = t; k < kTags; k += threads) {
        PostSend(l, sends[k].get(), me);
        mine.push_back(&sends[k]->req);
      }
      Wait(l, mine, "tags: sender thread");
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  for (int i = kTags / 2; i < kTags; ++i) {
    Msg* m = recvs[order[i]].get();
    l->Recv(m->tag, m->buf.data(), m->n, &m->req);
  }
  for (auto& t : senders) t.join();
  Wait(l, Reqs(recvs), "tags: receives");
  stop = true;
  for (auto& t : helpers) t.join();
  for (auto& m : sends) CheckSent(m.get(), "tags");
  for (auto& m : recvs) CheckRecv(m.get(), 1 - me, "tags");
  Barrier("tags: done");
}

// A receive whose size differs from the message's fails that request only.
void TestSizeMismatch(Link* l, int me) {
  if (me == 0) {
    Expect('r', "mismatch: child posted");
    Msg a(400, 100), b(401, 100), c(402, 50);
    PostSend(l, &a, 0);
    PostSend(l, &b, 0);
    PostSend(l, &c, 0);
    Wait(l, {&a.req, &b.req, &c.req}, "mismatch: sends");
    Put('s');
  } else {
    Msg early(400, 99);
    l->Recv(400, early.buf.data(), 99, &early.req);
    Put('r');
    Wait1(l, &early.req, "mismatch: early receive");
    CHECK_MSG(!early.req.status().ok(), "mismatched receive (posted first) succeeded");
    CHECK_MSG(
        Contains(early.req.status().message(), "peer sent 100 bytes under tag 400, expected 99"),
        early.req.status().message());
    Expect('s', "mismatch: sends done");
    Spin(l, 20);
    Msg late(401, 101);
    l->Recv(401, late.buf.data(), 101, &late.req);
    CHECK_MSG(late.req.done(), "mismatched receive (posted late) did not fail at once");
    CHECK_MSG(!late.req.status().ok(), "mismatched receive (posted late) succeeded");
    CHECK_MSG(
        Contains(late.req.status().message(), "peer sent 100 bytes under tag 401, expected 101"),
        late.req.status().message());
    Msg good(402, 50);
    l->Recv(402, good.buf.data(), 50, &good.req);
    Wait1(l, &good.req, "mismatch: following receive");
    CheckRecv(&good, 0, "after mismatch");
    CHECK(l->PeerFailure().empty());
  }
  Barrier("mismatch: done");
}

// Several messages under one tag arrive in the order they were sent (their
// chunks never interleave), whether the receives wait for them or not.
void TestSameTag(Link* l, int me) {
  const size_t n1 = 2 * kMiB + 1, n2 = 3 * kMiB + 7;
  if (me == 0) {
    Expect('r', "same tag: posted");
    std::vector<uint8_t> a(n1), b(n2), c(n1), d(n2);
    Fill(a.data(), n1, 450, 0);
    Fill(b.data(), n2, 4500, 0);
    Fill(c.data(), n1, 451, 0);
    Fill(d.data(), n2, 4510, 0);
    // A filler first, so that the ring is full (the child is not reading)
    // and all four wait to be written together.
    Msg filler(449, 12 * kMiB);
    PostSend(l, &filler, 0);
    Request ra, rb, rc, rd;
    l->Send(450, a.data(), n1, &ra);
    l->Send(450, b.data(), n2, &rb);
    l->Send(451, c.data(), n1, &rc);
    l->Send(451, d.data(), n2, &rd);
    CHECK(!ra.done() && !rb.done() && !rc.done() && !rd.done());
    Put('g');
    Wait(l, {&filler.req, &ra, &rb}, "same tag: sends received");
    Put('s');
    // Tag 451's receives are not posted: the child's Progress reads the
    // messages into its store once they have waited kUnclaimedReadAfter.
    Wait(l, {&rc, &rd}, "same tag: sends never received");
    CHECK(ra.status().ok() && rb.status().ok() && rc.status().ok() && rd.status().ok());
    Put('u');
  } else {
    std::vector<uint8_t> a(n1), b(n2), c(n1), d(n2);
    Request ra, rb, rc, rd;
    Msg filler(449, 12 * kMiB);
    l->Recv(449, filler.buf.data(), filler.n, &filler.req);
    l->Recv(450, a.data(), n1, &ra);
    l->Recv(450, b.data(), n2, &rb);
    Put('r');
    Expect('g', "same tag: all posted");
    Wait(l, {&filler.req, &ra, &rb}, "same tag: receives posted first");
    CheckRecv(&filler, 0, "same tag: filler");
    Expect('s', "same tag: sent");
    Spin(l, 20);
    Expect('u', "same tag: sends done with no receive posted");
    l->Recv(451, c.data(), n1, &rc);
    l->Recv(451, d.data(), n2, &rd);
    CHECK(rc.done() && rd.done());
    CHECK(ra.status().ok() && rb.status().ok() && rc.status().ok() && rd.status().ok());
    CHECK_MSG(Verify(a.data(), n1, 450, 0) < 0, "first message under tag 450");
    CHECK_MSG(Verify(b.data(), n2, 4500, 0) < 0, "second message under tag 450");
    CHECK_MSG(Verify(c.data(), n1, 451, 0) < 0, "first message under tag 451 (late)");
    CHECK_MSG(Verify(d.data(), n2, 4510, 0) < 0, "second message under tag 451 (late)");
  }
  Barrier("same tag: done");
}

// A message to be read in place (single copy) whose receive is not posted
// yet stays in the writer's memory: the reader copies it once, straight into
// the receive's buffer, in its first Progress after the receive comes, and
// only then does the send complete. (Without single copy it goes through the
// ring and the store.)
void TestInPlaceWaitsForItsReceive(Link* l, int me) {
  const size_t n = 4 * kMiB + 320;
  if (me == 0) {
    Msg m(470, n);
    PostSend(l, &m, 0);  // its reference (or first chunk) is in the ring now
    Put('p');
    Expect('q', "in place: the child progressed");
    Spin(l, 10);  // takes in any answer
    CHECK_MSG(!SingleCopy() || !m.req.done(),
              "in place: the child took the message before its receive was posted");
    Put('r');
    Wait1(l, &m.req, "in place: send");
    CheckSent(&m, "in place");
  } else {
    Expect('p', "in place: sent");
    const uint64_t before = l->SingleCopyBytes();
    l->Progress();  // reads the reference; under kUnclaimedReadAfter: not the message
    Put('q');
    Expect('r', "in place: the parent looked");
    Msg m(470, n);
    l->Recv(470, m.buf.data(), n, &m.req);
    l->Progress();  // reads it, straight into the receive's buffer
    if (SingleCopy())
      CHECK_MSG(l->SingleCopyBytes() == before + n,
                "in place: not read by the first Progress after its receive was posted");
    Wait1(l, &m.req, "in place: receive");
    CheckRecv(&m, 0, "in place");
    if (SingleCopy()) CHECK(l->SingleCopyBytes() == before + n);
  }
  Barrier("in place: done");
  // A receive that claimed such a message and was cancelled before it was
  // read leaves it to the next receive; one of another size gets a mismatch
  // and the send still completes. (Through the ring a cancelled receive that
  // took over part of a message discards the rest: not this case.)
  if (!SingleCopy()) return;
  if (me == 0) {
    Msg a(471, n), b(472, n);
    PostSend(l, &a, 0);
    PostSend(l, &b, 0);
    Put('p');
    Wait(l, {&a.req, &b.req}, "in place, claims: sends");
    CheckSent(&a, "in place, cancelled claim");
    CheckSent(&b, "in place, mismatch");
  } else {
    Expect('p', "in place, claims: sent");
    l->Progress();
    Msg gone(471, n), again(471, n), wrong(472, n - 1);
    l->Recv(471, gone.buf.data(), n, &gone.req);
    l->Cancel(&gone.req);
    l->Recv(471, again.buf.data(), n, &again.req);
    l->Recv(472, wrong.buf.data(), n - 1, &wrong.req);
    Wait(l, {&again.req, &wrong.req}, "in place, claims: receives");
    CHECK(!gone.req.done());
    CheckRecv(&again, 0, "in place, after a cancelled claim");
    CHECK_MSG(wrong.req.status().code() == smddp::StatusCode::kMismatch,
              "in place, mismatch: " + wrong.req.status().message());
  }
  Barrier("in place, claims: done");
}

void TestCancel(Link* l, int me) {
  // (a) A receive cancelled before anything arrived; the message then goes to
  // the unexpected store and a new receive gets it.
  if (me == 1) {
    Msg gone(500, 64);
    l->Recv(500, gone.buf.data(), 64, &gone.req);
    l->Cancel(&gone.req);
    CHECK(!gone.req.done());
    Put('c');
    Expect('s', "cancel a: sent");
    Spin(l, 20);
    CHECK(!gone.req.done());
    Msg m(500, 64);
    l->Recv(500, m.buf.data(), 64, &m.req);
    Wait1(l, &m.req, "cancel a: receive");
    CheckRecv(&m, 0, "cancel a");
    l->Cancel(&m.req);  // done: a no-op
    CHECK(m.req.status().ok());
  } else {
    Expect('c', "cancel a: cancelled");
    Msg m(500, 64);
    PostSend(l, &m, 0);
    Wait1(l, &m.req, "cancel a: send");
    Put('s');
  }
  Barrier("cancel a: done");

  // (b) A receive cancelled part-way: its buffer is freed at once (ASan
  // would see a later write); the rest of the message is discarded; the
  // next message under the same tag is received normally. (Through the ring
  // only: a message read in place never arrives part-way.)
  const size_t big = 16 * kMiB;
  if (SingleCopy()) {
  } else if (me == 0) {
    Expect('r', "cancel b: posted");
    Msg m(501, big);
    PostSend(l, &m, 0);
    Spin(l, 100);
    CHECK(!m.req.done());
    Put('p');
    Expect('q', "cancel b: cancelled");
    Wait1(l, &m.req, "cancel b: send");
    CheckSent(&m, "cancel b");
    Msg again(501, 16);
    PostSend(l, &again, 0);
    Wait1(l, &again.req, "cancel b: second send");
  } else {
    auto* m = new Msg(501, big);
    l->Recv(501, m->buf.data(), big, &m->req);
    Put('r');
    Expect('p', "cancel b: ring full");
    l->Progress();
    CHECK_MSG(!m->req.done(), "cancel b: 16 MiB cannot have fully arrived");
    l->Cancel(&m->req);
    CHECK(!m->req.done());
    delete m;
    Put('q');
    Msg again(501, 16);
    l->Recv(501, again.buf.data(), 16, &again.req);
    Wait1(l, &again.req, "cancel b: second receive");
    CheckRecv(&again, 0, "cancel b: next message under the tag");
  }
  Barrier("cancel b: done");

  // (c) A send cancelled part-way (its buffer freed at once): the receiver's
  // request fails ("cancelled"); later messages, the same tag included, go
  // through. A send cancelled before it started never arrives.
  if (me == 0) {
    auto* m = new Msg(502, big);
    PostSend(l, m, 0);
    Spin(l, 50);  // the child is not reading: the ring fills
    CHECK(!m->req.done());
    l->Cancel(&m->req);
    CHECK(!m->req.done());
    delete m;
    auto* unstarted = new Msg(504, 4 * kMiB);
    PostSend(l, unstarted, 0);
    CHECK(!unstarted->req.done());
    l->Cancel(&unstarted->req);
    delete unstarted;
    Msg small(503, 8);
    PostSend(l, &small, 0);
    Put('c');
    Wait1(l, &small.req, "cancel c: small send");
    Msg again(502, 32);
    PostSend(l, &again, 0);
    Wait1(l, &again.req, "cancel c: same tag again");
  } else {
    Expect('c', "cancel c: cancelled");
    Msg m(502, big), small(503, 8), again(502, 32);
    l->Recv(502, m.buf.data(), big, &m.req);
    l->Recv(503, small.buf.data(), 8, &small.req);
    l->Recv(502, again.buf.data(), 32, &again.req);
    Wait(l, {&m.req, &small.req, &again.req}, "cancel c: receives");
    CHECK_MSG(!m.req.status().ok(), "receive of a cancelled send succeeded");
    CHECK_MSG(Contains(m.req.status().message(), "cancelled"), m.req.status().message());
    CheckRecv(&small, 0, "cancel c: following message");
    CheckRecv(&again, 0, "cancel c: same tag after cancel");
    CHECK(l->PeerFailure().empty());
  }
  Barrier("cancel c: done");
}

// Many messages of random sizes through a 16 KiB ring, both ways: chunks
// wrap around the ring end, partial chunks, interleaving.
void TestSmallRing(Link* l, int me) {
  const int kCount = 300;
  auto sizes = [&](int dir) {
    std::mt19937_64 rng(1234 + dir);
    std::vector<size_t> s(kCount);
    for (auto& x : s) x = (rng() % 4 == 0) ? rng() % 64 : rng() % (100 << 10);
    return s;
  };
  std::vector<size_t> out = sizes(me), in = sizes(1 - me);
  Msgs sends, recvs;
  for (int i = 0; i < kCount; ++i) {
    recvs.push_back(std::make_unique<Msg>(1000 + i, in[i]));
    l->Recv(1000 + i, recvs.back()->buf.data(), in[i], &recvs.back()->req);
  }
  Barrier("small ring: receives posted");
  for (int i = 0; i < kCount; ++i) {
    sends.push_back(std::make_unique<Msg>(1000 + i, out[i]));
    PostSend(l, sends.back().get(), me);
  }
  Wait(l, Reqs(sends), "small ring: sends");
  Wait(l, Reqs(recvs), "small ring: receives");
  for (auto& m : recvs) CheckRecv(m.get(), 1 - me, "small ring");
  Barrier("small ring: done");
}

// 64 MiB one way, then both ways at once.
void TestThroughput(Link* l, int me) {
  const size_t n = 64 * kMiB;
  Msg s(0, n), r(0, n);
  Fill(s.buf.data(), n, 600, me);
  double best = 0, sum = 0;
  const int reps = 5;
  for (int k = 0; k < reps; ++k) {
    const uint64_t tag = 600 + k;
    if (me == 1) {
      r.req.Reset();
      l->Recv(tag, r.buf.data(), n, &r.req);
    }
    Barrier("throughput");
    const auto t0 = Clock::now();
    if (me == 0) {
      s.req.Reset();
      l->Send(tag, s.buf.data(), n, &s.req);
      Wait1(l, &s.req, "throughput: send");
    } else {
      Wait1(l, &r.req, "throughput: receive");
      const double gbs = n / Seconds(t0, Clock::now()) / 1e9;
      best = std::max(best, gbs);
      sum += gbs;
    }
  }
  if (me == 1) {
    CHECK(r.req.status().ok());
    CHECK(Verify(r.buf.data(), n, 600, 0) < 0);
    std::printf("throughput 64 MiB one way (parent -> child): best %.2f GB/s, mean %.2f GB/s\n",
                best, sum / reps);
  }
  best = sum = 0;
  for (int k = 0; k < reps; ++k) {
    const uint64_t tag = 700 + k;
    r.req.Reset();
    l->Recv(tag, r.buf.data(), n, &r.req);
    Barrier("throughput both ways");
    const auto t0 = Clock::now();
    s.req.Reset();
    l->Send(tag, s.buf.data(), n, &s.req);
    Wait(l, {&s.req, &r.req}, "throughput: both ways");
    const double gbs = 2.0 * n / Seconds(t0, Clock::now()) / 1e9;
    best = std::max(best, gbs);
    sum += gbs;
  }
  CHECK(r.req.status().ok());
  CHECK(Verify(r.buf.data(), n, 600, 1 - me) < 0);
  if (me == 0) {
    std::printf(
        "throughput 64 MiB both ways at once (sum of both directions, parent's view): "
        "best %.2f GB/s, mean %.2f GB/s\n",
        best, sum / reps);
  }
  std::fflush(stdout);
  Barrier("throughput: done");
}

// Single copy counted and reported on; then the child may no longer read the
// parent's memory (a seccomp filter makes process_vm_readv fail with EPERM,
// as in a container that forbids it): the parent's messages reach it through
// the ring, correct, and both ends say why single copy is off.
void TestSingleCopyRefused(Link* l, int me) {
  const size_t n = 3 * kMiB + 64;
  const uint64_t before = l->SingleCopyBytes();
  {
    Msg out(800, n), in(800, n);
    l->Recv(800, in.buf.data(), n, &in.req);
    Barrier("single copy: posted");
    PostSend(l, &out, me);
    Wait(l, {&out.req, &in.req}, "single copy: both ways");
    CheckRecv(&in, 1 - me, "single copy");
  }
  CHECK_MSG(l->SingleCopyBytes() - before == n, "single copy: bytes read in place " +
                                                    std::to_string(l->SingleCopyBytes() - before) +
                                                    ", expected " + std::to_string(n));
  CHECK_MSG(l->SingleCopy() == "on", l->SingleCopy());
  Barrier("single copy: checked");
  if (me == 1) {
    sock_filter filter[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_process_vm_readv, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    sock_fprog prog{sizeof(filter) / sizeof(filter[0]), filter};
    CHECK(::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0);
    CHECK(::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0);
  }
  Barrier("single copy: child forbidden");
  for (int round = 0; round < 2; ++round) {
    const uint64_t tag = 810 + round;
    Msg out(tag, n), in(tag, n);
    if (round == 0) {
      // Sent before its receive is posted: the child is refused when the
      // receive comes and reads the message in place.
      PostSend(l, &out, me);
      Barrier("refused: sent");
      l->Progress();
      l->Recv(tag, in.buf.data(), n, &in.req);
    } else {
      l->Recv(tag, in.buf.data(), n, &in.req);
      Barrier("refused: posted");
      PostSend(l, &out, me);
    }
    Wait(l, {&out.req, &in.req}, "refused: both ways");
    CheckRecv(&in, 1 - me, "refused: message through the ring");
  }
  const std::string why = l->SingleCopy();
  if (me == 1) {
    CHECK_MSG(why.rfind("off: this process may not read process", 0) == 0 &&
                  Contains(why, "Operation not permitted") && Contains(why, "ring"),
              why);
    CHECK_MSG(l->SingleCopyBytes() == before + n, "the child read in place while forbidden");
  } else {
    // The parent still reads the child's memory; the child asked it to use the ring.
    CHECK_MSG(why.rfind("off: process", 0) == 0 && Contains(why, "may not read this process's"),
              why);
    CHECK_MSG(l->SingleCopyBytes() == before + 3 * n, "the parent stopped reading in place");
  }
  std::printf("%s single copy: %s\n", me == 0 ? "parent" : "child", why.c_str());
  Barrier("refused: done");
}

// A waiter sleeps on the link's doorbell until the peer writes: woken at
// once, not at its timeout; a count that moved before it slept returns at
// once; with nothing happening it sleeps its whole timeout.
void TestDoorbell(Link* l, int me) {
  using std::chrono::duration;
  const uint64_t tag = 9001;
  Msg m(tag, 4096);
  Barrier("doorbell: start");
  if (me == 1) {
    l->Recv(tag, m.buf.data(), m.n, &m.req);
    uint32_t seen = l->Activity();
    l->Progress();
    CHECK_MSG(!m.req.done(), "doorbell: the message came before it was sent");
    Put('s');  // about to sleep
    const auto t0 = Clock::now();
    l->AwaitActivity(seen, 3000000);
    const double woke = duration<double>(Clock::now() - t0).count();
    CHECK_MSG(woke < 1.5, "doorbell: the waiter slept " + std::to_string(woke) +
                              " s although the peer wrote after 0.1 s");
    Wait1(l, &m.req, "doorbell: message");
    CheckRecv(&m, 0, "doorbell: message");
    // The count moved since `seen` (the peer wrote): no sleep at all.
    const auto t1 = Clock::now();
    l->AwaitActivity(seen, 3000000);
    CHECK_MSG(duration<double>(Clock::now() - t1).count() < 1.0,
              "doorbell: slept on a count that had already moved");
    // Nothing happens: the whole (short) timeout.
    seen = l->Activity();
    const auto t2 = Clock::now();
    l->AwaitActivity(seen, 20000);
    const double idle = duration<double>(Clock::now() - t2).count();
    CHECK_MSG(idle >= 0.015 && idle < 1.0,
              "doorbell: a 20 ms idle wait took " + std::to_string(idle) + " s");
  } else {
    Expect('s', "doorbell: peer asleep");
    ::usleep(100000);
    PostSend(l, &m, 0);
    Wait1(l, &m.req, "doorbell: send");
    CheckSent(&m, "doorbell");
  }
  Barrier("doorbell: done");
}

void RunScript(Link* l, Link* small, int me) {
  CHECK(l->Kind() == "shared memory");
  TestSizesPostedFirst(l, me);
  TestSizesPostedLate(l, me);
  TestPartialTakeover(l, me);
  TestTagsAndThreads(l, me);
  TestSizeMismatch(l, me);
  TestSameTag(l, me);
  TestInPlaceWaitsForItsReceive(l, me);
  TestCancel(l, me);
  TestSmallRing(small, me);
  TestThroughput(l, me);
  TestDoorbell(l, me);
  if (SingleCopy()) TestSingleCopyRefused(l, me);
  CHECK(l->PeerFailure().empty());
  CHECK(small->PeerFailure().empty());
  Barrier("script done");
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::string name, small_name;
  std::shared_ptr<ShmSegment> seg, small_seg;
  CHECK_OK(smddp::CreateShmSegment(smddp::DefaultShmRingBytes(), &name, &seg));
  CHECK_OK(smddp::CreateShmSegment(16 << 10, &small_name, &small_seg));
  CHECK(name.rfind("/jax_smddp-", 0) == 0 && name.size() == 11 + 32);
  CHECK(name != small_name);
  CHECK(ShmExists(name));
  int p2c[2], c2p[2];
  CHECK(::pipe(p2c) == 0 && ::pipe(c2p) == 0);
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t parent = ::getpid();
  pid_t pid = ::fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    smddp_test::Who() = "child";
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);
    g_in = p2c[0];
    g_out = c2p[1];
    ::close(p2c[1]);
    ::close(c2p[0]);
    seg.reset();  // the child maps the segments by name, as a real peer
    small_seg.reset();
    // Names arrive through the pipe.
    auto get_name = [] {
      std::string s;
      for (;;) {
        char c = Get("segment name");
        if (c == '\n') return s;
        s += c;
      }
    };
    std::string n1 = get_name(), n2 = get_name();
    std::shared_ptr<ShmSegment> mine, mine_small;
    CHECK_OK(smddp::OpenShmSegment(n1, &mine));
    CHECK_OK(smddp::OpenShmSegment(n2, &mine_small));
    Put('o');
    auto link = smddp::MakeShmLink(mine, false, parent);
    auto small = smddp::MakeShmLink(mine_small, false, parent);
    Expect('u', "unlinked");
    RunScript(link.get(), small.get(), 1);
    // An orderly close of the small link.
    small.reset();
    Put('x');
    Expect('d', "parent saw the close");
    // Die without closing the main link; the parent does not reap us yet.
    Put('e');
    std::fflush(stdout);
    ::_exit(0);
  }
  smddp_test::Peer() = pid;
  g_in = c2p[0];
  g_out = p2c[1];
  ::close(p2c[0]);
  ::close(c2p[1]);
  for (const std::string& n : {name, small_name}) {
    for (char c : n) Put(c);
    Put('\n');
  }
  Expect('o', "child opened the segments");
  // A third process (here: the parent again) cannot open a segment in use.
  {
    std::shared_ptr<ShmSegment> third;
    Status st = smddp::OpenShmSegment(name, &third);
    CHECK_MSG(!st.ok() && Contains(st.message(), "in use"), st.message());
  }
  CHECK_OK(smddp::UnlinkShmSegment(name));
  CHECK_OK(smddp::UnlinkShmSegment(small_name));
  CHECK_OK(smddp::UnlinkShmSegment(name));  // already gone: fine
  CHECK(!ShmExists(name) && !ShmExists(small_name));
  auto link = smddp::MakeShmLink(seg, true, pid);
  auto small = smddp::MakeShmLink(small_seg, true, pid);
  Put('u');
  RunScript(link.get(), small.get(), 0);

  // Orderly close: the child destroyed its end of the small link.
  Expect('x', "child closed the small link");
  {
    const auto t0 = Clock::now();
    std::string why;
    while ((why = small->PeerFailure()).empty() && Seconds(t0, Clock::now()) < 1) small->Progress();
    CHECK_MSG(Contains(why, "exited") && Contains(why, std::to_string(pid)),
              "orderly close: '" + why + "'");
    Msg r(1, 8);
    small->Recv(1, r.buf.data(), 8, &r.req);
    CHECK(r.req.done() && !r.req.status().ok());
    std::printf("orderly close seen: %s\n", why.c_str());
  }
  CHECK(link->PeerFailure().empty());
  Msg pending(900, 10);
  link->Recv(900, pending.buf.data(), 10, &pending.req);
  Put('d');

  // Peer death: the child _exits (no destructor) and stays a zombie.
  Expect('e', "child about to exit");
  {
    const auto t0 = Clock::now();
    std::string why;
    while ((why = link->PeerFailure()).empty() && Seconds(t0, Clock::now()) < 1) {
      link->Progress();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    const double took = Seconds(t0, Clock::now());
    CHECK_MSG(!why.empty(), "dead child not noticed within 1 s");
    CHECK_MSG(Contains(why, std::to_string(pid)), why);
    CHECK_MSG(pending.req.done() && !pending.req.status().ok(),
              "a receive pending on a dead peer's link did not fail");
    std::printf("peer death seen after %.1f ms: %s\n", took * 1e3, why.c_str());
  }
  int status = 0;
  CHECK(::waitpid(pid, &status, 0) == pid);
  smddp_test::Peer() = 0;
  CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0,
            "child failed (status " + std::to_string(status) + ")");
  link.reset();
  small.reset();
  seg.reset();
  small_seg.reset();
  CHECK(!ShmExists(name) && !ShmExists(small_name));
  // Others' segments (concurrent runs) are only reported.
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d)) {
      if (std::strncmp(e->d_name, "jax_smddp-", 10) == 0) {
        std::printf("note: /dev/shm/%s exists (not this test's)\n", e->d_name);
      }
    }
    ::closedir(d);
  }
  std::printf("shm_link_test: all checks passed\n");
  return 0;
}

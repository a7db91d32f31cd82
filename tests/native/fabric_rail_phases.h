// fabric_link_test.cc's phases of FabricRail links: tagged zero-copy messages between
// registered buffers. No jax; inline, one translation unit per program.
#ifndef JAX_SMDDP_TESTS_NATIVE_FABRIC_RAIL_PHASES_H_
#define JAX_SMDDP_TESTS_NATIVE_FABRIC_RAIL_PHASES_H_

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
#include "tests/native/fabric_messages.h"
#include "xla_ffi/transports/fabric_link.h"
#include "xla_ffi/transports/fabric_rail.h"

namespace fabric_rail_phases {

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
using fabric_harness::SwapStrings;
using fabric_harness::Wait;
using fabric_harness::WriteAll;
using fabric_messages::kMiB;
using fabric_messages::kSizes;

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

inline void FillAt(char* p, size_t n, uint64_t tag, int from) {
  std::vector<char> v(n);
  Fill(v, tag, from);
  std::memcpy(p, v.data(), n);
}
inline long long VerifyAt(const char* p, size_t n, uint64_t tag, int from) {
  return Verify(std::vector<char>(p, p + n), tag, from);
}

inline void RailTests(Link* control, int me, const std::string& provider, const std::string& node) {
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

}  // namespace fabric_rail_phases

#endif  // JAX_SMDDP_TESTS_NATIVE_FABRIC_RAIL_PHASES_H_

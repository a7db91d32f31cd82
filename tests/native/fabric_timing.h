// fabric_link_test.cc's phases that time a link: a waiter woken by the peer's data, the
// throughput and the latency of one exchange. No jax; inline, one translation unit per program.
#ifndef JAX_SMDDP_TESTS_NATIVE_FABRIC_TIMING_H_
#define JAX_SMDDP_TESTS_NATIVE_FABRIC_TIMING_H_

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

namespace fabric_timing {

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
using fabric_messages::Direct;
using fabric_messages::kMiB;

// A waiter asleep on the link (AwaitActivity, as the engine's calls wait,
// with a bound of 2 s here) is woken by the peer's data, and only then, when
// the endpoint sleeps on its completion queue's descriptor; otherwise it
// sleeps the bound. tcp;ofi_rxm must give the descriptor (JAX_SMDDP_FABRIC_WAIT=fd, the
// default), and "sleep" must sleep. Then 20 more wake-ups while another thread
// progresses the link (a concurrent call, the drainer) and may read what the
// waiter's descriptor announced: the waiter must still wake.
inline void Wakes(Link* link, int me, const FabricEndpoint& ep) {
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

inline void Throughput(Link* link, int me, const std::string& provider) {
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
inline void Latency(Link* link, int me) {
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

}  // namespace fabric_timing

#endif  // JAX_SMDDP_TESTS_NATIVE_FABRIC_TIMING_H_

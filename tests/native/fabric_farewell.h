// fabric_link_test.cc's phase of farewells (peer_watch.h's Farewell) over a link and a second
// connection between the two processes. No jax; inline, one translation unit per program.
#ifndef JAX_SMDDP_TESTS_NATIVE_FABRIC_FAREWELL_H_
#define JAX_SMDDP_TESTS_NATIVE_FABRIC_FAREWELL_H_

#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "tests/native/check.h"
#include "tests/native/fabric_data.h"
#include "tests/native/fabric_harness.h"
#include "xla_ffi/transports/link.h"
#include "xla_ffi/transports/peer_watch.h"

namespace fabric_farewell {

using fabric_data::Fill;
using fabric_data::Verify;
using fabric_harness::CheckOk;
using fabric_harness::Log;
using fabric_harness::ProgressUntil;
using fabric_harness::Wait;
using smddp::Link;
using smddp::Request;

// A peer that said farewell (peer_watch.h: its program ended) has not failed: what it sent
// before still arrives, and each side's farewell ends the other's wait. The child says it
// with its last message still unreceived, as a process whose collectives finished while a
// peer on another host was still receiving; the parent looks only 0.3 s later.
inline void Farewells(Link* link, int me, int farewell_fd) {
  std::vector<char> out(1000), in(1000);
  Fill(out, 950, me);
  if (me == 1) {
    Request s;
    link->Send(950, out.data(), out.size(), &s);
    std::vector<int> silent{-1};
    std::thread bye(
        [&] { silent = smddp::Farewell({{0, farewell_fd}}, std::chrono::seconds(20)); });
    ProgressUntil(link, s, 30);  // a direct send waits for the parent's receive
    bye.join();
    CheckOk(s, "the last send before a farewell");
    CHECK(silent.empty(), "the farewell waited in vain for the parent's");
    return;
  }
  ::usleep(300000);
  const std::string failure = link->PeerFailure();
  CHECK(failure.empty(), "a peer that said farewell counts as failed: %s", failure.c_str());
  Request r;
  link->Recv(950, in.data(), in.size(), &r);
  Wait(link, {&r}, 30, "a message sent before its sender's farewell");
  CheckOk(r, "a message sent before its sender's farewell");
  CHECK(Verify(in, 950, 1) < 0, "wrong data from a peer that said farewell");
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<int> silent = smddp::Farewell({{1, farewell_fd}}, std::chrono::seconds(20));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(silent.empty() && s < 5, "a farewell answering the peer's took %.1f s (%zu silent)", s,
        silent.size());
  Log("farewell: the peer's last message arrived after it; answered in %.3f s", s);
}

}  // namespace fabric_farewell

#endif  // JAX_SMDDP_TESTS_NATIVE_FABRIC_FAREWELL_H_

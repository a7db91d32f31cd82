// Standalone test of FabricEndpoint / FabricLink (no jax): forks a child,
// both open an endpoint of the provider named in argv[1], exchange addresses
// through pipes, connect, and run the phases in lockstep (fabric_messages.h, fabric_timing.h,
// then the kill and the errors below). Where the provider offers FI_HMEM (shm here), the same for
// FabricRail links over registered host memory (fabric_rail_phases.h); then farewells
// (fabric_farewell.h). Exits 0 on success; prints GB/s for 64 MiB messages.
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
#include "tests/native/fabric_messages.h"
#include "tests/native/fabric_rail_phases.h"
#include "tests/native/fabric_regions.h"
#include "tests/native/fabric_timing.h"
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
using fabric_harness::SwapStrings;
using fabric_harness::Wait;
using fabric_harness::WriteAll;
using fabric_messages::Announced;
using fabric_messages::Cancels;
using fabric_messages::Direct;
using fabric_messages::ExchangeSizes;
using fabric_messages::kMiB;
using fabric_messages::SizeMismatch;
using fabric_messages::TagOrder;
using fabric_messages::Threads;
using fabric_rail_phases::RailTests;
using fabric_timing::Latency;
using fabric_timing::Throughput;
using fabric_timing::Wakes;

namespace {

int g_watch_fd = -1;     // the parent's end of a connection the child's exit closes (WatchLink)
int g_farewell_fd = -1;  // this process's end of a second one (fabric_farewell.h)

std::unique_ptr<FabricEndpoint> OpenEndpoint(const std::string& provider, const std::string& node) {
  std::unique_ptr<FabricEndpoint> ep;
  Status st = FabricEndpoint::Open(provider, node, &ep);
  CHECK(st.ok(), "Open(%s): %s", provider.c_str(), st.message().c_str());
  return ep;
}

std::unique_ptr<Link> Handshake(FabricEndpoint* ep, const char* peer_name) {
  const std::string theirs = SwapStrings(ep->Address());
  std::unique_ptr<Link> link;
  Status st = ep->Connect(theirs, peer_name, &link);
  CHECK(st.ok(), "Connect: %s", st.message().c_str());
  return link;
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

// The GPU communicators across hosts (cuda/gpu_hierarchy.cc) and the network
// proxy (xla_ffi/algorithms/net_port.h) on CPU processes, against the mock
// node's CUDA runtime (gpu_communicator_harness.h), each process on a GPU of
// its own.
//
//   gpu_hosts_test hosts|hosts_dead|hosts_2x2 staging|rail
//
// Two hosts of one process each (hosts_2x2: two each) over the multi-process
// world's real bootstrap (libfabric shm links, a TCP watch): the
// hierarchical all_gather and reduce_scatter with their network slots staged
// through the world's links, or ("rail") in (mock) device memory registered
// with the process's FabricRail; hosts_dead then kills process 1 mid-call.
//
//   gpu_hosts_test proxy_shut|proxy_progress
//
// The network proxy alone: its exit wait (NetworkProxy::Shut) and its
// progress (each progress key once a round). Prints "all checks passed" and
// exits 0 on success.
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>  // the mock node: inputs in "device memory"

#include "cuda/buffer_ipc.h"
#include "cuda/gpu_communicator.h"
#include "cuda/gpu_hierarchy.h"
#include "tests/native/check.h"
#include "tests/native/fabric_regions.h"
#include "tests/native/gpu_communicator_harness.h"
#include "tests/native/host_stream_ops.h"
#include "xla_ffi/algorithms/net_port.h"
#include "xla_ffi/algorithms/stream_algorithms.h"
#include "xla_ffi/engine/buffer_exchange.h"
#include "xla_ffi/engine/communicator.h"  // SetTimeoutSeconds
#include "xla_ffi/transports/link.h"
#include "xla_ffi/transports/world.h"

namespace {

using namespace gpu_test;  // NOLINT: the harness is this test's vocabulary

// --- Groups across hosts ----------------------------------------------------

// Through the parent: sends mine, returns every process's (mine included).
std::vector<std::string> AllStrings(int p, int up, int down, const std::string& mine, int n) {
  std::vector<std::string> all(n);
  Expect(p, WriteBytes(up, mine), "relay through the parent");
  for (auto& s : all) Expect(p, ReadBytes(down, &s), "relay through the parent");
  return all;
}

void Check(int p, const Status& st, const std::string& what) {
  Expect(p, st.ok(), what + ": " + st.message());
}

// Process p of 2 hosts x L (host p / L, rail p % L; group rank p, host-major).
int RunHost(int p, int L, bool rail, bool die, int up, int down) {
  const int P = 2 * L, h = p / L, j = p % L;
  gpu::SetProcessIndex(p);
  setenv("JAX_SMDDP_MOCK_DEVICES", std::to_string(j).c_str(), 1);  // its host's GPU j
  // The world, as jax_smddp.initialize() builds it, every process its own
  // "host" to the world (libfabric shm links and a TCP watch between all).
  Check(p, smddp::WorldBegin(p, P), "WorldBegin");
  const auto pids = AllStrings(p, up, down, std::to_string(getpid()), P);
  for (int q = 0; q < P; ++q)
    Check(p, smddp::WorldSetPeer(q, std::stoi(pids[q]), "proc" + std::to_string(q)),
          "WorldSetPeer");
  std::string address, provider, watch;
  Check(p, smddp::WorldOpenFabric("shm", "", &address, &provider), "WorldOpenFabric");
  Check(p, smddp::WorldWatchListen("127.0.0.1", &watch), "WorldWatchListen");
  const auto addresses = AllStrings(p, up, down, address, P);
  const auto watches = AllStrings(p, up, down, watch, P);
  std::vector<int> higher;
  for (int q = 0; q < P; ++q) {
    if (q == p) continue;
    Check(p, smddp::WorldConnectFabric(q, addresses[q]), "WorldConnectFabric");
    if (q < p) Check(p, smddp::WorldWatchConnect(q, watches[q]), "WorldWatchConnect");
    if (q > p) higher.push_back(q);
  }
  Check(p, smddp::WorldWatchAccept(higher), "WorldWatchAccept");
  Check(p, smddp::WorldStart(), "WorldStart");

  // This host's communicator (its L processes, CUDA IPC through the mock),
  // then the group across both hosts.
  std::vector<int64_t> members, intra;
  std::vector<int> host_of, process_of, rank_of;
  for (int r = 0; r < P; ++r) {
    members.push_back(30 + r);
    host_of.push_back(r / L);
    process_of.push_back(r);
    rank_of.push_back(r);
    if (r / L == h) intra.push_back(30 + r);
  }
  std::vector<std::pair<int, std::string>> handles;
  Check(p, gpu::PrepareCommunicator(intra, 4096, {{j, 0}}, L, &handles), "prepare");
  const auto all_handles = AllStrings(p, up, down, handles.empty() ? "" : handles[0].second, P);
  std::vector<std::pair<int, std::string>> remote;
  for (int x = 0; x < L; ++x)
    if (x != j) remote.emplace_back(x, all_handles[h * L + x]);
  Check(p, gpu::ConnectCommunicator(intra, remote), "connect");
  std::vector<std::string> rails;
  if (rail) {
    std::string mine;
    Check(p, gpu::OpenDeviceRail(0, &mine), "OpenDeviceRail");
    rails = AllStrings(p, up, down, mine, P);
  }
  bool gdrcopy = true, on_rail = !rail;
  Check(p,
        gpu::PrepareHierarchy(members, host_of, process_of, {{p, 0}}, intra, 4096, rails, &gdrcopy,
                              &on_rail),
        "PrepareHierarchy");
  // JAX_SMDDP_TEST_EXPECT_GDRCOPY: the test put a mock libgdrapi on the
  // library path; the signals are then the mock's device memory, which the
  // proxy writes through a second mapping.
  const bool want_gdrcopy = std::getenv("JAX_SMDDP_TEST_EXPECT_GDRCOPY") != nullptr;
  Expect(p, on_rail == rail && gdrcopy == want_gdrcopy, "slots or signals not where asked");
  gpu::GpuHierarchy* hier = gpu::FindHierarchy(gpu::GroupKey(members.data(), P));
  gpu::GpuHierarchy::Member* m = hier ? hier->Find(p) : nullptr;
  Expect(p, m && m->port && m->local, "no network port");
  smddp::NetPort& port = *m->port;
  const std::string kind = port.links[1 - h]->Kind();
  Expect(p, kind.find(rail ? "no staging" : "libfabric shm") != std::string::npos,
         "the port's link is " + kind);
  Expect(p, port.peer_process[1 - h] == (1 - h) * L + j, "the rail peer is not the same rail");
  Expect(p,
         rail == (port.slots_stream != port.mailbox_stream + port.layout.flag_bytes) &&
             rail == bool(port.poison),
         "the slots are not where the mode puts them");
  Expect(p, want_gdrcopy == (port.signals_proxy != port.signals_stream),
         "the signals are not where the mode puts them");
  if (want_gdrcopy)
    Expect(p, reinterpret_cast<uintptr_t>(port.signals_stream) % (64 << 10) == 0,
           "GDRCopy signals do not start a 64 KiB GPU page");
  char c = 'c';
  Expect(p, WriteAll(up, &c, 1) && ReadAll(down, &c, 1), "barrier");

  smddp::HostStreamOps ops(20);
  for (int call = 0; call < 4; ++call) {
    // all_gather: rows of 6000 bytes through 4 KiB slots (pieces of rows).
    const size_t outer = 3, n = 1500;
    std::vector<float> send(outer * n), recv(outer * P * n);
    for (size_t i = 0; i < send.size(); ++i) send[i] = Input(p, i + call);
    Check(p,
          smddp::RunStreamHierarchicalAllGather(outer, n * 4, m->local->view, port, rank_of, ops,
                                                send.data(), recv.data()),
          "hierarchical all_gather");
    for (size_t o = 0; o < outer; ++o)
      for (int r = 0; r < P; ++r)
        for (size_t i = 0; i < n; ++i)
          Expect(p, recv[(o * P + r) * n + i] == Input(r, o * n + i + call),
                 "hierarchical all_gather value");
    // reduce_scatter: [2, P, 700] -> [2, 700], sum.
    const size_t k = 700;
    std::vector<float> in(2 * P * k), out(2 * k);
    for (size_t i = 0; i < in.size(); ++i) in[i] = Input(p, i + call);
    Check(p,
          smddp::RunStreamHierarchicalReduceScatter(2, k, smddp::DType::kFloat32,
                                                    smddp::ReduceOp::kSum, m->local->view, port,
                                                    rank_of, ops, in.data(), out.data()),
          "hierarchical reduce_scatter");
    for (size_t o = 0; o < 2; ++o)
      for (size_t i = 0; i < k; ++i) {
        float want = 0;
        for (int r = 0; r < P; ++r) want += Input(r, (o * P + p) * k + i + call);
        Expect(p, out[o * k + i] == want, "hierarchical reduce_scatter value");
      }
    // all_to_all: [3, P, 500] -> [3, P, 500], rows of P x 2000 bytes in pieces.
    const size_t b = 500;
    std::vector<float> blocks(3 * P * b), swapped(3 * P * b);
    for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = Input(p, i + call);
    Check(p,
          smddp::RunStreamHierarchicalAllToAll(3, b * 4, m->local->view, port, rank_of, ops,
                                               blocks.data(), swapped.data()),
          "hierarchical all_to_all");
    for (size_t o = 0; o < 3; ++o)
      for (int r = 0; r < P; ++r)
        for (size_t i = 0; i < b; ++i)
          Expect(p, swapped[(o * P + r) * b + i] == Input(r, (o * P + p) * b + i + call),
                 "hierarchical all_to_all value");
  }
  Expect(p, !port.proxy->failed(), "the proxy failed: " + port.proxy->error().message());
  {
    // The world counts what the port moved (jax_smddp.traffic()): per call,
    // this rank's all_gather input to its rail peer, the reduce_scatter
    // partial sums of the peer's shards (2 x 700 floats), and the all_to_all
    // blocks of this host's L ranks for the peer (3 x L x 500 floats). The
    // last step is counted just after the stream may have seen its data.
    const auto world = smddp::CurrentWorld();
    const int peer = (1 - h) * L + j;
    const uint64_t want = 4 * (3 * 1500 * 4 + 2 * 700 * 4 + 3 * L * 500 * 4);
    for (int spin = 0; spin < 500 && world->sent(peer) < want; ++spin)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    Expect(p, world->sent(peer) == want && world->received(peer) == want,
           "the world counted " + std::to_string(world->sent(peer)) + " bytes sent and " +
               std::to_string(world->received(peer)) + " received, not " + std::to_string(want));
  }
  Expect(p, WriteAll(up, &c, 1) && ReadAll(down, &c, 1), "barrier");
  if (die) {  // 1 rank per host: process 1 dies
    if (p == 1) raise(SIGKILL);
    // Process 0's next call: the proxy sees the peer gone (the world's watch,
    // also behind a rail link), releases the stream and poisons what never
    // arrived; the call after fails naming the peer.
    const size_t n = 1000;
    std::vector<float> send(n, 1.0f), recv(2 * n, 0.0f);
    const auto t0 = std::chrono::steady_clock::now();
    Check(p,
          smddp::RunStreamHierarchicalAllGather(1, n * 4, m->local->view, port, rank_of, ops,
                                                send.data(), recv.data()),
          "the call in flight when the peer died");
    for (size_t i = 0; i < n; ++i) {
      uint32_t bits;
      std::memcpy(&bits, &recv[n + i], 4);
      Expect(p, bits == 0xFFFFFFFFu, "what never arrived is not poisoned");
      Expect(p, recv[i] == 1.0f, "this host's own part is wrong");
    }
    for (int spin = 0; spin < 500 && !port.proxy->failed(); ++spin)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    const Status next = smddp::RunStreamHierarchicalAllGather(
        1, n * 4, m->local->view, port, rank_of, ops, send.data(), recv.data());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    Expect(p, !next.ok() && next.message().find("peer process 1") != std::string::npos,
           "the next call did not fail naming the peer: " + next.message());
    Expect(p, s < 10, "took " + std::to_string(s) + " s");
    std::printf("process 0: %s\n", next.message().c_str());
  } else {
    Expect(p, WriteAll(up, &c, 1) && ReadAll(down, &c, 1), "end barrier");
  }
  // The job's exit (jax_smddp/gpu.py's hook, jax_smddp.distributed's): every
  // libfabric endpoint closes, so none leaves a region in /dev/shm, and a
  // later network step fails instead of using a closed link.
  Expect(p, gpu::CloseCommunicatorsAtExit(), "the network proxy did not go idle at exit");
  smddp::WorldShutdown();
  Expect(p, FabricRegionsOf(getpid()) == 0,
         std::to_string(FabricRegionsOf(getpid())) + " libfabric regions left in /dev/shm");
  if (!die) {
    std::vector<float> send(100, 1.0f), recv(100 * P);
    const Status late = smddp::RunStreamHierarchicalAllGather(1, 400, m->local->view, port, rank_of,
                                                              ops, send.data(), recv.data());
    Expect(p, !late.ok() && late.message().find("exiting") != std::string::npos,
           "a call after the network closed: " + late.message());
  }
  gpu::ReleaseCommunicators();
  for (auto& d : device_buffers) d.Free();
  std::printf("process %d: ok\n", p);
  std::fflush(stdout);
  _exit(0);  // the proxy thread stays up until exit, as in a job
}

// A link on which nothing ever arrives (it counts what was asked of it).
class SilentLink : public smddp::Link {
 public:
  void Send(uint64_t, const void*, size_t, smddp::Request*) override { ++asked; }
  void Recv(uint64_t, void*, size_t, smddp::Request*) override { ++asked; }
  void Progress() override {}
  void Cancel(smddp::Request* req) override { req->Complete(Status::Error("cancelled")); }
  std::string PeerFailure() override { return ""; }
  std::string Kind() const override { return "silent"; }
  std::atomic<int> asked{0};
};

// NetworkProxy::Shut, what the exit hook relies on: it refuses while a step
// runs (here one whose stream never posts, until its 1.5 s deadline), then
// goes idle once that step failed; after Shut, a step only releases its
// flags and never touches the links.
// Checks that report every failure and remember whether any failed.
struct Checks {
  bool ok = true;
  void operator()(bool c, const std::string& what) {
    if (!c) std::printf("FAILED: %s\n", what.c_str());
    std::fflush(stdout);
    ok &= c;
  }
  int Exit() const {
    if (ok) std::printf("all checks passed\n");
    return ok ? 0 : 1;
  }
};

// A network port in host memory whose host 0 is this one and host k > 0 is
// reached over links[k] (its proxy still to be set).
struct MockPort {
  explicit MockPort(std::vector<smddp::Link*> links)
      : layout(int(links.size()), 256),
        mailbox(layout.mailbox_bytes),
        signals(layout.signal_bytes) {
    port.hosts = int(links.size());
    port.layout = layout;
    port.mailbox_stream = port.mailbox_proxy = mailbox.data();
    port.signals_stream = port.signals_proxy = signals.data();
    port.slots_stream = port.slots_proxy = mailbox.data() + layout.flag_bytes;
    port.links = std::move(links);
    for (int k = 0; k < port.hosts; ++k) port.peer_process.push_back(k);
  }
  const smddp::NetLayout layout;
  std::vector<uint8_t> mailbox, signals;
  smddp::NetPort port;
};

int ProxyShut() {
  Checks expect;
  SilentLink silent;
  MockPort mock({nullptr, &silent});  // outlives the proxy, whose thread may still hold it
  smddp::NetPort& port = mock.port;
  smddp::NetworkProxy proxy(1.5);
  port.proxy = &proxy;
  const smddp::NetLayout& layout = mock.layout;
  proxy.Enqueue(&port, 1, 64);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  auto t0 = std::chrono::steady_clock::now();
  expect(!proxy.Shut(0.3, "exiting"), "Shut went through while a step ran");
  const double busy = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  expect(busy >= 0.25 && busy < 1.0, "Shut waited " + std::to_string(busy) + " s, not 0.3");
  expect(!proxy.failed(), "a refused Shut failed the proxy");
  expect(proxy.Shut(5, "exiting"), "Shut did not go through once the step ended");
  expect(proxy.error().message().find("timed out waiting for the GPU") != std::string::npos,
         "the first failure is not the step's: " + proxy.error().message());
  const int asked = silent.asked.load();
  proxy.Enqueue(&port, 2, 64);
  const uint32_t* done = port.host_side<uint32_t>(layout.done(), true);
  for (int i = 0; i < 500 && __atomic_load_n(done, __ATOMIC_ACQUIRE) != 2; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  expect(__atomic_load_n(done, __ATOMIC_ACQUIRE) == 2,
         "a step after Shut did not release its flags");
  expect(silent.asked.load() == asked, "a step after Shut used the links");
  // An idle proxy shuts at once, and its error says why later steps fail.
  smddp::NetworkProxy idle(1.5);
  t0 = std::chrono::steady_clock::now();
  expect(idle.Shut(5, "this process is exiting"), "an idle proxy did not shut");
  expect(std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(200),
         "shutting an idle proxy waited");
  expect(idle.failed() && idle.error().message() == "this process is exiting",
         "no error after Shut");
  return expect.Exit();
}

int Hosts(int L, bool rail, bool die) {
  const int P = 2 * L;
  signal(SIGPIPE, SIG_IGN);  // a process that failed closed its pipe: clean up, not die
  Children kids;
  if (!Spawn(P, [&](int p, int up, int down) { return RunHost(p, L, rail, die, up, down); }, &kids))
    return 2;
  const auto &pids = kids.pids, &ups = kids.ups, &downs = kids.downs;
  alarm(90);
  // Relay rounds (pids, fabric addresses, watch addresses, IPC handles, rail
  // addresses): every process gets every process's string, then barriers.
  bool relayed = true;  // false: a process failed during set-up (it said why)
  for (int round = 0; relayed && round < (rail ? 5 : 4); ++round) {
    std::vector<std::string> got(P);
    for (int p = 0; relayed && p < P; ++p) relayed = ReadBytes(ups[p], &got[p]);
    for (int p = 0; relayed && p < P; ++p)
      for (int q = 0; q < P; ++q) WriteBytes(downs[p], got[q]);
  }
  char c;
  for (int round = 0; relayed && round < (die ? 2 : 3); ++round) {
    // A killed process (hosts_dead) ends its barriers by closing its pipe.
    for (int p = 0; p < P; ++p) relayed &= ReadAll(ups[p], &c, 1) || (die && p == 1);
    for (int p = 0; relayed && p < P; ++p) WriteAll(downs[p], "g", 1);
  }
  if (!relayed)
    for (pid_t pid : pids) kill(pid, SIGKILL);  // the others wait on the relay
  bool ok = relayed;
  for (int p = 0; p < P; ++p) {
    int status = 0;
    waitpid(pids[p], &status, 0);
    const bool killed = die && p == 1;
    ok &= killed ? WIFSIGNALED(status) : WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  for (pid_t pid : pids) {  // also after a failure: nothing left in /dev/shm
    mock_node::RemoveMemoryOf(pid);
    RemoveFabricRegionsOf(pid);  // the killed process's (the others checked theirs are gone)
  }
  if (ok) std::printf("all checks passed\n");
  return ok ? 0 : 1;
}

// A silent link that counts its progress calls, under a progress key it may
// share with others (as the hosts of one libfabric endpoint do).
class KeyedLink : public SilentLink {
 public:
  explicit KeyedLink(const void* key) : key_(key) {}
  void Progress() override { ++progressed; }
  const void* ProgressKey() const override { return key_; }
  std::atomic<int> progressed{0};

 private:
  const void* key_;
};

// A step progresses each progress key once a round, not each host: four
// hosts, two of whose links share a key, through both of a step's waits
// (for the stream to post, then for the exchange), each until it times out.
int ProxyProgress() {
  Checks expect;
  for (bool posted : {false, true}) {
    const std::string wait = posted ? "the exchange" : "the stream";
    int shared_key = 0, own_key = 0;
    KeyedLink a(&shared_key), b(&shared_key), c(&own_key);
    MockPort mock({nullptr, &a, &b, &c});  // outlives the proxy
    smddp::NetPort& port = mock.port;
    smddp::NetworkProxy proxy(0.3);
    port.proxy = &proxy;
    const smddp::NetLayout& layout = mock.layout;
    // The stream posted step 1 already: the step goes on to the exchange.
    if (posted) __atomic_store_n(port.host_side<uint32_t>(layout.posted()), 1u, __ATOMIC_RELEASE);
    proxy.Enqueue(&port, 1, 64);
    expect(proxy.Shut(5, "done"), "the step did not end");
    const std::string err = proxy.error().message();
    expect(err.find(posted ? "exchanging with the other hosts" : "waiting for the GPU") !=
               std::string::npos,
           "waiting for " + wait + ": " + err);
    const int pa = a.progressed.load(), pb = b.progressed.load(), pc = c.progressed.load();
    expect(pa > 100 && pc > 100, "waiting for " + wait + ": a link was not progressed (" +
                                     std::to_string(pa) + ", " + std::to_string(pc) + ")");
    expect(pb == 0, "waiting for " + wait + ": a link whose key was progressed already was " +
                        "progressed again, " + std::to_string(pb) + " times");
    // Each key about once a round: the shared key as often as the lone one.
    expect(pa <= pc + 1 && pc <= pa + 1, "waiting for " + wait + ": keys progressed unevenly (" +
                                             std::to_string(pa) + ", " + std::to_string(pc) + ")");
  }
  return expect.Exit();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 && argc != 2) {
    std::fprintf(
        stderr, "usage: %s hosts|hosts_dead|hosts_2x2 staging|rail, or proxy_shut|proxy_progress\n",
        argv[0]);
    return 2;
  }
  const std::string scenario = argv[1];
  if (scenario == "proxy_shut") return ProxyShut();
  if (scenario == "proxy_progress") return ProxyProgress();
  if (argc == 3 && (scenario == "hosts" || scenario == "hosts_dead" || scenario == "hosts_2x2"))
    return Hosts(scenario == "hosts_2x2" ? 2 : 1, std::string(argv[2]) == "rail",
                 scenario == "hosts_dead");
  std::fprintf(stderr, "no scenario %s\n", scenario.c_str());
  return 2;
}

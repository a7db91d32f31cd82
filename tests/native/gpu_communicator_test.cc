// The GPU communicators' set-up and per-call checks
// (cuda/gpu_communicator.cc, cuda/gpu_hierarchy.cc) on CPU processes, built against the
// mock node's CUDA runtime (tests/native/mock_node; no GPU here or in CI): each
// rank is a forked process with a GPU of its own that prepares its staging,
// trades handles with the others through the parent, connects, then runs the
// stream protocol with HostStreamOps over the communicator's own views (the
// regions and, with host flag memory, the shared flag blocks it mapped). What
// a GPU adds (the real CUDA calls) is tested by tests/gpu on a GPU machine.
//
//   gpu_communicator_test SCENARIO device|host
//
// SCENARIO: collectives (every op, several calls, against expected values),
// dead_peer (the last rank is SIGKILLed after connecting), closed (it marks
// its groups closed and stays alive), stalled (it stays alive and never
// calls: the 2 s progress deadline), mismatch (rank 1's second call
// differs), two_per_process (2 processes x 2 ranks: collectives, then one
// process dies), direct (collectives with JAX_SMDDP_GPU_DIRECT_READS=1: the
// buffers in mock device memory, exchanged per call and read in place; then
// a call where rank 1's input cannot be shared, which every rank stages),
// direct_dead_peer (the last rank dies; the others wait for its buffers in
// the exchange), direct_two_per_process (two_per_process with direct reads:
// local peers' buffers used as they are, the other process's mapped),
// direct_in_process (one process, 3 ranks on threads), direct_in_process_late
// (the same, one rank late for a call: the group fails at once for all),
// direct_map_fails
// (rank 2 cannot map its peers' buffers: it releases them), direct_disagree
// (rank 2's allocator rules direct reads out: every rank's set-up fails
// naming the disagreement). Prints "all checks passed" and exits 0 on success.
// Groups across hosts and the network proxy: gpu_hosts_test.cc.
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

// Checks the call with the communicator, runs it, returns the run's status.
Status Run(gpu::LocalRank* me, const Plan& plan, const std::vector<float>& send,
           std::vector<float>* recv, double timeout_s) {
  Status st = gpu::CheckCall(*me, Name(plan.kind), plan);
  if (!st.ok()) return st;
  const void* input = send.data();
  void* output = recv->data();
  const size_t in_bytes = send.size() * sizeof(float), out_bytes = recv->size() * sizeof(float);
  DeviceBuffers& d = device_buffers[me->view.rank % 4];
  if (me->exchange) {
    for (void*& a : d.allocation)
      if (!a && cudaMalloc(&a, DeviceBuffers::kBytes) != cudaSuccess)
        return Status::Error("cudaMalloc");
    if (in_bytes + 256 * 6 > DeviceBuffers::kOutputs ||
        out_bytes + 256 * 4 > DeviceBuffers::kOutputs)
      return Status::Error("buffers too big");
    auto* in = static_cast<uint8_t*>(d.allocation[d.calls % 2]) + 256 * (d.calls % 7);
    auto* out = static_cast<uint8_t*>(d.allocation[(d.calls + 1) % 2]) + DeviceBuffers::kOutputs +
                256 * (d.calls % 5);
    d.calls++;
    if (!d.heap_input) {
      std::memcpy(in, send.data(), in_bytes);
      input = in;
    }
    output = out;
  }
  smddp::HostStreamOps ops(timeout_s);
  st = gpu::ExchangeBuffers(*me, plan, input, output);
  if (!st.ok()) {  // as the handler does: peers may already read in place
    smddp::ReleaseEveryoneWaitingOn(me->view, ops);
    return st;
  }
  if (me->exchange && !d.staged && me->view.inputs.empty())
    return Status::Error("the call staged where every rank could share its buffers");
  st = smddp::RunStreamPlan(plan, me->view, ops, input, output);
  if (output != recv->data()) std::memcpy(recv->data(), output, out_bytes);
  return st;
}

void Collectives(int r, gpu::LocalRank* me, int P = kRanks) {
  for (int call = 0; call < 3; ++call) {
    // all_gather: [2, P, 300] from [2, 300] per rank (several steps per call: 4 KiB slots).
    {
      const size_t outer = 2, n = 300;
      std::vector<float> send(outer * n), recv(outer * P * n);
      for (size_t i = 0; i < send.size(); ++i) send[i] = Input(r, i + call);
      Status st = Run(me, MakePlan(Collective::kAllGather, outer, n * 4, 0), send, &recv, 20);
      Expect(r, st.ok(), "all_gather: " + st.message());
      for (size_t o = 0; o < outer; ++o)
        for (int q = 0; q < P; ++q)
          for (size_t i = 0; i < n; ++i)
            Expect(r, recv[(o * P + q) * n + i] == Input(q, o * n + i + call), "all_gather value");
    }
    // reduce_scatter: [1, P, 500] -> [1, 500], sum.
    {
      const size_t n = 500;
      std::vector<float> send(P * n), recv(n);
      for (size_t i = 0; i < send.size(); ++i) send[i] = Input(r, i + call);
      Status st = Run(me, MakePlan(Collective::kReduceScatter, 1, n, 0), send, &recv, 20);
      Expect(r, st.ok(), "reduce_scatter: " + st.message());
      for (size_t i = 0; i < n; ++i) {
        float want = 0;
        for (int q = 0; q < P; ++q) want += Input(q, r * n + i + call);
        Expect(r, recv[i] == want, "reduce_scatter value");
      }
    }
    // all_reduce of 1001 elements (uneven shards).
    {
      const size_t n = 1001;
      std::vector<float> send(n), recv(n);
      for (size_t i = 0; i < n; ++i) send[i] = Input(r, i + call);
      Status st = Run(me, MakePlan(Collective::kAllReduce, 1, 0, n), send, &recv, 20);
      Expect(r, st.ok(), "all_reduce: " + st.message());
      for (size_t i = 0; i < n; ++i) {
        float want = 0;
        for (int q = 0; q < P; ++q) want += Input(q, i + call);
        Expect(r, recv[i] == want, "all_reduce value");
      }
    }
    // all_to_all: [1, P, 200] per rank.
    {
      const size_t n = 200;
      std::vector<float> send(P * n), recv(P * n);
      for (size_t i = 0; i < send.size(); ++i) send[i] = Input(r, i + call);
      Status st = Run(me, MakePlan(Collective::kAllToAll, 1, n * 4, 0), send, &recv, 20);
      Expect(r, st.ok(), "all_to_all: " + st.message());
      for (int q = 0; q < P; ++q)
        for (size_t i = 0; i < n; ++i)
          Expect(r, recv[q * n + i] == Input(q, r * n + i + call), "all_to_all value");
    }
  }
}

// Polls CheckCall until it fails (at most `seconds`); returns its message.
std::string FirstError(gpu::LocalRank* me, double seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  const Plan plan = MakePlan(Collective::kAllGather, 1, 4, 0);
  while (std::chrono::steady_clock::now() < end) {
    if (me->watch && me->watch->failed()) return me->watch->error().message();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const Status st = gpu::CheckCall(*me, "all_gather", plan);
  return st.message();
}

// The survivors of a peer that died or closed: a call waiting on it is
// released (host flags) and later calls fail naming it.
void Survive(int r, gpu::LocalRank* me, bool host, const std::string& expect) {
  const auto t0 = std::chrono::steady_clock::now();
  if (!host) {  // logs call #0 (or already fails)
    gpu::CheckCall(*me, "all_gather", MakePlan(Collective::kAllGather, 1, 400, 0));
  } else {
    std::vector<float> send(100, 1.0f), recv(100 * kRanks);
    // May start before the watchdog noticed: then it waits on the peer's flags until released.
    Status st = Run(me, MakePlan(Collective::kAllGather, 1, 400, 0), send, &recv, 20);
    Expect(r, st.ok() || st.message().find(expect) != std::string::npos,
           "a call waiting on the gone peer was not released: " + st.message());
  }
  const std::string why = FirstError(me, 10);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  Expect(r, why.find(expect) != std::string::npos, "expected '" + expect + "', got: " + why);
  Expect(r,
         why.find("rank 2 (process 2, pid ") != std::string::npos &&
             why.find("GPU group [10, 11, 12]") != std::string::npos,
         "the error does not name rank 2 and the group: " + why);
  Expect(r, s < 8, "took " + std::to_string(s) + " s");
  const Status again = gpu::CheckCall(*me, "all_gather", MakePlan(Collective::kAllGather, 1, 4, 0));
  Expect(r, !again.ok(), "a later call did not fail");
}

void Mismatch(int r, gpu::LocalRank* me) {
  const Plan same = MakePlan(Collective::kAllGather, 1, 400, 0);
  Status st = gpu::CheckCall(*me, "all_gather", same);
  Expect(r, st.ok(), "call #0: " + st.message());
  std::this_thread::sleep_for(std::chrono::milliseconds(300 * r));  // rank 0 first, then 1, then 2
  const Plan second = MakePlan(Collective::kAllGather, 1, r == 1 ? 800 : 400, 0);
  st = gpu::CheckCall(*me, "all_gather", second);
  if (r == 0) {
    Expect(r, st.ok(), "rank 0 logged first and must not fail: " + st.message());
    return;
  }
  // Rank 1 differs from rank 0; rank 2 agrees with rank 0 but not with rank 1.
  Expect(r,
         !st.ok() && st.message().find("disagree on call #1") != std::string::npos &&
             st.message().find("1 x 800 bytes per rank") != std::string::npos &&
             st.message().find("1 x 400 bytes per rank") != std::string::npos &&
             st.message().find("rank 1 (process 1)") != std::string::npos,
         "expected a disagreement naming both calls, got: " + st.message());
  st = gpu::CheckCall(*me, "all_gather", same);
  Expect(r, !st.ok() && st.message().find("disagree") != std::string::npos,
         "the group did not stay failed: " + st.message());
}

int RunRank(int r, const std::string& scenario, bool host, int up, int down) {
  gpu::SetProcessIndex(r);
  setenv("JAX_SMDDP_MOCK_DEVICES", std::to_string(r).c_str(), 1);  // its GPU: the node's r
  // Rank 2 with an allocator direct reads refuse: it stages, the others would read in place.
  if (scenario == "direct_disagree" && r == 2) setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "platform", 1);
  std::vector<std::pair<int, std::string>> handles;
  Status st = gpu::PrepareCommunicator(kMembers, 4096, {{r, 0}}, kRanks, &handles);
  Expect(r, st.ok() && handles.size() == 1, "prepare: " + st.message());
  Expect(r, WriteBytes(up, handles[0].second), "sending the handle");
  std::vector<std::pair<int, std::string>> remote;
  for (int q = 0; q < kRanks; ++q) {
    if (q == r) continue;
    std::string h;
    Expect(r, ReadBytes(down, &h), "receiving handles");
    remote.emplace_back(q, h);
  }
  st = gpu::ConnectCommunicator(kMembers, remote);
  if (scenario == "direct_disagree") {
    Expect(r,
           !st.ok() &&
               st.message().find("processes disagree on direct reads: " +
                                 std::string(r == 2 ? "0 here, 1" : "1 here, 0")) !=
                   std::string::npos &&
               st.message().find("XLA_PYTHON_CLIENT_ALLOCATOR") != std::string::npos,
           "expected a disagreement on direct reads, got: " + st.message());
    char b = 'c';  // the parent's two barriers
    Expect(r, WriteAll(up, &b, 1) && ReadAll(down, &b, 1), "barrier");
    Expect(r, WriteAll(up, "d", 1) && ReadAll(down, &b, 1), "end barrier");
    gpu::ReleaseCommunicators();
    std::printf("rank %d: ok\n", r);
    std::fflush(stdout);
    return 0;
  }
  Expect(r, st.ok(), "connect: " + st.message());
  gpu::GpuCommunicator* comm = gpu::FindCommunicator(gpu::GroupKey(kMembers.data(), kRanks));
  Expect(r, comm && comm->Local(r), "no connected communicator");
  gpu::LocalRank* me = comm->Local(r);
  Expect(r, me->watch != nullptr && me->call_logs.size() == size_t(kRanks),
         "not watched or logged");
  Expect(r, me->view.flags.size() == (host ? size_t(kRanks) : 0u), "flag blocks not as configured");
  const bool direct = scenario.rfind("direct", 0) == 0;
  Expect(r, (me->exchange != nullptr) == direct, "direct reads not as configured");
  char c = 'c';
  Expect(r, WriteAll(up, &c, 1) && ReadAll(down, &c, 1), "barrier");  // everyone connected

  if (scenario == "collectives" || scenario == "direct") {
    Collectives(r, me);
    if (direct) {
      // Each peer's two allocations, mapped once each.
      Expect(r, me->exchange->exported() == 2,
             "exported " + std::to_string(me->exchange->exported()));
      Expect(r, me->exchange->mapped() == size_t(2 * (kRanks - 1)),
             "mapped " + std::to_string(me->exchange->mapped()));
      // By descriptor where the memory is cuMemCreate's, else by legacy CUDA IPC.
      const uint64_t maps = mock_node::Count().maps;
      Expect(r, maps == (mock_node::CuMemMode() ? 2 * (kRanks - 1) : 0u),
             "cuMem mappings: " + std::to_string(maps));
      // The set-up probe copies a descriptor (here this process's own); a
      // refusal names the process and why, and then memory that only a
      // descriptor could share is not exported (its calls stage).
      Expect(r,
             smddp::cuda::CopyDescriptorRefused(getpid(), smddp::cuda::DescriptorProbe()).empty(),
             "cannot copy the probe descriptor");
      const std::string refused = smddp::cuda::CopyDescriptorRefused(getpid(), 1 << 20);
      Expect(r,
             refused.find("copying process " + std::to_string(getpid())) != std::string::npos &&
                 refused.find("pidfd_getfd") != std::string::npos,
             "a bad descriptor: " + refused);
      {
        smddp::cuda::BufferIpc ipc;
        ipc.RefuseDescriptors("a peer cannot copy them");
        void* buffer = nullptr;
        cudaMalloc(&buffer, 4096);
        uintptr_t base = 0;
        uint64_t unique = 0;
        const Status st = ipc.FindAllocation(0, buffer, &base, &unique);
        Expect(r,
               mock_node::CuMemMode()
                   ? !st.ok() && st.message().find("a peer cannot copy them") != std::string::npos
                   : st.ok(),
               "after a refusal: " + st.message());
        cudaFree(buffer);
      }
      // Rank 1's input in memory CUDA IPC cannot share: every rank stages that
      // call (all decide alike), right, then reads in place again.
      for (int call = 0; call < 2; ++call) {
        device_buffers[r].heap_input = r == 1 && call == 0;
        device_buffers[r].staged = call == 0;
        const size_t n = 700;
        std::vector<float> send(n), recv(n * kRanks);
        for (size_t i = 0; i < n; ++i) send[i] = Input(r, i + 7 * call);
        Status st = Run(me, MakePlan(Collective::kAllGather, 1, n * 4, 0), send, &recv, 20);
        Expect(r, st.ok(), "all_gather: " + st.message());
        Expect(r, me->view.inputs.empty() == (call == 0), "staged only the call with a heap input");
        // The process says why (gpu.direct_reads_staged_because()): rank 1 itself, or its peers.
        const std::string why = smddp::BufferExchange::StagedBecause();
        Expect(r,
               why.find("rank 1") != std::string::npos &&
                   why.find(r == 1 ? "cannot share its buffers in place (its memory is not"
                                   : "could not share its buffers") != std::string::npos,
               "staged because: " + why);
        for (int q = 0; q < kRanks; ++q)
          for (size_t i = 0; i < n; ++i)
            Expect(r, recv[q * n + i] == Input(q, i + 7 * call), "all_gather value");
      }
      // XLA frees an allocation and allocates anew, usually at the same
      // address: a new buffer id, so it is exported and mapped again (the
      // peers' old mapping would show the freed memory's stale bytes).
      void* old = device_buffers[r].allocation[0];
      cudaFree(old);
      device_buffers[r].allocation[0] = nullptr;
      Expect(r, cudaMalloc(&device_buffers[r].allocation[0], DeviceBuffers::kBytes) == cudaSuccess,
             "cudaMalloc");
      std::printf("rank %d: reallocated %s\n", r,
                  device_buffers[r].allocation[0] == old ? "at the same address" : "elsewhere");
      const size_t before = me->exchange->exported();
      for (int call = 0; call < 2; ++call) {  // one call's input is in each allocation
        const size_t n = 500;
        std::vector<float> send(n), recv(n * kRanks);
        for (size_t i = 0; i < n; ++i) send[i] = Input(r, i + 11 * call + 3);
        Status st = Run(me, MakePlan(Collective::kAllGather, 1, n * 4, 0), send, &recv, 20);
        Expect(r, st.ok() && !me->view.inputs.empty(),
               "all_gather after reallocating: " + st.message());
        for (int q = 0; q < kRanks; ++q)
          for (size_t i = 0; i < n; ++i)
            Expect(r, recv[q * n + i] == Input(q, i + 11 * call + 3),
                   "all_gather value after reallocating");
      }
      Expect(r, me->exchange->exported() == before + 1,
             "exported " + std::to_string(me->exchange->exported() - before) +
                 " allocations after one was made anew, not 1");
    }
  } else if (scenario == "direct_timing") {
    // What direct reads add on the host per call, between processes (the
    // GPU's side is not here): the call-log check and the buffer exchange,
    // a rendezvous with every peer's host. The exchanges keep the ranks in
    // step, so the median is the exchange itself, not a wait for a late peer.
    const Plan plan = MakePlan(Collective::kAllGather, 1, 4096, 0);
    void* in = nullptr;
    void* out = nullptr;
    Expect(r, cudaMalloc(&in, 1 << 16) == cudaSuccess && cudaMalloc(&out, 1 << 16) == cudaSuccess,
           "cudaMalloc");
    // Each rank's input holds words that name it and their place (the mock's
    // device memory is host memory shared between processes), so a peer's
    // address that is off, stale or another rank's reads the wrong words.
    auto word = [](int rank, size_t i) { return uint32_t(rank) * 1000003u + uint32_t(i); };
    auto* in_words = static_cast<uint32_t*>(in);
    for (size_t i = 0; i < (1 << 16) / 4; ++i) in_words[i] = word(r, i);
    std::vector<double> check_us, exchange_us;
    for (int call = 0; call < 400; ++call) {
      const auto t0 = std::chrono::steady_clock::now();
      Status st = gpu::CheckCall(*me, "all_gather", plan);
      const auto t1 = std::chrono::steady_clock::now();
      const size_t offset = 256 * (call % 3);
      if (st.ok()) st = gpu::ExchangeBuffers(*me, plan, static_cast<uint8_t*>(in) + offset, out);
      const auto t2 = std::chrono::steady_clock::now();
      Expect(r, st.ok() && me->view.inputs.size() == size_t(kRanks), "exchange: " + st.message());
      check_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      exchange_us.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
      // The GPU would now read the peers' inputs; here the host reads what
      // their addresses show: each peer's allocation, mapped once, at the
      // offset it used, holding that peer's words (first and last of the block).
      for (int q = 0; q < kRanks && st.ok(); ++q) {
        const auto* theirs = reinterpret_cast<const uint32_t*>(me->view.inputs[q]);
        const size_t first = offset / 4, last = first + plan.inner / 4 - 1;
        Expect(r,
               theirs != nullptr && theirs[0] == word(q, first) &&
                   theirs[last - first] == word(q, last),
               "call " + std::to_string(call) + ": rank " + std::to_string(q) +
                   "'s input as this rank reads it is not what rank " + std::to_string(q) +
                   " wrote at offset " + std::to_string(offset));
      }
    }
    Expect(r, me->exchange->mapped() == size_t(kRanks - 1),
           "mapped " + std::to_string(me->exchange->mapped()) + " allocations, not one per peer");
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    std::printf(
        "rank %d: per call, median of 400: call-log check %.1f us, buffer exchange %.1f us\n", r,
        median(check_us), median(exchange_us));
    Expect(r, median(exchange_us) < 5000, "the exchange took milliseconds");
    cudaFree(in);
    cudaFree(out);
  } else if (scenario == "direct_map_fails") {
    // Rank 2 cannot map its peers' buffers after they saw its own: its call
    // fails and releases every flag it owns, so ranks 0 and 1, already
    // reading in place, finish instead of waiting on it; then every rank's
    // later calls fail naming the cause.
    if (r == 2) setenv("JAX_SMDDP_MOCK_IPC_OPEN_FAILS", "1", 1);
    smddp::SetTimeoutSeconds(30);
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<float> send(300, float(r)), recv(300 * kRanks);
    const Status st = Run(me, MakePlan(Collective::kAllGather, 1, 1200, 0), send, &recv, 30);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r == 2) {
      Expect(
          r,
          !st.ok() && st.message().find("mapping rank 0 (process 0)'s buffer") != std::string::npos,
          "expected rank 2's exchange to fail mapping, got: " + st.message());
    } else {
      // Released (the call finishes), or, when rank 2's failure reached this
      // rank's check before its call did (a loaded machine), failed at once
      // naming it: either way not waiting on rank 2.
      Expect(
          r,
          st.ok() || st.message().find("mapping rank 0 (process 0)'s buffer") != std::string::npos,
          "not released: " + st.message());
    }
    Expect(r, s < 8, "took " + std::to_string(s) + " s");
    const std::string why = FirstError(me, 10);
    const char* cause =
        mock_node::CuMemMode() ? "cuMemImportFromShareableHandle" : "cudaIpcOpenMemHandle";
    Expect(r, why.find(cause) != std::string::npos,
           "later calls do not fail naming the cause: " + why);
  } else if (scenario == "direct_dead_peer") {
    // The live ranks' hosts wait for rank 2's input in the exchange, with a
    // 30 s deadline: the watchdog, not the deadline, ends the wait.
    smddp::SetTimeoutSeconds(30);
    if (r == kRanks - 1) raise(SIGKILL);
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<float> send(100, 1.0f), recv(100 * kRanks);
    const Status st = Run(me, MakePlan(Collective::kAllGather, 1, 400, 0), send, &recv, 30);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    Expect(r,
           !st.ok() && st.message().find("rank 2 (process 2, pid ") != std::string::npos &&
               st.message().find("is gone") != std::string::npos,
           "expected the exchange to fail naming rank 2, got: " + st.message());
    Expect(r, s < 8, "took " + std::to_string(s) + " s");
  } else if (scenario == "dead_peer" || scenario == "closed" || scenario == "stalled") {
    smddp::SetTimeoutSeconds(2);  // the progress deadline
    if (r == kRanks - 1) {
      if (scenario == "dead_peer") raise(SIGKILL);  // no goodbye
      if (scenario == "closed") gpu::MarkCommunicatorsClosed();
      sleep(60);  // alive, and never calls: the parent kills it
      _exit(0);
    }
    Survive(r, me, host,
            scenario == "dead_peer" ? "is gone (process "
            : scenario == "closed"  ? "closed the group"
                                    : "has not reached call #0 of the group (all_gather of float32 "
                                      "(1 x 400 bytes per rank)) within 2 s");
  } else if (scenario == "mismatch") {
    Mismatch(r, me);
  } else {
    Expect(r, false, "unknown scenario " + scenario);
  }
  // No rank closes the group before every other is done with its checks.
  Expect(r, WriteAll(up, "d", 1) && ReadAll(down, &c, 1), "end barrier");
  gpu::ReleaseCommunicators();
  for (auto& d : device_buffers) d.Free();
  std::printf("rank %d: ok\n", r);
  std::fflush(stdout);
  return 0;
}

// Two processes with two ranks each (members 20..23; process p holds ranks
// 2p and 2p + 1 on its devices 0 and 1, the node's 2p and 2p + 1): every
// collective with the local ranks on threads, then process 1 dies and
// process 0's ranks, waiting on it, are released (host flags) and told which
// ranks died.
int RunTwoPerProcess(int p, bool host, int up, int down) {
  const std::vector<int64_t> members = {20, 21, 22, 23};
  gpu::SetProcessIndex(p);
  const std::string devices = std::to_string(2 * p) + "," + std::to_string(2 * p + 1);
  setenv("JAX_SMDDP_MOCK_DEVICES", devices.c_str(), 1);
  std::vector<std::pair<int, std::string>> handles;
  Status st = gpu::PrepareCommunicator(members, 4096, {{2 * p, 0}, {2 * p + 1, 1}}, 2, &handles);
  Expect(p, st.ok() && handles.size() == 2, "prepare: " + st.message());
  for (const auto& [rank, h] : handles) {
    const int32_t r32 = rank;
    Expect(p, WriteAll(up, &r32, 4) && WriteBytes(up, h), "sending handles");
  }
  std::vector<std::pair<int, std::string>> remote(2);
  for (auto& [rank, h] : remote) {
    int32_t r32 = -1;
    Expect(p, ReadAll(down, &r32, 4) && ReadBytes(down, &h), "receiving handles");
    rank = r32;
  }
  st = gpu::ConnectCommunicator(members, remote);
  Expect(p, st.ok(), "connect: " + st.message());
  gpu::GpuCommunicator* comm = gpu::FindCommunicator(gpu::GroupKey(members.data(), 4));
  Expect(p, comm && comm->Local(2 * p) && comm->Local(2 * p + 1), "no connected communicator");
  gpu::LocalRank* mine[2] = {comm->Local(2 * p), comm->Local(2 * p + 1)};
  Expect(p, mine[0]->watch == mine[1]->watch && mine[0]->watch, "local ranks share one watch");
  char c = 'c';
  Expect(p, WriteAll(up, &c, 1) && ReadAll(down, &c, 1), "barrier");
  auto on_both = [&](auto&& body) {  // each rank on a thread of its device, as XLA runs them
    std::thread t([&] {
      cudaSetDevice(1);
      body(2 * p + 1, mine[1]);
    });
    cudaSetDevice(0);
    body(2 * p, mine[0]);
    t.join();
  };
  const char* setting = std::getenv("JAX_SMDDP_GPU_DIRECT_READS");
  const bool direct = setting && std::string(setting) == "1";
  Expect(p, (mine[0]->exchange != nullptr) == direct, "direct reads not as configured");
  on_both([&](int r, gpu::LocalRank* me) { Collectives(r, me, 4); });
  if (direct) {  // the local peer's buffers used as they are: only the other process's mapped
    for (gpu::LocalRank* me : mine)
      Expect(p, me->exchange->mapped() == 4, "located " + std::to_string(me->exchange->mapped()));
    // ...and each of those 4 allocations (2 per remote rank) mapped once per process.
    Expect(p, comm->mapped_buffers() == 4, "mapped " + std::to_string(comm->mapped_buffers()));
  }
  Expect(p, WriteAll(up, &c, 1) && ReadAll(down, &c, 1), "barrier");  // all done before one dies
  if (p == 1) raise(SIGKILL);
  smddp::SetTimeoutSeconds(20);
  on_both([&](int r, gpu::LocalRank* me) {
    if (host) {  // waits on ranks 2 and 3 until the watchdog releases it
      std::vector<float> send(100, 1.0f), recv(400);
      const Status run = Run(me, MakePlan(Collective::kAllGather, 1, 400, 0), send, &recv, 20);
      Expect(r, run.ok() || run.message().find("is gone") != std::string::npos,
             "not released: " + run.message());
    }
    const std::string why = FirstError(me, 10);
    Expect(r,
           why.find("ranks 2, 3 (process 1, pid ") != std::string::npos &&
               why.find("is gone") != std::string::npos,
           "expected ranks 2, 3 of process 1 named, got: " + why);
  });
  gpu::ReleaseCommunicators();
  for (auto& d : device_buffers) d.Free();
  std::printf("process %d: ok\n", p);
  std::fflush(stdout);
  return 0;
}

// The group of members 30..32 on mock devices 0..2, all in this process,
// with direct reads.
gpu::GpuCommunicator* InProcessGroup() {
  const std::vector<int64_t> members = {30, 31, 32};
  std::vector<std::pair<int, std::string>> handles;
  Status st = gpu::PrepareCommunicator(members, 4096, {{0, 0}, {1, 1}, {2, 2}}, 1, &handles);
  Expect(0, st.ok(), "prepare: " + st.message());
  st = gpu::ConnectCommunicator(members, {});
  Expect(0, st.ok(), "connect: " + st.message());
  gpu::GpuCommunicator* comm = gpu::FindCommunicator(gpu::GroupKey(members.data(), 3));
  Expect(0, comm && comm->direct_reads(), "no direct reads in the group");
  return comm;
}

// One process holding every rank (members 30..32 on mock devices 0..2, each
// on a thread of its own, as XLA runs each device's program): with direct
// reads the ranks meet in tables of this process and read each other's
// buffers at their own addresses, nothing exported or mapped.
int InProcess() {
  gpu::GpuCommunicator* comm = InProcessGroup();
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      cudaSetDevice(r);
      gpu::LocalRank* me = comm->Local(r);
      Expect(r, me && me->exchange && !me->watch, "rank not set up");
      Collectives(r, me, 3);
      Expect(r, me->exchange->exported() == 0 && me->exchange->mapped() == 0,
             "exported or mapped within one process");
    });
  }
  for (auto& t : threads) t.join();
  gpu::ReleaseCommunicators();
  for (auto& d : device_buffers) d.Free();
  std::printf("all checks passed\n");
  return 0;
}

// One process, 3 ranks on threads, direct reads: rank 2 is late for its
// second call, so ranks 0 and 1 give up on it after the 2 s deadline. When
// rank 2 comes, and at every later call of any rank, the group fails at once
// with that first reason (before, rank 2 waited out another deadline for
// peers that no longer publish, naming them).
int InProcessLate() {
  gpu::GpuCommunicator* comm = InProcessGroup();
  smddp::SetTimeoutSeconds(2);
  std::atomic<int> gave_up{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      cudaSetDevice(r);
      gpu::LocalRank* me = comm->Local(r);
      const Plan plan = MakePlan(Collective::kAllGather, 1, 400, 0);
      std::vector<float> send(100, float(r)), recv(300);
      Status first = Run(me, plan, send, &recv, 20);
      Expect(r, first.ok(), "first call: " + first.message());
      if (r == 2) {
        while (gave_up.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      const auto t0 = std::chrono::steady_clock::now();
      const Status late = Run(me, plan, send, &recv, 20);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (r != 2) {
        Expect(r,
               !late.ok() && late.message().find("rank 2 (process 0) did not enqueue call 1") !=
                                 std::string::npos,
               "the late rank is not named: " + late.message());
        gave_up++;
      } else {
        Expect(r,
               !late.ok() &&
                   late.message().find("rank 2 (process 0) did not enqueue call 1") !=
                       std::string::npos &&
                   s < 1.0,
               "the late rank's call took " + std::to_string(s) + " s: " + late.message());
      }
      const auto t1 = std::chrono::steady_clock::now();
      const Status next = Run(me, plan, send, &recv, 20);
      const double s1 =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
      Expect(r, !next.ok() && next.message() == late.message() && s1 < 1.0,
             "a later call: " + next.message() + " after " + std::to_string(s1) + " s");
    });
  }
  for (auto& t : threads) t.join();
  gpu::ReleaseCommunicators();
  for (auto& d : device_buffers) d.Free();
  std::printf("all checks passed\n");
  return 0;
}

int TwoPerProcess(bool host) {
  Children kids;
  if (!Spawn(
          2, [&](int p, int up, int down) { return RunTwoPerProcess(p, host, up, down); }, &kids))
    return 2;
  const auto &pids = kids.pids, &ups = kids.ups, &downs = kids.downs;
  alarm(90);
  std::vector<std::pair<int32_t, std::string>> handles[2];
  for (int p = 0; p < 2; ++p) {
    for (int i = 0; i < 2; ++i) {
      int32_t rank = -1;
      std::string h;
      if (!ReadAll(ups[p], &rank, 4) || !ReadBytes(ups[p], &h)) return 1;
      handles[p].emplace_back(rank, h);
    }
  }
  for (int p = 0; p < 2; ++p) {
    for (const auto& [rank, h] : handles[1 - p]) {
      WriteAll(downs[p], &rank, 4);
      WriteBytes(downs[p], h);
    }
  }
  char c;
  for (int round = 0; round < 2; ++round) {
    for (int p = 0; p < 2; ++p) ReadAll(ups[p], &c, 1);
    for (int p = 0; p < 2; ++p) WriteAll(downs[p], "g", 1);
  }
  int status = 0;
  waitpid(pids[0], &status, 0);
  const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  waitpid(pids[1], nullptr, 0);
  for (pid_t pid : pids) mock_node::RemoveMemoryOf(pid);
  if (ok) std::printf("all checks passed\n");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(
        stderr,
        "usage: %s collectives|dead_peer|closed|stalled|mismatch|two_per_process|"
        "direct|direct_dead_peer|direct_two_per_process|direct_in_process|direct_in_process_late|"
        "direct_map_fails|"
        "direct_disagree|direct_timing "
        "device|host\n",
        argv[0]);
    return 2;
  }
  const std::string scenario = argv[1];
  const bool host = std::string(argv[2]) == "host";
  setenv("JAX_SMDDP_GPU_FLAG_MEMORY", argv[2], 1);
  setenv("JAX_SMDDP_GPU_DIRECT_READS", scenario.rfind("direct", 0) == 0 ? "1" : "0", 1);
  if (scenario == "two_per_process" || scenario == "direct_two_per_process")
    return TwoPerProcess(host);
  if (scenario == "direct_in_process") return InProcess();
  if (scenario == "direct_in_process_late") return InProcessLate();
  Children kids;
  if (!Spawn(
          kRanks, [&](int r, int up, int down) { return RunRank(r, scenario, host, up, down); },
          &kids))
    return 2;
  const auto &pids = kids.pids, &ups = kids.ups, &downs = kids.downs;
  alarm(90);  // a hang fails
  std::vector<std::string> handles(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    if (!ReadBytes(ups[r], &handles[r])) {
      std::printf("rank %d sent no handle\n", r);
      return 1;
    }
  }
  for (int r = 0; r < kRanks; ++r)
    for (int q = 0; q < kRanks; ++q)
      if (q != r) WriteBytes(downs[r], handles[q]);
  char c;
  for (int r = 0; r < kRanks; ++r) ReadAll(ups[r], &c, 1);
  for (int r = 0; r < kRanks; ++r) WriteAll(downs[r], "g", 1);
  const bool leaves = scenario == "dead_peer" || scenario == "closed" || scenario == "stalled" ||
                      scenario == "direct_dead_peer";                          // the last rank
  for (int r = 0; r < kRanks - (leaves ? 1 : 0); ++r) ReadAll(ups[r], &c, 1);  // EOF if it failed
  for (int r = 0; r < kRanks - (leaves ? 1 : 0); ++r) WriteAll(downs[r], "e", 1);
  bool ok = true;
  for (int r = 0; r < kRanks - (leaves ? 1 : 0); ++r) {
    int status = 0;
    waitpid(pids[r], &status, 0);
    ok &= WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  if (leaves) {
    kill(pids[kRanks - 1], SIGKILL);  // alive until the survivors are done, unless dead_peer
    int status = 0;
    waitpid(pids[kRanks - 1], &status, 0);
    ok &= WIFSIGNALED(status);  // it must not have failed its own checks
  }
  // A killed rank leaves its mock "device memory" behind.
  for (pid_t pid : pids) mock_node::RemoveMemoryOf(pid);
  if (ok) std::printf("all checks passed\n");
  return ok ? 0 : 1;
}

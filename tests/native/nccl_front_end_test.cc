// The NCCL API front end (cuda/ncclapi) driven as XLA drives it, on CPU
// processes: built against the mock node's CUDA runtime (tests/native/mock_node)
// with its served calls on HostStreamOps, the real NCCL replaced by a mock
// that records what is forwarded (tests/native/mock_nccl.cc, found through
// JAX_SMDDP_NCCL_LIBRARY). The parent forks P processes that build a world
// of shared-memory links (as jax_smddp.initialize() does on one host) and
// relays what XLA would put in the key-value store (the unique id) through
// pipes; each process then creates its communicator from the id and runs
// the scenario's calls, checking results against expected values and the
// mock's record.
//
//   nccl_front_end_test SCENARIO
//
// served: P=3, every collective served (all_gather, reduce_scatter,
//   all_reduce of several types and reductions, a group of them), nothing
//   forwarded, the real communicator never created.
// captured, captured_direct: P=2, calls captured into a CUDA graph and
//   replayed (Captured, below).
// forwarded: P=2, broadcast, a product all_reduce and a send/recv group go to
//   the mock with the mock's own communicator (created once, blocking).
// mixed_group: P=2, one group mixing served and forwarded calls keeps its
//   order (forwarded runs become real groups between the served calls).
// unknown_config / unknown_version: P=2, a config or a library version the
//   front end does not know: every call forwarded.
// id_full: P=2, the real id does not fit: served calls run; forwarded ones
//   fail saying why.
// no_fallback: P=2, JAX_SMDDP_REQUIRE=no-fallback: a forwarded call fails.
// split: P=3, ncclCommSplit (one rank without color, keys reversing the
//   order) and an all_gather on the child.
// dead_peer: P=2, process 1 is killed after a call; process 0's next call
//   fails naming it, and ncclCommGetAsyncError reports it.
// stalled: P=2, process 1 never makes the call: the deadline.
// forward_fails: P=2, the real library fails a forwarded call: its code and
//   message come through.
// across_hosts: P=4 on two simulated hosts (ranks alternate): all_gather,
//   reduce_scatter and all_to_all on the hierarchical bodies, all_reduce as
//   reduce_scatter + all_gather (in place too), one whose count does not
//   divide by the ranks forwarded; captured ones refused.
// abort: P=2, process 1 aborts the communicator: process 0's async error
//   names it (tagged for jax_smddp.errors.classify).
// join_timeout: 2 processes create a communicator of 3 ranks: the deadline
//   names the missing rank.
// Prints "all checks passed" and exits 0 on success.
//
// The harness (processes, relay, world, the mock's record) is nccl_harness.h;
// the deadline scenarios (stalled, partial_forward, join_timeout) are in
// nccl_front_end_deadlines.cc.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tests/native/nccl_harness.h"

// The deadlines (nccl_front_end_deadlines.cc).
void Stalled();
void PartialForward();
void JoinTimeout();

namespace {

using namespace nccl_test;  // NOLINT: the harness is this test's vocabulary

// --- Scenarios -----------------------------------------------------------------------

void Served() {
  ncclComm_t comm = Create(P, me, Config(22809, 0));
  // The front end reads in place unless a call is captured (gpu::NcclFrontEndPreferences),
  // as the custom calls do; these host buffers cannot be shared, so its calls
  // stage, saying why once.
  smddp::nccl::Comm* c = smddp::nccl::AsComm(comm);
  Expect(c && c->local && c->local->exchange,
         "the front end's communicator reads in place where it can");
  int n = 0, r = -1;
  Expect(ncclCommCount(comm, &n) == ncclSuccess && n == P, "ncclCommCount");
  Expect(ncclCommUserRank(comm, &r) == ncclSuccess && r == me, "ncclCommUserRank");
  CheckAllGather(comm, P, me, 1000, "all_gather f32");
  {  // reduce_scatter, f32 sum
    const size_t count = 500;
    std::vector<float> send(count * P), recv(count, 0.f);
    for (size_t i = 0; i < send.size(); ++i) send[i] = Value(me, i);
    Expect(ncclReduceScatter(send.data(), recv.data(), count, ncclFloat32, ncclSum, comm,
                             nullptr) == ncclSuccess,
           std::string("reduce_scatter: ") + ncclGetLastError(comm));
    bool ok = true;
    for (size_t i = 0; i < count; ++i) {
      float want = 0;
      for (int q = 0; q < P; ++q) want += Value(q, me * count + i);
      ok = ok && std::fabs(recv[i] - want) <= 1e-3f * std::fabs(want) + 1e-3f;
    }
    Expect(ok, "reduce_scatter f32 sum: wrong values");
  }
  {  // all_reduce, int32 max and f64 min
    const size_t count = 777;
    std::vector<int32_t> send(count), recv(count, 0);
    for (size_t i = 0; i < count; ++i) send[i] = int32_t((i * 7919 + me * 104729) % 1000) - 500;
    Expect(ncclAllReduce(send.data(), recv.data(), count, ncclInt32, ncclMax, comm, nullptr) ==
               ncclSuccess,
           "all_reduce int32 max");
    bool ok = true;
    for (size_t i = 0; i < count; ++i) {
      int32_t want = INT32_MIN;
      for (int q = 0; q < P; ++q)
        want = std::max(want, int32_t((i * 7919 + q * 104729) % 1000) - 500);
      ok = ok && recv[i] == want;
    }
    Expect(ok, "all_reduce int32 max: wrong values");
    std::vector<double> dsend(count), drecv(count, 0);
    for (size_t i = 0; i < count; ++i) dsend[i] = std::sin(double(i + 13 * me));
    Expect(ncclAllReduce(dsend.data(), drecv.data(), count, ncclFloat64, ncclMin, comm, nullptr) ==
               ncclSuccess,
           "all_reduce f64 min");
    ok = true;
    for (size_t i = 0; i < count; ++i) {
      double want = 1e9;
      for (int q = 0; q < P; ++q) want = std::min(want, std::sin(double(i + 13 * q)));
      ok = ok && drecv[i] == want;
    }
    Expect(ok, "all_reduce f64 min: wrong values");
  }
  {  // In place, as NCCL allows: all_gather's input in its rank's block of the
     // output, reduce_scatter's output in its rank's block of the input,
     // all_reduce's output on its input.
    const size_t count = 300;
    std::vector<float> g(count * P, -1.f);
    for (size_t i = 0; i < count; ++i) g[me * count + i] = Value(me, i);
    Expect(ncclAllGather(g.data() + me * count, g.data(), count, ncclFloat32, comm, nullptr) ==
               ncclSuccess,
           "in-place all_gather");
    bool ok = true;
    for (int q = 0; q < P; ++q)
      for (size_t i = 0; i < count; ++i) ok = ok && g[q * count + i] == Value(q, i);
    Expect(ok, "in-place all_gather: wrong values");
    std::vector<float> rs(count * P);
    for (size_t i = 0; i < rs.size(); ++i) rs[i] = Value(me, i);
    Expect(ncclReduceScatter(rs.data(), rs.data() + me * count, count, ncclFloat32, ncclSum, comm,
                             nullptr) == ncclSuccess,
           "in-place reduce_scatter");
    ok = true;
    for (size_t i = 0; i < count; ++i) {
      float want = 0;
      for (int q = 0; q < P; ++q) want += Value(q, me * count + i);
      ok = ok && std::fabs(rs[me * count + i] - want) <= 1e-3f * std::fabs(want) + 1e-3f;
    }
    Expect(ok, "in-place reduce_scatter: wrong values");
    std::vector<float> ar(count);
    for (size_t i = 0; i < count; ++i) ar[i] = Value(me, i);
    Expect(ncclAllReduce(ar.data(), ar.data(), count, ncclFloat32, ncclSum, comm, nullptr) ==
               ncclSuccess,
           "in-place all_reduce");
    ok = true;
    for (size_t i = 0; i < count; ++i) {
      float want = 0;
      for (int q = 0; q < P; ++q) want += Value(q, i);
      ok = ok && std::fabs(ar[i] - want) <= 1e-3f * std::fabs(want) + 1e-3f;
    }
    Expect(ok, "in-place all_reduce: wrong values");
  }
  {  // all_to_all (XLA calls ncclAlltoAll): block q of rank r's output is rank q's block r
    const size_t count = 100;
    std::vector<float> send(count * P), recv(count * P, -1.f);
    for (size_t i = 0; i < send.size(); ++i) send[i] = Value(me, i);
    Expect(ncclAlltoAll(send.data(), recv.data(), count, ncclFloat32, comm, nullptr) == ncclSuccess,
           std::string("all_to_all: ") + ncclGetLastError(comm));
    bool ok = true;
    for (int q = 0; q < P; ++q)
      for (size_t i = 0; i < count; ++i) ok = ok && recv[q * count + i] == Value(q, me * count + i);
    Expect(ok, "all_to_all: wrong values");
  }
  int unused = 0;  // a handle the front end never made: refused, not dereferenced
  Expect(ncclCommCount(reinterpret_cast<ncclComm_t>(&unused), &n) == ncclInvalidArgument,
         "a foreign handle is refused");
  // A group of served calls (as XLA issues a combined all-gather).
  std::vector<float> a(64), b(32), ga(64 * P), gb(32 * P);
  for (size_t i = 0; i < a.size(); ++i) a[i] = Value(me, i);
  for (size_t i = 0; i < b.size(); ++i) b[i] = -Value(me, i);
  Expect(ncclGroupStart() == ncclSuccess, "group start");
  Expect(ncclAllGather(a.data(), ga.data(), a.size(), ncclFloat32, comm, nullptr) == ncclSuccess,
         "grouped a");
  Expect(ncclAllGather(b.data(), gb.data(), b.size(), ncclFloat32, comm, nullptr) == ncclSuccess,
         "grouped b");
  Expect(ncclGroupEnd() == ncclSuccess, std::string("group end: ") + ncclGetLastError(comm));
  bool ok = true;
  for (int q = 0; q < P; ++q) {
    for (size_t i = 0; i < a.size(); ++i) ok = ok && ga[q * a.size() + i] == Value(q, i);
    for (size_t i = 0; i < b.size(); ++i) ok = ok && gb[q * b.size() + i] == -Value(q, i);
  }
  Expect(ok, "grouped all_gathers: wrong values");
  ncclResult_t async = ncclInternalError;
  Expect(ncclCommGetAsyncError(comm, &async) == ncclSuccess && async == ncclSuccess,
         "no async error");
  const std::string record = Record();
  Expect(!Has(record, "ncclCommInitRankConfig") && !Has(record, "ncclAllGather") &&
             !Has(record, "ncclReduceScatter") && !Has(record, "ncclAllReduce"),
         "nothing forwarded, no real communicator; the mock saw:\n" + record);
  // Nor a real id: the real ncclGetUniqueId would have started NCCL's bootstrap
  // root, waiting for a real communicator that a served one never makes.
  Expect(!Has(record, "ncclGetUniqueId"), "no real id for a served communicator: " + record);
  const std::string described = smddp::nccl::Describe();
  Expect(Has(described, "\"ncclAllGather\": 4") && Has(described, "\"ncclAllReduce\": 3") &&
             Has(described, "\"ncclReduceScatter\": 2") && Has(described, "\"ncclAlltoAll\": 1") &&
             Has(described, "\"forwarded\": {}"),
         "describe: " + described);
  Expect(ncclCommDestroy(comm) == ncclSuccess, "destroy");
}

// captured / captured_direct: P=2; all_gather, reduce_scatter and
// all_reduce captured into a "graph" (small slots: several steps per call;
// process 0 captures them twice), which nothing runs until it is replayed,
// three times, on fresh inputs in the same buffers, each replay after an
// uncaptured all_gather (staged with JAX_SMDDP_GPU_DIRECT_READS=0, or reading
// in place, the default). Process 1 is late and
// reads slowly, so a replay that did not wait for its peer, or that reused a
// slot the uncaptured call's peer still reads, gives wrong values.
// An all_gather whose buffers are "device memory" (the mock's cudaMalloc)
// where `device`, so that it may read its peers' in place.
void UncapturedAllGather(ncclComm_t comm, size_t count, bool device, const std::string& what) {
  if (!device) return CheckAllGather(comm, P, me, count, what);
  float *send = nullptr, *recv = nullptr;
  Expect(cudaMalloc(reinterpret_cast<void**>(&send), count * sizeof(float)) == cudaSuccess &&
             cudaMalloc(reinterpret_cast<void**>(&recv), P * count * sizeof(float)) == cudaSuccess,
         what + ": cudaMalloc");
  CheckAllGatherIn(comm, P, me, send, recv, count, what);
  const smddp::nccl::Comm* c = smddp::nccl::AsComm(comm);
  Expect(c && (c->local->view.inputs.size() == size_t(P) || c->local->view.device.active),
         what + ": read its peers' buffers in place");
  cudaFree(send);
  cudaFree(recv);
}

void Captured(bool direct) {
  ncclComm_t comm = Create(P, me, Config(22809, 0));
  smddp::nccl::Comm* c = smddp::nccl::AsComm(comm);
  Expect(c && c->local && bool(c->local->exchange) == direct,
         direct ? "uncaptured calls read in place" : "uncaptured calls stage");
  const size_t count = 3000;  // 12000 bytes per rank: 3-6 steps per call with 4 KiB slots
  std::vector<float> ag_send(count), ag_recv(count * P, -1.f);
  std::vector<float> rs_send(count * P), rs_recv(count, -1.f);
  std::vector<float> ar_send(count), ar_recv(count, -1.f);
  // Process 0 records its graph twice, as XLA records a command buffer anew
  // when its buffers moved, which one process may do alone.
  const int captures = me == 0 ? 2 : 1;
  for (int k = 0; k < captures; ++k) {
    graph.clear();
    capturing = true;
    Expect(ncclAllGather(ag_send.data(), ag_recv.data(), count, ncclFloat32, comm, nullptr) ==
               ncclSuccess,
           std::string("captured all_gather: ") + ncclGetLastError(comm));
    Expect(ncclReduceScatter(rs_send.data(), rs_recv.data(), count, ncclFloat32, ncclSum, comm,
                             nullptr) == ncclSuccess,
           std::string("captured reduce_scatter: ") + ncclGetLastError(comm));
    Expect(ncclAllReduce(ar_send.data(), ar_recv.data(), count, ncclFloat32, ncclSum, comm,
                         nullptr) == ncclSuccess,
           std::string("captured all_reduce: ") + ncclGetLastError(comm));
    capturing = false;
  }
  Expect(!graph.empty() && ag_recv[0] == -1.f && rs_recv[0] == -1.f && ar_recv[0] == -1.f,
         "capturing runs nothing");
  const std::string described = smddp::nccl::Describe();
  Expect(Has(described, "\"captured\": " + std::to_string(3 * captures)),
         "describe counts the captured calls: " + described);
  auto value = [](int rank, size_t i, int round) { return Value(rank, i) + float(round); };
  for (int round = 1; round <= 3; ++round) {
    if (me == 1) {
      usleep(50000);
      slow_copy_us = 2000;
    }
    // 5 steps: its last one is in the slot the replay's first step takes (round 1 and 3).
    UncapturedAllGather(comm, 5000, direct,
                        "uncaptured all_gather, round " + std::to_string(round));
    for (size_t i = 0; i < count; ++i) ag_send[i] = ar_send[i] = value(me, i, round);
    for (size_t i = 0; i < rs_send.size(); ++i) rs_send[i] = value(me, i, round);
    Check(Replay(), "replay " + std::to_string(round));
    slow_copy_us = 0;
    bool ok = true;
    for (int q = 0; q < P; ++q)
      for (size_t i = 0; i < count; ++i) ok = ok && ag_recv[q * count + i] == value(q, i, round);
    Expect(ok, "replayed all_gather, round " + std::to_string(round) + ": wrong values");
    ok = true;
    for (size_t i = 0; i < count; ++i) {
      float rs = 0, ar = 0;
      for (int q = 0; q < P; ++q) {
        rs += value(q, me * count + i, round);
        ar += value(q, i, round);
      }
      ok = ok && std::fabs(rs_recv[i] - rs) <= 1e-3f * std::fabs(rs) + 1e-3f &&
           std::fabs(ar_recv[i] - ar) <= 1e-3f * std::fabs(ar) + 1e-3f;
    }
    Expect(ok, "replayed reduce_scatter and all_reduce, round " + std::to_string(round) +
                   ": wrong values");
  }
  UncapturedAllGather(comm, count, direct, "uncaptured all_gather after the replays");
}

void Forwarded() {
  ncclComm_t comm = Create(P, me, Config(22809, 0));
  std::vector<float> x(100, float(me)), y(100);
  Expect(ncclBroadcast(x.data(), y.data(), 100, ncclFloat32, 0, comm, nullptr) == ncclSuccess,
         std::string("broadcast: ") + ncclGetLastError(comm));
  Expect(
      ncclAllReduce(x.data(), y.data(), 100, ncclFloat32, ncclProd, comm, nullptr) == ncclSuccess,
      "all_reduce prod");
  // To the peer and to itself, the blocks apart: neither an all-to-all nor a permutation.
  Expect(ncclGroupStart() == ncclSuccess, "group start");
  for (int peer : {1 - me, me}) {
    Expect(
        ncclSend(x.data() + 50 * (peer == me), 5, ncclFloat32, peer, comm, nullptr) == ncclSuccess,
        "send");
    Expect(
        ncclRecv(y.data() + 50 * (peer == me), 5, ncclFloat32, peer, comm, nullptr) == ncclSuccess,
        "recv");
  }
  Expect(ncclGroupEnd() == ncclSuccess, "group end");
  CheckAllGather(comm, P, me, 256, "all_gather beside forwarded calls");
  const std::string who = "rank=" + std::to_string(me) + "/" + std::to_string(P);
  const std::vector<std::string> want = {
      "ncclGetUniqueId",  // process 0 only (filtered below)
      "ncclCommInitRankConfig nranks=2 rank=" + std::to_string(me) + " id=real blocking=1",
      "ncclBroadcast " + who + " count=100 root=0",
      "ncclAllReduce " + who + " count=100 type=7 op=1",
      "ncclGroupStart",
      "ncclSend " + who + " count=5 peer=" + std::to_string(1 - me),
      "ncclRecv " + who + " count=5 peer=" + std::to_string(1 - me),
      "ncclSend " + who + " count=5 peer=" + std::to_string(me),
      "ncclRecv " + who + " count=5 peer=" + std::to_string(me),
      "ncclGroupEnd",
      "SERVED"};
  std::vector<std::string> got = Lines(Record());
  if (me != 0) got.insert(got.begin(), "ncclGetUniqueId");
  Expect(got == want,
         "the forwarded calls, in order, with the real communicator; got:\n" + Record());
  const std::string described = smddp::nccl::Describe();
  Expect(Has(described, "\"ncclBroadcast\": 1") && Has(described, "\"ncclSend\": 2") &&
             Has(described, "does not serve ncclBroadcast"),
         "describe: " + described);
  Expect(ncclCommDestroy(comm) == ncclSuccess, "destroy");
  Expect(Has(Record(), "ncclCommDestroy " + who), "the real communicator destroyed");
}

void MixedGroup() {
  ncclComm_t comm = Create(P, me, Config(22809, 0));
  std::vector<float> x(128), g(128 * P), s(64, 1.f), r(64, 0.f), y(16);
  for (size_t i = 0; i < x.size(); ++i) x[i] = Value(me, i);
  Note("BEGIN");
  Expect(ncclGroupStart() == ncclSuccess, "group start");
  Expect(ncclAllGather(x.data(), g.data(), x.size(), ncclFloat32, comm, nullptr) == ncclSuccess,
         "all_gather");
  Expect(ncclBroadcast(y.data(), y.data(), 16, ncclFloat32, 0, comm, nullptr) == ncclSuccess,
         "broadcast");
  Expect(ncclSend(y.data(), 4, ncclFloat32, 1 - me, comm, nullptr) == ncclSuccess, "send");
  Expect(ncclAllReduce(s.data(), r.data(), s.size(), ncclFloat32, ncclSum, comm, nullptr) ==
             ncclSuccess,
         "all_reduce sum");
  Expect(ncclAllReduce(s.data(), r.data(), s.size(), ncclFloat32, ncclProd, comm, nullptr) ==
             ncclSuccess,
         "all_reduce prod");
  Note("ISSUED");  // nothing ran before ncclGroupEnd
  Expect(ncclGroupEnd() == ncclSuccess, std::string("group end: ") + ncclGetLastError(comm));
  bool ok = true;
  for (int q = 0; q < P; ++q)
    for (size_t i = 0; i < x.size(); ++i) ok = ok && g[q * x.size() + i] == Value(q, i);
  for (float v : r) ok = ok && v == float(P);  // the served sum (the mock's prod writes nothing)
  Expect(ok, "served calls of the group: wrong values");
  const std::string who = "rank=" + std::to_string(me) + "/" + std::to_string(P);
  // Served calls before the first forwarded one, then every forwarded call
  // as one real group (a send/recv pair stays in one), then the rest.
  const std::vector<std::string> want = {
      "BEGIN",
      "ISSUED",
      "SERVED",
      "ncclGetUniqueId",  // process 0 only (added below for process 1), at the first forwarded
      "ncclCommInitRankConfig nranks=2 rank=" + std::to_string(me) + " id=real blocking=1",
      "ncclGroupStart",
      "ncclBroadcast " + who + " count=16 root=0",
      "ncclSend " + who + " count=4 peer=" + std::to_string(1 - me),
      "ncclAllReduce " + who + " count=64 type=7 op=1",
      "ncclGroupEnd",
      "SERVED"};
  std::vector<std::string> got = Lines(Record());
  if (me != 0 && got.size() > 3) got.insert(got.begin() + 3, "ncclGetUniqueId");
  Expect(got == want, "the group's order; got:\n" + Record());
}

void Unknown(bool config) {
  ncclComm_t comm = Create(P, me, config ? Config(24000, 0) : Config(22809, 0));
  // Split before any call: the real side alone, its parent's real
  // communicator made for it (no front-end exchange between the processes).
  ncclComm_t child = nullptr;
  Expect(ncclCommSplit(comm, 0, -me, &child, nullptr) == ncclSuccess,
         std::string("split of a forwarded communicator: ") + ncclGetLastError(comm));
  std::vector<float> x(50, 1.f), g(50 * P);
  Expect(child && ncclAllGather(x.data(), g.data(), 50, ncclFloat32, child, nullptr) == ncclSuccess,
         "all_gather on the forwarded child");
  Expect(Has(Record(), "ncclCommInitRankConfig nranks=2 rank=" + std::to_string(me)) &&
             Has(Record(), "ncclCommSplit rank=" + std::to_string(me) +
                               "/2 color=0 key=" + std::to_string(-me) +
                               "\nncclAllGather rank=" + std::to_string(-me) + "/-1 count=50"),
         "the real communicator split, the child's call forwarded to its part: " + Record());
  Expect(ncclAllGather(x.data(), g.data(), 50, ncclFloat32, comm, nullptr) == ncclSuccess,
         "all_gather");
  const std::string record = Record();
  Expect(Has(record, "ncclAllGather rank=" + std::to_string(me) + "/2 count=50") &&
             !Has(record, "SERVED"),
         "forwarded entirely; the mock saw:\n" + record);
  const std::string described = smddp::nccl::Describe();
  Expect(Has(described, config ? "ncclConfig_t is of NCCL 2.40" : "version 24100"),
         "the reason: " + described);
}

void IdFull() {
  ncclComm_t comm = Create(P, me, nullptr);
  CheckAllGather(comm, P, me, 64, "all_gather (served)");
  std::vector<float> x(8), y(8);
  const ncclResult_t rc = ncclBroadcast(x.data(), y.data(), 8, ncclFloat32, 0, comm, nullptr);
  Expect(rc == ncclInvalidUsage, "a forwarded call without a real id fails");
  Expect(Has(ncclGetLastError(comm), "did not fit"), std::string("why: ") + ncclGetLastError(comm));
}

void NoFallback() {
  ncclComm_t comm = Create(P, me, nullptr);
  std::vector<float> x(8), y(8);
  Expect(ncclBroadcast(x.data(), y.data(), 8, ncclFloat32, 0, comm, nullptr) == ncclInvalidUsage,
         "no-fallback refuses forwarding");
  Expect(Has(ncclGetLastError(comm), "JAX_SMDDP_REQUIRE=no-fallback"),
         std::string("why: ") + ncclGetLastError(comm));
  Expect(!Has(Record(), "ncclBroadcast") && !Has(Record(), "ncclCommInitRankConfig"),
         "nothing reached NCCL: " + Record());
  CheckAllGather(comm, P, me, 64, "served calls still run");
  // Sends and receives: an all-to-all group and a permutation are served;
  // one to the peer and one to itself, blocks apart, would be forwarded, so
  // that group fails at ncclGroupEnd.
  std::vector<float> a(8 * P, 1.f), b(8 * P);
  Expect(ncclGroupStart() == ncclSuccess, "group start");
  for (int q = 0; q < P; ++q) {
    ncclSend(a.data() + 8 * q, 8, ncclFloat32, q, comm, nullptr);
    ncclRecv(b.data() + 8 * q, 8, ncclFloat32, q, comm, nullptr);
  }
  Expect(ncclGroupEnd() == ncclSuccess, "an all-to-all group is served");
  Expect(ncclGroupStart() == ncclSuccess, "group start");
  ncclSend(a.data(), 8, ncclFloat32, 1 - me, comm, nullptr);
  ncclRecv(b.data(), 8, ncclFloat32, 1 - me, comm, nullptr);
  Expect(ncclGroupEnd() == ncclSuccess, "a permutation is served");
  Expect(ncclGroupStart() == ncclSuccess, "group start");
  for (int peer : {1 - me, me}) {
    ncclSend(a.data() + 8 * (peer == me), 4, ncclFloat32, peer, comm, nullptr);
    ncclRecv(b.data() + 8 * (peer == me), 4, ncclFloat32, peer, comm, nullptr);
  }
  Expect(ncclGroupEnd() == ncclInvalidUsage && Has(ncclGetLastError(comm), "no-fallback"),
         std::string("neither refused: ") + ncclGetLastError(comm));
  Expect(!Has(Record(), "ncclSend") && !Has(Record(), "ncclRecv"),
         "nothing reached NCCL: " + Record());
}

void SplitScenario() {
  ncclComm_t parent = Create(P, me, Config(22809, 1));
  // Process 1 takes no color; the others reverse their order.
  ncclComm_t child = nullptr;
  const int color = me == 1 ? smddp::nccl::kNoColor : 7;
  Expect(ncclCommSplit(parent, color, -me, &child, Config(22809, 1)) == ncclSuccess,
         std::string("split: ") + ncclGetLastError(parent));
  if (me == 1) {
    Expect(child == nullptr, "no color: no communicator");
  } else {
    int n = 0, r = -1;
    ncclCommCount(child, &n);
    ncclCommUserRank(child, &r);
    const int want = me == 2 ? 0 : 1;
    Expect(n == 2 && r == want,
           "child size 2, rank by key: got " + std::to_string(n) + "/" + std::to_string(r));
    CheckAllGather(child, 2, r, 300, "all_gather on the child");
  }
  CheckAllGather(parent, P, me, 100, "the parent still works");
  Expect(!Has(Record(), "ncclCommSplit"), "served parent: the split is jax_smddp's: " + Record());

  // The parent never forwarded a call, so it has no real communicator to
  // split: the child forwards from a real id its rank 0's process (process 2)
  // makes at its first forwarded call, one id for both its members (and none
  // made for the parent, nor at the split).
  Expect(!Has(Record(), "ncclGetUniqueId"), "no real id before a forwarded call: " + Record());
  std::vector<float> x(16, float(me)), y(16);
  if (me != 1) {
    const int r = me == 2 ? 0 : 1;
    Expect(ncclBroadcast(x.data(), y.data(), 16, ncclFloat32, 0, child, nullptr) == ncclSuccess,
           std::string("a forwarded call on the child: ") + ncclGetLastError(child));
    Expect(Has(Record(), "ncclCommInitRankConfig nranks=2 rank=" + std::to_string(r) +
                             " id=real blocking=1\nncclBroadcast rank=" + std::to_string(r) +
                             "/2 count=16"),
           "the child's real communicator made from its id, then the call: " + Record());
    Expect(Has(Record(), "ncclGetUniqueId") == (me == 2),
           "the child's real id made in its rank 0's process (2) alone: " + Record());
  }
  const auto ids = Relay(me == 1 ? "" : LastInitId());
  Expect(!ids[0].empty() && ids[0] == ids[2] && ids[1].empty(),
         "both members' real communicators come from one id: " + ids[0] + " " + ids[2]);
  // A parent that has a real communicator splits it, every rank calling the
  // real split (it is collective), the rank without a color too.
  Expect(ncclBroadcast(x.data(), y.data(), 16, ncclFloat32, 0, parent, nullptr) == ncclSuccess,
         std::string("a forwarded call on the parent: ") + ncclGetLastError(parent));
  ncclComm_t child2 = nullptr;
  Expect(ncclCommSplit(parent, color, me, &child2, Config(22809, 1)) == ncclSuccess,
         std::string("second split: ") + ncclGetLastError(parent));
  Expect(Has(Record(), "ncclCommSplit rank=" + std::to_string(me) +
                           "/3 color=" + std::to_string(color) + " key=" + std::to_string(me)),
         "the real side split: " + Record());
  Expect((child2 == nullptr) == (me == 1), "no color: no communicator");
  if (child2) CheckAllGather(child2, 2, me == 0 ? 0 : 1, 64, "all_gather on the second child");
}

// Sends and receives in a group, as XLA's all-to-all issues them: served as
// one all_to_all when they form one (every peer, self included, each side's
// blocks contiguous in rank order), forwarded otherwise.
void SendRecvGroups() {
  ncclComm_t comm = Create(P, me, Config(22809, 0));
  const size_t count = 300;
  std::vector<float> x(count * P), y(count * P, -1.f);
  for (size_t i = 0; i < x.size(); ++i) x[i] = Value(me, i);
  Expect(ncclGroupStart() == ncclSuccess, "group start");
  for (int q = P - 1; q >= 0; --q) {  // any order within the group
    Expect(ncclRecv(y.data() + q * count, count, ncclFloat32, q, comm, nullptr) == ncclSuccess,
           "recv");
    Expect(ncclSend(x.data() + q * count, count, ncclFloat32, q, comm, nullptr) == ncclSuccess,
           "send");
  }
  Expect(ncclGroupEnd() == ncclSuccess,
         std::string("an all-to-all of sends and receives: ") + ncclGetLastError(comm));
  bool ok = true;
  for (int q = 0; q < P; ++q)
    for (size_t i = 0; i < count; ++i) ok = ok && y[q * count + i] == Value(q, me * count + i);
  Expect(ok, "the all-to-all's values");
  Expect(!Has(Record(), "ncclSend") && !Has(Record(), "ncclRecv") &&
             Has(smddp::nccl::Describe(), "\"ncclAlltoAll\": 1"),
         "served as one all_to_all; the mock saw:\n" + Record() + smddp::nccl::Describe());
  // A permutation (one peer each way) is not an all-to-all: served as one
  // collective_permute (nccl_permute_test.cc tests them).
  Expect(ncclGroupStart() == ncclSuccess, "group start");
  Expect(ncclSend(x.data(), count, ncclFloat32, 1 - me, comm, nullptr) == ncclSuccess, "send");
  Expect(ncclRecv(y.data(), count, ncclFloat32, 1 - me, comm, nullptr) == ncclSuccess, "recv");
  Expect(ncclGroupEnd() == ncclSuccess, "group end");
  const std::string who = "rank=" + std::to_string(me) + "/" + std::to_string(P);
  ok = true;
  for (size_t i = 0; i < count; ++i) ok = ok && y[i] == Value(1 - me, i);
  Expect(
      ok && !Has(Record(), "ncclSend") && Has(smddp::nccl::Describe(), "\"ncclSend/ncclRecv\": 1"),
      "the permutation served: " + Record() + smddp::nccl::Describe());
  // Blocks out of rank order: forwarded too.
  Expect(ncclGroupStart() == ncclSuccess, "group start");
  for (int q = 0; q < P; ++q) {
    Expect(ncclSend(x.data() + (P - 1 - q) * count, count, ncclFloat32, q, comm, nullptr) ==
               ncclSuccess,
           "send");
    Expect(ncclRecv(y.data() + q * count, count, ncclFloat32, q, comm, nullptr) == ncclSuccess,
           "recv");
  }
  Expect(ncclGroupEnd() == ncclSuccess, "group end");
  Expect(Has(Record(), "ncclSend " + who + " count=300 peer=" + std::to_string(me)),
         "the shuffled blocks forwarded: " + Record());
}

void DeadPeer() {
  ncclComm_t comm = Create(P, me, nullptr);
  CheckAllGather(comm, P, me, 128, "before the death");
  Relay("one call done");
  if (me == 1) kill(getpid(), SIGKILL);
  // On a GPU the next call would be enqueued and its stream would wait: XLA
  // learns of the death by polling the async error, which names the peer.
  double s = 0;
  const ncclResult_t async = AwaitAsyncError(comm, std::chrono::steady_clock::now(), 15, &s);
  const std::string why = ncclGetLastError(comm);
  Expect(async == ncclRemoteError, "the async error reports the death");
  Expect(Has(why, "process 1"), "the error names the dead process: " + why);
  Expect(s < 5, "within seconds: " + std::to_string(s));
  std::vector<float> x(128, 1.f), g(128 * P);
  const ncclResult_t rc = ncclAllGather(x.data(), g.data(), 128, ncclFloat32, comm, nullptr);
  Expect(rc == ncclRemoteError,
         "a later call fails at once as a remote error: " + std::to_string(int(rc)));
  Expect(Has(ncclGetLastError(comm), "process 1"),
         std::string("and names it: ") + ncclGetLastError(comm));
  std::printf("process 0: dead peer reported after %.2f s: %s\n", s, why.c_str());
}

void ForwardFails() {
  ncclComm_t comm = Create(P, me, nullptr);
  std::vector<float> x(8), y(8);
  const ncclResult_t rc = ncclBroadcast(x.data(), y.data(), 8, ncclFloat32, 0, comm, nullptr);
  const std::string why = ncclGetLastError(comm);
  Expect(rc == ncclInvalidUsage,
         "the real library's code comes through: " + std::to_string(int(rc)));
  Expect(Has(why, "code 5") && Has(why, "Duplicate GPU detected") && Has(why, "ncclBroadcast"),
         "and its message, with what was forwarded: " + why);
}

void Abort() {
  ncclComm_t comm = Create(P, me, nullptr);
  CheckAllGather(comm, P, me, 64, "before the abort");
  if (me == 1) Expect(ncclCommAbort(comm) == ncclSuccess, "abort");
  Relay("aborted");
  if (me == 1) {
    Relay("seen");
    return;
  }
  double s = 0;
  const ncclResult_t async = AwaitAsyncError(comm, std::chrono::steady_clock::now(), 10, &s);
  const std::string why = ncclGetLastError(comm);
  Expect(async == ncclRemoteError && Has(why, "aborted the communicator") && Has(why, "process 1"),
         "the peer's abort fails the group here, naming it: " + why);
  Expect(Has(why, "jax_smddp[peer_failed]"), "tagged for jax_smddp.errors.classify: " + why);
  Relay("seen");
}

// Ranks alternate between two hosts (rank r on host r % 2): the
// hierarchical bodies, this host's ranks as an intra-host communicator.
void AcrossHosts() {
  ncclComm_t comm = Create(P, me, Config(22809, 0));
  for (int call = 0; call < 2; ++call) {
    CheckAllGather(comm, P, me, 1500 + call, "all_gather across hosts");
    const size_t count = 700;
    std::vector<float> send(count * P), recv(count, 0.f);
    for (size_t i = 0; i < send.size(); ++i) send[i] = Value(me, i + call);
    Expect(ncclReduceScatter(send.data(), recv.data(), count, ncclFloat32, ncclSum, comm,
                             nullptr) == ncclSuccess,
           std::string("reduce_scatter across hosts: ") + ncclGetLastError(comm));
    bool ok = true;
    for (size_t i = 0; i < count; ++i) {
      float want = 0;
      for (int q = 0; q < P; ++q) want += Value(q, me * count + i + call);
      ok = ok && std::fabs(recv[i] - want) <= 1e-3f * std::fabs(want) + 1e-3f;
    }
    Expect(ok, "reduce_scatter across hosts: wrong values");
    std::vector<float> blocks(count * P), swapped(count * P, -1.f);
    for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = Value(me, i + call);
    Expect(ncclAlltoAll(blocks.data(), swapped.data(), count, ncclFloat32, comm, nullptr) ==
               ncclSuccess,
           std::string("all_to_all across hosts: ") + ncclGetLastError(comm));
    ok = true;
    for (int q = 0; q < P; ++q)
      for (size_t i = 0; i < count; ++i)
        ok = ok && swapped[q * count + i] == Value(q, me * count + i + call);
    Expect(ok, "all_to_all across hosts: wrong values");
  }
  {  // all_reduce as reduce_scatter + all_gather: out of place and in place
    const size_t count = 4 * 333;
    std::vector<float> x(count), y(count, -1.f);
    for (size_t i = 0; i < count; ++i) x[i] = Value(me, i);
    Expect(ncclAllReduce(x.data(), y.data(), count, ncclFloat32, ncclSum, comm, nullptr) ==
               ncclSuccess,
           std::string("all_reduce across hosts: ") + ncclGetLastError(comm));
    Expect(ncclAllReduce(x.data(), x.data(), count, ncclFloat32, ncclMax, comm, nullptr) ==
               ncclSuccess,
           std::string("in-place all_reduce across hosts: ") + ncclGetLastError(comm));
    bool ok = true;
    for (size_t i = 0; i < count; ++i) {
      float sum = 0, max = -1e30f;
      for (int q = 0; q < P; ++q) sum += Value(q, i), max = std::max(max, Value(q, i));
      ok = ok && std::fabs(y[i] - sum) <= 1e-3f * std::fabs(sum) + 1e-3f && x[i] == max;
    }
    Expect(ok, "all_reduce across hosts: wrong values");
  }
  std::vector<float> x(63, 1.f), y(63);  // not divisible by the ranks: forwarded
  Expect(ncclAllReduce(x.data(), y.data(), 63, ncclFloat32, ncclSum, comm, nullptr) == ncclSuccess,
         "all_reduce across hosts (forwarded)");
  const std::string record = Record();
  Expect(Has(record, "ncclAllReduce rank=" + std::to_string(me) + "/4 count=63") &&
             !Has(record, "count=1332") && !Has(record, "ncclAllGather") &&
             !Has(record, "ncclReduceScatter") && !Has(record, "ncclAlltoAll"),
         "the odd all_reduce forwarded, the rest served; the mock saw:\n" + record);
  Expect(Has(smddp::nccl::Describe(), "needs a count divisible by the ranks (63 over 4)"),
         "why: " + smddp::nccl::Describe());
  // Into a CUDA graph: refused (the network proxy is driven from the host), all_reduce's
  // reduce_scatter and all_gather parts too; nothing is enqueued.
  std::vector<float> cs(400, 1.f), cr(400 * P);
  capturing = true;
  const ncclResult_t ag = ncclAllGather(cs.data(), cr.data(), 400, ncclFloat32, comm, nullptr);
  const std::string ag_why = ncclGetLastError(comm);
  const ncclResult_t ar =
      ncclAllReduce(cr.data(), cr.data(), 400 * P, ncclFloat32, ncclSum, comm, nullptr);
  const std::string ar_why = ncclGetLastError(comm);
  capturing = false;
  for (const auto& [rc, why] : {std::make_pair(ag, ag_why), std::make_pair(ar, ar_why)})
    Expect(rc == ncclInvalidUsage && Has(why, "cannot run inside a CUDA graph"),
           "a captured call across hosts is refused: " + why);
  Expect(graph.empty(), "a refused captured call enqueues nothing");
}

int RunProcess(const std::string& scenario) {
  StartProcess(scenario == "stalled" || scenario == "join_timeout" || scenario == "partial_forward"
                   ? 2.0
                   : 10.0);
  if (failures) return 1;
  if (scenario == "served")
    Served();
  else if (scenario == "forwarded")
    Forwarded();
  else if (scenario == "captured" || scenario == "captured_direct")
    Captured(scenario == "captured_direct");
  else if (scenario == "send_recv")
    SendRecvGroups();
  else if (scenario == "mixed_group")
    MixedGroup();
  else if (scenario == "unknown_config")
    Unknown(true);
  else if (scenario == "unknown_version")
    Unknown(false);
  else if (scenario == "id_full")
    IdFull();
  else if (scenario == "no_fallback")
    NoFallback();
  else if (scenario == "split")
    SplitScenario();
  else if (scenario == "dead_peer")
    DeadPeer();
  else if (scenario == "stalled")
    Stalled();
  else if (scenario == "forward_fails")
    ForwardFails();
  else if (scenario == "abort")
    Abort();
  else if (scenario == "across_hosts")
    AcrossHosts();
  else if (scenario == "partial_forward")
    PartialForward();
  else if (scenario == "join_timeout")
    JoinTimeout();
  else {
    std::fprintf(stderr, "unknown scenario %s\n", scenario.c_str());
    return 2;
  }
  return EndProcess();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: nccl_front_end_test SCENARIO\n");
    return 2;
  }
  const std::string scenario = argv[1];
  const int processes = scenario == "served" || scenario == "split" ? 3
                        : scenario == "across_hosts"                ? 4
                                                                    : 2;
  if (scenario == "across_hosts") nccl_test::hosts = 2;
  if (scenario == "captured" || scenario == "captured_direct")
    setenv("JAX_SMDDP_GPU_SLOT_BYTES", "4096", 1);
  // The front end reads in place by default: "captured" stages its uncaptured calls.
  if (scenario == "captured") setenv("JAX_SMDDP_GPU_DIRECT_READS", "0", 1);
  if (scenario == "unknown_version") setenv("MOCK_NCCL_VERSION", "24100", 1);
  if (scenario == "id_full") setenv("MOCK_NCCL_ID_FULL", "1", 1);
  if (scenario == "no_fallback") setenv("JAX_SMDDP_REQUIRE", "no-fallback", 1);
  if (scenario == "forward_fails") setenv("MOCK_NCCL_FAIL_BROADCAST", "1", 1);
  return nccl_test::RunMain(scenario, processes, scenario == "dead_peer" ? 1 : -1, RunProcess);
}

// The layouts users run on a GPU node, on the mock node (tests/native/mock_node:
// devices that fault on memory they were not granted, streams that run
// concurrently and asynchronously), through the custom calls' GPU path below
// XLA: each process sets its communicator up as jax_smddp/gpu.py does
// (PrepareCommunicator, handles traded, ConnectCommunicator), then each of
// its devices, on a thread of its own as XLA runs them, enqueues every
// collective on its stream with the stream operations the handlers use
// (cuda/cuda_stream_ops.cc over the mock's streams) and gpu::EnqueueCollective
// (what xla_ffi/ffi/gpu_handlers.cc calls once it decoded a call). Inputs are
// written to the device on the stream just before each call, as XLA's
// producer would, and results read back after it; the stream is synchronized
// only at the end.
//
//   gpu_node_test PxG direct|staged|schedule|refused|dead|steady|late_peer|realloc|dead_warm|replay
//   OUTDIR [ffi|nccl]
//
// nccl: the same through the NCCL API front end (cuda/ncclapi, its stream
// backend cuda/ncclapi/nccl_library.cc: CudaStreamOps on the caller's
// stream), as XLA drives it: the processes build jax_smddp's world (shared
// memory links), process 0 makes the unique id, each device's thread
// creates its rank's communicator with it current and calls ncclAllGather,
// ncclReduceScatter, ncclAllReduce and ncclAlltoAll (blocks of 1500
// elements) on its stream.
//
// PxG: P processes of G devices each (1x8, 8x1, 2x4; the group is all P*G
// devices). HxPxG: H simulated hosts of P processes of G devices
// (the world's libfabric shm links between hosts; the hierarchical
// bodies, by either entry point; each host's devices are node devices of their own). direct|staged:
// JAX_SMDDP_GPU_DIRECT_READS=1|0; every collective, float32 and int32, two calls each; each rank
// writes its inputs and outputs to OUTDIR/rank<r>.bin for the test to check against numpy.
// schedule: two all_gathers of 4 KiB per rank (schedule_staged: through the 4 KiB slots), then
// prints the most peer copies each device had in flight at once and rank 0's copies of the second
// call. refused: set-up must fail naming a pair of devices (JAX_SMDDP_MOCK_TOPOLOGY=pcie_nop2p).
// dead: the last process dies after set-up; the others' calls fail naming it. steady: what
// calls cost the host once their buffers are known (gpu_node_steady.h; direct reads); late_peer:
// the last process comes 300 ms late to each call; realloc: rank 0's input allocated anew at
// the same start; dead_warm: the last process dies after the warm-up; replay: calls captured into
// graphs of the mock and replayed (the same file).
//
//   gpu_node_test mock
//
// The mock node's own checks (MockSelfTest, below).
//
// Prints "all checks passed" and exits 0 on success.
#include <dirent.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <list>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>  // the mock node

#include "cuda/cuda_stream_ops.h"
#include "cuda/gpu_call.h"
#include "cuda/gpu_communicator.h"
#include "cuda/gpu_hierarchy.h"
#include "cuda/ncclapi/nccl_types.h"
#include "tests/native/check.h"
#include "tests/native/gpu_node_steady.h"
#include "tests/native/job_ranks.h"
#include "xla_ffi/algorithms/plan.h"
#include "xla_ffi/common/timeout.h"
#include "xla_ffi/transports/world.h"

extern "C" {
ncclResult_t ncclGetUniqueId(ncclUniqueId*);
ncclResult_t ncclCommInitRank(ncclComm_t*, int, ncclUniqueId, int);
const char* ncclGetLastError(ncclComm_t);
ncclResult_t ncclAllGather(const void*, void*, size_t, ncclDataType_t, ncclComm_t, void*);
ncclResult_t ncclReduceScatter(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                               void*);
ncclResult_t ncclAllReduce(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                           void*);
ncclResult_t ncclAlltoAll(const void*, void*, size_t, ncclDataType_t, ncclComm_t, void*);
}

namespace {

using smddp::Collective;
using smddp::DType;
using smddp::Plan;
using smddp::Status;
namespace gpu = smddp::gpu;

// Shared by the forked processes: their handles and barriers.
struct Board {
  std::atomic<int> count[64];
  struct Handle {
    int32_t rank;
    uint32_t len;
    char bytes[1024];
  } handles[16];
  struct Said {
    uint32_t len;
    char bytes[1020];
  } relay[16][16];  // Relay: round, process
};
Board* board = nullptr;
int barriers = 0;

void Barrier(int processes) {
  CHECK(barriers < 64, "more than 64 barriers");
  std::atomic<int>& c = board->count[barriers++];
  c.fetch_add(1);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (c.load() < processes) {
    CHECK(std::chrono::steady_clock::now() < deadline, "barrier %d timed out", barriers - 1);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Every rank of the job (each process's G threads, then the processes).
int ranks_per_process = 1, job_processes = 1;
smddp_test::ThreadsThenProcesses job_ranks;
void JobBarrier() {
  job_ranks.Wait(ranks_per_process, [] { Barrier(job_processes); });
}

// dead_warm: a survivor leaves once every survivor is done (one that left
// earlier would be named gone too), without closing its groups.
[[noreturn]] void SurvivorExit(int P) {
  Barrier(P - 1);
  std::fflush(stdout);
  _exit(0);
}

// What every process said, as the key-value store would relay it.
int relays = 0;
std::vector<std::string> Relay(int p, int P, const std::string& mine) {
  CHECK(mine.size() <= sizeof(board->relay[0][0].bytes) && relays < 16);
  board->relay[relays][p].len = uint32_t(mine.size());
  std::memcpy(board->relay[relays][p].bytes, mine.data(), mine.size());
  Barrier(P);
  std::vector<std::string> all;
  for (int q = 0; q < P; ++q)
    all.emplace_back(board->relay[relays][q].bytes, board->relay[relays][q].len);
  relays++;
  return all;
}

void Check(const Status& st, const char* what) {
  CHECK_MSG(st.ok(), std::string(what) + ": " + st.message());
}

// jax_smddp.initialize()'s world on one host: shared-memory links between
// the processes.
// With several simulated hosts (process q on host q / (P / hosts)):
// libfabric's shm provider and a TCP watch between hosts.
int hosts = 1;
std::string HostOf(int q, int P) { return "host" + std::to_string(q / (P / hosts)); }

void BuildWorld(int me, int P) {
  Check(smddp::WorldBegin(me, P), "WorldBegin");
  const auto pids = Relay(me, P, std::to_string(getpid()));
  for (int q = 0; q < P; ++q)
    Check(smddp::WorldSetPeer(q, std::stoi(pids[q]), HostOf(q, P)), "peer");
  if (hosts > 1) {
    std::string address, provider, watch;
    Check(smddp::WorldOpenFabric("shm", "", &address, &provider), "WorldOpenFabric");
    Check(smddp::WorldWatchListen("127.0.0.1", &watch), "WorldWatchListen");
    std::vector<std::string> addresses(P);
    for (int q = 0; q < P; ++q) addresses[q] = Relay(me, P, q == me ? address : "")[q];
    const auto watches = Relay(me, P, watch);
    std::vector<int> higher;
    for (int q = 0; q < P; ++q) {
      if (HostOf(q, P) == HostOf(me, P)) continue;
      Check(smddp::WorldConnectFabric(q, addresses[q]), "WorldConnectFabric");
      if (q < me) Check(smddp::WorldWatchConnect(q, watches[q]), "WorldWatchConnect");
      if (q > me) higher.push_back(q);
    }
    Check(smddp::WorldWatchAccept(higher), "WorldWatchAccept");
  }
  std::vector<std::string> created(P);
  for (int q = 0; q < P; ++q) {  // one process's names at a time: they are long
    std::string mine;
    if (q == me) {
      for (int r = me + 1; r < P; ++r) {
        if (HostOf(r, P) != HostOf(me, P)) continue;
        std::string name;
        Check(smddp::WorldCreateShm(r, &name), "WorldCreateShm");
        mine += std::to_string(r) + "=" + name + ";";
      }
    }
    created[q] = Relay(me, P, mine)[q];
  }
  for (int q = 0; q < me; ++q) {
    if (HostOf(q, P) != HostOf(me, P)) continue;
    const std::string key = std::to_string(me) + "=";
    const size_t at = created[q].find(key), end = created[q].find(';', at);
    Check(smddp::WorldOpenShm(q, created[q].substr(at + key.size(), end - at - key.size())),
          "WorldOpenShm");
  }
  Barrier(P);
  for (int q = me + 1; q < P; ++q)
    if (HostOf(q, P) == HostOf(me, P)) Check(smddp::WorldUnlinkShm(q), "WorldUnlinkShm");
  Check(smddp::WorldStart(), "WorldStart");
}

constexpr size_t kOuter = 3, kInner = 500;  // elements
// all_reduce's: one that does not divide by the ranks, except across hosts
// (where the front end forwards such a call to the real NCCL).
size_t kCount = 3001;
constexpr size_t kBufferBytes = 64 << 10;

const char* OpName(Collective k) {
  switch (k) {
    case Collective::kAllGather:
      return "all_gather";
    case Collective::kReduceScatter:
      return "reduce_scatter";
    case Collective::kAllReduce:
      return "all_reduce";
    default:
      return "all_to_all";
  }
}

// One call's plan and its per-rank input and output sizes (elements).
Plan MakePlan(Collective kind, DType dtype, int P, size_t inner, size_t* in, size_t* out) {
  Plan p;
  p.kind = kind;
  p.dtype = dtype;
  p.outer = kOuter;
  switch (kind) {
    case Collective::kAllGather:
      p.inner = inner * 4;
      *in = kOuter * inner;
      *out = kOuter * P * inner;
      break;
    case Collective::kReduceScatter:
      p.inner = inner;
      *in = kOuter * P * inner;
      *out = kOuter * inner;
      break;
    case Collective::kAllReduce:
      p.count = kCount;
      *in = *out = kCount;
      break;
    case Collective::kAllToAll:
      p.inner = inner * 4;
      *in = *out = kOuter * P * inner;
      break;
  }
  return p;
}

// Small integers, exact in float32 sums; differ per rank, op, type and call.
std::vector<uint32_t> Input(int rank, int op, int type, int call, size_t n) {
  std::vector<uint32_t> v(n);
  uint64_t x = 0x9e3779b97f4a7c15ull * uint64_t(1 + rank + 16 * (op + 4 * (type + 2 * call)));
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    const int value = int(x % 41) - 20;
    if (type == 0) {
      const float f = float(value);
      std::memcpy(&v[i], &f, 4);
    } else {
      v[i] = uint32_t(value);
    }
  }
  return v;
}

struct Record {
  uint32_t head[8];  // op, type, call, ranks, outer, inner, count, rank
  std::vector<uint32_t> in, out;
};

bool Write(const std::string& path, const std::list<Record>& records) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return false;
  for (const Record& r : records) {
    const uint64_t sizes[2] = {r.in.size() * 4, r.out.size() * 4};
    std::fwrite(r.head, 4, 8, f);
    std::fwrite(sizes, 8, 2, f);
    std::fwrite(r.in.data(), 4, r.in.size(), f);
    std::fwrite(r.out.data(), 4, r.out.size(), f);
  }
  return std::fclose(f) == 0;
}

// Rank `rank` on local device `ordinal`: every call enqueued, one
// synchronization at the end.
void RunRank(const std::string& mode, const std::string& outdir, int P, int rank, int ordinal,
             gpu::CallRank me, const ncclUniqueId* id) {
  smddp_test::Who() = "rank " + std::to_string(rank);
  CHECK(cudaSetDevice(ordinal) == cudaSuccess);
  ncclComm_t comm = nullptr;
  if (id) {  // the NCCL front end: the communicator of this device's rank
    CHECK_MSG(ncclCommInitRank(&comm, P, *id, rank) == ncclSuccess,
              std::string("ncclCommInitRank: ") + ncclGetLastError(nullptr));
  }
  if (mode == "steady" || mode == "late_peer" || mode == "realloc" || mode == "dead_warm" ||
      mode == "replay") {
    smddp_test::SteadyRank s;
    s.ranks = P;
    s.rank = rank;
    s.process = rank / ranks_per_process;
    s.first_of_process = rank % ranks_per_process == 0;
    s.me = me;
    s.comm = comm;
    s.barrier = [] { JobBarrier(); };
    s.permutes = hosts == 1;
    if (mode == "steady")
      smddp_test::RunSteady(s);
    else if (mode == "realloc")
      smddp_test::RunRealloc(s);
    else if (mode == "replay")
      smddp_test::RunReplay(s);
    else if (mode == "dead_warm")
      smddp_test::RunDeadAfterWarmUp(s, s.process == job_processes - 1);
    else
      smddp_test::RunLatePeer(s, s.process == job_processes - 1);
    return;
  }
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  void *send = nullptr, *recv = nullptr;
  CHECK(cudaMalloc(&send, kBufferBytes) == cudaSuccess && cudaMalloc(&recv, kBufferBytes) == 0);
  smddp::cuda::GpuSettings settings;  // copy engines, stream memory operations
  settings.max_blocks = 8;
  std::list<Record> records;  // their host memory stays put until the end
  int64_t op_id = 0;
  int in_place = 0;  // calls that read their peers' buffers in place
  const bool schedule = mode.rfind("schedule", 0) == 0;
  for (int op = 0; op < 4; ++op) {
    for (int type = 0; type < 2; ++type) {
      for (int call = 0; call < 2; ++call) {
        const auto kind = Collective(op);
        if (schedule && (kind != Collective::kAllGather || type != 0)) continue;
        size_t in_n = 0, out_n = 0;
        const size_t inner = schedule ? 1024 : kInner;
        Plan plan =
            MakePlan(kind, type == 0 ? DType::kFloat32 : DType::kInt32, P, inner, &in_n, &out_n);
        if (schedule) plan.outer = 1, in_n = inner, out_n = P * inner;
        if (comm && kind != Collective::kAllReduce) plan.outer = 1;  // NCCL's layouts: one row
        const size_t row = plan.outer == 1 && !schedule ? kOuter * inner : inner;
        Record& r = records.emplace_back();
        const uint32_t head[8] = {uint32_t(op),     uint32_t(type),       uint32_t(call),
                                  uint32_t(P),      uint32_t(plan.outer), uint32_t(row),
                                  uint32_t(kCount), uint32_t(rank)};
        std::memcpy(r.head, head, sizeof(head));
        r.in = Input(rank, op, type, call, in_n);
        r.out.assign(out_n, 0xdeadbeef);
        CHECK(in_n * 4 <= kBufferBytes && out_n * 4 <= kBufferBytes);
        CHECK(cudaMemcpyAsync(send, r.in.data(), in_n * 4, cudaMemcpyHostToDevice, stream) ==
              cudaSuccess);
        if (comm) {
          const size_t n = kind == Collective::kAllReduce ? kCount : row;
          const ncclDataType_t t = type == 0 ? ncclFloat32 : ncclInt32;
          ncclResult_t rc;
          if (kind == Collective::kAllGather)
            rc = ncclAllGather(send, recv, n, t, comm, stream);
          else if (kind == Collective::kReduceScatter)
            rc = ncclReduceScatter(send, recv, n, t, ncclSum, comm, stream);
          else if (kind == Collective::kAllReduce)
            rc = ncclAllReduce(send, recv, n, t, ncclSum, comm, stream);
          else
            rc = ncclAlltoAll(send, recv, n, t, comm, stream);
          op_id++;
          CHECK_MSG(rc == ncclSuccess, std::string(OpName(kind)) + ": " + ncclGetLastError(comm));
        } else {
          smddp::cuda::CudaStreamOps ops(stream, settings);
          const Status st =
              gpu::EnqueueCollective(OpName(kind), op_id++, me, ops, send, recv, plan);
          CHECK_MSG(st.ok(), std::string(OpName(kind)) + ": " + st.message());
          in_place += !me.rank->view.inputs.empty() || me.rank->view.device.active;
        }
        CHECK(cudaMemcpyAsync(r.out.data(), recv, out_n * 4, cudaMemcpyDeviceToHost, stream) ==
              cudaSuccess);
      }
    }
  }
  const cudaError_t err = cudaStreamSynchronize(stream);
  CHECK_MSG(err == cudaSuccess, std::string("the stream failed: ") + cudaGetErrorString(err) +
                                    ": " + mock_node::Fault(ordinal));
  CHECK(Write(outdir + "/rank" + std::to_string(rank) + ".bin", records));
  if (!comm) std::printf("rank %d: %d of %d calls read in place\n", rank, in_place, int(op_id));
  std::fflush(stdout);
  cudaStreamDestroy(stream);
  cudaFree(send);
  cudaFree(recv);
}

// The last process dies after set-up: every rank of the others has a call
// fail within seconds, naming the dead ranks. With host flag memory (the
// default) the calls meet no peer on the host, so the first may enqueue before
// the group's watch sees the death (its stream is then released); the
// survivor keeps calling, paced, until one fails.
int DeadPeer(int p, int P, int G, gpu::GpuCommunicator* comm) {
  const int N = P * G;
  if (p == P - 1) raise(SIGKILL);
  std::vector<std::thread> threads;
  for (int i = 0; i < G; ++i) {
    threads.emplace_back([&, i] {
      const int rank = p * G + i;
      smddp_test::Who() = "rank " + std::to_string(rank);
      CHECK(cudaSetDevice(i) == cudaSuccess);
      cudaStream_t stream;
      CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
      void *send = nullptr, *recv = nullptr;
      CHECK(cudaMalloc(&send, kBufferBytes) == 0 && cudaMalloc(&recv, kBufferBytes) == 0);
      size_t in_n = 0, out_n = 0;
      const Plan plan = MakePlan(Collective::kAllGather, DType::kFloat32, N, kInner, &in_n, &out_n);
      smddp::cuda::GpuSettings settings;
      settings.max_blocks = 8;
      smddp::cuda::CudaStreamOps ops(stream, settings);
      const auto t0 = std::chrono::steady_clock::now();
      auto since = [&] {
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      };
      Status st;
      for (int64_t op = 0; st.ok() && since() < 10; ++op) {
        if (op) std::this_thread::sleep_for(std::chrono::milliseconds(10));
        st = gpu::EnqueueCollective("all_gather", op, gpu::CallRank{comm->Local(rank)}, ops, send,
                                    recv, plan);
      }
      const double s = since();
      CHECK_MSG(!st.ok() && st.message().find("is gone") != std::string::npos,
                "expected the call to fail naming the dead process, got: " + st.message());
      std::printf("rank %d: failed after %.2f s: %s\n", rank, s, st.message().c_str());
      std::fflush(stdout);
      CHECK(s < 10, "the death was named after %.1f s", s);
      CHECK(cudaStreamSynchronize(stream) == cudaSuccess, "%s", mock_node::Fault(i).c_str());
      cudaStreamDestroy(stream);
      cudaFree(send);
      cudaFree(recv);
    });
  }
  for (auto& t : threads) t.join();
  Barrier(P - 1);  // no survivor leaves (and is named gone) before all have failed
  gpu::ReleaseCommunicators();
  return 0;
}

// Joins the ranks' threads, then leaves the world built by BuildWorld (a
// survivor of a death at once: its group's network cannot close in order).
int JoinAndLeaveWorld(std::vector<std::thread>& threads, const std::string& mode, int P) {
  for (auto& t : threads) t.join();
  if (mode == "dead_warm") SurvivorExit(P);
  Barrier(P);
  CHECK(gpu::CloseCommunicatorsAtExit(), "the network proxy idle at exit");
  smddp::WorldShutdown();
  return 0;
}

// The same calls through the NCCL API front end.
int RunProcessNccl(int p, int P, int G, const std::string& mode, const std::string& outdir) {
  const int N = P * G;
  BuildWorld(p, P);
  std::string id_bytes;
  if (p == 0) {
    ncclUniqueId id;
    CHECK(ncclGetUniqueId(&id) == ncclSuccess);
    for (size_t i = 0; i < sizeof(id.internal); ++i) {  // as hex: the relay carries text
      char hex[3];
      std::snprintf(hex, sizeof(hex), "%02x", unsigned(uint8_t(id.internal[i])));
      id_bytes += hex;
    }
  }
  const std::string hex = Relay(p, P, id_bytes)[0];
  ncclUniqueId id;
  for (size_t i = 0; i < sizeof(id.internal); ++i)
    id.internal[i] = char(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
  std::vector<std::thread> threads;
  for (int i = 0; i < G; ++i)
    threads.emplace_back(RunRank, mode, outdir, N, p * G + i, i, gpu::CallRank{}, &id);
  return JoinAndLeaveWorld(threads, mode, P);
}

// The custom calls' path across hosts, set up as jax_smddp/gpu.py does it:
// this host's communicator (its processes' handles only), then the group's
// hierarchy over the world's links (network slots staged in host memory).
int RunProcessAcrossHosts(int p, int P, int G, const std::string& mode, const std::string& outdir) {
  const int N = P * G, per_host = P / hosts, host = p / per_host;
  BuildWorld(p, P);
  std::vector<int64_t> members, intra;
  std::vector<int> host_of, process_of;
  for (int r = 0; r < N; ++r) {
    members.push_back(r);
    process_of.push_back(r / G);
    host_of.push_back(r / G / per_host);
    if (r / G / per_host == host) intra.push_back(r);
  }
  // The host's communicator numbers its ranks from 0 (group rank - first);
  // the hierarchy takes group ranks.
  const int first = int(intra[0]);
  std::vector<std::pair<int, int>> local, local_intra;
  for (int i = 0; i < G; ++i) {
    local.emplace_back(p * G + i, i);
    local_intra.emplace_back(p * G + i - first, i);
  }
  std::vector<std::pair<int, std::string>> handles;
  Status st = gpu::PrepareCommunicator(intra, 4096, local_intra, per_host, &handles);
  CHECK_MSG(st.ok(), "prepare: " + st.message());
  for (const auto& [rank, h] : handles) {
    CHECK(h.size() <= sizeof(board->handles[0].bytes));
    board->handles[first + rank].rank = rank;
    board->handles[first + rank].len = uint32_t(h.size());
    std::memcpy(board->handles[first + rank].bytes, h.data(), h.size());
  }
  Barrier(P);
  std::vector<std::pair<int, std::string>> remote;
  for (int64_t r : intra) {
    if (r / G != p)
      remote.emplace_back(int(r) - first,
                          std::string(board->handles[r].bytes, board->handles[r].len));
  }
  st = gpu::ConnectCommunicator(intra, remote);
  CHECK_MSG(st.ok(), "connect: " + st.message());
  bool gdrcopy = false, rail = false;
  st = gpu::PrepareHierarchy(members, host_of, process_of, local, intra, 4096, {}, &gdrcopy, &rail);
  CHECK_MSG(st.ok(), "prepare_hierarchy: " + st.message());
  Barrier(P);
  gpu::GpuHierarchy* hierarchy = gpu::FindHierarchy(gpu::GroupKey(members.data(), N));
  CHECK(hierarchy != nullptr);
  std::vector<std::thread> threads;
  for (int i = 0; i < G; ++i) {
    gpu::GpuHierarchy::Member* m = hierarchy->Find(p * G + i);
    CHECK(m && m->local && m->port);
    threads.emplace_back(RunRank, mode, outdir, N, p * G + i, i,
                         gpu::CallRank{m->local, m->port, &hierarchy->rank_of()}, nullptr);
  }
  return JoinAndLeaveWorld(threads, mode, P);
}

int RunProcess(int p, int P, int G, const std::string& mode, const std::string& outdir, bool nccl) {
  smddp_test::Who() = "process " + std::to_string(p);
  ranks_per_process = G;
  job_processes = P;
  std::string devices;
  for (int i = 0; i < G; ++i) devices += (i ? "," : "") + std::to_string(p * G + i);
  setenv("JAX_SMDDP_MOCK_DEVICES", devices.c_str(), 1);
  const bool staged = mode == "staged" || mode == "schedule_staged";
  setenv("JAX_SMDDP_GPU_DIRECT_READS", staged ? "0" : "1", 1);
  gpu::SetProcessIndex(p);
  smddp::SetTimeoutSeconds(20);
  if (nccl) return RunProcessNccl(p, P, G, mode, outdir);
  if (hosts > 1) return RunProcessAcrossHosts(p, P, G, mode, outdir);
  const int N = P * G;
  std::vector<int64_t> members;
  for (int r = 0; r < N; ++r) members.push_back(r);
  std::vector<std::pair<int, int>> local;
  for (int i = 0; i < G; ++i) local.emplace_back(p * G + i, i);
  std::vector<std::pair<int, std::string>> handles;
  Status st = gpu::PrepareCommunicator(members, 4096, local, P, &handles);
  CHECK_MSG(st.ok(), "prepare: " + st.message());
  for (const auto& [rank, h] : handles) {
    CHECK(h.size() <= sizeof(board->handles[0].bytes));
    board->handles[rank].rank = rank;
    board->handles[rank].len = uint32_t(h.size());
    std::memcpy(board->handles[rank].bytes, h.data(), h.size());
  }
  Barrier(P);
  std::vector<std::pair<int, std::string>> remote;
  for (int r = 0; r < N; ++r) {
    if (r / G != p)
      remote.emplace_back(r, std::string(board->handles[r].bytes, board->handles[r].len));
  }
  st = gpu::ConnectCommunicator(members, remote);
  if (mode == "refused") {
    CHECK_MSG(!st.ok(), "set-up went on without peer to peer");
    std::printf("refused: %s\n", st.message().c_str());
    std::fflush(stdout);
    Barrier(P);  // the peers are done with this process's handles
    gpu::ReleaseCommunicators();
    return 0;
  }
  CHECK_MSG(st.ok(), "connect: " + st.message());
  Barrier(P);
  gpu::GpuCommunicator* comm = gpu::FindCommunicator(gpu::GroupKey(members.data(), N));
  CHECK(comm != nullptr);
  if (mode == "dead") return DeadPeer(p, P, G, comm);
  std::vector<std::thread> threads;
  for (int i = 0; i < G; ++i) {
    gpu::LocalRank* me = comm->Local(p * G + i);
    CHECK(me && me->ordinal == i);
    threads.emplace_back(RunRank, mode, outdir, N, p * G + i, i, gpu::CallRank{me}, nullptr);
  }
  for (auto& t : threads) t.join();
  if (mode == "dead_warm") SurvivorExit(P);
  if (mode.rfind("schedule", 0) == 0) {
    for (int i = 0; i < G; ++i) {
      const int d = mock_node::NodeDevice(i);
      std::printf("device %d: peer copies in flight at most %d\n", d,
                  mock_node::MaxPeerCopiesInFlight(d));
    }
    if (p == 0) {  // rank 0's copies of its last call (the one P + 1 copies long)
      std::vector<mock_node::CopyRecord> mine;
      for (const auto& c : mock_node::Schedule())
        if (c.device == 0 && c.bytes == 1024 * 4) mine.push_back(c);
      const size_t n = mine.size(), from = n > size_t(N) ? n - size_t(N) : 0;
      std::sort(mine.begin() + long(from), mine.end(),
                [](const auto& a, const auto& b) { return a.start_us < b.start_us; });
      const double t0 = n ? mine[from].start_us : 0;
      for (size_t k = from; k < n; ++k)
        std::printf("copy: %s %.0f-%.0f us\n", mine[k].peer ? "peer" : "own ",
                    mine[k].start_us - t0, mine[k].end_us - t0);
    }
  }
  std::fflush(stdout);
  Barrier(P);  // every rank is done before any group goes
  gpu::ReleaseCommunicators();
  return 0;
}

}  // namespace

// What the mock node enforces, on its own (run in the parent, 5 devices):
// a device faults on another's memory until peer access from it is enabled,
// and stays poisoned; a CUDA IPC mapping serves the device it was opened on;
// a cuMem mapping serves the devices cuMemSetAccess named; a stream wait
// blocks its stream (not others) until the value is written; events order
// streams; a copy takes time in proportion to its size.
int MockSelfTest() {
  setenv("JAX_SMDDP_MOCK_DEVICES", "0,1,2,3,4", 1);
  setenv("JAX_SMDDP_MOCK_COPY_US", "1000", 1);
  void* mem[5];
  cudaStream_t s[5];
  for (int d = 0; d < 5; ++d) {
    CHECK(cudaSetDevice(d) == cudaSuccess && cudaMalloc(&mem[d], 1 << 20) == cudaSuccess);
    CHECK(cudaStreamCreateWithFlags(&s[d], cudaStreamNonBlocking) == cudaSuccess);
  }
  // Device 1 reads device 0's memory without peer access: a fault, for good.
  CHECK(cudaMemcpyAsync(mem[1], mem[0], 64, cudaMemcpyDeviceToDevice, s[1]) == cudaSuccess);
  CHECK(cudaStreamSynchronize(s[1]) == cudaErrorIllegalAddress);
  CHECK(mock_node::Fault(1).find("no peer access") != std::string::npos, "%s",
        mock_node::Fault(1).c_str());
  CHECK(cudaMemsetAsync(mem[1], 0, 4, s[1]) == cudaErrorIllegalAddress, "not poisoned");
  // Device 2 with peer access to device 0: the copy runs, and takes its time.
  CHECK(cudaSetDevice(2) == cudaSuccess && cudaDeviceEnablePeerAccess(0, 0) == cudaSuccess);
  std::memset(mem[0], 7, 1 << 20);
  auto t0 = std::chrono::steady_clock::now();
  CHECK(cudaMemcpyAsync(mem[2], mem[0], 1 << 20, cudaMemcpyDeviceToDevice, s[2]) == cudaSuccess);
  CHECK(cudaStreamSynchronize(s[2]) == cudaSuccess, "%s", mock_node::Fault(2).c_str());
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(static_cast<uint8_t*>(mem[2])[(1 << 20) - 1] == 7 && took > 1e-3 + 0.5e-3,
        "1 MiB took %.4f s", took);  // 1 ms + 1 MiB at 2 GB/s
  // An IPC mapping of device 0's memory opened on device 3 serves device 3,
  // not device 4.
  cudaIpcMemHandle_t h;
  void* opened = nullptr;
  CHECK(cudaIpcGetMemHandle(&h, mem[0]) == cudaSuccess);
  CHECK(cudaSetDevice(3) == cudaSuccess && cudaIpcOpenMemHandle(&opened, h, 1) == cudaSuccess);
  CHECK(cudaMemcpyAsync(mem[3], opened, 64, cudaMemcpyDeviceToDevice, s[3]) == cudaSuccess);
  CHECK(cudaStreamSynchronize(s[3]) == cudaSuccess, "%s", mock_node::Fault(3).c_str());
  CHECK(cudaMemcpyAsync(mem[4], opened, 64, cudaMemcpyDeviceToDevice, s[4]) == cudaSuccess);
  CHECK(cudaStreamSynchronize(s[4]) == cudaErrorIllegalAddress &&
            mock_node::Fault(4).find("IPC mapping opened on another device") != std::string::npos,
        "device 4 read device 3's mapping: %s", mock_node::Fault(4).c_str());
  // A stream wait blocks its stream until the value is written; an event
  // orders another stream after it.
  cudaStream_t waiter, other;
  cudaEvent_t done;
  CHECK(cudaSetDevice(3) == cudaSuccess);
  CHECK(cudaStreamCreateWithFlags(&waiter, 1) == 0 && cudaStreamCreateWithFlags(&other, 1) == 0);
  CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming) == cudaSuccess);
  auto* flag = static_cast<uint32_t*>(mem[3]);
  auto* out = static_cast<uint32_t*>(mem[3]) + 64;
  flag[0] = 0;
  out[0] = 0;
  using Wait = int (*)(cudaStream_t, unsigned long long, uint32_t, unsigned);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found;
  CHECK(cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &fn, 12000, 0, &found) == 0 && fn);
  CHECK(reinterpret_cast<Wait>(fn)(waiter, reinterpret_cast<uintptr_t>(flag), 5, 0) == 0);
  CHECK(cudaMemsetAsync(out, 1, 4, waiter) == cudaSuccess);
  CHECK(cudaEventRecord(done, waiter) == cudaSuccess);
  CHECK(cudaStreamWaitEvent(other, done, 0) == cudaSuccess);
  CHECK(cudaMemsetAsync(out, 2, 4, other) == cudaSuccess);  // after the waiter's, by the event
  CHECK(cudaMemsetAsync(out + 1, 3, 4, s[3]) == cudaSuccess);
  CHECK(cudaStreamSynchronize(s[3]) == cudaSuccess && out[1] == 0x03030303u, "a stream was held");
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(out[0] == 0, "the waiting stream went on before the value");
  __atomic_store_n(flag, 5u, __ATOMIC_RELEASE);
  CHECK(cudaStreamSynchronize(other) == cudaSuccess && out[0] == 0x02020202u,
        "the event did not order the streams: %#x", out[0]);
  std::printf("mock node: faults, peer access, IPC mappings, stream waits, events, copy times\n");
  for (int d = 0; d < 5; ++d) cudaFree(mem[d]);
  cudaIpcCloseMemHandle(opened);
  smddp_test::Passed();
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "mock") return MockSelfTest();
  if (argc != 4 && argc != 5) {
    std::fprintf(stderr, "usage: gpu_node_test [H]xPxG MODE OUTDIR [ffi|nccl], or mock\n");
    return 2;
  }
  const bool nccl = argc == 5 && std::string(argv[4]) == "nccl";
  int P = 0, G = 0, H = 0;
  if (std::sscanf(argv[1], "%dx%dx%d", &H, &P, &G) == 3) {  // hosts x processes x GPUs
    hosts = H;
    P *= H;
    kCount = 3000;
  } else {
    CHECK(std::sscanf(argv[1], "%dx%d", &P, &G) == 2);
  }
  CHECK(P > 0 && G > 0 && P * G <= 16);
  const std::string mode = argv[2], outdir = argv[3];
  board = static_cast<Board*>(
      mmap(nullptr, sizeof(Board), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  CHECK(board != MAP_FAILED);
  std::fflush(stdout);
  std::vector<pid_t> children;
  for (int p = 0; p < P; ++p) {
    const pid_t pid = fork();
    if (pid == 0) {
      const int rc = RunProcess(p, P, G, mode, outdir, nccl);
      std::fflush(stdout);
      _exit(rc);
    }
    children.push_back(pid);
  }
  // Whose mock device memory is this run's (the test checks none is left).
  std::string pids;
  for (pid_t c : children) pids += " " + std::to_string(c);
  std::printf("processes:%s\n", pids.c_str());
  std::fflush(stdout);
  bool ok = true;
  for (size_t left = children.size(); left > 0; --left) {
    int status = 0;
    const pid_t pid = wait(&status);
    const bool killed =
        (mode == "dead" || mode == "dead_warm") && pid == children.back();  // it kills itself
    if (killed ? !(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
               : (!WIFEXITED(status) || WEXITSTATUS(status) != 0)) {
      std::fprintf(stderr, "process (pid %d) failed\n", int(pid));
      ok = false;
      for (pid_t c : children) kill(c, SIGKILL);
    }
  }
  // The mock's device memory that processes left (killed, or the front end's
  // communicators, which XLA never destroys either).
  if (DIR* dir = opendir("/dev/shm")) {
    while (dirent* e = readdir(dir)) {
      for (pid_t c : children) {
        const std::string prefix = "jax_smddp_node-" + std::to_string(c) + "-";
        if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0)
          shm_unlink(("/" + std::string(e->d_name)).c_str());
      }
    }
    closedir(dir);
  }
  CHECK(ok, "a process failed");
  smddp_test::Passed();
  return 0;
}

// Symmetric memory through the NCCL API front end (cuda/ncclapi/nccl_windows.h)
// on the mock node (tests/native/mock_node: devices that fault on memory they
// were not granted, streams that run concurrently): P processes of G devices
// build jax_smddp's world (nccl_harness.h), each device's thread creates its
// rank's communicator, allocates with ncclMemAlloc and registers windows as
// XLA does under --xla_gpu_enable_nccl_user_buffers, then calls on its stream
// (the front end's stream backend, cuda/ncclapi/nccl_library.cc).
//
//   nccl_windows_test PxG exact|mismatch|mismatch_registered|size_mismatch|realloc|passthrough
//
// exact: an input window (ncclCommWindowRegister) and an output window
// (ncclCommRegister), buffers at offsets inside them; every collective in
// float32 and int32, then 20 calls of each in int32, every answer checked
// against a reference computed here from every rank's inputs; prints what
// the registration cost each process and what the 20 x 4 cost it
//   windows registration process <p>: <counter> <n> ...
//   windows steady process <p>: <counter> <n> ...
// and one call on buffers outside any window (the usual path), checked too.
// mismatch: rank kOdd calls all_gather on its window at another offset than
// the others (mismatch_registered: it registered its window at another
// offset of its allocation); every rank prints the failure it saw:
//   rank <r>: failed after <s> s: <message>
// size_mismatch: rank kOdd registers a window of another size; every rank's
// registration fails: rank <r>: registration failed: <message>
// realloc: a window deregistered, its memory freed, allocated again and
// registered: a new registration index, calls exact before and after:
//   realloc rank <r>: window #<a> then #<b>
//   windows realloc process <p>: <counter> <n> ...
// two_comms: the windows registered with a split of the communicator too
// (the same allocations): calls exact on both; the second registration maps
// nothing anew: windows second process <p>: ..., windows two_comms process <p>: ...
// passthrough: the real library is of a version the front end does not know
// (MOCK_NCCL_VERSION): ncclMemAlloc/ncclMemFree reach it, ncclCommRegister
// registers no window.
// Prints "all checks passed" and exits 0 on success.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>  // the mock node

#include "cuda/ncclapi/nccl_types.h"
#include "cuda/ncclapi/nccl_windows.h"
#include "tests/native/check.h"
#include "tests/native/job_ranks.h"
#include "tests/native/nccl_harness.h"
#include "xla_ffi/engine/buffer_exchange.h"

extern "C" {
ncclResult_t ncclCommInitRank(ncclComm_t*, int, ncclUniqueId, int);
ncclResult_t ncclMemAlloc(void**, size_t);
ncclResult_t ncclMemFree(void*);
ncclResult_t ncclCommWindowRegister(ncclComm_t, void*, size_t, void**, int);
ncclResult_t ncclCommWindowDeregister(ncclComm_t, void*);
ncclResult_t ncclCommRegister(const ncclComm_t, void*, size_t, void**);
ncclResult_t ncclCommDeregister(const ncclComm_t, void*);
}

namespace {

using nccl_test::Relay;

int G = 1, N = 1;                      // devices per process, ranks
constexpr size_t kRow = 1500;          // elements per rank's block
constexpr size_t kCount = 3001;        // all_reduce's elements (not a multiple of the ranks)
constexpr size_t kWindow = 256 << 10;  // bytes per window
constexpr size_t kInOffset = 1280, kOutOffset = 768;  // where the buffers sit in them
constexpr int kOdd = 5;                               // mismatch: the rank at another offset

// Every rank of the job: this process's threads, then the processes.
smddp_test::ThreadsThenProcesses job_ranks;
void JobBarrier() {
  job_ranks.Wait(G, [] { Relay("barrier"); });
}

const char* const kOps[] = {"all_gather", "reduce_scatter", "all_reduce", "all_to_all"};

void Sizes(int op, size_t* in, size_t* out) {
  const size_t n = size_t(N);
  if (op == 0) *in = kRow, *out = n * kRow;
  if (op == 1) *in = n * kRow, *out = kRow;
  if (op == 2) *in = *out = kCount;
  if (op == 3) *in = *out = n * kRow;
}

// Rank r's answer, from every rank's input (NCCL's layouts, written out).
std::vector<int32_t> Want(int op, int r, int call) {
  size_t in = 0, out = 0;
  Sizes(op, &in, &out);
  std::vector<int32_t> want(out, 0);
  for (int q = 0; q < N; ++q) {
    const std::vector<int32_t> x = smddp_test::RankData(q, op, call, in);
    if (op == 0)
      for (size_t i = 0; i < kRow; ++i) want[size_t(q) * kRow + i] = x[i];
    if (op == 1)
      for (size_t i = 0; i < kRow; ++i) want[i] += x[size_t(r) * kRow + i];
    if (op == 2)
      for (size_t i = 0; i < kCount; ++i) want[i] += x[i];
    if (op == 3)
      for (size_t i = 0; i < kRow; ++i) want[size_t(q) * kRow + i] = x[size_t(r) * kRow + i];
  }
  return want;
}

// One rank: its communicator, stream, and calls on given buffers.
struct Rank {
  int rank = 0, ordinal = 0;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  struct Pending {
    int op, call, type;
    std::vector<int32_t> out;
  };
  std::vector<Pending> pending;  // read back on the stream, checked after it synchronized

  // Call `call` of `op` (type 0: float32, 1: int32) from `send` into `recv`;
  // false with `error` if the front end refused it.
  bool Call(int op, int call, int type, void* send, void* recv, std::string* error = nullptr) {
    size_t in = 0, out = 0;
    Sizes(op, &in, &out);
    std::vector<int32_t> x = smddp_test::RankData(rank, op, call, in);
    if (type == 0)
      for (int32_t& v : x) {
        const float f = float(v);
        std::memcpy(&v, &f, 4);
      }
    auto* host = new std::vector<int32_t>(std::move(x));  // lives until the copy ran
    CHECK(cudaMemcpyAsync(send, host->data(), in * 4, cudaMemcpyHostToDevice, stream) == 0);
    const ncclDataType_t t = type == 0 ? ncclFloat32 : ncclInt32;
    ncclResult_t rc;
    if (op == 0)
      rc = ncclAllGather(send, recv, kRow, t, comm, stream);
    else if (op == 1)
      rc = ncclReduceScatter(send, recv, kRow, t, ncclSum, comm, stream);
    else if (op == 2)
      rc = ncclAllReduce(send, recv, kCount, t, ncclSum, comm, stream);
    else
      rc = ncclAlltoAll(send, recv, kRow, t, comm, stream);
    keep.emplace_back(host);
    if (rc != ncclSuccess) {
      const std::string why = ncclGetLastError(comm);
      CHECK_MSG(error, std::string(kOps[op]) + ": " + why);
      *error = why;
      return false;
    }
    pending.push_back({op, call, type, std::vector<int32_t>(out, -12345)});
    CHECK(cudaMemcpyAsync(pending.back().out.data(), recv, out * 4, cudaMemcpyDeviceToHost,
                          stream) == 0);
    return true;
  }
  // Synchronizes and checks every pending answer.
  void Check() {
    const cudaError_t err = cudaStreamSynchronize(stream);
    CHECK_MSG(err == cudaSuccess, std::string("the stream failed: ") + cudaGetErrorString(err) +
                                      ": " + mock_node::Fault(ordinal));
    for (Pending& p : pending) {
      std::vector<int32_t> want = Want(p.op, rank, p.call);
      if (p.type == 0)
        for (int32_t& v : want) {
          const float f = float(v);
          std::memcpy(&v, &f, 4);
        }
      size_t bad = 0, first = 0;
      for (size_t i = 0; i < want.size(); ++i)
        if (p.out[i] != want[i] && bad++ == 0) first = i;
      CHECK(bad == 0, "%s %s call %d: %zu of %zu wrong, first at %zu: %d (want %d)", kOps[p.op],
            p.type == 0 ? "float32" : "int32", p.call, bad, want.size(), first, p.out[first],
            want[first]);
    }
    pending.clear();
    keep.clear();
  }
  std::vector<std::unique_ptr<std::vector<int32_t>>> keep;
};

struct Snapshot {
  mock_node::Counters mock;
  smddp::BufferExchange::HostWaits host;
  smddp::nccl::WindowCounts windows;
};
Snapshot Take() {
  return {mock_node::Count(), smddp::BufferExchange::HostWaitCounts(), smddp::nccl::CountWindows()};
}
void Print(const char* what, int p, const Snapshot& b, const Snapshot& a) {
  auto d = [](uint64_t x, uint64_t y) { return (unsigned long long)(y - x); };
  std::printf(
      "windows %s process %d: ipc_exports %llu ipc_opens %llu cumem_exports %llu imports %llu "
      "maps %llu grants %llu meetings %llu waits %llu registered %llu windowed %llu usual %llu\n",
      what, p, d(b.mock.ipc_exports, a.mock.ipc_exports), d(b.mock.ipc_opens, a.mock.ipc_opens),
      d(b.mock.cumem_exports, a.mock.cumem_exports), d(b.mock.imports, a.mock.imports),
      d(b.mock.maps, a.mock.maps), d(b.mock.grants, a.mock.grants),
      d(b.host.meetings, a.host.meetings), d(b.host.waits, a.host.waits),
      d(b.windows.registered, a.windows.registered), d(b.windows.windowed, a.windows.windowed),
      d(b.windows.usual, a.windows.usual));
  std::fflush(stdout);
}

// A window of kWindow bytes from ncclMemAlloc, registered on `comm`.
void* Window(Rank& me, bool window_api, void** handle) {
  void* p = nullptr;
  CHECK(ncclMemAlloc(&p, kWindow) == ncclSuccess, "ncclMemAlloc: %s", ncclGetLastError(nullptr));
  const ncclResult_t rc = window_api ? ncclCommWindowRegister(me.comm, p, kWindow, handle, 0)
                                     : ncclCommRegister(me.comm, p, kWindow, handle);
  CHECK(rc == ncclSuccess, "registering: %s", ncclGetLastError(me.comm));
  return p;
}

void Exact(Rank& me, int p) {
  const bool first = me.rank % G == 0;
  JobBarrier();
  const Snapshot before_registration = Take();
  JobBarrier();
  void *hin = nullptr, *hout = nullptr;
  auto* win_in = static_cast<uint8_t*>(Window(me, true, &hin));
  auto* win_out = static_cast<uint8_t*>(Window(me, false, &hout));
  JobBarrier();
  const Snapshot after_registration = Take();
  JobBarrier();
  if (first) Print("registration", p, before_registration, after_registration);
  uint8_t* send = win_in + kInOffset;
  uint8_t* recv = win_out + kOutOffset;
  for (int op = 0; op < 4; ++op)
    for (int type = 0; type < 2; ++type)
      for (int call = 0; call < 2; ++call) me.Call(op, call, type, send, recv);
  me.Check();
  JobBarrier();
  const Snapshot before = Take();
  JobBarrier();
  for (int op = 0; op < 4; ++op)
    for (int call = 2; call < 22; ++call) me.Call(op, call, 1, send, recv);
  me.Check();
  JobBarrier();
  const Snapshot after = Take();
  JobBarrier();
  if (first) Print("steady", p, before, after);
  // Buffers outside any window: the usual path, on the same communicator.
  void *plain_in = nullptr, *plain_out = nullptr;
  CHECK(cudaMalloc(&plain_in, kWindow) == 0 && cudaMalloc(&plain_out, kWindow) == 0);
  for (int op = 0; op < 4; ++op) me.Call(op, 30, 1, plain_in, plain_out);
  me.Check();
  JobBarrier();
  if (first) Print("outside", p, after, Take());
  CHECK(ncclCommWindowDeregister(me.comm, hin) == ncclSuccess, "%s", ncclGetLastError(me.comm));
  CHECK(ncclCommDeregister(me.comm, hout) == ncclSuccess, "%s", ncclGetLastError(me.comm));
  CHECK(ncclMemFree(win_in) == ncclSuccess && ncclMemFree(win_out) == ncclSuccess);
  cudaFree(plain_in);
  cudaFree(plain_out);
}

// `registered`: rank kOdd registers its input window 256 bytes into its
// allocation (the others at its start) and every rank calls on the same
// buffer, 256 bytes in: rank kOdd's offset in its window is 0, the others' 256.
// Else rank kOdd calls 256 bytes further into its window than the others.
void Mismatch(Rank& me, bool registered) {
  void *hin = nullptr, *hout = nullptr;
  uint8_t* send = nullptr;
  uint8_t* win_in = nullptr;
  if (registered) {
    void* p = nullptr;
    CHECK(ncclMemAlloc(&p, kWindow) == ncclSuccess);
    win_in = static_cast<uint8_t*>(p);
    CHECK(ncclCommWindowRegister(me.comm, win_in + (me.rank == kOdd ? 256 : 0), kWindow - 256, &hin,
                                 0) == ncclSuccess,
          "registering: %s", ncclGetLastError(me.comm));
    send = win_in + 256;
  } else {
    win_in = static_cast<uint8_t*>(Window(me, true, &hin));
    send = win_in + (me.rank == kOdd ? 256 : 0);
  }
  auto* win_out = static_cast<uint8_t*>(Window(me, true, &hout));
  me.Call(0, 0, 1, win_out, win_out + (64 << 10));  // the same offsets everywhere: exact
  me.Check();
  JobBarrier();
  const auto t0 = std::chrono::steady_clock::now();
  auto since = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  std::string error;
  for (int call = 1; error.empty() && since() < 10; ++call) {
    if (call > 1) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    me.Call(0, call, 1, send, win_out, &error);
  }
  std::printf("rank %d: failed after %.2f s: %s\n", me.rank, since(), error.c_str());
  // What was enqueued ends (released), never hangs, and nothing faulted.
  const cudaError_t err = cudaStreamSynchronize(me.stream);
  CHECK_MSG(err == cudaSuccess, std::string("the stream: ") + cudaGetErrorString(err) + ": " +
                                    mock_node::Fault(me.ordinal));
  me.pending.clear();  // the outputs of a failed group are undefined
  me.keep.clear();
  ncclResult_t async = ncclSuccess;
  CHECK(ncclCommGetAsyncError(me.comm, &async) == ncclSuccess && async == ncclRemoteError,
        "async error %d", int(async));
  std::printf("rank %d: async error %d\n", me.rank, int(async));
  std::fflush(stdout);
  JobBarrier();  // nobody frees memory a peer's stream may still read
}

void Realloc(Rank& me, int p) {
  const bool first = me.rank % G == 0;
  void *hin = nullptr, *hout = nullptr;
  auto* win_in = static_cast<uint8_t*>(Window(me, true, &hin));
  auto* win_out = static_cast<uint8_t*>(Window(me, true, &hout));
  const int64_t a = smddp::nccl::WindowIndex(hin);
  me.Call(0, 0, 1, win_in, win_out);
  me.Call(2, 1, 0, win_in + kInOffset, win_out + kOutOffset);
  me.Check();
  CHECK(ncclCommWindowDeregister(me.comm, hin) == ncclSuccess, "%s", ncclGetLastError(me.comm));
  CHECK(smddp::nccl::WindowIndex(hin) == -1, "a deregistered window is still known");
  CHECK(ncclMemFree(win_in) == ncclSuccess);
  JobBarrier();
  const Snapshot before = Take();
  JobBarrier();
  auto* again = static_cast<uint8_t*>(Window(me, true, &hin));
  const int64_t b = smddp::nccl::WindowIndex(hin);
  CHECK(a >= 0 && b > a + 1, "window #%lld registered again as #%lld", (long long)a, (long long)b);
  for (int call = 2; call < 4; ++call) me.Call(0, call, 1, again, win_out);
  me.Call(2, 4, 1, again + kInOffset, win_out + kOutOffset);
  me.Check();
  JobBarrier();
  const Snapshot after = Take();
  JobBarrier();
  std::printf("realloc rank %d: window #%lld then #%lld\n", me.rank, (long long)a, (long long)b);
  if (first) Print("realloc", p, before, after);
  JobBarrier();
  CHECK(ncclCommWindowDeregister(me.comm, hin) == ncclSuccess);
  CHECK(ncclCommWindowDeregister(me.comm, hout) == ncclSuccess);
  CHECK(ncclMemFree(again) == ncclSuccess && ncclMemFree(win_out) == ncclSuccess);
}

// Rank kOdd registers a window of another size: every rank's registration
// fails naming it.
void SizeMismatch(Rank& me) {
  void* p = nullptr;
  CHECK(ncclMemAlloc(&p, kWindow) == ncclSuccess);
  void* handle = nullptr;
  const size_t bytes = me.rank == kOdd ? kWindow / 2 : kWindow;
  CHECK(ncclCommRegister(me.comm, p, bytes, &handle) == ncclRemoteError, "registered");
  std::printf("rank %d: registration failed: %s\n", me.rank, ncclGetLastError(me.comm));
  std::fflush(stdout);
  JobBarrier();
  CHECK(ncclMemFree(p) == ncclSuccess);
}

// One allocation registered with two communicators (the second a split of
// the first, as XLA registers an allocation with each communicator that uses
// it): calls exact on both; the second registration exports again but maps
// no peer's allocation anew (a legacy CUDA IPC handle opens once per device
// and process).
void TwoComms(Rank& me, int p) {
  const bool first = me.rank % G == 0;
  void *hin = nullptr, *hout = nullptr, *hin2 = nullptr, *hout2 = nullptr;
  auto* win_in = static_cast<uint8_t*>(Window(me, true, &hin));
  auto* win_out = static_cast<uint8_t*>(Window(me, false, &hout));
  me.Call(0, 0, 1, win_in + kInOffset, win_out + kOutOffset);
  me.Check();
  ncclComm_t a = me.comm, b = nullptr;
  CHECK(ncclCommSplit(a, 0, me.rank, &b, nullptr) == ncclSuccess && b, "ncclCommSplit: %s",
        ncclGetLastError(a));
  JobBarrier();
  const Snapshot before = Take();
  JobBarrier();
  CHECK(ncclCommWindowRegister(b, win_in, kWindow, &hin2, 0) == ncclSuccess, "%s",
        ncclGetLastError(b));
  CHECK(ncclCommRegister(b, win_out, kWindow, &hout2) == ncclSuccess, "%s", ncclGetLastError(b));
  JobBarrier();
  const Snapshot after = Take();
  JobBarrier();
  if (first) Print("second", p, before, after);
  me.comm = b;
  for (int op = 0; op < 4; ++op) me.Call(op, 1, 1, win_in + kInOffset, win_out + kOutOffset);
  me.Check();
  me.comm = a;
  me.Call(2, 2, 0, win_in + kInOffset, win_out + kOutOffset);
  me.Check();
  JobBarrier();
  if (first) Print("two_comms", p, after, Take());
  JobBarrier();
  CHECK(ncclCommWindowDeregister(b, hin2) == ncclSuccess && ncclCommDeregister(b, hout2) == 0);
  me.comm = b;  // the mappings live on with the first communicator's windows
  me.Call(0, 3, 1, win_in, win_out);
  me.Check();
  me.comm = a;
  me.Call(0, 4, 1, win_in, win_out);
  me.Check();
  CHECK(ncclCommWindowDeregister(a, hin) == ncclSuccess && ncclCommDeregister(a, hout) == 0);
  std::printf("rank %d: two communicators\n", me.rank);
}

// A real library of a version the front end does not know (MOCK_NCCL_VERSION):
// its communicators are forwarded, and so are ncclMemAlloc and ncclMemFree.
void Passthrough(Rank& me) {
  void* p = nullptr;
  CHECK(ncclMemAlloc(&p, kWindow) == ncclSuccess && p, "%s", ncclGetLastError(nullptr));
  CHECK(nccl_test::Has(nccl_test::Record(), "ncclMemAlloc size=" + std::to_string(kWindow)),
        "ncclMemAlloc did not reach the real library: %s", nccl_test::Record().c_str());
  void* handle = &me;
  CHECK(ncclCommRegister(me.comm, p, kWindow, &handle) == ncclSuccess && handle == nullptr);
  CHECK(smddp::nccl::CountWindows().registered == 0, "a forwarded communicator got a window");
  CHECK(ncclMemFree(p) == ncclSuccess);
  CHECK(nccl_test::Has(nccl_test::Record(), "ncclMemFree"), "%s", nccl_test::Record().c_str());
  std::printf("rank %d: passed through\n", me.rank);
}

void RunRank(const std::string& scenario, int p, int i, const ncclUniqueId& id) {
  Rank me;
  me.rank = p * G + i;
  me.ordinal = i;
  smddp_test::Who() = "rank " + std::to_string(me.rank);
  CHECK(cudaSetDevice(i) == cudaSuccess);
  CHECK(cudaStreamCreateWithFlags(&me.stream, cudaStreamNonBlocking) == cudaSuccess);
  CHECK_MSG(ncclCommInitRank(&me.comm, N, id, me.rank) == ncclSuccess,
            std::string("ncclCommInitRank: ") + ncclGetLastError(nullptr));
  if (scenario == "exact") Exact(me, p);
  if (scenario == "mismatch") Mismatch(me, false);
  if (scenario == "mismatch_registered") Mismatch(me, true);
  if (scenario == "size_mismatch") SizeMismatch(me);
  if (scenario == "realloc") Realloc(me, p);
  if (scenario == "passthrough") Passthrough(me);
  if (scenario == "two_comms") TwoComms(me, p);
  // Served: no memory from the real library.
  if (scenario != "passthrough")
    CHECK(!nccl_test::Has(nccl_test::Record(), "ncclMem"), "%s", nccl_test::Record().c_str());
  JobBarrier();
  cudaStreamDestroy(me.stream);
}

int Run(const std::string& scenario) {
  const int p = nccl_test::me;
  smddp_test::Who() = "process " + std::to_string(p);
  std::string devices;
  for (int i = 0; i < G; ++i) devices += (i ? "," : "") + std::to_string(p * G + i);
  setenv("JAX_SMDDP_MOCK_DEVICES", devices.c_str(), 1);
  smddp::SetTimeoutSeconds(20);
  nccl_test::BuildWorld();
  std::string id_bytes;
  if (p == 0) {
    ncclUniqueId id;
    CHECK(ncclGetUniqueId(&id) == ncclSuccess);
    id_bytes.assign(id.internal, sizeof(id.internal));
  }
  const std::string got = Relay(id_bytes)[0];
  ncclUniqueId id;
  std::memcpy(id.internal, got.data(), sizeof(id.internal));
  std::vector<std::thread> threads;
  for (int i = 0; i < G; ++i) threads.emplace_back(RunRank, scenario, p, i, std::cref(id));
  for (auto& t : threads) t.join();
  return nccl_test::EndProcess();
}

}  // namespace

int main(int argc, char** argv) {
  int P = 0;
  if (argc != 3 || std::sscanf(argv[1], "%dx%d", &P, &G) != 2 || P < 1 || G < 1 || P * G > 16) {
    std::fprintf(stderr, "usage: nccl_windows_test PxG SCENARIO (see the top of the file)\n");
    return 2;
  }
  N = P * G;
  return nccl_test::RunMain(argv[2], P, -1, &Run);
}

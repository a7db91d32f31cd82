#include "tests/native/gpu_node_steady.h"

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>  // the mock node

#include "cuda/cuda_stream_ops.h"
#include "cuda/gpu_call.h"
#include "tests/native/check.h"
#include "tests/native/job_ranks.h"
#include "xla_ffi/algorithms/plan.h"
#include "xla_ffi/engine/buffer_exchange.h"

extern "C" {
const char* ncclGetLastError(ncclComm_t);
ncclResult_t ncclAllGather(const void*, void*, size_t, ncclDataType_t, ncclComm_t, void*);
ncclResult_t ncclReduceScatter(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                               void*);
ncclResult_t ncclAllReduce(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                           void*);
ncclResult_t ncclAlltoAll(const void*, void*, size_t, ncclDataType_t, ncclComm_t, void*);
ncclResult_t ncclGroupStart();
ncclResult_t ncclGroupEnd();
ncclResult_t ncclSend(const void*, size_t, ncclDataType_t, int, ncclComm_t, void*);
ncclResult_t ncclRecv(void*, size_t, ncclDataType_t, int, ncclComm_t, void*);
}

namespace smddp_test {
namespace {

using smddp::Collective;
constexpr size_t kRow = 512;  // int32 elements per rank's block
constexpr int kCalls = 50;    // after the warm-up
const char* const kNames[] = {"all_gather", "reduce_scatter", "all_reduce", "all_to_all",
                              "collective_permute"};

// Elements in and out of one rank's call of op `op`.
void Sizes(int op, size_t N, size_t* in, size_t* out) {
  switch (Collective(op)) {
    case Collective::kAllGather:
      *in = kRow, *out = N * kRow;
      break;
    case Collective::kReduceScatter:
      *in = N * kRow, *out = kRow;
      break;
    case Collective::kAllReduce:
    case Collective::kAllToAll:
      *in = *out = N * kRow;
      break;
    case Collective::kCollectivePermute:
      *in = *out = kRow;
      break;
  }
}

// Rank r's answer to call `call` of op `op`, from every rank's inputs.
std::vector<int32_t> Want(int op, int N, int r, int call) {
  size_t in = 0, out = 0;
  Sizes(op, size_t(N), &in, &out);
  std::vector<int32_t> want(out, 0);
  for (int q = 0; q < N; ++q) {
    const std::vector<int32_t> x = RankData(q, op, call, in);
    for (size_t i = 0; i < kRow; ++i) {
      switch (Collective(op)) {
        case Collective::kAllGather:
          want[size_t(q) * kRow + i] = x[i];
          break;
        case Collective::kReduceScatter:
          want[i] += x[size_t(r) * kRow + i];
          break;
        case Collective::kAllReduce:
          for (int b = 0; b < N; ++b) want[size_t(b) * kRow + i] += x[size_t(b) * kRow + i];
          break;
        case Collective::kAllToAll:
          want[size_t(q) * kRow + i] = x[size_t(r) * kRow + i];
          break;
        case Collective::kCollectivePermute:
          if (q == (r + N - 1) % N) want[i] = x[i];
          break;
      }
    }
  }
  return want;
}

struct Snapshot {
  mock_node::Counters mock;
  smddp::BufferExchange::HostWaits host;
};
Snapshot Take() { return {mock_node::Count(), smddp::BufferExchange::HostWaitCounts()}; }

void Print(const char* what, int process, const Snapshot& before, const Snapshot& after) {
  const auto& a = after.mock;
  const auto& b = before.mock;
  std::printf(
      "steady %s process %d: meetings %llu waits %llu ipc_exports %llu ipc_opens %llu "
      "cumem_exports %llu imports %llu maps %llu grants %llu attribute_queries %llu\n",
      what, process, (unsigned long long)(after.host.meetings - before.host.meetings),
      (unsigned long long)(after.host.waits - before.host.waits),
      (unsigned long long)(a.ipc_exports - b.ipc_exports),
      (unsigned long long)(a.ipc_opens - b.ipc_opens),
      (unsigned long long)(a.cumem_exports - b.cumem_exports),
      (unsigned long long)(a.imports - b.imports), (unsigned long long)(a.maps - b.maps),
      (unsigned long long)(a.grants - b.grants),
      (unsigned long long)(a.attribute_queries - b.attribute_queries));
  std::fflush(stdout);
}

// One rank's buffers and stream, and its calls on them.
class Caller {
 public:
  explicit Caller(const SteadyRank& s) : s_(s), N_(s.ranks), sources_(static_cast<size_t>(N_)) {
    CHECK(cudaGetDevice(&ordinal_) == cudaSuccess);
    CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking) == cudaSuccess);
    const size_t bytes = size_t(N_) * kRow * 4;
    CHECK(cudaMalloc(&send_, bytes) == cudaSuccess && cudaMalloc(&recv_, bytes) == cudaSuccess);
    settings_.max_blocks = 8;  // copy engines, stream memory operations
    for (int q = 0; q < N_; ++q) sources_[size_t(q)] = (q + N_ - 1) % N_;
  }
  ~Caller() {
    cudaStreamDestroy(stream_);
    cudaFree(send_);
    cudaFree(recv_);
  }

  // Starts `calls` calls of `op`: their inputs and outputs live here until Check.
  void Begin(int op, int calls) {
    op_ = op;
    Sizes(op, size_t(N_), &in_n_, &out_n_);
    ins_.assign(size_t(calls), {});
    outs_.assign(size_t(calls), {});
  }
  // Call `c` of the op: its input written on the stream, the call enqueued,
  // its output read back on the stream; returns how long the enqueue took (s).
  // A failure fails the test, or with `error` is said there (and returns -1).
  double Call(int c, std::string* error = nullptr) {
    Write(c);
    const double took = Enqueue(error);
    if (took >= 0) Read(c);
    return took;
  }
  // Call `c`'s input, written on the stream.
  void Write(int c) {
    ins_[size_t(c)] = RankData(s_.rank, op_, c, in_n_);
    outs_[size_t(c)].assign(out_n_, -12345);
    CHECK(cudaMemcpyAsync(send_, ins_[size_t(c)].data(), in_n_ * 4, cudaMemcpyHostToDevice,
                          stream_) == cudaSuccess);
  }
  // Call `c`'s output, read back on the stream.
  void Read(int c) {
    CHECK(cudaMemcpyAsync(outs_[size_t(c)].data(), recv_, out_n_ * 4, cudaMemcpyDeviceToHost,
                          stream_) == cudaSuccess);
  }
  // The collective alone: how long its enqueue took (s), or -1 with `error`.
  double Enqueue(std::string* error = nullptr) {
    const int r = s_.rank, N = N_;
    const auto kind = Collective(op_);
    const auto t0 = std::chrono::steady_clock::now();
    if (s_.comm) {
      ncclResult_t rc;
      if (kind == Collective::kAllGather)
        rc = ncclAllGather(send_, recv_, kRow, ncclInt32, s_.comm, stream_);
      else if (kind == Collective::kReduceScatter)
        rc = ncclReduceScatter(send_, recv_, kRow, ncclInt32, ncclSum, s_.comm, stream_);
      else if (kind == Collective::kAllReduce)
        rc = ncclAllReduce(send_, recv_, in_n_, ncclInt32, ncclSum, s_.comm, stream_);
      else if (kind == Collective::kAllToAll)
        rc = ncclAlltoAll(send_, recv_, kRow, ncclInt32, s_.comm, stream_);
      else {
        rc = ncclGroupStart();
        if (rc == ncclSuccess) rc = ncclSend(send_, kRow, ncclInt32, (r + 1) % N, s_.comm, stream_);
        if (rc == ncclSuccess)
          rc = ncclRecv(recv_, kRow, ncclInt32, (r + N - 1) % N, s_.comm, stream_);
        const ncclResult_t end = ncclGroupEnd();
        if (rc == ncclSuccess) rc = end;
      }
      if (rc != ncclSuccess && error) {
        *error = ncclGetLastError(s_.comm);
        return -1;
      }
      CHECK_MSG(rc == ncclSuccess, std::string(kNames[op_]) + ": " + ncclGetLastError(s_.comm));
    } else {
      smddp::Plan plan;
      plan.kind = kind;
      plan.dtype = smddp::DType::kInt32;
      plan.outer = 1;
      plan.inner = kind == Collective::kReduceScatter ? kRow : kRow * 4;
      plan.count = kind == Collective::kAllReduce ? in_n_ : 0;
      plan.sources = sources_.data();
      smddp::cuda::CudaStreamOps ops(stream_, settings_);
      // As the handlers do (xla_ffi/ffi/gpu_handlers.cc): a captured stream takes the
      // replayable path.
      const smddp::Status st = smddp::gpu::EnqueueCollective(kNames[op_], op_id_++, s_.me, ops,
                                                             send_, recv_, plan, ops.capturing());
      if (!st.ok() && error) {
        *error = st.message();
        return -1;
      }
      CHECK_MSG(st.ok(), std::string(kNames[op_]) + ": " + st.message());
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  // Records the collective alone into a graph (the stream captured meanwhile).
  cudaGraphExec_t Capture() {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    Enqueue();
    CHECK(cudaStreamEndCapture(stream_, &graph) == cudaSuccess);
    CHECK(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
    cudaGraphDestroy(graph);
    return exec;
  }
  void Launch(cudaGraphExec_t exec) { CHECK(cudaGraphLaunch(exec, stream_) == cudaSuccess); }
  // Frees the input buffer and allocates it again at the same start (as
  // XLA's allocator does): a new allocation at a known base.
  void ReallocateSend() {
    const size_t bytes = size_t(N_) * kRow * 4;
    void* was = send_;
    CHECK(cudaFree(send_) == cudaSuccess);
    std::vector<void*> misses;
    for (int k = 0; k < 8; ++k) {
      CHECK(cudaMalloc(&send_, bytes) == cudaSuccess);
      if (send_ == was) break;
      misses.push_back(send_);
    }
    for (void* m : misses) cudaFree(m);
    CHECK(send_ == was, "the reallocation did not land at the same start");
  }
  cudaError_t TrySynchronize() { return cudaStreamSynchronize(stream_); }
  void Synchronize() {
    CHECK(cudaStreamSynchronize(stream_) == cudaSuccess, "%s", mock_node::Fault(ordinal_).c_str());
  }
  // Every call begun, against its answer (after Synchronize).
  void Check() {
    for (size_t c = 0; c < outs_.size(); ++c) {
      const std::vector<int32_t> want = Want(op_, N_, s_.rank, int(c));
      for (size_t i = 0; i < out_n_; ++i)
        CHECK(outs_[c][i] == want[i], "%s call %zu: element %zu is %d, want %d", kNames[op_], c, i,
              outs_[c][i], want[i]);
    }
  }

 private:
  const SteadyRank& s_;
  const int N_;
  int ordinal_ = 0;
  cudaStream_t stream_;
  void *send_ = nullptr, *recv_ = nullptr;
  smddp::cuda::GpuSettings settings_;
  std::vector<int64_t> sources_;
  int64_t op_id_ = 0;
  int op_ = 0;
  size_t in_n_ = 0, out_n_ = 0;
  std::vector<std::vector<int32_t>> ins_, outs_;  // host copies: alive until the stream ran
};

}  // namespace

void RunSteady(const SteadyRank& s) {
  Caller caller(s);
  const Snapshot start = Take();
  for (int op = 0; op < (s.permutes ? 5 : 4); ++op) {
    caller.Begin(op, kCalls + 1);
    caller.Call(0);  // the warm-up: this op's buffers exported and mapped
    caller.Synchronize();
    s.barrier();
    const Snapshot before = Take();
    s.barrier();
    for (int c = 1; c <= kCalls; ++c) caller.Call(c);
    caller.Synchronize();
    s.barrier();
    const Snapshot after = Take();
    caller.Check();
    if (s.first_of_process) Print(kNames[op], s.process, before, after);
    s.barrier();  // every process printed before the next op's calls count
  }
  // The whole run, warm-ups included (where the buffers were exported and mapped).
  if (s.first_of_process) Print("total", s.process, start, Take());
}

void RunRealloc(const SteadyRank& s) {
  Caller caller(s);
  caller.Begin(0, 3);  // all_gather: the peers read the input in place
  caller.Call(0);      // the warm-up
  caller.Call(1);
  caller.Synchronize();
  s.barrier();
  const Snapshot before = Take();
  s.barrier();
  if (s.rank == 0) caller.ReallocateSend();
  s.barrier();
  caller.Call(2);
  caller.Synchronize();
  s.barrier();
  const Snapshot after = Take();
  caller.Check();
  if (s.first_of_process) Print("realloc", s.process, before, after);
  s.barrier();
}

void RunDeadAfterWarmUp(const SteadyRank& s, bool dies) {
  Caller caller(s);
  caller.Begin(0, 1000);  // all_gather
  caller.Call(0);         // the warm-up, and one more
  caller.Call(1);
  caller.Synchronize();
  s.barrier();
  if (dies) {
    std::fflush(stdout);
    raise(SIGKILL);
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto since = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  std::string error;
  // Paced: a call that waits for no peer returns at once, and the death takes a moment to see.
  for (int c = 2; c < 1000 && error.empty() && since() < 10; ++c) {
    if (c > 2) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    caller.Call(c, &error);
  }
  const double failed = since();
  CHECK_MSG(!error.empty(), "no call failed in 10 s after the peer died");
  std::printf("rank %d: failed after %.2f s: %s\n", s.rank, failed, error.c_str());
  std::fflush(stdout);
  // What was enqueued before the failure ends (released or poisoned), never hangs.
  const cudaError_t err = caller.TrySynchronize();
  std::printf("rank %d: synchronized after %.2f s (%s)\n", s.rank, since(),
              cudaGetErrorString(err));
  std::fflush(stdout);
}

void RunReplay(const SteadyRank& s) {
  constexpr int kReplays = 10;
  Caller caller(s);
  for (int op = 0; op < 4; ++op) {  // collective-permute: the front end forwards captured ones
    caller.Begin(op, kReplays + 1);
    caller.Call(0);  // uncaptured first, as XLA's first run before it records
    caller.Synchronize();
    s.barrier();
    cudaGraphExec_t graph = caller.Capture();
    for (int c = 1; c <= kReplays; ++c) {
      caller.Write(c);
      caller.Launch(graph);
      caller.Read(c);
    }
    caller.Synchronize();
    cudaGraphExecDestroy(graph);
    caller.Check();
    if (s.first_of_process)
      std::printf("replay %s process %d: %d replays exact\n", kNames[op], s.process, kReplays);
    std::fflush(stdout);
    s.barrier();
  }
}

void RunLatePeer(const SteadyRank& s, bool late) {
  constexpr int kLateCalls = 20;
  Caller caller(s);
  for (int op = 0; op < 2; ++op) {  // all_gather, reduce_scatter
    caller.Begin(op, kLateCalls + 1);
    caller.Call(0);  // the warm-up
    caller.Synchronize();
    s.barrier();
    std::vector<double> took;
    for (int c = 1; c <= kLateCalls; ++c) {
      if (late) std::this_thread::sleep_for(std::chrono::milliseconds(300));
      took.push_back(caller.Call(c));
    }
    caller.Synchronize();
    caller.Check();
    double enqueue_s = 0;
    for (double t : took) enqueue_s += t;
    std::sort(took.begin(), took.end());
    std::printf(
        "late_peer %s rank %d%s: %d enqueues took %.1f ms in all (the median %.2f, the longest "
        "%.1f)\n",
        kNames[op], s.rank, late ? " (late)" : "", kLateCalls, enqueue_s * 1e3,
        took[kLateCalls / 2] * 1e3, took.back() * 1e3);
    std::fflush(stdout);
    s.barrier();
  }
}

}  // namespace smddp_test

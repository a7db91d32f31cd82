#include "tests/native/gpu_node_steady.h"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>  // the mock node

#include "cuda/cuda_stream_ops.h"
#include "cuda/gpu_call.h"
#include "tests/native/check.h"
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

// Small integers, different per rank, op and call.
std::vector<int32_t> Data(int rank, int op, int call, size_t n) {
  std::vector<int32_t> v(n);
  uint64_t x = 0x9e3779b97f4a7c15ull * uint64_t(1 + rank + 64 * (op + 8 * call));
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    v[i] = int32_t(x % 41) - 20;
  }
  return v;
}

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
    const std::vector<int32_t> x = Data(q, op, call, in);
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

}  // namespace

void RunSteady(const SteadyRank& s) {
  const int N = s.ranks, r = s.rank;
  int ordinal = 0;
  CHECK(cudaGetDevice(&ordinal) == cudaSuccess);
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  void *send = nullptr, *recv = nullptr;
  const size_t bytes = size_t(N) * kRow * 4;
  CHECK(cudaMalloc(&send, bytes) == cudaSuccess && cudaMalloc(&recv, bytes) == cudaSuccess);
  smddp::cuda::GpuSettings settings;  // copy engines, stream memory operations
  settings.max_blocks = 8;
  std::vector<int64_t> sources(static_cast<size_t>(N));
  for (int q = 0; q < N; ++q) sources[size_t(q)] = (q + N - 1) % N;
  int64_t op_id = 0;
  const Snapshot start = Take();
  for (int op = 0; op < (s.permutes ? 5 : 4); ++op) {
    size_t in_n = 0, out_n = 0;
    Sizes(op, size_t(N), &in_n, &out_n);
    // Host copies of every call's input and output: alive until the stream ran.
    std::vector<std::vector<int32_t>> ins(kCalls + 1), outs(kCalls + 1);
    auto call = [&](int c) {
      ins[size_t(c)] = Data(r, op, c, in_n);
      outs[size_t(c)].assign(out_n, -12345);
      CHECK(cudaMemcpyAsync(send, ins[size_t(c)].data(), in_n * 4, cudaMemcpyHostToDevice,
                            stream) == cudaSuccess);
      const auto kind = Collective(op);
      if (s.comm) {
        ncclResult_t rc;
        if (kind == Collective::kAllGather)
          rc = ncclAllGather(send, recv, kRow, ncclInt32, s.comm, stream);
        else if (kind == Collective::kReduceScatter)
          rc = ncclReduceScatter(send, recv, kRow, ncclInt32, ncclSum, s.comm, stream);
        else if (kind == Collective::kAllReduce)
          rc = ncclAllReduce(send, recv, in_n, ncclInt32, ncclSum, s.comm, stream);
        else if (kind == Collective::kAllToAll)
          rc = ncclAlltoAll(send, recv, kRow, ncclInt32, s.comm, stream);
        else {
          rc = ncclGroupStart();
          if (rc == ncclSuccess) rc = ncclSend(send, kRow, ncclInt32, (r + 1) % N, s.comm, stream);
          if (rc == ncclSuccess)
            rc = ncclRecv(recv, kRow, ncclInt32, (r + N - 1) % N, s.comm, stream);
          const ncclResult_t end = ncclGroupEnd();
          if (rc == ncclSuccess) rc = end;
        }
        CHECK_MSG(rc == ncclSuccess, std::string(kNames[op]) + ": " + ncclGetLastError(s.comm));
      } else {
        smddp::Plan plan;
        plan.kind = kind;
        plan.dtype = smddp::DType::kInt32;
        plan.outer = 1;
        plan.inner = kind == Collective::kReduceScatter ? kRow : kRow * 4;
        plan.count = kind == Collective::kAllReduce ? in_n : 0;
        plan.sources = sources.data();
        smddp::cuda::CudaStreamOps ops(stream, settings);
        const smddp::Status st = smddp::gpu::EnqueueCollective(
            kNames[op], op_id++, smddp::gpu::CallRank{s.me}, ops, send, recv, plan);
        CHECK_MSG(st.ok(), std::string(kNames[op]) + ": " + st.message());
      }
      CHECK(cudaMemcpyAsync(outs[size_t(c)].data(), recv, out_n * 4, cudaMemcpyDeviceToHost,
                            stream) == cudaSuccess);
    };
    call(0);  // the warm-up: this op's buffers exported and mapped
    CHECK(cudaStreamSynchronize(stream) == cudaSuccess, "%s", mock_node::Fault(ordinal).c_str());
    s.barrier();
    const Snapshot before = Take();
    s.barrier();
    for (int c = 1; c <= kCalls; ++c) call(c);
    CHECK(cudaStreamSynchronize(stream) == cudaSuccess, "%s", mock_node::Fault(ordinal).c_str());
    s.barrier();
    const Snapshot after = Take();
    for (int c = 0; c <= kCalls; ++c) {
      const std::vector<int32_t> want = Want(op, N, r, c);
      for (size_t i = 0; i < out_n; ++i)
        CHECK(outs[size_t(c)][i] == want[i], "%s call %d: element %zu is %d, want %d", kNames[op],
              c, i, outs[size_t(c)][i], want[i]);
    }
    if (s.first_of_process) Print(kNames[op], s.process, before, after);
    s.barrier();  // every process printed before the next op's calls count
  }
  // The whole run, warm-ups included (where the buffers were exported and mapped).
  if (s.first_of_process) Print("total", s.process, start, Take());
  cudaStreamDestroy(stream);
  cudaFree(send);
  cudaFree(recv);
}

}  // namespace smddp_test

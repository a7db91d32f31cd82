#include "cuda/stream_driver.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "cuda/event_clock.h"
#include "cuda/gpu_communicator.h"
#include "xla_ffi/algorithms/phase_timer.h"
#include "xla_ffi/algorithms/stream_algorithms.h"

namespace smddp {
namespace cuda {

namespace {

// The message the bindings always gave: the call, then CUDA's words.
Status Failed(cudaError_t err, const char* what) {
  return Status::Error(std::string(what) + ": " + cudaGetErrorString(err));
}

// The engine's failures as they reach Python: a RuntimeError, whatever their code
// (InvalidArgument here is for stream_run's own arguments: a ValueError).
Status AsError(const Status& st) { return st.ok() ? st : Status::Error(st.message()); }

#define SMDDP_CUDA_OR_RETURN(expr, what)                \
  do {                                                  \
    const cudaError_t err_ = (expr);                    \
    if (err_ != cudaSuccess) return Failed(err_, what); \
  } while (0)

struct DirectBuffers {
  void* send = nullptr;
  void* recv = nullptr;
  size_t in_bytes = 0, out_bytes = 0;
};
DirectBuffers& TheDirectBuffers() {
  static DirectBuffers d;
  return d;
}

}  // namespace

Status StreamDirectBuffers(int ordinal, size_t in_bytes, size_t out_bytes, std::string* send_handle,
                           std::string* recv_handle) {
  DirectBuffers& d = TheDirectBuffers();
  SMDDP_CUDA_OR_RETURN(cudaSetDevice(ordinal), "cudaSetDevice");
  cudaFree(d.send);
  cudaFree(d.recv);
  d = DirectBuffers{};
  SMDDP_CUDA_OR_RETURN(cudaMalloc(&d.send, std::max<size_t>(in_bytes, 1)), "cudaMalloc");
  SMDDP_CUDA_OR_RETURN(cudaMalloc(&d.recv, std::max<size_t>(out_bytes, 1)), "cudaMalloc");
  d.in_bytes = in_bytes;
  d.out_bytes = out_bytes;
  cudaIpcMemHandle_t hs, hr;
  SMDDP_CUDA_OR_RETURN(cudaIpcGetMemHandle(&hs, d.send), "cudaIpcGetMemHandle");
  SMDDP_CUDA_OR_RETURN(cudaIpcGetMemHandle(&hr, d.recv), "cudaIpcGetMemHandle");
  send_handle->assign(reinterpret_cast<const char*>(&hs), sizeof(hs));
  recv_handle->assign(reinterpret_cast<const char*>(&hr), sizeof(hr));
  return Status::Ok();
}

namespace {

// The peers' direct buffers opened for one stream_run, closed after it.
struct OpenedPeers {
  std::vector<void*> opened;
  ~OpenedPeers() {
    for (void* p : opened) cudaIpcCloseMemHandle(p);
  }
  Status Open(const std::string& handle, void** out) {
    cudaIpcMemHandle_t h;
    if (handle.size() != sizeof(h)) return Status::InvalidArgument("stream_run: not an IPC handle");
    std::memcpy(&h, handle.data(), sizeof(h));
    void* p = nullptr;
    SMDDP_CUDA_OR_RETURN(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess),
                         "cudaIpcOpenMemHandle");
    opened.push_back(p);
    *out = p;
    return Status::Ok();
  }
};

// This call's own buffers (without direct reads), freed at its end, and the
// rank's view of its peers' buffers, cleared then.
struct RunBuffers {
  gpu::LocalRank* me;
  void* send = nullptr;
  void* recv = nullptr;
  ~RunBuffers() {
    me->view.inputs.clear();
    me->view.outputs.clear();
    if (send) cudaFree(send);
    if (recv) cudaFree(recv);
  }
};

}  // namespace

Status StreamRun(const std::vector<int64_t>& members, int rank, const Plan& plan,
                 const char* op_name, const char* input, size_t input_bytes, size_t out_bytes,
                 int calls, const GpuSettings& settings, bool phases, int graph_replays,
                 const std::vector<std::pair<std::string, std::string>>& peers, std::string* output,
                 PhaseTotals* totals) {
  gpu::GpuCommunicator* comm =
      gpu::FindCommunicator(gpu::GroupKey(members.data(), int(members.size())));
  gpu::LocalRank* me = comm ? comm->Local(rank) : nullptr;
  if (!comm || !comm->connected() || !me)
    return Status::Error("stream_run: rank " + std::to_string(rank) +
                         " is not a rank of a connected communicator in this process "
                         "(prepare and connect first)");
  if (graph_replays > 0) {
    if (phases || input_bytes % size_t(graph_replays) != 0)
      return Status::InvalidArgument(
          "stream_run: graph_replays needs one input per launch, no phases");
    SMDDP_RETURN_IF_ERROR(AsError(gpu::GroupFailure(*me)));
  } else {
    SMDDP_RETURN_IF_ERROR(AsError(gpu::CheckCall(*me, op_name, plan)));
  }
  const size_t launches = graph_replays > 0 ? size_t(graph_replays) : 1;
  const size_t in_bytes = input_bytes / launches;
  SMDDP_CUDA_OR_RETURN(cudaSetDevice(me->ordinal), "cudaSetDevice");
  void *send = nullptr, *recv = nullptr;
  OpenedPeers opened;
  RunBuffers allocated{me};  // released before the peers' buffers are closed
  const bool direct = !peers.empty();
  if (direct) {  // every rank's buffers read in place (StreamRank::inputs, outputs)
    const DirectBuffers& d = TheDirectBuffers();
    if (graph_replays > 0 || int(peers.size()) != me->view.layout.size || d.in_bytes != in_bytes ||
        d.out_bytes != out_bytes)
      return Status::InvalidArgument(
          "stream_run: peers needs a handle pair per rank, stream_direct_buffers of this "
          "call's sizes first, and no graph_replays");
    send = d.send;
    recv = d.recv;
    const bool outputs = DirectReadsNeedOutputs(plan.kind);
    std::vector<const uint8_t*> inputs(peers.size(), nullptr);
    std::vector<uint8_t*> outs(outputs ? peers.size() : 0, nullptr);
    for (size_t q = 0; q < peers.size(); ++q) {
      const bool own = int(q) == rank;
      void* in = send;
      if (!own) SMDDP_RETURN_IF_ERROR(opened.Open(peers[q].first, &in));
      inputs[q] = static_cast<const uint8_t*>(in);
      if (outputs) {
        void* out = recv;
        if (!own) SMDDP_RETURN_IF_ERROR(opened.Open(peers[q].second, &out));
        outs[q] = static_cast<uint8_t*>(out);
      }
    }
    me->view.inputs = std::move(inputs);
    me->view.outputs = std::move(outs);
  } else {
    SMDDP_CUDA_OR_RETURN(cudaMalloc(&allocated.send, std::max<size_t>(in_bytes, 1)), "cudaMalloc");
    SMDDP_CUDA_OR_RETURN(cudaMalloc(&allocated.recv, std::max<size_t>(out_bytes, 1)), "cudaMalloc");
    send = allocated.send;
    recv = allocated.recv;
  }
  SMDDP_CUDA_OR_RETURN(cudaMemcpy(send, input, in_bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  Status status;
  cudaError_t err = cudaSuccess;
  std::string& host = *output;
  host.assign(out_bytes * launches, '\0');
  {
    cudaStream_t stream;
    SMDDP_CUDA_OR_RETURN(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                         "cudaStreamCreate");
    CudaStreamOps ops(stream, settings);
    if (graph_replays > 0) {
      // One replayable call captured, the graph launched on each input in turn.
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      err = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
      if (err == cudaSuccess) {
        status = RunStreamPlan(plan, me->view, ops, send, recv, /*replayable=*/true);
        err = cudaStreamEndCapture(stream, &graph);
      }
      if (status.ok() && err == cudaSuccess) err = cudaGraphInstantiate(&exec, graph, 0);
      for (size_t r = 0; r < launches && status.ok() && err == cudaSuccess; ++r) {
        // A fresh input in the same buffer, and an output that shows what the launch did not write.
        err = cudaMemcpyAsync(send, input + r * in_bytes, in_bytes, cudaMemcpyHostToDevice, stream);
        if (err == cudaSuccess) err = cudaMemsetAsync(recv, 0xA5, out_bytes, stream);
        if (err == cudaSuccess) err = cudaGraphLaunch(exec, stream);
        if (err == cudaSuccess)
          err = cudaMemcpyAsync(host.data() + r * out_bytes, recv, out_bytes,
                                cudaMemcpyDeviceToHost, stream);
        if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
      }
      if (exec) cudaGraphExecDestroy(exec);
      if (graph) cudaGraphDestroy(graph);
    } else {
      const int untimed = phases ? calls - 1 : calls;
      for (int c = 0; c < untimed && status.ok(); ++c)
        status = RunStreamPlan(plan, me->view, ops, send, recv);
      if (phases && status.ok()) {
        EventClock clock(stream);
        PhaseTimedOps timed(ops, clock);
        status = RunStreamPlan(plan, me->view, timed, send, recv);
        if (status.ok()) status = timed.Totals(totals);
      }
      err = cudaStreamSynchronize(stream);
      if (status.ok() && err == cudaSuccess)
        err = cudaMemcpy(host.data(), recv, out_bytes, cudaMemcpyDeviceToHost);
    }
    cudaStreamDestroy(stream);
  }
  SMDDP_RETURN_IF_ERROR(AsError(status));
  SMDDP_CUDA_OR_RETURN(err, "stream_run");
  return Status::Ok();
}

#undef SMDDP_CUDA_OR_RETURN

}  // namespace cuda
}  // namespace smddp

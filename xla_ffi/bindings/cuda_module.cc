// Python bindings of the GPU backend (_smddp_cuda): FFI targets for platform
// CUDA, communicator set-up (regions and CUDA IPC handles, exchanged by
// jax_smddp/gpu.py over the jax.distributed key-value store), settings and
// counters. Built only where nvcc is found; imports without a GPU or driver.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "cuda/cuda_stream_ops.h"
#include "cuda/device_scope.h"
#include "cuda/event_clock.h"
#include "cuda/gdrcopy.h"
#include "cuda/gpu_communicator.h"
#include "cuda/gpu_hierarchy.h"
#include "cuda/kernels.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/pair.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/vector.h"
#include "xla_ffi/algorithms/stream_algorithms.h"
#include "xla_ffi/bindings/enums.h"
#include "xla_ffi/bindings/failures.h"
#include "xla_ffi/bindings/phase_dict.h"
#include "xla_ffi/bindings/registrations.h"
#include "xla_ffi/engine/buffer_exchange.h"
#include "xla_ffi/engine/communicator.h"
#include "xla_ffi/ffi/gpu_handlers.h"
#include "xla_ffi/transports/world.h"

namespace nb = nanobind;

namespace {

void Check(const smddp::Status& st) {
  if (!st.ok()) throw std::runtime_error(st.message());
}

void CheckCuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

// Best seconds of `iters` runs (after two warm-ups) of what `enqueue(stream)`
// puts on a stream of its own on device `ordinal`, timed by CUDA events.
template <typename F>
double BestSeconds(int ordinal, int iters, F&& enqueue) {
  CheckCuda(cudaSetDevice(ordinal), "cudaSetDevice");
  cudaStream_t s;
  cudaEvent_t start, stop;
  CheckCuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  CheckCuda(cudaEventCreate(&start), "cudaEventCreate");
  CheckCuda(cudaEventCreate(&stop), "cudaEventCreate");
  float best_ms = 0;
  for (int i = 0; i < iters + 2; ++i) {
    CheckCuda(cudaEventRecord(start, s), "cudaEventRecord");
    enqueue(s);
    CheckCuda(cudaEventRecord(stop, s), "cudaEventRecord");
    CheckCuda(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    CheckCuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    if (i >= 2 && (best_ms == 0 || ms < best_ms)) best_ms = ms;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(s);
  return best_ms * 1e-3;
}

// `count` zeroed buffers of `bytes` each on `ordinal`, the current device
// while they live (the caller's again after).
struct DeviceBuffers {
  DeviceBuffers(int ordinal, int count, size_t bytes) : scope(ordinal), p(size_t(count), nullptr) {
    CheckCuda(cudaSetDevice(ordinal), "cudaSetDevice");
    for (void*& b : p) CheckCuda(cudaMalloc(&b, bytes), "cudaMalloc");
    for (void* b : p) CheckCuda(cudaMemset(b, 0, bytes), "cudaMemset");
  }
  ~DeviceBuffers() {
    for (void* b : p) cudaFree(b);
  }
  smddp::cuda::DeviceScope scope;
  std::vector<void*> p;
};

// Device-to-device copy bandwidth on `ordinal` (bytes copied per second by
// cudaMemcpyAsync of `bytes`, best of `iters`): the benchmark's reference.
double CopyBandwidth(int ordinal, size_t bytes, int iters) {
  DeviceBuffers m(ordinal, 2, bytes);
  const double s = BestSeconds(ordinal, iters, [&](cudaStream_t stream) {
    CheckCuda(cudaMemcpyAsync(m.p[1], m.p[0], bytes, cudaMemcpyDeviceToDevice, stream),
              "cudaMemcpyAsync");
  });
  return s > 0 ? double(bytes) / s : 0.0;
}

// Seconds one bare reduction kernel takes (best of `iters`): f32 sum of
// `sources` buffers of `bytes` each into one, within `max_blocks` blocks, as
// the stream algorithms launch it. The benchmark's reference for what the SM
// budget allows the reductions, beside the copy rate (what the device allows).
// `unroll` 2: the kernel with twice the loads in flight per thread (kernels.h).
double ReduceSeconds(int ordinal, size_t bytes, int sources, int max_blocks, int iters,
                     int unroll) {
  if (sources < 1 || sources > smddp::cuda::kMaxSources)
    throw std::invalid_argument("reduce_seconds: sources must be 1.." +
                                std::to_string(smddp::cuda::kMaxSources));
  DeviceBuffers m(ordinal, sources + 1, bytes);  // the sources, then the destination
  return BestSeconds(ordinal, iters, [&](cudaStream_t stream) {
    CheckCuda(smddp::cuda::LaunchReduce(m.p[size_t(sources)], bytes, m.p.data(), sources, bytes,
                                        bytes / 4, 1, smddp::DType::kFloat32, smddp::ReduceOp::kSum,
                                        max_blocks, stream, unroll),
              "reduction kernel");
  });
}

#ifdef SMDDP_TESTING_ENTRIES
// The GPU kernel tests' entry (tests/gpu/test_kernels.py), compiled in only
// with -DJAX_SMDDP_TESTING=ON (tools/gpu_check.sh builds so): the installed
// module exposes no test probe.
// Runs `calls` calls of one collective (kinds as in the host probe) as `rank`
// of the prepared and connected communicator of `members`, on a stream of its
// own, with CudaStreamOps; returns the output. Checks the kernels, copy modes
// and flag operations on a GPU without JAX or XLA. Each rank must be in a
// process of its own (tests/gpu/test_kernels.py): ranks on streams of one CUDA
// context wait on each other through flags the CUDA scheduler does not see,
// and it may serialise a waiting stream ahead of the one that would release it
// (seen on an H100: each of 4 runs of the kernel tests as threads hung at a
// 4-rank case, in memops and flag-kernel modes alike).
// With `phases`, the last call runs through PhaseTimedOps on CUDA events and
// the result is (output, {phase: (calls, seconds), "total": seconds}).
// With `graph_replays` (instead of `calls`), one replayable call (as the NCCL
// API front end enqueues a call captured into a CUDA graph) is captured into
// a graph, which is launched that many times, `input` holding one input per
// launch and the result every launch's output, one after the other.
// The kernel tests' buffers for direct reads (stream_run's `peers`): this
// process's send and receive buffers, shared by legacy CUDA IPC, replaced
// when the next case asks for others (after every rank finished the last).
struct DirectBuffers {
  void* send = nullptr;
  void* recv = nullptr;
  size_t in_bytes = 0, out_bytes = 0;
};
DirectBuffers& TheDirectBuffers() {
  static DirectBuffers d;
  return d;
}

nb::tuple StreamDirectBuffers(int ordinal, size_t in_bytes, size_t out_bytes) {
  DirectBuffers& d = TheDirectBuffers();
  CheckCuda(cudaSetDevice(ordinal), "cudaSetDevice");
  cudaFree(d.send);
  cudaFree(d.recv);
  d = DirectBuffers{};
  CheckCuda(cudaMalloc(&d.send, std::max<size_t>(in_bytes, 1)), "cudaMalloc");
  CheckCuda(cudaMalloc(&d.recv, std::max<size_t>(out_bytes, 1)), "cudaMalloc");
  d.in_bytes = in_bytes;
  d.out_bytes = out_bytes;
  cudaIpcMemHandle_t hs, hr;
  CheckCuda(cudaIpcGetMemHandle(&hs, d.send), "cudaIpcGetMemHandle");
  CheckCuda(cudaIpcGetMemHandle(&hr, d.recv), "cudaIpcGetMemHandle");
  return nb::make_tuple(nb::bytes(&hs, sizeof(hs)), nb::bytes(&hr, sizeof(hr)));
}

// The peers' direct buffers opened for one stream_run, closed after it.
struct OpenedPeers {
  std::vector<void*> opened;
  ~OpenedPeers() {
    for (void* p : opened) cudaIpcCloseMemHandle(p);
  }
  void* Open(const nb::bytes& handle) {
    cudaIpcMemHandle_t h;
    if (handle.size() != sizeof(h)) throw std::invalid_argument("stream_run: not an IPC handle");
    std::memcpy(&h, handle.c_str(), sizeof(h));
    void* p = nullptr;
    CheckCuda(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
    opened.push_back(p);
    return p;
  }
};

nb::object StreamRun(std::vector<int64_t> members, int rank, int kind, int dtype, int op,
                     size_t outer, size_t inner, size_t count, nb::bytes input, size_t out_bytes,
                     int calls, const std::string& copies, const std::string& flags, int max_blocks,
                     bool phases, int graph_replays,
                     std::vector<std::pair<nb::bytes, nb::bytes>> peers) {
  smddp::gpu::GpuCommunicator* comm =
      smddp::gpu::FindCommunicator(smddp::gpu::GroupKey(members.data(), int(members.size())));
  smddp::gpu::LocalRank* me = comm ? comm->Local(rank) : nullptr;
  if (!comm || !comm->connected() || !me)
    throw std::runtime_error("stream_run: rank " + std::to_string(rank) +
                             " is not a rank of a connected communicator in this process "
                             "(prepare and connect first)");
  const smddp::Plan plan = smddp::PlanOf(kind, dtype, op, outer, inner, count);
  if (graph_replays > 0) {
    if (phases || input.size() % size_t(graph_replays) != 0)
      throw std::invalid_argument(
          "stream_run: graph_replays needs one input per launch, no phases");
    Check(smddp::gpu::GroupFailure(*me));
  } else {
    Check(smddp::gpu::CheckCall(*me, smddp::KindName(kind), plan));
  }
  const size_t launches = graph_replays > 0 ? size_t(graph_replays) : 1;
  const size_t in_bytes = input.size() / launches;
  smddp::cuda::GpuSettings settings;
  settings.copies = copies == "kernel" ? smddp::cuda::GpuSettings::Copies::kKernel
                                       : smddp::cuda::GpuSettings::Copies::kEngine;
  settings.flags = flags == "kernel" ? smddp::cuda::GpuSettings::Flags::kKernel
                                     : smddp::cuda::GpuSettings::Flags::kMemOps;
  settings.max_blocks = max_blocks;
  CheckCuda(cudaSetDevice(me->ordinal), "cudaSetDevice");
  void *send = nullptr, *recv = nullptr;
  OpenedPeers opened;
  const bool direct = !peers.empty();
  if (direct) {  // every rank's buffers read in place (StreamRank::inputs, outputs)
    const DirectBuffers& d = TheDirectBuffers();
    if (graph_replays > 0 || int(peers.size()) != me->view.layout.size || d.in_bytes != in_bytes ||
        d.out_bytes != out_bytes)
      throw std::invalid_argument(
          "stream_run: peers needs a handle pair per rank, stream_direct_buffers of this "
          "call's sizes first, and no graph_replays");
    send = d.send;
    recv = d.recv;
    const bool outputs = smddp::DirectReadsNeedOutputs(plan.kind);
    me->view.inputs.assign(peers.size(), nullptr);
    me->view.outputs.assign(outputs ? peers.size() : 0, nullptr);
    for (size_t q = 0; q < peers.size(); ++q) {
      const bool own = int(q) == rank;
      me->view.inputs[q] = static_cast<const uint8_t*>(own ? send : opened.Open(peers[q].first));
      if (outputs)
        me->view.outputs[q] = static_cast<uint8_t*>(own ? recv : opened.Open(peers[q].second));
    }
  } else {
    CheckCuda(cudaMalloc(&send, std::max<size_t>(in_bytes, 1)), "cudaMalloc");
    CheckCuda(cudaMalloc(&recv, std::max<size_t>(out_bytes, 1)), "cudaMalloc");
  }
  CheckCuda(cudaMemcpy(send, input.c_str(), in_bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  smddp::Status status;
  cudaError_t err = cudaSuccess;
  smddp::PhaseTotals totals;
  std::string host(out_bytes * launches, '\0');
  {
    nb::gil_scoped_release release;
    cudaStream_t stream;
    CheckCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    smddp::cuda::CudaStreamOps ops(stream, settings);
    if (graph_replays > 0) {
      // One replayable call captured, the graph launched on each input in turn.
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      err = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
      if (err == cudaSuccess) {
        status = smddp::RunStreamPlan(plan, me->view, ops, send, recv, /*replayable=*/true);
        err = cudaStreamEndCapture(stream, &graph);
      }
      if (status.ok() && err == cudaSuccess) err = cudaGraphInstantiate(&exec, graph, 0);
      for (size_t r = 0; r < launches && status.ok() && err == cudaSuccess; ++r) {
        // A fresh input in the same buffer, and an output that shows what the launch did not write.
        err = cudaMemcpyAsync(send, input.c_str() + r * in_bytes, in_bytes, cudaMemcpyHostToDevice,
                              stream);
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
        status = smddp::RunStreamPlan(plan, me->view, ops, send, recv);
      if (phases && status.ok()) {
        smddp::cuda::EventClock clock(stream);
        smddp::PhaseTimedOps timed(ops, clock);
        status = smddp::RunStreamPlan(plan, me->view, timed, send, recv);
        if (status.ok()) status = timed.Totals(&totals);
      }
      err = cudaStreamSynchronize(stream);
      if (status.ok() && err == cudaSuccess)
        err = cudaMemcpy(host.data(), recv, out_bytes, cudaMemcpyDeviceToHost);
    }
    cudaStreamDestroy(stream);
  }
  me->view.inputs.clear();
  me->view.outputs.clear();
  if (!direct) {
    cudaFree(send);
    cudaFree(recv);
  }
  Check(status);
  CheckCuda(err, "stream_run");
  nb::bytes output(host.data(), host.size());
  if (!phases) return output;
  return nb::make_tuple(output, smddp::PhaseDict(totals));
}
#endif  // SMDDP_TESTING_ENTRIES

}  // namespace

NB_MODULE(_smddp_cuda, m) {
  m.doc() = "jax_smddp native engine (CUDA)";
  m.def("type_registrations", [] {
    return smddp::TypeRegistrations("smddp_gpu_call_site", SmddpGpuCallSiteTypeId(),
                                    SmddpGpuCallSiteTypeInfo());
  });
  m.def("registrations", [] {
    return smddp::TargetRegistrations(SmddpInstantiateCuda, SmddpAllGatherCuda,
                                      SmddpReduceScatterCuda, SmddpAllReduceCuda, SmddpAllToAllCuda,
                                      SmddpCollectivePermuteCuda);
  });
  m.def(
      "prepare",
      [](std::vector<int64_t> members, size_t slot_bytes, std::vector<std::pair<int, int>> local,
         int processes) {
        std::vector<std::pair<int, std::string>> handles;
        Check(smddp::gpu::PrepareCommunicator(members, slot_bytes, local, processes, &handles));
        std::vector<std::pair<int, nb::bytes>> out;
        for (auto& [rank, h] : handles) out.emplace_back(rank, nb::bytes(h.data(), h.size()));
        return out;
      },
      nb::arg("members"), nb::arg("slot_bytes"), nb::arg("local"), nb::arg("processes"),
      "Allocates this process's ranks' staging regions (`processes`: how many processes have "
      "ranks in the group); returns the handles the other processes connect with.");
  m.def(
      "connect",
      [](std::vector<int64_t> members, std::vector<std::pair<int, nb::bytes>> remote) {
        std::vector<std::pair<int, std::string>> handles;
        for (auto& [rank, b] : remote) handles.emplace_back(rank, std::string(b.c_str(), b.size()));
        Check(smddp::gpu::ConnectCommunicator(members, handles));
      },
      nb::arg("members"), nb::arg("remote"));
  m.def(
      "prepare_hierarchy",
      [](std::vector<int64_t> members, std::vector<int> host_of, std::vector<int> process_of,
         std::vector<std::pair<int, int>> local, std::vector<int64_t> intra_members,
         size_t slot_bytes, std::vector<nb::bytes> rail_addresses) {
        std::vector<std::string> rails;
        for (const auto& a : rail_addresses) rails.emplace_back(a.c_str(), a.size());
        bool gdrcopy = false, rail = false;
        nb::gil_scoped_release release;
        Check(smddp::gpu::PrepareHierarchy(members, host_of, process_of, local, intra_members,
                                           slot_bytes, rails, &gdrcopy, &rail));
        return std::make_pair(gdrcopy, rail);
      },
      "Sets up a group across hosts (this host's communicator first); returns whether its "
      "network signals use GDRCopy and whether its slots stay in device memory (rail).");
  m.def(
      "open_device_rail",
      [](int ordinal) {
        std::string address;
        smddp::Status st;
        {
          nb::gil_scoped_release release;
          st = smddp::gpu::OpenDeviceRail(ordinal, &address);
        }
        return std::make_pair(nb::bytes(address.data(), address.size()), st.message());
      },
      "This process's FI_HMEM rail: (address, '') or (b'', why it cannot open).");
  m.def("gdrcopy", [] {
    std::string why;
    const bool ok = smddp::cuda::GdrCopyAvailable(&why);
    return std::make_pair(ok, why);
  });
  m.def("group_key", [](std::vector<int64_t> members) {
    return smddp::gpu::GroupKey(members.data(), int(members.size()));
  });
  m.def("set_process", &smddp::gpu::SetProcessIndex);
  m.def("use_world_of", [](uintptr_t source) {  // _smddp_cpu.world_source(): one world
    smddp::UseWorldOf(reinterpret_cast<smddp::WorldSource>(source));
  });
  m.def("world_processes", [] {  // the world as this module sees it (0: none)
    auto world = smddp::CurrentWorld();
    return world ? world->processes() : 0;
  });
  // This module's engine copy has its own timeout; jax_smddp.set_timeout sets both.
  m.def("set_timeout", &smddp::SetTimeoutSeconds, nb::arg("seconds"));
  m.def("timeout", &smddp::TimeoutSeconds);
  BindFailures(m);  // this module's engine copy's failed calls (jax_smddp.errors)
  m.def("release", &smddp::gpu::ReleaseCommunicators);
  m.def("mark_closed", &smddp::gpu::MarkCommunicatorsClosed,
        "At exit: tells the groups' other processes this one finished (it did not die).");
  m.def("close_at_exit", &smddp::gpu::CloseCommunicatorsAtExit,
        nb::call_guard<nb::gil_scoped_release>(),
        "At exit: mark_closed, then close the libfabric links, registrations and rail of the "
        "groups across hosts once the network proxy is idle (False: it was not, nothing closed).");
  m.def("device_count", [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return n;
  });
  m.def("driver_version", [] {  // 0 when no CUDA driver is loaded
    int v = 0;
    if (cudaDriverGetVersion(&v) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return v;
  });
  m.def(
      "device_info",
      [](int ordinal) {
        // What jax_smddp.doctor shows of one GPU: what the collectives rely on.
        cudaDeviceProp p;
        CheckCuda(cudaGetDeviceProperties(&p, ordinal), "cudaGetDeviceProperties");
        auto attr = [ordinal](cudaDeviceAttr a) {
          int v = 0;
          if (cudaDeviceGetAttribute(&v, a, ordinal) != cudaSuccess) {
            cudaGetLastError();
            return -1;
          }
          return v;
        };
        nb::dict d;
        d["name"] = std::string(p.name);
        d["compute_capability"] = std::to_string(p.major) + "." + std::to_string(p.minor);
        d["multiprocessors"] = p.multiProcessorCount;
        d["memory_bytes"] = static_cast<uint64_t>(p.totalGlobalMem);
        d["copy_engines"] = p.asyncEngineCount;
        d["unified_addressing"] = p.unifiedAddressing != 0;
        d["ipc_events"] = attr(cudaDevAttrIpcEventSupport) == 1;
        d["posix_fd_handles"] = (attr(cudaDevAttrMemoryPoolSupportedHandleTypes) > 0 &&
                                 (attr(cudaDevAttrMemoryPoolSupportedHandleTypes) &
                                  cudaMemHandleTypePosixFileDescriptor) != 0);
        d["compute_mode"] =
            attr(cudaDevAttrComputeMode);  // 0 default, 2 prohibited, 3 exclusive process
        return d;
      },
      nb::arg("ordinal"));
  m.def(
      "copy_bandwidth",
      [](int ordinal, size_t bytes, int iters) {
        nb::gil_scoped_release release;
        return CopyBandwidth(ordinal, bytes, iters);
      },
      nb::arg("ordinal"), nb::arg("bytes"), nb::arg("iters") = 10);
  m.def(
      "reduce_seconds",
      [](int ordinal, size_t bytes, int sources, int max_blocks, int iters, int unroll) {
        nb::gil_scoped_release release;
        return ReduceSeconds(ordinal, bytes, sources, max_blocks, iters, unroll);
      },
      nb::arg("ordinal"), nb::arg("bytes"), nb::arg("sources"), nb::arg("max_blocks"),
      nb::arg("iters") = 10, nb::arg("unroll") = 2);
#ifdef SMDDP_TESTING_ENTRIES
  m.def("stream_run", &StreamRun, nb::arg("members"), nb::arg("rank"), nb::arg("kind"),
        nb::arg("dtype"), nb::arg("op"), nb::arg("outer"), nb::arg("inner"), nb::arg("count"),
        nb::arg("input"), nb::arg("out_bytes"), nb::arg("calls") = 1, nb::arg("copies") = "engine",
        nb::arg("flags") = "memops", nb::arg("max_blocks") = 8, nb::arg("phases") = false,
        nb::arg("graph_replays") = 0,
        nb::arg("peers") = std::vector<std::pair<nb::bytes, nb::bytes>>());
  m.def("stream_direct_buffers", &StreamDirectBuffers, nb::arg("ordinal"), nb::arg("in_bytes"),
        nb::arg("out_bytes"),
        "This process's send and receive buffers for stream_run's direct reads (replacing the "
        "last ones); returns their CUDA IPC handles.");
#endif
  m.def("have_stream_memops", &smddp::cuda::HaveStreamMemOps);
  m.def("settings", [] {
    const auto s = smddp::cuda::GpuSettings::FromEnvironment();
    nb::dict d;
    d["copies"] = s.copies == smddp::cuda::GpuSettings::Copies::kEngine ? "engine" : "kernel";
    d["flags"] = s.flags == smddp::cuda::GpuSettings::Flags::kMemOps ? "memops" : "kernel";
    d["max_blocks"] = s.max_blocks;
    smddp::gpu::FlagMemory memory;
    Check(smddp::gpu::FlagMemoryFromEnvironment(&memory));
    d["flag_memory"] = memory == smddp::gpu::FlagMemory::kHost ? "host" : "device";
    bool direct = false;
    Check(smddp::gpu::DirectReadsFromEnvironment(&direct));
    d["direct_reads"] = direct;
    return d;
  });
  m.def("direct_reads_staged_because", &smddp::BufferExchange::StagedBecause);
  m.def("counters", [] {
    auto& c = smddp::cuda::Counters();
    nb::dict d;
    d["copy_kernels"] = c.copy_kernels.load();
    d["engine_copies"] = c.engine_copies.load();
    d["reduce_kernels"] = c.reduce_kernels.load();
    d["flag_kernels"] = c.flag_kernels.load();
    d["flag_memops"] = c.flag_memops.load();
    d["direct_reads"] = c.direct_reads.load();
    d["handler_calls"] = c.handler_calls.load();
    d["handler_ns"] = c.handler_ns.load();
    return d;
  });
}

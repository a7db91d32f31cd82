// Python bindings of the GPU backend (_smddp_cuda): FFI targets for platform
// CUDA, communicator set-up (regions and CUDA IPC handles, exchanged by
// jax_smddp/gpu.py over the jax.distributed key-value store), settings and
// counters, and the GPU's own rates (cuda/microbenchmarks.h); with
// -DJAX_SMDDP_TESTING=ON the kernel tests' driver (cuda/stream_driver.h). Built
// only where nvcc is found; imports without a GPU or driver.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "cuda/cuda_stream_ops.h"
#include "cuda/device_scope.h"
#include "cuda/gdrcopy.h"
#include "cuda/gpu_communicator.h"
#include "cuda/gpu_hierarchy.h"
#include "cuda/microbenchmarks.h"
#ifdef SMDDP_TESTING_ENTRIES
#include "cuda/stream_driver.h"
#endif
#include "nanobind/nanobind.h"
#include "nanobind/stl/pair.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/tuple.h"
#include "nanobind/stl/vector.h"
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

// A failure of the GPU code as Python sees it: ValueError for bad arguments,
// RuntimeError otherwise.
void Raise(const smddp::Status& st) {
  if (st.ok()) return;
  if (st.code() == smddp::StatusCode::kInvalidArgument) throw std::invalid_argument(st.message());
  throw std::runtime_error(st.message());
}

#ifdef SMDDP_TESTING_ENTRIES
// cuda/stream_driver.h's StreamRun for Python: bytes in, bytes out (with
// `phases`, (output, {phase: (calls, seconds), "total": seconds})).
nb::object StreamRun(std::vector<int64_t> members, int rank, int kind, int dtype, int op,
                     size_t outer, size_t inner, size_t count, nb::bytes input, size_t out_bytes,
                     int calls, const std::string& copies, const std::string& flags, int max_blocks,
                     bool phases, int graph_replays,
                     std::vector<std::pair<nb::bytes, nb::bytes>> peers) {
  const smddp::Plan plan = smddp::PlanOf(kind, dtype, op, outer, inner, count);
  smddp::cuda::GpuSettings settings;
  settings.copies = copies == "kernel" ? smddp::cuda::GpuSettings::Copies::kKernel
                                       : smddp::cuda::GpuSettings::Copies::kEngine;
  settings.flags = flags == "kernel" ? smddp::cuda::GpuSettings::Flags::kKernel
                                     : smddp::cuda::GpuSettings::Flags::kMemOps;
  settings.max_blocks = max_blocks;
  std::vector<std::pair<std::string, std::string>> handles;
  for (const auto& [send, recv] : peers)
    handles.emplace_back(std::string(send.c_str(), send.size()),
                         std::string(recv.c_str(), recv.size()));
  std::string output;
  smddp::PhaseTotals totals;
  smddp::Status st;
  {
    nb::gil_scoped_release release;
    st = smddp::cuda::StreamRun(members, rank, plan, smddp::KindName(kind), input.c_str(),
                                input.size(), out_bytes, calls, settings, phases, graph_replays,
                                handles, &output, &totals);
  }
  Raise(st);
  nb::bytes out(output.data(), output.size());
  if (!phases) return out;
  return nb::make_tuple(out, smddp::PhaseDict(totals));
}

nb::tuple StreamDirectBuffers(int ordinal, size_t in_bytes, size_t out_bytes) {
  std::string send, recv;
  Raise(smddp::cuda::StreamDirectBuffers(ordinal, in_bytes, out_bytes, &send, &recv));
  return nb::make_tuple(nb::bytes(send.data(), send.size()), nb::bytes(recv.data(), recv.size()));
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
    using smddp::Collective;
    return smddp::TargetRegistrations(
        SmddpInstantiateCuda, {{Collective::kAllGather, SmddpAllGatherCuda},
                               {Collective::kReduceScatter, SmddpReduceScatterCuda},
                               {Collective::kAllReduce, SmddpAllReduceCuda},
                               {Collective::kAllToAll, SmddpAllToAllCuda},
                               {Collective::kCollectivePermute, SmddpCollectivePermuteCuda}});
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
  m.def("alone_calls", [] {
    // A one-process job's GPU calls, counted in this engine copy's world of the process alone
    // (CountingWorld); none where a world exists (_smddp_cpu's world_calls reads that one).
    if (smddp::CurrentWorld()) return std::vector<std::tuple<std::string, uint64_t, uint64_t>>();
    return smddp::CallCounts(*smddp::CountingWorld());
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
        double rate = 0;
        smddp::Status st;
        {
          nb::gil_scoped_release release;
          st = smddp::cuda::CopyBandwidth(ordinal, bytes, iters, &rate);
        }
        Raise(st);
        return rate;
      },
      nb::arg("ordinal"), nb::arg("bytes"), nb::arg("iters") = 10);
  m.def(
      "reduce_seconds",
      [](int ordinal, size_t bytes, int sources, int max_blocks, int iters, int unroll) {
        double seconds = 0;
        smddp::Status st;
        {
          nb::gil_scoped_release release;
          st = smddp::cuda::ReduceSeconds(ordinal, bytes, sources, max_blocks, iters, unroll,
                                          &seconds);
        }
        Raise(st);
        return seconds;
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
    bool graphs = false;
    Check(smddp::gpu::GraphsFromEnvironment(&graphs));
    d["graphs"] = graphs;
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

// Python bindings of the native engine: the FFI targets (as capsules the
// Python layer registers with jax.ffi), engine settings, and a direct entry
// into the engine's rendezvous for tests of its failure paths.
#include <atomic>
#include <chrono>
#include <future>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "nanobind/nanobind.h"
#include "nanobind/stl/pair.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/tuple.h"
#include "nanobind/stl/vector.h"
#include "xla_ffi/cpu_handlers.h"
#include "xla_ffi/engine/algorithms.h"
#include "xla_ffi/engine/communicator.h"
#include "xla_ffi/engine/host_stream_ops.h"
#include "xla_ffi/engine/stream_algorithms.h"
#include "xla_ffi/engine/world.h"

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule Capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// Runs one all_reduce of `count` floats on a private communicator of `size`
// ranks, where only the ranks in `present` ever arrive (rank `odd_rank`, if
// any, with one element more than the others). Checks the sum and returns, per
// present rank, the error text ("" on success). Tests the engine's failure
// paths directly.
std::vector<std::pair<int, std::string>> RendezvousProbe(int size, std::vector<int> present,
                                                         double timeout_s, int64_t count,
                                                         int odd_rank) {
  static std::atomic<int64_t> next_run{1};
  std::vector<int64_t> members;
  for (int r = 0; r < size; ++r) members.push_back(-1000000 - r);  // never a real device
  smddp::Status error;
  smddp::Communicator* comm = smddp::FindOrCreateCommunicator(members.data(), nullptr, size, &error);
  const int64_t run_id = -(next_run++);
  const double saved = smddp::TimeoutSeconds();
  smddp::SetTimeoutSeconds(timeout_s);
  std::vector<std::pair<int, std::string>> results(present.size());
  std::vector<std::vector<float>> send, recv;
  for (int r : present) {
    const int64_t n = count + (r == odd_rank ? 1 : 0);
    send.emplace_back(n, float(r + 1));
    recv.emplace_back(n, 0.0f);
  }
  {
    nb::gil_scoped_release release;
    std::vector<std::thread> threads;
    for (size_t i = 0; i < present.size(); ++i) {
      threads.emplace_back([&, i] {
        const uint64_t bytes = send[i].size() * 4;
        smddp::CallInfo info{"all_reduce", smddp::DType::kFloat32, smddp::ReduceOp::kSum, bytes, bytes};
        smddp::Plan plan;
        plan.kind = smddp::Plan::Kind::kAllReduce;
        plan.count = send[i].size();
        std::promise<smddp::Status> finished;
        comm->Start(run_id, 0, 0, 0, 0, 0, present[i], send[i].data(), recv[i].data(), info, plan,
                    [&finished](const smddp::Status& st) { finished.set_value(st); });
        smddp::Status st = finished.get_future().get();
        const float want = float(size) * float(size + 1) / 2;
        for (float v : recv[i]) {
          if (st.ok() && v != want) st = smddp::Status::Error("wrong sum");
        }
        results[i] = {present[i], st.ok() ? std::string() : st.message()};
      });
    }
    for (auto& t : threads) t.join();
  }
  smddp::SetTimeoutSeconds(saved);
  return results;
}


// Runs the stream-ordered algorithms (the GPU protocol) on host threads, one
// per rank, over host memory: `calls` consecutive calls of one collective
// (kind 0 all_gather, 1 reduce_scatter, 2 all_reduce, 3 all_to_all) with
// `slot_bytes` staging slots. Returns each rank's output, or raises the first
// rank's error. Tests the protocol (slots, flags, tiling) without a GPU.
std::vector<nb::bytes> StreamProbe(int kind, int dtype, int op, size_t outer, size_t inner,
                                   size_t count, size_t slot_bytes, std::vector<nb::bytes> inputs,
                                   size_t out_bytes, int calls, double timeout_s) {
  const int size = int(inputs.size());
  smddp::Plan plan;
  plan.kind = smddp::Plan::Kind(kind);
  plan.dtype = smddp::DType(dtype);
  plan.op = smddp::ReduceOp(op);
  plan.outer = outer;
  plan.inner = inner;
  plan.count = count;
  smddp::RegionLayout layout(size, slot_bytes);
  std::vector<std::vector<uint8_t>> regions(size, std::vector<uint8_t>(layout.total_bytes + 64));
  std::vector<uint8_t*> bases;
  for (auto& r : regions) bases.push_back(reinterpret_cast<uint8_t*>((uintptr_t(r.data()) + 63) / 64 * 64));
  std::vector<std::string> send;
  for (auto& b : inputs) send.emplace_back(b.c_str(), b.size());
  std::vector<std::string> recv(size, std::string(out_bytes, '\0'));
  std::vector<smddp::Status> status(size);
  {
    nb::gil_scoped_release release;
    std::vector<std::thread> threads;
    for (int r = 0; r < size; ++r) {
      threads.emplace_back([&, r] {
        smddp::StreamRank me;
        me.rank = r;
        me.layout = layout;
        me.regions = bases;
        smddp::HostStreamOps ops(timeout_s);
        for (int c = 0; c < calls && status[r].ok(); ++c) {
          status[r] = smddp::RunStreamPlan(plan, me, ops, send[r].data(), recv[r].data());
        }
      });
    }
    for (auto& t : threads) t.join();
  }
  for (int r = 0; r < size; ++r) {
    if (!status[r].ok()) throw std::runtime_error("rank " + std::to_string(r) + ": " + status[r].message());
  }
  std::vector<nb::bytes> out;
  for (auto& r : recv) out.emplace_back(r.data(), r.size());
  return out;
}

// Raises the engine's error as a Python RuntimeError.
void Check(const smddp::Status& st) {
  if (!st.ok()) throw std::runtime_error(st.message());
}

// The bootstrap steps of jax_smddp.initialize() (see engine/world.h).
void BindWorld(nb::module_& m) {
  m.def("world_begin", [](int process, int processes) { Check(smddp::WorldBegin(process, processes)); });
  m.def("world_set_peer", [](int process, int pid, const std::string& host) {
    Check(smddp::WorldSetPeer(process, pid, host));
  });
  m.def("world_create_shm", [](int peer) {
    std::string name;
    Check(smddp::WorldCreateShm(peer, &name));
    return name;
  });
  m.def("world_open_shm", [](int peer, const std::string& name) { Check(smddp::WorldOpenShm(peer, name)); });
  m.def("world_unlink_shm", [](int peer) { Check(smddp::WorldUnlinkShm(peer)); });
  m.def("world_open_fabric", [](const std::string& provider, const std::string& node) {
    std::string address, chosen;
    {
      nb::gil_scoped_release release;
      Check(smddp::WorldOpenFabric(provider, node, &address, &chosen));
    }
    return std::make_pair(nb::bytes(address.data(), address.size()), chosen);
  });
  m.def("world_connect_fabric", [](int peer, nb::bytes address) {
    Check(smddp::WorldConnectFabric(peer, std::string(address.c_str(), address.size())));
  });
  m.def("world_watch_listen", [](const std::string& node) {
    std::string address;
    Check(smddp::WorldWatchListen(node, &address));
    return address;
  });
  m.def("world_watch_connect", [](int peer, const std::string& address) {
    nb::gil_scoped_release release;
    Check(smddp::WorldWatchConnect(peer, address));
  });
  m.def("world_watch_accept", [](std::vector<int> peers) {
    nb::gil_scoped_release release;
    Check(smddp::WorldWatchAccept(peers));
  });
  m.def("world_start", [] { Check(smddp::WorldStart()); });
  m.def("world_shutdown", [] {
    nb::gil_scoped_release release;
    smddp::WorldShutdown();
  });
  m.def("world_traffic", [] {
    // Per peer process: (kind of link, bytes sent, bytes received).
    std::vector<std::tuple<int, std::string, uint64_t, uint64_t>> out;
    auto world = smddp::CurrentWorld();
    if (!world) return out;
    for (int p = 0; p < world->processes(); ++p) {
      if (smddp::Link* link = world->link(p))
        out.emplace_back(p, link->Kind(), world->sent(p), world->received(p));
    }
    return out;
  });
  m.def("world_process", [] {
    auto world = smddp::CurrentWorld();
    return world ? world->process() : -1;
  });
}

}  // namespace

NB_MODULE(_smddp_cpu, m) {
  m.doc() = "jax_smddp native engine (CPU)";
  m.def("type_registrations", []() {
    nb::dict d, call_site;
    call_site["type_id"] = Capsule(SmddpCallSiteTypeId());
    call_site["type_info"] = Capsule(const_cast<XLA_FFI_TypeInfo*>(SmddpCallSiteTypeInfo()));
    d["smddp_call_site"] = call_site;
    return d;
  });
  m.def("registrations", []() {
    nb::dict d;
    auto stages = [](auto* execute) {
      nb::dict s;
      s["instantiate"] = Capsule(SmddpInstantiateCpu);
      s["execute"] = Capsule(execute);
      return s;
    };
    d["smddp_all_gather"] = stages(SmddpAllGatherCpu);
    d["smddp_reduce_scatter"] = stages(SmddpReduceScatterCpu);
    d["smddp_all_reduce"] = stages(SmddpAllReduceCpu);
    d["smddp_all_to_all"] = stages(SmddpAllToAllCpu);
    return d;
  });
  m.def("set_timeout", &smddp::SetTimeoutSeconds, nb::arg("seconds"));
  m.def("timeout", &smddp::TimeoutSeconds);
  BindWorld(m);
  m.def("rendezvous_probe", &RendezvousProbe, nb::arg("size"), nb::arg("present"),
        nb::arg("timeout_s"), nb::arg("count") = 1024, nb::arg("odd_rank") = -1);
  m.def("stream_probe", &StreamProbe, nb::arg("kind"), nb::arg("dtype"), nb::arg("op"),
        nb::arg("outer"), nb::arg("inner"), nb::arg("count"), nb::arg("slot_bytes"),
        nb::arg("inputs"), nb::arg("out_bytes"), nb::arg("calls") = 1, nb::arg("timeout_s") = 20.0);
}

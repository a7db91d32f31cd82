// Python bindings of the native engine (_smddp_cpu): the FFI targets (as
// capsules the Python layer registers with jax.ffi), the multi-process
// world's bootstrap, settings, build and libfabric information, and the
// engine's enums. The tests' probes are another module (testing_module.cc),
// not installed with the package.
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "nanobind/nanobind.h"
#include "nanobind/stl/map.h"
#include "nanobind/stl/pair.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/tuple.h"
#include "nanobind/stl/vector.h"
#include "xla_ffi/algorithms/call_phases.h"
#include "xla_ffi/algorithms/wait_polls.h"
#include "xla_ffi/bindings/enums.h"
#include "xla_ffi/bindings/failures.h"
#include "xla_ffi/bindings/registrations.h"
#include "xla_ffi/common/heap_reuse.h"
#include "xla_ffi/common/protocol.h"
#include "xla_ffi/common/settings.h"
#include "xla_ffi/common/timeout.h"
#include "xla_ffi/ffi/cpu_handlers.h"
#include "xla_ffi/transports/fabric_info.h"
#include "xla_ffi/transports/world.h"

namespace nb = nanobind;

namespace {

// Raises the engine's error as a Python RuntimeError.
void Check(const smddp::Status& st) {
  if (!st.ok()) throw std::runtime_error(st.message());
}

#ifndef SMDDP_BUILD_JAXLIB
#define SMDDP_BUILD_JAXLIB ""
#define SMDDP_BUILD_FFI_API ""
#define SMDDP_BUILD_VERSION ""
#endif
#include "smddp_source_hash.h"  // SMDDP_SOURCE_HASH, generated (cmake/source_hash.cmake)

// What this build was configured with and what libfabric offers here
// (jax_smddp.doctor).
void BindBuildInfo(nb::module_& m) {
  // glibc's heap kept for XLA's outputs (common/heap_reuse.h).
  m.def("malloc_arenas", [] {
    std::string reason;
    const int n = smddp::MallocArenas(&reason);
    nb::dict d;
    d["arenas"] = n;
    d["reason"] = reason;
    return d;
  });
  m.def("heap_reuse", [] {
    const smddp::HeapReusePolicy p = smddp::HeapReuse();
    nb::dict d;
    d["bytes"] = p.bytes;
    d["reason"] = p.reason;
    d["applied"] = smddp::HeapReuseApplied();
    return d;
  });
  m.def("build_info", [] {
    // What processes of one job must share (jax_smddp.initialize() compares
    // it): the wire protocol this process speaks, and the build.
    nb::dict d;
    d["jaxlib"] = SMDDP_BUILD_JAXLIB;
    d["ffi_api"] = SMDDP_BUILD_FFI_API;
    d["version"] = SMDDP_BUILD_VERSION;
    d["source_hash"] = SMDDP_SOURCE_HASH;
    d["protocol"] = smddp::WireProtocolVersion();
    d["protocol_built"] = smddp::kWireProtocolVersion;
    return d;
  });
  // The settings registries (common/settings.h), for jax_smddp.config: the
  // user's, or the test-only one.
  m.def(
      "setting_specs",
      [](bool tests) {
        nb::list out;
        for (const smddp::SettingSpec& spec :
             tests ? smddp::TestSettings() : smddp::AllSettings()) {
          nb::dict d;
          d["name"] = spec.name;
          d["kind"] = spec.kind == smddp::SettingKind::kInt       ? "int"
                      : spec.kind == smddp::SettingKind::kBytes   ? "bytes"
                      : spec.kind == smddp::SettingKind::kSeconds ? "seconds"
                      : spec.kind == smddp::SettingKind::kChoice  ? "choice"
                      : spec.kind == smddp::SettingKind::kList    ? "list"
                                                                  : "text";
          d["default"] = spec.default_text;
          d["min"] = spec.min;
          d["max"] = spec.max;
          d["choices"] = spec.choices;
          d["scope"] = spec.scope;
          d["agree"] = spec.agree;
          d["meaning"] = spec.meaning;
          out.append(d);
        }
        return out;
      },
      nb::arg("tests") = false);
  m.def("parse_setting", [](const std::string& name, const std::string& value) -> nb::object {
    // `value` typed as the engine reads it: int (counts, bytes), float
    // (seconds), list of str (lists), str; a ValueError naming the setting.
    std::string normalized;
    double number = 0;
    smddp::Status st = smddp::ParseSetting(name, value, &normalized, &number);
    if (!st.ok()) throw nb::value_error(st.message().c_str());
    switch (smddp::FindSetting(name)->kind) {
      case smddp::SettingKind::kInt:
      case smddp::SettingKind::kBytes:
        return nb::int_(int64_t(number));
      case smddp::SettingKind::kSeconds:
        return nb::float_(number);
      case smddp::SettingKind::kList:
        return nb::cast(smddp::SettingItems(normalized));
      case smddp::SettingKind::kChoice:
      case smddp::SettingKind::kText:
        break;
    }
    return nb::str(normalized.c_str());
  });
  m.def("check_settings", [] {
    // (names that are not settings, the first invalid value's error or "").
    std::vector<std::string> unknown;
    smddp::Status st = smddp::CheckSettings(&unknown);
    return std::make_pair(unknown, st.ok() ? std::string() : st.message());
  });
  m.def("fabric_info", [] {
    smddp::FabricInfo f;
    {
      nb::gil_scoped_release release;
      f = smddp::DescribeFabric();
    }
    nb::dict d;
    d["built"] = f.built;
    d["include_dir"] = f.include_dir;
    d["library_dir"] = f.library_dir;
    d["loaded"] = f.loaded;
    d["error"] = f.error;
    d["path"] = f.path;
    d["version"] = f.version;
    d["providers"] = f.providers;
    d["default_provider"] = f.default_provider;
    nb::list env;
    for (const auto& e : f.env_defaults) {
      nb::dict item;
      item["name"] = e.name;
      item["value"] = e.value;
      item["set_by"] = e.ours ? "jax_smddp" : "environment";
      env.append(item);
    }
    d["env_defaults"] = env;
    return d;
  });
}

// The bootstrap steps of jax_smddp.initialize() (see transports/world.h).
void BindWorld(nb::module_& m) {
  // The address of this module's world accessor, for the CUDA module (world.h).
  m.def("world_source", [] { return reinterpret_cast<uintptr_t>(&smddp::CopyCurrentWorld); });
  m.def("wait_polls", [](bool oversubscribed) {
    const smddp::WaitPolls p = smddp::WaitPollsFor(oversubscribed);
    return std::make_pair(p.yield_after, p.sleep_after);
  });
  m.def("world_begin",
        [](int process, int processes) { Check(smddp::WorldBegin(process, processes)); });
  m.def("world_set_peer", [](int process, int pid, const std::string& host) {
    Check(smddp::WorldSetPeer(process, pid, host));
  });
  m.def("world_set_oversubscribed",
        [](bool oversubscribed) { Check(smddp::WorldSetOversubscribed(oversubscribed)); });
  m.def("world_create_shm", [](int peer) {
    std::string name;
    Check(smddp::WorldCreateShm(peer, &name));
    return name;
  });
  m.def("world_open_shm",
        [](int peer, const std::string& name) { Check(smddp::WorldOpenShm(peer, name)); });
  m.def("world_unlink_shm", [](int peer) { Check(smddp::WorldUnlinkShm(peer)); });
  m.def("world_open_fabric", [](const std::string& provider, std::vector<std::string> nodes) {
    std::vector<std::string> addresses;
    std::string chosen;
    {
      nb::gil_scoped_release release;
      Check(smddp::WorldOpenFabric(provider, nodes, &addresses, &chosen));
    }
    nb::list out;
    for (const std::string& a : addresses) out.append(nb::bytes(a.data(), a.size()));
    return std::make_pair(out, chosen);
  });
  m.def("world_connect_fabric", [](int peer, std::vector<std::pair<int, nb::bytes>> stripes) {
    std::vector<std::pair<int, std::string>> pairs;
    for (auto& [nic, address] : stripes)
      pairs.emplace_back(nic, std::string(address.c_str(), address.size()));
    Check(smddp::WorldConnectFabric(peer, pairs));
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
  m.def("world_farewell", [] {
    nb::gil_scoped_release release;
    return smddp::WorldFarewell();
  });
  m.def("world_shutdown", [] {
    nb::gil_scoped_release release;
    smddp::WorldShutdown();
  });
  m.def("world_traffic", [] {
    // Per peer process: (kind of link, bytes sent, bytes received, bytes
    // received by single copy, how single copy stands).
    std::vector<std::tuple<int, std::string, uint64_t, uint64_t, uint64_t, std::string>> out;
    auto world = smddp::CurrentWorld();
    if (!world) return out;
    for (int p = 0; p < world->processes(); ++p) {
      if (smddp::Link* link = world->link(p))
        out.emplace_back(p, link->Kind(), world->sent(p), world->received(p),
                         link->SingleCopyBytes(), link->SingleCopy());
    }
    return out;
  });
  m.def("world_calls", [] {
    // Per caller with calls (World::Caller): (name, calls, bytes delivered).
    return smddp::CallCounts(*smddp::CountingWorld());  // a one-process job's own counts too
  });
  m.def("call_phases", [] {
    // Per collective with cross-process calls (call_phases.h): its calls and
    // each phase's seconds summed over them, and the sleeps.
    std::vector<std::pair<std::string, std::map<std::string, double>>> out;
    for (int k = 0; k < smddp::kCollectives; ++k) {
      const smddp::CallPhaseTotals t = smddp::CallPhaseTotal(smddp::Collective(k));
      if (!t.calls) continue;
      out.emplace_back(smddp::KindName(k),
                       std::map<std::string, double>{{"calls", double(t.calls)},
                                                     {"local_s", t.sum.local_s},
                                                     {"queue_s", t.sum.queue_s},
                                                     {"agree_s", t.sum.agree_s},
                                                     {"body_s", t.sum.body_s},
                                                     {"wait_s", t.sum.wait_s},
                                                     {"sleep_s", t.sum.sleep_s},
                                                     {"sleeps", double(t.sum.sleeps)},
                                                     {"inline_calls", double(t.sum.inline_calls)}});
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
  smddp::CapMallocArenas();  // before XLA's CPU client starts its threads
  m.def("type_registrations", [] {
    return smddp::TypeRegistrations("smddp_call_site", SmddpCallSiteTypeId(),
                                    SmddpCallSiteTypeInfo());
  });
  m.def("registrations", [] {
    using smddp::Collective;
    return smddp::TargetRegistrations(
        SmddpInstantiateCpu, {{Collective::kAllGather, SmddpAllGatherCpu},
                              {Collective::kReduceScatter, SmddpReduceScatterCpu},
                              {Collective::kAllReduce, SmddpAllReduceCpu},
                              {Collective::kAllToAll, SmddpAllToAllCpu},
                              {Collective::kCollectivePermute, SmddpCollectivePermuteCpu}});
  });
  m.def("set_timeout", &smddp::SetTimeoutSeconds, nb::arg("seconds"));
  m.def("timeout", &smddp::TimeoutSeconds);
  BindBuildInfo(m);
  BindWorld(m);
  BindFailures(m);  // last_failure(), recent_failures(): jax_smddp.errors
  BindEnums(m);
}

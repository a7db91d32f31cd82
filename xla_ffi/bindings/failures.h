// The engine's record of failed collectives as Python sees it
// (jax_smddp.errors.last_failure): each module (_smddp_cpu, _smddp_cuda)
// exports the failures its own engine copy saw.
#ifndef JAX_SMDDP_BINDINGS_FAILURES_H_
#define JAX_SMDDP_BINDINGS_FAILURES_H_

#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "xla_ffi/engine/last_failure.h"

inline nanobind::dict FailureDict(const smddp::FailureRecord& r) {
  namespace nb = nanobind;
  nb::list devices, peer_ranks, peer_processes;
  for (int64_t d : r.devices) devices.append(d);
  for (int q : r.peer_ranks) peer_ranks.append(q);
  for (int p : r.peer_processes) peer_processes.append(p);
  nb::dict d;
  d["sequence"] = r.sequence;
  d["time"] = r.unix_time;
  d["op"] = r.op;
  d["devices"] = devices;
  d["rank"] = r.rank;
  d["code"] = smddp::StatusCodeName(r.code);
  d["peer_ranks"] = peer_ranks;
  d["peer_processes"] = peer_processes;
  d["message"] = r.message;
  d["remedy"] = r.remedy;
  return d;
}

// last_failure() -> dict | None; recent_failures() -> [dict] (oldest first);
// failure_remedies() -> {code name: remedy}.
inline void BindFailures(nanobind::module_& m) {
  namespace nb = nanobind;
  m.def("last_failure", []() -> nb::object {
    const auto records = smddp::RecentFailures();
    if (records.empty()) return nb::none();
    return FailureDict(records.back());
  });
  m.def("failure_remedies", [] {
    nb::dict d;
    for (int c = int(smddp::StatusCode::kTimeout); c <= int(smddp::StatusCode::kInternal); ++c)
      d[smddp::StatusCodeName(smddp::StatusCode(c))] = smddp::Remedy(smddp::StatusCode(c));
    return d;
  });
  m.def("recent_failures", [] {
    nb::list out;
    for (const auto& r : smddp::RecentFailures()) out.append(FailureDict(r));
    return out;
  });
}

#endif  // JAX_SMDDP_BINDINGS_FAILURES_H_

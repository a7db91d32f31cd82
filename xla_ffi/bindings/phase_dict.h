// A collective's time per phase (algorithms/phase_timer.h) as Python sees it:
// {"copy": (calls, seconds), "reduce": ..., "wait": ..., "signal": ...,
//  "total": seconds}. Shared by the modules that time the stream protocol.
#ifndef JAX_SMDDP_BINDINGS_PHASE_DICT_H_
#define JAX_SMDDP_BINDINGS_PHASE_DICT_H_

#include "nanobind/nanobind.h"
#include "nanobind/stl/pair.h"
#include "xla_ffi/algorithms/phase_timer.h"

namespace smddp {

inline nanobind::dict PhaseDict(const PhaseTotals& totals) {
  nanobind::dict d;
  for (int p = 0; p < kPhases; ++p)
    d[PhaseName(Phase(p))] = std::make_pair(totals.calls[p], totals.seconds[p]);
  d["total"] = totals.total_s;
  return d;
}

}  // namespace smddp

#endif  // JAX_SMDDP_BINDINGS_PHASE_DICT_H_

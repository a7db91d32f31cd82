// The engine's enums as Python sees them (element types, reductions, plan
// kinds, the collectives' descriptions), exported by each module from the C++ definitions, so
// Python and the tests never mirror their numbers by hand; and the plan a test entry builds from
// those numbers.
#ifndef JAX_SMDDP_BINDINGS_ENUMS_H_
#define JAX_SMDDP_BINDINGS_ENUMS_H_

#include "nanobind/nanobind.h"
#include "xla_ffi/algorithms/plan.h"
#include "xla_ffi/common/dtype.h"

namespace smddp {

// A plan from the integers test entries receive (kind 0 all_gather,
// 1 reduce_scatter, 2 all_reduce, 3 all_to_all; engine dtype and op codes).
inline Plan PlanOf(int kind, int dtype, int op, size_t outer, size_t inner, size_t count) {
  Plan plan;
  plan.kind = Collective(kind);
  plan.dtype = DType(dtype);
  plan.op = ReduceOp(op);
  plan.outer = outer;
  plan.inner = inner;
  plan.count = count;
  return plan;
}

// The op name of a test entry's kind (as the handlers name their calls).
inline const char* KindName(int kind) {
  return kind >= 0 && kind < kCollectives ? CollectiveName(Collective(kind)) : "?";
}

}  // namespace smddp

inline void BindEnums(nanobind::module_& m) {
  namespace nb = nanobind;
  using smddp::DType;
  m.def("dtypes", [] {  // numpy name -> DType
    nb::dict d;
    d["bool"] = int(DType::kBool);
    d["int8"] = int(DType::kInt8);
    d["uint8"] = int(DType::kUInt8);
    d["int32"] = int(DType::kInt32);
    d["uint32"] = int(DType::kUInt32);
    d["int64"] = int(DType::kInt64);
    d["float16"] = int(DType::kFloat16);
    d["bfloat16"] = int(DType::kBFloat16);
    d["float32"] = int(DType::kFloat32);
    d["float64"] = int(DType::kFloat64);
    return d;
  });
  m.def("reduce_ops", [] {
    nb::dict d;
    d["sum"] = int(smddp::ReduceOp::kSum);
    d["max"] = int(smddp::ReduceOp::kMax);
    d["min"] = int(smddp::ReduceOp::kMin);
    return d;
  });
  // Each collective's description (xla_ffi/common/collective.h), in the
  // enumeration's order: what jax_smddp._collectives reads.
  m.def("collectives", [] {
    nb::list out;
    for (const smddp::CollectiveSpec& s : smddp::kCollectiveSpecs) {
      nb::dict d;
      d["name"] = s.name;
      d["kind"] = int(s.kind);
      d["reduces"] = s.reduces;
      d["out_power"] = int(s.out_power);
      d["block_power"] = int(s.block_power);
      d["passes"] = int(s.passes);
      d["every_peer"] = s.every_peer;
      d["routed"] = s.routed;
      d["modelled"] = s.modelled;
      nb::list substrates;
      for (int bit = 0; bit < smddp::kSubstrates; ++bit)
        if (s.substrates & (1 << bit)) substrates.append(smddp::SubstrateName(bit));
      d["substrates"] = substrates;
      d["plan_size"] = s.plan_size == smddp::PlanSize::kElements        ? "elements"
                       : s.plan_size == smddp::PlanSize::kElementBlocks ? "element_blocks"
                                                                        : "byte_blocks";
      out.append(d);
    }
    return out;
  });
  m.def("plan_kinds", [] {
    nb::dict d;
    for (int k = 0; k < smddp::kCollectives; ++k)
      d[smddp::CollectiveName(smddp::Collective(k))] = k;
    return d;
  });
}

#endif  // JAX_SMDDP_BINDINGS_ENUMS_H_

// What the Python layer hands to jax.ffi for one platform's handlers: the
// per-instruction state type and, per collective, its instantiate and execute
// stages; and the plan the modules' test entries take from Python (shared by
// the CPU and CUDA modules).
#ifndef JAX_SMDDP_BINDINGS_REGISTRATIONS_H_
#define JAX_SMDDP_BINDINGS_REGISTRATIONS_H_

#include "nanobind/nanobind.h"
#include "xla/ffi/api/c_api.h"
#include "xla_ffi/algorithms/plan.h"

namespace smddp {

template <typename T>
nanobind::capsule Capsule(T* fn) {
  return nanobind::capsule(reinterpret_cast<void*>(fn));
}

// {name: {"type_id": ..., "type_info": ...}} for jax.ffi.register_ffi_type.
inline nanobind::dict TypeRegistrations(const char* name, XLA_FFI_TypeId* id,
                                        const XLA_FFI_TypeInfo* info) {
  nanobind::dict d, type;
  type["type_id"] = Capsule(id);
  type["type_info"] = Capsule(const_cast<XLA_FFI_TypeInfo*>(info));
  d[name] = type;
  return d;
}

// {target: {"instantiate": ..., "execute": ...}} for jax.ffi.register_ffi_target.
template <typename Handler>
nanobind::dict TargetRegistrations(Handler* instantiate, Handler* all_gather,
                                   Handler* reduce_scatter, Handler* all_reduce,
                                   Handler* all_to_all, Handler* collective_permute) {
  nanobind::dict d;
  auto stages = [&](Handler* execute) {
    nanobind::dict s;
    s["instantiate"] = Capsule(instantiate);
    s["execute"] = Capsule(execute);
    return s;
  };
  d["smddp_all_gather"] = stages(all_gather);
  d["smddp_reduce_scatter"] = stages(reduce_scatter);
  d["smddp_all_reduce"] = stages(all_reduce);
  d["smddp_all_to_all"] = stages(all_to_all);
  d["smddp_collective_permute"] = stages(collective_permute);
  return d;
}

}  // namespace smddp

#endif  // JAX_SMDDP_BINDINGS_REGISTRATIONS_H_

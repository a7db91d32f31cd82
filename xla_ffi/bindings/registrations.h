// What the Python layer hands to jax.ffi for one platform's handlers: the
// per-instruction state type and, per collective, its instantiate and execute
// stages under the target its description names ("smddp_" + its name); and
// the plan the modules' test entries take from Python (shared by the CPU and
// CUDA modules).
#ifndef JAX_SMDDP_BINDINGS_REGISTRATIONS_H_
#define JAX_SMDDP_BINDINGS_REGISTRATIONS_H_

#include <stdexcept>
#include <string>

#include "nanobind/nanobind.h"
#include "xla/ffi/api/c_api.h"
#include "xla_ffi/algorithms/plan.h"
#include "xla_ffi/common/collective.h"

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

// One collective's execute stage.
template <typename Handler>
struct Execute {
  Collective kind;
  Handler* handler;
};

// {target: {"instantiate": ..., "execute": ...}} for jax.ffi.register_ffi_target:
// "smddp_all_gather" and so on, one per collective (each exactly once).
template <typename Handler>
nanobind::dict TargetRegistrations(Handler* instantiate,
                                   const Execute<Handler> (&execute)[kCollectives]) {
  nanobind::dict d;
  bool seen[kCollectives] = {};
  for (const Execute<Handler>& e : execute) {
    if (int(e.kind) >= kCollectives || seen[int(e.kind)])
      throw std::logic_error("jax_smddp: a collective registered twice");
    seen[int(e.kind)] = true;
    nanobind::dict s;
    s["instantiate"] = Capsule(instantiate);
    s["execute"] = Capsule(e.handler);
    d[(std::string("smddp_") + CollectiveName(e.kind)).c_str()] = s;
  }
  return d;
}

}  // namespace smddp

#endif  // JAX_SMDDP_BINDINGS_REGISTRATIONS_H_

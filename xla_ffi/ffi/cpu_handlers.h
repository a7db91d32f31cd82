// XLA FFI handlers for the CPU platform (XLA's "Host"): they decode buffers,
// attributes and context, find the communicator, and call the engine. No
// algorithm logic lives here.
#ifndef JAX_SMDDP_FFI_CPU_HANDLERS_H_
#define JAX_SMDDP_FFI_CPU_HANDLERS_H_

#include "xla/ffi/api/api.h"

// Per-instruction state, created when XLA instantiates each custom call: one
// object per collective instruction of an executable, shared by all devices
// that run it. Its instance number tells apart two instructions that carry
// the same attributes (XLA inlines a sub-function lowered once and called
// twice), which the op id in the attributes cannot.
XLA_FFI_DECLARE_TYPE_ID_SYMBOL(SmddpCallSiteTypeId);
XLA_FFI_DECLARE_TYPE_INFO_SYMBOL(SmddpCallSiteTypeInfo);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SmddpInstantiateCpu);

XLA_FFI_DECLARE_HANDLER_SYMBOL(SmddpAllGatherCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SmddpReduceScatterCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SmddpAllReduceCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SmddpAllToAllCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SmddpCollectivePermuteCpu);

#endif  // JAX_SMDDP_FFI_CPU_HANDLERS_H_

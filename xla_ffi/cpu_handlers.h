// XLA FFI handlers for the CPU platform (XLA's "Host"): they decode buffers,
// attributes and context, find the communicator, and call the engine. No
// algorithm logic lives here.
#ifndef JAX_SMDDP_XLA_FFI_CPU_HANDLERS_H_
#define JAX_SMDDP_XLA_FFI_CPU_HANDLERS_H_

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(SmddpAllGatherCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SmddpReduceScatterCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SmddpAllReduceCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SmddpAllToAllCpu);

#endif  // JAX_SMDDP_XLA_FFI_CPU_HANDLERS_H_

// XLA FFI handlers of the GPU backend (platform CUDA). Each decodes its call,
// finds this device's rank in the instruction's state and enqueues the
// stream-ordered collective (algorithms/stream_algorithms.h) on the stream XLA
// gives it; it never waits for the GPU. Not command-buffer compatible: the
// step counters advance on the host at every call, so a replayed command
// buffer would reuse stale flag values.
#ifndef JAX_SMDDP_FFI_GPU_HANDLERS_H_
#define JAX_SMDDP_FFI_GPU_HANDLERS_H_

#include "xla/ffi/api/api.h"

// Per-instruction state: this process's ranks of the instruction's groups,
// by device ordinal.
XLA_FFI_DECLARE_TYPE_ID_SYMBOL(SmddpGpuCallSiteTypeId);
XLA_FFI_DECLARE_TYPE_INFO_SYMBOL(SmddpGpuCallSiteTypeInfo);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SmddpInstantiateCuda);

XLA_FFI_DECLARE_HANDLER_SYMBOL(SmddpAllGatherCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SmddpReduceScatterCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SmddpAllReduceCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SmddpAllToAllCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SmddpCollectivePermuteCuda);

#endif  // JAX_SMDDP_FFI_GPU_HANDLERS_H_

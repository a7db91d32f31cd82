// Symmetric memory for the NCCL API front end (issue 65): XLA's collective
// memory space (--xla_gpu_enable_nccl_user_buffers) allocated by
// ncclMemAlloc and registered once per communicator, so that a call on it
// addresses peer q's buffer as q's window base + the same offset, with no
// per-call exchange of addresses and nothing mapped per call.
//
// Memory. ncclMemAlloc, where the front end serves communicators (no real
// library, or one of a version it knows), is cudaMalloc on the current
// device: memory every peer on the node can map (legacy CUDA IPC, or a cuMem
// file descriptor where the driver hands that out; cuda/buffer_ipc.h).
// ncclMemFree frees it; a window still registered over it is unusable from
// then on (its calls go the usual way). Other memory passes through.
//
// Registration. ncclCommWindowRegister and ncclCommRegister (local in NCCL;
// XLA calls it on every rank at the same point, so it is served the same
// way) are collective here on a served communicator inside one host: the
// ranks meet once (the host waits for every rank's entry: its window's
// handle, size and call log), each maps its peers' windows (a peer's
// allocation once per process and device, however many windows or
// communicators cover it), and the window gets the communicator's next
// registration index (never reused, alike on every rank). Sizes must
// agree. Deregistration synchronizes the rank's device, meets the peers
// again (nobody reads the window any more), then unmaps; ncclMemFree after
// it frees.
//
// Calls. Once a communicator has a window, every uncaptured served call of
// each rank is logged (its window index and offsets, or none) in a ring
// every peer reads, as the call log (xla_ffi/engine/call_log.h) logs the
// plan: a rank compares its entry with the peers' entries for that call
// already there and, where they differ, fails the group naming both ranks,
// the call and the offsets, before it enqueues anything, and releases the
// peers' streams waiting on it. A call whose input (and for all_reduce its
// output) lies in a window, where the group reads in place, runs the
// direct-read body on window bases + offset: no exchange, no mapping, no
// host wait. Any other call goes the usual way (gpu::EnqueueCollective).
#ifndef JAX_SMDDP_CUDA_NCCLAPI_NCCL_WINDOWS_H_
#define JAX_SMDDP_CUDA_NCCLAPI_NCCL_WINDOWS_H_

#include <cstddef>
#include <cstdint>

#include "cuda/ncclapi/nccl_comm.h"
#include "xla_ffi/algorithms/plan.h"
#include "xla_ffi/algorithms/stream_ops.h"
#include "xla_ffi/common/status.h"

namespace smddp {
namespace nccl {

// ncclMemAlloc / ncclMemFree where the front end serves (*served false:
// pass the call to the real library).
Status MemAlloc(void** ptr, size_t size, bool* served);
Status MemFree(void* ptr, bool* served);

// ncclCommWindowRegister / ncclCommRegister (`function` names it) on a
// served communicator inside one host: *handle the window (deregistered
// by DeregisterWindow). Where the communicator spans hosts, *handle is a
// registration that no call uses.
Status RegisterWindow(Comm& comm, void* buffer, size_t bytes, const char* function, void** handle);
// *known false: `handle` is no window of `comm` (the caller forwards it).
Status DeregisterWindow(Comm& comm, void* handle, const char* function, bool* known);

// A served call on `comm` that may use its windows (`captured` calls never
// do): *done true when this ran it (on window addresses) or it failed;
// false when the call goes the usual way.
Status EnqueueWindowed(Comm& comm, const char* op, int64_t op_id, const Plan& plan, StreamOps& ops,
                       const void* send, void* recv, bool captured, bool* done);

// What the windows did in this process, for the tests.
struct WindowCounts {
  uint64_t registered = 0;  // windows registered (every rank's, this process)
  uint64_t windowed = 0;    // calls that ran on window addresses
  uint64_t usual = 0;       // logged calls that went the usual way
};
WindowCounts CountWindows();
// The registration index of a window handle (-1: none).
int64_t WindowIndex(void* handle);

}  // namespace nccl
}  // namespace smddp

#endif  // JAX_SMDDP_CUDA_NCCLAPI_NCCL_WINDOWS_H_

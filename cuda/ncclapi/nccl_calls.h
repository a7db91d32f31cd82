// The calls of the NCCL API front end: each collective is served by
// jax_smddp's GPU engine (cuda/gpu_call.h, on the stream the caller passes)
// when its communicator is served and the engine has its type and
// reduction, and forwarded to the real NCCL otherwise. Between
// ncclGroupStart and ncclGroupEnd calls are only recorded; the outermost
// ncclGroupEnd issues them (a group of sends and receives that is an
// all-to-all as one served call, SendRecv): the served calls before the first forwarded one,
// then every forwarded call as one real NCCL group (in their order: a
// send/recv pair never splits across real groups), then the other served
// calls. NCCL orders nothing inside a group, so this keeps its meaning.
// A served call on a communicator with registered windows is logged against
// its peers' and, on window buffers, read at window base + offset
// (nccl_windows.h).
//
// Errors: a failed call returns ncclInvalidArgument (arguments),
// ncclInvalidUsage (unsupported use, e.g. capture into a CUDA graph),
// ncclRemoteError (a peer died or disagreed) or ncclInternalError, and
// ncclGetLastError gives the engine's message, which names the op, the rank
// and peer process, and the remedy (jax_smddp.errors.classify reads it).
// A peer's failure also becomes the communicator's async error.
#ifndef JAX_SMDDP_CUDA_NCCLAPI_NCCL_CALLS_H_
#define JAX_SMDDP_CUDA_NCCLAPI_NCCL_CALLS_H_

#include <cstddef>
#include <functional>
#include <string>

#include "cuda/ncclapi/nccl_comm.h"
#include "cuda/ncclapi/nccl_types.h"
#include "xla_ffi/algorithms/stream_ops.h"
#include "xla_ffi/common/collective.h"
#include "xla_ffi/common/status.h"

namespace smddp {
namespace nccl {

// The stream operations served calls enqueue with: CUDA streams in the
// library, host threads in the mock tests. `run` builds them for `stream`
// on its own stack (nothing allocated per call) and runs `body` with them;
// `capturing` says whether a stream is being captured into a CUDA graph
// (served calls then enqueue replayable bodies, stream_algorithms.h).
struct StreamBackend {
  using Body = Status (*)(StreamOps& ops, void* context);
  Status (*run)(void* stream, Body body, void* context) = nullptr;
  bool (*capturing)(void* stream) = nullptr;
};
void SetStreamBackend(StreamBackend backend);

// The engine's collectives (xla_ffi/common/collective.h) the front end
// serves as NCCL's functions: all but collective_permute, which comes as a
// group of sends and receives.
// A collective (count: NCCL's: per rank for all_gather's input,
// reduce_scatter's output and all_to_all's blocks, the whole buffer for
// all_reduce).
ncclResult_t RunCollective(Collective kind, const void* send, void* recv, size_t count,
                           ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm, void* stream);

// Any other call on a communicator: `call` runs with the real communicator
// (inside a group: at ncclGroupEnd).
// (`reason`: why it is not served, when the caller knows better than "the
// GPU engine does not serve <function>").
ncclResult_t Forward(const char* function, ncclComm_t comm,
                     std::function<ncclResult_t(ncclComm_t real)> call,
                     const std::string& reason = "");

// ncclSend / ncclRecv: forwarded, except in a group that is exactly an
// all-to-all on one served communicator, as XLA's all-to-all issues it: a
// send to and a receive from every rank (itself included), one count, type
// and stream, each side's blocks contiguous in rank order. Such a group is
// served as one ncclAlltoAll. A group of sends to one peer and receives from
// one peer (XLA's collective-permute: to the rank's target, from its source;
// one of each per operand) on a served communicator inside one host is
// served as jax_smddp's collective_permute, between the pairs only
// (RunStreamPairPermute), unless it is being captured into a CUDA graph.
ncclResult_t SendRecv(bool send, void* buffer, size_t count, ncclDataType_t type, int peer,
                      ncclComm_t comm, void* stream);

ncclResult_t GroupStart();
ncclResult_t GroupEnd();
// ncclGroupSimulateEnd: the group is dropped, not run.
ncclResult_t GroupDrop();

// Records `status` as this thread's (and `comm`'s, if given) last error and
// returns its NCCL code.
ncclResult_t Fail(Comm* comm, const Status& status);
std::string LastError(Comm* comm);

// What the front end did, process-wide, for the doctor and the tests: calls
// served and forwarded by function, how many of the served ones were
// captured into CUDA graphs (counted once, however often a graph replays),
// and each reason for forwarding (told once at WARNING on stderr).
std::string Describe();
// `text` as the inside of a JSON string.
std::string JsonEscaped(const std::string& text);
void NoteForwarded(const std::string& function, const std::string& why);

}  // namespace nccl
}  // namespace smddp

#endif  // JAX_SMDDP_CUDA_NCCLAPI_NCCL_CALLS_H_

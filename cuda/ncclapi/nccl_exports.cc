// The NCCL C API as the front end exports it (exports.map lists the names):
// set-up and errors answered here, collectives through nccl_calls.h, and
// every other call on a communicator forwarded to the real NCCL with the
// real communicator in place of the front end's. Calls that take no
// communicator pass straight through, but for ncclMemAlloc/ncclMemFree
// where the front end serves (nccl_windows.h, with window registration).
#include <cstring>
#include <mutex>
#include <string>

#include "cuda/ncclapi/nccl_calls.h"
#include "cuda/ncclapi/nccl_comm.h"
#include "cuda/ncclapi/nccl_types.h"
#include "cuda/ncclapi/nccl_windows.h"
#include "cuda/ncclapi/real_nccl.h"

#define SMDDP_NCCL_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using smddp::Collective;
using smddp::Status;
using namespace smddp::nccl;

template <typename Fn>
Fn Real(const char* name) {
  std::string why;
  return reinterpret_cast<Fn>(RealSymbol(name, &why));
}

ncclResult_t Missing(const char* name) {
  std::string why;
  RealSymbol(name, &why);
  return Fail(nullptr, Status::Unsupported("jax_smddp NCCL front end: " + std::string(name) +
                                           " cannot be forwarded: " + why));
}

// Passes a call without a communicator straight to the real library.
#define SMDDP_PASS(name, params, args)         \
  SMDDP_NCCL_EXPORT ncclResult_t name params { \
    using Fn = ncclResult_t(*) params;         \
    auto fn = Real<Fn>(#name);                 \
    return fn ? fn args : Missing(#name);      \
  }

// Forwards a call whose first argument is a communicator.
#define SMDDP_FORWARD(name, params, args)              \
  SMDDP_NCCL_EXPORT ncclResult_t name params {         \
    return Forward(#name, comm, [=](ncclComm_t real) { \
      using Fn = ncclResult_t(*) params;               \
      auto fn = Real<Fn>(#name);                       \
      return fn ? fn args : Missing(#name);            \
    });                                                \
  }

ncclResult_t Checked(Comm* comm, const Status& st) {
  return st.ok() ? ncclSuccess : Fail(comm, st);
}

}  // namespace

SMDDP_NCCL_EXPORT ncclResult_t ncclGetVersion(int* version) {
  if (!version) return ncclInvalidArgument;
  std::string why;
  const int real = RealVersion(&why);
  *version = real ? real : kOldestKnownVersion + 200;  // no real library: the oldest jaxlib needs
  return ncclSuccess;
}

SMDDP_NCCL_EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (!id) return ncclInvalidArgument;
  return Checked(nullptr, MakeUniqueId(id));
}

SMDDP_NCCL_EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t* out, int nranks, ncclUniqueId id,
                                                      int rank, ncclConfig_t* config) {
  if (!out) return ncclInvalidArgument;
  Comm* comm = nullptr;
  const Status st = InitRank(nranks, id, rank, config, &comm);
  if (!st.ok()) return Fail(nullptr, st);
  *out = Publish(comm);
  return ncclSuccess;
}

SMDDP_NCCL_EXPORT ncclResult_t ncclCommInitRank(ncclComm_t* out, int nranks, ncclUniqueId id,
                                                int rank) {
  return ncclCommInitRankConfig(out, nranks, id, rank, nullptr);
}

SMDDP_NCCL_EXPORT ncclResult_t ncclCommInitRankScalable(ncclComm_t* out, int nranks, int rank,
                                                        int nids, ncclUniqueId* ids,
                                                        ncclConfig_t* config) {
  if (nids != 1 || !ids)
    return Fail(nullptr,
                Status::Unsupported("jax_smddp NCCL front end: ncclCommInitRankScalable with " +
                                    std::to_string(nids) + " ids (it takes one)"));
  return ncclCommInitRankConfig(out, nranks, ids[0], rank, config);
}

SMDDP_NCCL_EXPORT ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* out,
                                             ncclConfig_t* config) {
  Comm* parent = AsComm(comm);
  if (!parent || !out) return ncclInvalidArgument;
  Comm* child = nullptr;
  const Status st = Split(*parent, color, key, config, &child);
  if (!st.ok()) return Fail(parent, st);
  *out = child ? Publish(child) : nullptr;
  return ncclSuccess;
}

SMDDP_NCCL_EXPORT ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  Comm* c = AsComm(comm);
  return c ? DestroyReal(*c, "ncclCommFinalize") : ncclInvalidArgument;
}

SMDDP_NCCL_EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  Comm* c = AsComm(comm);
  if (!c) return ncclInvalidArgument;
  const ncclResult_t rc = DestroyReal(*c, "ncclCommDestroy");
  Retire(c);  // the GPU communicator stays registered (nccl_comm.h); the handle is dead
  return rc;
}

SMDDP_NCCL_EXPORT ncclResult_t ncclCommAbort(ncclComm_t comm) {
  Comm* c = AsComm(comm);
  if (!c) return ncclInvalidArgument;
  // The group fails for every rank of it: the watchdog releases the streams
  // waiting on its flags (host flag memory, the front end's default) and
  // the peers' next calls fail. The real side aborts its own.
  if (c->local && c->local->watch)
    c->local->watch->Fail(Status::PeerFailed(
        "jax_smddp NCCL front end: rank " + std::to_string(c->rank) + " (process " +
        std::to_string(c->process_of.empty() ? -1 : c->process_of[c->rank]) +
        ") aborted the communicator (ncclCommAbort)"));
  const ncclResult_t rc = DestroyReal(*c, "ncclCommAbort");
  Retire(c);
  return rc;
}

SMDDP_NCCL_EXPORT ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async_error) {
  Comm* c = AsComm(comm);
  if (!c || !async_error) return ncclInvalidArgument;
  Status failure;
  {
    std::lock_guard<std::mutex> lock(c->error_mu);
    if (c->async_error.ok() && c->local && c->local->watch && c->local->watch->failed()) {
      c->async_error = c->local->watch->error();
      c->failed.store(true, std::memory_order_release);
    }
    // A group inside one process has no watch: a rank of it that failed the
    // group (a window offset that differs) says so here.
    if (c->async_error.ok() && c->local && c->local->exchange_failure->failed()) {
      c->async_error = c->local->exchange_failure->error();
      c->failed.store(true, std::memory_order_release);
    }
    failure = c->async_error;
  }
  if (!failure.ok()) {
    Fail(c, failure);  // ncclGetLastError(comm) says what (tagged, as every failure)
    *async_error = ncclRemoteError;
    return ncclSuccess;
  }
  std::lock_guard<std::mutex> lock(c->real_mu);
  if (c->real) {
    using Fn = ncclResult_t (*)(ncclComm_t, ncclResult_t*);
    if (auto fn = Real<Fn>("ncclCommGetAsyncError")) return fn(c->real, async_error);
  }
  *async_error = ncclSuccess;
  return ncclSuccess;
}

SMDDP_NCCL_EXPORT ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  Comm* c = AsComm(comm);
  if (!c || !count) return ncclInvalidArgument;
  *count = c->nranks;
  return ncclSuccess;
}

SMDDP_NCCL_EXPORT ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  Comm* c = AsComm(comm);
  if (!c || !rank) return ncclInvalidArgument;
  *rank = c->rank;
  return ncclSuccess;
}

SMDDP_NCCL_EXPORT ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
  Comm* c = AsComm(comm);
  if (!c || !device) return ncclInvalidArgument;
  *device = c->ordinal;
  return ncclSuccess;
}

SMDDP_NCCL_EXPORT const char* ncclGetErrorString(ncclResult_t result) {
  using Fn = const char* (*)(ncclResult_t);
  if (auto fn = Real<Fn>("ncclGetErrorString")) return fn(result);
  switch (result) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error";
    case ncclSystemError:
      return "unhandled system error";
    case ncclInternalError:
      return "internal error";
    case ncclInvalidArgument:
      return "invalid argument";
    case ncclInvalidUsage:
      return "invalid usage";
    case ncclRemoteError:
      return "remote process exited or there was a network error";
    case ncclInProgress:
      return "NCCL operation in progress";
  }
  return "unknown result code";
}

SMDDP_NCCL_EXPORT const char* ncclGetLastError(ncclComm_t comm) {
  static thread_local std::string message;
  message = LastError(AsComm(comm));
  if (message.empty()) {
    using Fn = const char* (*)(ncclComm_t);
    Comm* c = AsComm(comm);
    if (auto fn = Real<Fn>("ncclGetLastError")) {
      const char* real = fn(c ? c->real : nullptr);
      return real ? real : "";
    }
  }
  return message.c_str();
}

SMDDP_NCCL_EXPORT ncclResult_t ncclGroupStart() { return GroupStart(); }

SMDDP_NCCL_EXPORT ncclResult_t ncclGroupEnd() { return GroupEnd(); }

SMDDP_NCCL_EXPORT ncclResult_t ncclGroupSimulateEnd(ncclSimInfo_t* /*info*/) { return GroupDrop(); }

SMDDP_NCCL_EXPORT ncclResult_t ncclAllGather(const void* send, void* recv, size_t count,
                                             ncclDataType_t type, ncclComm_t comm, void* stream) {
  return RunCollective(Collective::kAllGather, send, recv, count, type, ncclSum, comm, stream);
}

SMDDP_NCCL_EXPORT ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count,
                                                 ncclDataType_t type, ncclRedOp_t op,
                                                 ncclComm_t comm, void* stream) {
  return RunCollective(Collective::kReduceScatter, send, recv, count, type, op, comm, stream);
}

SMDDP_NCCL_EXPORT ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count,
                                             ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                                             void* stream) {
  return RunCollective(Collective::kAllReduce, send, recv, count, type, op, comm, stream);
}

SMDDP_NCCL_EXPORT ncclResult_t ncclAlltoAll(const void* send, void* recv, size_t count,
                                            ncclDataType_t type, ncclComm_t comm, void* stream) {
  return RunCollective(Collective::kAllToAll, send, recv, count, type, ncclSum, comm, stream);
}

// Collectives and point-to-point calls the engine does not serve.
SMDDP_NCCL_EXPORT ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count,
                                             ncclDataType_t type, int root, ncclComm_t comm,
                                             void* stream) {
  return Forward("ncclBroadcast", comm, [=](ncclComm_t real) {
    using Fn = ncclResult_t (*)(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t, void*);
    auto fn = Real<Fn>("ncclBroadcast");
    return fn ? fn(send, recv, count, type, root, real, stream) : Missing("ncclBroadcast");
  });
}
SMDDP_FORWARD(ncclBcast,
              (void* buff, size_t count, ncclDataType_t type, int root, ncclComm_t comm,
               void* stream),
              (buff, count, type, root, real, stream))
SMDDP_FORWARD(ncclReduce,
              (const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op,
               int root, ncclComm_t comm, void* stream),
              (send, recv, count, type, op, root, real, stream))
SMDDP_NCCL_EXPORT ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t type,
                                        int peer, ncclComm_t comm, void* stream) {
  return SendRecv(true, const_cast<void*>(send), count, type, peer, comm, stream);
}
SMDDP_NCCL_EXPORT ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t type, int peer,
                                        ncclComm_t comm, void* stream) {
  return SendRecv(false, recv, count, type, peer, comm, stream);
}
SMDDP_FORWARD(ncclRedOpCreatePreMulSum,
              (ncclRedOp_t * op, void* scalar, ncclDataType_t type, int residence, ncclComm_t comm),
              (op, scalar, type, residence, real))
SMDDP_FORWARD(ncclRedOpDestroy, (ncclRedOp_t op, ncclComm_t comm), (op, real))

// Windows (nccl_windows.h): a served communicator's own; a forwarded one's
// are the real library's.
SMDDP_NCCL_EXPORT ncclResult_t ncclCommWindowRegister(ncclComm_t comm, void* buff, size_t size,
                                                      void** win, int flags) {
  Comm* c = AsComm(comm);
  if (c && c->served) {
    if (!win) return ncclInvalidArgument;
    return Checked(c, RegisterWindow(*c, buff, size, "ncclCommWindowRegister", win));
  }
  return Forward("ncclCommWindowRegister", comm, [=](ncclComm_t real) {
    using Fn = ncclResult_t (*)(ncclComm_t, void*, size_t, void**, int);
    auto fn = Real<Fn>("ncclCommWindowRegister");
    return fn ? fn(real, buff, size, win, flags) : Missing("ncclCommWindowRegister");
  });
}
SMDDP_NCCL_EXPORT ncclResult_t ncclCommWindowDeregister(ncclComm_t comm, void* win) {
  Comm* c = AsComm(comm);
  bool known = false;
  if (c) {
    const Status st = DeregisterWindow(*c, win, "ncclCommWindowDeregister", &known);
    if (known) return Checked(c, st);
  }
  return Forward("ncclCommWindowDeregister", comm, [=](ncclComm_t real) {
    using Fn = ncclResult_t (*)(ncclComm_t, void*);
    auto fn = Real<Fn>("ncclCommWindowDeregister");
    return fn ? fn(real, win) : Missing("ncclCommWindowDeregister");
  });
}
SMDDP_FORWARD(ncclCommQueryProperties, (ncclComm_t comm, void* properties), (real, properties))
SMDDP_FORWARD(ncclDevCommCreate, (ncclComm_t comm, const void* requirements, void* dev_comm),
              (real, requirements, dev_comm))
SMDDP_FORWARD(ncclDevCommDestroy, (ncclComm_t comm, const void* dev_comm), (real, dev_comm))
SMDDP_FORWARD(ncclSignal,
              (int peer, int signal, int ctx, unsigned int flags, ncclComm_t comm, void* stream),
              (peer, signal, ctx, flags, real, stream))
SMDDP_FORWARD(ncclWaitSignal, (int n, void* descriptors, ncclComm_t comm, void* stream),
              (n, descriptors, real, stream))
SMDDP_FORWARD(ncclPutSignal,
              (const void* local, size_t count, ncclDataType_t type, int peer, void* peer_window,
               size_t peer_offset, int signal, int ctx, unsigned int flags, ncclComm_t comm,
               void* stream),
              (local, count, type, peer, peer_window, peer_offset, signal, ctx, flags, real,
               stream))

// User buffer registration: a served communicator's is a window
// (nccl_windows.h); a forwarded one's goes to its real communicator, and
// with neither there is nothing to register with.
SMDDP_NCCL_EXPORT ncclResult_t ncclCommRegister(const ncclComm_t comm, void* buff, size_t size,
                                                void** handle) {
  Comm* c = AsComm(comm);
  if (!c || !handle) return ncclInvalidArgument;
  if (c->served) return Checked(c, RegisterWindow(*c, buff, size, "ncclCommRegister", handle));
  std::lock_guard<std::mutex> lock(c->real_mu);
  using Fn = ncclResult_t (*)(ncclComm_t, void*, size_t, void**);
  auto fn = Real<Fn>("ncclCommRegister");
  if (c->real && fn) return fn(c->real, buff, size, handle);
  *handle = nullptr;
  return ncclSuccess;
}

SMDDP_NCCL_EXPORT ncclResult_t ncclCommDeregister(const ncclComm_t comm, void* handle) {
  Comm* c = AsComm(comm);
  if (!c) return ncclInvalidArgument;
  if (!handle) return ncclSuccess;
  bool known = false;
  const Status st = DeregisterWindow(*c, handle, "ncclCommDeregister", &known);
  if (known) return Checked(c, st);
  std::lock_guard<std::mutex> lock(c->real_mu);
  using Fn = ncclResult_t (*)(ncclComm_t, void*);
  auto fn = Real<Fn>("ncclCommDeregister");
  return c->real && fn ? fn(c->real, handle) : ncclSuccess;
}

SMDDP_NCCL_EXPORT ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devices) {
  using Fn = ncclResult_t (*)(ncclComm_t*, int, const int*);
  auto fn = Real<Fn>("ncclCommInitAll");
  if (!fn) return Missing("ncclCommInitAll");
  const ncclResult_t rc = fn(comms, ndev, devices);
  if (rc != ncclSuccess) return rc;
  for (int i = 0; i < ndev; ++i)
    comms[i] = Publish(WrapReal(comms[i], "ncclCommInitAll communicators are the real library's"));
  NoteForwarded("ncclCommInitAll", "ncclCommInitAll communicators are the real library's");
  return ncclSuccess;
}

SMDDP_NCCL_EXPORT ncclResult_t ncclCommShrink(ncclComm_t comm, int* exclude, int excluded,
                                              ncclComm_t* out, ncclConfig_t* config, int flags) {
  if (!out) return ncclInvalidArgument;
  ncclComm_t shrunk = nullptr;
  const ncclResult_t rc = Forward("ncclCommShrink", comm, [&](ncclComm_t real) {
    using Fn = ncclResult_t (*)(ncclComm_t, int*, int, ncclComm_t*, ncclConfig_t*, int);
    auto fn = Real<Fn>("ncclCommShrink");
    return fn ? fn(real, exclude, excluded, &shrunk, config, flags) : Missing("ncclCommShrink");
  });
  if (rc != ncclSuccess) return rc;
  *out =
      shrunk
          ? Publish(WrapReal(shrunk, "communicators made by ncclCommShrink are the real library's"))
          : nullptr;
  return ncclSuccess;
}

// Memory every peer can map where the front end serves (nccl_windows.h).
SMDDP_NCCL_EXPORT ncclResult_t ncclMemAlloc(void** ptr, size_t size) {
  if (!ptr) return ncclInvalidArgument;
  bool served = false;
  const Status st = MemAlloc(ptr, size, &served);
  if (served) return Checked(nullptr, st);
  using Fn = ncclResult_t (*)(void**, size_t);
  auto fn = Real<Fn>("ncclMemAlloc");
  return fn ? fn(ptr, size) : Missing("ncclMemAlloc");
}
SMDDP_NCCL_EXPORT ncclResult_t ncclMemFree(void* ptr) {
  if (!ptr) return ncclSuccess;
  bool served = false;
  const Status st = MemFree(ptr, &served);
  if (served) return Checked(nullptr, st);
  using Fn = ncclResult_t (*)(void*);
  auto fn = Real<Fn>("ncclMemFree");
  return fn ? fn(ptr) : Missing("ncclMemFree");
}

// No communicator: straight through.
SMDDP_PASS(ncclGetLsaDevicePointer, (void* window, size_t offset, int rank, void** ptr),
           (window, offset, rank, ptr))
SMDDP_PASS(ncclGetLsaMultimemDevicePointer, (void* window, size_t offset, void** ptr),
           (window, offset, ptr))

SMDDP_NCCL_EXPORT void ncclResetDebugInit() {
  using Fn = void (*)();
  if (auto fn = Real<Fn>("ncclResetDebugInit")) fn();
}

#include "cuda/ncclapi/nccl_calls.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include "cuda/gpu_call.h"
#include "cuda/ncclapi/nccl_windows.h"
#include "cuda/ncclapi/real_nccl.h"
#include "xla_ffi/algorithms/stream_algorithms.h"
#include "xla_ffi/common/dtype.h"
#include "xla_ffi/common/settings.h"

namespace smddp {
namespace nccl {
namespace {

StreamBackend backend;

// What each served collective (CollectiveSpec::substrates: kNcclApi) is
// called where it shows, in the enumeration's order (the engine's messages
// name it CollectiveName).
struct CollectiveNames {
  const char* function;  // NCCL's (ncclAllGather)
  World::Caller caller;  // the world's per-op counts (traffic_by_op)
};
constexpr CollectiveNames kNames[] = {
    {"ncclAllGather", World::Caller::kNcclAllGather},
    {"ncclReduceScatter", World::Caller::kNcclReduceScatter},
    {"ncclAllReduce", World::Caller::kNcclAllReduce},
    {"ncclAlltoAll", World::Caller::kNcclAlltoAll},
    // A group of sends and receives served as a permutation (PermutationOf).
    {"ncclSend/ncclRecv", World::Caller::kNcclPermute},
};
static_assert(sizeof(kNames) / sizeof(kNames[0]) == kCollectives, "a name for each collective");
const CollectiveNames& NamesOf(Collective kind) { return kNames[int(kind)]; }

struct Tally {
  std::atomic<uint64_t> served[kCollectives] = {};  // per call: no lock
  std::atomic<uint64_t> captured{0};  // of those, captured into CUDA graphs (once each)
  std::mutex mu;                      // the rest: forwarding only
  std::map<std::string, uint64_t> forwarded;
  std::set<std::string> reasons;  // told once each
};
Tally& Tallies() {
  static auto* t = new Tally;
  return *t;
}

// A served call of `kind` that delivered `bytes` into this rank's output.
void CountServed(const Comm& comm, Collective kind, uint64_t bytes) {
  if (auto world = comm.world.lock()) world->CountCall(NamesOf(kind).caller, bytes);
  Tallies().served[int(kind)].fetch_add(1, std::memory_order_relaxed);
}

thread_local std::string thread_error;

// A send or receive recorded inside a group, for SendRecv's match.
struct PointToPoint {
  bool send = false;
  char* buffer = nullptr;
  size_t count = 0;
  ncclDataType_t type = ncclFloat32;
  int peer = -1;
  Comm* comm = nullptr;
  void* stream = nullptr;
};

// A call recorded inside a group.
struct Pending {
  Comm* forwarded = nullptr;  // the communicator of a forwarded call
  std::function<ncclResult_t()> run;
  bool point_to_point = false;  // p2p holds the call
  PointToPoint p2p;
};
thread_local int group_depth = 0;
thread_local std::vector<Pending> group_calls;

bool NoFallback() {
  for (const std::string& item : SettingItems(TextSetting("JAX_SMDDP_REQUIRE")))
    if (item == "no-fallback") return true;
  return false;
}

// The engine's type for `type`: false where it has none.
bool EngineType(ncclDataType_t type, DType* out) {
  switch (type) {
    case ncclInt8:
      *out = DType::kInt8;
      return true;
    case ncclUint8:
      *out = DType::kUInt8;
      return true;
    case ncclInt32:
      *out = DType::kInt32;
      return true;
    case ncclUint32:
      *out = DType::kUInt32;
      return true;
    case ncclInt64:
      *out = DType::kInt64;
      return true;
    case ncclFloat16:
      *out = DType::kFloat16;
      return true;
    case ncclFloat32:
      *out = DType::kFloat32;
      return true;
    case ncclFloat64:
      *out = DType::kFloat64;
      return true;
    case ncclBfloat16:
      *out = DType::kBFloat16;
      return true;
    default:
      return false;
  }
}

size_t TypeBytes(ncclDataType_t type) {
  switch (type) {
    case ncclInt8:
    case ncclUint8:
    case ncclFloat8e4m3:
    case ncclFloat8e5m2:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
  }
  return 0;
}

// Why `kind` of `type`/`op` is not served on `comm` ("" when it is).
std::string WhyNotServed(const Comm& comm, Collective kind, ncclDataType_t type, ncclRedOp_t op,
                         size_t count) {
  if (!comm.served) return comm.forwarded_because;
  // Two passes (a reduce-scatter, then an all-gather of the shards): across
  // hosts, shards of equal size.
  if (comm.port && SpecOf(kind).passes > 1 && count % size_t(comm.nranks) != 0)
    return std::string("an ") + CollectiveName(kind) +
           " across hosts runs as reduce_scatter + all_gather, which needs a count divisible by "
           "the ranks (" +
           std::to_string(count) + " over " + std::to_string(comm.nranks) + ")";
  if (!Reduces(kind))
    return TypeBytes(type) ? "" : "data type " + std::to_string(int(type)) + " is not known";
  DType dtype;
  if (!EngineType(type, &dtype))
    return "the GPU engine does not reduce NCCL data type " + std::to_string(int(type));
  if (op != ncclSum && op != ncclMax && op != ncclMin)
    return "the GPU engine reduces with sum, max and min only (NCCL op " + std::to_string(int(op)) +
           ")";
  return "";
}

ncclResult_t Code(const Status& st) {
  switch (st.code()) {
    case StatusCode::kOk:
      return ncclSuccess;
    case StatusCode::kInvalidArgument:
      return ncclInvalidArgument;
    case StatusCode::kUnsupported:
      return ncclInvalidUsage;
    case StatusCode::kPeerFailed:
    case StatusCode::kTimeout:
    case StatusCode::kMismatch:
    case StatusCode::kProtocol:
      return ncclRemoteError;
    default:
      return ncclInternalError;
  }
}

// A served call's failure: a dead or late peer or a disagreement fails the
// communicator for good (every later call reports it); then as Fail.
ncclResult_t FailServed(Comm& comm, StatusCode code, const Status& located) {
  if (code == StatusCode::kPeerFailed || code == StatusCode::kTimeout ||
      code == StatusCode::kMismatch) {
    std::lock_guard<std::mutex> lock(comm.error_mu);
    if (comm.async_error.ok()) comm.async_error = located;
    comm.failed.store(true, std::memory_order_release);
  }
  return Fail(&comm, located);
}

// The engine's part of a served call, on `ops` (`captured`: into a CUDA graph).
Status Enqueue(Collective kind, const void* send, void* recv, const Plan& plan, Comm& comm,
               StreamOps& ops, bool captured) {
  const int64_t op_id = int64_t(comm.calls++);
  bool done = false;  // on window addresses (or failed there)
  const Status st =
      EnqueueWindowed(comm, CollectiveName(kind), op_id, plan, ops, send, recv, captured, &done);
  if (done) return st;
  const gpu::CallRank me{comm.local, comm.port, comm.rank_of};
  return gpu::EnqueueCollective(CollectiveName(kind), op_id, me, ops, send, recv, plan, captured);
}

ncclResult_t Serve(Collective kind, const void* send, void* recv, size_t count, DType dtype,
                   ReduceOp op, Comm& comm, void* stream) {
  // Into a CUDA graph (XLA's command buffers): enqueued as a replayable call.
  const bool captured = backend.capturing && backend.capturing(stream);
  if (comm.failed.load(std::memory_order_acquire)) {
    Status earlier;
    {
      std::lock_guard<std::mutex> lock(comm.error_mu);
      earlier = comm.async_error;
    }
    return Fail(&comm, earlier);
  }
  // NCCL's count is in the unit the plan takes (PlanSize): a rank's block, or the buffer.
  Plan plan;
  plan.kind = kind;
  plan.dtype = dtype;
  plan.op = op;
  plan.outer = 1;
  switch (SpecOf(kind).plan_size) {
    case PlanSize::kByteBlocks:
      plan.dtype = DType::kUInt8;
      plan.inner = count * ElementSize(dtype);
      break;
    case PlanSize::kElementBlocks:
      plan.inner = count;
      break;
    case PlanSize::kElements:
      plan.count = count;
      break;
  }
  size_t send_bytes = 0, recv_bytes = 0;
  CallBytes(plan, comm.nranks, &send_bytes, &recv_bytes);
  if (count == 0) return ncclSuccess;
  struct Call {
    Collective kind;
    const void* send;
    void* recv;
    const Plan& plan;
    Comm& comm;
    bool captured;
  } call{kind, send, recv, plan, comm, captured};
  const Status st = backend.run(
      stream,
      [](StreamOps& ops, void* context) {
        const Call& c = *static_cast<const Call*>(context);
        return Enqueue(c.kind, c.send, c.recv, c.plan, c.comm, ops, c.captured);
      },
      &call);
  if (!st.ok()) {
    const Status located = st.WithMessage(
        "jax_smddp " + st.message() + " [XLA's collective through " + NamesOf(kind).function +
        ", rank " + std::to_string(comm.rank) + " of " + std::to_string(comm.nranks) + "]");
    return FailServed(comm, st.code(), located);
  }
  CountServed(comm, kind, recv_bytes);
  if (captured) Tallies().captured.fetch_add(1, std::memory_order_relaxed);
  return ncclSuccess;
}

// A call that would be forwarded, under JAX_SMDDP_REQUIRE=no-fallback.
ncclResult_t RefuseForwarding(Comm* comm, const std::string& function, const std::string& why) {
  return Fail(comm, Status::Unsupported("jax_smddp NCCL front end: " + function +
                                        " would be forwarded to NCCL (" + why +
                                        ") and JAX_SMDDP_REQUIRE=no-fallback forbids it"));
}

// Runs `call` now, or records it inside a group.
ncclResult_t Issue(Comm* forwarded, std::function<ncclResult_t()> call) {
  if (group_depth > 0) {
    Pending pending;
    pending.forwarded = forwarded;
    pending.run = std::move(call);
    group_calls.push_back(std::move(pending));
    return ncclSuccess;
  }
  return call();
}

template <typename Fn>
Fn Real(const char* name, std::string* why) {
  return reinterpret_cast<Fn>(RealSymbol(name, why));
}

// Bytes moved, not reduced: any type of a known size, as an engine type of that size.
DType MovedType(ncclDataType_t type) {
  switch (TypeBytes(type)) {
    case 1:
      return DType::kUInt8;
    case 2:
      return DType::kFloat16;
    case 4:
      return DType::kUInt32;
    default:
      return DType::kInt64;
  }
}

// Whether a group's calls are exactly an all-to-all (SendRecv); `*a2a` then
// holds its first send (and the first receive's buffer in `*recv`).
bool AllToAllOf(const std::vector<Pending>& calls, PointToPoint* a2a, char** recv) {
  if (calls.empty() || !calls[0].point_to_point) return false;
  const PointToPoint& first = calls[0].p2p;
  Comm* comm = first.comm;
  const int n = comm->nranks;
  const size_t block = first.count * TypeBytes(first.type);
  if (calls.size() != 2 * size_t(n) || block == 0 ||
      !WhyNotServed(*comm, Collective::kAllToAll, first.type, ncclSum, first.count).empty())
    return false;
  // Kept per thread: a group served this way allocates nothing once warm.
  thread_local std::vector<char*> sends, recvs;
  sends.assign(n, nullptr);
  recvs.assign(n, nullptr);
  for (const Pending& c : calls) {
    const PointToPoint& p = c.p2p;
    if (!c.point_to_point || p.comm != comm || p.stream != first.stream || p.type != first.type ||
        p.count != first.count || p.peer < 0 || p.peer >= n || p.buffer == nullptr)
      return false;
    char*& slot = p.send ? sends[p.peer] : recvs[p.peer];
    if (slot) return false;  // two to one peer
    slot = p.buffer;
  }
  for (int q = 0; q < n; ++q)
    if (sends[q] != sends[0] + size_t(q) * block || recvs[q] != recvs[0] + size_t(q) * block)
      return false;
  *a2a = first;
  a2a->buffer = sends[0];
  *recv = recvs[0];
  return true;
}

// A group of sends and receives that forms (this rank's part of) a
// permutation on a served communicator inside one host, as XLA's
// collective-permute issues it: sends to one peer (the target) and receives
// from one peer (the source), either side possibly absent, one stream, a
// send to itself only with a receive from itself; with several operands (a
// combined permute) the i-th send and the i-th receive carry the same
// operand (one count and type). The ranks of the permutation are all that
// take part: a rank that neither sends nor receives makes no call, so it is
// served pairwise (RunStreamPairPermute), never as a collective of the group.
struct Permutation {
  struct Part {
    char* send = nullptr;
    char* recv = nullptr;
    size_t bytes = 0;
  };
  Comm* comm = nullptr;
  void* stream = nullptr;
  int target = -1, source = -1;
  const std::vector<Part>* parts = nullptr;
};

bool PermutationOf(const std::vector<Pending>& calls, Permutation* out) {
  if (calls.empty() || !calls[0].point_to_point) return false;
  const PointToPoint& first = calls[0].p2p;
  Comm* comm = first.comm;
  if (!comm || !comm->served || !comm->local || comm->port ||
      (backend.capturing && backend.capturing(first.stream)))
    return false;
  // Kept per thread: a group served this way allocates nothing once warm.
  thread_local std::vector<const PointToPoint*> sends, recvs;
  thread_local std::vector<Permutation::Part> parts;
  sends.clear();
  recvs.clear();
  Permutation p;
  for (const Pending& c : calls) {
    const PointToPoint& q = c.p2p;
    if (!c.point_to_point || q.comm != comm || q.stream != first.stream || q.count == 0 ||
        TypeBytes(q.type) == 0 || q.peer < 0 || q.peer >= comm->nranks || q.buffer == nullptr)
      return false;
    int& peer = q.send ? p.target : p.source;
    if (peer >= 0 && peer != q.peer) return false;  // two peers one way: not a permutation
    peer = q.peer;
    (q.send ? sends : recvs).push_back(&q);
  }
  if ((p.target == comm->rank) != (p.source == comm->rank)) return false;
  if (!sends.empty() && !recvs.empty() && sends.size() != recvs.size()) return false;
  parts.assign(std::max(sends.size(), recvs.size()), {});
  for (size_t i = 0; i < parts.size(); ++i) {
    const PointToPoint* s = sends.empty() ? nullptr : sends[i];
    const PointToPoint* r = recvs.empty() ? nullptr : recvs[i];
    if (s && r && (s->type != r->type || s->count != r->count)) return false;
    const PointToPoint& any = s ? *s : *r;
    parts[i] = {s ? s->buffer : nullptr, r ? r->buffer : nullptr, any.count * TypeBytes(any.type)};
  }
  p.comm = comm;
  p.stream = first.stream;
  p.parts = &parts;
  *out = p;
  return true;
}

ncclResult_t ServePermutation(const Permutation& p) {
  Comm& comm = *p.comm;
  if (comm.failed.load(std::memory_order_acquire)) {
    Status earlier;
    {
      std::lock_guard<std::mutex> lock(comm.error_mu);
      earlier = comm.async_error;
    }
    return Fail(&comm, earlier);
  }
  Status st = gpu::GroupFailure(*comm.local);
  if (st.ok()) {
    st = backend.run(
        p.stream,
        [](StreamOps& ops, void* context) {
          const Permutation& q = *static_cast<const Permutation*>(context);
          for (const Permutation::Part& part : *q.parts)
            SMDDP_RETURN_IF_ERROR(RunStreamPairPermute(q.comm->local->view, ops, part.send,
                                                       part.recv, part.bytes, q.target, q.source));
          return Status::Ok();
        },
        const_cast<Permutation*>(&p));
  }
  if (!st.ok()) {
    const Status located = st.WithMessage(
        "jax_smddp collective_permute: " + st.message() + " [XLA's collective-permute through " +
        NamesOf(Collective::kCollectivePermute).function + ", rank " + std::to_string(comm.rank) +
        " of " + std::to_string(comm.nranks) + ", to rank " + std::to_string(p.target) +
        ", from rank " + std::to_string(p.source) + "]");
    return FailServed(comm, st.code(), located);
  }
  size_t received = 0;
  for (const Permutation::Part& part : *p.parts) received += p.source >= 0 ? part.bytes : 0;
  CountServed(comm, Collective::kCollectivePermute, received);
  return ncclSuccess;
}

}  // namespace

// The closure that runs `call` on `comm`'s real communicator (made now if it
// was not), noting the forwarding and keeping NCCL's code and message.
std::function<ncclResult_t()> Forwarding(Comm* comm, const std::string& name,
                                         const std::string& why,
                                         std::function<ncclResult_t(ncclComm_t real)> call);

std::string JsonEscaped(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char code[8];
      std::snprintf(code, sizeof(code), "\\u%04x", c);
      out += code;
    } else {
      out += c;
    }
  }
  return out;
}

void SetStreamBackend(StreamBackend b) { backend = b; }

ncclResult_t Fail(Comm* comm, const Status& status) {
  // Tagged with its kind: jax_smddp.errors.classify reads it from XLA's error.
  thread_error = TaggedMessage(status.code(), status.message());
  if (comm) {
    std::lock_guard<std::mutex> lock(comm->error_mu);
    comm->last_error = thread_error;
  }
  return Code(status);
}

std::string LastError(Comm* comm) {
  if (comm) {
    std::lock_guard<std::mutex> lock(comm->error_mu);
    if (!comm->last_error.empty()) return comm->last_error;
  }
  return thread_error;
}

void NoteForwarded(const std::string& function, const std::string& why) {
  Tally& t = Tallies();
  std::lock_guard<std::mutex> lock(t.mu);
  t.forwarded[function]++;
  if (t.reasons.insert(why).second)
    std::fprintf(stderr, "WARNING jax_smddp NCCL front end: %s forwarded to NCCL: %s\n",
                 function.c_str(), why.c_str());
}

std::string Describe() {
  Tally& t = Tallies();
  std::lock_guard<std::mutex> lock(t.mu);
  std::map<std::string, uint64_t> served;  // by name, as the forwarded ones
  for (int k = 0; k < kCollectives; ++k)
    if (const uint64_t n = t.served[k].load(std::memory_order_relaxed))
      served[kNames[k].function] = n;
  std::string out = "{\"served\": {";
  bool first = true;
  for (const auto& [f, n] : served) {
    out += std::string(first ? "" : ", ") + "\"" + f + "\": " + std::to_string(n);
    first = false;
  }
  out += "}, \"captured\": " + std::to_string(t.captured.load(std::memory_order_relaxed)) +
         ", \"forwarded\": {";
  first = true;
  for (const auto& [f, n] : t.forwarded) {
    out += std::string(first ? "" : ", ") + "\"" + f + "\": " + std::to_string(n);
    first = false;
  }
  out += "}, \"reasons\": [";
  first = true;
  for (const std::string& r : t.reasons) {
    const std::string escaped = JsonEscaped(r);
    out += std::string(first ? "" : ", ") + "\"" + escaped + "\"";
    first = false;
  }
  return out + "]}";
}

ncclResult_t Forward(const char* function, ncclComm_t handle,
                     std::function<ncclResult_t(ncclComm_t real)> call, const std::string& reason) {
  Comm* comm = AsComm(handle);
  if (!comm)
    return Fail(nullptr,
                Status::InvalidArgument(std::string("jax_smddp NCCL front end: ") + function +
                                        " on a communicator it did not create"));
  const std::string why = !reason.empty() ? reason
                          : comm->served  ? "the GPU engine does not serve " + std::string(function)
                                          : comm->forwarded_because;
  if (NoFallback()) return RefuseForwarding(comm, function, why);
  return Issue(comm, Forwarding(comm, function, why, std::move(call)));
}

std::function<ncclResult_t()> Forwarding(Comm* comm, const std::string& name,
                                         const std::string& why,
                                         std::function<ncclResult_t(ncclComm_t real)> call) {
  return [comm, name, why, call = std::move(call)]() {
    ncclComm_t real = nullptr;
    const Status st = RealComm(*comm, &real);
    if (!st.ok())
      return Fail(comm, st.WithMessage(st.message() + " (needed by " + name + ": " + why + ")"));
    NoteForwarded(name, why);
    const ncclResult_t rc = call(real);
    if (rc != ncclSuccess && rc != ncclInProgress) {
      // The real library's code and message, with what the front end adds.
      using LastFn = const char* (*)(ncclComm_t);
      std::string missing;
      auto last = Real<LastFn>("ncclGetLastError", &missing);
      const char* text = last ? last(real) : nullptr;
      Fail(comm, Status::Error("jax_smddp NCCL front end: " + name + " (forwarded to NCCL: " + why +
                               ") failed in NCCL with code " + std::to_string(int(rc)) +
                               (text && *text ? std::string(": ") + text : std::string())));
    }
    return rc;
  };
}

ncclResult_t RunCollective(Collective kind, const void* send, void* recv, size_t count,
                           ncclDataType_t type, ncclRedOp_t op, ncclComm_t handle, void* stream) {
  Comm* comm = AsComm(handle);
  if (!comm)
    return Fail(nullptr, Status::InvalidArgument(std::string("jax_smddp NCCL front end: ") +
                                                 NamesOf(kind).function +
                                                 " on a communicator it did not create"));
  const std::string why = WhyNotServed(*comm, kind, type, op, count);
  if (!why.empty()) {
    const char* name = NamesOf(kind).function;
    return Forward(
        name, handle,
        [=](ncclComm_t real) {
          std::string missing;
          // NCCL's functions take an op exactly where the collective reduces.
          if (!Reduces(kind)) {
            using Fn =
                ncclResult_t (*)(const void*, void*, size_t, ncclDataType_t, ncclComm_t, void*);
            auto fn = Real<Fn>(name, &missing);
            return fn ? fn(send, recv, count, type, real, stream) : ncclInternalError;
          }
          using Fn = ncclResult_t (*)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                                      ncclComm_t, void*);
          auto fn = Real<Fn>(name, &missing);
          return fn ? fn(send, recv, count, type, op, real, stream) : ncclInternalError;
        },
        comm->served ? why : std::string());
  }
  DType dtype = DType::kUInt8;
  EngineType(type, &dtype);
  if (!Reduces(kind)) dtype = MovedType(type);
  const ReduceOp engine_op = op == ncclMax   ? ReduceOp::kMax
                             : op == ncclMin ? ReduceOp::kMin
                                             : ReduceOp::kSum;
  if (group_depth == 0) return Serve(kind, send, recv, count, dtype, engine_op, *comm, stream);
  return Issue(nullptr,
               [=]() { return Serve(kind, send, recv, count, dtype, engine_op, *comm, stream); });
}

namespace {

// The real library's ncclSend or ncclRecv, on `real`.
std::function<ncclResult_t(ncclComm_t)> RealSendRecv(const PointToPoint& p) {
  return [p](ncclComm_t real) {
    std::string missing;
    using Fn = ncclResult_t (*)(void*, size_t, ncclDataType_t, int, ncclComm_t, void*);
    auto fn = Real<Fn>(p.send ? "ncclSend" : "ncclRecv", &missing);  // same ABI for const
    return fn ? fn(p.buffer, p.count, p.type, p.peer, real, p.stream) : ncclInternalError;
  };
}

}  // namespace

ncclResult_t SendRecv(bool send, void* buffer, size_t count, ncclDataType_t type, int peer,
                      ncclComm_t handle, void* stream) {
  Comm* comm = AsComm(handle);
  const PointToPoint p{send, static_cast<char*>(buffer), count, type, peer, comm, stream};
  if (group_depth == 0 || !comm || !comm->served)
    return Forward(send ? "ncclSend" : "ncclRecv", handle, RealSendRecv(p));
  // Recorded only (nothing allocated beyond the group's slot): GroupEnd
  // serves the group if it is an all-to-all, and forwards it if it is not.
  Pending pending;
  pending.forwarded = comm;
  pending.point_to_point = true;
  pending.p2p = p;
  group_calls.push_back(std::move(pending));
  return ncclSuccess;
}

ncclResult_t GroupStart() {
  group_depth++;
  return ncclSuccess;
}

ncclResult_t GroupEnd() {
  if (group_depth == 0)
    return Fail(nullptr, Status::InvalidArgument("jax_smddp NCCL front end: ncclGroupEnd without "
                                                 "ncclGroupStart"));
  if (--group_depth > 0) return ncclSuccess;
  std::vector<Pending> calls = std::move(group_calls);
  group_calls.clear();
  PointToPoint a2a;
  char* a2a_recv = nullptr;
  if (AllToAllOf(calls, &a2a, &a2a_recv)) {
    calls.clear();
    group_calls.swap(calls);  // the next group reuses the slots
    return Serve(Collective::kAllToAll, a2a.buffer, a2a_recv, a2a.count, MovedType(a2a.type),
                 ReduceOp::kSum, *a2a.comm, a2a.stream);
  }
  Permutation permutation;
  if (PermutationOf(calls, &permutation)) {
    calls.clear();
    group_calls.swap(calls);
    return ServePermutation(permutation);
  }
  for (Pending& c : calls) {
    if (!c.point_to_point) continue;
    const char* name = c.p2p.send ? "ncclSend" : "ncclRecv";
    c.run = [comm = c.p2p.comm, name, call = RealSendRecv(c.p2p)]() {
      const std::string why =
          "the GPU engine serves sends and receives only as a group that forms an all-to-all or "
          "(sends to one peer, receives from one, inside one host, not captured) a permutation";
      return NoFallback() ? RefuseForwarding(comm, name, why) : Forwarding(comm, name, why, call)();
    };
  }
  ncclResult_t first = ncclSuccess;
  auto keep = [&](ncclResult_t rc) {
    if (first == ncclSuccess) first = rc;
  };
  size_t next = 0;
  while (next < calls.size() && !calls[next].forwarded) keep(calls[next++].run());
  if (next < calls.size()) {
    // Every forwarded call, as one real group; its communicators' real
    // sides created first (NCCL defers creation inside a group).
    for (size_t i = next; i < calls.size(); ++i) {
      ncclComm_t real;
      if (calls[i].forwarded) RealComm(*calls[i].forwarded, &real);  // a failure is the call's
    }
    std::string why;
    using GroupFn = ncclResult_t (*)();
    auto start = Real<GroupFn>("ncclGroupStart", &why);
    auto end = Real<GroupFn>("ncclGroupEnd", &why);
    if (!start || !end) {
      keep(Fail(nullptr, Status::Error("jax_smddp NCCL front end: " + why)));
    } else {
      start();
      for (size_t i = next; i < calls.size(); ++i)
        if (calls[i].forwarded) keep(calls[i].run());
      keep(end());
    }
    for (size_t i = next; i < calls.size(); ++i)
      if (!calls[i].forwarded) keep(calls[i].run());
  }
  return first;
}

ncclResult_t GroupDrop() {
  if (group_depth > 0) group_depth--;
  if (group_depth == 0) group_calls.clear();
  return ncclSuccess;
}

}  // namespace nccl
}  // namespace smddp

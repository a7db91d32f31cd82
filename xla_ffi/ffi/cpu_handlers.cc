#include "xla_ffi/ffi/cpu_handlers.h"

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/algorithms/plan.h"
#include "xla_ffi/common/hashing.h"
#include "xla_ffi/common/heap_reuse.h"
#include "xla_ffi/common/huge_pages.h"
#include "xla_ffi/engine/communicator.h"
#include "xla_ffi/engine/last_failure.h"
#include "xla_ffi/ffi/call_counts.h"
#include "xla_ffi/ffi/ffi_dtype.h"
#include "xla_ffi/ffi/ffi_status.h"
#include "xla_ffi/ffi/invocation_counter.h"

namespace ffi = xla::ffi;

namespace smddp {

// State of one collective instruction, built once when XLA instantiates it
// and shared by every device that runs it: its instance number (the
// rendezvous key) and, per partition id, the communicator and rank, so the
// per-call path looks nothing up.
struct CallSite {
  static ffi::TypeId id;
  static ffi::TypeInfo info;
  struct Member {
    Communicator* comm = nullptr;
    int rank = -1;
    std::unique_ptr<InvocationCounter> calls;  // touched by this device only
  };
  int64_t instance = 0;
  uint64_t site = 0;  // names this instruction alike in every process
  std::vector<Member> by_partition;
  std::vector<int64_t> sources;        // collective_permute's, per rank (Plan::sources)
  std::shared_ptr<const World> world;  // where its calls are counted (call_counts.h)
};
ffi::TypeId CallSite::id = {};
ffi::TypeInfo CallSite::info = ffi::MakeTypeInfo<CallSite>();

namespace {

ffi::ErrorOr<std::unique_ptr<CallSite>> Instantiate(ffi::Dictionary attrs) {
  static std::atomic<int64_t> next{0};
  static std::mutex mu;
  static auto* copies = new std::map<int64_t, uint64_t>();
  auto groups = attrs.get<ffi::Span<const int64_t>>("groups");
  auto size = attrs.get<int64_t>("group_size");
  auto processes = attrs.get<ffi::Span<const int64_t>>("processes");
  auto site_uid = attrs.get<int64_t>("site_uid");
  if (!groups.has_value()) return ffi::Unexpected(groups.error());
  if (!size.has_value()) return ffi::Unexpected(size.error());
  if (!processes.has_value()) return ffi::Unexpected(processes.error());
  if (!site_uid.has_value()) return ffi::Unexpected(site_uid.error());
  const int64_t n = *size;
  if (n <= 0 || groups->size() % n != 0)
    return ffi::Unexpected(
        ToFfiError(Status::InvalidArgument("jax_smddp: malformed replica groups")));
  ApplyHeapReuse();  // before XLA allocates this program's outputs
  auto site = std::make_unique<CallSite>();
  site->instance = next++;
  {
    // XLA may inline one lowered sub-function twice: two instructions with
    // the same attributes. Every process compiles the same module and
    // instantiates its instructions in the same order, so the copy number
    // tells them apart alike everywhere.
    std::lock_guard<std::mutex> lock(mu);
    site->site = MixTag(uint64_t(*site_uid), (*copies)[*site_uid]++);
  }
  std::vector<int64_t> group_processes(n);
  for (size_t g = 0; g < groups->size(); g += n) {
    for (int64_t r = 0; r < n; ++r) {
      const int64_t id = (*groups)[g + r];
      group_processes[r] = id >= 0 && size_t(id) < processes->size() ? (*processes)[id] : 0;
    }
    Status error;
    Communicator* comm =
        FindOrCreateCommunicator(groups->begin() + g, group_processes.data(), int(n), &error);
    if (!comm) return ffi::Unexpected(ToFfiError(error));
    for (int64_t r = 0; r < n; ++r) {
      const int64_t id = (*groups)[g + r];
      if (id < 0)
        return ffi::Unexpected(
            ToFfiError(Status::InvalidArgument("jax_smddp: negative device id in replica groups")));
      if (size_t(id) >= site->by_partition.size()) site->by_partition.resize(id + 1);
      site->by_partition[id] =
          CallSite::Member{comm, int(r), std::make_unique<InvocationCounter>()};
    }
  }
  if (auto sources = attrs.get<ffi::Span<const int64_t>>("sources"); sources.has_value()) {
    if (int64_t(sources->size()) != n)
      return ffi::Unexpected(ToFfiError(
          Status::InvalidArgument("jax_smddp: a permutation's sources are not one per rank")));
    site->sources.assign(sources->begin(), sources->end());
  }
  site->world = CountingWorld();
  return site;
}

// How a call moves data across processes (chosen at lowering by
// jax_smddp.tuning): routes and chunk size.
Plan CrossProcessChoice(int64_t routing, int64_t chunk_bytes) {
  Plan plan;
  plan.routing = routing == 1   ? Plan::Routing::kFlat
                 : routing == 2 ? Plan::Routing::kHierarchical
                                : Plan::Routing::kAuto;
  plan.chunk_bytes = chunk_bytes > 0 ? (size_t(chunk_bytes) + 63) / 64 * 64 : 0;
  return plan;
}

// What every collective's handler knows of its call.
struct Common {
  const char* op;
  int64_t op_id;  // position in the module, for messages
  CallSite* site;
};

// A call that fails before it reaches the engine (recorded like the engine's).
ffi::Future Failed(const char* op, const Status& st) {
  RecordFailure(op, {}, -1, st);
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetError(ToFfiError(st));
  return future;
}

// Starts the call on this device's communicator (looked up by partition id
// in the instruction's state) and returns at once: the future completes when
// the collective is over for this device. Handlers never block an XLA thread
// waiting for peers that are not in the call (XLA may run independent
// collectives of one device at the same time; blocked handlers would exhaust
// its threads); a small call whose peers are all in it may end before this
// returns.
ffi::Future StartCall(const Common& c, int64_t run_id, uint32_t partition_id, ffi::AnyBuffer x,
                      ffi::Result<ffi::AnyBuffer>& out, Plan plan) {
  if (!ToDType(x.element_type(), &plan.dtype))
    return Failed(c.op, Status::Unsupported(std::string("jax_smddp ") + c.op +
                                            ": unsupported element type reached the engine"));
  const auto& members = c.site->by_partition;
  if (partition_id >= members.size() || members[partition_id].comm == nullptr)
    return Failed(
        c.op, Status::InvalidArgument(std::string("jax_smddp ") + c.op + ": device " +
                                      std::to_string(partition_id) + " is in no replica group"));
  const CallSite::Member& me = members[partition_id];
  AdviseHugePages(out->untyped_data(), out->size_bytes());  // before the first write
  CallInfo info{c.op, plan.dtype, plan.op, uint64_t(x.size_bytes()), uint64_t(out->size_bytes())};
  CountCustomCall(c.site->world.get(), plan.kind, info.recv_bytes);
  ffi::Promise promise;
  ffi::Future future(promise);
  uint64_t sequence;
  const uint64_t invocation = me.calls->Next(run_id, &sequence);
  me.comm->Start(run_id, c.site->instance, c.site->site, sequence, invocation, c.op_id, me.rank,
                 x.untyped_data(), out->untyped_data(), info, plan,
                 // One completion per call, as before: the failure record
                 // (jax_smddp.errors) rides in it rather than in a second wrapper.
                 [promise, op = c.op, member = &me](const Status& st) mutable {
                   if (st.ok()) {
                     promise.SetAvailable();
                   } else {
                     RecordFailure(op, member->comm->members(), member->rank, st);
                     promise.SetError(ToFfiError(st));
                   }
                 });
  return future;
}

// all_gather and all_to_all: blocks of `inner_bytes` in an [outer, ranks, inner] layout.
template <Collective kKind>
ffi::Future BlocksImpl(ffi::RunId run, CallSite* site, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> pid,
                       ffi::Result<ffi::AnyBuffer> out, int64_t op_id,
                       ffi::Span<const int64_t> /*groups*/, int64_t /*group_size*/,
                       ffi::Span<const int64_t> /*processes*/, int64_t /*site_uid*/,
                       int64_t routing, int64_t chunk_bytes, int64_t outer, int64_t inner_bytes) {
  Plan plan = CrossProcessChoice(routing, chunk_bytes);
  plan.kind = kKind;
  plan.outer = size_t(outer);
  plan.inner = size_t(inner_bytes);
  const char* op = CollectiveName(kKind);
  return StartCall(Common{op, op_id, site}, run.run_id, pid.typed_data()[0], x, out, plan);
}

ffi::Future ReduceScatterImpl(ffi::RunId run, CallSite* site, ffi::AnyBuffer x,
                              ffi::Buffer<ffi::U32> pid, ffi::Result<ffi::AnyBuffer> out,
                              int64_t op_id, ffi::Span<const int64_t> /*groups*/,
                              int64_t /*group_size*/, ffi::Span<const int64_t> /*processes*/,
                              int64_t /*site_uid*/, int64_t routing, int64_t chunk_bytes,
                              int64_t reduce, int64_t outer, int64_t inner) {
  Plan plan = CrossProcessChoice(routing, chunk_bytes);
  plan.kind = Collective::kReduceScatter;
  plan.op = ReduceOp(reduce);
  plan.outer = size_t(outer);
  plan.inner = size_t(inner);
  return StartCall(Common{CollectiveName(plan.kind), op_id, site}, run.run_id, pid.typed_data()[0],
                   x, out, plan);
}

ffi::Future AllReduceImpl(ffi::RunId run, CallSite* site, ffi::AnyBuffer x,
                          ffi::Buffer<ffi::U32> pid, ffi::Result<ffi::AnyBuffer> out, int64_t op_id,
                          ffi::Span<const int64_t> /*groups*/, int64_t /*group_size*/,
                          ffi::Span<const int64_t> /*processes*/, int64_t /*site_uid*/,
                          int64_t routing, int64_t chunk_bytes, int64_t reduce) {
  Plan plan = CrossProcessChoice(routing, chunk_bytes);
  plan.kind = Collective::kAllReduce;
  plan.op = ReduceOp(reduce);
  plan.count = x.element_count();
  return StartCall(Common{CollectiveName(plan.kind), op_id, site}, run.run_id, pid.typed_data()[0],
                   x, out, plan);
}

// collective_permute: `inner_bytes` from rank sources[r] to each rank r (the
// sources are read at instantiation, into the call site).
ffi::Future CollectivePermuteImpl(ffi::RunId run, CallSite* site, ffi::AnyBuffer x,
                                  ffi::Buffer<ffi::U32> pid, ffi::Result<ffi::AnyBuffer> out,
                                  int64_t op_id, ffi::Span<const int64_t> /*groups*/,
                                  int64_t /*group_size*/, ffi::Span<const int64_t> /*processes*/,
                                  int64_t /*site_uid*/, int64_t routing, int64_t chunk_bytes,
                                  ffi::Span<const int64_t> /*sources*/, int64_t inner_bytes) {
  Plan plan = CrossProcessChoice(routing, chunk_bytes);
  plan.kind = Collective::kCollectivePermute;
  plan.inner = size_t(inner_bytes);
  plan.sources = site->sources.empty() ? nullptr : site->sources.data();
  return StartCall(Common{CollectiveName(plan.kind), op_id, site}, run.run_id, pid.typed_data()[0],
                   x, out, plan);
}

}  // namespace
}  // namespace smddp

#define SMDDP_COMMON_BINDING()                                                 \
  ffi::Ffi::Bind()                                                             \
      .Ctx<ffi::RunId>()                                                       \
      .Ctx<ffi::State<smddp::CallSite>>()                                      \
      .Arg<ffi::AnyBuffer>()                                                   \
      .Arg<ffi::Buffer<ffi::U32>>()                                            \
      .Ret<ffi::AnyBuffer>()                                                   \
      .Attr<int64_t>("op_id")                                                  \
      .Attr<ffi::Span<const int64_t>>("groups") /* read at instantiation */    \
      .Attr<int64_t>("group_size")                                             \
      .Attr<ffi::Span<const int64_t>>("processes") /* read at instantiation */ \
      .Attr<int64_t>("site_uid")                                               \
      .Attr<int64_t>("routing")                                                \
      .Attr<int64_t>("chunk_bytes")

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SmddpAllGatherCpu, smddp::BlocksImpl<smddp::Collective::kAllGather>,
    SMDDP_COMMON_BINDING().Attr<int64_t>("outer").Attr<int64_t>("inner_bytes"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SmddpReduceScatterCpu, smddp::ReduceScatterImpl,
    SMDDP_COMMON_BINDING().Attr<int64_t>("reduce").Attr<int64_t>("outer").Attr<int64_t>("inner"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SmddpAllReduceCpu, smddp::AllReduceImpl,
                              SMDDP_COMMON_BINDING().Attr<int64_t>("reduce"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SmddpAllToAllCpu, smddp::BlocksImpl<smddp::Collective::kAllToAll>,
    SMDDP_COMMON_BINDING().Attr<int64_t>("outer").Attr<int64_t>("inner_bytes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SmddpCollectivePermuteCpu, smddp::CollectivePermuteImpl,
    SMDDP_COMMON_BINDING().Attr<ffi::Span<const int64_t>>("sources").Attr<int64_t>("inner_bytes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SmddpInstantiateCpu, smddp::Instantiate,
                              ffi::Ffi::BindInstantiate().Attrs());

extern "C" XLA_FFI_TypeId* SmddpCallSiteTypeId() { return &smddp::CallSite::id; }
extern "C" const XLA_FFI_TypeInfo* SmddpCallSiteTypeInfo() { return &smddp::CallSite::info; }

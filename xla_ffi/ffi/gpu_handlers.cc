#include "xla_ffi/ffi/gpu_handlers.h"

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "cuda/cuda_stream_ops.h"
#include "cuda/gpu_call.h"
#include "cuda/gpu_communicator.h"
#include "cuda/gpu_hierarchy.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/algorithms/net_port.h"
#include "xla_ffi/algorithms/stream_algorithms.h"
#include "xla_ffi/engine/last_failure.h"
#include "xla_ffi/ffi/call_counts.h"
#include "xla_ffi/ffi/ffi_dtype.h"
#include "xla_ffi/ffi/ffi_status.h"

namespace ffi = xla::ffi;

namespace smddp {

struct GpuCallSite {
  static ffi::TypeId id;
  static ffi::TypeInfo info;
  struct Member {
    gpu::LocalRank* rank = nullptr;  // in the (intra-host) communicator
    NetPort* port = nullptr;         // groups across hosts: the network side
    const std::vector<int>* rank_of = nullptr;
  };
  std::vector<Member> by_ordinal;      // this process's rank on each device
  std::shared_ptr<const World> world;  // where its calls are counted (call_counts.h)
};
ffi::TypeId GpuCallSite::id = {};
ffi::TypeInfo GpuCallSite::info = ffi::MakeTypeInfo<GpuCallSite>();

namespace {

Status InvalidStatus(const std::string& message) {
  return Status::InvalidArgument("jax_smddp (GPU): " + message);
}

ffi::Error Invalid(const std::string& message) { return ToFfiError(InvalidStatus(message)); }

ffi::ErrorOr<std::unique_ptr<GpuCallSite>> Instantiate(ffi::Dictionary attrs) {
  auto groups = attrs.get<ffi::Span<const int64_t>>("groups");
  auto size = attrs.get<int64_t>("group_size");
  auto processes = attrs.get<ffi::Span<const int64_t>>("processes");
  auto ordinals = attrs.get<ffi::Span<const int64_t>>("ordinals");
  if (!groups.has_value()) return ffi::Unexpected(groups.error());
  if (!size.has_value()) return ffi::Unexpected(size.error());
  if (!processes.has_value()) return ffi::Unexpected(processes.error());
  if (!ordinals.has_value()) return ffi::Unexpected(ordinals.error());
  const int64_t n = *size;
  if (n <= 0 || groups->size() % n != 0)
    return ffi::Unexpected(Invalid("malformed replica groups"));
  auto site = std::make_unique<GpuCallSite>();
  const int me = gpu::ProcessIndex();
  for (size_t g = 0; g < groups->size(); g += n) {
    std::vector<int64_t> members(groups->begin() + g, groups->begin() + g + n);
    const uint64_t key = gpu::GroupKey(members.data(), int(n));
    gpu::GpuCommunicator* comm = nullptr;
    gpu::GpuHierarchy* hierarchy = gpu::FindHierarchy(key);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t id = members[r];
      if (id < 0 || size_t(id) >= processes->size() || size_t(id) >= ordinals->size())
        return ffi::Unexpected(Invalid("device id out of range in replica groups"));
      if ((*processes)[id] != me) continue;
      const int64_t ordinal = (*ordinals)[id];
      if (size_t(ordinal) >= site->by_ordinal.size()) site->by_ordinal.resize(ordinal + 1);
      if (hierarchy) {
        gpu::GpuHierarchy::Member* m = hierarchy->Find(int(r));
        if (!m || m->local->ordinal != ordinal)
          return ffi::Unexpected(
              Invalid("device " + std::to_string(ordinal) + " has no prepared rank in its group"));
        site->by_ordinal[ordinal] = GpuCallSite::Member{m->local, m->port, &hierarchy->rank_of()};
        continue;
      }
      if (!comm) comm = gpu::FindCommunicator(key);
      if (!comm)
        return ffi::Unexpected(ToFfiError(Status::InvalidArgument(
            "jax_smddp (GPU): the communicator of this collective was never set up in this "
            "process; jax_smddp sets it up when it lowers the program for local GPUs (do not "
            "run programs lowered or exported elsewhere)")));
      gpu::LocalRank* rank = comm->Local(int(r));
      if (!rank || rank->ordinal != ordinal)
        return ffi::Unexpected(
            Invalid("device " + std::to_string(ordinal) + " has no prepared rank in its group"));
      site->by_ordinal[ordinal] = GpuCallSite::Member{rank, nullptr, nullptr};
    }
  }
  site->world = CountingWorld();  // a one-process job's calls count too
  return site;
}

const cuda::GpuSettings& Settings() {
  static const cuda::GpuSettings settings = cuda::GpuSettings::FromEnvironment();
  return settings;
}

// Enqueues the call on `stream` and returns. A failure keeps the engine's
// code, with the op in front of its message.
Status EnqueueCall(const char* op, int64_t op_id, cudaStream_t stream, int32_t ordinal,
                   GpuCallSite* site, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer>& out,
                   Plan plan) {
  if (!ToDType(x.element_type(), &plan.dtype))
    return Status::Unsupported("jax_smddp (GPU): " + std::string(op) +
                               ": unsupported element type reached the engine");
  if (ordinal < 0 || size_t(ordinal) >= site->by_ordinal.size() || !site->by_ordinal[ordinal].rank)
    return InvalidStatus(std::string(op) + " (op " + std::to_string(op_id) + "): device " +
                         std::to_string(ordinal) + " is in no replica group of this process");
  const auto start = std::chrono::steady_clock::now();
  const GpuCallSite::Member& me = site->by_ordinal[ordinal];
  cuda::CudaStreamOps ops(stream, Settings());
  // XLA captures the call into its command buffer (a CUDA graph) only where
  // JAX_SMDDP_GPU_GRAPHS=1 said it may (jax_smddp/_native.py registers them so).
  const Status st =
      gpu::EnqueueCollective(op, op_id, gpu::CallRank{me.rank, me.port, me.rank_of}, ops,
                             x.untyped_data(), out->untyped_data(), plan, ops.capturing());
  cuda::GpuCounters& counters = cuda::Counters();
  // Read in place: by addresses the host exchanged, or by the device exchange.
  if (st.ok() && !me.port && (!me.rank->view.inputs.empty() || me.rank->view.device.active))
    counters.direct_reads++;
  counters.handler_calls++;
  counters.handler_ns += uint64_t(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count());
  return st;
}

// Enqueues the call; a failure is recorded (jax_smddp.errors.last_failure)
// and handed to XLA with its code.
ffi::Error Enqueue(const char* op, int64_t op_id, cudaStream_t stream, int32_t ordinal,
                   GpuCallSite* site, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer>& out,
                   Plan plan) {
  const Status st = EnqueueCall(op, op_id, stream, ordinal, site, x, out, plan);
  if (st.ok()) {
    CountCustomCall(site->world.get(), plan.kind, out->size_bytes());
    return ffi::Error::Success();
  }
  RecordFailure(op, {}, -1, st);  // the GPU group's device ids are not at hand here
  return ToFfiError(st);
}

// Group attributes are read at instantiation; the execute stage ignores them.
using Ids = ffi::Span<const int64_t>;

// all_gather and all_to_all: blocks of `inner_bytes` in an [outer, ranks, inner] layout.
template <Collective kKind>
ffi::Error BlocksImpl(cudaStream_t stream, int32_t ordinal, GpuCallSite* site, ffi::AnyBuffer x,
                      ffi::Result<ffi::AnyBuffer> out, int64_t op_id, Ids /*groups*/,
                      int64_t /*group_size*/, Ids /*processes*/, Ids /*ordinals*/, int64_t outer,
                      int64_t inner_bytes) {
  Plan plan;
  plan.kind = kKind;
  plan.outer = size_t(outer);
  plan.inner = size_t(inner_bytes);
  return Enqueue(CollectiveName(kKind), op_id, stream, ordinal, site, x, out, plan);
}

ffi::Error ReduceScatterImpl(cudaStream_t stream, int32_t ordinal, GpuCallSite* site,
                             ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out, int64_t op_id,
                             Ids /*groups*/, int64_t /*group_size*/, Ids /*processes*/,
                             Ids /*ordinals*/, int64_t reduce, int64_t outer, int64_t inner) {
  Plan plan;
  plan.kind = Collective::kReduceScatter;
  plan.op = ReduceOp(reduce);
  plan.outer = size_t(outer);
  plan.inner = size_t(inner);
  return Enqueue(CollectiveName(plan.kind), op_id, stream, ordinal, site, x, out, plan);
}

ffi::Error AllReduceImpl(cudaStream_t stream, int32_t ordinal, GpuCallSite* site, ffi::AnyBuffer x,
                         ffi::Result<ffi::AnyBuffer> out, int64_t op_id, Ids /*groups*/,
                         int64_t /*group_size*/, Ids /*processes*/, Ids /*ordinals*/,
                         int64_t reduce) {
  Plan plan;
  plan.kind = Collective::kAllReduce;
  plan.op = ReduceOp(reduce);
  plan.count = x.element_count();
  return Enqueue(CollectiveName(plan.kind), op_id, stream, ordinal, site, x, out, plan);
}

// collective_permute: `inner_bytes` from rank sources[r] to each rank r. The
// call only enqueues: the attribute's memory outlives it.
ffi::Error CollectivePermuteImpl(cudaStream_t stream, int32_t ordinal, GpuCallSite* site,
                                 ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out, int64_t op_id,
                                 Ids /*groups*/, int64_t /*group_size*/, Ids /*processes*/,
                                 Ids /*ordinals*/, Ids sources, int64_t inner_bytes) {
  Plan plan;
  plan.kind = Collective::kCollectivePermute;
  plan.inner = size_t(inner_bytes);
  plan.sources = sources.begin();
  return Enqueue(CollectiveName(plan.kind), op_id, stream, ordinal, site, x, out, plan);
}

}  // namespace
}  // namespace smddp

// groups/processes/ordinals are read at instantiation; bound here so the
// execute stage accepts them.
#define SMDDP_GPU_BINDING()                        \
  ffi::Ffi::Bind()                                 \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()    \
      .Ctx<ffi::DeviceOrdinal>()                   \
      .Ctx<ffi::State<smddp::GpuCallSite>>()       \
      .Arg<ffi::AnyBuffer>()                       \
      .Ret<ffi::AnyBuffer>()                       \
      .Attr<int64_t>("op_id")                      \
      .Attr<ffi::Span<const int64_t>>("groups")    \
      .Attr<int64_t>("group_size")                 \
      .Attr<ffi::Span<const int64_t>>("processes") \
      .Attr<ffi::Span<const int64_t>>("ordinals")

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SmddpAllGatherCuda, smddp::BlocksImpl<smddp::Collective::kAllGather>,
    SMDDP_GPU_BINDING().Attr<int64_t>("outer").Attr<int64_t>("inner_bytes"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SmddpReduceScatterCuda, smddp::ReduceScatterImpl,
    SMDDP_GPU_BINDING().Attr<int64_t>("reduce").Attr<int64_t>("outer").Attr<int64_t>("inner"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SmddpAllReduceCuda, smddp::AllReduceImpl,
                              SMDDP_GPU_BINDING().Attr<int64_t>("reduce"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SmddpAllToAllCuda, smddp::BlocksImpl<smddp::Collective::kAllToAll>,
    SMDDP_GPU_BINDING().Attr<int64_t>("outer").Attr<int64_t>("inner_bytes"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SmddpCollectivePermuteCuda, smddp::CollectivePermuteImpl,
    SMDDP_GPU_BINDING().Attr<ffi::Span<const int64_t>>("sources").Attr<int64_t>("inner_bytes"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SmddpInstantiateCuda, smddp::Instantiate,
                              ffi::Ffi::BindInstantiate().Attrs());

extern "C" XLA_FFI_TypeId* SmddpGpuCallSiteTypeId() { return &smddp::GpuCallSite::id; }
extern "C" const XLA_FFI_TypeInfo* SmddpGpuCallSiteTypeInfo() { return &smddp::GpuCallSite::info; }

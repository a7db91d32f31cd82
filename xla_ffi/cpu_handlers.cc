#include "xla_ffi/cpu_handlers.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/engine/algorithms.h"
#include "xla_ffi/engine/communicator.h"

namespace ffi = xla::ffi;

namespace smddp {

struct CallSite {
  static ffi::TypeId id;
  static ffi::TypeInfo info;
  int64_t instance;
};
ffi::TypeId CallSite::id = {};
ffi::TypeInfo CallSite::info = ffi::MakeTypeInfo<CallSite>();

namespace {

ffi::ErrorOr<std::unique_ptr<CallSite>> Instantiate() {
  static std::atomic<int64_t> next{0};
  return std::make_unique<CallSite>(CallSite{next++});
}

bool ToDType(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::PRED: *out = DType::kBool; return true;
    case ffi::DataType::S8: *out = DType::kInt8; return true;
    case ffi::DataType::U8: *out = DType::kUInt8; return true;
    case ffi::DataType::S32: *out = DType::kInt32; return true;
    case ffi::DataType::U32: *out = DType::kUInt32; return true;
    case ffi::DataType::S64: *out = DType::kInt64; return true;
    case ffi::DataType::F16: *out = DType::kFloat16; return true;
    case ffi::DataType::BF16: *out = DType::kBFloat16; return true;
    case ffi::DataType::F32: *out = DType::kFloat32; return true;
    case ffi::DataType::F64: *out = DType::kFloat64; return true;
    default: return false;
  }
}

ffi::Error ToFfi(const Status& st) {
  if (st.ok()) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal, st.message());
}

// The attributes every collective carries, and the call they describe.
struct Common {
  const char* op;
  int64_t op_id;      // position in the module, for messages
  int64_t instance;   // which instruction: the rendezvous key
  ffi::Span<const int64_t> groups;  // replica groups, row-major
  int64_t group_size;
};

// Runs the call: finds this device's group (the row of `groups` holding its
// partition id), the communicator for it and this device's rank in it, and
// runs `algorithm` (a body: Status(Exchange&, DType)) through it.
template <typename Algorithm>
ffi::Error RunCall(const Common& c, int64_t run_id, uint32_t partition_id, ffi::AnyBuffer x,
                   ffi::Result<ffi::AnyBuffer>& out, ReduceOp reduce, Algorithm algorithm) {
  DType dtype;
  if (!ToDType(x.element_type(), &dtype))
    return ffi::Error::InvalidArgument(std::string("jax_smddp ") + c.op +
                                       ": unsupported element type reached the engine");
  const int64_t n = c.group_size;
  if (n <= 0 || c.groups.size() % n != 0)
    return ffi::Error::InvalidArgument(std::string("jax_smddp ") + c.op + ": malformed replica groups");
  for (size_t g = 0; g < c.groups.size(); g += n) {
    for (int64_t r = 0; r < n; ++r) {
      if (c.groups[g + r] != int64_t(partition_id)) continue;
      Communicator* comm = FindOrCreateCommunicator(c.groups.begin() + g, int(n));
      CallInfo info{c.op, dtype, reduce, uint64_t(x.size_bytes()), uint64_t(out->size_bytes())};
      auto body = [&](Exchange& ex) { return algorithm(ex, dtype); };
      return ToFfi(comm->Run(run_id, c.instance, c.op_id, int(r), x.untyped_data(),
                             out->untyped_data(), info, body));
    }
  }
  return ffi::Error::InvalidArgument(std::string("jax_smddp ") + c.op + ": device " +
                                     std::to_string(partition_id) + " is in no replica group");
}

ffi::Error AllGatherImpl(ffi::RunId run, CallSite* site, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> pid,
                         ffi::Result<ffi::AnyBuffer> out, int64_t op_id,
                         ffi::Span<const int64_t> groups, int64_t group_size,
                         int64_t outer, int64_t inner_bytes) {
  Common c{"all_gather", op_id, site->instance, groups, group_size};
  return RunCall(c, run.run_id, pid.typed_data()[0], x, out, ReduceOp::kSum,
                 [&](Exchange& ex, DType) { return AllGather(ex, size_t(outer), size_t(inner_bytes)); });
}

ffi::Error ReduceScatterImpl(ffi::RunId run, CallSite* site, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> pid,
                             ffi::Result<ffi::AnyBuffer> out, int64_t op_id,
                             ffi::Span<const int64_t> groups, int64_t group_size,
                             int64_t reduce, int64_t outer, int64_t inner) {
  Common c{"reduce_scatter", op_id, site->instance, groups, group_size};
  const ReduceOp op = ReduceOp(reduce);
  return RunCall(c, run.run_id, pid.typed_data()[0], x, out, op, [&](Exchange& ex, DType dtype) {
    return ReduceScatter(ex, dtype, op, size_t(outer), size_t(inner));
  });
}

ffi::Error AllReduceImpl(ffi::RunId run, CallSite* site, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> pid,
                         ffi::Result<ffi::AnyBuffer> out, int64_t op_id,
                         ffi::Span<const int64_t> groups, int64_t group_size, int64_t reduce) {
  Common c{"all_reduce", op_id, site->instance, groups, group_size};
  const ReduceOp op = ReduceOp(reduce);
  const size_t count = x.element_count();
  return RunCall(c, run.run_id, pid.typed_data()[0], x, out, op, [&](Exchange& ex, DType dtype) {
    return AllReduce(ex, dtype, op, count);
  });
}

ffi::Error AllToAllImpl(ffi::RunId run, CallSite* site, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> pid,
                        ffi::Result<ffi::AnyBuffer> out, int64_t op_id,
                        ffi::Span<const int64_t> groups, int64_t group_size,
                        int64_t outer, int64_t inner_bytes) {
  Common c{"all_to_all", op_id, site->instance, groups, group_size};
  return RunCall(c, run.run_id, pid.typed_data()[0], x, out, ReduceOp::kSum,
                 [&](Exchange& ex, DType) { return AllToAll(ex, size_t(outer), size_t(inner_bytes)); });
}

}  // namespace
}  // namespace smddp

#define SMDDP_COMMON_BINDING()                 \
  ffi::Ffi::Bind()                             \
      .Ctx<ffi::RunId>()                       \
      .Ctx<ffi::State<smddp::CallSite>>()      \
      .Arg<ffi::AnyBuffer>()                   \
      .Arg<ffi::Buffer<ffi::U32>>()            \
      .Ret<ffi::AnyBuffer>()                   \
      .Attr<int64_t>("op_id")                  \
      .Attr<ffi::Span<const int64_t>>("groups") \
      .Attr<int64_t>("group_size")

XLA_FFI_DEFINE_HANDLER_SYMBOL(SmddpAllGatherCpu, smddp::AllGatherImpl,
                              SMDDP_COMMON_BINDING()
                                  .Attr<int64_t>("outer")
                                  .Attr<int64_t>("inner_bytes"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SmddpReduceScatterCpu, smddp::ReduceScatterImpl,
                              SMDDP_COMMON_BINDING()
                                  .Attr<int64_t>("reduce")
                                  .Attr<int64_t>("outer")
                                  .Attr<int64_t>("inner"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SmddpAllReduceCpu, smddp::AllReduceImpl,
                              SMDDP_COMMON_BINDING().Attr<int64_t>("reduce"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SmddpAllToAllCpu, smddp::AllToAllImpl,
                              SMDDP_COMMON_BINDING()
                                  .Attr<int64_t>("outer")
                                  .Attr<int64_t>("inner_bytes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SmddpInstantiateCpu, smddp::Instantiate, ffi::Ffi::BindInstantiate());

extern "C" XLA_FFI_TypeId* SmddpCallSiteTypeId() { return &smddp::CallSite::id; }
extern "C" const XLA_FFI_TypeInfo* SmddpCallSiteTypeInfo() { return &smddp::CallSite::info; }

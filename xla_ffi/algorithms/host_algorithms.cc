#include "xla_ffi/algorithms/host_algorithms.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "xla_ffi/algorithms/reduce.h"

namespace smddp {

namespace {

// Elements reduced per step when peers' data must be staged locally.
constexpr size_t kStageBytes = 256 * 1024;

// Reads `bytes` of every rank's send buffer at `offset` (per rank) and
// reduces them into `dst`: in place when the transport can address the
// peer's memory, through a staging buffer otherwise.
class PeerReader {
 public:
  PeerReader(Exchange& ex, DType dtype, ReduceOp op)
      : ex_(ex), dtype_(dtype), op_(op), esize_(ElementSize(dtype)), srcs_(ex.size()) {
    for (int p = 0; p < ex.size(); ++p) direct_ &= ex.PeerSend(p) != nullptr;
  }

  Status ReduceAt(size_t offset_bytes, void* dst, size_t count) {
    const int n = ex_.size();
    if (direct_) {
      for (int p = 0; p < n; ++p)
        srcs_[p] = static_cast<const char*>(ex_.PeerSend(p)) + offset_bytes;
      Reduce(dtype_, op_, srcs_.data(), n, dst, count);
      return Status::Ok();
    }
    const size_t step = std::max<size_t>(1, kStageBytes / esize_);
    if (stage_.empty()) stage_.resize(size_t(n) * step * esize_);
    for (size_t done = 0; done < count; done += step) {
      const size_t m = std::min(step, count - done);
      for (int p = 0; p < n; ++p) {
        char* s = stage_.data() + size_t(p) * step * esize_;
        SMDDP_RETURN_IF_ERROR(ex_.Get(p, offset_bytes + done * esize_, s, m * esize_));
        srcs_[p] = s;
      }
      Reduce(dtype_, op_, srcs_.data(), n, static_cast<char*>(dst) + done * esize_, m);
    }
    return Status::Ok();
  }

 private:
  Exchange& ex_;
  DType dtype_;
  ReduceOp op_;
  size_t esize_;
  bool direct_ = true;
  std::vector<const void*> srcs_;
  std::vector<char> stage_;
};

}  // namespace

Status AllGather(Exchange& ex, size_t outer, size_t inner_bytes) {
  const int n = ex.size();
  char* out = static_cast<char*>(ex.Recv());
  // Fill the output front to back: its pages are often fresh, and the
  // kernel serves sequential first touches fastest.
  for (size_t o = 0; o < outer; ++o) {
    for (int p = 0; p < n; ++p) {
      SMDDP_RETURN_IF_ERROR(
          ex.Get(p, o * inner_bytes, out + (o * n + p) * inner_bytes, inner_bytes));
    }
  }
  return Status::Ok();
}

Status ReduceScatter(Exchange& ex, DType dtype, ReduceOp op, size_t outer, size_t inner) {
  const size_t n = ex.size(), r = ex.rank(), esize = ElementSize(dtype);
  PeerReader reader(ex, dtype, op);
  char* out = static_cast<char*>(ex.Recv());
  for (size_t o = 0; o < outer; ++o) {
    SMDDP_RETURN_IF_ERROR(
        reader.ReduceAt((o * n + r) * inner * esize, out + o * inner * esize, inner));
  }
  return Status::Ok();
}

Status AllReduce(Exchange& ex, DType dtype, ReduceOp op, size_t count) {
  const size_t n = ex.size(), r = ex.rank(), esize = ElementSize(dtype);
  const size_t begin = count * r / n, end = count * (r + 1) / n;
  const size_t offset = begin * esize, bytes = (end - begin) * esize;
  char* mine = static_cast<char*>(ex.Recv()) + offset;
  PeerReader reader(ex, dtype, op);
  SMDDP_RETURN_IF_ERROR(reader.ReduceAt(offset, mine, end - begin));
  for (size_t i = 1; i < n; ++i) {
    SMDDP_RETURN_IF_ERROR(ex.Put(int((r + i) % n), offset, mine, bytes));
  }
  return Status::Ok();
}

Status AllToAll(Exchange& ex, size_t outer, size_t inner_bytes) {
  const size_t n = ex.size(), r = ex.rank();
  char* out = static_cast<char*>(ex.Recv());
  for (size_t i = 0; i < n; ++i) {
    const size_t p = (r + i) % n;
    for (size_t o = 0; o < outer; ++o) {
      SMDDP_RETURN_IF_ERROR(
          ex.Get(int(p), (o * n + r) * inner_bytes, out + (o * n + p) * inner_bytes, inner_bytes));
    }
  }
  return Status::Ok();
}

Status CollectivePermute(Exchange& ex, const int64_t* sources, size_t bytes) {
  if (!sources) return Status::Error("jax_smddp: collective_permute without its permutation");
  const int64_t s = sources[ex.rank()];
  if (s < 0) {
    if (bytes) std::memset(ex.Recv(), 0, bytes);
    return Status::Ok();
  }
  return ex.Get(int(s), 0, ex.Recv(), bytes);
}

Status RunHostPlan(const Plan& plan, Exchange& ex) {
  switch (plan.kind) {
    case Collective::kAllGather:
      return AllGather(ex, plan.outer, plan.inner);
    case Collective::kReduceScatter:
      return ReduceScatter(ex, plan.dtype, plan.op, plan.outer, plan.inner);
    case Collective::kAllReduce:
      return AllReduce(ex, plan.dtype, plan.op, plan.count);
    case Collective::kAllToAll:
      return AllToAll(ex, plan.outer, plan.inner);
    case Collective::kCollectivePermute:
      return CollectivePermute(ex, plan.sources, plan.outer * plan.inner);
  }
  return Status::Error("jax_smddp: unknown collective plan");
}

}  // namespace smddp

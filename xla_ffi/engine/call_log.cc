#include "xla_ffi/engine/call_log.h"

#include <algorithm>
#include <cstring>

namespace smddp {
namespace {

// An entry's words after the stamp: what every rank must agree on.
struct Fields {
  uint64_t w[7] = {};
};

Fields Make(const char* op, const Plan& p) {
  Fields f;
  f.w[0] = uint64_t(p.kind) | uint64_t(p.dtype) << 8 | uint64_t(p.op) << 16;
  f.w[1] = p.outer;
  f.w[2] = p.inner;
  f.w[3] = p.count;
  char name[24] = {};
  std::strncpy(name, op, sizeof(name) - 1);
  std::memcpy(&f.w[4], name, 24);
  return f;
}

std::string DescribeFields(const Fields& f) {
  char name[25] = {};
  std::memcpy(name, &f.w[4], 24);
  const auto kind = Collective(f.w[0] & 0xff);
  const auto dtype = DType((f.w[0] >> 8) & 0xff);
  const auto op = ReduceOp((f.w[0] >> 16) & 0xff);
  // Plain strings, not a stream: the text is built inside XLA's execution of
  // the call, where a stream's locale facets crashed the CUDA module (seen on
  // an H100 with jax 0.11.2; the same code runs on CPU).
  auto text = [](const char* s) { return std::string(s ? s : "?"); };
  std::string out = std::string(name) + " of " + text(DTypeName(dtype)) + " (";
  const PlanSize size = int(kind) < kCollectives ? SpecOf(kind).plan_size : PlanSize::kByteBlocks;
  if (size == PlanSize::kElements) {
    out += std::to_string(f.w[3]) + " elements";
  } else {
    out += std::to_string(f.w[1]) + " x " + std::to_string(f.w[2]) +
           (size == PlanSize::kElementBlocks ? " elements per rank out" : " bytes per rank");
  }
  if (int(kind) < kCollectives && Reduces(kind)) out += ", " + text(ReduceOpName(op));
  return out + ")";
}

// Reads entry `e` like a seqlock (its owner may be rewriting it for a later
// call): true with its fields if it holds call `call`.
bool ReadEntry(const CallLog::Entry* e, uint64_t call, Fields* out) {
  if (e->w[0].load(std::memory_order_seq_cst) != call + 1) return false;
  for (int k = 0; k < 7; ++k) out->w[k] = e->w[k + 1].load(std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_acquire);
  return e->w[0].load(std::memory_order_relaxed) == call + 1;
}

}  // namespace

uint64_t CallLog::Calls(const uint8_t* ring) {
  const auto* e = reinterpret_cast<const CallLog::Entry*>(ring);
  uint64_t calls = 0;
  for (size_t i = 0; i < kEntries; ++i)
    calls = std::max(calls, e[i].w[0].load(std::memory_order_acquire));
  return calls;
}

std::string CallLog::Describe(const uint8_t* ring, uint64_t call) {
  Fields f;
  const auto* e = reinterpret_cast<const CallLog::Entry*>(ring) + call % kEntries;
  return ReadEntry(e, call, &f) ? DescribeFields(f) : "";
}

Status CallLog::RecordAndCheck(const std::vector<uint8_t*>& rings, int rank, uint64_t call,
                               const char* op, const Plan& plan,
                               const std::function<std::string(int)>& who) {
  const size_t slot = size_t(call % kEntries);
  const Fields mine = Make(op, plan);
  auto* own = reinterpret_cast<CallLog::Entry*>(rings[rank]) + slot;
  own->w[0].store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  for (int k = 0; k < 7; ++k) own->w[k + 1].store(mine.w[k], std::memory_order_relaxed);
  own->w[0].store(call + 1, std::memory_order_seq_cst);
  for (int q = 0; q < int(rings.size()); ++q) {
    if (q == rank || !rings[q]) continue;
    Fields theirs;
    if (!ReadEntry(reinterpret_cast<CallLog::Entry*>(rings[q]) + slot, call, &theirs)) continue;
    if (std::memcmp(&theirs, &mine, sizeof(Fields)) != 0) {
      Status st = Status::Mismatch("processes disagree on call #" + std::to_string(call) +
                                   " of the group: " + who(rank) + " runs " + DescribeFields(mine) +
                                   " but " + who(q) + " runs " + DescribeFields(theirs) +
                                   ". Every process must run the same collectives on "
                                   "a group, with the same shapes, in the same order.");
      return st.SetPeers({q}, {});
    }
  }
  return Status::Ok();
}

}  // namespace smddp

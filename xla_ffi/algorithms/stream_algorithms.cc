#include "xla_ffi/algorithms/stream_algorithms.h"

#include <algorithm>
#include <cstdint>

#include "xla_ffi/algorithms/stream_steps.h"

namespace smddp {

RegionLayout::RegionLayout(int size_, size_t slot_bytes_) : size(size_) {
  slot_bytes = std::max<size_t>((slot_bytes_ + 255) / 256 * 256, 256);
  mailbox_base = (flag_bytes() + 63) / 64 * 64;
  slots_offset = (resolved_offset() + 2 * size_t(size) * 8 + 4095) / 4096 * 4096;
  total_bytes = slots_offset + kSlots * slot_bytes;
}

std::vector<uint32_t*> AllFlags(const RegionLayout& layout, const std::vector<uint8_t*>& blocks) {
  std::vector<uint32_t*> flags;
  for (uint8_t* block : blocks) {
    if (!block) continue;
    flags.push_back(reinterpret_cast<uint32_t*>(block + layout.posted_offset()));
    for (int q = 0; q < layout.size; ++q)
      flags.push_back(reinterpret_cast<uint32_t*>(block + layout.consumed_offset(q)));
  }
  return flags;
}

std::vector<uint32_t*> AllTokens(const RegionLayout& layout, const std::vector<uint8_t*>& blocks) {
  std::vector<uint32_t*> tokens;
  for (uint8_t* block : blocks) {
    if (!block) continue;
    for (int slot = 0; slot < RegionLayout::kSlots; ++slot) {
      for (int q = 0; q < layout.size; ++q) {
        tokens.push_back(reinterpret_cast<uint32_t*>(block + layout.posted_token_offset(slot, q)));
        tokens.push_back(
            reinterpret_cast<uint32_t*>(block + layout.consumed_token_offset(slot, q)));
      }
    }
    for (int q = 0; q < layout.size; ++q) {
      tokens.push_back(reinterpret_cast<uint32_t*>(block + layout.pair_posted_offset(q)));
      tokens.push_back(reinterpret_cast<uint32_t*>(block + layout.pair_consumed_offset(q)));
    }
  }
  return tokens;
}

bool DirectReadsNeedOutputs(Collective kind) { return kind == Collective::kAllReduce; }

Status ReleaseEveryoneWaitingOn(const StreamRank& me, StreamOps& ops) {
  const RegionLayout& layout = me.layout;
  auto block = [&](int q) { return me.flags.empty() ? me.regions[q] : me.flags[q]; };
  const uint32_t released = ReleasedFlag(me.step);
  SMDDP_RETURN_IF_ERROR(
      ops.Write(reinterpret_cast<uint32_t*>(block(me.rank) + layout.posted_offset()), released));
  for (int q = 0; q < layout.size; ++q) {
    if (q == me.rank || !block(q)) continue;
    SMDDP_RETURN_IF_ERROR(ops.Write(
        reinterpret_cast<uint32_t*>(block(q) + layout.consumed_offset(me.rank)), released));
    for (int slot = 0; slot < RegionLayout::kSlots; ++slot) {
      for (size_t at :
           {layout.posted_token_offset(slot, me.rank), layout.consumed_token_offset(slot, me.rank)})
        SMDDP_RETURN_IF_ERROR(
            ops.Write(reinterpret_cast<uint32_t*>(block(q) + at), kReleasedToken));
    }
  }
  return Status::Ok();
}

namespace {

// How a rank reaches its peers' data in one call: on the device (kernels hand
// each other this call's addresses), by direct reads of the buffers whose
// addresses the host exchanged, or staged through the regions' slots.
enum class Reach { kDevice, kDirect, kStaged };

// The one place the stream family picks a collective's body, for `reach`.
// `source` and `sends`: collective_permute's (RunStreamPlan).
Status RunStreamBody(Reach reach, const Plan& plan, Steps& steps, StreamRank& me, StreamOps& ops,
                     const uint8_t* send, uint8_t* recv, int64_t source, bool sends) {
  const bool device = reach == Reach::kDevice, direct = reach == Reach::kDirect;
  const size_t outer = plan.outer, inner = plan.inner;
  switch (plan.kind) {
    case Collective::kAllGather:
      return device   ? DeviceAllGatherOrAllToAll(steps, ops, send, recv, outer, inner, false)
             : direct ? DirectAllGatherOrAllToAll(steps, ops, me.inputs, recv, outer, inner, false)
                      : StagedAllGather(steps, ops, send, recv, outer, inner);
    case Collective::kAllToAll:
      return device   ? DeviceAllGatherOrAllToAll(steps, ops, send, recv, outer, inner, true)
             : direct ? DirectAllGatherOrAllToAll(steps, ops, me.inputs, recv, outer, inner, true)
                      : StagedAllToAll(steps, ops, send, recv, outer, inner);
    case Collective::kReduceScatter:
      return device ? DeviceReduceScatter(steps, ops, recv, outer, inner, plan.dtype, plan.op)
             : direct
                 ? DirectReduceScatter(steps, ops, me.inputs, recv, outer, inner, plan.dtype,
                                       plan.op)
                 : StagedReduceScatter(steps, ops, send, recv, outer, inner, plan.dtype, plan.op);
    case Collective::kAllReduce:
      return device   ? DeviceAllReduce(steps, ops, plan.count, plan.dtype, plan.op)
             : direct ? DirectAllReduce(steps, ops, me.inputs, me.outputs, plan.count, plan.dtype,
                                        plan.op)
                      : StagedAllReduce(steps, ops, send, recv, plan.count, plan.dtype, plan.op);
    case Collective::kCollectivePermute:
      return device ? DeviceCollectivePermute(steps, ops, send, recv, outer * inner, source)
             : direct
                 ? DirectCollectivePermute(steps, ops, me.inputs, recv, outer * inner, source)
                 : StagedCollectivePermute(steps, ops, send, recv, outer * inner, source, sends);
  }
  return Status::Error("jax_smddp: unknown collective kind");
}

}  // namespace

Status RunStreamPlan(const Plan& plan, StreamRank& me, StreamOps& ops, const void* send_v,
                     void* recv_v, bool replayable) {
  const auto* send = static_cast<const uint8_t*>(send_v);
  auto* recv = static_cast<uint8_t*>(recv_v);
  if (int(me.regions.size()) != me.layout.size || me.rank < 0 || me.rank >= me.layout.size ||
      !(me.flags.empty() || int(me.flags.size()) == me.layout.size))
    return Status::Error("jax_smddp: stream communicator is not set up for this rank");
  if (int(plan.kind) >= kCollectives) return Status::Error("jax_smddp: unknown collective kind");
  // A collective whose ranks each send to one peer (not every peer) is given by its permutation.
  const bool permute = !SpecOf(plan.kind).every_peer;
  if (permute && !plan.sources)
    return Status::Error("jax_smddp: collective_permute without its permutation");
  // collective_permute: where this rank's output comes from, and whether its input goes anywhere.
  const int64_t source = permute ? plan.sources[me.rank] : -1;
  bool sends = false;
  for (int r = 0; permute && r < me.layout.size; ++r)
    sends |= r != me.rank && plan.sources[r] == me.rank;
  if (me.layout.size == 1) {  // a group of one: the output is the input, one copy, no staging
    if (permute && source < 0) return ops.Zero(recv, plan.outer * plan.inner);
    size_t in = 0, bytes = 0;
    CallBytes(plan, 1, &in, &bytes);
    return bytes ? ops.Copy(recv, send, bytes) : Status::Ok();
  }
  Steps steps(me, ops, replayable);
  const Reach reach = replayable           ? Reach::kStaged
                      : me.device.active   ? Reach::kDevice
                      : !me.inputs.empty() ? Reach::kDirect
                                           : Reach::kStaged;
  if (reach == Reach::kDirect) {
    const size_t P = size_t(me.layout.size);
    if (me.inputs.size() != P || me.inputs[me.rank] != send ||
        (DirectReadsNeedOutputs(plan.kind) &&
         (me.outputs.size() != P || me.outputs[me.rank] != recv)))
      return Status::Error("jax_smddp: direct reads need every rank's buffers of this call");
  }
  const Status st = RunStreamBody(reach, plan, steps, me, ops, send, recv, source, sends);
  if (!st.ok() || reach != Reach::kStaged) return st;
  return replayable || me.drain_each_call ? steps.Finish() : Status::Ok();
}

}  // namespace smddp

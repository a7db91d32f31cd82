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

Status RunStreamPlan(const Plan& plan, StreamRank& me, StreamOps& ops, const void* send_v,
                     void* recv_v, bool replayable) {
  const auto* send = static_cast<const uint8_t*>(send_v);
  auto* recv = static_cast<uint8_t*>(recv_v);
  if (int(me.regions.size()) != me.layout.size || me.rank < 0 || me.rank >= me.layout.size ||
      !(me.flags.empty() || int(me.flags.size()) == me.layout.size))
    return Status::Error("jax_smddp: stream communicator is not set up for this rank");
  const bool permute = plan.kind == Collective::kCollectivePermute;
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
  if (me.device.active && !replayable) {
    switch (plan.kind) {
      case Collective::kAllGather:
      case Collective::kAllToAll:
        return DeviceAllGatherOrAllToAll(steps, ops, send, recv, plan.outer, plan.inner,
                                         plan.kind == Collective::kAllToAll);
      case Collective::kReduceScatter:
        return DeviceReduceScatter(steps, ops, recv, plan.outer, plan.inner, plan.dtype, plan.op);
      case Collective::kAllReduce:
        return DeviceAllReduce(steps, ops, plan.count, plan.dtype, plan.op);
      case Collective::kCollectivePermute:
        return DeviceCollectivePermute(steps, ops, send, recv, plan.outer * plan.inner, source);
    }
  }
  if (!me.inputs.empty() && !replayable) {
    const size_t P = size_t(me.layout.size);
    if (me.inputs.size() != P || me.inputs[me.rank] != send ||
        (DirectReadsNeedOutputs(plan.kind) &&
         (me.outputs.size() != P || me.outputs[me.rank] != recv)))
      return Status::Error("jax_smddp: direct reads need every rank's buffers of this call");
    switch (plan.kind) {
      case Collective::kAllGather:
      case Collective::kAllToAll:
        return DirectAllGatherOrAllToAll(steps, ops, me.inputs, recv, plan.outer, plan.inner,
                                         plan.kind == Collective::kAllToAll);
      case Collective::kReduceScatter:
        return DirectReduceScatter(steps, ops, me.inputs, recv, plan.outer, plan.inner, plan.dtype,
                                   plan.op);
      case Collective::kAllReduce:
        return DirectAllReduce(steps, ops, me.inputs, me.outputs, plan.count, plan.dtype, plan.op);
      case Collective::kCollectivePermute:
        return DirectCollectivePermute(steps, ops, me.inputs, recv, plan.outer * plan.inner,
                                       source);
    }
  }
  Status st = Status::Error("jax_smddp: unknown collective kind");
  switch (plan.kind) {
    case Collective::kAllGather:
      st = StagedAllGather(steps, ops, send, recv, plan.outer, plan.inner);
      break;
    case Collective::kAllToAll:
      st = StagedAllToAll(steps, ops, send, recv, plan.outer, plan.inner);
      break;
    case Collective::kReduceScatter:
      st = StagedReduceScatter(steps, ops, send, recv, plan.outer, plan.inner, plan.dtype, plan.op);
      break;
    case Collective::kAllReduce:
      st = StagedAllReduce(steps, ops, send, recv, plan.count, plan.dtype, plan.op);
      break;
    case Collective::kCollectivePermute:
      st = StagedCollectivePermute(steps, ops, send, recv, plan.outer * plan.inner, source, sends);
      break;
  }
  SMDDP_RETURN_IF_ERROR(st);
  return replayable || me.drain_each_call ? steps.Finish() : Status::Ok();
}

}  // namespace smddp

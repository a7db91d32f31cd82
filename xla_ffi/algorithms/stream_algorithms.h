// Collectives as stream-ordered steps over registered staging memory, for
// memory the host must not wait on (GPU memory; the handler only enqueues).
//
// Each rank owns one registered region that every peer has mapped (CUDA IPC
// or peer access on GPUs, plain pointers in tests): a `posted` flag, one
// `consumed` flag per peer, and kSlots staging slots. The flags may instead
// live in a separate flag block per rank (host memory the GPUs address, so
// that a host thread can release them when a peer dies), at the same offsets. A call is a sequence
// of steps; in step s a rank
//   1. waits until every peer consumed step s - kSlots (its slot is free),
//   2. copies its part of the step into slot s % kSlots and sets posted = s,
//   3. for each peer: waits for the peer's posted >= s, copies or reduces
//      straight out of the peer's slot into its output, and sets the peer's
//      consumed[rank] = s.
// Ranks keep their own step counters, equal because every rank runs the same
// calls on a communicator in the same order. Nothing here blocks the host
// except in the host implementation of StreamOps.
//
// Calls captured into a CUDA graph: a graph replays the flag values of the
// call it captured, so a step counter kept on the host cannot number its
// steps. A replayable call (RunStreamPlan's `replayable`) stages, numbers its
// steps from 1 within the call, and hands slots over by tokens instead of
// step values: per slot and pair of ranks, a `posted` token the writer sets
// and the reader clears, and a `consumed` token the reader sets and the
// writer clears (both in the waiting rank's flags). It reuses a slot only
// after clearing its consumed tokens and ends by clearing those of the slots
// it used, so it leaves every token at zero, as it found them, and each
// replay is the same call again. Its first steps reuse slots at once: a group
// whose calls may be captured (StreamRank::drain_each_call) ends every staged
// call once its peers consumed its last step, so no earlier call still reads
// them.
//
// Direct reads: when the caller knows every rank's input of this call as
// this rank addresses it (StreamRank::inputs; CUDA IPC mappings of the XLA
// buffers on GPUs), all_gather, all_to_all and reduce_scatter run as one step
// with no staging: a rank posts the step (its input is ready), reads or
// reduces each peer's input in place into its output, sets the peer's
// consumed flag, and before its stream goes on waits until every peer has
// consumed its input (XLA may reuse that buffer next). Each rank copies n
// shards instead of n + 1, and a call costs two hand-offs between ranks
// instead of two per slot-sized step. all_reduce also needs every rank's
// output (StreamRank::outputs) and runs in one step too: rank r reduces shard
// r of every input and stores it into every rank's output from one kernel
// (StreamOps::ReduceToEach).
//
// The bodies: stream_staged.cc (through the slots), stream_direct.cc (direct
// reads), stream_hierarchical.cc (across hosts); what they share (tiles, the
// step protocol) in stream_steps.h; RunStreamPlan in stream_algorithms.cc.
#ifndef JAX_SMDDP_ALGORITHMS_STREAM_ALGORITHMS_H_
#define JAX_SMDDP_ALGORITHMS_STREAM_ALGORITHMS_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "xla_ffi/algorithms/plan.h"
#include "xla_ffi/algorithms/stream_ops.h"

namespace smddp {

// Where things are in a rank's registered region.
struct RegionLayout {
  static constexpr int kSlots = 2;           // double-buffered: post step s+1 while peers read s
  static constexpr size_t kFlagStride = 64;  // one cache line per flag

  RegionLayout(int size, size_t slot_bytes);

  size_t posted_offset() const { return 0; }
  size_t consumed_offset(int peer) const { return kFlagStride * (1 + size_t(peer)); }
  // Replayable calls' tokens, in the waiting rank's flags: `writer` posted
  // `slot`; `reader` consumed this rank's `slot`.
  size_t posted_token_offset(int slot, int writer) const {
    return kFlagStride * (1 + size_t(size) * (1 + size_t(slot)) + size_t(writer));
  }
  size_t consumed_token_offset(int slot, int reader) const {
    return kFlagStride * (1 + size_t(size) * (1 + kSlots + size_t(slot)) + size_t(reader));
  }
  // Pairwise permutes' counters (RunStreamPairPermute): in the reader's flags,
  // the tiles `writer` posted to it; in the writer's flags, those `reader` consumed.
  size_t pair_posted_offset(int writer) const {
    return kFlagStride * (1 + size_t(size) * (1 + 2 * kSlots) + size_t(writer));
  }
  size_t pair_consumed_offset(int reader) const {
    return kFlagStride * (1 + size_t(size) * (2 + 2 * kSlots) + size_t(reader));
  }
  size_t slot_offset(int slot) const { return slots_offset + size_t(slot) * slot_bytes; }
  size_t flag_bytes() const { return kFlagStride * (1 + size_t(size) * (3 + 2 * kSlots)); }
  // The device exchange (DeviceExchange, below), always in the region: the
  // rank's mailbox entries (kMailboxSlots, by step), then where this call's
  // buffers of every rank are as this rank addresses them (2 x size words:
  // inputs, then outputs).
  static constexpr int kMailboxSlots = 2;
  size_t mailbox_offset(uint32_t step) const {
    return mailbox_base + size_t(step % kMailboxSlots) * kMailboxWords * 8;
  }
  size_t resolved_offset() const { return mailbox_base + kMailboxSlots * kMailboxWords * 8; }

  int size;
  size_t slot_bytes;    // a multiple of 256
  size_t mailbox_base;  // after the flags
  size_t slots_offset;  // page aligned
  size_t total_bytes;   // what to allocate (zeroed) per rank
};

// Calls whose peers' buffers are not known on the host (issue 65): each
// rank writes its call's mailbox entry (MailboxEntry words, stream_ops.h) on
// its stream before it posts, and its peers resolve the addresses on theirs
// (StreamOps::Resolve) once it posted: through `tables[q]` (peer q's
// allocations as mapped here, filled by the process's mapper thread;
// null: q is in this process and its addresses are used as they are).
// Nothing on the host waits for a peer.
struct DeviceExchange {
  bool active = false;                 // this call goes by it (set per call)
  uint64_t entry[kMailboxWords] = {};  // this call's entry (words 1-6; the stamp is the step)
  std::vector<const uint64_t*> tables;
  const uint32_t* released = nullptr;  // nonzero once the group failed
};

// One rank's view of a communicator's regions.
struct StreamRank {
  int rank = 0;
  RegionLayout layout{1, 256};
  std::vector<uint8_t*> regions;  // every rank's region, as this rank addresses it
  std::vector<uint8_t*> flags;    // every rank's flag block; empty: flags are in the regions
  uint32_t step = 0;              // steps run so far (host side)
  // Every staged call ends once its peers consumed its last step: set where
  // calls may be captured into CUDA graphs (replayable calls reuse the slots).
  bool drain_each_call = false;
  std::vector<const void*> sources;  // reduction sources, sized once (no per-call allocation)
  // This call's input (and for all_reduce, output) of every rank, as this
  // rank addresses them, set per call for direct reads (all ranks alike);
  // empty: stage through the slots.
  std::vector<const uint8_t*> inputs;
  std::vector<uint8_t*> outputs;
  // Or direct reads by the device exchange (inputs and outputs then empty).
  DeviceExchange device;
  // Per peer: the tiles this rank posted to it and took from it in pairwise
  // permutes (host side; RunStreamPairPermute).
  std::vector<uint32_t> pair_sent, pair_received;
};

struct NetPort;

// Every step flag (AllFlags) and every token (AllTokens, with the pairwise
// permutes' counters, small counts like them) of every rank's flag
// block (or region), as some process addresses them (null blocks skipped):
// what a failed group releases so that no stream waits on it
// (stream_watchdog.h; ReleasedFlag and kReleasedToken, stream_ops.h).
std::vector<uint32_t*> AllFlags(const RegionLayout& layout, const std::vector<uint8_t*>& blocks);
std::vector<uint32_t*> AllTokens(const RegionLayout& layout, const std::vector<uint8_t*>& blocks);

// all_gather over hosts (the hierarchical, pipelined algorithm): the group is
// `port.hosts` hosts of L = local.layout.size ranks each, and
// rank_of[g * L + j] is the group rank of host g's j-th rank. Per tile, the
// rank hands its part to the network proxy (an all-to-all between hosts over
// its rail: same j everywhere), then, host by host as parts arrive, shares
// each part with its local peers through the staging slots, so the exchange
// inside the host overlaps the network's. recv[o, q, :] = send_q[o, :].
Status RunStreamHierarchicalAllGather(size_t outer, size_t inner_bytes, StreamRank& local,
                                      NetPort& port, const std::vector<int>& rank_of,
                                      StreamOps& ops, const void* send, void* recv);

// reduce_scatter over hosts, likewise: per tile and destination host g, the
// ranks of each host reduce their blocks for host g's rail (rank i keeps
// rail i's partial sum); the partials go over the network to host g's rail
// peer, which combines the hosts' partials in host order. recv[o, :] =
// reduce_q send_q[o, rank, :]; inner in elements. 16-bit floats are rounded
// at each level (host partial, final).
Status RunStreamHierarchicalReduceScatter(size_t outer, size_t inner, DType dtype, ReduceOp op,
                                          StreamRank& local, NetPort& port,
                                          const std::vector<int>& rank_of, StreamOps& ops,
                                          const void* send, void* recv);

// all_reduce over hosts: reduce_scatter into this rank's shard of recv, then
// all_gather the shards in place; `count` must divide by the ranks (the
// custom calls pad, the NCCL front end forwards other counts).
Status RunStreamHierarchicalAllReduce(size_t count, DType dtype, ReduceOp op, StreamRank& local,
                                      NetPort& port, const std::vector<int>& rank_of,
                                      StreamOps& ops, const void* send, void* recv);

// all_to_all over hosts: recv[o, q, :] = send_q[o, rank, :]. Per tile, rank
// i of host h collects through the staging slots, from every rank j of its
// host, the blocks that rank j sends to rail i of each other host g
// ([rows, L, width] per host, in the network send slot), hands them to the
// proxy (host g's part to its rail peer on host g), and meanwhile copies the
// blocks its own host's ranks send it; then it unpacks each host's part as
// it arrives. Each block crosses the network once, between rail peers.
Status RunStreamHierarchicalAllToAll(size_t outer, size_t inner_bytes, StreamRank& local,
                                     NetPort& port, const std::vector<int>& rank_of, StreamOps& ops,
                                     const void* send, void* recv);

// The one place the family over hosts picks a collective's body: runs
// `plan` by the RunStreamHierarchical* above (arguments as theirs); a
// collective it does not serve (CollectiveSpec::substrates without
// kGpuAcrossHosts) is refused.
Status RunStreamHierarchicalPlan(const Plan& plan, StreamRank& local, NetPort& port,
                                 const std::vector<int>& rank_of, StreamOps& ops, const void* send,
                                 void* recv);

// For a rank that gives up on a call after its peers may have enqueued
// theirs (a failed buffer exchange): enqueues releases (ReleasedFlag of its
// step) of its posted flag and to its consumed flag at every peer, and of its
// tokens at every peer (kReleasedToken), so that no peer's stream waits on it; the group's outputs
// are undefined from then on (it fails for good, as after the watchdog releases a dead peer's
// flags).
Status ReleaseEveryoneWaitingOn(const StreamRank& me, StreamOps& ops);

// Whether direct reads of `kind` need every rank's output as well as its
// input (all_reduce).
bool DirectReadsNeedOutputs(Collective kind);

// collective_permute where only the ranks of its pairs take part (the NCCL
// front end: a rank that neither sends nor receives makes no call): this
// rank's input goes to `target` and its output comes from `source` (-1:
// none; the output is then left alone, as NCCL leaves it), `bytes` each, on
// the pairs' own counters, through the sender's staging slots, tile by tile.
// The sender first waits until its peers consumed the group's last step (its
// slots are free) and at the end until the target consumed every tile (they
// are free again for whatever call comes next). Not replayable (a CUDA graph
// cannot number the pairs' tiles).
Status RunStreamPairPermute(StreamRank& me, StreamOps& ops, const void* send, void* recv,
                            size_t bytes, int target, int source);

// Runs one collective of `plan` (kinds and layouts as in plan.h) on
// `ops`: recv of the same shapes as the host algorithms. With `me.inputs`
// set (one per rank; and `me.outputs` where DirectReadsNeedOutputs), reads
// the peers' buffers in place. `replayable`: the call may be replayed as
// captured (a CUDA graph): it stages, by tokens (above), and leaves
// `me.step` alone; every rank of the group must pass the same.
Status RunStreamPlan(const Plan& plan, StreamRank& me, StreamOps& ops, const void* send, void* recv,
                     bool replayable = false);

}  // namespace smddp

#endif  // JAX_SMDDP_ALGORITHMS_STREAM_ALGORITHMS_H_

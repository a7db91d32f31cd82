// The collectives the engine runs, each described once (as NCCL's ncclFunc_t
// and its one table): its name, whether it reduces, how its output and input
// sizes relate, the bytes it moves (the cost model's terms), how a plan sizes
// it and which engine families serve it. What a plan runs (Plan::kind), what
// the world counts per custom call (World::Caller), what the NCCL API front end
// serves, the op names of messages and counters, and, through the bindings'
// collectives(), jax_smddp._collectives (tests/build/test_one_list.py).
#ifndef JAX_SMDDP_COMMON_COLLECTIVE_H_
#define JAX_SMDDP_COMMON_COLLECTIVE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace smddp {

enum class Collective : uint8_t {
  kAllGather,
  kReduceScatter,
  kAllReduce,
  kAllToAll,
  kCollectivePermute,  // jax.lax.ppermute, XLA's collective-permute
};
inline constexpr int kCollectives = 5;

// How a plan sizes a call (Plan::outer, inner, count): the unit NCCL's count
// takes too (a rank's block, or the whole buffer).
enum class PlanSize : uint8_t {
  kByteBlocks,     // outer x inner bytes: one rank's block (to each peer, or its one peer)
  kElementBlocks,  // outer x inner elements: one rank's output shard
  kElements,       // count elements: the whole buffer
};

// The engine families that run a collective (CollectiveSpec::substrates).
enum Substrate : uint8_t {
  kInProcess = 1 << 0,        // every rank in this process (host_algorithms.h)
  kAcrossProcesses = 1 << 1,  // over links between processes (process_algorithms.h)
  kOnStreams = 1 << 2,        // on GPU streams, one host (stream_algorithms.h)
  kGpuAcrossHosts = 1 << 3,   // on GPU streams across hosts (RunStreamHierarchicalPlan)
  kNcclApi = 1 << 4,          // XLA's GPU collective through the NCCL API front end
  kMpiApi = 1 << 5,           // XLA's CPU collective through the MPI ABI front end
};
inline constexpr int kSubstrates = 6;

// "in_process", ...: as Python names the bits of CollectiveSpec::substrates.
inline const char* SubstrateName(int bit) {
  static const char* const kNames[kSubstrates] = {
      "in_process", "across_processes", "on_streams", "gpu_across_hosts", "nccl_api", "mpi_api"};
  return bit >= 0 && bit < kSubstrates ? kNames[bit] : "?";
}

// One collective, over n ranks each with S input bytes.
struct CollectiveSpec {
  Collective kind;
  const char* name;  // "all_gather": messages, counters, Python
  bool reduces;      // a ReduceOp combines the ranks' values
  // A rank's output is S n^out_power bytes: 1 gathers, -1 scatters, 0 keeps the size.
  int8_t out_power;
  // What one rank sends one other rank (a block) is S n^block_power bytes.
  int8_t block_power;
  // Times the data crosses the group: 2 for all_reduce (a reduce-scatter, then
  // an all-gather of the shards), 1 otherwise.
  uint8_t passes;
  // Whether every rank sends to every other (nccl-tests' busbw counts (n-1)/n
  // of each pass) or to one peer (a permutation: busbw is algbw).
  bool every_peer;
  // Whether routes through other processes apply (Routes: hierarchical, a
  // ring between hosts); all_to_all and permutations always go direct.
  bool routed;
  // Whether the cost model counts its traffic and the benchmarks time it
  // (jax_smddp/cost_model.py, jax_smddp/tools/bench).
  bool modelled;
  uint8_t substrates;  // Substrate bits
  PlanSize plan_size;
};

inline constexpr uint8_t kEveryCpuAndGpuFamily =
    kInProcess | kAcrossProcesses | kOnStreams | kGpuAcrossHosts | kNcclApi;

// In the enumeration's order: {kind, name, reduces, out_power, block_power,
// passes, every_peer, routed, modelled, substrates, plan_size}.
inline constexpr CollectiveSpec kCollectiveSpecs[kCollectives] = {
    {Collective::kAllGather, "all_gather", false, 1, 0, 1, true, true, true,
     kEveryCpuAndGpuFamily | kMpiApi, PlanSize::kByteBlocks},
    {Collective::kReduceScatter, "reduce_scatter", true, -1, -1, 1, true, true, true,
     kEveryCpuAndGpuFamily | kMpiApi, PlanSize::kElementBlocks},
    {Collective::kAllReduce, "all_reduce", true, 0, -1, 2, true, true, true,
     kEveryCpuAndGpuFamily | kMpiApi, PlanSize::kElements},
    {Collective::kAllToAll, "all_to_all", false, 0, -1, 1, true, false, true, kEveryCpuAndGpuFamily,
     PlanSize::kByteBlocks},
    // The NCCL front end serves a permutation of ncclSend/ncclRecv (World::Caller::kNcclPermute).
    {Collective::kCollectivePermute, "collective_permute", false, 0, 0, 1, false, false, false,
     kInProcess | kAcrossProcesses | kOnStreams | kNcclApi, PlanSize::kByteBlocks},
};

constexpr bool SpecsInOrder(int k = 0) {
  return k == kCollectives || (int(kCollectiveSpecs[k].kind) == k &&
                               kCollectiveSpecs[k].passes >= 1 && SpecsInOrder(k + 1));
}
static_assert(SpecsInOrder(), "one description per collective, in the enumeration's order");

inline const CollectiveSpec& SpecOf(Collective c) { return kCollectiveSpecs[int(c)]; }

// "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "collective_permute".
inline const char* CollectiveName(Collective c) {
  return int(c) < kCollectives ? kCollectiveSpecs[int(c)].name : "?";
}

// Whether the collective combines its ranks' values (a ReduceOp applies).
inline constexpr bool Reduces(Collective c) { return kCollectiveSpecs[int(c)].reduces; }

// The collective CollectiveName calls `name`; false for any other name (an
// MPI point-to-point call's, say).
inline bool CollectiveNamed(const char* name, Collective* out) {
  for (int k = 0; k < kCollectives; ++k) {
    if (std::strcmp(name, CollectiveName(Collective(k))) == 0) {
      *out = Collective(k);
      return true;
    }
  }
  return false;
}

// `bytes` times n^power (n ranks); powers of -1, 0 and 1 only.
inline constexpr size_t ScaleByRanks(size_t bytes, int power, size_t n) {
  return power > 0 ? bytes * n : power < 0 ? bytes / n : bytes;
}

// "all_gather, reduce_scatter, all_reduce and all_to_all": the collectives
// served by every family of `substrates`, for messages.
inline std::string CollectivesServedBy(uint8_t substrates) {
  std::string out;
  int last = -1;
  for (int k = 0; k < kCollectives; ++k)
    if ((kCollectiveSpecs[k].substrates & substrates) == substrates) last = k;
  for (int k = 0; k < kCollectives; ++k) {
    if ((kCollectiveSpecs[k].substrates & substrates) != substrates) continue;
    if (!out.empty()) out += k == last ? " and " : ", ";
    out += kCollectiveSpecs[k].name;
  }
  return out;
}

}  // namespace smddp

#endif  // JAX_SMDDP_COMMON_COLLECTIVE_H_

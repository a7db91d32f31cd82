// The collectives the engine runs, enumerated and named once: what a plan
// runs (Plan::kind), what the world counts per custom call (World::Caller),
// what the NCCL API front end serves, and the op names of messages, counters
// and jax_smddp._startup.COLLECTIVES (tests/build/test_one_list.py).
#ifndef JAX_SMDDP_COMMON_COLLECTIVE_H_
#define JAX_SMDDP_COMMON_COLLECTIVE_H_

#include <cstdint>
#include <cstring>

namespace smddp {

enum class Collective : uint8_t {
  kAllGather,
  kReduceScatter,
  kAllReduce,
  kAllToAll,
  kCollectivePermute,  // jax.lax.ppermute, XLA's collective-permute
};
inline constexpr int kCollectives = 5;

// "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "collective_permute".
inline const char* CollectiveName(Collective c) {
  static const char* const kNames[kCollectives] = {"all_gather", "reduce_scatter", "all_reduce",
                                                   "all_to_all", "collective_permute"};
  return int(c) < kCollectives ? kNames[int(c)] : "?";
}

// Whether the collective combines its ranks' values (a ReduceOp applies).
inline constexpr bool Reduces(Collective c) {
  return c == Collective::kReduceScatter || c == Collective::kAllReduce;
}

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

}  // namespace smddp

#endif  // JAX_SMDDP_COMMON_COLLECTIVE_H_

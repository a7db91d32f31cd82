// One collective call as a process sees it when the group spans processes:
// which ranks live where, this process's ranks' buffers, and the links to the
// other processes. What the cross-process algorithms run on.
#ifndef JAX_SMDDP_ENGINE_PROCESS_CALL_H_
#define JAX_SMDDP_ENGINE_PROCESS_CALL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "xla_ffi/engine/transport.h"
#include "xla_ffi/engine/world.h"

namespace smddp {

struct ProcessCall {
  const World* world = nullptr;
  int size = 0;                              // ranks in the group
  const std::vector<int64_t>* members;       // device (partition) id per rank
  const std::vector<int>* process_of_rank;   // process per rank
  std::vector<int> local;                    // this process's ranks, ascending
  std::vector<const void*> send;             // per local rank
  std::vector<void*> recv;                   // per local rank
  std::vector<int> peers;                    // the group's other processes, ascending
  std::vector<std::vector<int>> peer_ranks;  // per peer, its ranks, ascending
  uint64_t tag = 0;                          // this call's; equal on every process
  Clock::time_point start, deadline;
  std::string where;                         // "jax_smddp all_gather (op 3 of ...)"
  CallInfo info;

  // "process 1 (devices [2 3])"
  std::string DescribeProcess(int process) const;
};

// Mixes `value` into a 64-bit tag (message tags and call tags).
uint64_t MixTag(uint64_t tag, uint64_t value);

}  // namespace smddp

#endif  // JAX_SMDDP_ENGINE_PROCESS_CALL_H_

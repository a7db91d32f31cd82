// The steady-state scenario of the mock node's layouts test (gpu_node_test.cc,
// mode "steady"; issue 65): what a call costs the host once its buffers are
// known. Each rank runs, per collective (all_gather, reduce_scatter,
// all_reduce, all_to_all, collective-permute to rank r + 1), one warm-up call,
// then 50 calls on the same buffers with new data each, every answer checked
// here; around the 50 every process reads the mock's counters (IPC exports,
// opens, cuMem exports, imports, maps, grants, pointer-attribute queries:
// mock_node::Count) and the buffer exchange's host meetings with its peers
// (BufferExchange::HostWaitCounts) and prints what the 50 cost it:
//   steady <op> process <p>: meetings M waits W ipc_exports .. ipc_opens ..
//   cumem_exports .. imports .. maps .. grants .. attribute_queries ..
#ifndef JAX_SMDDP_TESTS_NATIVE_GPU_NODE_STEADY_H_
#define JAX_SMDDP_TESTS_NATIVE_GPU_NODE_STEADY_H_

#include <functional>

#include "cuda/gpu_call.h"
#include "cuda/gpu_communicator.h"
#include "cuda/ncclapi/nccl_types.h"

namespace smddp_test {

struct SteadyRank {
  int ranks = 0;                  // in the group
  int rank = 0;                   // this one's
  int process = 0;                // this rank's process
  bool first_of_process = false;  // prints the process's counters
  smddp::gpu::CallRank me;        // the custom calls' path (rank set), or
  ncclComm_t comm = nullptr;      // the NCCL API front end
  std::function<void()> barrier;  // every rank of the job
  // Groups across hosts: the front end forwards permutes to the real NCCL
  // (here a mock that moves no data), so they are left out.
  bool permutes = true;
};

// Runs the scenario on the current device; a failed check exits the process.
void RunSteady(const SteadyRank& s);

// Reallocation (mode "realloc"): after a warm-up call and one more of
// all_gather, rank 0 frees its input and allocates it again at the same
// start, and every rank makes one more call; every answer checked, and what
// that call cost each process printed as "steady realloc process <p>: ...".
void RunRealloc(const SteadyRank& s);

// A peer dies after the warm-up (mode "dead_warm"): after two all_gathers
// the `dies` ranks' process kills itself; every other rank calls until a call
// fails (at most 10 s) and prints
//   rank <r>: failed after X s: <message>
//   rank <r>: synchronized after Y s (<error>)
// then its stream is synchronized (what it enqueued ends, never hangs).
void RunDeadAfterWarmUp(const SteadyRank& s, bool dies);

// Capture (mode "replay", both entry points; the custom calls' with
// JAX_SMDDP_GPU_GRAPHS=1): per collective but the permute, one uncaptured
// call, then the call captured into a graph (the mock records it) and the
// graph launched 10 times, each on new input written to the same buffer;
// every answer checked; prints
//   replay <op> process <p>: 10 replays exact
void RunReplay(const SteadyRank& s);

// The late peer (mode "late_peer"): after a warm-up call, 20 calls of
// all_gather, then of reduce_scatter, where the `late` ranks (the last
// process's) sleep 300 ms before each; every rank prints how long its 20
// enqueues took in all, and checks every answer:
//   late_peer <op> rank <r>[ (late)]: 20 enqueues took X ms in all
void RunLatePeer(const SteadyRank& s, bool late);

}  // namespace smddp_test

#endif  // JAX_SMDDP_TESTS_NATIVE_GPU_NODE_STEADY_H_

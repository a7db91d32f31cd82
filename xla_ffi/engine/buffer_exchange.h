// Where every rank's buffers of a call are, for direct reads between
// processes (stream_algorithms.h): XLA hands each call buffers of its own
// choosing, so before a rank enqueues a call that reads its peers' buffers in
// place, it publishes where its input (and, for all_reduce, its output) lie
// (a CUDA IPC handle of the allocation that holds each, exported and
// published once per allocation, and the offset) in a table in its shared block, and waits until
// every peer published the same call's. Peers map an allocation once and keep the mapping while the
// group lives.
//
// The wait is a rendezvous of the ranks' host threads (not of their GPUs):
// a call's enqueue waits until every peer's host enqueues that call too,
// bounded by jax_smddp's timeout and failed at once when a peer process dies.
// Ranks in one process meet the same way (XLA enqueues each local device's
// part of a program from a thread of its own, as its NCCL rendezvous needs)
// and use each other's addresses as they are.
// A rank that cannot export its buffers (memory that CUDA IPC cannot share,
// or too many allocations seen) says so, and then every rank stages that
// call through the slots: all ranks see the same entries, so they decide alike.
#ifndef JAX_SMDDP_ENGINE_BUFFER_EXCHANGE_H_
#define JAX_SMDDP_ENGINE_BUFFER_EXCHANGE_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "xla_ffi/common/status.h"

namespace smddp {

class BufferExchange {
 public:
  static constexpr size_t kHandleBytes =
      72;  // a kind, then a CUDA IPC handle or a descriptor's (cuda/buffer_ipc.h)
  using Handle = std::array<unsigned char, kHandleBytes>;  // fixed size: nothing allocated per call
  static constexpr size_t kEntries = 4;  // exchanges in flight (a peer is at most one ahead)
  static constexpr size_t kMaxAllocations =
      256;  // exported per rank; beyond, calls stage (mappings are kept)
  // One per allocation id, never reused: a mapper reads a handle whenever it
  // gets to it (Publish: no peer waits for another).
  static constexpr size_t kHandleSlots = kMaxAllocations;
  static size_t Bytes();  // one rank's table (zeroed before use)

  // How this process shares and maps memory (CUDA IPC on GPUs).
  struct Memory {
    // The allocation holding `p`: its start and an id no other allocation of
    // this process ever has (CUDA's buffer id), asked every call. An error
    // says why `p` cannot be shared.
    std::function<Status(const void* p, uintptr_t* base, uint64_t* unique)> find_allocation;
    // An IPC handle of the allocation starting at `base`, asked once per
    // allocation.
    std::function<Status(uintptr_t base, Handle* handle)> export_allocation;
    // Maps a peer's allocation from its handle; its start here.
    std::function<Status(const Handle& handle, uint8_t** base)> map_allocation;
  };

  // `tables`: every rank's table as this process addresses it; `local[q]`:
  // rank q is in this process (its published addresses are used as they are).
  // `who(q)` names rank q in messages; `check()` fails once the group failed
  // (a peer died).
  BufferExchange(int rank, std::vector<uint8_t*> tables, std::vector<bool> local, Memory memory,
                 std::function<std::string(int)> who, std::function<Status()> check);

  // Publishes this rank's `input` and `output` (null: the peers need only
  // inputs) for exchange number `exchange` (0, 1, ...: the same calls on
  // every rank) of call `call`, waits up to `timeout_s` for every peer's, and
  // sets `*inputs` (and with an output `*outputs`) to every rank's buffers as
  // addressed here, or empties both when some rank could not export its
  // buffers (the call stages).
  Status Exchange(uint64_t exchange, uint64_t call, const void* input, void* output,
                  double timeout_s, std::vector<const uint8_t*>* inputs,
                  std::vector<uint8_t*>* outputs);

  // The device exchange (stream_algorithms.h: DeviceExchange): exports this
  // rank's `input` and `output` (null: none) where they are new, publishing
  // their handles, and sets words 1-6 of its mailbox entry (MailboxEntry,
  // stream_ops.h); waits for no peer. An error says why a buffer cannot be
  // shared (the caller then stages it in memory that can).
  Status Publish(const void* input, void* output, uint64_t* entry);
  // Rank q's published handle of its allocation `id` from its table, if
  // published yet (the process's mapper thread).
  static bool ReadHandle(const uint8_t* table, uint64_t id, Handle* handle);

  // Allocations this rank exported, and peers' allocations it located (each
  // mapped once per process by Memory::map_allocation).
  size_t exported() const { return size_t(next_id_); }
  // Why the latest call of this process that asked for direct reads staged
  // instead (which rank could not share its buffers, and why); empty if none did.
  static std::string StagedBecause();
  size_t mapped() const { return mapped_.size(); }

  // This process's host meetings with peers so far, for the steady-state
  // test (issue 65: a steady call should meet no peer on the host):
  // `meetings`, peers' entries an exchange awaited (whether or not they were
  // there yet); `waits`, those it had to spin for (not there at first look).
  struct HostWaits {
    uint64_t meetings;
    uint64_t waits;
  };
  static HostWaits HostWaitCounts();

 private:
  // Exports the allocation holding `p` (publishing its handle the first
  // time); its id + 1 and `p`'s offset in it, or 0 and why not.
  uint64_t Export(const void* p, uint64_t* offset, Status* why);
  // Rank q's buffer published as (id + 1, offset, address), as addressed here.
  Status Locate(int q, uint64_t id_plus_one, uint64_t offset, uint64_t address, uint8_t** out);

  int rank_;
  std::vector<uint8_t*> tables_;
  std::vector<bool> local_;
  Memory memory_;
  std::function<std::string(int)> who_;
  std::function<Status()> check_;
  std::map<uintptr_t, std::pair<uint64_t, uint64_t>> exported_;  // base -> (unique, id)
  uint64_t next_id_ = 0;
  std::map<std::pair<int, uint64_t>, uint8_t*> mapped_;  // (peer, id) -> base here
  bool remote_peers_ = false;  // some rank is in another process (buffers are exported)
  bool told_ = false;          // why this rank stages, said once
  bool peer_told_ = false;     // that a peer made a call stage, noted once
};

}  // namespace smddp

#endif  // JAX_SMDDP_ENGINE_BUFFER_EXCHANGE_H_

#include "xla_ffi/engine/input_exchange.h"

#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <utility>

namespace smddp {
namespace {

// One exchange of one rank: w[0] is exchange + 1 once the rest is written.
struct Entry {
  std::atomic<uint64_t> w[8];  // stamp, call, allocation id + 1 (0: not exported), offset, address
};
// A published allocation: w[0] is its id + 1 once the handle is written.
struct HandleSlot {
  std::atomic<uint64_t> stamp;
  uint64_t pad;
  unsigned char handle[InputExchange::kHandleBytes];
  unsigned char pad2[48];
};
static_assert(sizeof(Entry) == 64 && sizeof(HandleSlot) == 128, "cache-line sized");

Entry* Entries(uint8_t* table) { return reinterpret_cast<Entry*>(table); }
HandleSlot* Handles(uint8_t* table) {
  return reinterpret_cast<HandleSlot*>(table + InputExchange::kEntries * sizeof(Entry));
}

}  // namespace

size_t InputExchange::Bytes() { return kEntries * sizeof(Entry) + kHandleSlots * sizeof(HandleSlot); }

InputExchange::InputExchange(int rank, std::vector<uint8_t*> tables, std::vector<bool> local,
                             Memory memory, std::function<std::string(int)> who,
                             std::function<Status()> check)
    : rank_(rank), tables_(std::move(tables)), local_(std::move(local)), memory_(std::move(memory)),
      who_(std::move(who)), check_(std::move(check)) {}

Status InputExchange::Exchange(uint64_t exchange, uint64_t call, const void* input, double timeout_s,
                               std::vector<const uint8_t*>* inputs) {
  const int size = int(tables_.size());
  // This rank's allocation: exported once (a new handle at a known start
  // means XLA freed it and allocated anew there).
  uintptr_t base = 0;
  std::string handle;
  uint64_t id_plus_one = 0;
  Status why = memory_.export_allocation(input, &base, &handle);
  if (why.ok() && handle.size() != kHandleBytes) why = Status::Error("malformed handle");
  if (why.ok()) {
    auto it = exported_.find(base);
    if (it != exported_.end() && it->second.first == handle) {
      id_plus_one = it->second.second + 1;
    } else if (exported_.size() >= kMaxAllocations) {
      why = Status::Error("inputs came from more than " + std::to_string(kMaxAllocations) +
                          " allocations, and peers keep every one mapped");
    } else {
      const uint64_t id = next_id_++;
      exported_[base] = {handle, id};
      HandleSlot* slot = Handles(tables_[rank_]) + id % kHandleSlots;
      slot->stamp.store(0, std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_release);
      std::memcpy(slot->handle, handle.data(), kHandleBytes);
      slot->stamp.store(id + 1, std::memory_order_release);
      id_plus_one = id + 1;
    }
  }
  if (!why.ok() && !told_) {
    told_ = true;
    std::fprintf(stderr, "jax_smddp (GPU): %s cannot share its input in place (%s); such calls "
                 "of its group stage through the slots\n", who_(rank_).c_str(), why.message().c_str());
  }
  Entry* own = Entries(tables_[rank_]) + exchange % kEntries;
  own->w[0].store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  own->w[1].store(call, std::memory_order_relaxed);
  own->w[2].store(id_plus_one, std::memory_order_relaxed);
  own->w[3].store(uint64_t(reinterpret_cast<uintptr_t>(input) - base), std::memory_order_relaxed);
  own->w[4].store(uint64_t(reinterpret_cast<uintptr_t>(input)), std::memory_order_relaxed);
  own->w[0].store(exchange + 1, std::memory_order_seq_cst);

  // Every peer's entry of this exchange.
  inputs->assign(size, nullptr);
  (*inputs)[rank_] = static_cast<const uint8_t*>(input);
  bool all = id_plus_one != 0;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_s));
  for (int q = 0; q < size; ++q) {
    if (q == rank_) continue;
    Entry* e = Entries(tables_[q]) + exchange % kEntries;
    for (uint64_t spins = 0; e->w[0].load(std::memory_order_acquire) != exchange + 1; ++spins) {
      if (Status st = check_(); !st.ok()) return st;
      if (spins % 256 == 255 && std::chrono::steady_clock::now() > deadline)
        return Status::Error("jax_smddp (GPU): " + who_(q) + " did not enqueue call " +
                             std::to_string(call) + " of the group within " +
                             std::to_string(int(timeout_s)) + " s (its inputs are read in place, "
                             "so every rank's host waits for the others' at each such call)");
      if (spins < 1000) {
        sched_yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }
    const uint64_t peer_call = e->w[1].load(std::memory_order_relaxed);
    const uint64_t peer_id = e->w[2].load(std::memory_order_relaxed);
    const uint64_t offset = e->w[3].load(std::memory_order_relaxed);
    const uint64_t address = e->w[4].load(std::memory_order_relaxed);
    if (peer_call != call)
      return Status::Error("jax_smddp (GPU): " + who_(q) + " is at call " + std::to_string(peer_call) +
                           " where this rank is at call " + std::to_string(call) +
                           " (the ranks ran different calls)");
    if (peer_id == 0) {
      all = false;
      continue;
    }
    if (local_[q]) {
      (*inputs)[q] = reinterpret_cast<const uint8_t*>(uintptr_t(address));
      continue;
    }
    auto it = mapped_.find({q, peer_id - 1});
    if (it == mapped_.end()) {
      const HandleSlot* slot = Handles(tables_[q]) + (peer_id - 1) % kHandleSlots;
      std::string bytes(kHandleBytes, '\0');
      std::memcpy(bytes.data(), slot->handle, kHandleBytes);
      std::atomic_thread_fence(std::memory_order_acquire);
      if (slot->stamp.load(std::memory_order_acquire) != peer_id)
        return Status::Error("jax_smddp (GPU): " + who_(q) + "'s input handle was overwritten "
                             "before this rank read it");
      uint8_t* mapped = nullptr;
      if (Status st = memory_.map_allocation(bytes, &mapped); !st.ok())
        return Status::Error("jax_smddp (GPU): mapping " + who_(q) + "'s input: " + st.message());
      it = mapped_.emplace(std::make_pair(q, peer_id - 1), mapped).first;
    }
    (*inputs)[q] = it->second + offset;
  }
  if (!all) inputs->clear();
  return Status::Ok();
}

}  // namespace smddp

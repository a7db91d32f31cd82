#include "xla_ffi/engine/buffer_exchange.h"

#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>
#include <utility>

namespace smddp {
namespace {

// One exchange of one rank; w[0] is exchange + 1 once the rest is written.
// Per buffer (input at w[2], output at w[5]): allocation id + 1 (0: not
// exported), offset in the allocation, address in the owner's process.
struct Entry {
  std::atomic<uint64_t> w[8];  // stamp, call, input (3 words), output (3 words)
};
// A published allocation: `stamp` is its id + 1 once the handle is written.
struct HandleSlot {
  std::atomic<uint64_t> stamp;
  uint64_t pad;
  unsigned char handle[BufferExchange::kHandleBytes];
  unsigned char pad2[128 - 16 - BufferExchange::kHandleBytes];
};
static_assert(sizeof(Entry) == 64 && sizeof(HandleSlot) == 128, "cache-line sized");

Entry* Entries(uint8_t* table) { return reinterpret_cast<Entry*>(table); }
HandleSlot* Handles(uint8_t* table) {
  return reinterpret_cast<HandleSlot*>(table + BufferExchange::kEntries * sizeof(Entry));
}

std::atomic<uint64_t> host_meetings{0}, host_waits{0};  // BufferExchange::HostWaitCounts

std::mutex staged_mu;
std::string staged_because;  // BufferExchange::StagedBecause

void NoteStaged(const std::string& why) {
  std::lock_guard<std::mutex> lock(staged_mu);
  staged_because = why;
}

}  // namespace

std::string BufferExchange::StagedBecause() {
  std::lock_guard<std::mutex> lock(staged_mu);
  return staged_because;
}

BufferExchange::HostWaits BufferExchange::HostWaitCounts() {
  return {host_meetings.load(std::memory_order_relaxed),
          host_waits.load(std::memory_order_relaxed)};
}

size_t BufferExchange::Bytes() {
  return kEntries * sizeof(Entry) + kHandleSlots * sizeof(HandleSlot);
}

BufferExchange::BufferExchange(int rank, std::vector<uint8_t*> tables, std::vector<bool> local,
                               Memory memory, std::function<std::string(int)> who,
                               std::function<Status()> check)
    : rank_(rank),
      tables_(std::move(tables)),
      local_(std::move(local)),
      memory_(std::move(memory)),
      who_(std::move(who)),
      check_(std::move(check)) {
  for (bool here : local_) remote_peers_ |= !here;
}

uint64_t BufferExchange::Export(const void* p, uint64_t* offset, Status* why) {
  uintptr_t base = 0;
  uint64_t unique = 0;
  *why = memory_.find_allocation(p, &base, &unique);
  if (!why->ok()) return 0;
  *offset = uint64_t(reinterpret_cast<uintptr_t>(p) - base);
  // Another id at a known start: XLA freed that allocation and allocated anew.
  auto it = exported_.find(base);
  if (it != exported_.end() && it->second.first == unique) return it->second.second + 1;
  if (next_id_ >= kMaxAllocations) {  // ids, not entries: a reallocated start takes a new id
    *why =
        Status::Unsupported("its buffers came from more than " + std::to_string(kMaxAllocations) +
                            " allocations, and peers keep every one mapped");
    return 0;
  }
  Handle handle;
  *why = memory_.export_allocation(base, &handle);
  if (!why->ok()) return 0;
  const uint64_t id = next_id_++;
  exported_[base] = {unique, id};
  HandleSlot* slot = Handles(tables_[rank_]) + id % kHandleSlots;
  slot->stamp.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  std::memcpy(slot->handle, handle.data(), kHandleBytes);
  slot->stamp.store(id + 1, std::memory_order_release);
  return id + 1;
}

Status BufferExchange::Publish(const void* input, void* output, uint64_t* entry) {
  const void* buffers[2] = {input, output};
  for (int b = 0; b < 2; ++b) {
    uint64_t* w = entry + 1 + 3 * b;
    w[0] = w[1] = 0;
    w[2] = uint64_t(reinterpret_cast<uintptr_t>(buffers[b]));
    if (!buffers[b] || !remote_peers_) continue;  // peers in this process use the address
    Status why;
    w[0] = Export(buffers[b], &w[1], &why);
    if (!w[0]) return why;
  }
  return Status::Ok();
}

bool BufferExchange::ReadHandle(const uint8_t* table, uint64_t id, Handle* handle) {
  const HandleSlot* slot = Handles(const_cast<uint8_t*>(table)) + id % kHandleSlots;
  if (slot->stamp.load(std::memory_order_acquire) != id + 1) return false;
  std::memcpy(handle->data(), slot->handle, kHandleBytes);
  std::atomic_thread_fence(std::memory_order_acquire);
  return slot->stamp.load(std::memory_order_acquire) == id + 1;
}

Status BufferExchange::Locate(int q, uint64_t id_plus_one, uint64_t offset, uint64_t address,
                              uint8_t** out) {
  if (local_[q]) {
    *out = reinterpret_cast<uint8_t*>(uintptr_t(address));
    return Status::Ok();
  }
  auto it = mapped_.find({q, id_plus_one - 1});
  if (it == mapped_.end()) {
    const HandleSlot* slot = Handles(tables_[q]) + (id_plus_one - 1) % kHandleSlots;
    Handle bytes;
    std::memcpy(bytes.data(), slot->handle, kHandleBytes);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (slot->stamp.load(std::memory_order_acquire) != id_plus_one)
      return Status::Error("jax_smddp (GPU): " + who_(q) +
                           "'s buffer handle was overwritten "
                           "before this rank read it");
    uint8_t* mapped = nullptr;
    if (Status st = memory_.map_allocation(bytes, &mapped); !st.ok())
      return Status::Error("jax_smddp (GPU): mapping " + who_(q) + "'s buffer: " + st.message());
    it = mapped_.emplace(std::make_pair(q, id_plus_one - 1), mapped).first;
  }
  *out = it->second + offset;
  return Status::Ok();
}

Status BufferExchange::Exchange(uint64_t exchange, uint64_t call, const void* input, void* output,
                                double timeout_s, std::vector<const uint8_t*>* inputs,
                                std::vector<uint8_t*>* outputs) {
  const int size = int(tables_.size());
  uint64_t in_offset = 0, out_offset = 0, in_id = 1, out_id = output ? 1 : 0;
  Status why;
  if (remote_peers_) {  // peers in this process use the addresses as they are
    in_id = Export(input, &in_offset, &why);
    out_id = in_id && output ? Export(output, &out_offset, &why) : 0;
  }
  const bool exported = in_id && (!output || out_id);
  if (!exported && !told_) {  // said once (no string built per call)
    told_ = true;
    const std::string text =
        who_(rank_) + " cannot share its buffers in place (" + why.message() + ")";
    NoteStaged(text);
    std::fprintf(stderr, "jax_smddp (GPU): %s; such calls of its group stage through the slots\n",
                 text.c_str());
  }
  Entry* own = Entries(tables_[rank_]) + exchange % kEntries;
  own->w[0].store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  own->w[1].store(call, std::memory_order_relaxed);
  own->w[2].store(in_id, std::memory_order_relaxed);
  own->w[3].store(in_offset, std::memory_order_relaxed);
  own->w[4].store(uint64_t(reinterpret_cast<uintptr_t>(input)), std::memory_order_relaxed);
  own->w[5].store(out_id, std::memory_order_relaxed);
  own->w[6].store(out_offset, std::memory_order_relaxed);
  own->w[7].store(uint64_t(reinterpret_cast<uintptr_t>(output)), std::memory_order_relaxed);
  own->w[0].store(exchange + 1, std::memory_order_seq_cst);

  // Every peer's entry of this exchange.
  inputs->assign(size, nullptr);
  outputs->assign(output ? size : 0, nullptr);
  (*inputs)[rank_] = static_cast<const uint8_t*>(input);
  if (output) (*outputs)[rank_] = static_cast<uint8_t*>(output);
  bool all = exported;
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                    std::chrono::duration<double>(timeout_s));
  // Peers normally publish within the time a call takes: yield, never sleep,
  // for that long (a 20 us sleep wakes late by as much again on a busy host).
  const auto spin_until = start + std::chrono::milliseconds(2);
  bool sleeping = false;
  for (int q = 0; q < size; ++q) {
    if (q == rank_) continue;
    Entry* e = Entries(tables_[q]) + exchange % kEntries;
    host_meetings.fetch_add(1, std::memory_order_relaxed);
    if (e->w[0].load(std::memory_order_acquire) != exchange + 1)
      host_waits.fetch_add(1, std::memory_order_relaxed);
    for (uint64_t spins = 0; e->w[0].load(std::memory_order_acquire) != exchange + 1; ++spins) {
      if (Status st = check_(); !st.ok()) return st;
      if (spins % 256 == 255) {
        const auto now = std::chrono::steady_clock::now();
        sleeping = sleeping || now > spin_until;
        if (now > deadline)
          return Status::Timeout("jax_smddp (GPU): " + who_(q) + " did not enqueue call " +
                                 std::to_string(call) + " of the group within " +
                                 std::to_string(int(timeout_s)) +
                                 " s (its buffers are read in place, "
                                 "so every rank's host waits for the others' at each such call)");
      }
      if (sleeping) {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      } else {
        sched_yield();
      }
    }
    uint64_t w[8];
    uint8_t* at_input = nullptr;
    for (int k = 1; k < 8; ++k) w[k] = e->w[k].load(std::memory_order_relaxed);
    if (w[1] != call)
      return Status::Mismatch("jax_smddp (GPU): " + who_(q) + " is at call " +
                              std::to_string(w[1]) + " where this rank is at call " +
                              std::to_string(call) + " (the ranks ran different calls)");
    // Every handle is read when it is published, whether or not this call stages.
    if (w[2]) SMDDP_RETURN_IF_ERROR(Locate(q, w[2], w[3], w[4], &at_input));
    if (output && w[5]) SMDDP_RETURN_IF_ERROR(Locate(q, w[5], w[6], w[7], &(*outputs)[q]));
    (*inputs)[q] = at_input;
    if (exported && !(w[2] && (!output || w[5])) && !peer_told_) {
      peer_told_ = true;
      NoteStaged(who_(q) +
                 " could not share its buffers in place (its process says why on stderr)");
    }
    all = all && w[2] && (!output || w[5]);
  }
  if (!all) {
    inputs->clear();
    outputs->clear();
  }
  return Status::Ok();
}

}  // namespace smddp

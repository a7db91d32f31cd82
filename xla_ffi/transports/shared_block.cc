#include "xla_ffi/transports/shared_block.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <new>

#include "xla_ffi/common/protocol.h"
#include "xla_ffi/transports/process_liveness.h"
#include "xla_ffi/transports/shm_file.h"

namespace smddp {
namespace {

constexpr uint64_t kMagic = 0x4b4c425044444d53ull;  // "SMDDPBLK"
constexpr size_t kPage = 4096;
constexpr size_t kMaxBytes = size_t(1) << 30;

struct Header {
  uint64_t magic;
  uint32_t version;
  int32_t owner_pid;
  uint64_t owner_start_time;
  uint64_t data_bytes;
  std::atomic<int32_t> openers_left;  // the opener that takes it to 0 removes the name
  std::atomic<int32_t> state;         // SharedBlock::State; kFailed set after the two below
  int32_t quiet;
  char reason[1024];
};
static_assert(sizeof(Header) <= SharedBlock::kHeaderBytes, "header fits its page");
static_assert(std::atomic<int32_t>::is_always_lock_free, "counter in shared memory");

}  // namespace

Status SharedBlock::Create(size_t bytes, int openers, std::unique_ptr<SharedBlock>* out) {
  if (bytes == 0 || bytes > kMaxBytes)
    return Status::Error("shared block of " + std::to_string(bytes) + " bytes requested");
  const size_t data = (bytes + kPage - 1) / kPage * kPage;
  const size_t total = kHeaderBytes + data;
  std::string name;
  void* base = nullptr;
  SMDDP_RETURN_IF_ERROR(CreateShmFile(total, "use fewer GPU groups", &name, &base));
  auto* h = new (base) Header();
  h->magic = kMagic;
  h->version = WireProtocolVersion();  // the block's layout is part of the protocol
  h->owner_pid = int32_t(::getpid());
  h->owner_start_time = ProcessStartTime(::getpid());
  h->data_bytes = data;
  h->state.store(kOpen, std::memory_order_relaxed);
  h->openers_left.store(openers, std::memory_order_release);
  out->reset(new SharedBlock(static_cast<uint8_t*>(base), total, name, /*created=*/true));
  if (openers <= 0) UnlinkShmFile(name);
  return Status::Ok();
}

Status SharedBlock::Open(const std::string& name, size_t bytes, std::unique_ptr<SharedBlock>* out) {
  const size_t data = (bytes + kPage - 1) / kPage * kPage;
  void* base = nullptr;
  size_t mapped = 0;
  SMDDP_RETURN_IF_ERROR(
      OpenShmFile(name, "block", kHeaderBytes + data, kHeaderBytes + data, &base, &mapped));
  std::unique_ptr<SharedBlock> block(new SharedBlock(static_cast<uint8_t*>(base), mapped, name,
                                                     /*created=*/false));
  auto* h = reinterpret_cast<Header*>(base);
  if (h->magic != kMagic || h->version != WireProtocolVersion() || h->data_bytes != data)
    return Status::Error("shared-memory block " + name + " is not a jax_smddp block of " +
                         std::to_string(data) + " bytes (processes from different builds?)");
  if (h->openers_left.fetch_sub(1, std::memory_order_acq_rel) == 1) UnlinkShmFile(name);
  *out = std::move(block);
  return Status::Ok();
}

SharedBlock::~SharedBlock() {
  if (created_) UnlinkShmFile(name_);  // a peer that never opened it: nothing left behind
  ::munmap(base_, mapped_);
}

int SharedBlock::owner_pid() const { return reinterpret_cast<const Header*>(base_)->owner_pid; }

void SharedBlock::MarkClosed() {
  int32_t open = kOpen;
  reinterpret_cast<Header*>(base_)->state.compare_exchange_strong(open, kClosed,
                                                                  std::memory_order_acq_rel);
}

void SharedBlock::MarkFailed(const std::string& reason, bool quiet) {
  auto* h = reinterpret_cast<Header*>(base_);
  if (h->state.load(std::memory_order_acquire) == kFailed) return;  // the first reason stays
  std::strncpy(h->reason, reason.c_str(), sizeof(h->reason) - 1);
  h->reason[sizeof(h->reason) - 1] = '\0';
  h->quiet = quiet ? 1 : 0;
  h->state.store(kFailed, std::memory_order_release);
}

SharedBlock::State SharedBlock::state() const {
  return State(reinterpret_cast<const Header*>(base_)->state.load(std::memory_order_acquire));
}

void SharedBlock::Failure(std::string* reason, bool* quiet) const {
  const auto* h = reinterpret_cast<const Header*>(base_);
  *reason = std::string(h->reason, strnlen(h->reason, sizeof(h->reason)));
  *quiet = h->quiet != 0;
}

uint64_t SharedBlock::owner_start_time() const {
  return reinterpret_cast<const Header*>(base_)->owner_start_time;
}

}  // namespace smddp

// The shared-memory link's segment (shm_link.h): created, opened and
// unlinked, and the doorbells in it.
#include "xla_ffi/transports/shm_link.h"

#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <utility>

#include "xla_ffi/common/protocol.h"
#include "xla_ffi/common/settings.h"
#include "xla_ffi/transports/shm_file.h"
#include "xla_ffi/transports/shm_link_impl.h"

namespace smddp {
namespace shm {

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, unsigned max_us) {
  timespec timeout{time_t(max_us / 1000000), long(max_us % 1000000) * 1000};
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &timeout, nullptr,
            0);
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void Ring(Doorbell* bell) {
  bell->count.fetch_add(1, std::memory_order_seq_cst);
  if (bell->sleepers.load(std::memory_order_seq_cst) != 0) FutexWakeAll(&bell->count);
}

}  // namespace shm

using shm::kDataOffset;
using shm::kMagic;
using shm::kMaxRing;
using shm::kMinRing;
using shm::kPage;
using shm::Layout;
using shm::RoundUp;
using shm::SegmentHeader;

Status CreateShmSegment(size_t ring_bytes, std::string* name, std::shared_ptr<ShmSegment>* out) {
  if (ring_bytes > kMaxRing) {
    return Status::InvalidArgument("shared-memory ring of " + std::to_string(ring_bytes) +
                                   " bytes requested; at most " + std::to_string(kMaxRing) +
                                   " are supported");
  }
  const uint64_t ring = std::max<uint64_t>(kMinRing, RoundUp(ring_bytes, kPage));
  const uint64_t total = kDataOffset + 2 * ring;

  std::string nm;
  void* base = nullptr;
  SMDDP_RETURN_IF_ERROR(CreateShmFile(total, "lower JAX_SMDDP_SHM_RING_BYTES", &nm, &base));

  Layout* lay = new (base) Layout();
  lay->header.magic = kMagic;
  lay->header.version = WireProtocolVersion();
  lay->header.data_offset = uint32_t(kDataOffset);
  lay->header.ring_bytes = ring;
  lay->header.total_bytes = total;
  lay->side[0].pid.store(int32_t(::getpid()), std::memory_order_release);

  *name = nm;
  *out = std::make_shared<ShmSegment>(base, total, /*created_here=*/true);
  return Status::Ok();
}

Status OpenShmSegment(const std::string& name, std::shared_ptr<ShmSegment>* out) {
  void* base = nullptr;
  size_t size = 0;
  SMDDP_RETURN_IF_ERROR(OpenShmFile(name, "segment", kDataOffset + 2 * kMinRing,
                                    kDataOffset + 2 * kMaxRing, &base, &size));
  auto segment = std::make_shared<ShmSegment>(base, size, /*created_here=*/false);

  SegmentHeader h;
  std::memcpy(&h, base, sizeof(h));
  if (h.magic != kMagic) {
    return Status::Error("shared-memory segment " + name + " is not a jax_smddp link");
  }
  if (h.version != WireProtocolVersion()) {
    return Status::Protocol("shared-memory segment " + name + " is of wire protocol version " +
                            std::to_string(h.version) + ", this process speaks " +
                            std::to_string(WireProtocolVersion()) +
                            " (processes from different jax_smddp builds)");
  }
  if (h.data_offset != kDataOffset || h.ring_bytes < kMinRing || h.ring_bytes > kMaxRing ||
      h.ring_bytes % kPage != 0 || h.total_bytes != kDataOffset + 2 * h.ring_bytes ||
      h.total_bytes != size) {
    return Status::Error("shared-memory segment " + name + " has an inconsistent header");
  }
  Layout* lay = segment->layout();
  int32_t expected = 0;
  if (!lay->side[1].pid.compare_exchange_strong(expected, int32_t(::getpid()),
                                                std::memory_order_acq_rel)) {
    return Status::Error("shared-memory segment " + name + " is already in use by process " +
                         std::to_string(expected));
  }
  *out = std::move(segment);
  return Status::Ok();
}

Status UnlinkShmSegment(const std::string& name) { return UnlinkShmFile(name); }

size_t DefaultShmRingBytes() {
  return size_t(std::min<uint64_t>(uint64_t(IntSetting("JAX_SMDDP_SHM_RING_BYTES")), kMaxRing));
}

}  // namespace smddp

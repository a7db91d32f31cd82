#include "xla_ffi/common/huge_pages.h"

#include <sys/mman.h>

#include <cstdint>

#include "xla_ffi/common/heap_reuse.h"
#include "xla_ffi/common/settings.h"

namespace smddp {
namespace {

// The threshold where the heap policy does not apply (glibc's own maps blocks
// of 32 MiB at most afresh, adjusting as blocks are freed).
constexpr int64_t kMappedOutputHugePageBytes = int64_t(4) << 20;

}  // namespace

int64_t HugePageMinBytes() {
  int64_t bytes = 0;
  if (IntSettingIfSet("JAX_SMDDP_HUGE_PAGE_BYTES", &bytes)) return bytes;
  // Below the heap policy's threshold an output comes from glibc's kept heap:
  // fresh only when the heap grows, onto memory free for a while, which a
  // host that takes back free guest memory hands out slowest as huge pages
  // (docs/cpu_steadiness.md: 0.4 GB/s against 2.4 with 4 KiB pages). At and above
  // it, glibc maps each output afresh from memory just freed, where huge pages
  // write fastest (6.5 GB/s against 2.4).
  const HeapReusePolicy policy = HeapReuse();
  return policy.bytes > 0 ? policy.bytes : kMappedOutputHugePageBytes;
}

void AdviseHugePages(void* p, size_t bytes) {
  static const int64_t min_bytes = HugePageMinBytes();
  if (min_bytes <= 0 || int64_t(bytes) < min_bytes) return;
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHuge - 1);
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}

}  // namespace smddp

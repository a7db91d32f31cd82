#include "xla_ffi/common/huge_pages.h"

#include <sys/mman.h>

#include <cstdint>

#include "xla_ffi/common/settings.h"

namespace smddp {

void AdviseHugePages(void* p, size_t bytes) {
  static const int64_t min_bytes = IntSetting("JAX_SMDDP_HUGE_PAGE_BYTES");
  if (min_bytes <= 0 || int64_t(bytes) < min_bytes) return;
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHuge - 1);
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}

}  // namespace smddp

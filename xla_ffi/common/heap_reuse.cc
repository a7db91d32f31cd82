#include "xla_ffi/common/heap_reuse.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "xla_ffi/common/settings.h"

namespace smddp {

namespace {

std::atomic<bool> applied{false};

// The largest heap of a glibc arena other than the main one (HEAP_MAX_SIZE:
// twice the largest dynamic mmap threshold, 64 MiB on 64-bit hosts).
constexpr int64_t kArenaHeapBytes = int64_t(64) << 20;

// The first of glibc's own malloc settings found in the environment, or null.
const char* UserMallocSetting() {
  for (const char* name : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"})
    if (std::getenv(name) != nullptr) return name;
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (tunables != nullptr && std::strstr(tunables, "glibc.malloc.") != nullptr)
    return "GLIBC_TUNABLES (glibc.malloc.*)";
  return nullptr;
}

}  // namespace

HeapReusePolicy HeapReuse() {
  HeapReusePolicy p;
#if !defined(__GLIBC__)
  p.reason = "the C library is not glibc";
  return p;
#else
  const int64_t bytes = IntSetting("JAX_SMDDP_HEAP_REUSE_BYTES");
  if (bytes <= 0) {
    p.reason = "JAX_SMDDP_HEAP_REUSE_BYTES=0";
  } else if (const char* user = UserMallocSetting()) {
    p.reason = std::string(user) + " is set: glibc's malloc is tuned by the environment";
  } else {
    p.bytes = bytes;
  }
  return p;
#endif
}

void ApplyHeapReuse() {
  static std::once_flag once;
  std::call_once(once, [] {
#if defined(__GLIBC__)
    const HeapReusePolicy p = HeapReuse();
    if (p.bytes <= 0) return;
    // The trim threshold first: with it above the mmap threshold, a freed
    // output at the top of the heap is kept rather than returned at once, and
    // well above it (JAX_SMDDP_HEAP_TRIM_BYTES), the heap does not shrink to
    // its pad and regrow onto fresh pages as outputs come and go
    // (docs/cpu_steadiness.md). mallopt takes an int: the registry caps both
    // settings at 1G, and twice that is clamped.
    const int64_t trim_bytes =
        std::min<int64_t>(std::max(IntSetting("JAX_SMDDP_HEAP_TRIM_BYTES"), 2 * p.bytes), INT_MAX);
    const bool trim = mallopt(M_TRIM_THRESHOLD, int(trim_bytes)) == 1;
    const bool mmap = mallopt(M_MMAP_THRESHOLD, int(p.bytes)) == 1;
    // The trim threshold does not hold in a thread's own arena: glibc unmaps
    // any of its heaps but the first once everything in it is free, unless
    // the rest of the arena lacks room for M_TOP_PAD bytes. A pad of a whole
    // heap keeps them, for threads that got their arenas before
    // CapMallocArenas ran (jax_smddp imported after jax.distributed started
    // its threads). glibc only reserves the pad's address space.
    const bool pad = mallopt(M_TOP_PAD, int(kArenaHeapBytes)) == 1;
    applied = trim && mmap && pad;
#endif
  });
}

bool HeapReuseApplied() { return applied.load(); }

namespace {
int arenas_set = 0;
std::string arenas_reason = "not applied yet";
}  // namespace

void CapMallocArenas() {
  static std::once_flag once;
  std::call_once(once, [] {
#if !defined(__GLIBC__)
    arenas_reason = "the C library is not glibc";
#else
    const int64_t n = IntSetting("JAX_SMDDP_MALLOC_ARENAS");
    const char* tunables = std::getenv("GLIBC_TUNABLES");
    if (n <= 0) {
      arenas_reason = "JAX_SMDDP_MALLOC_ARENAS=0";
    } else if (std::getenv("MALLOC_ARENA_MAX") != nullptr) {
      arenas_reason = "MALLOC_ARENA_MAX is set: glibc's arenas are tuned by the environment";
    } else if (tunables != nullptr && std::strstr(tunables, "glibc.malloc.arena_max") != nullptr) {
      arenas_reason = "GLIBC_TUNABLES sets glibc.malloc.arena_max";
    } else if (mallopt(M_ARENA_MAX, int(n)) == 1) {
      arenas_set = int(n);
      arenas_reason.clear();
    } else {
      arenas_reason = "mallopt(M_ARENA_MAX) refused it";
    }
#endif
  });
}

int MallocArenas(std::string* reason) {
  if (reason) *reason = arenas_reason;
  return arenas_set;
}

}  // namespace smddp

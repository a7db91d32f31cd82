// glibc's heap kept for XLA's large host buffers.
//
// XLA's CPU client allocates every output afresh with malloc, and glibc maps
// allocations above its mmap threshold (32 MiB at most, adjusted as blocks
// are freed) with a new mmap each time: each call then page-faults on its
// output and the kernel zeroes every page before the collective copies into
// it. A 2-process all_gather of 16 MiB per rank (a 32 MiB output) spent about
// half its time there. Raising the threshold (and the trim threshold,
// so freed memory stays in the heap) lets glibc hand the same memory back call
// after call.
#ifndef JAX_SMDDP_COMMON_HEAP_REUSE_H_
#define JAX_SMDDP_COMMON_HEAP_REUSE_H_

#include <cstdint>
#include <string>

namespace smddp {

struct HeapReusePolicy {
  int64_t bytes = 0;   // mmap threshold to set; 0: glibc's policy is left alone
  std::string reason;  // why it is left alone (empty when bytes > 0)
};

// What ApplyHeapReuse would do in this process: JAX_SMDDP_HEAP_REUSE_BYTES
// (or its declared default), unless it is 0, the user tuned glibc's malloc through its own
// environment (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_,
// glibc.malloc tunables), or the C library is not glibc.
HeapReusePolicy HeapReuse();

// Applies the policy once per process (mallopt M_MMAP_THRESHOLD = bytes,
// M_TRIM_THRESHOLD = JAX_SMDDP_HEAP_TRIM_BYTES or 2 * bytes, the larger, at
// most INT_MAX, and M_TOP_PAD = 64 MiB so
// that per-thread arenas keep their emptied heaps too). Called when the first CPU
// collective is set up, so a process that only imports jax_smddp keeps
// glibc's thresholds (its arenas: CapMallocArenas, below).
void ApplyHeapReuse();

// Whether ApplyHeapReuse changed glibc's thresholds in this process.
bool HeapReuseApplied();

// glibc's arenas capped at JAX_SMDDP_MALLOC_ARENAS (mallopt M_ARENA_MAX), once
// per process, when jax_smddp's CPU module loads: XLA's CPU device threads,
// started later, then allocate from the heaps the policy above keeps (a
// per-thread arena unmaps a heap once everything in it is freed, so each
// call's output would land on fresh pages). Left alone where the setting is
// 0, the environment tunes arenas itself, or the C library is not glibc.
void CapMallocArenas();
// The cap set in this process (0: none), and why none when so.
int MallocArenas(std::string* reason);

}  // namespace smddp

#endif  // JAX_SMDDP_COMMON_HEAP_REUSE_H_

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
// M_TRIM_THRESHOLD = 2 * bytes, at most INT_MAX). Called when the first CPU
// collective is set up, so a process that only imports jax_smddp keeps
// glibc's defaults.
void ApplyHeapReuse();

// Whether ApplyHeapReuse changed glibc's thresholds in this process.
bool HeapReuseApplied();

}  // namespace smddp

#endif  // JAX_SMDDP_COMMON_HEAP_REUSE_H_

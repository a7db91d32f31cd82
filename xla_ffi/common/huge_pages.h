// Transparent huge pages for large collective outputs.
//
// XLA's CPU client maps a fresh buffer for most large outputs, so a
// collective's first write to each 4 KiB page takes a page fault (and the
// kernel zeroes the page): on this project's machines that first touch costs
// as much as the copy itself. Advising the kernel to back the output with
// 2 MiB pages (madvise MADV_HUGEPAGE, which the default "madvise" THP mode
// honours) turns 512 faults into one.
#ifndef JAX_SMDDP_COMMON_HUGE_PAGES_H_
#define JAX_SMDDP_COMMON_HUGE_PAGES_H_

#include <cstddef>

namespace smddp {

// Advises huge pages for the whole 2 MiB pages inside [p, p + bytes) when
// bytes >= JAX_SMDDP_HUGE_PAGE_BYTES (0: never). Advice only:
// pages already there stay, and where THP is off this does nothing.
void AdviseHugePages(void* p, size_t bytes);

}  // namespace smddp

#endif  // JAX_SMDDP_COMMON_HUGE_PAGES_H_

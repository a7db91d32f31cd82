// Transparent huge pages for large collective outputs.
//
// An output that glibc maps afresh takes a page fault, and the kernel zeroes
// the page, at the collective's first write to each 4 KiB page: on this
// project's machines that first touch costs as much as the copy itself.
// Advising the kernel to back the output with 2 MiB pages (madvise
// MADV_HUGEPAGE, which the default "madvise" THP mode honours) turns 512
// faults into one, and memory freed a moment before is zeroed faster so.
// Outputs glibc serves from the heap the heap policy keeps (heap_reuse.h) are
// left alone: they are fresh only when the heap grows, and on a virtual
// machine whose host takes back free memory, huge pages of memory free for a
// while are the slowest to fault in.
#ifndef JAX_SMDDP_COMMON_HUGE_PAGES_H_
#define JAX_SMDDP_COMMON_HUGE_PAGES_H_

#include <cstddef>
#include <cstdint>

namespace smddp {

// The smallest output advised: JAX_SMDDP_HUGE_PAGE_BYTES when set (0:
// never), else the heap policy's threshold (outputs glibc maps afresh), or
// 4 MiB where that policy is off.
int64_t HugePageMinBytes();

// Advises huge pages for the whole 2 MiB pages inside [p, p + bytes) when
// bytes >= HugePageMinBytes() (0: never). Advice only: pages already there
// stay, and where THP is off this does nothing.
void AdviseHugePages(void* p, size_t bytes);

}  // namespace smddp

#endif  // JAX_SMDDP_COMMON_HUGE_PAGES_H_

// What the benchmarks measure a GPU's own rates with, beside the collectives
// (jax_smddp/tools/gpu_bench.py, tests/gpu/test_kernels.py,
// scripts/gpu_block_sweep.py): the device copy rate and one bare reduction
// kernel, each the best of several runs timed by CUDA events on a stream of
// its own. Errors name the CUDA call that failed.
#ifndef JAX_SMDDP_CUDA_MICROBENCHMARKS_H_
#define JAX_SMDDP_CUDA_MICROBENCHMARKS_H_

#include <cstddef>

#include "xla_ffi/common/status.h"

namespace smddp {
namespace cuda {

// Device-to-device copy bandwidth on `ordinal` (bytes copied per second by
// cudaMemcpyAsync of `bytes`, best of `iters`): the benchmark's reference.
Status CopyBandwidth(int ordinal, size_t bytes, int iters, double* bytes_per_second);

// Seconds one bare reduction kernel takes (best of `iters`): f32 sum of
// `sources` buffers of `bytes` each into one, within `max_blocks` blocks, as
// the stream algorithms launch it. The benchmark's reference for what the SM
// budget allows the reductions, beside the copy rate (what the device allows).
// `unroll` 2: the kernel with twice the loads in flight per thread (kernels.h).
// `sources` outside 1..kMaxSources is an InvalidArgument error.
Status ReduceSeconds(int ordinal, size_t bytes, int sources, int max_blocks, int iters, int unroll,
                     double* seconds);

}  // namespace cuda
}  // namespace smddp

#endif  // JAX_SMDDP_CUDA_MICROBENCHMARKS_H_

// The driver API types cuda/cuda_stream_ops.cc uses, for the mock node
// (cuda_runtime_api.h beside this file; the entry points come through
// cudaGetDriverEntryPointByVersion).
#ifndef JAX_SMDDP_TESTS_MOCK_NODE_CUDA_H_
#define JAX_SMDDP_TESTS_MOCK_NODE_CUDA_H_

#include "cuda_runtime_api.h"

typedef int CUresult;
typedef struct CUstream_st* CUstream;
typedef unsigned long long CUdeviceptr;
typedef uint32_t cuuint32_t;
enum : int { CUDA_SUCCESS = 0 };
enum : unsigned { CU_STREAM_WAIT_VALUE_GEQ = 0x0, CU_STREAM_WRITE_VALUE_DEFAULT = 0x0 };
typedef enum {
  CU_STREAM_MEM_OP_WAIT_VALUE_32 = 1,
  CU_STREAM_MEM_OP_WRITE_VALUE_32 = 2
} CUstreamBatchMemOpType;
// The fields cuStreamBatchMemOp's waits and writes use, laid out as CUDA's.
typedef union {
  CUstreamBatchMemOpType operation;
  struct {
    CUstreamBatchMemOpType operation;
    CUdeviceptr address;
    union {
      cuuint32_t value;
      unsigned long long value64;
    };
    unsigned int flags;
    CUdeviceptr alias;
  } waitValue, writeValue;
  unsigned long long pad[6];
} CUstreamBatchMemOpParams;

#endif  // JAX_SMDDP_TESTS_MOCK_NODE_CUDA_H_

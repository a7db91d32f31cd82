// The part of NCCL's C ABI the front end reads or returns (types, enum
// values, the config struct's fixed head), declared from NCCL's documented
// API; everything else passes through to the real library untouched.
#ifndef JAX_SMDDP_CUDA_NCCLAPI_NCCL_TYPES_H_
#define JAX_SMDDP_CUDA_NCCLAPI_NCCL_TYPES_H_

#include <cstddef>
#include <cstdint>

extern "C" {

typedef struct ncclComm* ncclComm_t;

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
  char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
} ncclResult_t;

typedef enum {
  ncclInt8 = 0,
  ncclUint8 = 1,
  ncclInt32 = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6,
  ncclFloat32 = 7,
  ncclFloat64 = 8,
  ncclBfloat16 = 9,
  ncclFloat8e4m3 = 10,
  ncclFloat8e5m2 = 11,
} ncclDataType_t;

typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4 } ncclRedOp_t;

// The head every ncclConfig_t version shares (NCCL >= 2.14): the caller's
// struct is read through it only after `magic` and `version` are checked,
// and handed to the real library as it came.
struct ncclConfigHead {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
};
typedef struct ncclConfigHead ncclConfig_t;

typedef struct ncclSimInfo ncclSimInfo_t;

}  // extern "C"

namespace smddp {
namespace nccl {

constexpr unsigned int kConfigMagic = 0xcafebeef;
constexpr int kNoColor = -1;  // NCCL_SPLIT_NOCOLOR
// NCCL versions (major * 10000 + minor * 100 + patch) whose config and entry
// points this front end was checked against: the range jaxlib's CUDA plugins
// require (nvidia-nccl-cu12/13 >= 2.27.7) up to the newest wheel seen.
constexpr int kOldestKnownVersion = 22700;
constexpr int kNewestKnownVersion = 23399;

}  // namespace nccl
}  // namespace smddp

#endif  // JAX_SMDDP_CUDA_NCCLAPI_NCCL_TYPES_H_

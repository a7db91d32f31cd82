// The engine's Status as an XLA FFI error (shared by the CPU and CUDA
// handlers). The code picks the canonical status that JAX's runtime error
// text starts with ("DEADLINE_EXCEEDED: ..."), and the message is tagged
// (TaggedMessage, status.h) so that jax_smddp.errors.classify can tell a
// collective's failure, and its kind, from any other runtime error.
#ifndef JAX_SMDDP_FFI_FFI_STATUS_H_
#define JAX_SMDDP_FFI_FFI_STATUS_H_

#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/common/status.h"

namespace smddp {

inline xla::ffi::ErrorCode ToFfiErrorCode(StatusCode code) {
  using xla::ffi::ErrorCode;
  switch (code) {
    case StatusCode::kOk:
      return ErrorCode::kOk;
    case StatusCode::kTimeout:
      return ErrorCode::kDeadlineExceeded;
    case StatusCode::kPeerFailed:
      return ErrorCode::kUnavailable;
    case StatusCode::kMismatch:
      return ErrorCode::kFailedPrecondition;
    case StatusCode::kUnsupported:
      return ErrorCode::kUnimplemented;
    case StatusCode::kInvalidArgument:
      return ErrorCode::kInvalidArgument;
    case StatusCode::kProtocol:
      return ErrorCode::kDataLoss;
    case StatusCode::kInternal:
      return ErrorCode::kInternal;
  }
  return ErrorCode::kInternal;
}

inline xla::ffi::Error ToFfiError(const Status& st) {
  if (st.ok()) return xla::ffi::Error::Success();
  return xla::ffi::Error(ToFfiErrorCode(st.code()), TaggedMessage(st.code(), st.message()));
}

}  // namespace smddp

#endif  // JAX_SMDDP_FFI_FFI_STATUS_H_

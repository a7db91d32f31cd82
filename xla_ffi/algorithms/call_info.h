// What every rank of one call must agree on (CallInfo), and the clock every
// deadline is measured on. Shared by the cross-process bodies (process_call.h)
// and the engine's rendezvous (engine/rendezvous.h).
#ifndef JAX_SMDDP_ALGORITHMS_CALL_INFO_H_
#define JAX_SMDDP_ALGORITHMS_CALL_INFO_H_

#include <chrono>
#include <cstdint>
#include <string>

#include "xla_ffi/common/dtype.h"

namespace smddp {

using Clock = std::chrono::steady_clock;

// What every rank of one call must agree on; checked when the call opens so
// that mismatched programs fail loudly instead of mixing data.
struct CallInfo {
  const char* op = "";
  DType dtype = DType::kFloat32;
  ReduceOp reduce = ReduceOp::kSum;
  uint64_t send_bytes = 0;
  uint64_t recv_bytes = 0;
  bool operator==(const CallInfo& o) const {
    return std::string(op) == o.op && dtype == o.dtype && reduce == o.reduce &&
           send_bytes == o.send_bytes && recv_bytes == o.recv_bytes;
  }
};

}  // namespace smddp

#endif  // JAX_SMDDP_ALGORITHMS_CALL_INFO_H_

// A small status type for the engine: the engine knows nothing of XLA, so it
// cannot use ffi::Error; handlers translate it at the boundary.
#ifndef JAX_SMDDP_COMMON_STATUS_H_
#define JAX_SMDDP_COMMON_STATUS_H_

#include <string>
#include <utility>

namespace smddp {

class Status {
 public:
  Status() = default;
  static Status Ok() { return Status(); }
  static Status Error(std::string message) {
    Status s;
    s.ok_ = false;
    s.message_ = std::move(message);
    return s;
  }
  bool ok() const { return ok_; }
  const std::string& message() const { return message_; }

 private:
  bool ok_ = true;
  std::string message_;
};

#define SMDDP_RETURN_IF_ERROR(expr)        \
  do {                                     \
    ::smddp::Status _st = (expr);          \
    if (!_st.ok()) return _st;             \
  } while (0)

}  // namespace smddp

#endif  // JAX_SMDDP_COMMON_STATUS_H_

// A small status type for the engine: the engine knows nothing of XLA, so it
// cannot use ffi::Error; handlers translate it at the boundary. Besides its
// message a failure carries a code (what kind of failure, so that users can
// react to a dead peer differently from a mismatch without parsing text) and,
// where known, the peers it concerns.
#ifndef JAX_SMDDP_COMMON_STATUS_H_
#define JAX_SMDDP_COMMON_STATUS_H_

#include <string>
#include <utility>
#include <vector>

namespace smddp {

enum class StatusCode {
  kOk = 0,
  kTimeout,          // a peer missed the deadline (never arrived, stalled)
  kPeerFailed,       // a peer process died, its link closed, or it failed earlier
  kMismatch,         // ranks or processes disagree on the call (shape, dtype, op)
  kUnsupported,      // a case the engine does not take
  kInvalidArgument,  // a bad argument or set-up (replica groups, settings, not initialized)
  kProtocol,  // a peer sent what this process cannot parse (a malformed chunk: another build)
  kInternal,  // anything else: a bug or a system failure (out of memory, mmap)
};

// "timeout", "peer_failed", ...: the names Python's jax_smddp.errors uses.
inline const char* StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "ok";
    case StatusCode::kTimeout:
      return "timeout";
    case StatusCode::kPeerFailed:
      return "peer_failed";
    case StatusCode::kMismatch:
      return "mismatch";
    case StatusCode::kUnsupported:
      return "unsupported";
    case StatusCode::kInvalidArgument:
      return "invalid_argument";
    case StatusCode::kProtocol:
      return "protocol";
    case StatusCode::kInternal:
      return "internal";
  }
  return "internal";
}

class Status {
 public:
  Status() = default;
  static Status Ok() { return Status(); }
  static Status WithCode(StatusCode code, std::string message) {
    Status s;
    s.code_ = code == StatusCode::kOk ? StatusCode::kInternal : code;
    s.message_ = std::move(message);
    return s;
  }
  // A failure of no particular kind (kInternal).
  static Status Error(std::string message) {
    return WithCode(StatusCode::kInternal, std::move(message));
  }
  static Status Timeout(std::string message) {
    return WithCode(StatusCode::kTimeout, std::move(message));
  }
  static Status PeerFailed(std::string message) {
    return WithCode(StatusCode::kPeerFailed, std::move(message));
  }
  static Status Mismatch(std::string message) {
    return WithCode(StatusCode::kMismatch, std::move(message));
  }
  static Status Unsupported(std::string message) {
    return WithCode(StatusCode::kUnsupported, std::move(message));
  }
  static Status InvalidArgument(std::string message) {
    return WithCode(StatusCode::kInvalidArgument, std::move(message));
  }
  static Status Protocol(std::string message) {
    return WithCode(StatusCode::kProtocol, std::move(message));
  }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // The peers the failure concerns: their ranks in the group and their
  // processes (either may be empty where unknown).
  const std::vector<int>& peer_ranks() const { return peer_ranks_; }
  const std::vector<int>& peer_processes() const { return peer_processes_; }
  Status& SetPeers(std::vector<int> ranks, std::vector<int> processes) {
    peer_ranks_ = std::move(ranks);
    peer_processes_ = std::move(processes);
    return *this;
  }

  // The same failure (code and peers kept) with another message: for a
  // caller that adds where it happened, so the first cause's kind survives.
  Status WithMessage(std::string message) const {
    Status s = *this;
    s.message_ = std::move(message);
    return s;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
  std::vector<int> peer_ranks_;
  std::vector<int> peer_processes_;
};

// The message as Python sees it, tagged with the failure's kind so that
// jax_smddp.errors.classify can tell a collective's failure, and its kind,
// from any other runtime error (FFI handlers and the MPI front end alike):
// "jax_smddp all_gather (op 0 ...): ..." -> "jax_smddp[timeout] all_gather (op 0 ...): ...";
// a message that does not start with "jax_smddp" gets "jax_smddp[timeout] " in front.
inline std::string TaggedMessage(StatusCode code, const std::string& message) {
  static const std::string kName = "jax_smddp";
  const std::string tag = kName + "[" + StatusCodeName(code) + "]";
  if (message.compare(0, kName.size(), kName) == 0) return tag + message.substr(kName.size());
  return tag + " " + message;
}

#define SMDDP_RETURN_IF_ERROR(expr) \
  do {                              \
    ::smddp::Status _st = (expr);   \
    if (!_st.ok()) return _st;      \
  } while (0)

}  // namespace smddp

#endif  // JAX_SMDDP_COMMON_STATUS_H_

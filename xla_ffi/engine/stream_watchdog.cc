#include "xla_ffi/engine/stream_watchdog.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <thread>

#include "xla_ffi/algorithms/stream_ops.h"  // ReleasedFlag
#include "xla_ffi/engine/call_log.h"
#include "xla_ffi/engine/communicator.h"  // TimeoutSeconds
#include "xla_ffi/transports/process_liveness.h"
#include "xla_ffi/transports/shared_block.h"

namespace smddp {

Status WatchedGroup::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_.load(std::memory_order_relaxed) ? error_ : Status::Ok();
}

void WatchedGroup::Fail(const Status& failure, const std::string& reason, bool quiet) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_.load(std::memory_order_relaxed)) return;
    error_ = failure;
    failed_.store(true, std::memory_order_release);
  }
  for (SharedBlock* block : own_blocks_) block->MarkFailed(reason, quiet);
}

void WatchedGroup::FailBecauseOf(const std::string& cause, StatusCode code, bool quiet,
                                 const std::string& root) {
  const std::string text =
      "jax_smddp: " + cause + "; this group's collectives cannot complete: " +
      (all_flags_.empty() ? "streams waiting on it stay blocked (its flags are in device "
                            "memory, JAX_SMDDP_GPU_FLAG_MEMORY=device; the default, host, lets "
                            "jax_smddp release them)"
                          : "the calls in flight were released with undefined output") +
      ", and every later call fails. Restart the job.";
  Fail(Status::WithCode(code, text), root.empty() ? cause : root, quiet);
  // Every flag released, so every stream waiting goes on (and kept so by
  // Check(): live peers may still write theirs).
  ReleaseFlags();
  if (!quiet) std::fprintf(stderr, "%s\n", text.c_str());  // a stream may be blocked: say it now
}

void WatchedGroup::ReleaseFlags() {
  if (all_flags_.empty()) return;
  if (!released_) {
    released_value_ = ReleasedFlag(step_reached_ ? step_reached_() : 0);
    released_ = true;
  }
  for (uint32_t* flag : all_flags_) __atomic_store_n(flag, released_value_, __ATOMIC_RELEASE);
  for (uint32_t* token : all_tokens_) __atomic_store_n(token, kReleasedToken, __ATOMIC_RELEASE);
}

bool WatchedGroup::Check() {
  if (failed()) {
    ReleaseFlags();
    return false;
  }
  auto state_of = [](const WatchedPeer& peer) {
    int32_t state = SharedBlock::kOpen;
    for (const SharedBlock* b : peer.blocks) state = std::max<int32_t>(state, b->state());
    return state;
  };
  // A peer whose group failed first, with its root cause (else every process
  // would name the one that told it, not what went wrong).
  for (const WatchedPeer& peer : peers_) {
    for (const SharedBlock* b : peer.blocks) {
      if (b->state() != SharedBlock::kFailed) continue;
      std::string reason;
      bool quiet = false;
      b->Failure(&reason, &quiet);
      const size_t colon = reason.find(": ");
      if (reason.rfind("jax_smddp", 0) == 0 && colon != std::string::npos)
        reason = reason.substr(colon + 2);  // its "jax_smddp (GPU): " prefix
      // That peer failed earlier (whatever its own cause): for this process, a failed peer.
      FailBecauseOf(reason + " (reported by " + peer.who + ")", StatusCode::kPeerFailed, quiet,
                    reason);
      return true;
    }
  }
  // A peer that died or finished.
  for (const WatchedPeer& peer : peers_) {
    const bool closed = state_of(peer) == SharedBlock::kClosed;
    const std::string why = closed ? "it closed the group: its process finished or released "
                                     "jax_smddp's GPU groups"
                                   : CheckProcess(peer.pid, peer.start_time);
    if (why.empty()) continue;
    FailBecauseOf(peer.who + " of " + name_ + " is gone (" + why + ")", StatusCode::kPeerFailed,
                  /*quiet=*/closed);
    return true;
  }
  // Progress: a peer that has not logged a call this process logged, for
  // longer than the timeout, is late (alive but stuck, or it skipped a call).
  if (own_logs_.empty()) return false;
  uint64_t mine = 0;
  for (const uint8_t* log : own_logs_) mine = std::max(mine, CallLog::Calls(log));
  const double timeout = TimeoutSeconds();
  const auto now = std::chrono::steady_clock::now();
  if (lag_.size() != peers_.size()) lag_.resize(peers_.size());
  for (size_t i = 0; i < peers_.size(); ++i) {
    const WatchedPeer& peer = peers_[i];
    if (peer.call_logs.empty()) continue;
    uint64_t theirs = UINT64_MAX;
    for (const uint8_t* log : peer.call_logs) theirs = std::min(theirs, CallLog::Calls(log));
    Lag& lag = lag_[i];
    if (theirs >= mine) {
      lag.behind = false;
    } else if (!lag.behind || theirs != lag.calls) {
      lag = Lag{theirs, now, true};
    } else if (timeout > 0 && now - lag.since > std::chrono::duration<double>(timeout)) {
      const std::string call = CallLog::Describe(own_logs_[0], theirs);
      FailBecauseOf(peer.who + " of " + name_ + " has not reached call #" + std::to_string(theirs) +
                        " of the group" + (call.empty() ? "" : " (" + call + ")") + " within " +
                        std::to_string(int(timeout)) +
                        " s of this process (set by "
                        "jax_smddp.set_timeout or JAX_SMDDP_TIMEOUT_S): it is stuck, or it "
                        "skipped the call",
                    StatusCode::kTimeout, /*quiet=*/false);
      return true;
    }
  }
  return false;
}

namespace {

class Watchdog {
 public:
  void Add(std::shared_ptr<WatchedGroup> group) {
    std::lock_guard<std::mutex> lock(mu_);
    groups_.push_back(std::move(group));
    if (!running_) {
      if (thread_.joinable()) thread_.join();  // one that stopped with no groups left
      running_ = true;
      thread_ = std::thread([this] { Loop(); });
    }
  }
  void Remove(const WatchedGroup* group) {
    std::lock_guard<std::mutex> lock(mu_);  // the thread checks under it
    for (size_t i = 0; i < groups_.size(); ++i) {
      if (groups_[i].get() == group) {
        groups_.erase(groups_.begin() + long(i));
        break;
      }
    }
    cv_.notify_all();
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!groups_.empty()) {
      for (auto& g : groups_) g->Check();
      cv_.wait_for(lock, std::chrono::milliseconds(50));
    }
    running_ = false;
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<WatchedGroup>> groups_;
  bool running_ = false;
  std::thread thread_;
};

Watchdog& TheWatchdog() {
  static Watchdog* w = new Watchdog();  // never destroyed: the thread may outlive statics
  return *w;
}

}  // namespace

void Watch(std::shared_ptr<WatchedGroup> group) { TheWatchdog().Add(std::move(group)); }
void Unwatch(const WatchedGroup* group) { TheWatchdog().Remove(group); }

}  // namespace smddp

#include "xla_ffi/engine/stream_watchdog.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <thread>

#include "xla_ffi/engine/call_log.h"
#include "xla_ffi/engine/communicator.h"  // TimeoutSeconds
#include "xla_ffi/engine/process_liveness.h"

namespace smddp {

Status WatchedGroup::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_.load(std::memory_order_relaxed) ? Status::Error(error_) : Status::Ok();
}

void WatchedGroup::Fail(const std::string& message) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_.load(std::memory_order_relaxed)) return;
  error_ = message;
  failed_.store(true, std::memory_order_release);
}

void WatchedGroup::FailBecauseOf(const WatchedPeer& peer, const std::string& message, bool say) {
  // Its flags: set to their largest value, so every stream waiting on it
  // goes on (and kept so, Check() rewrites them: a late peer may write them).
  for (uint32_t* flag : peer.release) {
    __atomic_store_n(flag, UINT32_MAX, __ATOMIC_RELEASE);
    released_.push_back(flag);
  }
  const std::string text =
      "jax_smddp: " + message + "; this group's collectives cannot complete: " +
      (peer.release.empty() ? "streams waiting on it stay blocked (its flags are in device "
                              "memory; JAX_SMDDP_GPU_FLAG_MEMORY=host lets jax_smddp release them)"
                            : "the call in flight was released with undefined output") +
      ", and every later call fails. Restart the job.";
  Fail(text);
  if (say) std::fprintf(stderr, "%s\n", text.c_str());  // a stream may be blocked: say it now
}

bool WatchedGroup::Check() {
  if (failed()) {
    for (uint32_t* flag : released_) __atomic_store_n(flag, UINT32_MAX, __ATOMIC_RELEASE);
    return false;
  }
  for (const WatchedPeer& peer : peers_) {
    bool closed = false;
    for (const auto* flag : peer.closed) closed |= flag->load(std::memory_order_acquire) != 0;
    const std::string why = closed ? "it closed the group: its process finished or released "
                                     "jax_smddp's GPU groups"
                                   : CheckProcess(peer.pid, peer.start_time);
    if (why.empty()) continue;
    FailBecauseOf(peer, peer.who + " of " + name_ + " is gone (" + why + ")", /*say=*/!closed);
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
      FailBecauseOf(peer,
                    peer.who + " of " + name_ + " has not reached call #" + std::to_string(theirs) +
                        " of the group" + (call.empty() ? "" : " (" + call + ")") + " within " +
                        std::to_string(int(timeout)) + " s of this process (set by "
                        "jax_smddp.set_timeout or JAX_SMDDP_TIMEOUT_S): it is stuck, or it "
                        "skipped the call",
                    /*say=*/true);
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

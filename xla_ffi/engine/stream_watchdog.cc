#include "xla_ffi/engine/stream_watchdog.h"

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <thread>

#include "xla_ffi/engine/process_liveness.h"

namespace smddp {

void WatchedGroup::AddPeer(int pid, uint64_t start_time, std::string who,
                           std::vector<uint32_t*> release,
                           std::vector<const std::atomic<int32_t>*> closed) {
  peers_.push_back(Peer{pid, start_time, std::move(who), std::move(release), std::move(closed)});
}

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

bool WatchedGroup::Check() {
  if (failed()) return false;
  for (const Peer& peer : peers_) {
    bool closed = false;
    for (const auto* flag : peer.closed) closed |= flag->load(std::memory_order_acquire) != 0;
    const std::string why = closed ? "it closed the group: its process finished or released "
                                     "jax_smddp's GPU groups"
                                   : CheckProcess(peer.pid, peer.start_time);
    if (why.empty()) continue;
    // Nothing but the dead process wrote these flags: setting them cannot
    // race with a live writer, and it lets every waiting stream go on.
    for (uint32_t* flag : peer.release) __atomic_store_n(flag, UINT32_MAX, __ATOMIC_RELEASE);
    std::string message = "jax_smddp: " + peer.who + " of " + name_ + " is gone (" + why +
                          "); this group's collectives cannot complete: " +
                          (peer.release.empty()
                               ? "streams waiting on it stay blocked (its flags are in device "
                                 "memory; JAX_SMDDP_GPU_FLAG_MEMORY=host lets jax_smddp release "
                                 "them)"
                               : "the call in flight was released with undefined output") +
                          ", and every later call fails. Restart the job.";
    Fail(message);
    if (!closed) std::fprintf(stderr, "%s\n", message.c_str());  // it died: say so now
    return true;
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

// Notices when a process whose ranks a stream-ordered group waits on exits.
// A GPU stream waiting on a dead peer's flag would wait forever, and the
// host never blocks on it (the handlers only enqueue), so nothing would
// report it. One thread per process checks every watched peer process every
// 50 ms; when one is gone it records an error naming the rank and process
// (every later call of the group fails with it), prints it at once, and sets
// the flags only the dead process would have written to their largest value,
// so that no waiting stream hangs: the call in flight completes with
// undefined output, the next call raises. Flags can be released this way only
// where the host can write them (host memory the GPU addresses); groups whose
// flags are in device memory get the error and the message, and their
// streams stay blocked.
#ifndef JAX_SMDDP_ENGINE_STREAM_WATCHDOG_H_
#define JAX_SMDDP_ENGINE_STREAM_WATCHDOG_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "xla_ffi/engine/status.h"

namespace smddp {

// One peer process of a watched group.
struct WatchedPeer {
  int pid = 0;
  uint64_t start_time = 0;  // of `pid`, as /proc says (0: unknown)
  std::string who;          // its ranks, "rank 2 (process 1, pid 123)"
  // Flags only its ranks write (host addresses): set to UINT32_MAX when the
  // group fails because of it.
  std::vector<uint32_t*> release;
  // Set when it finished in order (it released its groups, or exited
  // normally): the group fails all the same, without a message on stderr
  // (the end of every job would print one otherwise).
  std::vector<const std::atomic<int32_t>*> closed;
  // Its ranks' call logs (call_log.h), for the progress deadline.
  std::vector<const uint8_t*> call_logs;
};

class WatchedGroup {
 public:
  // `name` describes the group in messages ("GPU group [0, 1, 2, 3]").
  explicit WatchedGroup(std::string name) : name_(std::move(name)) {}

  void AddPeer(WatchedPeer peer) { peers_.push_back(std::move(peer)); }
  // This process's ranks' call logs: with them, a peer that has not logged
  // a call this process logged within jax_smddp's timeout (set_timeout,
  // JAX_SMDDP_TIMEOUT_S) fails the group naming it and the call, as a
  // deadline does on CPU, and its flags are released.
  void SetOwnCallLogs(std::vector<const uint8_t*> logs) { own_logs_ = std::move(logs); }

  // Marks the group failed for another reason (every later call fails with
  // `message`); the first failure is kept.
  void Fail(const std::string& message);

  // Whether a peer died: the per-call check, without a lock.
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  Status error() const;

  // Checks the peers once (the watchdog thread calls it); true if the group
  // failed now. Once failed, keeps setting the released flags (a live but
  // late peer may still write them).
  bool Check();

 private:
  void FailBecauseOf(const WatchedPeer& peer, const std::string& message, bool say);

  struct Lag {
    uint64_t calls = 0;  // the peer's calls when last seen
    std::chrono::steady_clock::time_point since;  // behind this process since
    bool behind = false;
  };
  std::string name_;
  std::vector<WatchedPeer> peers_;  // set before the group is watched, then read-only
  std::vector<const uint8_t*> own_logs_;
  std::vector<Lag> lag_;               // by peer (the watchdog thread only)
  std::vector<uint32_t*> released_;    // (the watchdog thread only)
  mutable std::mutex mu_;
  std::string error_;
  std::atomic<bool> failed_{false};
};

// Starts watching `group` (the process's watchdog thread starts with the
// first group and stops when none is left).
void Watch(std::shared_ptr<WatchedGroup> group);
// Stops watching it; once this returns the thread no longer touches it.
void Unwatch(const WatchedGroup* group);

}  // namespace smddp

#endif  // JAX_SMDDP_ENGINE_STREAM_WATCHDOG_H_

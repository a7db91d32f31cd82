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
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "xla_ffi/engine/status.h"

namespace smddp {

class WatchedGroup {
 public:
  // `name` describes the group in messages ("GPU group [0, 1, 2, 3]").
  explicit WatchedGroup(std::string name) : name_(std::move(name)) {}

  // Process `pid` (started at `start_time`, as /proc says; 0 if unknown)
  // holds the ranks `who` describes ("rank 2 (process 1)"); when it exits,
  // every flag of `release` (host addresses) is set to UINT32_MAX. When one
  // of `closed` is set first, the process finished in order (it released
  // its groups, or exited normally): the group fails all the same, without a
  // message on stderr (the end of every job would print one otherwise).
  void AddPeer(int pid, uint64_t start_time, std::string who, std::vector<uint32_t*> release,
               std::vector<const std::atomic<int32_t>*> closed = {});

  // Marks the group failed for another reason (every later call fails with
  // `message`); the first failure is kept.
  void Fail(const std::string& message);

  // Whether a peer died: the per-call check, without a lock.
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  Status error() const;

  // Checks the peers once (the watchdog thread calls it); true if one died now.
  bool Check();

 private:
  struct Peer {
    int pid;
    uint64_t start_time;
    std::string who;
    std::vector<uint32_t*> release;
    std::vector<const std::atomic<int32_t>*> closed;
  };
  std::string name_;
  std::vector<Peer> peers_;  // set before the group is watched, then read-only
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

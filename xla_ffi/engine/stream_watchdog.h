// Notices when a stream-ordered group cannot go on because of another
// process: a peer that died, finished, stalled past the timeout, or whose
// own group failed. A GPU stream waiting on such a peer's flag would wait
// forever, and the host never blocks on it (the handlers only enqueue), so
// nothing would report it. One thread per process checks every watched
// group every 50 ms; when a group fails it records an error naming the rank
// and process (every later call of the group fails with it), prints it at
// once (unless the peer finished in order), tells the peers (its blocks'
// state), and releases every flag of the group (moves it far ahead of any
// step awaited), again every 50 ms, so that no waiting stream hangs: the calls in flight complete
// with undefined output, the next call raises. Flags can be released this way only where the host
// can write them (host memory the GPU addresses); groups whose flags are in device memory get the
// error and the message, and their streams stay blocked.
#ifndef JAX_SMDDP_ENGINE_STREAM_WATCHDOG_H_
#define JAX_SMDDP_ENGINE_STREAM_WATCHDOG_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "xla_ffi/common/status.h"
#include "xla_ffi/transports/shared_block.h"

namespace smddp {

// One peer process of a watched group.
struct WatchedPeer {
  int pid = 0;
  uint64_t start_time = 0;  // of `pid`, as /proc says (0: unknown)
  std::string who;          // its ranks, "rank 2 (process 1, pid 123)"
  // Its ranks' shared blocks, for their state: closed when it finished in
  // order (it released its groups, or exited normally): the group fails all
  // the same, without a message on stderr (the end of every job would print
  // one otherwise); failed when its group failed there: this one fails too,
  // with the root cause it recorded.
  std::vector<const SharedBlock*> blocks;
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
  // This process's ranks' shared blocks: marked failed (with the root
  // cause) when the group fails here, so that the peers fail theirs.
  void SetOwnBlocks(std::vector<SharedBlock*> blocks) { own_blocks_ = std::move(blocks); }
  // Every flag of the group, in every rank's block (host addresses; host
  // flag memory only), and the step this process's ranks of the group have
  // reached (enqueued). Once the group failed, for whatever reason, the
  // watchdog keeps them all released (ReleasedFlag of that step,
  // stream_ops.h): a stream of any process may wait on a rank whose host
  // stopped before enqueuing its part (it saw the failure first), not only
  // on the rank that caused it. Peers' steps differ from this process's by
  // a few calls at most, far less than the release distance.
  // Its tokens (replayable calls' hand-overs, stream_algorithms.h) are kept
  // released too (kReleasedToken).
  void SetAllFlags(std::vector<uint32_t*> flags, std::vector<uint32_t*> tokens,
                   std::function<uint32_t()> step_reached) {
    all_flags_ = std::move(flags);
    all_tokens_ = std::move(tokens);
    step_reached_ = std::move(step_reached);
  }

  // Marks the group failed (every later call fails with `message`; the
  // first failure is kept) and tells the peers, with `message` as the cause.
  void Fail(const Status& failure) { Fail(failure, failure.message(), false); }

  // Whether a peer died: the per-call check, without a lock.
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  Status error() const;

  // Checks the peers once (the watchdog thread calls it); true if the group
  // failed now. Once failed, keeps setting every flag (live peers' streams
  // may still write theirs).
  bool Check();

 private:
  void Fail(const Status& failure, const std::string& reason, bool quiet);
  // `cause`: what went wrong, of kind `code`; `quiet`: print nothing (an
  // orderly close); `root`: the cause to hand on to the peers, if not `cause`.
  void FailBecauseOf(const std::string& cause, StatusCode code, bool quiet,
                     const std::string& root = "");
  // Sets every flag to its released value (chosen at the first release and
  // kept, so that releases by several processes do not add up).
  void ReleaseFlags();

  struct Lag {
    uint64_t calls = 0;                           // the peer's calls when last seen
    std::chrono::steady_clock::time_point since;  // behind this process since
    bool behind = false;
  };
  std::string name_;
  std::vector<WatchedPeer> peers_;  // set before the group is watched, then read-only
  std::vector<const uint8_t*> own_logs_;
  std::vector<SharedBlock*> own_blocks_;
  std::vector<uint32_t*> all_flags_;
  std::vector<uint32_t*> all_tokens_;
  std::function<uint32_t()> step_reached_;
  bool released_ = false;  // (the watchdog thread only)
  uint32_t released_value_ = 0;
  std::vector<Lag> lag_;  // by peer (the watchdog thread only)
  mutable std::mutex mu_;
  Status error_;
  std::atomic<bool> failed_{false};
};

// Starts watching `group` (the process's watchdog thread starts with the
// first group and stops when none is left).
void Watch(std::shared_ptr<WatchedGroup> group);
// Stops watching it; once this returns the thread no longer touches it.
void Unwatch(const WatchedGroup* group);

}  // namespace smddp

#endif  // JAX_SMDDP_ENGINE_STREAM_WATCHDOG_H_

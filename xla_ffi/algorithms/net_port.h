// The network side of one rank of a stream-ordered collective, and the proxy
// thread that drives it. The stream (a GPU stream, or a host thread in tests)
// never touches the network: it copies its part into a send slot and raises
// a flag; the proxy, a host thread of the process, sees the flag, sends over
// the rank's links (libfabric between hosts), receives its rail peers' parts
// into receive slots and raises flags the stream waits on.
//
// Memory is reached through two addresses, the stream's and the proxy's:
// on a GPU the mailbox (stream->proxy flags) is mapped pinned host memory and
// the signals (proxy->stream flags) are device memory mapped to the host by
// GDRCopy, or mapped pinned host memory without it. The slots follow the
// mailbox into host memory when the links copy through host buffers
// (staging), or stay in device memory registered with a FabricRail, which
// the NIC reads and writes itself (FI_HMEM): then the proxy never touches
// their bytes, it only names them to libfabric. In tests all of it is plain
// host memory and the addresses are equal.
#ifndef JAX_SMDDP_ALGORITHMS_NET_PORT_H_
#define JAX_SMDDP_ALGORITHMS_NET_PORT_H_

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "xla_ffi/common/status.h"
#include "xla_ffi/transports/link.h"

namespace smddp {

// Offsets in a port's blocks: the mailbox, the signals and the slots (which
// may follow the mailbox's flags in one block, at `flag_bytes`). Slots are
// double-buffered: the stream fills step s + 1 while the proxy still moves
// step s.
struct NetLayout {
  static constexpr size_t kFlagStride = 64;
  NetLayout() = default;
  NetLayout(int hosts, size_t slot_bytes);

  // Mailbox: written by the stream, read by the proxy.
  size_t posted() const { return 0; }
  size_t consumed(int host) const { return kFlagStride * (1 + size_t(host)); }
  // Slots, from the start of the slot area.
  size_t send_slot(uint32_t step) const { return (step % 2) * slot_bytes; }
  size_t recv_slot(int host, uint32_t step) const {
    return (2 + 2 * size_t(host) + step % 2) * slot_bytes;
  }
  // Signals: written by the proxy, read by the stream.
  size_t done() const { return 0; }
  size_t arrived(int host) const { return kFlagStride * (1 + size_t(host)); }

  int hosts = 1;
  size_t slot_bytes = 0;
  size_t flag_bytes = 0;       // the mailbox's flags, a page multiple: where slots may follow
  size_t slot_area_bytes = 0;  // send and receive slots
  size_t mailbox_bytes = 0;    // flags followed by the slots
  size_t signal_bytes = 0;
};

class NetworkProxy;
class World;

struct NetPort {
  int hosts = 1;     // hosts of the group
  int host = 0;      // this rank's host (its index among them)
  int rail = 0;      // this rank's index on its host: it talks to the same index elsewhere
  uint64_t key = 0;  // names the group in message tags
  NetLayout layout;
  uint8_t* mailbox_stream = nullptr;
  uint8_t* mailbox_proxy = nullptr;
  uint8_t* signals_stream = nullptr;
  uint8_t* signals_proxy = nullptr;
  uint8_t* slots_stream = nullptr;  // the slot area
  uint8_t* slots_proxy = nullptr;
  // Slots the proxy cannot write (device memory): how it fills a receive slot
  // with all-ones bytes after a failure. Empty: memset.
  std::function<void(uint8_t* slot_proxy, size_t bytes)> poison;
  // Run by the proxy between a receive's completion and its `arrived` flag,
  // e.g. to make the NIC's writes to device memory visible to the GPU.
  std::function<Status()> after_receive;
  // Whether this host's group of the port failed (a local peer saw a death):
  // the proxy then gives up the port's steps at once, since their peers on
  // the other hosts may never come (else each waits out the timeout). Unset: never.
  std::function<bool()> abandoned;
  std::vector<Link*> links;       // by host; null for this rank's own
  std::vector<int> peer_process;  // by host, for messages
  const World* world = nullptr;   // counts the bytes moved (jax_smddp.traffic()), if set
  NetworkProxy* proxy = nullptr;
  uint32_t step = 0;  // network steps enqueued (stream side)
  // The proxy's requests and their state, by host, reused every step (no
  // per-step allocation; touched by the proxy thread only).
  std::vector<Request> recvs, sends;
  std::vector<char> state;
  // The links a step progresses, found at the port's first step: one per
  // progress key (Link::ProgressKey; one libfabric endpoint serves every
  // host of a rail, read once a round).
  std::vector<Link*> progressed;

  template <typename T = uint8_t>
  T* stream(size_t offset, bool signal = false) const {
    return reinterpret_cast<T*>((signal ? signals_stream : mailbox_stream) + offset);
  }
  template <typename T = uint8_t>
  T* host_side(size_t offset, bool signal = false) const {
    return reinterpret_cast<T*>((signal ? signals_proxy : mailbox_proxy) + offset);
  }
  uint8_t* slot_stream(size_t offset) const { return slots_stream + offset; }
  uint8_t* slot_proxy(size_t offset) const { return slots_proxy + offset; }
};

// One thread that runs every port's network steps of this process, in the
// order they were enqueued. A step that fails (peer gone, timeout, size
// mismatch) still raises its flags, so no stream waits forever on it; the
// error sticks and every later Enqueue's caller sees it.
class NetworkProxy {
 public:
  // `timeout_s`: the deadline of each step; 0 reads jax_smddp's timeout
  // (set_timeout, JAX_SMDDP_TIMEOUT_S) afresh for every step.
  explicit NetworkProxy(double timeout_s = 0);
  ~NetworkProxy();

  // Step `step` of `port` moves `bytes` from its send slot to every other
  // host's rail peer, and theirs into its receive slots. `scatter`: host k
  // gets the k-th `bytes` of the send slot (else all get the first).
  void Enqueue(NetPort* port, uint32_t step, size_t bytes, bool scatter = false);
  // The first failure, if any (sticky).
  Status error();
  // Whether a step failed: the per-call check, without a lock.
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  // At process exit: waits up to `seconds` for the steps already enqueued to
  // finish, then fails every later one with `why` (they only release their
  // flags), so the links can be closed. Whether it went idle in time (if not,
  // nothing may be closed: a step may still be using the links).
  bool Shut(double seconds, const std::string& why);

 private:
  struct Task {
    NetPort* port;
    uint32_t step;
    size_t bytes;
    bool scatter;
  };
  void Loop();
  Status Run(const Task& task);
  void Release(const Task& task);

  double timeout_s_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;  // the queue emptied and no step runs
  std::deque<Task> queue_;
  bool running_ = false;  // a task was taken from the queue and is not finished
  bool stop_ = false;
  Status error_;
  std::atomic<bool> failed_{false};
  std::thread thread_;
};

}  // namespace smddp

#endif  // JAX_SMDDP_ALGORITHMS_NET_PORT_H_

#include "xla_ffi/algorithms/net_port.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

#include "xla_ffi/algorithms/stream_ops.h"  // FlagReached
#include "xla_ffi/common/hashing.h"
#include "xla_ffi/common/timeout.h"
#include "xla_ffi/transports/world.h"

namespace smddp {
namespace {

// Raises a signal the stream waits on. With GDRCopy the signal is GPU memory
// mapped write-combined over PCIe: a plain store, then a store fence to push
// it out of the write-combining buffer at once. Not an atomic exchange (what
// a sequentially consistent store compiles to on x86): a locked
// read-modify-write would read GPU memory across PCIe and lock the bus.
void RaiseSignal(uint32_t* signal, uint32_t value) {
  __atomic_store_n(signal, value, __ATOMIC_RELEASE);
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_sfence();
#else
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

}  // namespace

NetLayout::NetLayout(int hosts_, size_t slot_bytes_) : hosts(hosts_) {
  slot_bytes = (slot_bytes_ + 255) / 256 * 256;
  flag_bytes = (kFlagStride * (1 + size_t(hosts)) + 4095) / 4096 * 4096;
  slot_area_bytes = (2 + 2 * size_t(hosts)) * slot_bytes;
  mailbox_bytes = flag_bytes + slot_area_bytes;
  signal_bytes = kFlagStride * (1 + size_t(hosts));
}

NetworkProxy::NetworkProxy(double timeout_s) : timeout_s_(timeout_s) {
  thread_ = std::thread([this] { Loop(); });
}

NetworkProxy::~NetworkProxy() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void NetworkProxy::Enqueue(NetPort* port, uint32_t step, size_t bytes, bool scatter) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(Task{port, step, bytes, scatter});
  }
  cv_.notify_one();
}

bool NetworkProxy::Shut(double seconds, const std::string& why) {
  std::unique_lock<std::mutex> lock(mu_);
  const bool idle = idle_cv_.wait_for(lock, std::chrono::duration<double>(seconds),
                                      [&] { return queue_.empty() && !running_; });
  if (!idle) return false;
  if (error_.ok()) error_ = Status::Error(why);
  failed_.store(true, std::memory_order_release);
  return true;
}

Status NetworkProxy::error() {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

void NetworkProxy::Loop() {
  for (;;) {
    Task task;
    bool failed;
    {
      std::unique_lock<std::mutex> lock(mu_);
      running_ = false;
      if (queue_.empty()) idle_cv_.notify_all();
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      task = queue_.front();
      queue_.pop_front();
      running_ = true;
      failed = !error_.ok();
    }
    if (!failed) {
      Status st = Run(task);
      if (!st.ok()) {
        std::fprintf(stderr, "jax_smddp: network proxy: %s\n", st.message().c_str());
        std::lock_guard<std::mutex> lock(mu_);
        if (error_.ok()) error_ = st;
        failed_.store(true, std::memory_order_release);
        failed = true;
      }
    }
    if (failed) Release(task);  // garbage in, but nobody waits forever
  }
}

void NetworkProxy::Release(const Task& t) {
  NetPort& p = *t.port;
  for (int k = 0; k < p.hosts; ++k) {
    if (k == p.host) continue;
    uint32_t* arrived = p.host_side<uint32_t>(p.layout.arrived(k), true);
    if (__atomic_load_n(arrived, __ATOMIC_ACQUIRE) == t.step) continue;  // it did arrive
    // What never arrived reads as all-ones bytes, NaN in every float type, so
    // the failed call's output is visibly poisoned rather than holding an
    // earlier step's data; the next call raises the error.
    uint8_t* slot = p.slot_proxy(p.layout.recv_slot(k, t.step));
    if (p.poison) {
      p.poison(slot, t.bytes);
    } else {
      std::memset(slot, 0xFF, t.bytes);
    }
    RaiseSignal(arrived, t.step);
  }
  RaiseSignal(p.host_side<uint32_t>(p.layout.done(), true), t.step);
}

// Why a step of a port whose host group failed was given up (NetPort::abandoned).
constexpr char kAbandoned[] = "given up: this host's group of the collective failed";

Status NetworkProxy::Run(const Task& t) {
  NetPort& p = *t.port;
  const auto deadline =
      std::chrono::steady_clock::now() +
      std::chrono::duration<double>(timeout_s_ > 0 ? timeout_s_ : TimeoutSeconds());
  // `kind`: the failure's code (a link's failure keeps its own).
  auto failure = [&](int k, const Status& kind, const std::string& what) {
    Status st = kind.WithMessage(
        "network step " + std::to_string(t.step) + " of a GPU collective across hosts: " + what +
        (k >= 0 ? " (peer process " + std::to_string(p.peer_process[k]) + ")" : ""));
    if (k >= 0) st.SetPeers({}, {p.peer_process[k]});
    return st;
  };
  if (int(p.recvs.size()) != p.hosts) {  // first step of this port
    p.recvs = std::vector<Request>(p.hosts);
    p.sends = std::vector<Request>(p.hosts);
    p.state.assign(p.hosts, 0);
    // The links are the port's for its life (closed only once no step runs).
    for (Link* link : p.links) {
      if (!link) continue;
      const void* key = link->ProgressKey();
      if (std::none_of(p.progressed.begin(), p.progressed.end(),
                       [key](const Link* l) { return l->ProgressKey() == key; }))
        p.progressed.push_back(link);
    }
  }
  auto progress = [&p] {
    for (Link* link : p.progressed) link->Progress();
  };
  // Waits for a flag the stream raises, progressing links meanwhile.
  auto wait_stream = [&](size_t offset, uint32_t value) -> Status {
    const uint32_t* flag = p.host_side<uint32_t>(offset);
    for (int spins = 0; !FlagReached(__atomic_load_n(flag, __ATOMIC_ACQUIRE), value); ++spins) {
      progress();
      if ((spins & 255) == 255) {
        if (p.abandoned && p.abandoned())
          return failure(-1, Status::WithCode(StatusCode::kPeerFailed, ""), kAbandoned);
        if (std::chrono::steady_clock::now() > deadline)
          return failure(-1, Status::Timeout(""),
                         "timed out waiting for the GPU to reach step " + std::to_string(value));
        std::this_thread::yield();
      }
    }
    return Status::Ok();
  };
  const uint64_t tag = MixTag(MixTag(p.key, uint64_t(p.rail)), t.step);
  enum : char { kRecvPosted = 1, kSendPosted = 2, kSignalled = 4 };
  for (int k = 0; k < p.hosts; ++k) {
    p.recvs[k].Reset();
    p.sends[k].Reset();
    p.state[k] = 0;
  }
  auto cancel_all = [&] {
    for (int k = 0; k < p.hosts; ++k) {
      if ((p.state[k] & kRecvPosted) && !p.recvs[k].done()) p.links[k]->Cancel(&p.recvs[k]);
      if ((p.state[k] & kSendPosted) && !p.sends[k].done()) p.links[k]->Cancel(&p.sends[k]);
    }
  };
  for (int k = 0; k < p.hosts; ++k) {
    if (k == p.host) continue;
    if (t.step > 2) {
      Status st = wait_stream(p.layout.consumed(k), t.step - 2);
      if (!st.ok()) {
        cancel_all();
        return st;
      }
    }
    p.state[k] |= kRecvPosted;
    p.links[k]->Recv(tag, p.slot_proxy(p.layout.recv_slot(k, t.step)), t.bytes, &p.recvs[k]);
  }
  Status st = wait_stream(p.layout.posted(), t.step);
  if (!st.ok()) {
    cancel_all();
    return st;
  }
  for (int k = 0; k < p.hosts; ++k) {
    if (k == p.host) continue;
    const size_t offset = t.scatter ? size_t(k) * t.bytes : 0;
    p.state[k] |= kSendPosted;
    p.links[k]->Send(tag, p.slot_proxy(p.layout.send_slot(t.step)) + offset, t.bytes, &p.sends[k]);
  }
  for (int spins = 0;; ++spins) {
    bool all = true, sent = true;
    progress();
    for (int k = 0; k < p.hosts; ++k) {
      if (k == p.host) continue;
      if (p.recvs[k].done() && !(p.state[k] & kSignalled)) {
        if (!p.recvs[k].status().ok()) {
          cancel_all();
          return failure(k, p.recvs[k].status(), p.recvs[k].status().message());
        }
        if (p.after_receive) {
          Status st = p.after_receive();
          if (!st.ok()) {
            cancel_all();
            return failure(k, st, st.message());
          }
        }
        // The bytes are in the slot: let the stream read them.
        RaiseSignal(p.host_side<uint32_t>(p.layout.arrived(k), true), t.step);
        p.state[k] |= kSignalled;
      }
      if (p.sends[k].done() && !p.sends[k].status().ok()) {
        cancel_all();
        return failure(k, p.sends[k].status(), p.sends[k].status().message());
      }
      all = all && (p.state[k] & kSignalled);
      sent = sent && p.sends[k].done();
    }
    if (all && sent) break;
    if ((spins & 255) == 255) {
      for (int k = 0; k < p.hosts; ++k) {
        if (k == p.host) continue;
        const std::string dead = p.links[k]->PeerFailure();
        if (!dead.empty()) {
          cancel_all();
          return failure(k, Status::WithCode(p.links[k]->PeerFailureCode(), ""), dead);
        }
      }
      if (p.abandoned && p.abandoned()) {
        cancel_all();
        return failure(-1, Status::WithCode(StatusCode::kPeerFailed, ""), kAbandoned);
      }
      if (std::chrono::steady_clock::now() > deadline) {
        cancel_all();
        return failure(-1, Status::Timeout(""), "timed out exchanging with the other hosts");
      }
      std::this_thread::yield();
    }
  }
  if (p.world) {
    for (int k = 0; k < p.hosts; ++k) {
      if (k == p.host) continue;
      p.world->CountSent(p.peer_process[k], t.bytes);
      p.world->CountReceived(p.peer_process[k], t.bytes);
    }
  }
  RaiseSignal(p.host_side<uint32_t>(p.layout.done(), true), t.step);
  return Status::Ok();
}

}  // namespace smddp

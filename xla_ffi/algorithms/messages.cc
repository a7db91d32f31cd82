#include "xla_ffi/algorithms/messages.h"
#include "xla_ffi/common/settings.h"
#include "xla_ffi/common/timeout.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <sstream>

namespace smddp {

std::string ProcessCall::DescribeProcess(int process) const {
  std::ostringstream os;
  os << "process " << process << " (devices [";
  bool first = true;
  for (int r = 0; r < size; ++r) {
    if ((*process_of_rank)[r] != process) continue;
    os << (first ? "" : " ") << (*members)[r];
    first = false;
  }
  os << "])";
  return os.str();
}

std::vector<int> ProcessCall::RanksOf(int process) const {
  std::vector<int> ranks;
  for (int r = 0; r < size; ++r)
    if ((*process_of_rank)[r] == process) ranks.push_back(r);
  return ranks;
}

size_t ChunkBytes() {
  static const size_t bytes = [] {
    // A call's own chunk (jax_smddp.tuning's) comes with the call; this is the
    // setting, or its declared default. Whole cache lines, so chunk
    // boundaries never split an element; at least 4 KiB, as jax_smddp.tuning
    // rounds it.
    const int64_t v = IntSetting("JAX_SMDDP_CHUNK_BYTES");
    return std::max<size_t>(4096, (size_t(v) + 63) / 64 * 64);
  }();
  return bytes;
}

Messages::Messages(const ProcessCall& call)
    : call_(call),
      chunk_(call.chunk_bytes ? call.chunk_bytes : ChunkBytes()),
      polls_(WaitPollsFor(call.world->oversubscribed())) {
  // One link per progress key: the peers over one libfabric endpoint share
  // its completion queue, read once per round.
  for (int p : *call.peers) {
    Link* link = call.world->link(p);
    if (!link) continue;
    const void* key = link->ProgressKey();
    if (std::none_of(links_.begin(), links_.end(),
                     [key](const Link* l) { return l->ProgressKey() == key; }))
      links_.push_back(link);
  }
  one_descriptor_ = links_.size() == 1 && links_[0]->SleepsOnEveryArrival();
  next_check_ = Clock::now();
}

Messages::~Messages() {
  for (Entry& e : entries_) {
    if (!e.settled && !e.req.done() && e.link) e.link->Cancel(&e.req);
  }
}

void Messages::Chunk(size_t total, size_t i, size_t* offset, size_t* bytes) const {
  const size_t c = chunk_;
  *offset = i * c;
  *bytes = std::min(c, total - *offset);
}

Messages::Entry& Messages::NewEntry(int process, Link* link, bool recv) {
  entries_.emplace_back();
  Entry& e = entries_.back();
  e.process = process;
  e.recv = recv;
  e.link = link;
  return e;
}

size_t Messages::Post(int process, uint64_t tag, const void* src, void* dst, size_t bytes,
                      bool recv) {
  Entry& e = NewEntry(process, call_.world->link(process), recv);
  if (!e.link) {
    e.req.Complete(call_.Concerning(
        process,
        Status::InvalidArgument("no link to " + call_.DescribeProcess(process) +
                                ": jax_smddp.initialize() connected only some processes")));
  } else if (recv) {
    call_.world->CountReceived(process, bytes);
    e.link->Recv(tag, dst, bytes, &e.req);
  } else {
    call_.world->CountSent(process, bytes);
    e.link->Send(tag, src, bytes, &e.req);
  }
  return entries_.size() - 1;
}

Messages::Range Messages::Send(int process, uint64_t msg, const void* src, size_t bytes) {
  Range r{entries_.size(), Chunks(bytes)};
  const uint64_t base = MixTag(call_.tag, msg);
  for (size_t i = 0; i < r.count; ++i) {
    size_t off, n;
    Chunk(bytes, i, &off, &n);
    Out(process, MixTag(base, i), static_cast<const char*>(src) + off, n);
  }
  return r;
}

void Messages::Announce(int process, uint64_t msg, size_t total) {
  Link* link = call_.world->link(process);
  if (!link) return;  // SendChunk reports it
  const uint64_t base = MixTag(call_.tag, msg);
  for (size_t i = 0; i < Chunks(total); ++i) {
    size_t off, n;
    Chunk(total, i, &off, &n);
    if (FindAnnounced(process, MixTag(base, i)) != kNone) continue;  // announced already
    Entry& e = NewEntry(process, link, false);
    if (!link->Announce(MixTag(base, i), n, &e.req)) {
      entries_.pop_back();  // nothing to start: SendChunk posts it
      continue;
    }
    call_.world->CountSent(process, n);
    announced_.push_back({process, MixTag(base, i), entries_.size() - 1});
  }
}

void Messages::SendChunk(int process, uint64_t msg, size_t total, size_t i, const void* base) {
  size_t off, n;
  Chunk(total, i, &off, &n);
  Out(process, MixTag(MixTag(call_.tag, msg), i), static_cast<const char*>(base) + off, n);
}

void Messages::Out(int process, uint64_t tag, const char* src, size_t n) {
  for (Gate& g : gates_) {
    if (g.process != process || g.tag != tag) continue;
    const size_t after = g.after;
    g = gates_.back();
    gates_.pop_back();
    if (!entries_[after].req.done()) {
      held_.push_back({after, process, tag, src, n});
      return;
    }
    break;
  }
  Hand(process, tag, src, n);
}

size_t Messages::FindAnnounced(int process, uint64_t tag) const {
  for (size_t k = 0; k < announced_.size(); ++k)
    if (announced_[k].process == process && announced_[k].tag == tag) return k;
  return kNone;
}

void Messages::Hand(int process, uint64_t tag, const char* src, size_t n) {
  const size_t k = FindAnnounced(process, tag);
  if (k != kNone) {
    const size_t id = announced_[k].entry;
    announced_[k] = announced_.back();
    announced_.pop_back();
    entries_[id].link->SendAnnounced(&entries_[id].req, src);
    return;
  }
  Post(process, tag, src, nullptr, n, false);
}

void Messages::Hold(int process, const std::vector<std::pair<uint64_t, size_t>>& msgs,
                    const std::vector<size_t>& after) {
  size_t total = 0;
  for (const auto& [msg, bytes] : msgs) total += Chunks(bytes);
  if (after.empty() || total == 0) return;
  size_t j = 0;
  for (const auto& [msg, bytes] : msgs) {
    const uint64_t base = MixTag(call_.tag, msg);
    Announce(process, msg, bytes);  // its handshake now
    for (size_t i = 0; i < Chunks(bytes); ++i, ++j)
      gates_.push_back({process, MixTag(base, i), after[j * after.size() / total]});
  }
}

void Messages::Release() {
  for (size_t i = 0; i < held_.size();) {
    if (!entries_[held_[i].after].req.done()) {
      ++i;
      continue;
    }
    const Held h = held_[i];
    held_.erase(held_.begin() + i);
    Hand(h.process, h.tag, h.src, h.bytes);
  }
}

Messages::Range Messages::Recv(int process, uint64_t msg, void* dst, size_t bytes) {
  Range r{entries_.size(), Chunks(bytes)};
  const uint64_t base = MixTag(call_.tag, msg);
  for (size_t i = 0; i < r.count; ++i) {
    size_t off, n;
    Chunk(bytes, i, &off, &n);
    Post(process, MixTag(base, i), nullptr, static_cast<char*>(dst) + off, n, true);
  }
  return r;
}

void Messages::ProgressAll() {
  for (Link* link : links_) link->Progress();
  if (!held_.empty()) Release();
}

// A peer that is gone fails the call at once (not at the deadline), but only
// if this call still waits on it once everything it sent before it went has
// been read: a peer that finished its part and exited has failed nobody. In a
// ring (Routes::ring) every block and partial passes every process, so a dead
// one fails any call still waiting, though it sends this process nothing
// directly: its neighbours' failures would reach the rest only as each exits.
Status Messages::CheckPeers() {
  const bool ring = call_.routes && call_.routes->ring;
  for (int p : *call_.peers) {
    Link* link = call_.world->link(p);
    if (!link) continue;
    std::string why = link->PeerFailure();
    if (why.empty()) continue;
    link->Progress();
    link->Progress();
    for (const Entry& e : entries_) {
      if ((e.process != p && !ring) || e.settled || e.req.done()) continue;
      return PeerFailed(p, *link, why);
    }
  }
  return Status::Ok();
}

Status Messages::PeerFailed(int process, Link& link, const std::string& why) const {
  const StatusCode code = link.PeerFailureCode();
  return call_.Concerning(
      process,
      Status::WithCode(code,
                       call_.where() + ": " + call_.DescribeProcess(process) +
                           (code == StatusCode::kProtocol ? " sent what this process cannot parse ("
                                                          : " failed (") +
                           why + ", over " + link.Kind() + "); this collective cannot complete"));
}

Status Messages::Wait(size_t id) {
  Entry& e = entries_[id];
  // Spin briefly (shared-memory latency is microseconds), then yield the
  // core, then sleep until the link signals activity (or SleepBoundUs passed):
  // many calls may wait at once on few cores (wait_polls.h).
  // A link that wakes its sleepers on arrival is polled little (wait_polls.h).
  static const unsigned sleep_us = unsigned(IntSetting("JAX_SMDDP_SLEEP_US"));
  const bool on_arrival = e.link && e.link->SleepsOnArrival();
  const WaitPolls polls = on_arrival ? WaitPollsOnArrival(polls_) : polls_;
  const unsigned yield_after = polls.yield_after, sleep_after = polls.sleep_after;
  const unsigned arrival_floor = one_descriptor_ ? kOneDescriptorSleepUs : kArrivalSleepUs;
  const unsigned sleep_for = on_arrival ? std::max(sleep_us, arrival_floor) : sleep_us;
  CallPhases* phases = call_.phases;
  const auto waited_from = phases && !e.req.done() ? Clock::now() : Clock::time_point();
  Clock::time_point first_sleep;  // the bound grows with the time slept on this entry
  for (unsigned spins = 0; !e.req.done(); ++spins) {
    const bool sleeps = spins > yield_after && spins >= sleep_after;
    // Read before looking, and only when this round may sleep on it.
    const uint32_t seen = sleeps && e.link ? e.link->Activity() : 0;
    ProgressAll();
    if (e.req.done()) break;
    if (sleeps) {
      const auto slept_from = Clock::now();
      if (first_sleep == Clock::time_point()) first_sleep = slept_from;
      const unsigned bound = SleepBoundUs(
          sleep_for,
          std::chrono::duration_cast<std::chrono::microseconds>(slept_from - first_sleep).count());
      if (e.link) {
        e.link->AwaitActivity(seen, bound);
      } else {
        usleep(bound);
      }
      if (phases) {
        phases->sleep_s += std::chrono::duration<double>(Clock::now() - slept_from).count();
        phases->sleeps++;
      }
    } else if (spins > yield_after) {
      sched_yield();
    }
    if ((spins & 15) != 0 && !sleeps) continue;  // a sleeper checks after each sleep
    const auto now = Clock::now();
    if (now >= next_check_) {
      next_check_ = now + std::chrono::milliseconds(20);
      SMDDP_RETURN_IF_ERROR(CheckPeers());
      if (call_.watch) SMDDP_RETURN_IF_ERROR(call_.watch->Check());
    }
    if (now >= call_.deadline) {
      Link* link = e.link;
      return call_.Concerning(
          e.process,
          Status::Timeout(call_.where() + ": timed out after " + Seconds(now - call_.start) +
                          " waiting for " + call_.DescribeProcess(e.process) +
                          (e.recv ? " to send its data" : " to take this process's data") +
                          " (over " + (link ? link->Kind() : std::string("no link")) +
                          "). That process never reached this collective, or is stalled or much "
                          "slower; " +
                          kIfOnlySlow));
    }
  }
  if (phases && waited_from != Clock::time_point())
    phases->wait_s += std::chrono::duration<double>(Clock::now() - waited_from).count();
  e.settled = true;
  if (!e.req.status().ok()) {
    // A link that failed as a whole (its peer died, or sent what cannot be
    // parsed) is reported alike whether a request or the peer watch saw it
    // first (a request posted after the failure fails at once).
    const std::string why = e.link && e.req.status().code() != StatusCode::kMismatch
                                ? e.link->PeerFailure()
                                : std::string();
    if (!why.empty()) return PeerFailed(e.process, *e.link, why);
    // The link's failure keeps its kind (a closed link: the peer failed).
    return call_.Concerning(e.process, e.req.status().WithMessage(call_.where() + ": " +
                                                                  call_.DescribeProcess(e.process) +
                                                                  ": " + e.req.status().message()));
  }
  return Status::Ok();
}

bool Messages::PollRange(const Range& r, Clock::time_point until) {
  const auto from = Clock::now();
  bool done = false;
  for (unsigned spins = 0;; ++spins) {
    done = std::all_of(entries_.begin() + r.first, entries_.begin() + r.first + r.count,
                       [](const Entry& e) { return e.settled || e.req.done(); });
    if (done || ((spins & 15) == 0 && Clock::now() >= until)) break;
    ProgressAll();
    if (spins > polls_.yield_after) sched_yield();
  }
  if (call_.phases)
    call_.phases->wait_s += std::chrono::duration<double>(Clock::now() - from).count();
  return done;
}

Status Messages::WaitRange(const Range& r) {
  for (size_t i = 0; i < r.count; ++i) SMDDP_RETURN_IF_ERROR(Wait(r.first + i));
  return Status::Ok();
}

Status Messages::WaitAll() {
  // A held chunk's gate is an earlier transfer: waiting for it releases the
  // chunk, whose entry comes after it (or was announced).
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (!entries_[i].settled) SMDDP_RETURN_IF_ERROR(Wait(i));
  }
  Release();
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (!entries_[i].settled) SMDDP_RETURN_IF_ERROR(Wait(i));
  }
  return Status::Ok();
}

}  // namespace smddp

// How long a call across processes polls its links before it yields the core
// and before it sleeps (JAX_SMDDP_SPIN, JAX_SMDDP_YIELD). Polling answers a
// peer within microseconds while there are cores to spare; where the job's
// processes on this machine outnumber its cores, a poller takes the core the
// peer it waits for (or another library's threads) needs, so there it sleeps
// soon. The world says which (World::oversubscribed, found by
// jax_smddp.initialize()); a setting given in the environment is used either
// way.
#ifndef JAX_SMDDP_ALGORITHMS_WAIT_POLLS_H_
#define JAX_SMDDP_ALGORITHMS_WAIT_POLLS_H_

#include <cstdint>

namespace smddp {

struct WaitPolls {
  unsigned yield_after;  // polls before the waiter yields its core
  unsigned sleep_after;  // polls before it sleeps on the link's activity
};

// The polls of a waiting call on a machine that is, or is not, oversubscribed.
WaitPolls WaitPollsFor(bool oversubscribed);

// The polls of a wait on a link that wakes its sleepers when data arrives
// (Link::SleepsOnArrival): at most `polls`' own, and few, since each poll
// of such a link is a system call and sleeping on it loses no time (measured
// on capped links: docs/performance_model.md, "Waiting on a slow link").
WaitPolls WaitPollsOnArrival(WaitPolls polls);
// And the longest such a wait sleeps at a time (at least JAX_SMDDP_SLEEP_US):
// the descriptor wakes it when anything arrives, so the bound only matters
// where another thread read the completion it waits for.
constexpr unsigned kArrivalSleepUs = 1000;
// The floor instead where the call polls one link alone and its descriptor
// is signalled by everything that link carries (Link::SleepsOnEveryArrival:
// one libfabric endpoint, no shared-memory peer that needs this process to
// poll): the bound then only times the peer and deadline checks. 1 ms woke a
// wait on a 200 Mbit/s link about once per ms, arrivals or not: 4x1x1
// all_gather of 1 MiB per rank, 156 sleeps per 140 ms call and 27 ms of CPU
// (all processes) against 59 and 15 ms at 10 ms, calls as fast
// (docs/between_hosts.md, "One descriptor, long sleeps").
constexpr unsigned kOneDescriptorSleepUs = 10000;

// The longest a wait sleeps at a time once it has waited `waited_us`: its
// floor (JAX_SMDDP_SLEEP_US, or kArrivalSleepUs), growing with an eighth of
// the time waited so far up to kLongWaitSleepUs. A sleeper wakes early when
// its link signals activity; the bound matters where another thread took
// that activity, and there a late wake adds at most about an eighth to the
// wait, while a wait of milliseconds (peers across a slow link) wakes tens of
// times rather than one per floor.
constexpr unsigned kLongWaitSleepUs = 1000;
unsigned SleepBoundUs(unsigned floor_us, int64_t waited_us);

}  // namespace smddp

#endif  // JAX_SMDDP_ALGORITHMS_WAIT_POLLS_H_

// Counts how many times one collective instruction has run on one rank in
// each recent execution (an instruction inside a loop runs several times per
// execution; every rank runs the same program, so the counts agree across
// ranks). Fixed size: the per-call path allocates nothing, and nothing
// long-lived is left behind per execution.
#ifndef JAX_SMDDP_FFI_INVOCATION_COUNTER_H_
#define JAX_SMDDP_FFI_INVOCATION_COUNTER_H_

#include <array>
#include <cstdint>
#include <mutex>

namespace smddp {

class InvocationCounter {
 public:
  // The number of earlier calls in execution `run_id`, then counts this one;
  // `sequence` gets the number of earlier calls in every execution (equal on
  // every device of every process that runs the same program: the name of
  // this call across processes, where run ids differ between programs).
  uint64_t Next(int64_t run_id, uint64_t* sequence = nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    if (sequence) *sequence = sequence_;
    ++sequence_;
    Entry* oldest = &entries_[0];
    for (Entry& e : entries_) {
      if (e.used && e.run_id == run_id) {
        e.last_use = ++clock_;
        return e.count++;
      }
      if (!e.used || (oldest->used && e.last_use < oldest->last_use)) oldest = &e;
    }
    // A new execution replaces the least recently seen one: far more
    // executions than XLA keeps in flight on one device are remembered.
    *oldest = Entry{true, run_id, 1, ++clock_};
    return 0;
  }

 private:
  struct Entry {
    bool used = false;
    int64_t run_id = 0;
    uint64_t count = 0;
    uint64_t last_use = 0;
  };
  std::mutex mu_;
  uint64_t clock_ = 0;
  uint64_t sequence_ = 0;
  std::array<Entry, 32> entries_;
};

}  // namespace smddp

#endif  // JAX_SMDDP_FFI_INVOCATION_COUNTER_H_

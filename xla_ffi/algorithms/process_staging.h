// Staging memory for the cross-process algorithms (process_algorithms.cc):
// what a call receives before it reduces or places it.
#ifndef JAX_SMDDP_ALGORITHMS_PROCESS_STAGING_H_
#define JAX_SMDDP_ALGORITHMS_PROCESS_STAGING_H_

#include <algorithm>
#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

namespace smddp {

// Staging memory, reused across calls: a call holds one buffer from its
// start to its end, whichever threads run it (its start on XLA's thread, its
// rest perhaps on a worker while that thread starts another call), and gives
// it back for the next; calls allocate nothing in the steady state.
class Staging {
 public:
  Staging() = default;
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  ~Staging() {
    if (!buffer_) return;
    std::lock_guard<std::mutex> lock(Free().mu);
    Free().buffers.push_back({std::move(buffer_), capacity_});
  }

  // At least `bytes`, valid until this is destroyed. Called once.
  char* Get(size_t bytes) {
    {
      // The largest free buffer: calls of one size reuse theirs.
      Pool& pool = Free();
      std::lock_guard<std::mutex> lock(pool.mu);
      auto best =
          std::max_element(pool.buffers.begin(), pool.buffers.end(),
                           [](const Held& a, const Held& b) { return a.capacity < b.capacity; });
      if (best != pool.buffers.end()) {
        buffer_ = std::move(best->buffer);
        capacity_ = best->capacity;
        pool.buffers.erase(best);
      }
    }
    if (bytes > capacity_) {
      buffer_.reset(new char[bytes]);
      capacity_ = bytes;
    }
    return buffer_.get();
  }

 private:
  struct Held {
    std::unique_ptr<char[]> buffer;
    size_t capacity;
  };
  struct Pool {
    std::mutex mu;
    std::vector<Held> buffers;
  };
  static Pool& Free() {
    static Pool* pool = new Pool;  // never destroyed: calls may end during exit
    return *pool;
  }
  std::unique_ptr<char[]> buffer_;
  size_t capacity_ = 0;
};

}  // namespace smddp

#endif  // JAX_SMDDP_ALGORITHMS_PROCESS_STAGING_H_

// A block of shared memory that one process creates and the other processes
// of a group on its host map: the GPU backend keeps its step flags there
// (host memory the GPUs address, gpu_communicator.h), so that a host thread
// can release them when a peer process dies (stream_watchdog.h). The header
// page records the creator's pid and start time; the last expected opener
// removes the name, so nothing is left in /dev/shm once all have mapped it.
#ifndef JAX_SMDDP_TRANSPORTS_SHARED_BLOCK_H_
#define JAX_SMDDP_TRANSPORTS_SHARED_BLOCK_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "xla_ffi/common/status.h"

namespace smddp {

class SharedBlock {
 public:
  // `bytes` zeroed bytes that `openers` other processes will Open.
  static Status Create(size_t bytes, int openers, std::unique_ptr<SharedBlock>* out);
  // Maps a block another process created, which must hold `bytes` bytes.
  static Status Open(const std::string& name, size_t bytes, std::unique_ptr<SharedBlock>* out);
  ~SharedBlock();
  SharedBlock(const SharedBlock&) = delete;
  SharedBlock& operator=(const SharedBlock&) = delete;

  uint8_t* data() const { return base_ + kHeaderBytes; }  // page aligned
  size_t bytes() const { return mapped_ - kHeaderBytes; }
  // The whole mapping, header included (what to register with a GPU).
  void* mapping() const { return base_; }
  size_t mapping_bytes() const { return mapped_; }
  const std::string& name() const { return name_; }
  int owner_pid() const;
  uint64_t owner_start_time() const;
  // The owner's state, for its peers: kOpen, kClosed (it is done with the
  // block: an orderly exit, so it did not die), kFailed (its group failed:
  // the peers should fail theirs too).
  enum State : int32_t { kOpen = 0, kClosed = 1, kFailed = 2 };
  void MarkClosed();  // unless failed
  // `reason`: the root cause, for the peers' messages (cut to 1 KiB);
  // `quiet`: the peers print nothing either (an orderly close at the root).
  void MarkFailed(const std::string& reason, bool quiet);
  State state() const;
  // The reason and quietness a failed owner recorded.
  void Failure(std::string* reason, bool* quiet) const;

  static constexpr size_t kHeaderBytes = 4096;

 private:
  SharedBlock(uint8_t* base, size_t mapped, std::string name, bool created)
      : base_(base), mapped_(mapped), name_(std::move(name)), created_(created) {}
  uint8_t* base_;
  size_t mapped_;
  std::string name_;
  bool created_;
};

}  // namespace smddp

#endif  // JAX_SMDDP_TRANSPORTS_SHARED_BLOCK_H_

// Link between two processes of one host over POSIX shared memory.
//
// One segment holds two single-producer/single-consumer byte rings, one per
// direction. A message travels as chunks (a 64-byte header {tag, message
// size, offset, length} and the payload, padded to 64 bytes); chunks of
// different messages may interleave, and a large message is cut into chunks
// so that the reader copies out while the writer is still writing. Arrived
// chunks go straight into a posted receive's buffer, else into an
// "unexpected" store that a later receive takes over.
//
// Single copy: a message of JAX_SMDDP_SHM_SINGLE_COPY_BYTES or more does not
// travel through the ring. The writer sends only its address; the reader
// copies the bytes straight from the writer's memory into the receive's
// buffer (process_vm_readv, Linux cross-memory attach) and acknowledges, which
// frees the writer's buffer. Where the kernel refuses (ptrace rules), the
// reader says so and the writer sends that message, and every later one,
// through the ring; SingleCopy() reports why. A writer that cancels a message
// the reader may be copying counts the cancel in the segment, and the reader,
// seeing the count change, discards what it copied.
//
// Waiting: each side has a doorbell in the segment (a counter and a futex on
// it). Writing a chunk, freeing room in the peer's ring, or completing
// another local thread's requests rings it, so a waiter sleeping in
// AwaitActivity() wakes at once instead of at its next poll.
//
// Set-up: one process creates the segment and publishes its name; the other
// opens it; as soon as both mapped it, either unlinks the name (the mappings
// stay valid), so a crash leaves nothing in /dev/shm.
//
// Everything read from the shared memory is bounds-checked before use: a peer
// that writes nonsense fails the link (every request completes with an
// error, PeerFailure() says why) and never corrupts this process's memory.
#ifndef JAX_SMDDP_TRANSPORTS_SHM_LINK_H_
#define JAX_SMDDP_TRANSPORTS_SHM_LINK_H_

#include <cstddef>
#include <memory>
#include <string>

#include "xla_ffi/common/status.h"
#include "xla_ffi/transports/link.h"

namespace smddp {

// One mapped segment, shared by exactly two processes.
class ShmSegment;

// Creates a segment for two rings of `ring_bytes` each (rounded up to whole
// pages, at least 16 KiB, at most 1 GiB): shm_open(O_CREAT|O_EXCL|O_RDWR,
// 0600) under an unguessable name "/jax_smddp-<32 hex chars from
// getrandom()>", sized and backed (fails cleanly when /dev/shm is too small),
// mapped; writes a header (magic, version, ring size, creator pid). Returns
// the name to publish to the peer.
Status CreateShmSegment(size_t ring_bytes, std::string* name, std::shared_ptr<ShmSegment>* out);

// Maps a segment the peer created; checks owner, magic, version and size;
// records this (opener) pid in the header. Fails if another process already
// opened it.
Status OpenShmSegment(const std::string& name, std::shared_ptr<ShmSegment>* out);

// Removes the name (mappings stay valid). Called as soon as both processes
// mapped it. A name that is already gone is not an error.
Status UnlinkShmSegment(const std::string& name);

// The link over a segment. `creator`: whether this process created it
// (decides which ring it writes). `peer_pid`: the peer process, for liveness
// checks (<= 0: take it from the segment header). Destroying the link marks
// this side closed, which the peer reports as an orderly exit.
std::unique_ptr<Link> MakeShmLink(std::shared_ptr<ShmSegment> segment, bool creator, int peer_pid);

// Messages of this many bytes or more are read in place (single copy):
// JAX_SMDDP_SHM_SINGLE_COPY_BYTES (0 = never), or its declared default.
size_t SingleCopyMinBytes();

// Default ring size: JAX_SMDDP_SHM_RING_BYTES if set (a byte count), else
// its declared default.
size_t DefaultShmRingBytes();

}  // namespace smddp

#endif  // JAX_SMDDP_TRANSPORTS_SHM_LINK_H_

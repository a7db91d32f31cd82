#include "xla_ffi/mpiabi/mpi_point_to_point.h"

#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "xla_ffi/algorithms/messages.h"
#include "xla_ffi/algorithms/process_call.h"
#include "xla_ffi/common/hashing.h"
#include "xla_ffi/common/timeout.h"

namespace smddp {
namespace mpi {

namespace {

struct Letter {
  const void* src = nullptr;
  size_t src_bytes = 0;
  void* dst = nullptr;
  size_t dst_bytes = 0;
  bool delivered = false;
  Status status;
};

using LetterKey = std::tuple<int, int, int, uint64_t>;  // source, destination, tag, sequence

// Every other process of a world, and its ranks in the group: what a
// transfer's call waits on. Made once per world, not per message.
struct Peers {
  std::shared_ptr<const World> world;  // held: no other world reuses its address
  std::vector<int> processes;
  std::vector<std::vector<int>> ranks;
};

}  // namespace

struct Mailbox {
  std::mutex mu;
  std::condition_variable cv;
  std::map<LetterKey, std::shared_ptr<Letter>> pending;
  std::shared_ptr<const Peers> peers;  // of the latest world seen (guarded by mu)
};

Group::Group() : mailbox(new Mailbox) {}
Group::~Group() = default;

struct Transfer {
  std::shared_ptr<Group> group;
  std::string where;
  Clock::time_point deadline;
  // Within the process:
  std::shared_ptr<Letter> letter;
  LetterKey key;
  // Across processes:
  std::shared_ptr<const World> world;
  std::shared_ptr<const Peers> peers;  // what `call` points at
  ProcessCall call;
  std::unique_ptr<Messages> messages;
  Messages::Range range;
};

namespace {

std::string Where(const char* fn, const Rank& r, int peer, int tag) {
  return std::string("jax_smddp ") + fn + " (rank " + std::to_string(r.rank) +
         (fn[4] == 'I' && fn[5] == 's' ? " to rank " : " from rank ") + std::to_string(peer) +
         ", tag " + std::to_string(tag) + ", of a clique of " +
         std::to_string(r.group->comm->size()) + ")";
}

Status Post(Rank& r, bool recv, int peer, int tag, const void* src, void* dst, size_t bytes,
            Transfer** out) {
  const char* fn = recv ? "MPI_Irecv" : "MPI_Isend";
  Group& g = *r.group;
  const int n = int(g.process_of_rank.size());
  if (peer < 0 || peer >= n)
    return Status::InvalidArgument(std::string("jax_smddp ") + fn + ": rank " +
                                   std::to_string(peer) + " is not in the clique of " +
                                   std::to_string(n) + " (MPI_ANY_SOURCE is not supported)");
  auto& counter = recv ? r.received[{peer, tag}] : r.sent[{peer, tag}];
  const uint64_t sequence = counter++;
  auto t = std::make_unique<Transfer>();
  t->group = r.group;
  t->where = Where(fn, r, peer, tag);
  t->deadline = Clock::now() + Timeout();
  const int source = recv ? peer : r.rank, dest = recv ? r.rank : peer;
  if (g.process_of_rank[peer] == g.process_of_rank[r.rank]) {
    t->key = LetterKey{source, dest, tag, sequence};
    Mailbox& box = *g.mailbox;
    std::lock_guard<std::mutex> lock(box.mu);
    auto& slot = box.pending[t->key];
    if (!slot) slot = std::make_shared<Letter>();
    std::shared_ptr<Letter> letter = slot;  // outlives the entry, erased once delivered
    if (recv) {
      letter->dst = dst;
      letter->dst_bytes = bytes;
    } else {
      letter->src = src;
      letter->src_bytes = bytes;
    }
    if (letter->src && letter->dst) {
      if (letter->src_bytes != letter->dst_bytes) {
        letter->status = Status::Mismatch(t->where + ": rank " + std::to_string(source) + " sent " +
                                          std::to_string(letter->src_bytes) + " bytes, rank " +
                                          std::to_string(dest) + " expected " +
                                          std::to_string(letter->dst_bytes));
      } else if (letter->src_bytes) {
        memcpy(letter->dst, letter->src, letter->src_bytes);
      }
      letter->delivered = true;
      box.pending.erase(t->key);
      box.cv.notify_all();
    }
    t->letter = letter;
    *out = t.release();
    return Status::Ok();
  }
  std::shared_ptr<const World> world = CurrentWorld();
  if (!world)
    return Status::InvalidArgument(t->where + ": jax_smddp's world is not initialized here");
  t->world = world;
  ProcessCall& c = t->call;
  c.world = world.get();
  c.size = n;
  c.members = &g.members;
  c.process_of_rank = &g.process_of_rank;
  // Every other process: waiting here moves whatever this process has posted
  // to any of them (another device's sends may be what its peer waits for).
  {
    std::lock_guard<std::mutex> lock(g.mailbox->mu);
    std::shared_ptr<const Peers>& cached = g.mailbox->peers;
    if (!cached || cached->world != world) {
      auto made = std::make_shared<Peers>();
      made->world = world;
      for (int p = 0; p < world->processes(); ++p) {
        if (p == world->process()) continue;
        made->processes.push_back(p);
        made->ranks.push_back(c.RanksOf(p));
      }
      cached = std::move(made);
    }
    t->peers = cached;
  }
  static const std::vector<int> kNoLocalRanks;  // a transfer runs no collective body
  c.local = &kNoLocalRanks;
  c.peers = &t->peers->processes;
  c.peer_ranks = &t->peers->ranks;
  c.tag = MixTag(MixTag(MixTag(MixTag(MixTag(g.site, uint64_t(source)), uint64_t(dest)),
                               uint64_t(uint32_t(tag))),
                        sequence),
                 0x7032707432ull);
  c.start = Clock::now();
  c.deadline = t->deadline;
  c.where = [where = &t->where] { return *where; };
  c.info = CallInfo{fn, DType::kUInt8, ReduceOp::kSum, bytes, bytes};
  t->messages = std::make_unique<Messages>(c);
  const int process = g.process_of_rank[peer];
  t->range =
      recv ? t->messages->Recv(process, 1, dst, bytes) : t->messages->Send(process, 1, src, bytes);
  *out = t.release();
  return Status::Ok();
}

}  // namespace

Status PostSend(Rank& r, int dest, int tag, const void* buf, size_t bytes, Transfer** out) {
  return Post(r, false, dest, tag, buf, nullptr, bytes, out);
}

Status PostRecv(Rank& r, int source, int tag, void* buf, size_t bytes, Transfer** out) {
  return Post(r, true, source, tag, nullptr, buf, bytes, out);
}

Status Complete(Transfer* raw) {
  std::unique_ptr<Transfer> t(raw);
  if (t->messages) {
    Status st = t->messages->WaitRange(t->range);
    t->messages.reset();  // withdraws what is left on failure
    return st;
  }
  Mailbox& box = *t->group->mailbox;
  std::unique_lock<std::mutex> lock(box.mu);
  if (!box.cv.wait_until(lock, t->deadline, [&] { return t->letter->delivered; })) {
    box.pending.erase(t->key);
    return Status::Timeout(t->where + ": the peer rank did not post the matching call within " +
                           "the deadline (JAX_SMDDP_TIMEOUT_S)");
  }
  return t->letter->status;
}

}  // namespace mpi
}  // namespace smddp

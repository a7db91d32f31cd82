#include "xla_ffi/engine/communicator.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <sstream>

#include "xla_ffi/engine/inprocess_rendezvous.h"
#include "xla_ffi/engine/process_rendezvous.h"
#include "xla_ffi/transports/world.h"

namespace smddp {

namespace {

std::string DescribeMembers(const std::vector<int64_t>& members) {
  std::ostringstream os;
  os << "devices [";
  for (size_t i = 0; i < members.size(); ++i) os << (i ? " " : "") << members[i];
  os << "]";
  return os.str();
}

}  // namespace

Communicator::Communicator(uint64_t id, std::vector<int64_t> members, Rendezvous* rendezvous,
                           std::unique_ptr<Rendezvous> owned)
    : members_(std::move(members)),
      owned_(std::move(owned)),
      rendezvous_(owned_ ? owned_.get() : rendezvous) {
  info_.id = id;
  info_.description = DescribeMembers(members_);
}

void Communicator::Start(int64_t run_id, int64_t instance, uint64_t site, uint64_t sequence,
                         uint64_t invocation, int64_t op_id, int rank, const void* send, void* recv,
                         const CallInfo& call, const Plan& plan, Done done) {
  CallKey key{info_.id, run_id, instance, invocation, op_id, site, sequence};
  const auto deadline = Clock::now() + Timeout();
  rendezvous_->Start(info_, size(), key, rank, send, recv, call, deadline, plan, std::move(done));
}

Communicator* FindOrCreateCommunicator(const int64_t* members, const int64_t* processes, int size,
                                       Status* error) {
  static std::mutex mu;
  // Keyed by members and their processes: one device id names different
  // devices under different device assignments.
  static auto* table = new std::map<std::vector<int64_t>, std::unique_ptr<Communicator>>();
  static auto* in_process = new InProcessRendezvous();
  std::vector<int64_t> ids(members, members + size);
  std::vector<int64_t> key = ids;
  bool spans = false;
  if (processes) {
    key.insert(key.end(), processes, processes + size);
    for (int r = 1; r < size; ++r) spans |= processes[r] != processes[0];
  }
  std::lock_guard<std::mutex> lock(mu);
  auto& comm = (*table)[key];
  if (comm) return comm.get();
  if (!spans) {
    comm = std::make_unique<Communicator>(table->size(), ids, in_process);
    return comm.get();
  }
  std::shared_ptr<const World> world = CurrentWorld();
  if (!world) {
    table->erase(key);
    *error = Status::InvalidArgument(
        "jax_smddp: a collective's devices span several processes, but jax_smddp is not "
        "initialized in this process: call jax.distributed.initialize() and then "
        "jax_smddp.initialize() in every process (jax_smddp does this itself when it lowers a "
        "collective in a multi-process job).");
    return nullptr;
  }
  std::vector<int> process_of_rank(processes, processes + size);
  std::vector<std::string> hosts(world->processes());
  for (int p = 0; p < world->processes(); ++p) hosts[p] = world->peer(p).host;
  for (int p : process_of_rank) {
    if (p < 0 || p >= world->processes()) {
      table->erase(key);
      *error =
          Status::InvalidArgument("jax_smddp: a collective names process " + std::to_string(p) +
                                  " but the job has " + std::to_string(world->processes()));
      return nullptr;
    }
  }
  comm =
      std::make_unique<Communicator>(table->size(), ids, nullptr,
                                     std::make_unique<ProcessRendezvous>(
                                         ids, std::move(process_of_rank), world->process(), hosts));
  return comm.get();
}

}  // namespace smddp

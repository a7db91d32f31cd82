#include "xla_ffi/engine/communicator.h"

#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <thread>
#include <atomic>
#include <map>
#include <sstream>

#include "xla_ffi/engine/inprocess_transport.h"
#include "xla_ffi/engine/scheduler.h"

namespace smddp {

namespace {

std::atomic<int64_t> g_timeout_ms{300'000};

std::string DescribeMembers(const std::vector<int64_t>& members) {
  std::ostringstream os;
  os << "devices [";
  for (size_t i = 0; i < members.size(); ++i) os << (i ? " " : "") << members[i];
  os << "]";
  return os.str();
}

// Engine workers that run collective bodies beside the rank that arrives
// last: the cores this process may use, less one (JAX_SMDDP_CPU_HELPERS
// overrides).
int InProcessHelpers() {
  if (const char* env = std::getenv("JAX_SMDDP_CPU_HELPERS")) return std::atoi(env);
  cpu_set_t set;
  int cores = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 0;
  if (cores <= 0) cores = int(std::thread::hardware_concurrency());
  return std::min(std::max(cores, 1) - 1, WorkerCount());
}

}  // namespace

void SetTimeoutSeconds(double seconds) { g_timeout_ms = int64_t(seconds * 1000.0); }
double TimeoutSeconds() { return double(g_timeout_ms.load()) / 1000.0; }

Communicator::Communicator(uint64_t id, std::vector<int64_t> members, Transport* transport)
    : members_(std::move(members)), transport_(transport) {
  info_.id = id;
  info_.description = DescribeMembers(members_);
}

void Communicator::Start(int64_t run_id, int64_t instance, uint64_t invocation, int64_t op_id,
                         int rank, const void* send, void* recv, const CallInfo& call,
                         const Plan& plan, Done done) {
  CallKey key{info_.id, run_id, instance, invocation, op_id};
  const auto deadline = Clock::now() + std::chrono::milliseconds(g_timeout_ms.load());
  transport_->Start(info_, size(), key, rank, send, recv, call, deadline, plan, std::move(done));
}

Communicator* FindOrCreateCommunicator(const int64_t* members, int size) {
  static std::mutex mu;
  static auto* table = new std::map<std::vector<int64_t>, std::unique_ptr<Communicator>>();
  static auto* in_process = new InProcessTransport(InProcessHelpers());
  std::vector<int64_t> key(members, members + size);
  std::lock_guard<std::mutex> lock(mu);
  auto& comm = (*table)[key];
  if (!comm) comm = std::make_unique<Communicator>(table->size(), key, in_process);
  return comm.get();
}

}  // namespace smddp

#include "xla_ffi/mpiabi/mpi_front_end.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <sstream>
#include <tuple>
#include <vector>

#include "xla_ffi/common/hashing.h"
#include "xla_ffi/common/huge_pages.h"
#include "xla_ffi/common/timeout.h"
#include "xla_ffi/engine/communicator.h"
#include "xla_ffi/engine/inprocess_rendezvous.h"
#include "xla_ffi/engine/process_rendezvous.h"
#include "xla_ffi/mpiabi/abi.h"
#include "xla_ffi/mpiabi/mpi_point_to_point.h"

namespace smddp {
namespace mpi {

namespace {

std::atomic<bool> initialized{false}, finalized{false};
std::atomic<int> local_devices{0};

thread_local int last_code = 0;
thread_local std::string last_message;

// Engine workers for cliques within this process: as the CPU module's.
InProcessRendezvous* InProcess() {
  static InProcessRendezvous* rendezvous = new InProcessRendezvous();
  return rendezvous;
}

// Communicator ids of this library's cliques (only ever compared within this
// process); apart from the CPU module's, which count from 0.
std::atomic<uint64_t> next_id{uint64_t(1) << 62};

// One split as this process sees it: the (color, key) of each of its devices.
struct Epoch {
  uint64_t number = 0;
  std::vector<std::pair<int, int>> entries;  // by arrival
  std::vector<Rank*> results;                // by arrival
  bool done = false;
  Status status;
};

std::mutex split_mu;
std::condition_variable split_cv;
std::shared_ptr<Epoch> open_epoch;
uint64_t epochs = 0;

// The record each process contributes to a split's exchange.
constexpr int kMaxLocal = 256;
struct Record {
  int32_t count;
  int32_t pairs[kMaxLocal][2];
};

// One rank per process: the communicator splits are exchanged over.
Communicator* Control(const World& world) {
  static std::mutex mu;
  static std::unique_ptr<Communicator> control;
  static const World* built_for = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  if (!control || built_for != &world) {
    const int n = world.processes();
    std::vector<int64_t> members(n);
    std::vector<int> processes(n);
    std::vector<std::string> hosts(n);
    for (int p = 0; p < n; ++p) {
      members[p] = p;
      processes[p] = p;
      hosts[p] = world.peer(p).host;
    }
    control = std::make_unique<Communicator>(
        next_id++, members, nullptr,
        std::make_unique<ProcessRendezvous>(members, processes, world.process(), hosts));
    built_for = &world;
  }
  return control.get();
}

// Runs one engine call for rank `rank` of `comm` and waits for its end.
Status RunAndWait(Communicator& comm, uint64_t site, uint64_t sequence, int rank, const void* send,
                  void* recv, const CallInfo& info, const Plan& plan) {
  struct Wait {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    Status status;
  };
  auto wait = std::make_shared<Wait>();
  AdviseHugePages(recv, info.recv_bytes);  // before the first write
  comm.Start(/*run_id=*/0, /*instance=*/0, site, sequence, /*invocation=*/sequence,
             /*op_id=*/int64_t(sequence), rank, send, recv, info, plan, [wait](const Status& st) {
               std::lock_guard<std::mutex> lock(wait->mu);
               wait->status = st;
               wait->done = true;
               wait->cv.notify_all();
             });
  std::unique_lock<std::mutex> lock(wait->mu);
  wait->cv.wait(lock, [&] { return wait->done; });
  return wait->status;
}

// Every process's record in, this process's devices' ranks out.
Status Assign(Epoch& epoch, const std::vector<Record>& records, int me,
              const std::shared_ptr<const World>& world) {
  // color -> (key, process, arrival index here or -1)
  std::vector<std::pair<int, std::vector<std::tuple<int, int, int>>>> cliques;
  for (int p = 0; p < int(records.size()); ++p) {
    for (int i = 0; i < records[p].count; ++i) {
      const int color = records[p].pairs[i][0], key = records[p].pairs[i][1];
      if (color == int(MPIABI_UNDEFINED)) continue;
      auto it = std::find_if(cliques.begin(), cliques.end(),
                             [&](const auto& c) { return c.first == color; });
      if (it == cliques.end()) {
        cliques.emplace_back(color, std::vector<std::tuple<int, int, int>>());
        it = cliques.end() - 1;
      }
      it->second.emplace_back(key, p, p == me ? i : -1);
    }
  }
  epoch.results.assign(epoch.entries.size(), nullptr);
  for (auto& [color, members] : cliques) {
    std::sort(members.begin(), members.end());
    bool local = false, spans = false;
    for (auto& m : members) {
      local |= std::get<1>(m) == me;
      spans |= std::get<1>(m) != std::get<1>(members[0]);
    }
    if (!local) continue;
    const int n = int(members.size());
    std::vector<int64_t> ids(n);
    std::vector<int> processes(n);
    for (int r = 0; r < n; ++r) {
      ids[r] = std::get<0>(members[r]);
      processes[r] = std::get<1>(members[r]);
    }
    auto group = std::make_shared<Group>();
    group->members = ids;
    group->process_of_rank = processes;
    group->site = MixTag(MixTag(0x6d70692d73706c74ull, uint64_t(uint32_t(color))), epoch.number);
    group->world = world;
    if (!spans) {
      group->comm = std::make_unique<Communicator>(next_id++, ids, InProcess());
    } else {
      if (!world)
        return Status::InvalidArgument(
            "jax_smddp (XLA collectives through MPI): a clique spans processes but jax_smddp's "
            "world is not initialized in this process");
      std::vector<std::string> hosts(world->processes());
      for (int p = 0; p < world->processes(); ++p) hosts[p] = world->peer(p).host;
      group->comm = std::make_unique<Communicator>(
          next_id++, ids, nullptr,
          std::make_unique<ProcessRendezvous>(ids, processes, world->process(), hosts));
    }
    for (int r = 0; r < n; ++r) {
      const int arrival = std::get<2>(members[r]);
      if (arrival < 0) continue;
      auto* rank = new Rank;  // freed by MPI_Comm_free
      rank->group = group;
      rank->rank = r;
      epoch.results[arrival] = rank;
    }
  }
  return Status::Ok();
}

// The exchange, run by the last device of this process to arrive.
Status Exchange(Epoch& epoch) {
  std::shared_ptr<const World> world = CurrentWorld();
  Record mine{};
  mine.count = int32_t(epoch.entries.size());
  for (size_t i = 0; i < epoch.entries.size(); ++i) {
    mine.pairs[i][0] = epoch.entries[i].first;
    mine.pairs[i][1] = epoch.entries[i].second;
  }
  if (!world) return Assign(epoch, {mine}, 0, nullptr);
  const int n = world->processes();
  std::vector<Record> all(n);
  Communicator* control = Control(*world);
  Plan plan;
  plan.kind = Collective::kAllGather;
  plan.dtype = DType::kUInt8;
  plan.outer = 1;
  plan.inner = sizeof(Record);
  CallInfo info{"MPI_Comm_split", DType::kUInt8, ReduceOp::kSum, sizeof(Record),
                sizeof(Record) * uint64_t(n)};
  SMDDP_RETURN_IF_ERROR(RunAndWait(*control, 0x73706c6974ull, epoch.number, world->process(), &mine,
                                   all.data(), info, plan));
  return Assign(epoch, all, world->process(), world);
}

}  // namespace

void Configure(WorldSource source, int devices) {
  if (source) UseWorldOf(source);
  local_devices = devices;
}

int Fail(int code, std::string message) {
  last_code = code;
  last_message = std::move(message);
  return code;
}

int Fail(const Status& status) {
  int code;
  switch (status.code()) {
    case StatusCode::kUnsupported:
      code = int(MPIABI_ERR_UNSUPPORTED_OPERATION);
      break;
    case StatusCode::kInvalidArgument:
      code = int(MPIABI_ERR_ARG);
      break;
    case StatusCode::kMismatch:
      code = int(MPIABI_ERR_TRUNCATE);
      break;
    case StatusCode::kInternal:
      code = int(MPIABI_ERR_INTERN);
      break;
    default:
      code = int(MPIABI_ERR_OTHER);
      break;
  }
  return Fail(code, TaggedMessage(status.code(), status.message()));
}

int Unsupported(const char* function) {
  return Fail(
      int(MPIABI_ERR_UNSUPPORTED_OPERATION),
      TaggedMessage(StatusCode::kUnsupported, "jax_smddp's MPI front end does not implement ") +
          function +
          " (it serves the calls XLA's CPU collectives make); unset "
          "JAX_SMDDP_COLLECTIVES=xla to run this program on gloo");
}

std::string ErrorString(int code) {
  if (code == int(MPIABI_SUCCESS)) return "no error";
  if (code == last_code && !last_message.empty()) return last_message;
  return "jax_smddp MPI error " + std::to_string(code);
}

void SetInitialized(bool on) {
  if (on)
    initialized = true;
  else
    finalized = true;
}
bool Initialized() { return initialized; }
bool Finalized() { return finalized; }

int WorldRank() {
  auto world = CurrentWorld();
  return world ? world->process() : 0;
}
int WorldSize() {
  auto world = CurrentWorld();
  return world ? world->processes() : 1;
}

Status Split(int color, int key, Rank** out) {
  *out = nullptr;
  const int expected = local_devices.load();
  if (expected <= 0)
    return Status::InvalidArgument(
        "jax_smddp (XLA collectives through MPI): the front end was not configured; it is set "
        "up by the jax_smddp plugin when JAX_SMDDP_COLLECTIVES=xla (or all) is set before JAX "
        "starts");
  if (expected > kMaxLocal)
    return Status::Unsupported("jax_smddp (XLA collectives through MPI): more than " +
                               std::to_string(kMaxLocal) + " devices in one process");
  std::unique_lock<std::mutex> lock(split_mu);
  if (!open_epoch) {
    open_epoch = std::make_shared<Epoch>();
    open_epoch->number = epochs++;
  }
  std::shared_ptr<Epoch> epoch = open_epoch;
  const size_t arrival = epoch->entries.size();
  epoch->entries.emplace_back(color, key);
  if (int(epoch->entries.size()) == expected) {
    open_epoch = nullptr;  // the next split is the next epoch
    lock.unlock();
    Status st = Exchange(*epoch);
    lock.lock();
    epoch->status = st;
    epoch->done = true;
    split_cv.notify_all();
  } else {
    const auto deadline = Clock::now() + Timeout();
    while (!epoch->done) {
      if (split_cv.wait_until(lock, deadline) == std::cv_status::timeout && !epoch->done &&
          open_epoch == epoch) {
        // The other devices of this process never came: fail them all.
        open_epoch = nullptr;
        epoch->status = Status::Timeout(
            "jax_smddp (XLA collectives through MPI): MPI_Comm_split: " +
            std::to_string(epoch->entries.size()) + " of this process's " +
            std::to_string(expected) +
            " devices created a communicator within the deadline. XLA's collectives through "
            "jax_smddp need every device of the job to take part in each program that "
            "communicates across processes; raise JAX_SMDDP_TIMEOUT_S if they are only slow.");
        epoch->done = true;
        split_cv.notify_all();
      }
    }
  }
  if (!epoch->status.ok()) return epoch->status;
  *out = arrival < epoch->results.size() ? epoch->results[arrival] : nullptr;
  return Status::Ok();
}

int Size(const Rank& r) { return r.group->comm->size(); }

void CountCall(const Rank& r, World::Caller caller, uint64_t bytes) {
  if (r.group->world) r.group->world->CountCall(caller, bytes);
}

Status RunCollective(Rank& r, const char* mpi_name, World::Caller caller, const Plan& plan,
                     const void* send, void* recv) {
  size_t in = 0, out = 0;
  CallBytes(plan, Size(r), &in, &out);
  const CallInfo info{CollectiveName(plan.kind), plan.dtype, plan.op, in, out};
  const uint64_t n = r.calls++;
  Status st = RunAndWait(*r.group->comm, r.group->site, n, r.rank, send, recv, info, plan);
  if (st.ok()) {
    CountCall(r, caller, info.recv_bytes);
    return st;
  }
  // The engine's message first ("jax_smddp all_gather (op ...): ..."): what
  // jax_smddp.errors.classify reads the op and communicator from.
  return st.WithMessage(st.message() + " [XLA's collective through " + std::string(mpi_name) +
                        ", rank " + std::to_string(r.rank) + " of " + std::to_string(Size(r)) +
                        "]");
}

}  // namespace mpi
}  // namespace smddp

extern "C" SMDDP_MPI_EXPORT void smddp_mpi_configure(uintptr_t world_source, int local_devices) {
  smddp::mpi::Configure(reinterpret_cast<smddp::WorldSource>(world_source), local_devices);
}

// _smddp_testing: entries into the engine for the tests, built with
// -DJAX_SMDDP_TESTING=ON into the test environment (scripts/build_testing.sh),
// never installed with the package. Each probe runs a piece of the engine
// (a rendezvous, the stream protocol on host threads, the GPU watchdog, the
// call log, a libfabric rail) on its own, with its own copy of the engine.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include "nanobind/nanobind.h"
#include "nanobind/stl/map.h"
#include "nanobind/stl/pair.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/tuple.h"
#include "nanobind/stl/unique_ptr.h"
#include "nanobind/stl/vector.h"
#include "tests/native/host_stream_ops.h"
#include "tests/native/scheduler_probes.h"
#include "xla_ffi/algorithms/net_port.h"
#include "xla_ffi/algorithms/phase_timer.h"
#include "xla_ffi/algorithms/plan.h"
#include "xla_ffi/algorithms/process_call.h"
#include "xla_ffi/algorithms/reduce.h"
#include "xla_ffi/algorithms/reduce_kernels.h"
#include "xla_ffi/algorithms/stream_algorithms.h"
#include "xla_ffi/algorithms/wait_polls.h"
#include "xla_ffi/bindings/enums.h"
#include "xla_ffi/bindings/failures.h"
#include "xla_ffi/bindings/phase_dict.h"
#include "xla_ffi/common/protocol.h"
#include "xla_ffi/common/settings.h"
#include "xla_ffi/common/streaming_copy.h"
#include "xla_ffi/engine/call_log.h"
#include "xla_ffi/engine/communicator.h"
#include "xla_ffi/engine/inprocess_rendezvous.h"
#include "xla_ffi/engine/last_failure.h"
#include "xla_ffi/engine/scheduler.h"
#include "xla_ffi/engine/stream_watchdog.h"
#include "xla_ffi/transports/fabric_rail.h"
#include "xla_ffi/transports/fabric_wire.h"
#include "xla_ffi/transports/process_liveness.h"
#include "xla_ffi/transports/shared_block.h"
#include "xla_ffi/transports/shm_link.h"
#include "xla_ffi/transports/world.h"

namespace nb = nanobind;

namespace {

// Raises the engine's error as a Python RuntimeError.
void Check(const smddp::Status& st) {
  if (!st.ok()) throw std::runtime_error(st.message());
}

// Parses each chunk with the libfabric links' parser (fabric_wire.h) as a
// receiver of protocol `version` with a `capacity`-byte buffer whose group is
// `group` (sender id -> name). Each chunk lies at the very end of readable
// memory, a PROT_NONE page right after its last byte: a parser that read past
// the chunk's end would crash this process. Per chunk: (accepted, error
// message, the sender blamed (0: none), the header's fields when accepted:
// magic, version, sender, seq, tag, total, offset, len, kind, reserved).
using ChunkFields = std::vector<uint64_t>;
std::vector<std::tuple<bool, std::string, uint64_t, ChunkFields>> FabricChunkProbe(
    const std::vector<nb::bytes>& chunks, size_t capacity, uint32_t version,
    const std::map<uint64_t, std::string>& group) {
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  size_t longest = 0;
  for (const nb::bytes& c : chunks) longest = std::max(longest, c.size());
  const size_t readable = (longest + page - 1) / page * page + page;
  char* base = static_cast<char*>(
      mmap(nullptr, readable + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (base == MAP_FAILED) throw std::runtime_error("mmap failed");
  if (mprotect(base + readable, page, PROT_NONE) != 0) {
    munmap(base, readable + page);
    throw std::runtime_error("mprotect failed");
  }
  const smddp::FabricSenderGroup in_group = [&](uint64_t id, std::string* name) {
    auto it = group.find(id);
    if (it == group.end()) return false;
    *name = it->second;
    return true;
  };
  std::vector<std::tuple<bool, std::string, uint64_t, ChunkFields>> out;
  for (const nb::bytes& c : chunks) {
    char* at = base + readable - c.size();  // its last byte just before the guard page
    std::memcpy(at, c.c_str(), c.size());
    smddp::FabricChunkHeader h;
    uint64_t blame = 0;
    const smddp::Status st =
        smddp::ParseFabricChunk(at, c.size(), capacity, version, in_group, &h, &blame);
    ChunkFields fields;
    if (st.ok()) {
      fields = {h.magic, h.version, h.sender, h.seq,  h.tag,
                h.total, h.offset,  h.len,    h.kind, h.reserved};
    } else if (st.code() != smddp::StatusCode::kProtocol) {
      fields = {uint64_t(st.code())};  // the wrong kind of error: the test says so
    }
    out.emplace_back(st.ok(), st.message(), blame, std::move(fields));
  }
  munmap(base, readable + page);
  return out;
}

// Runs one all_reduce of `count` floats on a private communicator of `size`
// ranks, where only the ranks in `present` ever arrive (rank `odd_rank`, if
// any, with one element more than the others). Checks the sum and returns, per
// present rank, the error text ("" on success). Tests the engine's failure
// paths directly. Rank r's element i is r + 1 + 16 (i mod 4093), so the sum
// of every element depends on its place and on every rank (exact in f32): a
// shifted, swapped or missing contribution gives a wrong sum.
std::vector<std::pair<int, std::string>> RendezvousProbe(int size, std::vector<int> present,
                                                         double timeout_s, int64_t count,
                                                         int odd_rank) {
  static std::atomic<int64_t> next_run{1};
  std::vector<int64_t> members;
  for (int r = 0; r < size; ++r) members.push_back(-1000000 - r);  // never a real device
  smddp::Status error;
  smddp::Communicator* comm =
      smddp::FindOrCreateCommunicator(members.data(), nullptr, size, &error);
  const int64_t run_id = -(next_run++);
  const double saved = smddp::TimeoutSeconds();
  smddp::SetTimeoutSeconds(timeout_s);
  std::vector<std::pair<int, std::string>> results(present.size());
  std::vector<std::vector<float>> send, recv;
  auto element = [](int64_t i) { return 16.0f * float(i % 4093); };
  for (int r : present) {
    const int64_t n = count + (r == odd_rank ? 1 : 0);
    send.emplace_back(n);
    for (int64_t i = 0; i < n; ++i) send.back()[i] = float(r + 1) + element(i);
    recv.emplace_back(n, 0.0f);
  }
  {
    nb::gil_scoped_release release;
    std::vector<std::thread> threads;
    for (size_t i = 0; i < present.size(); ++i) {
      threads.emplace_back([&, i] {
        const uint64_t bytes = send[i].size() * 4;
        smddp::Plan plan;
        plan.kind = smddp::Collective::kAllReduce;
        const char* op = smddp::CollectiveName(plan.kind);
        smddp::CallInfo info{op, smddp::DType::kFloat32, smddp::ReduceOp::kSum, bytes, bytes};
        plan.count = send[i].size();
        std::promise<smddp::Status> finished;
        comm->Start(run_id, 0, 0, 0, 0, 0, present[i], send[i].data(), recv[i].data(), info, plan,
                    [&finished](const smddp::Status& st) { finished.set_value(st); });
        smddp::Status st = finished.get_future().get();
        // Recorded as the CPU handler records a failure (jax_smddp.errors).
        smddp::RecordFailure(op, comm->members(), present[i], st);
        for (size_t j = 0; j < recv[i].size() && st.ok(); ++j) {
          const float want = float(size) * float(size + 1) / 2 + float(size) * element(int64_t(j));
          if (recv[i][j] != want)
            st = smddp::Status::Error("wrong sum at element " + std::to_string(j) + ": " +
                                      std::to_string(recv[i][j]) + " instead of " +
                                      std::to_string(want));
        }
        results[i] = {present[i], st.ok() ? std::string() : st.message()};
      });
    }
    for (auto& t : threads) t.join();
  }
  smddp::SetTimeoutSeconds(saved);
  return results;
}

// 64-byte aligned host blocks of `bytes` each, zeroed (stand-ins for GPU
// regions and flag blocks).
struct HostBlocks {
  HostBlocks(int n, size_t bytes) : storage(n, std::vector<uint8_t>(bytes + 64)) {
    for (auto& r : storage)
      bases.push_back(reinterpret_cast<uint8_t*>((uintptr_t(r.data()) + 63) / 64 * 64));
  }
  std::vector<std::vector<uint8_t>> storage;
  std::vector<uint8_t*> bases;
};

// Runs `calls` calls of `plan` on host threads, one per rank except
// `absent` (-1: none), over `regions` (and separate flag blocks `flags`, if
// not empty). `direct`: 0 stages every call through the slots, 1 reads the
// peers' buffers in place (StreamRank::inputs, outputs), 2 alternates
// (direct first).
// `send` holds one input per rank, or with `vary` one per call and rank
// (call-major), copied into the rank's one input buffer before each call (as
// XLA reuses a buffer); then each rank's one output buffer is copied into
// `recv` after every call (every call's output in turn) and overwritten.
// Returns each rank's status.
std::vector<smddp::Status> RunStreamRanks(
    const smddp::Plan& plan, const smddp::RegionLayout& layout,
    const std::vector<uint8_t*>& regions, const std::vector<uint8_t*>& flags,
    const std::vector<std::string>& send, std::vector<std::string>& recv, int calls,
    double timeout_s, int absent, int direct = 0, bool vary = false, uint32_t first_step = 0,
    std::vector<smddp::PhaseTotals>* phases = nullptr, int replayable = 0) {
  const int size = int(regions.size());
  // A group that has already run `first_step` steps: every step flag there
  // (first_step near 2^32 checks that the counters wrap); tokens start clear.
  for (uint32_t* flag : smddp::AllFlags(layout, flags.empty() ? regions : flags))
    *flag = first_step;
  if (vary && int(send.size()) != calls * size)
    throw std::invalid_argument("one input per call and rank");
  std::vector<smddp::Status> status(size);
  std::vector<std::string> buffers(send.begin(), send.begin() + size);  // each rank's input buffer
  std::vector<const uint8_t*> inputs;
  for (auto& b : buffers) inputs.push_back(reinterpret_cast<const uint8_t*>(b.data()));
  const size_t out_bytes = vary ? recv[0].size() / calls : recv[0].size();
  // Each rank's output buffer: with `vary`, one reused by every call, copied
  // out after the call and then overwritten (as XLA reuses a buffer).
  std::vector<std::string> held(vary ? size : 0, std::string(out_bytes, '\0'));
  std::vector<uint8_t*> outputs;
  for (int r = 0; r < size; ++r)
    outputs.push_back(reinterpret_cast<uint8_t*>(vary ? held[r].data() : recv[r].data()));
  nb::gil_scoped_release release;
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    if (r == absent) continue;
    threads.emplace_back([&, r] {
      smddp::StreamRank me;
      me.rank = r;
      me.step = first_step;
      me.layout = layout;
      me.regions = regions;
      me.flags = flags;
      me.drain_each_call = replayable != 0;
      smddp::HostStreamOps host(timeout_s);
      smddp::HostClock clock;
      smddp::PhaseTimedOps timed(host, clock);
      smddp::StreamOps& ops = phases ? static_cast<smddp::StreamOps&>(timed) : host;
      for (int c = 0; c < calls && status[r].ok(); ++c) {
        if (vary)
          std::memcpy(buffers[r].data(), send[size_t(c) * size + r].data(), buffers[r].size());
        const bool in_place = direct == 1 || (direct == 2 && c % 2 == 0);
        me.inputs.clear();
        me.outputs.clear();
        if (in_place) {
          me.inputs = inputs;
          me.outputs = outputs;
        }
        // Every call must write all of its output: an earlier call's would hide a gap.
        if (!vary) std::memset(outputs[r], 0xA5, out_bytes);
        const bool replay = replayable == 1 || (replayable == 2 && c % 2 == 0);
        status[r] = smddp::RunStreamPlan(plan, me, ops, buffers[r].data(), outputs[r], replay);
        if (vary) {
          std::memcpy(recv[r].data() + c * out_bytes, outputs[r], out_bytes);
          std::memset(outputs[r], 0xA5, out_bytes);
        }
      }
      if (phases && status[r].ok()) status[r] = timed.Totals(&(*phases)[r]);
    });
  }
  for (auto& t : threads) t.join();
  return status;
}

std::vector<std::string> Strings(const std::vector<nb::bytes>& inputs) {
  std::vector<std::string> out;
  for (auto& b : inputs) out.emplace_back(b.c_str(), b.size());
  return out;
}

std::vector<nb::bytes> Bytes(const std::vector<std::string>& buffers) {
  std::vector<nb::bytes> out;
  for (auto& r : buffers) out.emplace_back(r.data(), r.size());
  return out;
}

// Runs the stream-ordered algorithms (the GPU protocol) on host threads, one
// per rank, over host memory: `calls` consecutive calls of one collective
// (kind 0 all_gather, 1 reduce_scatter, 2 all_reduce, 3 all_to_all) with
// `slot_bytes` staging slots (flags in the regions, or in separate flag
// blocks with `flag_blocks`); `direct` and `vary` as in RunStreamRanks;
// `replayable` 1: every call as one captured into a CUDA graph (each is the
// same sequence of operations a replay runs), 2: every other call, the rest
// staged or direct as `direct` says, the group draining each call.
// `sources`: collective_permute's (Plan::sources), one per rank.
// Returns each rank's output (every call's with `vary`), or raises the first
// rank's error. Tests the protocol (slots, flags, tiling) without a GPU.
std::vector<nb::bytes> StreamProbe(int kind, int dtype, int op, size_t outer, size_t inner,
                                   size_t count, size_t slot_bytes, std::vector<nb::bytes> inputs,
                                   size_t out_bytes, int calls, double timeout_s, bool flag_blocks,
                                   int direct, bool vary, uint32_t first_step, int replayable,
                                   std::vector<int64_t> sources) {
  const int size = vary ? int(inputs.size()) / std::max(calls, 1) : int(inputs.size());
  smddp::Plan plan = smddp::PlanOf(kind, dtype, op, outer, inner, count);
  if (!sources.empty()) {
    if (int(sources.size()) != size) throw std::invalid_argument("one source per rank");
    plan.sources = sources.data();
  }
  smddp::RegionLayout layout(size, slot_bytes);
  HostBlocks regions(size, layout.total_bytes), flags(flag_blocks ? size : 0, layout.flag_bytes());
  std::vector<std::string> recv(size, std::string(out_bytes * (vary ? calls : 1), '\0'));
  const std::vector<smddp::Status> status =
      RunStreamRanks(plan, layout, regions.bases, flags.bases, Strings(inputs), recv, calls,
                     timeout_s, -1, direct, vary, first_step, nullptr, replayable);
  for (int r = 0; r < size; ++r) {
    if (!status[r].ok())
      throw std::runtime_error("rank " + std::to_string(r) + ": " + status[r].message());
  }
  return Bytes(recv);
}

// Per-phase time of each rank (phase_timer.h) over `calls` calls of one
// collective on host threads, as StreamProbe runs them: (outputs, per rank
// {phase: (calls, seconds)} and "total": first mark to last).
std::pair<std::vector<nb::bytes>, std::vector<nb::dict>> StreamPhaseProbe(
    int kind, int dtype, int op, size_t outer, size_t inner, size_t count, size_t slot_bytes,
    std::vector<nb::bytes> inputs, size_t out_bytes, int calls, int direct) {
  const int size = int(inputs.size());
  const smddp::Plan plan = smddp::PlanOf(kind, dtype, op, outer, inner, count);
  smddp::RegionLayout layout(size, slot_bytes);
  HostBlocks regions(size, layout.total_bytes), flags(0, layout.flag_bytes());
  std::vector<std::string> recv(size, std::string(out_bytes, '\0'));
  std::vector<smddp::PhaseTotals> phases(size);
  const std::vector<smddp::Status> status =
      RunStreamRanks(plan, layout, regions.bases, flags.bases, Strings(inputs), recv, calls, 20.0,
                     -1, direct, false, 0, &phases);
  std::vector<nb::dict> out;
  for (int r = 0; r < size; ++r) {
    if (!status[r].ok())
      throw std::runtime_error("rank " + std::to_string(r) + ": " + status[r].message());
    out.push_back(smddp::PhaseDict(phases[r]));
  }
  return {Bytes(recv), out};
}

// The GPU backend's dead-peer watchdog over the protocol on host threads:
// rank `absent` never runs, and stands for process `absent_pid` (which the
// test kills while the other ranks wait for it). The watchdog sees the
// process exit and releases the group's flags, so the other ranks' calls
// complete (`replayable` as in StreamProbe: their waits on tokens too).
// Returns (each rank's status message, the group's error, outputs).
std::tuple<std::vector<std::string>, std::string, std::vector<nb::bytes>> StreamWatchProbe(
    int kind, int dtype, int op, size_t outer, size_t inner, size_t count, size_t slot_bytes,
    std::vector<nb::bytes> inputs, size_t out_bytes, int calls, double timeout_s, int absent,
    int absent_pid, int direct, uint32_t first_step, int replayable) {
  const int size = int(inputs.size());
  if (absent < 0 || absent >= size) throw std::invalid_argument("absent rank out of range");
  const smddp::Plan plan = smddp::PlanOf(kind, dtype, op, outer, inner, count);
  smddp::RegionLayout layout(size, slot_bytes);
  HostBlocks regions(size, layout.total_bytes), flags(size, layout.flag_bytes());
  auto group = std::make_shared<smddp::WatchedGroup>("host test group of " + std::to_string(size));
  smddp::WatchedPeer peer;
  peer.pid = absent_pid;
  peer.start_time = smddp::ProcessStartTime(absent_pid);
  peer.who = "rank " + std::to_string(absent) + " (pid " + std::to_string(absent_pid) + ")";
  group->AddPeer(std::move(peer));
  // The ranks run a few calls from first_step: the step reached, as far as
  // the release distance is concerned.
  group->SetAllFlags(smddp::AllFlags(layout, flags.bases), smddp::AllTokens(layout, flags.bases),
                     [first_step] { return first_step; });
  smddp::Watch(group);
  std::vector<std::string> recv(size, std::string(out_bytes, '\0'));
  const std::vector<smddp::Status> status =
      RunStreamRanks(plan, layout, regions.bases, flags.bases, Strings(inputs), recv, calls,
                     timeout_s, absent, direct, false, first_step, nullptr, replayable);
  smddp::Unwatch(group.get());
  std::vector<std::string> errors;
  for (const auto& st : status) errors.push_back(st.message());
  return {errors, group->error().message(), Bytes(recv)};
}

// The hierarchical all_gather (kind 0), reduce_scatter (kind 1) or
// all_to_all (kind 3: the kinds of StreamProbe) of the GPU backend on host
// threads: `hosts` x `local` ranks, each its own "process" with its own
// network proxy; rail peers joined by shared-memory links in this process (the proxy sees only
// the Link interface, as over libfabric). rank_of[g * local + j] is the group
// rank of host g's j-th rank; inputs are by group rank. `kill_host` >= 0
// closes that host's links before the calls (a dead peer): then returns the
// ranks' errors, then their outputs (by thread, host-major). `rail_provider`
// non-empty: the proxies move the slots' bytes over FabricRails of that
// provider instead (registered host memory, tagged messages, no bounce
// buffers), one rail endpoint per rank, the shared-memory links reporting
// peer failures.
std::vector<nb::bytes> StreamHierarchicalProbe(int hosts, int local, size_t outer, size_t inner,
                                               size_t slot_bytes, std::vector<int> rank_of,
                                               std::vector<nb::bytes> inputs, int calls,
                                               double timeout_s, int kill_host, int kind, int dtype,
                                               int op, const std::string& rail_provider) {
  const int P = hosts * local;
  if (int(inputs.size()) != P || int(rank_of.size()) != P) throw std::invalid_argument("sizes");
  if (kind != 0 && kind != 1 && kind != 3) throw std::invalid_argument("kind: 0, 1 or 3");
  smddp::RegionLayout layout(local, slot_bytes);
  smddp::NetLayout net(hosts, slot_bytes);
  HostBlocks regions(P, layout.total_bytes), mailboxes(P, net.mailbox_bytes),
      signals(P, net.signal_bytes);
  // Links: for each rail j and hosts g < g2, a pair between (g, j) and (g2, j).
  std::vector<std::unique_ptr<smddp::Link>> owned;
  std::vector<std::vector<smddp::Link*>> links(P, std::vector<smddp::Link*>(hosts, nullptr));
  for (int j = 0; j < local; ++j) {
    for (int g = 0; g < hosts; ++g) {
      for (int g2 = g + 1; g2 < hosts; ++g2) {
        std::string name;
        std::shared_ptr<smddp::ShmSegment> a, b;
        Check(smddp::CreateShmSegment(64 << 10, &name, &a));
        Check(smddp::OpenShmSegment(name, &b));
        Check(smddp::UnlinkShmSegment(name));
        owned.push_back(smddp::MakeShmLink(a, true, ::getpid()));
        links[g * local + j][g2] = owned.back().get();
        owned.push_back(smddp::MakeShmLink(b, false, ::getpid()));
        links[g2 * local + j][g] = owned.back().get();
      }
    }
  }
  if (kill_host >= 0) {
    // Destroying a link marks its side closed: the peers see an orderly exit.
    for (auto& l : owned) {
      for (int j = 0; j < local; ++j) {
        for (int g = 0; g < hosts; ++g) {
          if (links[kill_host * local + j][g] == l.get()) l.reset();
        }
      }
    }
  }
  std::vector<std::unique_ptr<smddp::FabricRail>> rails;
  std::vector<std::unique_ptr<smddp::FabricRail::Region>> regions_registered;
  if (!rail_provider.empty()) {
    for (int x = 0; x < P; ++x) {
      std::unique_ptr<smddp::FabricRail> rail;
      Check(smddp::FabricRail::Open(rail_provider, "", smddp::MemoryIface::kHost, &rail));
      std::unique_ptr<smddp::FabricRail::Region> region;
      Check(rail->Register(mailboxes.bases[x] + net.flag_bytes, net.slot_area_bytes, 0, &region));
      regions_registered.push_back(std::move(region));
      rails.push_back(std::move(rail));
    }
    for (int x = 0; x < P; ++x) {
      for (int g = 0; g < hosts; ++g) {
        smddp::Link* control = links[x][g];  // dangling for a killed host: never used
        if (!control) continue;
        const int peer = g * local + x % local;
        std::unique_ptr<smddp::Link> link;
        Check(rails[x]->Connect(rails[peer]->Address(), "rank " + std::to_string(peer), control,
                                &link));
        links[x][g] = link.get();
        owned.push_back(std::move(link));
      }
    }
  }
  std::vector<std::string> send;
  for (int g = 0; g < hosts; ++g)
    for (int j = 0; j < local; ++j) {
      const auto& b = inputs[rank_of[g * local + j]];
      send.emplace_back(b.c_str(), b.size());
    }
  // kind 0: all_gather (inner: bytes per row); 1: reduce_scatter (inner:
  // elements per block row); 3: all_to_all (inner: bytes per block row).
  const smddp::Plan plan = smddp::PlanOf(kind, dtype, op, outer, inner, 0);
  const size_t out_bytes =
      smddp::ScaleByRanks(send[0].size(), smddp::SpecOf(plan.kind).out_power, P);
  std::vector<std::string> recv(P, std::string(out_bytes, '\0'));
  std::vector<smddp::Status> status(P);
  {
    nb::gil_scoped_release release;
    std::vector<std::unique_ptr<smddp::NetworkProxy>> proxies;
    std::vector<smddp::NetPort> ports(P);
    for (int x = 0; x < P; ++x) proxies.push_back(std::make_unique<smddp::NetworkProxy>(timeout_s));
    std::vector<std::thread> threads;
    for (int g = 0; g < hosts; ++g) {
      for (int j = 0; j < local; ++j) {
        const int x = g * local + j;  // thread index: host-major
        if (g == kill_host) continue;
        smddp::NetPort& port = ports[x];
        port.hosts = hosts;
        port.host = g;
        port.rail = j;
        port.key = 0x5eed;
        port.layout = net;
        port.mailbox_stream = port.mailbox_proxy = mailboxes.bases[x];
        port.signals_stream = port.signals_proxy = signals.bases[x];
        port.slots_stream = port.slots_proxy = mailboxes.bases[x] + net.flag_bytes;
        port.links = links[x];
        port.peer_process.assign(hosts, 0);
        for (int k = 0; k < hosts; ++k) port.peer_process[k] = k * local + j;
        port.proxy = proxies[x].get();
        threads.emplace_back([&, g, j, x] {
          smddp::StreamRank me;
          me.rank = j;
          me.layout = layout;
          for (int k = 0; k < local; ++k) me.regions.push_back(regions.bases[g * local + k]);
          smddp::HostStreamOps ops(timeout_s);
          for (int c = 0; c < calls && status[x].ok(); ++c) {
            status[x] = smddp::RunStreamHierarchicalPlan(plan, me, ports[x], rank_of, ops,
                                                         send[x].data(), recv[x].data());
          }
          // The proxy reports network failures; a failed step still released the stream.
          if (status[x].ok()) {
            // Drain: the last steps' errors surface once the proxy ran them.
            for (int spin = 0; spin < 2000 && !ports[x].proxy->failed(); ++spin) {
              if (__atomic_load_n(ports[x].host_side<uint32_t>(net.done(), true),
                                  __ATOMIC_ACQUIRE) >= ports[x].step)
                break;
              std::this_thread::sleep_for(std::chrono::milliseconds(1));
            }
            status[x] = ports[x].proxy->error();
          }
        });
      }
    }
    for (auto& t : threads) t.join();
    proxies.clear();
  }
  std::vector<nb::bytes> out;
  for (int x = 0; x < P; ++x) {
    if (kill_host >= 0) {
      out.emplace_back(status[x].message().data(), status[x].message().size());
    } else if (!status[x].ok()) {
      throw std::runtime_error("rank " + std::to_string(x) + ": " + status[x].message());
    }
  }
  for (int x = 0; x < P; ++x) out.emplace_back(recv[x].data(), recv[x].size());
  return out;
}

}  // namespace

NB_MODULE(_smddp_testing, m) {
  m.doc() = "jax_smddp's test probes (not installed with the package)";
  BindEnums(m);
  // The engine's cross-process routes for `process` (routes.cc), for the
  // parity test with the cost model's port of them.
  m.def(
      "routes",
      [](std::vector<int> process_of_rank, int process, std::vector<std::string> host_of_process,
         bool allow_hierarchy, bool stagger) {
        const smddp::Routes r = smddp::ComputeRoutes(process_of_rank, process, host_of_process,
                                                     allow_hierarchy, stagger);
        nb::dict d;
        d["hierarchical"] = r.hierarchical;
        d["gather_source"] = r.gather_source;
        d["gather_relay"] = r.gather_relay;
        d["gather_targets"] = r.gather_targets;
        d["reduce_sources"] = r.reduce_sources;
        d["reduce_dest"] = r.reduce_dest;
        d["stagger_to"] = r.stagger_to;
        d["stagger_from"] = r.stagger_from;
        d["ring"] = r.ring;
        d["gather_order"] = r.gather_order;
        d["reduce_order"] = r.reduce_order;
        return d;
      },
      nb::arg("process_of_rank"), nb::arg("process"), nb::arg("host_of_process"),
      nb::arg("allow_hierarchy") = true, nb::arg("stagger") = false);
  // The failures this module's engine copy recorded (its probes' calls).
  BindFailures(m);
  // CopyBytes (streaming_copy.h): `src` copied to byte `dst_offset` of a
  // `dst_bytes` buffer of 0xAB (from byte `src_offset` of an aligned copy of
  // `src`); returns the whole buffer, guards included.
  m.def(
      "copy_bytes",
      [](nb::bytes src, size_t src_offset, size_t dst_bytes, size_t dst_offset, bool stream) {
        const size_t n = src.size();
        if (dst_offset + n > dst_bytes) throw std::invalid_argument("the copy does not fit");
        std::vector<char> from(src_offset + n + 64), to(dst_bytes + 64, char(0xAB));
        char* s =
            from.data() + ((64 - reinterpret_cast<uintptr_t>(from.data()) % 64) % 64) + src_offset;
        char* d = to.data() + ((64 - reinterpret_cast<uintptr_t>(to.data()) % 64) % 64);
        std::memcpy(s, src.c_str(), n);
        smddp::CopyBytes(d + dst_offset, s, n, stream);
        return nb::bytes(d, dst_bytes);
      },
      nb::arg("src"), nb::arg("src_offset"), nb::arg("dst_bytes"), nb::arg("dst_offset"),
      nb::arg("stream"));
  m.def("stream_stores", &smddp::StreamStores, nb::arg("bytes"));
  // The host reduction of `n` equal sources packed in `data` (n * count
  // elements of `dtype`): through Reduce() ("auto": the AVX2 copy where the
  // CPU has it), the baseline copy, or the AVX2 copy (None where this build
  // has none). Returns the output's bytes.
  m.def(
      "reduce",
      [](nb::bytes data, int n, int dtype, int op, const std::string& path) -> nb::object {
        const size_t es = smddp::ElementSize(smddp::DType(dtype));
        if (n <= 0 || data.size() % (size_t(n) * es) != 0)
          throw std::invalid_argument("ragged sources");
        const size_t count = data.size() / (size_t(n) * es);
        std::vector<const void*> srcs;
        for (int p = 0; p < n; ++p) srcs.push_back(data.c_str() + size_t(p) * count * es);
        std::vector<char> out(count * es + 1);
        const auto d = smddp::DType(dtype);
        const auto o = smddp::ReduceOp(op);
        if (path == "auto") {
          smddp::Reduce(d, o, srcs.data(), n, out.data(), count);
        } else if (path == "baseline") {
          smddp::ReduceBaseline(d, o, srcs.data(), n, out.data(), count);
        } else if (path == "avx2") {
#if defined(__x86_64__)
          if (!__builtin_cpu_supports("avx2")) return nb::none();
#endif
          if (!smddp::ReduceAvx2(d, o, srcs.data(), n, out.data(), count)) return nb::none();
        } else {
          throw std::invalid_argument("path: auto, baseline or avx2");
        }
        return nb::bytes(out.data(), count * es);
      },
      nb::arg("data"), nb::arg("n"), nb::arg("dtype"), nb::arg("op"), nb::arg("path"));
  m.def("off_cpu_probe", &smddp::OffCpuProbe, nb::arg("cpu"));
  m.def("off_cpu_spawn_probe", &smddp::OffCpuSpawnProbe, nb::arg("cpu"), nb::arg("tasks"),
        nb::call_guard<nb::gil_scoped_release>());
  m.def("timer_probe", &smddp::TimerProbe, nb::arg("delays_ms"), nb::arg("cancel"),
        nb::arg("wait_ms"), nb::call_guard<nb::gil_scoped_release>());
  m.def("rendezvous_probe", &RendezvousProbe, nb::arg("size"), nb::arg("present"),
        nb::arg("timeout_s"), nb::arg("count") = 1024, nb::arg("odd_rank") = -1);
  m.def("stream_probe", &StreamProbe, nb::arg("kind"), nb::arg("dtype"), nb::arg("op"),
        nb::arg("outer"), nb::arg("inner"), nb::arg("count"), nb::arg("slot_bytes"),
        nb::arg("inputs"), nb::arg("out_bytes"), nb::arg("calls") = 1, nb::arg("timeout_s") = 20.0,
        nb::arg("flag_blocks") = false, nb::arg("direct") = 0, nb::arg("vary") = false,
        nb::arg("first_step") = 0, nb::arg("replayable") = 0,
        nb::arg("sources") = std::vector<int64_t>());
  m.def("stream_phase_probe", &StreamPhaseProbe, nb::arg("kind"), nb::arg("dtype"), nb::arg("op"),
        nb::arg("outer"), nb::arg("inner"), nb::arg("count"), nb::arg("slot_bytes"),
        nb::arg("inputs"), nb::arg("out_bytes"), nb::arg("calls") = 1, nb::arg("direct") = 0);
  m.def("stream_watch_probe", &StreamWatchProbe, nb::arg("kind"), nb::arg("dtype"), nb::arg("op"),
        nb::arg("outer"), nb::arg("inner"), nb::arg("count"), nb::arg("slot_bytes"),
        nb::arg("inputs"), nb::arg("out_bytes"), nb::arg("calls"), nb::arg("timeout_s"),
        nb::arg("absent"), nb::arg("absent_pid"), nb::arg("direct") = 0, nb::arg("first_step") = 0,
        nb::arg("replayable") = 0);
  // The watchdog alone, on a real process (and the closed flag of `block`, if given).
  m.def(
      "watch_process",
      [](int pid, double seconds, const smddp::SharedBlock* block) {
        auto group = std::make_shared<smddp::WatchedGroup>("a test group");
        smddp::WatchedPeer peer;
        peer.pid = pid;
        peer.start_time = smddp::ProcessStartTime(pid);
        peer.who = "rank 1 (pid " + std::to_string(pid) + ")";
        if (block) peer.blocks.push_back(block);
        group->AddPeer(std::move(peer));
        smddp::Watch(group);
        {
          nb::gil_scoped_release release;
          const auto end =
              std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
          while (!group->failed() && std::chrono::steady_clock::now() < end)
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        smddp::Unwatch(group.get());
        return group->error().message();
      },
      nb::arg("pid"), nb::arg("seconds"), nb::arg("block").none() = nb::none());
  // The GPU call log over host memory: `records` (rank, kind, dtype, op,
  // outer, inner, count) are logged in order, each as its rank's next call;
  // returns each record's check result ("" when it agreed).
  m.def(
      "call_log_probe",
      [](int size, std::vector<std::tuple<int, int, int, int, size_t, size_t, size_t>> records) {
        HostBlocks rings(size, smddp::CallLog::kBytes);
        std::vector<uint64_t> calls(size, 0);
        std::vector<std::string> out;
        for (const auto& [rank, kind, dtype, op, outer, inner, count] : records) {
          if (rank < 0 || rank >= size || kind < 0 || kind > 3)
            throw std::invalid_argument("bad record");
          const smddp::Status st = smddp::CallLog::RecordAndCheck(
              rings.bases, rank, calls[rank]++, smddp::KindName(kind),
              smddp::PlanOf(kind, dtype, op, outer, inner, count),
              [](int q) { return "rank " + std::to_string(q); });
          out.push_back(st.message());
        }
        return out;
      },
      nb::arg("size"), nb::arg("records"));
  // Shared blocks (the GPU flag blocks' memory), for tests across processes.
  nb::class_<smddp::SharedBlock>(m, "SharedBlock")
      .def_static(
          "create",
          [](size_t bytes, int openers) {
            std::unique_ptr<smddp::SharedBlock> block;
            Check(smddp::SharedBlock::Create(bytes, openers, &block));
            return block;
          },
          nb::arg("bytes"), nb::arg("openers"))
      .def_static(
          "open",
          [](const std::string& name, size_t bytes) {
            std::unique_ptr<smddp::SharedBlock> block;
            Check(smddp::SharedBlock::Open(name, bytes, &block));
            return block;
          },
          nb::arg("name"), nb::arg("bytes"))
      .def_prop_ro("name", &smddp::SharedBlock::name)
      .def_prop_ro("bytes", &smddp::SharedBlock::bytes)
      .def_prop_ro("owner_pid", &smddp::SharedBlock::owner_pid)
      .def("mark_closed", &smddp::SharedBlock::MarkClosed)
      .def("load",
           [](const smddp::SharedBlock& b, size_t i) {
             if ((i + 1) * 4 > b.bytes()) throw std::out_of_range("word index");
             return __atomic_load_n(reinterpret_cast<const uint32_t*>(b.data()) + i,
                                    __ATOMIC_ACQUIRE);
           })
      .def("store", [](smddp::SharedBlock& b, size_t i, uint32_t v) {
        if ((i + 1) * 4 > b.bytes()) throw std::out_of_range("word index");
        __atomic_store_n(reinterpret_cast<uint32_t*>(b.data()) + i, v, __ATOMIC_RELEASE);
      });
  m.def("stream_hierarchical_probe", &StreamHierarchicalProbe, nb::arg("hosts"), nb::arg("local"),
        nb::arg("outer"), nb::arg("inner"), nb::arg("slot_bytes"), nb::arg("rank_of"),
        nb::arg("inputs"), nb::arg("calls") = 1, nb::arg("timeout_s") = 20.0,
        nb::arg("kill_host") = -1, nb::arg("kind") = 0, nb::arg("dtype") = 8, nb::arg("op") = 0,
        nb::arg("rail_provider") = "");
  m.def("fabric_chunk_probe", &FabricChunkProbe, nb::arg("chunks"), nb::arg("capacity"),
        nb::arg("version"), nb::arg("group"));
  m.def("wire_protocol_version", [] { return smddp::kWireProtocolVersion; });
  // The typed reads of the settings registry (common/settings.h) as the engine
  // makes them: `how` is int, seconds, int_if_set (None when it returns
  // false), text or declared (DeclaredDefault).
  m.def(
      "typed_setting",
      [](const std::string& how, const std::string& name) -> nb::object {
        const char* n = name.c_str();
        if (how == "int") return nb::int_(smddp::IntSetting(n));
        if (how == "seconds") return nb::float_(smddp::SecondsSetting(n));
        if (how == "declared") return nb::float_(smddp::DeclaredDefault(n));
        if (how == "text") return nb::str(smddp::TextSetting(n).c_str());
        if (how == "int_if_set") {
          int64_t v = 0;
          return smddp::IntSettingIfSet(n, &v) ? nb::object(nb::int_(v)) : nb::none();
        }
        throw std::invalid_argument("typed_setting: no typed read " + how);
      },
      nb::arg("how"), nb::arg("name"));
  // The engine's computed defaults, each from its one hook.
  m.def("cpu_helpers", &smddp::CpuHelpers);
  m.def("default_cpu_helpers", &smddp::DefaultCpuHelpers, nb::arg("cores"),
        nb::arg("local_processes"));
  m.def("local_processes", &smddp::LocalProcesses);
  m.def("sleep_bound_us", &smddp::SleepBoundUs, nb::arg("floor_us"), nb::arg("waited_us"));
  // Reads the world of the module that built it (_smddp_cpu's world_source()) from now on,
  // as the CUDA module does: what cpu_helpers() and local_processes() see in a job.
  m.def("use_world_of",
        [](uintptr_t source) { smddp::UseWorldOf(reinterpret_cast<smddp::WorldSource>(source)); });
  m.def("cores_available", &smddp::CoresAvailable);
  m.def("timeout_seconds", &smddp::TimeoutSeconds);
  m.def("rail_probe", [](const std::string& provider) {
    // Whether `provider` can carry rail links here ("" when it can, else why not).
    std::unique_ptr<smddp::FabricRail> rail;
    smddp::Status st = smddp::FabricRail::Open(provider, "", smddp::MemoryIface::kHost, &rail);
    return st.ok() ? std::string() : st.message();
  });
}

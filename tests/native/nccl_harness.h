// What the NCCL API front end's native tests share (nccl_front_end_test.cc,
// nccl_permute_test.cc; nccl_windows_test.cc its processes, relay and world):
// built against the mock node's CUDA runtime (tests/native/mock_node), each
// process on a GPU of its own, with served calls on HostStreamOps
// (StartProcess), the real NCCL replaced by a mock that records what is
// forwarded (tests/native/mock_nccl.cc, found through
// JAX_SMDDP_NCCL_LIBRARY). RunMain forks P processes that build a
// world of shared-memory links (as jax_smddp.initialize() does on one host) and
// relays what XLA would put in the key-value store (the unique id) through
// pipes; each process then creates its communicator from the id and runs a
// scenario, checking results against expected values and the mock's record.
// One translation unit per program: everything here is inline.
#ifndef JAX_SMDDP_TESTS_NATIVE_NCCL_HARNESS_H_
#define JAX_SMDDP_TESTS_NATIVE_NCCL_HARNESS_H_

#include <dlfcn.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>  // the mock node (tests/native/mock_node)

#include "cuda/gpu_communicator.h"
#include "cuda/ncclapi/nccl_calls.h"
#include "cuda/ncclapi/nccl_types.h"
#include "tests/native/host_stream_ops.h"
#include "xla_ffi/common/timeout.h"
#include "xla_ffi/transports/world.h"

extern "C" {
ncclResult_t ncclGetUniqueId(ncclUniqueId*);
ncclResult_t ncclCommInitRankConfig(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*);
ncclResult_t ncclCommSplit(ncclComm_t, int, int, ncclComm_t*, ncclConfig_t*);
ncclResult_t ncclCommDestroy(ncclComm_t);
ncclResult_t ncclCommCount(const ncclComm_t, int*);
ncclResult_t ncclCommUserRank(const ncclComm_t, int*);
ncclResult_t ncclCommGetAsyncError(ncclComm_t, ncclResult_t*);
const char* ncclGetLastError(ncclComm_t);
ncclResult_t ncclGroupStart();
ncclResult_t ncclGroupEnd();
ncclResult_t ncclAllGather(const void*, void*, size_t, ncclDataType_t, ncclComm_t, void*);
ncclResult_t ncclReduceScatter(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                               void*);
ncclResult_t ncclAllReduce(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                           void*);
ncclResult_t ncclBroadcast(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t, void*);
ncclResult_t ncclSend(const void*, size_t, ncclDataType_t, int, ncclComm_t, void*);
ncclResult_t ncclRecv(void*, size_t, ncclDataType_t, int, ncclComm_t, void*);
ncclResult_t ncclAlltoAll(const void*, void*, size_t, ncclDataType_t, ncclComm_t, void*);
ncclResult_t ncclCommAbort(ncclComm_t);
}

namespace nccl_test {

using smddp::Status;

inline int failures = 0;
inline int me = -1;

inline void Expect(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "process %d: FAILED: %s\n", me, what.c_str());
    failures++;
  }
}

// --- The mock's record --------------------------------------------------------

inline void* Mock() {
  static void* handle = [] {
    const char* path = std::getenv("JAX_SMDDP_NCCL_LIBRARY");
    return path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : nullptr;  // the front end's handle
  }();
  return handle;
}

inline std::string Record() {
  auto fn = reinterpret_cast<const char* (*)()>(dlsym(Mock(), "mock_nccl_calls"));
  return fn ? fn() : "";
}

inline std::string LastInitId() {
  auto fn = reinterpret_cast<const char* (*)()>(dlsym(Mock(), "mock_nccl_last_init_id"));
  return fn ? fn() : "";
}

inline void Note(const std::string& line) {
  auto fn = reinterpret_cast<void (*)(const char*)>(dlsym(Mock(), "mock_nccl_note"));
  if (fn) fn(line.c_str());
}

inline std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < text.size()) {
    const size_t nl = text.find('\n', at);
    out.push_back(text.substr(at, nl - at));
    at = nl == std::string::npos ? text.size() : nl + 1;
  }
  return out;
}

inline bool Has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Served calls mark the record, so the tests see their order among forwarded ones.
// Their waits outlast the deadline, as a GPU stream's do: what ends a wait on
// a dead or stalled peer is the watchdog's release, as on a GPU.
inline int slow_copy_us = 0;  // a slow reader: each copy waits this long first
class MarkedOps : public smddp::HostStreamOps {
 public:
  MarkedOps() : HostStreamOps(3 * smddp::TimeoutSeconds()) { Note("SERVED"); }
  Status Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                size_t rows) override {
    if (slow_copy_us) usleep(slow_copy_us);
    return HostStreamOps::Copy2D(dst, dpitch, src, spitch, width, rows);
  }
};

// A CUDA graph's capture, as the stream operations see it: while `capturing`,
// served calls only record what they enqueue (arguments fixed, as a graph's
// nodes); Replay runs the record on host threads, as launching the graph runs
// it on the GPU.
inline bool capturing = false;
inline std::vector<std::function<Status(smddp::StreamOps&)>> graph;
class RecordingOps : public smddp::StreamOps {
 public:
  Status Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                size_t rows) override {
    graph.push_back(
        [=](smddp::StreamOps& o) { return o.Copy2D(dst, dpitch, src, spitch, width, rows); });
    return Status::Ok();
  }
  Status Reduce(void* dst, size_t dpitch, const void* const* srcs, int n, size_t spitch,
                size_t count, size_t rows, smddp::DType dtype, smddp::ReduceOp op) override {
    std::vector<const void*> s(srcs, srcs + n);  // a kernel's arguments, by value
    graph.push_back([=](smddp::StreamOps& o) {
      return o.Reduce(dst, dpitch, s.data(), n, spitch, count, rows, dtype, op);
    });
    return Status::Ok();
  }
  Status Zero(void* dst, size_t bytes) override {
    graph.push_back([=](smddp::StreamOps& o) { return o.Zero(dst, bytes); });
    return Status::Ok();
  }
  Status WaitAtLeast(const uint32_t* flag, uint32_t value) override {
    graph.push_back([=](smddp::StreamOps& o) { return o.WaitAtLeast(flag, value); });
    return Status::Ok();
  }
  Status Write(uint32_t* flag, uint32_t value) override {
    graph.push_back([=](smddp::StreamOps& o) { return o.Write(flag, value); });
    return Status::Ok();
  }
};
inline Status Replay() {
  MarkedOps ops;
  for (auto& node : graph) SMDDP_RETURN_IF_ERROR(node(ops));
  return Status::Ok();
}

// --- Processes, relay, world ----------------------------------------------------

inline bool WriteAll(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n) {
    const ssize_t w = write(fd, c, n);
    if (w <= 0) return false;
    c += w;
    n -= size_t(w);
  }
  return true;
}
inline bool ReadAll(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n) {
    const ssize_t r = read(fd, c, n);
    if (r <= 0) return false;
    c += r;
    n -= size_t(r);
  }
  return true;
}
inline bool WriteBytes(int fd, const std::string& s) {
  const uint64_t n = s.size();
  return WriteAll(fd, &n, 8) && WriteAll(fd, s.data(), n);
}
inline bool ReadBytes(int fd, std::string* s) {
  uint64_t n;
  if (!ReadAll(fd, &n, 8) || n > (1u << 20)) return false;
  s->resize(n);
  return ReadAll(fd, s->data(), n);
}

inline int up_fd = -1, down_fd = -1, P = 0;

// What every process said (through the parent, as a key-value store would).
inline std::vector<std::string> Relay(const std::string& mine) {
  std::vector<std::string> all(P);
  if (!WriteBytes(up_fd, mine)) return all;
  for (auto& s : all) ReadBytes(down_fd, &s);
  return all;
}

inline void Check(const Status& st, const std::string& what) {
  Expect(st.ok(), what + ": " + st.message());
}

inline int hosts = 1;  // process p is on "host<p % hosts>"
inline std::string HostOf(int p) { return "host" + std::to_string(p % hosts); }

// The world of jax_smddp.initialize(): shared-memory links to the processes
// of this "host", libfabric (its shm provider) and a TCP watch to the others.
inline void BuildWorld() {
  Check(smddp::WorldBegin(me, P), "WorldBegin");
  const auto pids = Relay(std::to_string(getpid()));
  for (int q = 0; q < P; ++q)
    Check(smddp::WorldSetPeer(q, std::stoi(pids[q]), HostOf(q)), "WorldSetPeer");
  if (hosts > 1) {
    std::string address, provider, watch;
    Check(smddp::WorldOpenFabric("shm", "", &address, &provider), "WorldOpenFabric");
    Check(smddp::WorldWatchListen("127.0.0.1", &watch), "WorldWatchListen");
    const auto addresses = Relay(address);
    const auto watches = Relay(watch);
    std::vector<int> higher;
    for (int q = 0; q < P; ++q) {
      if (q == me || HostOf(q) == HostOf(me)) continue;
      Check(smddp::WorldConnectFabric(q, addresses[q]), "WorldConnectFabric");
      if (q < me) Check(smddp::WorldWatchConnect(q, watches[q]), "WorldWatchConnect");
      if (q > me) higher.push_back(q);
    }
    Check(smddp::WorldWatchAccept(higher), "WorldWatchAccept");
  }
  std::vector<std::string> names(P);
  std::string mine;
  for (int q = me + 1; q < P; ++q) {
    if (HostOf(q) != HostOf(me)) continue;
    std::string name;
    Check(smddp::WorldCreateShm(q, &name), "WorldCreateShm");
    mine += std::to_string(q) + "=" + name + ";";
  }
  const auto created = Relay(mine);
  for (int q = 0; q < me; ++q) {
    if (HostOf(q) != HostOf(me)) continue;
    const std::string& list = created[q];
    const std::string key = std::to_string(me) + "=";
    const size_t at = list.find(key);
    const size_t end = list.find(';', at);
    Check(smddp::WorldOpenShm(q, list.substr(at + key.size(), end - at - key.size())),
          "WorldOpenShm");
  }
  Relay("mapped");
  for (int q = me + 1; q < P; ++q)
    if (HostOf(q) == HostOf(me)) Check(smddp::WorldUnlinkShm(q), "WorldUnlinkShm");
  Check(smddp::WorldStart(), "WorldStart");
}

inline ncclConfig_t* Config(unsigned version, int blocking) {
  // As NCCL_CONFIG_INITIALIZER lays it out: the head, then fields the front
  // end passes on untouched.
  static unsigned char storage[256];
  std::memset(storage, 0x5a, sizeof(storage));
  auto* c = reinterpret_cast<ncclConfig_t*>(storage);
  c->size = 120;
  c->magic = smddp::nccl::kConfigMagic;
  c->version = version;
  c->blocking = blocking;
  return c;
}

// The communicator of `nranks` ranks (this process's rank `rank`), its id
// made by process 0 and relayed, as XLA's key-value store would.
inline ncclComm_t Create(int nranks, int rank, ncclConfig_t* config, ncclResult_t* rc = nullptr) {
  std::string id_bytes;
  if (me == 0) {
    ncclUniqueId id;
    Expect(ncclGetUniqueId(&id) == ncclSuccess, "ncclGetUniqueId");
    id_bytes.assign(id.internal, sizeof(id.internal));
  }
  const auto all = Relay(id_bytes);
  ncclUniqueId id;
  std::memcpy(id.internal, all[0].data(), sizeof(id.internal));
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&comm, nranks, id, rank, config);
  if (rc)
    *rc = r;
  else
    Expect(r == ncclSuccess, std::string("ncclCommInitRankConfig: ") + ncclGetLastError(nullptr));
  return comm;
}

inline float Value(int rank, size_t i) { return float(rank * 1000 + int(i % 997)) * 0.5f; }

// An all_gather of `count` floats per rank from `send` into `recv` (nranks * count).
inline void CheckAllGatherIn(ncclComm_t comm, int nranks, int rank, float* send, float* recv,
                             size_t count, const std::string& what) {
  for (size_t i = 0; i < count; ++i) send[i] = Value(rank, i);
  Expect(ncclAllGather(send, recv, count, ncclFloat32, comm, nullptr) == ncclSuccess,
         what + ": " + ncclGetLastError(comm));
  bool ok = true;
  for (int r = 0; r < nranks; ++r)
    for (size_t i = 0; i < count; ++i) ok = ok && recv[r * count + i] == Value(r, i);
  Expect(ok, what + ": wrong values");
}

inline void CheckAllGather(ncclComm_t comm, int nranks, int rank, size_t count,
                           const std::string& what) {
  std::vector<float> send(count), recv(count * nranks, -1.f);
  CheckAllGatherIn(comm, nranks, rank, send.data(), recv.data(), count, what);
}

// Polls ncclCommGetAsyncError, as XLA does, until it reports an error or
// `limit_s` passed since `start`; the error, and in *seconds when it came.
inline ncclResult_t AwaitAsyncError(ncclComm_t comm, std::chrono::steady_clock::time_point start,
                                    double limit_s, double* seconds) {
  ncclResult_t async = ncclSuccess;
  *seconds = 0;
  while (async == ncclSuccess && *seconds < limit_s) {
    Expect(ncclCommGetAsyncError(comm, &async) == ncclSuccess, "ncclCommGetAsyncError");
    usleep(20000);
    *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  return async;
}

// In each process: served calls on HostStreamOps (MarkedOps, or RecordingOps
// while `capturing`), the deadline `timeout_s`, and the world built.
inline void StartProcess(double timeout_s) {
  // A GPU of its own: its host's next (processes alternate between hosts).
  setenv("JAX_SMDDP_MOCK_DEVICES", std::to_string(me / hosts).c_str(), 1);
  smddp::SetTimeoutSeconds(timeout_s);
  smddp::nccl::SetStreamBackend({[](void*, smddp::nccl::StreamBackend::Body body, void* context) {
                                   if (capturing) {
                                     RecordingOps ops;
                                     return body(ops, context);
                                   }
                                   MarkedOps ops;
                                   return body(ops, context);
                                 },
                                 [](void*) { return capturing; }});
  BuildWorld();
}

// A process's end after its scenario: its exit status.
inline int EndProcess() {
  // As jax_smddp's exit hook does: no process leaves before the others are
  // done, and each tells its peers it ended in order (not a death).
  Relay("end");
  // As libsmddp_nccl.so's exit hook (smddp_nccl_close_at_exit), then
  // jax_smddp's shutdown: the world's libfabric endpoint closes, unlinking
  // its shm region, though communicators are left undestroyed (as XLA may).
  Expect(smddp::gpu::CloseCommunicatorsAtExit(), "the network proxy idle at exit");
  smddp::WorldShutdown();
  return failures ? 1 : 0;
}

// Forks `processes` processes that each run `run(scenario)` (its exit
// status), relays their messages, and checks they all ended well (process
// `killed` by SIGKILL, if it is not -1). Prints "all checks passed" on success.
inline int RunMain(const std::string& scenario, int processes, int killed,
                   int (*run)(const std::string&)) {
  P = processes;
  if (!std::getenv("JAX_SMDDP_NCCL_LIBRARY")) {
    std::fprintf(stderr, "set JAX_SMDDP_NCCL_LIBRARY to the mock libnccl.so.2\n");
    return 2;
  }
  std::vector<pid_t> pids;
  std::vector<int> ups, downs;
  for (int p = 0; p < P; ++p) {
    int up[2], down[2];
    if (pipe(up) != 0 || pipe(down) != 0) return 2;
    const pid_t pid = fork();
    if (pid == 0) {
      close(up[0]);
      close(down[1]);
      me = p;
      up_fd = up[1];
      down_fd = down[0];
      const int rc = run(scenario);
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(rc);
    }
    close(up[1]);
    close(down[0]);
    pids.push_back(pid);
    ups.push_back(up[0]);
    downs.push_back(down[1]);
  }
  alarm(60);
  // The relay: one message from every live process, then all of them to each.
  std::vector<bool> live(P, true);
  while (true) {
    std::vector<std::string> round(P);
    int got = 0;
    for (int p = 0; p < P; ++p) {
      if (!live[p]) continue;
      if (ReadBytes(ups[p], &round[p]))
        got++;
      else
        live[p] = false;
    }
    if (got == 0) break;
    for (int p = 0; p < P; ++p) {
      if (!live[p]) continue;
      for (const std::string& s : round) WriteBytes(downs[p], s);
    }
  }
  bool ok = true;
  for (int p = 0; p < P; ++p) {
    int status = 0;
    waitpid(pids[p], &status, 0);
    const bool fine = p == killed ? (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
                                  : (WIFEXITED(status) && WEXITSTATUS(status) == 0);
    if (!fine) {
      std::fprintf(stderr, "process %d ended badly (status %d)\n", p, status);
      ok = false;
    }
  }
  // The mock node's device memory the processes left: communicators are
  // left undestroyed, as XLA leaves them.
  for (pid_t pid : pids) mock_node::RemoveMemoryOf(pid);
  if (ok) std::printf("all checks passed\n");
  return ok ? 0 : 1;
}

}  // namespace nccl_test

#endif  // JAX_SMDDP_TESTS_NATIVE_NCCL_HARNESS_H_

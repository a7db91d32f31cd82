// A stand-in for the real NCCL behind the NCCL API front end
// (cuda/ncclapi), for tests on CPU: it runs nothing, it records every call
// it gets (mock_nccl_calls() returns them, one per line), and checks that
// every communicator it is handed is one it made (a front-end handle leaking
// through is recorded as "FOREIGN"). Built as libnccl.so.2 in its own
// folder; the front end opens it by path (JAX_SMDDP_NCCL_LIBRARY).
//   MOCK_NCCL_VERSION: what ncclGetVersion says (default 22809)
//   MOCK_NCCL_ID_FULL=1: ids use all 128 bytes (they do not fit the front end's)
// mock_nccl_last_init_id() names the id the last ncclCommInitRankConfig got.
//   MOCK_NCCL_FAIL_BROADCAST=1: ncclBroadcast fails (invalid usage), with a message
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "cuda/ncclapi/nccl_types.h"

#define EXPORT extern "C" __attribute__((visibility("default")))

namespace {

struct MockComm {
  unsigned magic = 0x6d6f636b;
  int nranks = 0;
  int rank = 0;
};

std::mutex mu;
std::string calls;
std::string last_init_id;  // bytes 40..47 of the id ncclCommInitRankConfig last got, in hex

void Record(const std::string& line) {
  std::lock_guard<std::mutex> lock(mu);
  calls += line + "\n";
}

std::string Who(ncclComm_t comm) {
  auto* c = reinterpret_cast<MockComm*>(comm);
  if (!c) return "comm=null";
  if (c->magic != 0x6d6f636b) return "comm=FOREIGN";
  return "rank=" + std::to_string(c->rank) + "/" + std::to_string(c->nranks);
}

}  // namespace

EXPORT const char* mock_nccl_calls() {
  static std::string copy;
  std::lock_guard<std::mutex> lock(mu);
  copy = calls;
  return copy.c_str();
}

// Which id the last communicator was made from: ids of different
// ncclGetUniqueId calls differ there (the process and a count).
EXPORT const char* mock_nccl_last_init_id() {
  static std::string copy;
  std::lock_guard<std::mutex> lock(mu);
  copy = last_init_id;
  return copy.c_str();
}

EXPORT ncclResult_t ncclGetVersion(int* version) {
  const char* v = std::getenv("MOCK_NCCL_VERSION");
  *version = v ? std::atoi(v) : 22809;
  return ncclSuccess;
}

EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  const char* full = std::getenv("MOCK_NCCL_ID_FULL");
  const size_t used = full && full[0] == '1' ? NCCL_UNIQUE_ID_BYTES : 40;
  char bytes[NCCL_UNIQUE_ID_BYTES] = {};
  for (size_t i = 0; i < used && i < sizeof(bytes); ++i) bytes[i] = char('A' + i % 26);
  static unsigned made = 0;
  const unsigned who[2] = {unsigned(getpid()), ++made};
  std::memcpy(bytes + 40, who, sizeof(who));  // within the 88 bytes the front end keeps
  std::memcpy(id->internal, bytes, sizeof(bytes));
  Record("ncclGetUniqueId");
  return ncclSuccess;
}

EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                           ncclConfig_t* config) {
  const bool real_id = id.internal[0] == 'A' && id.internal[39] == char('A' + 39 % 26);
  auto* c = new MockComm;
  c->nranks = nranks;
  c->rank = rank;
  *comm = reinterpret_cast<ncclComm_t>(c);
  {
    std::lock_guard<std::mutex> lock(mu);
    last_init_id.clear();
    for (int i = 40; i < 48; ++i) {
      char hex[3];
      std::snprintf(hex, sizeof(hex), "%02x", unsigned(uint8_t(id.internal[i])));
      last_init_id += hex;
    }
  }
  Record("ncclCommInitRankConfig nranks=" + std::to_string(nranks) +
         " rank=" + std::to_string(rank) + " id=" + (real_id ? "real" : "OTHER") +
         " blocking=" + (config ? std::to_string(config->blocking) : std::string("none")));
  return ncclSuccess;
}

EXPORT ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* out,
                                  ncclConfig_t*) {
  Record("ncclCommSplit " + Who(comm) + " color=" + std::to_string(color) +
         " key=" + std::to_string(key));
  auto* c = new MockComm;
  c->nranks = -1;
  c->rank = key;
  *out = color < 0 ? nullptr : reinterpret_cast<ncclComm_t>(c);
  return ncclSuccess;
}

EXPORT ncclResult_t ncclGroupStart() {
  Record("ncclGroupStart");
  return ncclSuccess;
}
EXPORT ncclResult_t ncclGroupEnd() {
  Record("ncclGroupEnd");
  return ncclSuccess;
}

EXPORT ncclResult_t ncclAllGather(const void*, void*, size_t count, ncclDataType_t type,
                                  ncclComm_t comm, void*) {
  Record("ncclAllGather " + Who(comm) + " count=" + std::to_string(count) +
         " type=" + std::to_string(int(type)));
  return ncclSuccess;
}
EXPORT ncclResult_t ncclReduceScatter(const void*, void*, size_t count, ncclDataType_t type,
                                      ncclRedOp_t op, ncclComm_t comm, void*) {
  Record("ncclReduceScatter " + Who(comm) + " count=" + std::to_string(count) +
         " type=" + std::to_string(int(type)) + " op=" + std::to_string(int(op)));
  return ncclSuccess;
}
EXPORT ncclResult_t ncclAllReduce(const void*, void*, size_t count, ncclDataType_t type,
                                  ncclRedOp_t op, ncclComm_t comm, void*) {
  Record("ncclAllReduce " + Who(comm) + " count=" + std::to_string(count) +
         " type=" + std::to_string(int(type)) + " op=" + std::to_string(int(op)));
  return ncclSuccess;
}
EXPORT ncclResult_t ncclBroadcast(const void*, void*, size_t count, ncclDataType_t, int root,
                                  ncclComm_t comm, void*) {
  Record("ncclBroadcast " + Who(comm) + " count=" + std::to_string(count) +
         " root=" + std::to_string(root));
  const char* fail = std::getenv("MOCK_NCCL_FAIL_BROADCAST");
  return fail && fail[0] == '1' ? ncclInvalidUsage : ncclSuccess;
}
EXPORT ncclResult_t ncclSend(const void*, size_t count, ncclDataType_t, int peer, ncclComm_t comm,
                             void*) {
  Record("ncclSend " + Who(comm) + " count=" + std::to_string(count) +
         " peer=" + std::to_string(peer));
  return ncclSuccess;
}
EXPORT ncclResult_t ncclRecv(void*, size_t count, ncclDataType_t, int peer, ncclComm_t comm,
                             void*) {
  Record("ncclRecv " + Who(comm) + " count=" + std::to_string(count) +
         " peer=" + std::to_string(peer));
  return ncclSuccess;
}
EXPORT ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* error) {
  Record("ncclCommGetAsyncError " + Who(comm));
  *error = ncclSuccess;
  return ncclSuccess;
}
EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  Record("ncclCommDestroy " + Who(comm));
  return ncclSuccess;
}
EXPORT ncclResult_t ncclCommAbort(ncclComm_t comm) {
  Record("ncclCommAbort " + Who(comm));
  return ncclSuccess;
}
EXPORT ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  Record("ncclCommFinalize " + Who(comm));
  return ncclSuccess;
}
EXPORT ncclResult_t ncclCommRegister(const ncclComm_t comm, void*, size_t size, void** handle) {
  Record("ncclCommRegister " + Who(comm) + " size=" + std::to_string(size));
  *handle = reinterpret_cast<void*>(0x1234);
  return ncclSuccess;
}
EXPORT const char* ncclGetErrorString(ncclResult_t result) {
  static thread_local char text[64];
  std::snprintf(text, sizeof(text), "mock nccl error %d", int(result));
  return text;
}
EXPORT const char* ncclGetLastError(ncclComm_t) {
  const char* fail = std::getenv("MOCK_NCCL_FAIL_BROADCAST");
  return fail && fail[0] == '1' ? "mock nccl: Duplicate GPU detected" : "mock nccl: no error";
}
EXPORT ncclResult_t ncclMemAlloc(void** ptr, size_t size) {
  Record("ncclMemAlloc size=" + std::to_string(size));
  *ptr = std::malloc(size);
  return *ptr ? ncclSuccess : ncclSystemError;
}
EXPORT ncclResult_t ncclMemFree(void* ptr) {
  Record("ncclMemFree");
  std::free(ptr);
  return ncclSuccess;
}

// The test's own marks between the front end's calls (served calls, barriers).
EXPORT void mock_nccl_note(const char* line) { Record(line); }

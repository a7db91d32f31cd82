// XLA's collective-permute through the NCCL API front end, on the mock
// (nccl_harness.h): a group of one ncclSend (to the rank's target) and one
// ncclRecv (from its source), either of them absent, is served by jax_smddp's
// collective_permute between the pairs only (RunStreamPairPermute), counted
// as jax_smddp's, and never reaches the real NCCL.
//
//   nccl_permute_test SCENARIO
//
// ring: P=3, a ring (every rank sends and receives) in f32, bf16 and int32,
//   small and over many slot-sized tiles (4 KiB slots), between served
//   all_gathers, a swap onto itself (a rank its own source), a combined
//   permute (two operands, one group); a group being captured into a CUDA
//   graph is forwarded.
// partial: P=4, (0 -> 3), (3 -> 1): rank 0 only sends, rank 1 only receives,
//   rank 3 both, rank 2 makes no call (an empty group, as XLA issues it);
//   its output is left alone where nothing comes (XLA zero-fills it); then
//   all_gathers of the whole group run right.
// Prints "all checks passed" and exits 0 on success.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tests/native/nccl_harness.h"

namespace {

using namespace nccl_test;  // NOLINT: the harness is this test's vocabulary

// Rank `rank`'s i-th element, exact in every type below (|v| < 256).
int Element(int rank, size_t i) { return int((i * 7 + size_t(rank) * 31) % 251) - 125; }

// bf16 of a small integer: its float's upper half (exact).
uint16_t Bf16(int v) {
  const float f = float(v);
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return uint16_t(bits >> 16);
}

// One rank's part of a permutation of `count` elements of `type` (4-byte f32
// or int32, 2-byte bf16): sends to `target`, receives from `source` (-1:
// none), then checks the output (left at `fill` where nothing comes).
void Permute(ncclComm_t comm, ncclDataType_t type, size_t count, int target, int source,
             const std::string& what) {
  const size_t esize = type == ncclBfloat16 ? 2 : 4;
  std::vector<uint8_t> send(count * esize), recv(count * esize, 0xEE);
  auto put = [&](std::vector<uint8_t>& buffer, size_t i, int v) {
    if (type == ncclBfloat16) {
      const uint16_t b = Bf16(v);
      std::memcpy(&buffer[i * 2], &b, 2);
    } else if (type == ncclFloat32) {
      const float f = float(v);
      std::memcpy(&buffer[i * 4], &f, 4);
    } else {
      const int32_t n = v;
      std::memcpy(&buffer[i * 4], &n, 4);
    }
  };
  for (size_t i = 0; i < count; ++i) put(send, i, Element(me, i));
  Expect(ncclGroupStart() == ncclSuccess, what + ": group start");
  if (source >= 0)
    Expect(ncclRecv(recv.data(), count, type, source, comm, nullptr) == ncclSuccess,
           what + ": recv");
  if (target >= 0)
    Expect(ncclSend(send.data(), count, type, target, comm, nullptr) == ncclSuccess,
           what + ": send");
  Expect(ncclGroupEnd() == ncclSuccess, what + ": group end: " + ncclGetLastError(comm));
  std::vector<uint8_t> want(count * esize, 0xEE);
  if (source >= 0)
    for (size_t i = 0; i < count; ++i) put(want, i, Element(source, i));
  Expect(recv == want, what + ": wrong values");
}

void Ring() {
  ncclComm_t comm = Create(P, me, Config(22809, 0));
  const int target = (me + 1) % P, source = (me + P - 1) % P;
  CheckAllGather(comm, P, me, 300, "all_gather before");
  int permutes = 0;
  for (ncclDataType_t type : {ncclFloat32, ncclBfloat16, ncclInt32}) {
    for (size_t count : {size_t(1), size_t(1000), size_t(10000)}) {  // 10000: 10 tiles
      Permute(comm, type, count, target, source,
              "ring of " + std::to_string(count) + " type " + std::to_string(int(type)));
      permutes++;
    }
    CheckAllGather(comm, P, me, 3000, "all_gather between rings");  // its steps use the slots
  }
  Permute(comm, ncclFloat32, 5000, me, me, "onto itself");
  permutes++;
  Permute(comm, ncclInt32, 2000, (me + 2) % P, (me + 1) % P, "the other way round");
  permutes++;
  {  // A combined permute (two operands in one group): the i-th send is the i-th receive's.
    std::vector<float> a(6000), ra(6000, -1.f);
    std::vector<int32_t> b(300), rb(300, -1);
    for (size_t i = 0; i < a.size(); ++i) a[i] = float(Element(me, i));
    for (size_t i = 0; i < b.size(); ++i) b[i] = -Element(me, i);
    Expect(ncclGroupStart() == ncclSuccess, "group start");
    Expect(ncclSend(a.data(), a.size(), ncclFloat32, target, comm, nullptr) == ncclSuccess &&
               ncclRecv(ra.data(), ra.size(), ncclFloat32, source, comm, nullptr) == ncclSuccess &&
               ncclRecv(rb.data(), rb.size(), ncclInt32, source, comm, nullptr) == ncclSuccess &&
               ncclSend(b.data(), b.size(), ncclInt32, target, comm, nullptr) == ncclSuccess,
           "combined: issued");
    Expect(ncclGroupEnd() == ncclSuccess, std::string("combined: ") + ncclGetLastError(comm));
    bool ok = true;
    for (size_t i = 0; i < a.size(); ++i) ok = ok && ra[i] == float(Element(source, i));
    for (size_t i = 0; i < b.size(); ++i) ok = ok && rb[i] == -Element(source, i);
    Expect(ok, "combined: wrong values");
    permutes++;
  }
  const std::string record = Record();
  Expect(!Has(record, "ncclSend") && !Has(record, "ncclRecv") &&
             !Has(record, "ncclCommInitRankConfig"),
         "nothing forwarded; the mock saw:\n" + record);
  const std::string described = smddp::nccl::Describe();
  Expect(Has(described, "\"ncclSend/ncclRecv\": " + std::to_string(permutes)),
         "counted as jax_smddp's: " + described);
  auto world = smddp::CurrentWorld();
  Expect(world && world->calls(smddp::World::Caller::kNcclPermute) == uint64_t(permutes),
         "the world counts them (traffic_by_op)");
  // Being captured into a CUDA graph: forwarded (pairs' counters cannot be replayed).
  capturing = true;
  std::vector<float> x(16, 1.f), y(16);
  Expect(ncclGroupStart() == ncclSuccess &&
             ncclSend(x.data(), 16, ncclFloat32, target, comm, nullptr) == ncclSuccess &&
             ncclRecv(y.data(), 16, ncclFloat32, source, comm, nullptr) == ncclSuccess &&
             ncclGroupEnd() == ncclSuccess,
         "captured group");
  capturing = false;
  Expect(Has(Record(), "ncclSend rank=" + std::to_string(me)), "captured: forwarded: " + Record());
}

void Partial() {
  ncclComm_t comm = Create(P, me, Config(22809, 0));
  CheckAllGather(comm, P, me, 100, "all_gather before");
  const int targets[4] = {3, -1, -1, 1}, sources[4] = {-1, 3, -1, 0};
  for (int round = 0; round < 3; ++round) {
    for (size_t count : {size_t(7), size_t(6000)}) {
      const std::string what =
          "partial, round " + std::to_string(round) + ", " + std::to_string(count);
      if (me == 2) {  // no source, no target: XLA issues an empty group
        Expect(ncclGroupStart() == ncclSuccess && ncclGroupEnd() == ncclSuccess, what);
        continue;
      }
      Permute(comm, round == 1 ? ncclBfloat16 : ncclFloat32, count, targets[me], sources[me], what);
    }
    CheckAllGather(comm, P, me, 2000, "all_gather after round " + std::to_string(round));
  }
  Expect(!Has(Record(), "ncclSend") && !Has(Record(), "ncclRecv"),
         "nothing forwarded: " + Record());
  Expect(
      Has(smddp::nccl::Describe(), me == 2 ? "\"ncclAllGather\": 4" : "\"ncclSend/ncclRecv\": 6"),
      "counted: " + smddp::nccl::Describe());
}

int RunProcess(const std::string& scenario) {
  StartProcess(10.0);
  if (scenario == "ring")
    Ring();
  else if (scenario == "partial")
    Partial();
  else {
    std::fprintf(stderr, "unknown scenario %s\n", scenario.c_str());
    return 2;
  }
  return EndProcess();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: nccl_permute_test SCENARIO\n");
    return 2;
  }
  const std::string scenario = argv[1];
  setenv("JAX_SMDDP_GPU_SLOT_BYTES", "4096", 1);  // many tiles per call
  return nccl_test::RunMain(scenario, scenario == "partial" ? 4 : 3, -1, RunProcess);
}

// The shared-memory ring's defences (xla_ffi/transports/shm_ring.cc,
// shm_segment.cc), in one process: a reader that finds nonsense in the ring
// (a garbage chunk header, a write position far past the ring, a read
// position the writer cannot believe) fails the link naming the corruption,
// and segments that are not jax_smddp's are refused. Exit code 0 on success.
#include "tests/native/shm_harness.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

using namespace shm_test;  // NOLINT: the harness is this test's vocabulary

namespace {

// Single-process checks that the reader survives nonsense in the ring. The
// raw offsets are those of the layout in shm_link_impl.h: ring 0's head counter
// at 192, tail at 320, ring 0's data at 4096.
void TestCorruption() {
  constexpr size_t kHead0 = 192, kTail0 = 320, kData = 4096;
  for (int kind = 0; kind < 3; ++kind) {
    std::string name;
    std::shared_ptr<ShmSegment> seg_a, seg_b;
    CHECK_OK(smddp::CreateShmSegment(16 << 10, &name, &seg_a));
    CHECK_OK(smddp::OpenShmSegment(name, &seg_b));
    int fd = ::shm_open(name.c_str(), O_RDWR, 0);
    CHECK(fd >= 0);
    struct stat st;
    CHECK(::fstat(fd, &st) == 0);
    auto* raw = static_cast<uint8_t*>(
        ::mmap(nullptr, size_t(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    ::close(fd);
    CHECK(raw != MAP_FAILED);
    CHECK_OK(smddp::UnlinkShmSegment(name));
    auto a = smddp::MakeShmLink(seg_a, true, ::getpid());
    auto b = smddp::MakeShmLink(seg_b, false, ::getpid());
    // A message goes through first.
    Msg m(1, 100), r(1, 100);
    b->Recv(1, r.buf.data(), 100, &r.req);
    PostSend(a.get(), &m, 0);
    Wait(b.get(), {&r.req}, "corruption: sane message");
    CheckRecv(&r, 0, "corruption: sane message");
    auto* head0 = reinterpret_cast<std::atomic<uint64_t>*>(raw + kHead0);
    auto* tail0 = reinterpret_cast<std::atomic<uint64_t>*>(raw + kTail0);
    Msg victim(2, 64);
    b->Recv(2, victim.buf.data(), 64, &victim.req);
    Link* failing = b.get();
    if (kind == 0) {  // garbage chunk header
      uint64_t h = head0->load();
      std::memset(raw + kData + h % (16 << 10), 0xab, 64);
      head0->store(h + 64);
    } else if (kind == 1) {  // write position far past the ring
      head0->store(head0->load() + (uint64_t(1) << 30));
    } else {  // the reader's position, as the writer sees it, is nonsense
      tail0->store(12345);
      failing = a.get();
      Msg s(3, 10);
      PostSend(a.get(), &s, 0);
      CHECK(s.req.done() && !s.req.status().ok());
    }
    failing->Progress();
    std::string why = failing->PeerFailure();
    CHECK_MSG(Contains(why, "corrupt"),
              "corruption kind " + std::to_string(kind) + ": '" + why + "'");
    if (failing == b.get()) {
      CHECK(victim.req.done() && !victim.req.status().ok());
    } else {
      b->Cancel(&victim.req);
    }
    Msg after(4, 8);
    failing->Recv(4, after.buf.data(), 8, &after.req);
    CHECK(after.req.done() && !after.req.status().ok());
    ::munmap(raw, size_t(st.st_size));
  }
  // Segment-level checks.
  std::shared_ptr<ShmSegment> seg;
  CHECK(!smddp::OpenShmSegment("/jax_smddp-0123456789abcdef0123456789abcdef", &seg).ok());
  CHECK(!smddp::OpenShmSegment("/etc/passwd", &seg).ok());
  std::printf("corruption checks passed\n");
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  TestCorruption();
  std::printf("shm_corruption_test: all checks passed\n");
  return 0;
}

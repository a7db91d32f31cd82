// A stand-in for GDRCopy's libgdrapi, built by CMake (target mock_gdrapi) as
// libgdrapi.so.2 for tests/native/test_gpu_communicator_mock.py and found
// through LD_LIBRARY_PATH, so that cuda/gdrcopy.cc and the network signals
// it maps run where there is no GPU. The mock CUDA runtime's "device memory"
// is a shared-memory file mapped into the process;
// like the real driver's BAR mapping, gdr_map maps the pinned pages a second
// time, at another address, so a store through the mapping reaches the
// "device" only if the offsets are right. Never part of the library.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

namespace {

constexpr uint64_t kGpuPage = 64 << 10;

struct Pin {
  unsigned long addr;
  size_t size;
  std::string path;  // the file backing the pinned range
  off_t offset;      // of addr in that file
};

std::mutex mu;
std::map<uint64_t, Pin> pins;
uint64_t next_handle = 1;
int session;  // what gdr_open returns the address of

// The file and offset backing `addr`, from /proc/self/maps.
bool Backing(unsigned long addr, std::string* path, off_t* offset) {
  FILE* maps = std::fopen("/proc/self/maps", "r");
  if (!maps) return false;
  char line[512];
  bool found = false;
  while (!found && std::fgets(line, sizeof(line), maps)) {
    unsigned long start, end, file_offset;
    char file[256] = "";
    if (std::sscanf(line, "%lx-%lx %*s %lx %*s %*s %255s", &start, &end, &file_offset, file) < 3)
      continue;
    if (addr < start || addr >= end || std::strncmp(file, "/dev/shm/", 9) != 0) continue;
    *path = file;
    *offset = off_t(file_offset + (addr - start));
    found = true;
  }
  std::fclose(maps);
  return found;
}

}  // namespace

extern "C" {

void* gdr_open() {
  const char* fail = std::getenv("JAX_SMDDP_MOCK_GDR_OPEN_FAILS");
  return fail && fail[0] == '1' ? nullptr : &session;
}

int gdr_pin_buffer(void* g, unsigned long addr, size_t size, uint64_t, uint32_t, uint64_t* handle) {
  if (g != &session || addr % kGpuPage != 0 || size % kGpuPage != 0) return 22;  // EINVAL
  Pin pin{addr, size, "", 0};
  if (!Backing(addr, &pin.path, &pin.offset)) return 22;  // not (mock) device memory
  std::lock_guard<std::mutex> lock(mu);
  *handle = next_handle++;
  pins[*handle] = pin;
  return 0;
}

int gdr_unpin_buffer(void*, uint64_t handle) {
  std::lock_guard<std::mutex> lock(mu);
  return pins.erase(handle) ? 0 : 22;
}

int gdr_map(void*, uint64_t handle, void** va, size_t size) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = pins.find(handle);
  if (it == pins.end() || size > it->second.size) return 22;
  const int fd = open(it->second.path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return 2;
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, it->second.offset);
  close(fd);
  if (p == MAP_FAILED) return 12;
  *va = p;
  return 0;
}

int gdr_unmap(void*, uint64_t, void* va, size_t size) { return munmap(va, size); }

// gdr_info_v2: the pinned range's device address first, then the rest.
int gdr_get_info_v2(void*, uint64_t handle, void* info) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = pins.find(handle);
  if (it == pins.end()) return 22;
  const uint64_t fields[2] = {it->second.addr, it->second.size};  // va, mapped_size
  std::memcpy(info, fields, sizeof(fields));
  return 0;
}

}  // extern "C"

#include "xla_ffi/transports/shm_file.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

namespace smddp {
namespace {

constexpr char kPrefix[] = "/jax_smddp-";
constexpr size_t kPrefixLen = sizeof(kPrefix) - 1;
constexpr size_t kHexChars = 32;

std::string Errno(const std::string& what, int err) { return what + ": " + std::strerror(err); }

bool ValidName(const std::string& name) {
  if (name.size() != kPrefixLen + kHexChars) return false;
  if (name.compare(0, kPrefixLen, kPrefix) != 0) return false;
  for (size_t i = kPrefixLen; i < name.size(); ++i) {
    char c = name[i];
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

Status NewName(std::string* name) {
  unsigned char rnd[kHexChars / 2];
  size_t got = 0;
  while (got < sizeof(rnd)) {
    ssize_t n = ::getrandom(rnd + got, sizeof(rnd) - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::Error(Errno("getrandom", errno));
    }
    got += size_t(n);
  }
  static const char kHex[] = "0123456789abcdef";
  *name = kPrefix;
  for (unsigned char c : rnd) {
    *name += kHex[c >> 4];
    *name += kHex[c & 15];
  }
  return Status::Ok();
}

}  // namespace

Status CreateShmFile(size_t bytes, const std::string& hint, std::string* name, void** base) {
  std::string nm;
  SMDDP_RETURN_IF_ERROR(NewName(&nm));
  int fd = ::shm_open(nm.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) return Status::Error(Errno("shm_open(" + nm + ")", errno));
  auto fail = [&](std::string message) {
    ::close(fd);
    ::shm_unlink(nm.c_str());
    return Status::Error(std::move(message));
  };
  if (::ftruncate(fd, off_t(bytes)) != 0) return fail(Errno("ftruncate(" + nm + ")", errno));
  // Back every page now: on a full /dev/shm, a page first touched through
  // the mapping would kill the process with SIGBUS instead.
  int err = ::posix_fallocate(fd, 0, off_t(bytes));
  if (err != 0 && err != EOPNOTSUPP && err != EINVAL) {
    if (err == ENOSPC) {
      return fail("/dev/shm has no room for a " + std::to_string(bytes) +
                  "-byte shared-memory file: enlarge it (docker run --shm-size) or " + hint);
    }
    return fail(Errno("posix_fallocate(" + nm + ")", err));
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) return fail(Errno("mmap(" + nm + ")", errno));
  ::close(fd);
  *name = nm;
  *base = p;
  return Status::Ok();
}

Status OpenShmFile(const std::string& name, const char* what, uint64_t min_bytes,
                   uint64_t max_bytes, void** base, size_t* bytes) {
  if (!ValidName(name)) {
    return Status::Error("\"" + name + "\" is not a jax_smddp shared-memory " + what + " name");
  }
  int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    int e = errno;
    if (e == ENOENT) {
      return Status::Error(std::string("shared-memory ") + what + " " + name +
                           " does not exist (its creator exited, or another process "
                           "opened and removed it)");
    }
    return Status::Error(Errno("shm_open(" + name + ")", e));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    return Status::Error(Errno("fstat(" + name + ")", e));
  }
  if (st.st_uid != ::geteuid() || (st.st_mode & 077) != 0) {
    ::close(fd);
    return Status::Error(std::string("shared-memory ") + what + " " + name +
                         " belongs to another user or is accessible to others");
  }
  const uint64_t size = uint64_t(st.st_size);
  if (st.st_size < 0 || size < min_bytes || size > max_bytes) {
    ::close(fd);
    return Status::Error(std::string("shared-memory ") + what + " " + name +
                         " has an unexpected size (" + std::to_string(st.st_size) + " bytes)");
  }
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  int e = errno;
  ::close(fd);
  if (p == MAP_FAILED) return Status::Error(Errno("mmap(" + name + ")", e));
  *base = p;
  *bytes = size;
  return Status::Ok();
}

Status UnlinkShmFile(const std::string& name) {
  if (!ValidName(name)) {
    return Status::Error("\"" + name + "\" is not a jax_smddp shared-memory name");
  }
  if (::shm_unlink(name.c_str()) != 0 && errno != ENOENT) {
    return Status::Error(Errno("shm_unlink(" + name + ")", errno));
  }
  return Status::Ok();
}

}  // namespace smddp

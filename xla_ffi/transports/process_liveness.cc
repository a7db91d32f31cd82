#include "xla_ffi/transports/process_liveness.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace smddp {

bool ReadProcStat(int pid, char* state, uint64_t* start_time) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[1024];
  ssize_t n;
  do {
    n = ::read(fd, buf, sizeof(buf) - 1);
  } while (n < 0 && errno == EINTR);
  ::close(fd);
  if (n <= 0) return false;
  buf[n] = '\0';
  // The command name (field 2) is in parentheses and may hold anything.
  char* p = std::strrchr(buf, ')');
  if (p == nullptr) return false;
  ++p;
  while (*p == ' ') ++p;
  if (*p == '\0') return false;
  *state = *p;  // field 3
  for (int field = 3; field < 22; ++field) {
    p = std::strchr(p, ' ');
    if (p == nullptr) return false;
    while (*p == ' ') ++p;
  }
  char* end = nullptr;
  *start_time = std::strtoull(p, &end, 10);
  return end != p;
}

uint64_t ProcessStartTime(int pid) {
  char state;
  uint64_t start = 0;
  return ReadProcStat(pid, &state, &start) ? start : 0;
}

std::string CheckProcess(int pid, uint64_t start_time) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) {
    return "process " + std::to_string(pid) + " exited";
  }
  char state = 0;
  uint64_t now_start = 0;
  if (ReadProcStat(pid, &state, &now_start)) {
    if (state == 'Z' || state == 'X' || state == 'x') {
      return "process " + std::to_string(pid) + " exited";
    }
    if (start_time != 0 && now_start != start_time) {
      return "process " + std::to_string(pid) + " exited (its pid now belongs to another process)";
    }
  }
  return "";
}

}  // namespace smddp

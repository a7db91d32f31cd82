// Whether another process of this host still runs, from its pid and the
// start time /proc recorded for it (so a pid the kernel reused for another
// process does not pass for the peer). Used by the shared-memory link and
// the GPU watchdog (stream_watchdog.h).
#ifndef JAX_SMDDP_TRANSPORTS_PROCESS_LIVENESS_H_
#define JAX_SMDDP_TRANSPORTS_PROCESS_LIVENESS_H_

#include <cstdint>
#include <string>

namespace smddp {

// The state letter and start time (field 22, clock ticks since boot) of
// /proc/<pid>/stat. False if it cannot be read.
bool ReadProcStat(int pid, char* state, uint64_t* start_time);

// Start time of `pid` as ReadProcStat reads it; 0 if unknown.
uint64_t ProcessStartTime(int pid);

// "" while process `pid` (started at `start_time`, 0 if unknown) lives, else
// why it counts as gone ("process 123 exited").
std::string CheckProcess(int pid, uint64_t start_time);

}  // namespace smddp

#endif  // JAX_SMDDP_TRANSPORTS_PROCESS_LIVENESS_H_

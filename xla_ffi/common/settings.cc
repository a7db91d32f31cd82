#include "xla_ffi/common/settings.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>

extern char** environ;

namespace smddp {

namespace {

constexpr double kNoMax = 1e18;
constexpr SettingKind kInt = SettingKind::kInt;
constexpr SettingKind kBytes = SettingKind::kBytes;
constexpr SettingKind kSeconds = SettingKind::kSeconds;
constexpr SettingKind kChoice = SettingKind::kChoice;
constexpr SettingKind kList = SettingKind::kList;
constexpr SettingKind kText = SettingKind::kText;

const std::vector<SettingSpec> kSettings = {
    // name, kind, default, min, max, choices, scope, agree, meaning
    {"JAX_SMDDP_COLLECTIVES", kText, "unset (none)", 0, 0, "", "runtime", true,
     "collectives run on jax_smddp without code changes: xla (XLA's own collectives, jit/pjit "
     "included: on CPU through the MPI ABI, on GPUs through the NCCL API front end; set before "
     "Python starts), all (xla and every jax.lax "
     "collective in shard_map), none, or a comma list of all_gather, reduce_scatter, all_reduce, "
     "all_to_all, collective_permute (jax.lax names accepted: ragged_all_to_all swaps with "
     "all_to_all, ppermute and pbroadcast with collective_permute) and xla; any case; "
     "1/true/on/yes mean all, 0/false/off/no none"},
    {"JAX_SMDDP_COMBINE_BYTES", kBytes, "30M", 0, kNoMax, "", "runtime", true,
     "under the lax swap, independent psums, all_gathers and psum_scatters of one shard_map body "
     "with one kind, axes and element type are merged into engine calls of at most this many "
     "bytes each, as XLA's combiners merge its own (30M: XLA's GPU combine threshold); 0 turns "
     "combining off"},
    {"JAX_SMDDP_TIMEOUT_S", kSeconds, "300", 0.001, 1e9, "", "runtime", false,
     "deadline of every wait inside a collective, in seconds (also jax_smddp.set_timeout)"},
    {"JAX_SMDDP_REQUIRE", kList, "unset", 0, 0, "libfabric|efa|cuda|gdrcopy|mps|no-fallback",
     "runtime", false,
     "what the job must not run without: the doctor exits non-zero and the first collective "
     "raises instead of running on a fallback"},
    {"JAX_SMDDP_CPU_HELPERS", kInt, "cores / local processes - 1", 0, 1024, "", "runtime", false,
     "engine workers that run collective bodies beside the last arrival. The default: the "
     "cores this process may use (its affinity mask) divided among the job's processes on its "
     "host (equal JAX_SMDDP_HOST_ID; 1 before jax_smddp.initialize() and in a one-process "
     "job), less the core the last arrival itself runs on, at least 0: 8 processes on 96 "
     "cores get 11 each (not 95), 2 processes on 2 cores none. Processes bound to disjoint "
     "cores (srun --cpu-bind) see only their own and get fewer than they could: set it. "
     "Measured (python scripts/cpu_helpers_ab.py --processes 2 --devices 2 --a 1 --bytes 16M, "
     "2-core VM under other jobs' load, 6 runs; docs/cpu_steadiness.md, \"Helper threads on a "
     "shared host\"): with none (this default there) against 1 (the old default) the in-process "
     "all_gather's median was 0.88x (0.74-0.99), its p90 0.68x, reduce_scatter and all_reduce "
     "level (0.94x, 1.03x); 4 processes x 2 devices level (1.00-1.06x)"},
    {"JAX_SMDDP_CPU_HELPER_MIN_BYTES", kBytes, "256K", 0, kNoMax, "", "runtime", false,
     "calls moving fewer bytes (all ranks) run on the last arrival alone"},
    {"JAX_SMDDP_INLINE_BYTES", kBytes, "1M", 0, kNoMax, "", "runtime", false,
     "calls across processes on more than one host (JAX_SMDDP_INLINE_ONE_HOST_BYTES within "
     "one) whose outputs in a process (all its devices) are smaller than this run on the XLA "
     "thread of the process's last device to arrive, with no hand-off to an engine worker, once "
     "every peer process has announced the same call; larger calls, and "
     "calls whose peers are later than JAX_SMDDP_INLINE_WAIT_US, run on an engine worker; 0 "
     "turns that off"},
    {"JAX_SMDDP_INLINE_WAIT_US", kInt, "50", 0, 1e6, "", "runtime", false,
     "how long, in microseconds, a small call across processes (JAX_SMDDP_INLINE_BYTES) polls "
     "on XLA's thread for its peers to announce it before it leaves the call to an engine "
     "worker"},
    {"JAX_SMDDP_INLINE_ONE_HOST_BYTES", kBytes, "64M; JAX_SMDDP_INLINE_BYTES where oversubscribed",
     0, kNoMax, "", "runtime", false,
     "JAX_SMDDP_INLINE_BYTES for calls whose processes all share one host: once every peer "
     "process is in the call what remains is copies in shared memory, not a network, and "
     "running it on XLA's thread saves the hand-off to an engine worker. Measured (python -m "
     "jax_smddp.tools.bench --layout 2x2 --ops all_gather,reduce_scatter,all_reduce -b 16M -e "
     "16M --iters 20 --timing solo, 2-core VM, alternating runs on two days; "
     "docs/cpu_steadiness.md, \"A call on XLA's thread within one host\"): p90 within 1.5x of "
     "the median in 23 of 27 op-runs against 9 of 21 with the call handed to a worker, "
     "all_reduce's median 7.0-7.7 ms against 7.9-11.5; 2x1 and 8x1 level. Unset where the "
     "host's processes outnumber its cores (oversubscribed, as for JAX_SMDDP_SPIN), calls within "
     "the host take JAX_SMDDP_INLINE_BYTES and _WAIT_US, as calls between hosts do: 4x1 on 2 "
     "cores, 3 batches of alternating runs of the set above: p90 within 1.5x in 25 of 25 "
     "op-runs against 22 of 25, 9 calls of 500 above 1.5x their run's median against 35. 0 "
     "turns that off"},
    {"JAX_SMDDP_INLINE_ONE_HOST_WAIT_US", kInt, "2000", 0, 1e6, "", "runtime", false,
     "JAX_SMDDP_INLINE_WAIT_US for calls whose processes all share one host: how long XLA's "
     "thread polls (yielding its core after a few rounds) for the peers to announce the call"},
    {"JAX_SMDDP_HOST_ID", kText, "hostname + network namespace", 0, 0, "", "runtime", false,
     "processes with equal ids share memory (one host)"},
    {"JAX_SMDDP_FABRIC_PROVIDER", kText, "efa, else net, else tcp;ofi_rxm (the first present)", 0,
     0, "", "runtime", true, "libfabric provider between hosts"},
    {"JAX_SMDDP_FABRIC_NODE", kText, "the address that reaches the coordinator", 0, 0, "",
     "runtime", false, "local address of the libfabric endpoint"},
    {"JAX_SMDDP_NICS", kText, "auto", 0, 0, "", "runtime", false,
     "the NICs this process's traffic to other hosts leaves by: auto (EFA: the host's EFA "
     "devices nearest this process's GPU by PCIe distance, else split evenly by local rank; "
     "other providers: the interface that reaches the coordinator), or a comma list of "
     "interface names, IP addresses or domain:<libfabric domain> naming the host's NICs, split "
     "between the host's processes evenly by local rank (list one per process to pin it); a "
     "process with several stripes its messages over them (JAX_SMDDP_FABRIC_STRIPE_BYTES)"},
    {"JAX_SMDDP_FABRIC_STRIPE_BYTES", kBytes, "256K", 64, kNoMax, "", "runtime", true,
     "smallest message to a process on another host that is cut into one stripe per NIC pair "
     "when either process has several NICs (JAX_SMDDP_NICS); smaller ones go whole over one "
     "NIC pair, chosen by their tag"},
    {"JAX_SMDDP_FABRIC_CHUNK_BYTES", kBytes, "256K", 64, 1 << 30, "", "runtime", true,
     "libfabric bounce-buffer chunk"},
    {"JAX_SMDDP_FABRIC_BUFFERS", kInt, "32", 1, 4096, "", "runtime", false,
     "libfabric receive buffers, and send buffers, per endpoint"},
    {"JAX_SMDDP_FABRIC_DIRECT_BYTES", kBytes, "512K", 0, kNoMax, "", "runtime", false,
     "smallest message over libfabric sent direct: tagged from the sender's buffer into the "
     "receiver's once the receiver has posted it (no bounce copies; one extra round trip); "
     "smaller messages go through bounce buffers; 0 turns that off. Needs a provider with tagged "
     "messages and directed receives (net, tcp;ofi_rxm, shm, efa); jax_smddp.traffic() says "
     "whether it is on"},
    {"JAX_SMDDP_FABRIC_WAIT", kChoice, "fd", 0, 0, "fd|sleep", "runtime", false,
     "how a call waiting on a libfabric link sleeps once it stops polling: on the completion "
     "queue's descriptor, woken when data arrives (fd, where the provider offers one; up to "
     "1 ms at a time, 10 ms where the call has no shared-memory peer and one endpoint), or for "
     "JAX_SMDDP_SLEEP_US at a time, longer as the wait lasts (sleep)"},
    {"JAX_SMDDP_SHM_RING_BYTES", kBytes, "8M", 4096, 1 << 30, "", "runtime", false,
     "each direction's shared-memory ring between two processes of a host"},
    {"JAX_SMDDP_SHM_SINGLE_COPY_BYTES", kBytes, "64K", 0, kNoMax, "", "runtime", false,
     "smallest message between two processes of a host that the receiver reads straight from "
     "the sender's memory (process_vm_readv: one copy, no ring); 0 turns that off. Where ptrace "
     "rules forbid it, the link falls back to the ring and jax_smddp.traffic() says why"},
    {"JAX_SMDDP_HUGE_PAGE_BYTES", kBytes, "JAX_SMDDP_HEAP_REUSE_BYTES (4M where that is off)", 0,
     kNoMax, "", "runtime", false,
     "outputs of collectives this large or larger are advised onto transparent huge pages "
     "before they are written (madvise MADV_HUGEPAGE: one page fault per 2 MiB of XLA's fresh "
     "output mappings instead of one per 4 KiB); 0 turns that off. The default advises only "
     "the outputs glibc maps afresh each call: smaller ones come from the heap "
     "JAX_SMDDP_HEAP_REUSE_BYTES keeps, fresh only when it grows, onto memory that a virtual "
     "machine's host may have taken back, where huge pages fault in slowest (this VM: 0.4 GB/s "
     "against 2.4 with 4 KiB pages, python scripts/first_touch.py; 2x2 all_gather of 4 MiB per "
     "rank, scripts/call_faults.py: such calls 35-86 ms advised, 10-27 ms not)"},
    {"JAX_SMDDP_MALLOC_ARENAS", kInt, "1", 0, 1024, "", "runtime", false,
     "glibc malloc arenas (mallopt M_ARENA_MAX), set when jax_smddp is imported, before XLA's "
     "CPU client starts its device threads: with 1 their output buffers come from the main heap, "
     "which JAX_SMDDP_HEAP_REUSE_BYTES keeps, not from per-thread heaps that glibc unmaps once "
     "empty (a 2x2 all_gather of 4 MiB per rank: 5-9 of 80 calls on fresh, page-faulting memory "
     "instead of 40-50, medians 4.7-6.4 ms instead of 8.4-13.7: docs/cpu_steadiness.md); threads "
     "then share one allocator lock. 0 leaves glibc's default (8 per core), as do MALLOC_ARENA_MAX "
     "or glibc.malloc.arena_max in the environment. glibc only"},
    {"JAX_SMDDP_HEAP_REUSE_BYTES", kBytes, "64M", 0, 1 << 30, "", "runtime", false,
     "when a process sets up its first CPU collective, glibc is told to serve allocations up "
     "to this size from its heap and to keep what is freed there (mallopt M_MMAP_THRESHOLD, "
     "M_TRIM_THRESHOLD at JAX_SMDDP_HEAP_TRIM_BYTES or twice this, the larger, and M_TOP_PAD at "
     "64 MiB, without which glibc unmaps a thread arena's heaps once empty), so XLA's large "
     "output buffers are reused call after call instead of mapped afresh, page-faulted and "
     "zeroed by the kernel each time; the process may keep that much freed memory at the top "
     "of the main heap, and a thread's own "
     "arena keeps the heaps it grew (64 MiB each); 0 leaves glibc's "
     "policy alone, as do MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_ or a "
     "glibc.malloc tunable in the environment. glibc only"},
    {"JAX_SMDDP_HEAP_TRIM_BYTES", kBytes, "1G", 0, 1 << 30, "", "runtime", false,
     "while JAX_SMDDP_HEAP_REUSE_BYTES keeps glibc's heap, free memory at the top of the main "
     "heap is given back to the system only beyond this much (mallopt M_TRIM_THRESHOLD; at least "
     "twice JAX_SMDDP_HEAP_REUSE_BYTES): below it the heap shrank to its 64 MiB pad whenever "
     "the outputs at its top were freed together and regrew onto fresh pages a few calls "
     "later, each such call waiting for the kernel (on a VM, its host) to supply its output "
     "page by page. 2x2 at 16 MiB per rank, 5 alternating pairs of the on-host benchmark: p90 "
     "within 1.5x of the median in 15 of 15 op-runs against 12 of 15 at 128M, 8 of 300 calls "
     "above 1.5x their run's median against 17 (docs/cpu_steadiness.md). The process may keep "
     "this much freed memory"},
    {"JAX_SMDDP_STREAMING_STORE_BYTES", kBytes, "16M", 0, kNoMax, "", "runtime", false,
     "collectives that write this much or more in a process (all its outputs) copy with "
     "non-temporal stores, which bypass the caches (no read of each destination line before "
     "it is overwritten; inputs stay cached); smaller ones use memcpy, whose output is still "
     "in cache for the next op; 0 turns that off. x86-64 only"},
    {"JAX_SMDDP_CHUNK_BYTES", kBytes, "1M", 1, 1 << 30, "", "runtime", true,
     "chunk of cross-process messages (pipelining); rounded up to a multiple of 64 bytes and "
     "at least 4K; process 0's is used. Unset, jax_smddp.tuning chooses each call's chunk, and "
     "calls it does not choose for take this default"},
    {"JAX_SMDDP_ALGORITHM", kChoice, "chosen by jax_smddp.tuning", 0, 0, "flat|hierarchical",
     "runtime", true, "force the cross-process routes; process 0's is used"},
    {"JAX_SMDDP_HIERARCHICAL", kChoice, "1", 0, 0, "0|1", "runtime", true,
     "0: direct routes between all processes, even across hosts"},
    {"JAX_SMDDP_STAGGER_CHUNK_BYTES", kBytes, "128K", 0, 1 << 30, "", "runtime", true,
     "with more than 2 hosts, one process on each: the hosts form a ring, and every byte "
     "between them goes round it, relayed and combined chunk by chunk; with several processes "
     "per host, a process exchanging with one process on each other host (its rail) sends to "
     "them in rounds: in round k to the host k after its own, each chunk once the same chunk of "
     "the previous round (from the host k-1 before it) arrived. Either way each host's link "
     "carries one flow at a time (several at once share a capped link unevenly, and the call "
     "waits for the last); such calls' chunks are at most this large, so the hops or rounds "
     "overlap; 0: no ring and no rounds, every host at once"},
    {"JAX_SMDDP_CALIBRATION", kText, "~/.cache/jax_smddp/calibration.json", 0, 0, "", "runtime",
     false, "the cost model's calibration of this machine (the tuner uses process 0's)"},
    {"JAX_SMDDP_SPIN", kInt, "256; 16 where oversubscribed", 0, 1e9, "", "runtime", false,
     "polls of a link before a thread waiting in a call across processes yields its core. "
     "Oversubscribed: the job has more processes on this machine (one kernel: equal "
     "/proc/sys/kernel/random/boot_id, network namespaces included) than this process may use "
     "cores, as jax_smddp.initialize() finds"},
    {"JAX_SMDDP_YIELD", kInt, "4096; 32 where oversubscribed", 0, 1e9, "", "runtime", false,
     "polls of a link before a thread waiting in a call across processes sleeps (woken by the "
     "link's activity: a shared-memory link as soon as its peer writes, a libfabric link with "
     "a wait descriptor when data arrives); oversubscribed as for JAX_SMDDP_SPIN"},
    {"JAX_SMDDP_SLEEP_US", kInt, "50", 0, 1e6, "", "runtime", false,
     "longest a sleeping engine thread waits before it polls again while its wait is young (it "
     "wakes earlier when a shared-memory link signals that its peer wrote); a wait that has "
     "lasted sleeps up to an eighth of the time it has slept, at most 1 ms or this, whichever is "
     "longer"},
    {"JAX_SMDDP_GPU_STREAM", kChoice, "collective", 0, 0, "collective|compute", "gpu", false,
     "the stream GPU collectives run on: XLA's collective stream, or the compute stream"},
    {"JAX_SMDDP_GPU_SLOT_BYTES", kBytes, "8M", 4096, 1 << 30, "", "gpu", true,
     "bytes per staging slot (two per rank and group)"},
    {"JAX_SMDDP_NCCL_LIBRARY", kText, "unset (the nvidia-nccl wheel's libnccl.so.2)", 0, 0, "",
     "gpu", false,
     "path of the real NCCL library the NCCL API front end forwards what it does not serve to "
     "(JAX_SMDDP_COLLECTIVES=xla on GPUs)"},
    {"JAX_SMDDP_GPU_COPIES", kChoice, "engine", 0, 0, "engine|kernel", "gpu", false,
     "GPU data moves by copy engines (zero SMs) or by kernels"},
    {"JAX_SMDDP_GPU_FLAGS", kChoice, "memops", 0, 0, "memops|kernel", "gpu", false,
     "GPU step flags by stream memory operations or by kernels"},
    {"JAX_SMDDP_GPU_MAX_BLOCKS", kInt, "16", 1, 1024, "", "gpu", false,
     "thread blocks (SMs) a GPU copy or reduction kernel may use (16 of an H200's 132 read "
     "0.57-0.70 of its copy rate, 8 read 0.30-0.37: docs/gpu_measurements.md)"},
    {"JAX_SMDDP_GPU_GRAPHS", kChoice, "0", 0, 0, "0|1", "gpu", true,
     "1: jax_smddp's GPU custom calls tell XLA they may be captured into CUDA graphs (its command "
     "buffers, which take custom calls by default): a captured call stages through the slots, "
     "replayable, and every staged call then ends once its peers consumed it; 0: XLA never "
     "captures them. The NCCL API front end's calls may always be captured"},
    {"JAX_SMDDP_GPU_FLAG_MEMORY", kChoice, "host", 0, 0, "device|host", "gpu", true,
     "where the step flags of GPU groups across processes live: host (shared memory every GPU "
     "of the group addresses: a dead peer's waiting streams are released, and direct calls meet "
     "their peers on the device) or device (polled in device memory, but a direct call then "
     "waits on the host for every peer and a dead peer's waiting streams stay blocked)"},
    {"JAX_SMDDP_GPU_DIRECT_READS", kChoice, "1", 0, 0, "0|1", "gpu", true,
     "1: ranks on one host read each other's XLA buffers in place (0: through the staging "
     "slots); the NCCL API front end's calls captured into CUDA graphs always stage"},
    {"JAX_SMDDP_FABRIC_HMEM", kChoice, "0", 0, 0, "0|auto|1", "gpu", true,
     "GPU network slots in device memory registered with libfabric (auto: where every process "
     "can)"},
    {"JAX_SMDDP_GDRCOPY", kChoice, "1", 0, 0, "0|1", "gpu", false,
     "0: never use GDRCopy for GPU flags"},
    {"JAX_SMDDP_LIBFABRIC_ROOT", kText, "pkg-config, /opt/amazon/efa, default paths", 0, 0, "",
     "build", false, "prefix holding libfabric's include/ and lib/ (also LIBFABRIC_ROOT)"},
    {"JAX_SMDDP_LAUNCH_WRAPPER", kText, "unset", 0, 0, "", "tools", false,
     "command put before every process of jax_smddp.tools.launch's jobs (e.g. a debugger)"},
};

std::string Accepts(const SettingSpec& s) {
  std::ostringstream os;
  auto num = [](double v) {
    std::ostringstream n;
    if (v >= 1e18) return std::string("any");
    if (v == std::floor(v) && std::fabs(v) < 9e15) {
      n << static_cast<long long>(v);
    } else {
      n << v;
    }
    return n.str();
  };
  switch (s.kind) {
    case SettingKind::kInt:
      os << "an integer from " << num(s.min) << " to " << num(s.max);
      break;
    case SettingKind::kBytes:
      os << "a byte count from " << num(s.min) << (s.max >= kNoMax ? " up" : " to " + num(s.max))
         << " (an integer, or with K, M or G)";
      break;
    case SettingKind::kSeconds:
      os << "a number of seconds from " << num(s.min) << " to " << num(s.max);
      break;
    case SettingKind::kChoice:
      os << "one of " << s.choices;
      break;
    case SettingKind::kList:
      os << "a comma list of " << s.choices;
      break;
    case SettingKind::kText:
      os << "any text";
      break;
  }
  return os.str();
}

bool InChoices(const std::string& v, const char* choices) {
  std::string all = std::string("|") + choices + "|";
  return !v.empty() && v.find('|') == std::string::npos &&
         all.find("|" + v + "|") != std::string::npos;
}

std::string Trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

// The value as the code compares it: trimmed, and lower case for choices.
std::string Normalize(const SettingSpec& s, const std::string& v) {
  std::string t = Trim(v);
  if (s.kind == SettingKind::kChoice || s.kind == SettingKind::kList)
    for (char& c : t) c = char(std::tolower(static_cast<unsigned char>(c)));
  return t;
}

// Parses a number of the spec's kind; false when `text` is not one.
bool ParseNumber(const SettingSpec& s, const std::string& text, double* out) {
  std::string t = Trim(text);
  if (t.empty()) return false;
  double scale = 1;
  if (s.kind == SettingKind::kBytes) {
    const char last = char(std::toupper(static_cast<unsigned char>(t.back())));
    if (last == 'K' || last == 'M' || last == 'G') {
      scale = last == 'K' ? 1024.0 : last == 'M' ? 1048576.0 : 1073741824.0;
      t.pop_back();
    }
  }
  char* end = nullptr;
  errno = 0;
  double v = s.kind == SettingKind::kSeconds ? std::strtod(t.c_str(), &end)
                                             : double(std::strtoll(t.c_str(), &end, 10));
  if (errno != 0 || end == t.c_str() || *end != '\0' || !std::isfinite(v)) return false;
  *out = v * scale;
  return true;
}

Status Validate(const SettingSpec& s, const std::string& value) {
  bool ok = true;
  switch (s.kind) {
    case SettingKind::kInt:
    case SettingKind::kBytes:
    case SettingKind::kSeconds: {
      double v = 0;
      ok = ParseNumber(s, value, &v) && v >= s.min && v <= s.max;
      break;
    }
    case SettingKind::kChoice:
      ok = InChoices(Normalize(s, value), s.choices);
      break;
    case SettingKind::kList:
      for (const std::string& item : SettingItems(Normalize(s, value)))
        ok = ok && InChoices(item, s.choices);
      break;
    case SettingKind::kText:
      break;
  }
  if (ok) return Status::Ok();
  return Status::InvalidArgument(std::string(s.name) + "='" + value + "' is not valid: it takes " +
                                 Accepts(s) + " (" + s.meaning + "; unset it for the default, " +
                                 s.default_text + ")");
}

const char* Env(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? v : nullptr;
}

}  // namespace

const std::vector<SettingSpec>& AllSettings() { return kSettings; }

std::vector<std::string> SettingItems(const std::string& value) {
  std::vector<std::string> items;
  std::stringstream in(value);
  std::string item;
  while (std::getline(in, item, ',')) {
    item = Trim(item);
    if (!item.empty()) items.push_back(item);
  }
  return items;
}

const SettingSpec* FindSetting(const std::string& name) {
  for (const std::vector<SettingSpec>* registry : {&kSettings, &TestSettings()})
    for (const SettingSpec& s : *registry)
      if (name == s.name) return &s;
  return nullptr;
}

Status ReadSetting(const char* name, std::string* text, bool* set) {
  const SettingSpec* s = FindSetting(name);
  if (s == nullptr)
    return Status::InvalidArgument(std::string("jax_smddp: no setting is named ") + name);
  const char* v = Env(name);
  if (set) *set = v != nullptr;
  if (v == nullptr) {
    *text = s->default_text;
    return Status::Ok();
  }
  SMDDP_RETURN_IF_ERROR(Validate(*s, v));
  *text = Normalize(*s, v);
  return Status::Ok();
}

Status ParseSetting(const std::string& name, const std::string& value, std::string* normalized,
                    double* number) {
  const SettingSpec* s = FindSetting(name);
  if (s == nullptr) return Status::InvalidArgument("jax_smddp: no setting is named " + name);
  SMDDP_RETURN_IF_ERROR(Validate(*s, value));
  *normalized = Normalize(*s, value);
  *number = 0;
  if (s->kind == SettingKind::kInt || s->kind == SettingKind::kBytes ||
      s->kind == SettingKind::kSeconds)
    ParseNumber(*s, value, number);
  return Status::Ok();
}

namespace {

// The environment's value of the numeric setting `name`, when set and valid.
bool NumberSetting(const char* name, double* out) {
  const SettingSpec* s = FindSetting(name);
  const char* v = Env(name);
  return s != nullptr && v != nullptr && Validate(*s, v).ok() && ParseNumber(*s, v, out);
}

}  // namespace

// 0 when the declared default is not a value: a caller's mistake, which
// tests/api/test_settings.py rules out.
double DeclaredDefault(const char* name) {
  const SettingSpec* s = FindSetting(name);
  double v = 0;
  return s != nullptr && ParseNumber(*s, s->default_text, &v) ? v : 0;
}

int64_t IntSetting(const char* name) {
  double v = 0;
  return int64_t(NumberSetting(name, &v) ? v : DeclaredDefault(name));
}

double SecondsSetting(const char* name) {
  double v = 0;
  return NumberSetting(name, &v) ? v : DeclaredDefault(name);
}

bool IntSettingIfSet(const char* name, int64_t* value) {
  double v = 0;
  if (!NumberSetting(name, &v)) return false;
  *value = int64_t(v);
  return true;
}

std::string TextSetting(const char* name) {
  const SettingSpec* s = FindSetting(name);
  if (s == nullptr) return std::string();
  const char* v = Env(name);
  if (v != nullptr && Validate(*s, v).ok()) return Normalize(*s, v);
  if (s->kind == SettingKind::kChoice && InChoices(s->default_text, s->choices))
    return s->default_text;
  return std::string();
}

Status CheckSettings(std::vector<std::string>* unknown) {
  static const char kPrefix[] = "JAX_SMDDP_";
  Status first;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const char* eq = std::strchr(*e, '=');
    if (eq == nullptr || std::strncmp(*e, kPrefix, sizeof(kPrefix) - 1) != 0) continue;
    const std::string name(*e, size_t(eq - *e));
    const SettingSpec* s = FindSetting(name);
    if (s == nullptr) {
      if (unknown) unknown->push_back(name);
      continue;
    }
    if (*(eq + 1) != '\0' && first.ok()) first = Validate(*s, eq + 1);
  }
  return first;
}

}  // namespace smddp

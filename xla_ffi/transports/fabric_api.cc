#include "xla_ffi/transports/fabric_api.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#ifdef SMDDP_HAVE_LIBFABRIC
#include <dlfcn.h>
#include <limits.h>
#include <link.h>
#include <poll.h>
#include <unistd.h>

#include <random>
#endif

namespace smddp {

const char kFabricNoHeaders[] =
    "built without libfabric headers (install libfabric-dev on Debian/Ubuntu, "
    "libfabric-devel on RHEL, and rebuild jax_smddp)";

#ifdef SMDDP_HAVE_LIBFABRIC

namespace {

const char kInstallHint[] =
    "install libfabric (Debian/Ubuntu: apt-get install libfabric1; RHEL: dnf install "
    "libfabric; on AWS the EFA installer provides it) or put the directory holding "
    "libfabric.so.1 on LD_LIBRARY_PATH";

template <typename F>
bool Resolve(void* lib, const char* name, F* fn, std::string* error) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  if (*fn == nullptr && error->empty()) {
    *error = std::string("libfabric.so.1 does not export ") + name +
             " (is it libfabric 1.5 or newer?); " + kInstallHint;
  }
  return *fn != nullptr;
}

// The file the loader opened for `lib` (its link map's name), else `fallback`.
std::string LoadedPath(void* lib, const std::string& fallback) {
  struct link_map* map = nullptr;
  if (dlinfo(lib, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr &&
      *map->l_name != '\0') {
    char resolved[PATH_MAX];
    return realpath(map->l_name, resolved) ? std::string(resolved) : std::string(map->l_name);
  }
  return fallback;
}

}  // namespace

// net (libfabric 1.17's TCP provider with reliable datagrams) reads each
// message's header through a 9000-byte prefetch buffer by default; with it the
// large all_gathers between two hosts ran at about 0.6 of the link, reading
// straight from the socket at about 0.8 (docs/cpu_floor_between_hosts.md,
// "The net provider's prefetch buffer").
const FabricEnvDefault kFabricEnvDefaults[] = {
    {"FI_NET_PREFETCH_RBUF_SIZE", "0"},
};
const int kFabricEnvDefaultCount = sizeof(kFabricEnvDefaults) / sizeof(kFabricEnvDefaults[0]);

std::string FabricApi::Err(int ret) const {
  int e = ret < 0 ? -ret : ret;
  const char* s = strerror ? strerror(e) : nullptr;
  return std::string(s ? s : "unknown error") + " (" + std::to_string(ret) + ")";
}

uint32_t FabricApi::RequestedVersion() const {
  return std::min<uint32_t>(version(), FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION));
}

const FabricApi& GetFabricApi() {
  static const FabricApi* api = [] {
    FabricApi* a = new FabricApi;
    // Providers read their variables once, when libfabric first initialises.
    for (int i = 0; i < kFabricEnvDefaultCount; ++i) {
      if (std::getenv(kFabricEnvDefaults[i].name) == nullptr) {
        setenv(kFabricEnvDefaults[i].name, kFabricEnvDefaults[i].value, /*overwrite=*/0);
        a->env_set.emplace_back(kFabricEnvDefaults[i].name);
      }
    }
    // The loader path first; else the library beside the headers this build
    // used (e.g. /opt/amazon/efa/lib, often not on the loader path).
    void* lib = dlopen("libfabric.so.1", RTLD_NOW | RTLD_LOCAL);
    std::string tried = "libfabric.so.1";
    if (lib == nullptr) {
      const char* e = dlerror();
      std::string why = e ? e : "not found";
#ifdef SMDDP_LIBFABRIC_LIBRARY_DIR
      if (*SMDDP_LIBFABRIC_LIBRARY_DIR != '\0') {
        tried = std::string(SMDDP_LIBFABRIC_LIBRARY_DIR) + "/libfabric.so.1";
        lib = dlopen(tried.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (lib == nullptr) {
          e = dlerror();
          why += "; " + tried + ": " + (e ? e : "not found");
        }
      }
#endif
      if (lib == nullptr) {
        a->error = "cannot load libfabric.so.1 (" + why + "); " + kInstallHint;
        return a;
      }
    }
    a->path = LoadedPath(lib, tried);
    Resolve(lib, "fi_getinfo", &a->getinfo, &a->error);
    Resolve(lib, "fi_freeinfo", &a->freeinfo, &a->error);
    Resolve(lib, "fi_dupinfo", &a->dupinfo, &a->error);
    Resolve(lib, "fi_fabric", &a->fabric, &a->error);
    Resolve(lib, "fi_strerror", &a->strerror, &a->error);
    Resolve(lib, "fi_version", &a->version, &a->error);
    if (a->error.empty() && a->version() < FI_VERSION(1, 5)) {
      a->error = "libfabric " + std::to_string(FI_MAJOR(a->version())) + "." +
                 std::to_string(FI_MINOR(a->version())) +
                 " is too old (jax_smddp needs 1.5 or newer); " + kInstallHint;
    }
    return a;
  }();
  return *api;
}

int GetRdmInfo(const FabricApi& a, const std::string& provider, const std::string& node,
               uint64_t caps, uint64_t mr_mode, struct fi_info** out) {
  // libfabric's shm provider names its endpoint's shared-memory region after
  // the process id unless given a name: a region left by a killed process
  // (it is unlinked only by fi_close) then makes a later process that gets
  // the same id fail to open its endpoint. A name of our own, the process id
  // and a random word, never meets such a leftover.
  std::string shm_name;
  if (provider == "shm") {
    std::random_device random;
    char word[32];
    std::snprintf(word, sizeof(word), "%d-%08x", int(getpid()), unsigned(random()));
    shm_name = word;
  }
  // "domain:<name>": a libfabric domain (one per EFA device, i.e. per NIC) instead of an
  // address: the endpoint opens on that NIC (JAX_SMDDP_NICS, jax_smddp/nics.py).
  const std::string kDomain = "domain:";
  const bool by_domain = node.compare(0, kDomain.size(), kDomain) == 0;
  const std::string domain = by_domain ? node.substr(kDomain.size()) : std::string();
  const char* where = provider == "shm"           ? shm_name.c_str()
                      : node.empty() || by_domain ? nullptr
                                                  : node.c_str();
  int ret = -FI_ENODATA;
  *out = nullptr;
  for (int attempt = 0; attempt < 3 && ret == -FI_ENODATA; ++attempt) {
    struct fi_info* hints = a.dupinfo(nullptr);
    if (hints == nullptr) return -FI_ENOMEM;
    hints->caps = caps;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->ep_attr->type = FI_EP_RDM;
    hints->domain_attr->mr_mode = static_cast<int>(mr_mode);
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    if (attempt < 2) hints->domain_attr->data_progress = FI_PROGRESS_MANUAL;
    if (attempt < 1) hints->domain_attr->control_progress = FI_PROGRESS_MANUAL;
    hints->fabric_attr->prov_name = strdup(provider.c_str());
    if (by_domain) hints->domain_attr->name = strdup(domain.c_str());
    ret = a.getinfo(a.RequestedVersion(), where, nullptr, where ? FI_SOURCE : 0, hints, out);
    a.freeinfo(hints);
  }
  if (ret == 0 && *out == nullptr) ret = -FI_ENODATA;
  return ret;
}

namespace {

// Opens o->cq signalling a wait set of its own (o->wait, o->wait_fd).
// Returns 0, or libfabric's code with neither left open.
int OpenCqOnWaitSet(RdmObjects* o, struct fi_cq_attr cq_attr) {
  struct fi_wait_attr wait_attr;
  std::memset(&wait_attr, 0, sizeof(wait_attr));
  wait_attr.wait_obj = FI_WAIT_FD;
  struct fid_wait* wait = nullptr;
  int ret = fi_wait_open(o->fabric, &wait_attr, &wait);
  if (ret != 0) return ret;
  cq_attr.wait_obj = FI_WAIT_SET;
  cq_attr.wait_set = wait;
  int fd = -1;
  ret = fi_cq_open(o->domain, &cq_attr, &o->cq, nullptr);
  if (ret == 0 && (ret = fi_control(&wait->fid, FI_GETWAIT, &fd)) != 0) {
    fi_close(&o->cq->fid);
    o->cq = nullptr;
  }
  if (ret != 0) {
    fi_close(&wait->fid);
    return ret;
  }
  o->wait = wait;
  o->wait_fd = fd;
  return 0;
}

}  // namespace

Status OpenRdmObjects(const FabricApi& a, struct fi_info* info, const std::string& what,
                      int cq_format, size_t cq_size, RdmObjects* o, bool wait_fd) {
  auto fail = [&](const char* call, int r) {
    return Status::Error(std::string(call) + " failed for " + what + ": " + a.Err(r));
  };
  int ret;
  if ((ret = a.fabric(info->fabric_attr, &o->fabric, nullptr)) != 0) return fail("fi_fabric", ret);
  if ((ret = fi_domain(o->fabric, info, &o->domain, nullptr)) != 0) return fail("fi_domain", ret);
  struct fi_av_attr av_attr;
  std::memset(&av_attr, 0, sizeof(av_attr));
  av_attr.type =
      info->domain_attr->av_type != FI_AV_UNSPEC ? info->domain_attr->av_type : FI_AV_TABLE;
  if ((ret = fi_av_open(o->domain, &av_attr, &o->av, nullptr)) != 0) return fail("fi_av_open", ret);
  struct fi_cq_attr cq_attr;
  std::memset(&cq_attr, 0, sizeof(cq_attr));
  cq_attr.format = static_cast<enum fi_cq_format>(cq_format);
  cq_attr.size = cq_size;
  ret = -FI_ENOSYS;
  // A descriptor to sleep on, so that a waiter wakes when data arrives
  // instead of at its next timed poll: a wait set's where the provider has
  // them (MaySleep can clear it), else the queue's own.
  if (wait_fd) ret = OpenCqOnWaitSet(o, cq_attr);
  if (wait_fd && ret != 0) {
    cq_attr.wait_obj = FI_WAIT_FD;
    ret = fi_cq_open(o->domain, &cq_attr, &o->cq, nullptr);
    if (ret == 0 && fi_control(&o->cq->fid, FI_GETWAIT, &o->wait_fd) != 0) o->wait_fd = -1;
  }
  if (ret != 0) {
    cq_attr.wait_obj = FI_WAIT_NONE;
    if ((ret = fi_cq_open(o->domain, &cq_attr, &o->cq, nullptr)) != 0)
      return fail("fi_cq_open", ret);
  }
  if ((ret = fi_endpoint(o->domain, info, &o->ep, nullptr)) != 0) return fail("fi_endpoint", ret);
  if ((ret = fi_ep_bind(o->ep, &o->av->fid, 0)) != 0)
    return fail("fi_ep_bind (address vector)", ret);
  if ((ret = fi_ep_bind(o->ep, &o->cq->fid, FI_TRANSMIT | FI_RECV)) != 0)
    return fail("fi_ep_bind (completion queue)", ret);
  if ((ret = fi_enable(o->ep)) != 0) return fail("fi_enable", ret);
  std::string name(256, '\0');
  size_t len = name.size();
  ret = fi_getname(&o->ep->fid, &name[0], &len);
  if (ret == -FI_ETOOSMALL) {
    name.resize(len);
    ret = fi_getname(&o->ep->fid, &name[0], &len);
  }
  if (ret != 0) return fail("fi_getname", ret);
  name.resize(std::min(len, name.size()));
  o->address = std::move(name);
  return Status::Ok();
}

bool MaySleep(const RdmObjects& o) {
  // No time left: clears the set's signal, then answers -FI_ETIMEDOUT where
  // nothing it watches is ready (0: something is).
  if (o.wait) return fi_wait(o.wait, 0) == -FI_ETIMEDOUT;
  struct fid* fids[1] = {&o.cq->fid};
  return fi_trywait(o.fabric, fids, 1) == FI_SUCCESS;
}

void SleepOnCompletions(const RdmObjects& o, int kick_fd, unsigned max_us) {
  struct pollfd p[2] = {{o.wait_fd, POLLIN, 0}, {kick_fd, POLLIN, 0}};  // fd -1: ignored
  struct timespec t = {time_t(max_us / 1000000), long(max_us % 1000000) * 1000};
  if (::ppoll(p, 2, &t, nullptr) > 0 && (p[1].revents & POLLIN)) {
    uint64_t count;
    (void)!::read(kick_fd, &count, sizeof(count));
  }
}

void CloseRdmObjects(RdmObjects* o) {
  if (o->ep) fi_close(&o->ep->fid);
  if (o->av) fi_close(&o->av->fid);
  if (o->cq) fi_close(&o->cq->fid);
  if (o->wait) fi_close(&o->wait->fid);
  if (o->domain) fi_close(&o->domain->fid);
  if (o->fabric) fi_close(&o->fabric->fid);
  *o = RdmObjects();
}

#endif  // SMDDP_HAVE_LIBFABRIC

}  // namespace smddp

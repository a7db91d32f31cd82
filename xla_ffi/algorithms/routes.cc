#include <algorithm>
#include <map>

#include "xla_ffi/algorithms/process_call.h"

namespace smddp {

namespace {

// Routes::ring for `process`, the group's processes in ring order `ring`
// (one per host).
void RingRoutes(const std::vector<int>& process_of_rank, int process, const std::vector<int>& ring,
                Routes* r) {
  const int n = int(process_of_rank.size()), hosts = int(ring.size());
  std::map<int, int> pos;
  for (int i = 0; i < hosts; ++i) pos[ring[size_t(i)]] = i;
  const int me = pos[process], next = ring[size_t((me + 1) % hosts)],
            prev = ring[size_t((me + hosts - 1) % hosts)];
  r->ring = true;
  r->gather_targets = {next};
  // How far round the ring a rank's block has come when it reaches this
  // process (gathers: 1 from the previous), and how far its reduction has
  // (0: it starts here, at the process after the rank's own).
  std::vector<int> gathered(size_t(n), 0), reduced(size_t(n), 0);
  for (int s = 0; s < n; ++s) {
    const int owner = pos[process_of_rank[size_t(s)]];
    gathered[size_t(s)] = (me - owner + hosts) % hosts;
    reduced[size_t(s)] = (me - owner - 1 + 2 * hosts) % hosts;
    r->reduce_sources[size_t(s)] = reduced[size_t(s)] == 0 ? std::vector<int>{} : std::vector{prev};
    if (owner == me) continue;  // completed here: gather_source and reduce_dest stay -1
    r->reduce_dest[size_t(s)] = next;
    r->gather_source[size_t(s)] = prev;
    if ((me + 1) % hosts != owner) r->gather_relay[size_t(s)] = {next};
  }
  // Each process waits for what comes round first first, so none waits on
  // one that waits on it.
  auto by = [](const std::vector<int>& key) {
    std::vector<int> order(key.size());
    for (size_t s = 0; s < order.size(); ++s) order[s] = int(s);
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return key[size_t(a)] < key[size_t(b)]; });
    return order;
  };
  for (int s : by(gathered))
    if (gathered[size_t(s)] != 0) r->gather_order.push_back(s);
  r->reduce_order = by(reduced);
}

}  // namespace

Routes ComputeRoutes(const std::vector<int>& process_of_rank, int process,
                     const std::vector<std::string>& host_of_process, bool allow_hierarchy,
                     bool stagger) {
  const int n = int(process_of_rank.size());
  // The group's processes, by host, in process order: a process's rail is
  // its position on its host.
  std::vector<int> procs(process_of_rank.begin(), process_of_rank.end());
  std::sort(procs.begin(), procs.end());
  procs.erase(std::unique(procs.begin(), procs.end()), procs.end());
  auto host = [&](int p) -> const std::string& { return host_of_process[size_t(p)]; };
  std::map<std::string, std::vector<int>> by_host;
  for (int p : procs) by_host[host(p)].push_back(p);
  std::map<int, int> rail;
  size_t per_host = 0;
  bool uniform = true;
  for (auto& [h, ps] : by_host) {
    if (per_host == 0) per_host = ps.size();
    uniform &= ps.size() == per_host;
    for (size_t i = 0; i < ps.size(); ++i) rail[ps[i]] = int(i);
  }
  Routes r;
  r.hierarchical = allow_hierarchy && uniform && by_host.size() >= 2 && per_host >= 2;
  r.gather_source.assign(n, -1);
  r.gather_relay.assign(n, {});
  r.reduce_sources.assign(n, {});
  r.reduce_dest.assign(n, -1);
  if (stagger && by_host.size() > 2 && per_host == 1 && uniform) {
    std::vector<int> ring;
    for (auto& [h, ps] : by_host) ring.push_back(ps[0]);
    RingRoutes(process_of_rank, process, ring, &r);
    return r;
  }
  const std::string& my_host = host(process);
  const int my_rail = rail.count(process) ? rail[process] : -1;
  // This host's process of rail `i`.
  auto on_my_host = [&](int i) { return by_host[my_host][size_t(i)]; };
  auto near = [&](int q) { return host(q) == my_host || rail[q] == my_rail; };

  for (int q : procs) {
    if (q == process) continue;
    if (!r.hierarchical || near(q)) r.gather_targets.push_back(q);
  }
  for (int s = 0; s < n; ++s) {
    const int q = process_of_rank[s];
    if (q == process) continue;
    r.gather_source[s] = !r.hierarchical || near(q) ? q : on_my_host(rail[q]);
    if (r.hierarchical && host(q) != my_host && rail[q] == my_rail) {
      for (int p : by_host[my_host])
        if (p != process) r.gather_relay[s].push_back(p);
    }
  }
  for (int t = 0; t < n; ++t) {
    const int q = process_of_rank[t];
    if (!r.hierarchical) {
      if (q == process) {
        for (int p : procs)
          if (p != process) r.reduce_sources[t].push_back(p);
      } else {
        r.reduce_dest[t] = q;
      }
      continue;
    }
    if (q == process) {
      // Own rank: every other process of this host, and this rail's process
      // on every other host (which combined its host first).
      for (int p : procs)
        if (p != process && near(p)) r.reduce_sources[t].push_back(p);
    } else if (host(q) == my_host) {
      r.reduce_dest[t] = q;
    } else if (rail[q] == my_rail) {
      // This process combines its host's contributions for t and sends them on.
      for (int p : by_host[my_host])
        if (p != process) r.reduce_sources[t].push_back(p);
      r.reduce_dest[t] = q;
    } else {
      r.reduce_dest[t] = on_my_host(rail[q]);
    }
  }
  for (int pass = 0; pass < 2; ++pass) {
    for (int s = 0; s < n; ++s) {
      if (r.gather_source[s] >= 0 && (pass == 0) == !r.gather_relay[s].empty())
        r.gather_order.push_back(s);
    }
  }
  for (int pass = 0; pass < 3; ++pass) {
    for (int t = 0; t < n; ++t) {
      const int stage = r.reduce_dest[t] < 0 ? 2 : (r.reduce_sources[t].empty() ? 0 : 1);
      if (stage == pass) r.reduce_order.push_back(t);
    }
  }
  // The peers on other hosts this process sends its own data to: one per
  // host, or no rounds.
  std::map<std::string, int> across;
  bool one_each = true;
  for (int q : r.gather_targets) {
    if (host(q) == my_host) continue;
    one_each &= across.emplace(host(q), q).second;
  }
  const size_t hosts = by_host.size();
  if (stagger && hosts > 2 && one_each && across.size() == hosts - 1) {
    std::vector<std::string> names;
    for (auto& [h, ps] : by_host) names.push_back(h);
    const size_t me = size_t(std::find(names.begin(), names.end(), my_host) - names.begin());
    for (size_t k = 1; k < hosts; ++k) {
      r.stagger_to.push_back(across[names[(me + k) % hosts]]);
      r.stagger_from.push_back(across[names[(me + hosts - k) % hosts]]);
    }
  }
  return r;
}

}  // namespace smddp

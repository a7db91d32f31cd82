#include "xla_ffi/transports/striped_link.h"

#include <algorithm>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

namespace smddp {

void StripeOf(size_t bytes, int links, int k, size_t* offset, size_t* length) {
  const size_t n = size_t(links);
  size_t part = (bytes / n + 63) & ~size_t(63);
  *offset = std::min(bytes, part * size_t(k));
  *length = k + 1 == links ? bytes - *offset : std::min(part, bytes - *offset);
}

int LinkOfTag(uint64_t tag, int links) {
  // The tags are hashes already (MixTag); fold the high bits in too.
  return int((tag ^ (tag >> 32)) % uint64_t(links));
}

namespace {

class Striped : public Link {
 public:
  Striped(std::vector<std::unique_ptr<Link>> links, size_t stripe_bytes)
      : links_(std::move(links)), stripe_bytes_(std::max<size_t>(stripe_bytes, 64)) {
    for (auto& l : links_) {
      bool seen = false;
      for (const void* key : keys_) seen = seen || key == l->ProgressKey();
      if (!seen) {
        keys_.push_back(l->ProgressKey());
        progress_.push_back(l.get());
      }
    }
  }

  ~Striped() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [req, t] : pending_) Withdraw(t);
  }

  void Send(uint64_t tag, const void* src, size_t bytes, Request* req) override {
    Post(tag, const_cast<void*>(src), bytes, req, false);
  }
  void Recv(uint64_t tag, void* dst, size_t bytes, Request* req) override {
    Post(tag, dst, bytes, req, true);
  }

  // Each stripe announced on its own link; a stripe whose link has nothing
  // to start is sent whole by SendAnnounced.
  bool Announce(uint64_t tag, size_t bytes, Request* req) override {
    Transfer t = Split(tag, bytes);
    const int stripes = int(t.link.size());
    t.tag = tag;
    t.bytes = bytes;
    bool any = false;
    for (int k = 0; k < stripes; ++k) {
      size_t off, len;
      StripeOf(bytes, stripes, k, &off, &len);
      // Not yet registered: a sub-request a link completes at once (a failed
      // peer) is seen by Settle once the transfer is.
      t.announced.push_back(links_[t.link[k]]->Announce(tag, len, &t.subs[k]));
      any = any || t.announced.back();
    }
    if (!any) return false;
    std::lock_guard<std::mutex> lock(mu_);
    pending_[req] = std::move(t);
    return true;
  }

  void SendAnnounced(Request* req, const void* src) override {
    Request* subs = nullptr;
    std::vector<int> link;
    std::vector<bool> announced;
    uint64_t tag = 0;
    size_t bytes = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = pending_.find(req);
      if (it == pending_.end()) return;  // done already (failed, or cancelled)
      subs = it->second.subs.get();
      link = it->second.link;
      announced = it->second.announced;
      tag = it->second.tag;
      bytes = it->second.bytes;
    }
    const int stripes = int(link.size());
    for (int k = 0; k < stripes; ++k) {
      size_t off, len;
      StripeOf(bytes, stripes, k, &off, &len);
      const char* at = static_cast<const char*>(src) + off;
      if (announced[k]) {
        links_[link[k]]->SendAnnounced(&subs[k], at);
      } else {
        links_[link[k]]->Send(tag, at, len, &subs[k]);
      }
    }
  }

  void Progress() override {
    for (Link* l : progress_) l->Progress();
    Settle();
  }

  // Under the lock, as Settle's completions are: once this returns, no
  // thread completes `req`.
  void Cancel(Request* req) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(req);
    if (it == pending_.end()) return;
    Withdraw(it->second);
    pending_.erase(it);
  }

  std::string PeerFailure() override {
    for (auto& l : links_) {
      std::string why = l->PeerFailure();
      if (!why.empty()) return why;
    }
    return "";
  }
  StatusCode PeerFailureCode() override {
    for (auto& l : links_)
      if (!l->PeerFailure().empty()) return l->PeerFailureCode();
    return StatusCode::kPeerFailed;
  }
  void WatchPeer(std::function<std::string()> failure) override {
    for (auto& l : links_) l->WatchPeer(failure);
  }
  std::string Kind() const override {
    return links_[0]->Kind() + " striped over " + std::to_string(links_.size()) + " NIC pairs";
  }

  uint32_t Activity() const override {
    uint32_t sum = 0;
    for (Link* l : progress_) sum += l->Activity();
    return sum;
  }
  // Sleeps on the link of a stripe not yet done: the oldest transfer cannot
  // complete before it, so waking for it alone loses nothing.
  void AwaitActivity(uint32_t seen, unsigned max_us) override {
    if (Activity() != seen) return;
    Link* wait_on = progress_[0];
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [req, t] : pending_) {
        for (size_t k = 0; k < t.link.size(); ++k) {
          if (t.subs[k].done()) continue;
          wait_on = links_[t.link[k]].get();
          break;
        }
        break;
      }
    }
    wait_on->AwaitActivity(wait_on->Activity(), max_us);
  }

  bool SleepsOnArrival() const override {
    for (auto& l : links_)
      if (!l->SleepsOnArrival()) return false;
    return true;
  }
  // AwaitActivity sleeps on one NIC's descriptor: the others' arrivals wait for its bound.
  bool SleepsOnEveryArrival() const override { return false; }

  uint64_t SingleCopyBytes() const override {
    uint64_t sum = 0;
    for (auto& l : links_) sum += l->SingleCopyBytes();
    return sum;
  }
  std::string SingleCopy() const override { return links_[0]->SingleCopy(); }

 private:
  struct Transfer {
    std::unique_ptr<Request[]> subs;  // fixed in place: the sub-links hold their addresses
    std::vector<int> link;            // the link of each stripe
    // An announced send's: which stripes their link announced, and the message.
    std::vector<bool> announced;
    uint64_t tag = 0;
    size_t bytes = 0;
  };

  // The stripes of a message of `bytes` under `tag`: how many, and their links.
  Transfer Split(uint64_t tag, size_t bytes) const {
    const int n = int(links_.size());
    const int stripes = bytes >= stripe_bytes_ ? n : 1;
    Transfer t;
    t.subs.reset(new Request[stripes]);
    for (int k = 0; k < stripes; ++k) t.link.push_back(stripes == 1 ? LinkOfTag(tag, n) : k);
    return t;
  }

  void Withdraw(Transfer& t) {
    for (size_t k = 0; k < t.link.size(); ++k) links_[t.link[k]]->Cancel(&t.subs[k]);
  }

  void Post(uint64_t tag, void* buf, size_t bytes, Request* req, bool recv) {
    Transfer t = Split(tag, bytes);
    const int stripes = int(t.link.size());
    Request* subs = t.subs.get();
    const std::vector<int> link = t.link;
    {
      // Registered before posting, so that Settle (another thread) finds it.
      std::lock_guard<std::mutex> lock(mu_);
      pending_[req] = std::move(t);
    }
    for (int k = 0; k < stripes; ++k) {
      size_t off = 0, len = bytes;
      if (stripes > 1) StripeOf(bytes, stripes, k, &off, &len);
      char* at = static_cast<char*>(buf) + off;
      if (recv) {
        links_[link[k]]->Recv(tag, at, len, &subs[k]);
      } else {
        links_[link[k]]->Send(tag, at, len, &subs[k]);
      }
    }
  }

  // Completes the requests whose stripes are all done; a failed stripe fails
  // its request once the others are withdrawn. All under the lock (Cancel).
  void Settle() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = pending_.begin(); it != pending_.end();) {
      Transfer& t = it->second;
      bool all = true;
      Status failed = Status::Ok();
      for (size_t k = 0; k < t.link.size(); ++k) {
        if (!t.subs[k].done()) {
          all = false;
        } else if (!t.subs[k].status().ok() && failed.ok()) {
          failed = t.subs[k].status();
        }
      }
      if (!all && failed.ok()) {
        ++it;
        continue;
      }
      if (!all) Withdraw(t);
      Request* req = it->first;
      it = pending_.erase(it);
      req->Complete(std::move(failed));
    }
  }

  std::vector<std::unique_ptr<Link>> links_;
  size_t stripe_bytes_;
  std::vector<const void*> keys_;
  std::vector<Link*> progress_;  // one link per progress key
  std::mutex mu_;
  std::unordered_map<Request*, Transfer> pending_;
};

}  // namespace

std::unique_ptr<Link> StripedLink(std::vector<std::unique_ptr<Link>> links, size_t stripe_bytes) {
  if (links.size() == 1) return std::move(links[0]);
  return std::make_unique<Striped>(std::move(links), stripe_bytes);
}

}  // namespace smddp

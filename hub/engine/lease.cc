#include "hub/engine/lease.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <random>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "hub/engine/bucket.h"

namespace weightfs {

std::string HostName() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "unknown";
  return buf;
}

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

Lease::Lease(Store* store, std::string key, std::string what, std::chrono::seconds ttl)
    : store_(store), key_(std::move(key)), what_(std::move(what)), ttl_(ttl) {}

Status Lease::Write() {
  nlohmann::json j{{"host", HostName()},
                   {"pid", static_cast<int64_t>(::getpid())},
                   {"what", what_},
                   {"expires_ms", NowMs() + std::chrono::milliseconds(ttl_).count()}};
  std::string body = j.dump();
  return store_->Put(key_, {reinterpret_cast<const uint8_t*>(body.data()), body.size()});
}

Expected<std::unique_ptr<Lease>> Lease::Acquire(Store* store, std::string what,
                                                std::chrono::seconds ttl) {
  std::random_device rd;
  char id[40];
  std::snprintf(id, sizeof(id), "%08x%08x%08x", rd(), rd(), rd());
  std::unique_ptr<Lease> lease(
      new Lease(store, std::string(Bucket::kLeasePrefix) + id + ".json", std::move(what), ttl));
  WFS_TRY(lease->Write().WithContext("writing a push lease"));
  lease->heartbeat_ = std::thread([l = lease.get()] { l->Heartbeat(); });
  return lease;
}

void Lease::Heartbeat() {
  MutexLock lock(mu_);
  while (!cv_.WaitFor(mu_, ttl_ / 3, [&]() WFS_REQUIRES(mu_) { return stop_; })) {
    lock.Unlock();
    Status s;
    try {  // on a thread of its own: nothing may escape
      s = Write();
    } catch (...) {
      s = StatusOfCurrentException("writing it");
    }
    if (!s.ok()) spdlog::warn("renewing push lease {}: {}", key_, s.ToString());
    lock.Lock();
  }
}

Lease::~Lease() {
  {
    MutexLock lock(mu_);
    stop_ = true;
  }
  cv_.NotifyAll();
  if (heartbeat_.joinable()) heartbeat_.join();
  Status s = store_->Delete(key_);
  if (!s.ok() && s.kind() != ErrorKind::kNotFound) {
    spdlog::warn("removing push lease {}: {}", key_, s.ToString());
  }
}

Expected<std::vector<LeaseInfo>> ListLeases(Store& store) {
  WFS_ASSIGN_OR_RETURN(std::vector<ObjectInfo> objects, ListAll(store, Bucket::kLeasePrefix));
  const std::string host = HostName();
  const int64_t now = NowMs();
  std::vector<LeaseInfo> out;
  for (const ObjectInfo& o : objects) {
    Expected<std::vector<uint8_t>> bytes = store.Get(o.key);
    if (!bytes.ok()) continue;  // removed meanwhile
    LeaseInfo info;
    info.key = o.key;
    nlohmann::json j = nlohmann::json::parse(bytes->begin(), bytes->end(), nullptr, false);
    try {
      if (j.is_object()) {
        info.host = j.value("host", "");
        info.pid = j.value("pid", int64_t{0});
        info.what = j.value("what", "");
        info.expires_ms = j.value("expires_ms", int64_t{0});
      }
    } catch (const nlohmann::json::exception&) {
      // A malformed lease protects nothing: treated as expired.
    }
    info.alive = info.expires_ms > now;
    if (info.alive && info.host == host && info.pid > 0) {
      info.alive = ::kill(static_cast<pid_t>(info.pid), 0) == 0 || errno == EPERM;
    }
    out.push_back(std::move(info));
  }
  return out;
}

}  // namespace weightfs

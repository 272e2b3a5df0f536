// Lease: a small object under leases/ that says "a push is writing packs to this bucket".
// `gc` never deletes unreferenced packs while a live lease exists, since they may belong to a
// version about to be published.
//
// A lease names its host and pid and an expiry; the holder renews it (heartbeat) while it
// lives. It is dead when expired, or — on the same host — when its process is gone, so a
// killed push stops protecting its orphans at once on that host and after the expiry elsewhere.
//
// Lease is thread-compatible; ListLeases is thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/mutex.h"
#include "core/status.h"
#include "hub/store/store.h"

namespace weightfs {

struct LeaseInfo {
  std::string key;
  std::string host;
  int64_t pid = 0;
  std::string what;        // "acme/qwen@v3"
  int64_t expires_ms = 0;  // Unix milliseconds
  bool alive = false;      // as judged by ListLeases
};

class Lease {
 public:
  // Writes the lease and starts renewing it every ttl/3.
  static Expected<std::unique_ptr<Lease>> Acquire(Store* store, std::string what,
                                                  std::chrono::seconds ttl = std::chrono::minutes(10));
  ~Lease();  // stops renewing and deletes the lease (best effort)

 private:
  Lease(Store* store, std::string key, std::string body_what, std::chrono::seconds ttl);
  Status Write();
  void Heartbeat() WFS_EXCLUDES(mu_);

  Store* store_;
  std::string key_;
  std::string what_;
  std::chrono::seconds ttl_;
  Mutex mu_;
  CondVar cv_;
  bool stop_ WFS_GUARDED_BY(mu_) = false;
  std::thread heartbeat_;
};

Expected<std::vector<LeaseInfo>> ListLeases(Store& store);
std::string HostName();
int64_t NowMs();

}  // namespace weightfs

// Metrics of a mount for monitoring: the counters of user.weightfs.stats (fs/fuse_server.h) in
// the Prometheus text format, and a file the daemon keeps them in (`weightfs mount --metrics
// FILE`, for node_exporter's textfile collector or any scraper that reads files).
//
// What they say: bytes fetched from the bucket vs bytes materialized (decoded) from them, the
// cache hit ratio (memory and disk), delta-chain depth (mean and max), time spent building and
// decoding chunks, and queue depths (builds running, readahead waiting, drafts' encodes queued).
// Every series carries a mountpoint label, so several mounts' files can sit side by side.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <functional>
#include <string>
#include <thread>

#include "core/mutex.h"
#include "core/status.h"
#include "core/thread_annotations.h"

namespace weightfs {

// The Prometheus text exposition (# HELP, # TYPE, one sample per metric) of `stats_json` (the
// object user.weightfs.stats holds), first `weightfs_up` (1 while the mount serves; 0 in the
// file's last write at unmount, so a stale file says so). Metrics whose field is missing are
// left out.
std::string PrometheusText(const std::string& stats_json, const std::string& mountpoint, bool up = true);

// Writes `text()` to `path` now, then every `interval`, and once more when destroyed (the final
// numbers). Each write replaces the file atomically (a temporary beside it, then rename), so a
// reader never sees half of one. A failed write is logged (once per distinct error) and retried
// at the next interval. Thread-safe; `text` runs on the writer's thread.
class MetricsFile {
 public:
  // `text(final)`: final is true for the write at destruction.
  MetricsFile(std::string path, std::chrono::milliseconds interval, std::function<std::string(bool final)> text);
  ~MetricsFile();
  MetricsFile(const MetricsFile&) = delete;
  MetricsFile& operator=(const MetricsFile&) = delete;

 private:
  void WriteOnce(bool final);

  const std::string path_;
  const std::chrono::milliseconds interval_;
  const std::function<std::string(bool)> text_;
  std::string last_error_;  // only the writer thread (and the destructor, after joining) use it
  Mutex mu_;
  CondVar stop_cv_;
  bool stop_ WFS_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// Serves `text()` over HTTP for Prometheus to scrape (`weightfs mount --metrics-port`): GET of
// /metrics (or /) answers 200 with the text exposition, anything else 404 or 405. One thread,
// one request at a time, each connection given 5 s; the listening socket is made at Start, so
// a port in use is an error there. Stops (and closes the port) when destroyed.
class MetricsServer {
 public:
  // `address`: an IPv4 address to listen on ("127.0.0.1", "0.0.0.0"); `port` 0 picks one.
  static Expected<std::unique_ptr<MetricsServer>> Start(const std::string& address, uint16_t port,
                                                        std::function<std::string()> text);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;
  uint16_t port() const { return port_; }

 private:
  MetricsServer(int listen_fd, int wake_fd, uint16_t port, std::function<std::string()> text);
  void Serve();
  void Answer(int fd);

  const int listen_fd_;
  const int wake_fd_;  // an eventfd: written to stop the thread
  const uint16_t port_;
  const std::function<std::string()> text_;
  std::thread thread_;
};

}  // namespace weightfs

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
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace weightfs {

// The Prometheus text exposition (# HELP, # TYPE, one sample per metric) of `stats_json` (the
// object user.weightfs.stats holds). Metrics whose field is missing are left out.
std::string PrometheusText(const std::string& stats_json, const std::string& mountpoint);

// Writes `text()` to `path` now, then every `interval`, and once more when destroyed (the final
// numbers). Each write replaces the file atomically (a temporary beside it, then rename), so a
// reader never sees half of one. A failed write is logged (once per distinct error) and retried
// at the next interval. Thread-safe; `text` runs on the writer's thread.
class MetricsFile {
 public:
  MetricsFile(std::string path, std::chrono::milliseconds interval, std::function<std::string()> text);
  ~MetricsFile();
  MetricsFile(const MetricsFile&) = delete;
  MetricsFile& operator=(const MetricsFile&) = delete;

 private:
  void WriteOnce();

  const std::string path_;
  const std::chrono::milliseconds interval_;
  const std::function<std::string()> text_;
  std::string last_error_;  // only the writer thread (and the destructor, after joining) use it
  std::mutex mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;  // GUARDED_BY(mu_)
  std::thread thread_;
};

}  // namespace weightfs

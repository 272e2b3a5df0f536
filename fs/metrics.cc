#include "fs/metrics.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "hub/store/local_file.h"

namespace weightfs {
namespace {

struct Metric {
  const char* name;
  const char* pointer;  // into the stats JSON
  const char* type;     // counter or gauge
  const char* help;
};

// In the order a reader wants them: traffic, caches, chains and time, queues, memory.
constexpr Metric kMetrics[] = {
    {"weightfs_reads_total", "/reader/reads", "counter", "Read requests served."},
    {"weightfs_read_bytes_total", "/reader/read_bytes", "counter", "Bytes returned to readers."},
    {"weightfs_read_failures_total", "/reader/failures", "counter", "Chunk reads that failed (EIO and the like)."},
    {"weightfs_fetched_bytes_total", "/materializer/payload_bytes", "counter",
     "Payload bytes fetched from the bucket to build chunks."},
    {"weightfs_materialized_bytes_total", "/materializer/built_bytes", "counter",
     "Chunk bytes built (decoded) from fetched payloads."},
    {"weightfs_bucket_requests_total", "/bucket/requests", "counter", "Requests made to the bucket."},
    {"weightfs_bucket_received_bytes_total", "/bucket/bytes_received", "counter",
     "Bytes received from the bucket (payloads and metadata)."},
    {"weightfs_shared_cache_hits_total", "/shared_cache/hits", "counter", "Reads served by the shared cache tier."},
    {"weightfs_shared_cache_misses_total", "/shared_cache/misses", "counter",
     "Reads the shared cache tier did not have (filled by this node or waited for)."},
    {"weightfs_shared_cache_fills_total", "/shared_cache/fills", "counter",
     "Objects this node fetched from the bucket and put into the shared cache tier."},
    {"weightfs_shared_cache_waits_total", "/shared_cache/waits", "counter", "Misses that waited for another node's fill."},
    {"weightfs_shared_cache_corrupt_total", "/shared_cache/corrupt", "counter",
     "Shared cache objects that failed their checks (read from the bucket instead)."},
    {"weightfs_shared_cache_errors_total", "/shared_cache/errors", "counter",
     "Shared cache requests that failed (read from the bucket instead)."},
    {"weightfs_shared_cache_received_bytes_total", "/shared_cache/bytes_received", "counter",
     "Bytes read from the shared cache tier."},
    {"weightfs_shared_cache_filled_bytes_total", "/shared_cache/bytes_filled", "counter",
     "Bytes this node put into the shared cache tier."},
    {"weightfs_chunk_lookups_total", "/rates/chunk_lookups", "counter", "Chunks asked of the caches."},
    {"weightfs_memory_hits_total", "/reader/memory_hits", "counter", "Chunks served from memory."},
    {"weightfs_disk_cache_hits_total", "/materializer/cache_hits", "counter", "Chunks served from the disk cache."},
    {"weightfs_cache_hit_ratio", "/rates/cache_hit_ratio", "gauge",
     "Chunks served from memory or the disk cache, of all chunks asked (since mount)."},
    {"weightfs_chunk_builds_total", "/materializer/builds", "counter", "Chunks built from payloads."},
    {"weightfs_chain_steps_total", "/materializer/chain_steps", "counter",
     "Payloads applied by chunk builds (their delta-chain depths summed)."},
    {"weightfs_chain_depth_mean", "/rates/mean_chain_depth", "gauge", "Payloads applied per chunk build (since mount)."},
    {"weightfs_chain_depth_max", "/materializer/chain_depth_max", "gauge", "Most payloads one chunk build applied."},
    {"weightfs_build_seconds_total", "/materializer/build_seconds", "counter",
     "Time chunk builds took, fetching included."},
    {"weightfs_decode_seconds_total", "/materializer/decode_seconds", "counter",
     "Time chunk builds spent decoding (not waiting for fetches)."},
    {"weightfs_rewritten_head_rebuilds_total", "/materializer/rewritten_heads", "counter",
     "Chunks built again after a head of their chain was found rewritten in the bucket (gc's rebase)."},
    {"weightfs_builds_running", "/reader/builds_running", "gauge", "Chunk builds running now."},
    {"weightfs_readahead_queue", "/reader/readahead_waiting", "gauge", "Readahead jobs waiting to start."},
    {"weightfs_readahead_dropped_total", "/reader/readahead_dropped", "counter",
     "Readahead jobs dropped because the queue was full."},
    {"weightfs_encode_queue", "/drafts/queued_encodes", "gauge", "Draft files whose encoding waits to start."},
    {"weightfs_drafts_open", "/drafts/open", "gauge", "Drafts not yet published."},
    {"weightfs_draft_pending_files", "/drafts/pending_files", "gauge", "Files written into drafts and not yet encoded."},
    {"weightfs_draft_pending_bytes", "/drafts/bytes_to_go", "gauge", "Bytes of draft files not yet encoded."},
    {"weightfs_draft_encoded_files_total", "/drafts/files_encoded", "counter", "Draft files encoded into packs."},
    {"weightfs_draft_encoded_bytes_total", "/drafts/bytes_encoded", "counter", "Bytes of the draft files encoded."},
    {"weightfs_uploaded_bytes_total", "/drafts/bytes_stored", "counter",
     "Bytes the encoded draft files took in packs, uploaded to the bucket."},
    {"weightfs_versions_published_total", "/drafts/versions_published", "counter", "Drafts published as versions."},
    {"weightfs_commit_failures_total", "/drafts/commit_failures", "counter",
     "Commits that failed (the draft is kept)."},
    {"weightfs_whole_files_written_total", "/whole_files/streamed", "counter",
     "Files read whole in order kept as local copies (from the kernel's pages, or written as they were read)."},
    {"weightfs_whole_files_rebuilt_chunks_total", "/whole_files/rebuilt", "counter",
     "Chunks of local copies built again: the kernel had dropped their pages before the copy (memory pressure)."},
    {"weightfs_whole_files_copied_total", "/whole_files/copied", "counter",
     "Files read whole kept as local copies, copied after they were read."},
    {"weightfs_whole_files_failed_total", "/whole_files/failed", "counter", "Local copies of files that failed."},
    {"weightfs_passthrough_opens_total", "/passthrough/opens", "counter",
     "Opens the kernel serves from a local copy (FUSE passthrough)."},
    {"weightfs_memory_cache_bytes", "/reader/cached_bytes", "gauge", "Chunk bytes kept in memory."},
    {"weightfs_disk_cache_bytes", "/disk_cache/size_bytes", "gauge", "Bytes in the disk chunk cache."},
    {"weightfs_disk_cache_max_bytes", "/disk_cache/max_bytes", "gauge", "Bound of the disk chunk cache."},
    {"weightfs_rss_bytes", "/rss_bytes", "gauge", "Resident memory of the daemon."},
    {"weightfs_memory_limit_bytes", "/memory_limit", "gauge", "The daemon's memory budget (--memory-limit)."},
};

// A label value: backslash, double quote and newline escaped.
std::string LabelValue(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\\' || c == '"') out.push_back('\\');
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out.push_back(c);
  }
  return out;
}

}  // namespace

std::string PrometheusText(const std::string& stats_json, const std::string& mountpoint, bool up) {
  const nlohmann::json stats = nlohmann::json::parse(stats_json, nullptr, /*allow_exceptions=*/false);
  if (!stats.is_object()) return "";
  const std::string labels = "{mountpoint=\"" + LabelValue(mountpoint) + "\"}";
  std::string out = "# HELP weightfs_up 1 while the mount serves; 0 in the metrics file it left at unmount.\n"
                    "# TYPE weightfs_up gauge\nweightfs_up" + labels + (up ? " 1\n" : " 0\n");
  for (const Metric& m : kMetrics) {
    const nlohmann::json::json_pointer at(m.pointer);
    if (!stats.contains(at) || !stats[at].is_number()) continue;
    const nlohmann::json& v = stats[at];
    char value[64];
    if (v.is_number_float()) {
      std::snprintf(value, sizeof value, "%.9g", v.get<double>());
    } else {
      std::snprintf(value, sizeof value, "%llu", static_cast<unsigned long long>(v.get<uint64_t>()));
    }
    out += std::string("# HELP ") + m.name + " " + m.help + "\n# TYPE " + m.name + " " + m.type + "\n" + m.name +
           labels + " " + value + "\n";
  }
  return out;
}

MetricsFile::MetricsFile(std::string path, std::chrono::milliseconds interval, std::function<std::string(bool)> text)
    : path_(std::move(path)), interval_(interval), text_(std::move(text)) {
  thread_ = std::thread([this] {
    MutexLock lock(mu_);
    while (!stop_) {
      lock.Unlock();
      WriteOnce(false);
      lock.Lock();
      stop_cv_.WaitFor(mu_, interval_, [this]() WFS_REQUIRES(mu_) { return stop_; });
    }
  });
}

MetricsFile::~MetricsFile() {
  {
    MutexLock lock(mu_);
    stop_ = true;
  }
  stop_cv_.NotifyAll();
  thread_.join();
  WriteOnce(true);
}

void MetricsFile::WriteOnce(bool final) {
  std::string error;
  try {
    const std::string text = text_(final);
    // Readable by a node exporter's textfile collector; rewritten every interval, so not synced.
    if (Status st = WriteAtomically(path_, text, AtomicWrite{.mode = 0644, .durable = false}); !st.ok()) {
      error = st.message();
    }
  } catch (const std::exception& e) {
    error = std::string("metrics: ") + e.what();
  }
  if (!error.empty() && error != last_error_) spdlog::warn("metrics file: {} (retried every interval)", error);
  last_error_ = error;
}

Expected<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& address, uint16_t port,
                                                               std::function<std::string()> text) {
  const std::string where = address + ":" + std::to_string(port);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  if (::inet_pton(AF_INET, address.c_str(), &sa.sin_addr) != 1) {
    return Status::InvalidArgument("--metrics-port: '" + address + "' is not an IPv4 address (such as 127.0.0.1 or 0.0.0.0)");
  }
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return StatusOfErrno(errno, "metrics endpoint: socket");
  const int one = 1;
  (void)::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof sa) != 0 || ::listen(fd, 16) != 0) {
    const int err = errno;
    ::close(fd);
    return StatusOfErrno(err, "metrics endpoint: cannot listen on " + where +
                                  (err == EADDRINUSE ? " (in use: give another --metrics-port)" : ""));
  }
  socklen_t len = sizeof sa;
  (void)::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  const int wake = ::eventfd(0, EFD_CLOEXEC);
  if (wake < 0) {
    const int err = errno;
    ::close(fd);
    return StatusOfErrno(err, "metrics endpoint: eventfd");
  }
  return std::unique_ptr<MetricsServer>(new MetricsServer(fd, wake, ntohs(sa.sin_port), std::move(text)));
}

MetricsServer::MetricsServer(int listen_fd, int wake_fd, uint16_t port, std::function<std::string()> text)
    : listen_fd_(listen_fd), wake_fd_(wake_fd), port_(port), text_(std::move(text)) {
  thread_ = std::thread([this] { Serve(); });
}

MetricsServer::~MetricsServer() {
  const uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof one);
  thread_.join();
  ::close(listen_fd_);
  ::close(wake_fd_);
}

void MetricsServer::Serve() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("metrics endpoint: poll: {}; no more scrapes are answered", std::strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    try {
      Answer(fd);
    } catch (const std::exception& e) {
      spdlog::warn("metrics endpoint: {}", e.what());
    }
    ::close(fd);
  }
}

void MetricsServer::Answer(int fd) {
  const timeval timeout{5, 0};
  (void)::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  (void)::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
  std::string request;
  char buf[2048];
  while (request.find("\r\n\r\n") == std::string::npos && request.size() < 16384) {
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // closed, or silent for 5 s
    request.append(buf, static_cast<size_t>(n));
  }
  const size_t line_end = request.find("\r\n");
  const std::string line = request.substr(0, line_end);
  // "GET /metrics HTTP/1.1"
  const size_t sp1 = line.find(' '), sp2 = line.find(' ', sp1 == std::string::npos ? 0 : sp1 + 1);
  const std::string method = line.substr(0, sp1);
  std::string path = sp1 == std::string::npos ? "" : line.substr(sp1 + 1, sp2 == std::string::npos ? std::string::npos : sp2 - sp1 - 1);
  if (const size_t q = path.find('?'); q != std::string::npos) path.resize(q);
  std::string status = "200 OK", type = "text/plain; version=0.0.4; charset=utf-8", body;
  if (method != "GET" && method != "HEAD") {
    status = "405 Method Not Allowed";
    type = "text/plain";
    body = "GET /metrics\n";
  } else if (path != "/metrics" && path != "/") {
    status = "404 Not Found";
    type = "text/plain";
    body = "the metrics are at /metrics\n";
  } else {
    body = text_();
  }
  std::string reply = "HTTP/1.1 " + status + "\r\nContent-Type: " + type + "\r\nContent-Length: " +
                      std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n";
  if (method != "HEAD") reply += body;
  for (size_t done = 0; done < reply.size();) {
    const ssize_t n = ::send(fd, reply.data() + done, reply.size() - done, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

}  // namespace weightfs

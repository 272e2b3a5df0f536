// weightfs mount / unmount: serve a bucket's published versions as a FUSE file system.
//
// `mount` checks everything it can before it forks (the mount point, /dev/fuse, the bucket,
// the cache directory, the log file), so that those errors reach the user directly. It then
// forks a daemon (setsid, stdio on /dev/null - stderr stays when it is systemd's journal -,
// working directory /) that re-opens the bucket, mounts and reports over a pipe; the parent
// returns only once the mount answers a stat(), or prints the daemon's error. A mount point left behind by a daemon that was killed (ENOTCONN)
// is detached first, with a log line.
//
// `unmount` asks the daemon for its pid (the root's user.weightfs.pid attribute), unmounts
// (umount2 as root, fusermount3 -u otherwise) and waits, bounded, until the daemon has exited.
// Unmounting a mount with open files fails with "busy" unless --lazy; a lazily detached mount
// keeps serving the files that are open and the daemon exits when the last one is closed.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "core/chunk_plan.h"
#include "core/hash.h"
#include "hub/engine/bucket.h"
#include "hub/engine/chunk_cache.h"
#include "hub/engine/materializer.h"
#include "fs/fuse_server.h"
#include "fs/metrics.h"
#include "fs/mount_point.h"
#include "hub/open_bucket.h"
#include "hub/open_store.h"
#include "hub/store/http_client.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "tools/logging.h"
#include "tools/service_notify.h"
#include "tools/store_args.h"

namespace weightfs::cli {
namespace {

constexpr const char* kMountHelp = R"(usage: weightfs mount BUCKET MOUNTPOINT [options]

Shows every published version of every model in BUCKET as a read-only directory:
  MOUNTPOINT/acme/qwen@v1/...        the files of version v1 of model acme/qwen
  MOUNTPOINT/acme/qwen@latest        a symbolic link to the newest version
A file is materialized lazily, chunk by chunk, where it is read: from memory, else from the
local chunk cache, else from the nearest cached ancestor plus the deltas after it. Versions
published elsewhere appear in listings and @latest within --refresh seconds, and at once when
looked up by name (`stat MNT/acme/qwen@v7` checks the bucket for v7 if it is not listed yet;
`weightfs wait` waits for one that way). Runs as a daemon unless --foreground;
returns once the mount answers. `weightfs unmount MOUNTPOINT` (or fusermount3 -u) unmounts.
/etc/fstab lines (type fuse.weightfs) and systemd units: docs/operations.md.

BUCKET: a directory, http(s)://host/prefix (WebDAV), s3://bucket/prefix, or a Hugging Face
Storage Bucket hf://buckets/NAMESPACE/NAME[/prefix] (see `weightfs push --help` for
credentials). hf://ORG/REPO[@REVISION] mounts a model repo on the Hub read-only as
ORG/REPO@REVISION, fetching only the byte ranges readers touch (files already in the local
Hugging Face cache, HF_HUB_CACHE, are read from there). Versions whose base is a Hub repo
(`weightfs push --base hf://...`) read the base's bytes the same way.

A TRL delta-sync bucket (anchors/step_NNNNNN.safetensors and deltas/step_NNNNNN.safetensors
as TRL's async GRPO weight sync writes them; no weightfs.json) is shown read-only: every step
as MODEL@step-N (MODEL: the bucket's last path component) holding one model.safetensors, the
newest anchor patched by the deltas after it, read lazily by ranges. `weightfs import` turns
such a bucket into weightfs versions.

Writing new versions (drafts):
  mkdir MOUNTPOINT/acme/qwen@v2      a draft; its parent is acme/qwen's latest version (set
                                     another with `weightfs set-parent DRAFT V1` before writing
                                     into it); it lists the parent's files
  cp ... MOUNTPOINT/acme/qwen@v2/    files written there are staged in the cache directory;
                                     each is delta-encoded and uploaded when it is closed
  weightfs commit MOUNTPOINT/acme/qwen@v2    publishes it (unmount publishes every draft)
  weightfs status MOUNTPOINT                 drafts, uploads to go, errors
Drafts survive a crash of the daemon: the next mount with the same cache directory resumes
them. One mount per bucket and cache directory owns the drafts (another one warns that its
drafts are off as it mounts). Mounting over a non-empty directory warns: its contents are
hidden while the mount is up.

Sparse weight patches (read-only; docs/patch.md):
  MOUNTPOINT/acme/qwen@v3/.patch/v1/model.safetensors   the patch v1 -> v3 (NAME.idx/NAME.val),
                                     made on first use into CACHE_DIR/patches (up to a quarter
                                     of --cache-size, LRU); .patch is hidden from ls of v3

Extended attributes: user.weightfs.{parent,stored_bytes,changed_fraction,newest} on version
directories, user.weightfs.{parent,sha256,stored_bytes} on files; user.weightfs.error on a
draft (its last commit's failure); on MOUNTPOINT itself user.weightfs.pid,
user.weightfs.stats (JSON counters), user.weightfs.status (JSON: the drafts, their state and
errors, as `weightfs status` prints them) and user.weightfs.staged (versions staged in parts).

options:
  -f, --foreground     stay in the foreground, log to stderr; tells systemd when the
                       mount is up (Type=notify services: packaging/systemd/)
  --cache-dir DIR      local chunk cache, shared with push/pull and other mounts
                       [$WEIGHTFS_CACHE_DIR or ~/.cache/weightfs]
  --cache-size BYTES   bound on the chunk cache (LRU eviction)               [20GiB]
  --no-whole-files     keep no whole copies of files. By default a published file
                       read whole is copied into the cache in place of its chunks,
                       and the kernel serves later opens of it from that copy (FUSE
                       passthrough: as root, on Linux 6.9+), so that re-reads and
                       maps of it run as on a local disk (docs/mount.md)
  --memory-limit BYTES the daemon's memory budget (at least 128MiB): 64MiB  [1GiB]
                       for itself, 16MiB per chunk build in flight (a quarter of
                       the rest; readers beyond wait), the rest for chunks kept
                       in memory
  --refresh SECONDS    re-list the bucket at most this often                  [10]
  --prefix MODEL       show only the models under MODEL (an organisation such as
                       acme, or a model such as acme/qwen): the mount lists only
                       models/MODEL/ and makes drafts only there; paths stay the
                       bucket's (MNT/acme/qwen@v3), the same on every node
  --probe-rate N       bucket checks a second, at most, for version names not   [20]
                       listed yet (a lookup of NAME@VERSION, `weightfs wait`);
                       0: new versions appear only with the --refresh listing
  --chunk-size BYTES   chunk size of the versions drafts publish (as push's)  [4MiB]
  --threads N          FUSE worker threads                                    [16]
  --read-only          mount read-only: no drafts (published versions always are)
  --allow-invalid      publish a draft's file that claims to be safetensors (by
                       name or header) and does not parse (truncated, a header
                       that lies) as opaque bytes; such a draft is refused at
                       commit otherwise, the message naming the file
  --allow-other        let other users read the mount (non-root users need
                       user_allow_other in /etc/fuse.conf)
  --uid N, --gid N     owner and group of published files and directories  [yours]
  --file-mode OCTAL    permission bits of published files                    [0444]
  --dir-mode OCTAL     of directories (those above versions also get the owner's
                       write bit, for mkdir of drafts)                       [0555]
                       The kernel checks them (default_permissions): with
                       --allow-other, --gid 1001 --file-mode 0440 --dir-mode 0550
                       lets only group 1001 read the weights
  -o OPTS              more FUSE mount options, comma-separated
  --metrics FILE       keep the mount's metrics in FILE in Prometheus text format
                       (bytes fetched vs materialized, cache hit ratio, chain depth,
                       decode time, queue depths; name it *.prom for node_exporter's
                       textfile collector); `weightfs status MNT --json` shows the same
  --metrics-interval SECONDS  how often FILE is rewritten                     [10]
                       (its last write, at unmount, says weightfs_up 0)
  --metrics-port [ADDRESS:]PORT  serve the same metrics over HTTP for Prometheus
                       to scrape: http://ADDRESS:PORT/metrics, while the mount
                       serves (weightfs_up 1); ADDRESS 127.0.0.1 unless given
                       (0.0.0.0: every interface)
  --log-file FILE      log here (appended). Default: stderr in the foreground; the
                       journal when run by systemd; else CACHE_DIR/logs/MOUNT.log
                       (MOUNT: the mount point's path with '-' for '/'; rotated at
                       16MiB, 3 kept). `--log-file syslog`: syslog, if it runs here
  --log-level LEVEL    error, warn, info, debug                               [info]
  --log-format FORMAT  text, or json: one object a line, {"time", "level", "pid",
                       "msg"}, for log collectors (gcsfuse's --log-format)   [text]
  --shared-cache URL   read the bucket's packs, tables and heads through a store every
                       node of the cluster reaches (s3://, http(s):// WebDAV, or a
                       directory on NFS/Lustre): the first node to need an object
                       fetches it from the bucket and puts it there, the others read
                       it from there, so K nodes following a run cost the bucket one
                       node's bytes. Everything read from it is checked; a tier that
                       is down or damaged costs speed, never a wrong byte or an error.
                       `weightfs status --json` counts it under shared_cache and the
                       bucket (origin) under bucket (docs/shared-cache.md)
  --shared-cache-size BYTES  keep the tier under this (objects filled longest ago
                       are removed); default: unbounded, for the store's own
                       lifecycle rules to bound
  --shared-cache-endpoint URL  S3 endpoint of an s3:// tier          [--endpoint]
  --endpoint URL       S3 endpoint (MinIO, Ceph, R2, the Hub's S3 gateway...)
  --region NAME        S3 region                                        [us-east-1]
  --no-sign-request    S3: send requests unsigned (a bucket open to anyone);
                       without it, finding no AWS credentials is an error
  --timeout SECONDS    give up on a bucket request (retries included) after this long; the
                       read that needed it then fails with EIO. Waits the Hugging Face
                       Hub asks for (429, up to its 5-minute window) are not counted  [120]
  --metadata-timeout SECONDS  what `ls`, `stat`, a lookup or an xattr may wait for the
                       bucket in all, retries included; then EIO and a log line. A bucket
                       that stops answering is marked so: each request then tries once,
                       until it answers again (0: only --timeout)              [10]
  -h, --help           show this help
)";

constexpr const char* kUnmountHelp = R"(usage: weightfs unmount MOUNTPOINT [--lazy] [--keep-drafts] [--timeout SECONDS]

Publishes the mount's drafts (showing progress), unmounts it and waits until its daemon has
exited. If a draft cannot be published the mount stays and the reason is printed: fix it and
run unmount again, or unmount with --keep-drafts (the drafts stay staged in the cache directory
and the next mount resumes them). While files on the mount are
open the unmount fails ("busy") unless --lazy: the mount then disappears from the tree at once,
the files that are open keep working, and the daemon exits when the last of them is closed.
A mount point whose daemon was killed ("Transport endpoint is not connected") is cleaned up.

options:
  --lazy               detach now even if files are open; do not wait for the daemon
                       (it publishes the drafts when the last file is closed)
  --keep-drafts        do not publish the drafts; leave them for the next mount
  --timeout SECONDS    how long to wait for the daemon to exit                 [30]
  -h, --help           show this help
)";

// Everything the daemon needs, with paths made absolute (it runs in /).
struct MountConfig {
  std::string url;
  std::string mountpoint;
  std::string cache_dir;
  uint64_t cache_size = 20ull << 30;
  bool foreground = false;
  LogDestination log;
  StoreOptions store;
  MountOptions mount;
};

// A bucket URL that is a plain path becomes absolute.
std::string AbsoluteUrl(const std::string& url) {
  if (url.find("://") == std::string::npos) return AbsolutePath(url);
  if (url.starts_with("file://") && url.size() > 7 && url[7] != '/') return "file://" + AbsolutePath(url.substr(7));
  return url;
}

struct Opened {
  OpenedStore store;
  std::unique_ptr<Bucket> bucket;
  std::unique_ptr<ChunkCache> cache;
};

Expected<Opened> OpenAll(const MountConfig& c) {
  Opened o;
  // A weightfs bucket, a TRL delta-sync bucket or a Hugging Face model repo (both read-only).
  WFS_ASSIGN_OR_RETURN(OpenedBucket ob, OpenBucketUrl(c.url, c.store, /*any_layout=*/true));
  o.store = std::move(ob.store);
  o.bucket = std::move(ob.bucket);
  ChunkCacheOptions cache_options;
  cache_options.whole_reads_around_page_cache = true;  // the reader's pages are the kernel's (chunk_cache.h)
  WFS_ASSIGN_OR_RETURN(o.cache, ChunkCache::Open(c.cache_dir, c.cache_size, cache_options));
  return o;
}

// Materializer::Warm on one thread while this one reads the manifests of each model's newest
// versions (at most kPreloadVersions of each, in listing order), bounded in time: a bucket
// that answers slowly or holds many models only delays the mount by kPreloadBudget.
void Preload(Bucket* bucket, Materializer* materializer, uint64_t memory_limit) {
  constexpr size_t kPreloadVersions = 16;
  constexpr auto kPreloadBudget = std::chrono::milliseconds(500);
  const size_t builds = std::min<size_t>(2, ChunkReader::MaxBuilds(memory_limit));
  // Warming is optional: if it fails (an allocation, a thread refused), first reads pay for it.
  std::thread warm;
  try {
    warm = std::thread([materializer, builds]() noexcept {
      try {
        materializer->Warm(builds, kDefaultChunkBytes);
      } catch (...) {
        spdlog::warn("{}", StatusOfCurrentException("warming the decoders").ToString());
      }
    });
  } catch (const std::exception& e) {
    spdlog::warn("warming the decoders: {}", e.what());
  }
  const auto deadline = std::chrono::steady_clock::now() + kPreloadBudget;
  Expected<std::vector<VersionInfo>> versions = bucket->ListVersions();
  if (versions.ok()) {
    for (size_t end = versions->size(); end > 0 && std::chrono::steady_clock::now() < deadline;) {
      const std::string& model = (*versions)[end - 1].model;
      size_t begin = end;
      while (begin > 0 && (*versions)[begin - 1].model == model) --begin;
      std::vector<std::string> newest;
      for (size_t i = end; i > begin && newest.size() < kPreloadVersions; --i) {
        newest.push_back((*versions)[i - 1].version);
      }
      bucket->PrefetchManifests(model, newest);
      end = begin;
    }
  }
  if (warm.joinable()) warm.join();
}

// The daemon's (or --foreground's) life: open, mount, report on `notify_fd` (-1: none) and to
// systemd (if it started us and waits for READY=1), serve.
int Serve(const MountConfig& c, int notify_fd) {
  auto notify = [&](const std::string& line) {
    if (notify_fd < 0) return;
    std::string msg = line + "\n";
    (void)!::write(notify_fd, msg.data(), msg.size());
    ::close(notify_fd);
    notify_fd = -1;
  };
  if (Status s = InstallLog(c.log); !s.ok()) {
    notify("ERR " + s.message());
    return 1;
  }
  Expected<Opened> opened = OpenAll(c);
  if (!opened.ok()) {
    notify("ERR " + opened.status().ToString());
    return 1;
  }
  // A manifest's JSON may take a quarter of the limit (256 MiB at the default 1 GiB; a real
  // 500k-chunk manifest is ~74 MB): parsing one costs about twice what it holds, so a
  // decompression bomb or an absurd manifest fails its version with ENOMEM instead of taking
  // the daemon past its limit.
  opened->bucket->set_max_manifest_json_bytes(c.mount.reader.memory_limit / 4);
  opened->bucket->set_metadata_budget(ChunkReader::MetadataBudget(c.mount.reader.memory_limit));
  Materializer materializer(opened->bucket.get(), opened->cache.get());
  // Chunks the mount builds reach the disk cache behind the reply, not before it: a reader
  // following a run (holding N, reading N+1) waited for an O_DIRECT write per chunk, a third of
  // its time (scripts/bench_step.sh row 3). Four chunks at most wait; the write-behind queue
  // mostly holds buffers the memory cache holds anyway, and is written out at unmount.
  if (opened->cache) opened->cache->set_write_behind(4 * kDefaultChunkBytes);
  ServerParts parts{opened->bucket.get(), &materializer, opened->cache.get(), opened->store.store.get(),
                    opened->store.shared.get()};
  MountOptions mount_options = c.mount;
  if (opened->bucket->derived()) {
    // Versions derived from another layout (TRL) cannot take new versions: no drafts, so mkdir
    // gets EROFS with a log line saying why (the mount itself stays rw so that it reaches us).
    mount_options.drafts.state_dir.clear();
    spdlog::info("{} is a TRL delta-sync bucket: its steps are read-only versions; `weightfs import` it "
                 "into a weightfs bucket to write new versions", opened->bucket->Describe());
  }
  // Before the mount answers: warm the decoders and read the newest manifests, so that a first
  // read pays for its own chunks only (measured on the 2-core VM: ~40 ms of codec set-up and
  // page faults, and ~2 ms per manifest of a 1B-parameter model that a chain walk would read
  // one after another). Both run while the mount is not up yet; `weightfs mount` returns that
  // much later.
  Preload(opened->bucket.get(), &materializer, mount_options.reader.memory_limit);
  FuseServer server(parts, mount_options);
  Status s = server.Mount();
  if (!s.ok()) {
    spdlog::error("{}", s.ToString());
    notify("ERR " + s.message());
    return 1;
  }
  spdlog::info("mounted {} at {} (pid {}; cache {} up to {}; memory limit {})", opened->bucket->Describe(),
               c.mountpoint, ::getpid(), c.cache_dir, FormatBytes(static_cast<double>(c.cache_size)),
               FormatBytes(static_cast<double>(c.mount.reader.memory_limit)));
  notify("OK");
  if (c.foreground) {
    NotifyServiceManager("READY=1\nSTATUS=mounted " + RedactUrl(c.url) + " at " + c.mountpoint);
  }
  s = server.Run();
  if (!s.ok()) {
    spdlog::error("{}", s.ToString());
    return 1;
  }
  spdlog::info("unmounted {}", c.mountpoint);
  if (c.foreground) NotifyServiceManager("STOPPING=1");
  return 0;
}

// stat() of the mount's root, through the daemon, with a bound.
bool MountAnswers(const std::string& mountpoint, std::chrono::seconds bound) {
  auto done = std::make_shared<std::promise<bool>>();
  std::future<bool> answered = done->get_future();
  std::thread([mountpoint, done] {
    struct stat st;
    done->set_value(::stat(mountpoint.c_str(), &st) == 0 && S_ISDIR(st.st_mode));
  }).detach();  // a hung stat cannot be cancelled; the process exits without it
  return answered.wait_for(bound) == std::future_status::ready && answered.get();
}

// Reads the daemon's one-line report; empty if it died first or `bound` passed.
std::string ReadReport(int fd, std::chrono::milliseconds bound) {
  std::string line;
  const auto deadline = std::chrono::steady_clock::now() + bound;
  while (line.find('\n') == std::string::npos) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    pollfd p{fd, POLLIN, 0};
    int r = ::poll(&p, 1, static_cast<int>(left.count()));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    char buf[512];
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    line.append(buf, static_cast<size_t>(n));
  }
  if (auto nl = line.find('\n'); nl != std::string::npos) line.resize(nl);
  return line;
}


// "3 entries: a, b, ..." when `dir` holds anything, else "".
std::string HiddenEntries(const std::string& dir) {
  std::error_code ec;
  size_t n = 0;
  std::string names;
  for (auto it = std::filesystem::directory_iterator(dir, ec); !ec && it != std::filesystem::directory_iterator();
       it.increment(ec)) {
    if (++n <= 3) names += (names.empty() ? "" : ", ") + it->path().filename().string();
  }
  if (n == 0) return "";
  return std::to_string(n) + (n == 1 ? " entry: " : " entries: ") + names + (n > 3 ? ", ..." : "");
}

// Drafts off on a mount that was meant to take them (another mount owns this bucket's drafts in
// this cache directory, or it cannot be created) is said now, not at the first mkdir's EROFS.
void WarnIfDraftsOff(const MountConfig& c) {
  if (c.mount.read_only) return;
  std::optional<nlohmann::json> st = MountStatus(c.mountpoint);
  if (!st || st->value("enabled", true) || !st->contains("disabled_reason")) return;
  std::fprintf(stderr, "weightfs: warning: drafts are off on %s (mkdir of a new version is refused): %s\n",
               c.mountpoint.c_str(), (*st)["disabled_reason"].get<std::string>().c_str());
}

Expected<MountConfig> ConfigFromArgs(const ArgParser& args) {
  MountConfig c;
  c.foreground = args.Has("--foreground") || args.Has("-f");
  c.url = AbsoluteUrl(args.positionals()[0]);
  c.mountpoint = AbsolutePath(args.positionals()[1]);
  c.cache_dir = AbsolutePath(args.GetOr("--cache-dir", DefaultCacheDir()));
  if (auto v = args.Get("--cache-size")) {
    WFS_ASSIGN_OR_RETURN(c.cache_size, ParseSize(*v));
  }
  WFS_ASSIGN_OR_RETURN(spdlog::level::level_enum level, ParseLogLevel(args.GetOr("--log-level", "info")));
  std::string log_file = args.GetOr("--log-file", "");
  if (!log_file.empty() && log_file != "syslog") log_file = AbsolutePath(log_file);
  if (auto v = args.Get("--metrics")) c.mount.metrics_file = AbsolutePath(*v);
  if (auto v = args.Get("--metrics-port")) {
    // [ADDRESS:]PORT
    const size_t colon = v->rfind(':');
    const std::string port = colon == std::string::npos ? *v : v->substr(colon + 1);
    if (colon != std::string::npos) c.mount.metrics_address = v->substr(0, colon);
    char* end = nullptr;
    const unsigned long n = std::strtoul(port.c_str(), &end, 10);
    if (port.empty() || *end != '\0' || n > 65535) {
      return Status::InvalidArgument("--metrics-port expects [ADDRESS:]PORT, such as 9101 or 0.0.0.0:9101 (got '" + *v + "')");
    }
    c.mount.metrics_port = static_cast<int>(n);
  }
  if (auto v = args.Get("--metrics-interval")) {
    WFS_ASSIGN_OR_RETURN(double seconds, ParseDouble(*v));
    if (seconds < 0.01 || seconds > 86400) return Status::InvalidArgument("--metrics-interval expects 0.01..86400 seconds");
    c.mount.metrics_interval = std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  }
  if (auto v = args.Get("--metadata-timeout")) {
    WFS_ASSIGN_OR_RETURN(double seconds, ParseDouble(*v));
    if (seconds < 0 || seconds > 86400) return Status::InvalidArgument("--metadata-timeout expects 0..86400 seconds (0: none)");
    c.mount.metadata_timeout = std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  }
  c.log = ChooseMountLog(log_file, c.foreground, c.cache_dir, c.mountpoint, level);
  const std::string log_format = args.GetOr("--log-format", "text");
  if (log_format != "text" && log_format != "json") {
    return Status::InvalidArgument("--log-format takes text or json (got '" + log_format + "')");
  }
  c.log.json = log_format == "json";
  WFS_ASSIGN_OR_RETURN(c.store, StoreOptionsFromArgs(args));
  MountOptions& m = c.mount;
  m.mountpoint = c.mountpoint;
  // The mount table is world-readable: no user:password@ or signed query in it.
  m.fsname = "weightfs:" + RedactUrl(c.url);
  m.allow_other = args.Has("--allow-other");
  m.read_only = args.Has("--read-only");
  m.whole_files = !args.Has("--no-whole-files");
  if (auto o = args.Get("-o")) m.fuse_options.push_back(*o);
  if (auto v = args.Get("--memory-limit")) {
    WFS_ASSIGN_OR_RETURN(m.reader.memory_limit, ParseSize(*v));
    if (m.reader.memory_limit < ChunkReader::kMinMemoryLimit) {
      // (128M is 128,000,000 bytes here: K, M, G are powers of 1000, Ki, Mi, Gi of 1024.)
      return Status::InvalidArgument("--memory-limit " + *v + " is " + FormatBytes(static_cast<double>(m.reader.memory_limit)) +
                                     "; it must be at least 128MiB (the daemon's own memory and one chunk build; "
                                     "M means 10^6 bytes, Mi 2^20)");
    }
  }
  if (auto v = args.Get("--threads")) {
    WFS_ASSIGN_OR_RETURN(double n, ParseDouble(*v));
    if (n < 1 || n > 256) return Status::InvalidArgument("--threads expects 1..256");
    m.max_threads = static_cast<size_t>(n);
  }
  double refresh = 10;
  if (auto v = args.Get("--refresh")) {
    WFS_ASSIGN_OR_RETURN(refresh, ParseDouble(*v));
  }
  m.names.refresh = std::chrono::milliseconds(static_cast<int64_t>(refresh * 1000));
  if (auto v = args.Get("--probe-rate")) {
    WFS_ASSIGN_OR_RETURN(m.names.probe_rate, ParseDouble(*v));
    if (m.names.probe_rate < 0 || m.names.probe_rate > 10000) return Status::InvalidArgument("--probe-rate expects 0..10000");
  }
  if (auto v = args.Get("--chunk-size")) {
    WFS_ASSIGN_OR_RETURN(m.drafts.push.chunk_bytes, ParseSize(*v));
    if (m.drafts.push.chunk_bytes < 4096 || m.drafts.push.chunk_bytes > kMaxChunkBytes) {
      return Status::InvalidArgument("--chunk-size takes 4KiB..64MiB");
    }
  }
  m.drafts.push.allow_invalid = args.Has("--allow-invalid");
  if (auto v = args.Get("--prefix")) {
    std::string prefix = *v;
    while (prefix.ends_with("/")) prefix.pop_back();
    if (Status valid = ValidateModelName(prefix); !valid.ok()) {
      return Status::InvalidArgument("--prefix " + *v + ": give an organisation or a model, such as acme or acme/qwen (" +
                                     valid.message() + ")");
    }
    m.names.prefix = prefix;
    m.drafts.prefix = prefix;
  }
  m.names.uid = ::getuid();
  m.names.gid = ::getgid();
  auto id_option = [&](const char* name, uint32_t* out) -> Status {
    if (auto v = args.Get(name)) {
      WFS_ASSIGN_OR_RETURN(double id, ParseDouble(*v));
      if (id < 0 || id > 4294967294.0 || id != static_cast<double>(static_cast<uint32_t>(id))) {
        return Status::InvalidArgument(std::string(name) + " expects a numeric id (got '" + *v + "')");
      }
      *out = static_cast<uint32_t>(id);
    }
    return Status::Ok();
  };
  auto mode_option = [&](const char* name, mode_t* out) -> Status {
    if (auto v = args.Get(name)) {
      char* end = nullptr;
      const unsigned long mode = std::strtoul(v->c_str(), &end, 8);
      if (v->empty() || *end != '\0' || mode > 0777) {
        return Status::InvalidArgument(std::string(name) + " expects octal permission bits such as 0440 (got '" + *v + "')");
      }
      if (mode & 0222) {
        return Status::InvalidArgument(std::string(name) + " " + *v + " has write bits: published versions are read-only "
                                       "(drafts have their own modes); give read and execute bits, such as 0440 or 0550");
      }
      *out = static_cast<mode_t>(mode);
    }
    return Status::Ok();
  };
  WFS_TRY(id_option("--uid", &m.names.uid));
  WFS_TRY(id_option("--gid", &m.names.gid));
  WFS_TRY(mode_option("--file-mode", &m.names.file_mode));
  WFS_TRY(mode_option("--dir-mode", &m.names.dir_mode));
  // Drafts of this bucket live in the cache directory, under a name derived from the URL.
  const std::string url_bytes = c.url;
  const uint64_t url_hash = Hash64(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(url_bytes.data()), url_bytes.size()));
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(url_hash));
  m.drafts.state_dir = c.cache_dir + "/drafts/" + hex;
  // Patch view files (fs/patch_view.h): per bucket too (model names repeat across buckets).
  m.patch_dir = c.cache_dir + "/patches/" + hex;
  m.patch_max_bytes = std::max<uint64_t>(c.cache_size / 4, 64ull << 20);
  return c;
}

}  // namespace

int MountMain(int argc, char** argv, bool quiet) {
  ArgParser args({"--cache-dir", "--cache-size", "--memory-limit", "--refresh", "--probe-rate", "--threads", "-o", "--chunk-size",
                  "--log-file", "--log-level", "--endpoint", "--region", "--timeout", "--metrics", "--metrics-interval",
                  "--metadata-timeout", "--uid", "--gid", "--file-mode", "--dir-mode", "--log-format",
                  "--metrics-port", "--shared-cache", "--shared-cache-size", "--shared-cache-endpoint", "--prefix"},
                 {"--foreground", "-f", "--read-only", "--allow-other", "--allow-invalid", "--no-sign-request", "--no-whole-files",
                  "--help", "-h"});
  if (auto rc = ParseArgs(args, argc, argv, kMountHelp, 2)) return *rc;
  Expected<MountConfig> config = ConfigFromArgs(args);
  if (!config.ok()) return Fail(config.status().message());
  const MountConfig& c = *config;
  spdlog::set_pattern("weightfs: %v");

  // Everything that can be checked here is, so that its error reaches the user directly.
  MountProbe probe = ProbeMountPoint(c.mountpoint);
  if (probe.state == MountPointState::kStale) {
    Status s = Unmount(c.mountpoint, /*lazy=*/true);
    if (!s.ok()) return Fail(probe.message + "; cleaning it up failed: " + s.message());
    std::fprintf(stderr, "weightfs: %s; detached it\n", probe.message.c_str());
    probe = ProbeMountPoint(c.mountpoint);
  }
  if (probe.state != MountPointState::kReady) return Fail(probe.message);
  // Allowed (fstab mounts over a directory that holds a placeholder, say), but never silent.
  if (std::string hidden = HiddenEntries(c.mountpoint); !hidden.empty()) {
    std::fprintf(stderr, "weightfs: warning: mount point %s is not empty (%s): what is in it is hidden while the "
                 "mount is up\n", c.mountpoint.c_str(), hidden.c_str());
  }
  if (Status s = CheckFuseDevice(); !s.ok()) return Fail(s.message());
  {
    Expected<Opened> opened = OpenAll(c);  // re-opened by the daemon: no state crosses fork()
    if (!opened.ok()) return Fail(opened.status());
  }
  if (Status s = CheckLogDestination(c.log); !s.ok()) return Fail(s.message());
  if (const std::string& metrics = c.mount.metrics_file; !metrics.empty()) {
    std::ofstream probe_metrics(metrics + ".tmp");  // the daemon writes there, then renames
    if (!probe_metrics) return Fail("cannot write the metrics file " + metrics + " (--metrics)");
  }
  if (c.mount.metrics_port > 0) {  // the port is free (the daemon listens on it again)
    Expected<std::unique_ptr<MetricsServer>> probe_port =
        MetricsServer::Start(c.mount.metrics_address, static_cast<uint16_t>(c.mount.metrics_port), [] { return std::string(); });
    if (!probe_port.ok()) return Fail(probe_port.status().message());
  }
  if (c.foreground) return Serve(c, -1);

  int report[2];
  if (::pipe2(report, O_CLOEXEC) != 0) return Fail(std::string("pipe: ") + std::strerror(errno));
  std::fflush(nullptr);
  pid_t pid = ::fork();
  if (pid < 0) return Fail(std::string("fork: ") + std::strerror(errno));
  if (pid == 0) {
    ::close(report[0]);
    ::setsid();
    int devnull = ::open("/dev/null", O_RDWR);
    if (devnull >= 0) {
      ::dup2(devnull, STDIN_FILENO);
      ::dup2(devnull, STDOUT_FILENO);
      if (c.log.kind != LogDestination::Kind::kJournal) ::dup2(devnull, STDERR_FILENO);
      if (devnull > STDERR_FILENO) ::close(devnull);
    }
    if (::chdir("/") != 0) {
      // Not fatal: every path is absolute.
    }
    std::exit(Serve(c, report[1]));
  }
  ::close(report[1]);
  const std::string line = ReadReport(report[0], std::chrono::seconds(150));
  ::close(report[0]);
  if (line != "OK") {
    int status = 0;
    if (line.empty()) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return Fail("the mount daemon exited before mounting " + c.mountpoint + " (see its log: " +
                  c.log.Describe() + ")");
    }
    ::waitpid(pid, &status, 0);
    return Fail(line.starts_with("ERR ") ? line.substr(4) : line);
  }
  if (!MountAnswers(c.mountpoint, std::chrono::seconds(30))) {
    return Fail("mounted " + c.mountpoint + " but it does not answer; the daemon (pid " +
                std::to_string(pid) + ") may be stuck: weightfs unmount --lazy " + c.mountpoint);
  }
  WarnIfDraftsOff(c);  // stderr: said even when mount.fuse.weightfs asks for quiet
  if (quiet) return 0;
  std::printf("mounted %s at %s (pid %d; log: %s); unmount with: weightfs unmount %s\n", RedactUrl(c.url).c_str(),
              c.mountpoint.c_str(), static_cast<int>(pid), c.log.Describe().c_str(), c.mountpoint.c_str());
  return 0;
}

namespace {

// The daemon's pid from the mount root's user.weightfs.pid, or 0 if it does not answer within
// `bound`.
pid_t DaemonPid(const std::string& mountpoint, std::chrono::seconds bound) {
  auto done = std::make_shared<std::promise<pid_t>>();
  std::future<pid_t> answered = done->get_future();
  std::thread([mountpoint, done] {
    char buf[32] = {};
    ssize_t n = ::getxattr(mountpoint.c_str(), "user.weightfs.pid", buf, sizeof buf - 1);
    done->set_value(n > 0 ? static_cast<pid_t>(std::atol(buf)) : 0);
  }).detach();  // a hung request cannot be cancelled; the process exits without it
  return answered.wait_for(bound) == std::future_status::ready ? answered.get() : 0;
}

// True once `pid` has exited (or is a zombie nobody reaped yet).
bool Exited(pid_t pid) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string content((std::istreambuf_iterator<char>(stat)), {});
  size_t paren = content.rfind(')');
  return paren != std::string::npos && paren + 2 < content.size() && content[paren + 2] == 'Z';
}

}  // namespace

int UnmountMain(int argc, char** argv, bool quiet) {
  ArgParser args({"--timeout"}, {"--lazy", "--keep-drafts", "--help", "-h"});
  if (auto rc = ParseArgs(args, argc, argv, kUnmountHelp, 1)) return *rc;
  const std::string mountpoint = AbsolutePath(args.positionals()[0]);
  const bool lazy = args.Has("--lazy");
  double timeout = 30;
  if (auto t = args.Get("--timeout")) {
    Expected<double> v = ParseDouble(*t);
    if (!v.ok()) return Fail(v.status().message());
    timeout = *v;
  }
  MountProbe probe = ProbeMountPoint(mountpoint);
  if (probe.state == MountPointState::kStale) {
    Status s = Unmount(mountpoint, /*lazy=*/true);
    if (!s.ok()) return Fail(s.message());
    if (!quiet) std::printf("%s: its daemon was gone; detached the mount\n", mountpoint.c_str());
    return 0;
  }
  std::optional<MountEntry> entry = FindMount(mountpoint);
  if (!entry) return Fail(mountpoint + " is not a mount point");
  if (entry->fstype != "fuse.weightfs") {
    return Fail(mountpoint + " is not a weightfs mount (it is " + entry->fstype + ")");
  }
  // The daemon's pid, to wait for it below; a daemon that does not answer is unmounted all
  // the same (without waiting).
  const pid_t pid = DaemonPid(mountpoint, std::chrono::seconds(5));
  if (args.Has("--keep-drafts")) {
    if (::setxattr(mountpoint.c_str(), "user.weightfs.keep_drafts", "", 0, 0) != 0) {
      return Fail(mountpoint + ": cannot tell the daemon to keep its drafts: " + std::strerror(errno));
    }
  } else if (!lazy && pid > 0) {
    if (int err = PublishDrafts(mountpoint); err != 0) {
      return Fail("the drafts of " + mountpoint + " could not be published (" + std::strerror(err) +
                  "); the mount stays. Fix the cause and unmount again, or unmount with --keep-drafts "
                  "to leave them staged for the next mount");
    }
  }
  if (!lazy && pid > 0) {
    // The local copies of the files just read whole are made from the kernel's pages while it
    // still has them (best effort: a daemon before this answers ENOTSUP, and unmount goes on).
    (void)::setxattr(mountpoint.c_str(), "user.weightfs.finish_whole_files", "", 0, 0);
  }
  Status s = Unmount(mountpoint, lazy);
  if (!s.ok()) return Fail(s.message());
  if (lazy) {
    if (!quiet) std::printf("detached %s; its daemon exits once the last file open on it is closed\n", mountpoint.c_str());
    return 0;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout * 1000));
  while (pid > 0 && !Exited(pid)) {
    if (std::chrono::steady_clock::now() > deadline) {
      return Fail("unmounted " + mountpoint + ", but its daemon (pid " + std::to_string(pid) +
                  ") still runs after " + std::to_string(static_cast<int>(timeout)) + " s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (!quiet) std::printf("unmounted %s\n", mountpoint.c_str());
  return 0;
}

}  // namespace weightfs::cli

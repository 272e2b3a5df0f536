// weightfs commit / status: publish a draft of a mount, and report on a mount's drafts.
//
// Both talk to the mount daemon through extended attributes (fs/fuse_server.h): setting
// user.weightfs.commit on a draft directory publishes it, and blocks until it is published or
// failed; the root's user.weightfs.status is a JSON report. While a commit runs, the command
// polls the report to show the bytes left to encode and upload.
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "fs/metrics.h"
#include "fs/mount_point.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace weightfs::cli {
namespace {

constexpr const char* kCommitHelp = R"(usage: weightfs commit MOUNTPOINT/MODEL@VERSION [--as NAME]

Publishes a draft of a weightfs mount: waits until every file written into it is encoded
(deltas against the draft's parent) and uploaded, then creates the version's manifest in the
bucket (create-if-absent: if another writer took the name first, the commit fails and the draft
stays; commit it under another name with --as). Prints the stored bytes, ratio and time.
Files of the draft that are still open for writing make it fail: close them first.

options:
  --as NAME      publish under this version name instead of the draft's
  -h, --help     show this help
)";

constexpr const char* kDiscardHelp = R"(usage: weightfs discard MOUNTPOINT/MODEL@VERSION

Abandons a draft of a weightfs mount: forgets it and deletes its staging files. Nothing of it
was published and nothing is (packs it already uploaded are left to `weightfs gc`, which
removes them once the draft's lease has expired). `rm -r` of the draft directory does the same
one file at a time. Fails while the draft is being committed or a file of it is open for
writing.

options:
  -h, --help     show this help
)";

constexpr const char* kSetParentHelp = R"(usage: weightfs set-parent MOUNTPOINT/MODEL@DRAFT VERSION

Makes VERSION (a published version of MODEL) the parent of a draft: the draft then lists
VERSION's files, and the files written into it are encoded as deltas against them. Only a draft
nothing was written into yet can change its parent (mkdir it, set-parent, then write). The
same as `setfattr -n user.weightfs.parent -v VERSION MOUNTPOINT/MODEL@DRAFT`, but on failure it
prints why (the reason is also in the draft's user.weightfs.error).

options:
  -h, --help     show this help
)";

constexpr const char* kStatusHelp = R"(usage: weightfs status MOUNTPOINT [--json | --prometheus]

Shows the drafts of a weightfs mount: their parent, files staged, files still to encode and
upload (and their bytes), files open for writing, the last error, and the chunk cache's use;
then the mount's metrics since it was mounted: bytes fetched from the bucket vs bytes
materialized from them, the cache hit ratio (memory and disk), delta-chain depth (mean, max),
time spent building and decoding chunks, and queue depths.

options:
  --json         print the report as JSON (the metrics under "metrics")
  --prometheus   print the metrics in Prometheus text format (what --metrics FILE of
                 `weightfs mount` holds)
  -h, --help     show this help
)";

std::optional<std::string> GetXattr(const std::string& path, const char* name) {
  std::string value(4096, '\0');
  for (int i = 0; i < 4; ++i) {
    ssize_t n = ::getxattr(path.c_str(), name, value.data(), value.size());
    if (n >= 0) {
      value.resize(static_cast<size_t>(n));
      return value;
    }
    if (errno != ERANGE) return std::nullopt;
    ssize_t need = ::getxattr(path.c_str(), name, nullptr, 0);
    if (need < 0) return std::nullopt;
    value.assign(static_cast<size_t>(need) + 1024, '\0');
  }
  return std::nullopt;
}

std::optional<nlohmann::json> StatusOf(const std::string& root) {
  std::optional<std::string> text = GetXattr(root, "user.weightfs.status");
  if (!text) return std::nullopt;
  try {
    return nlohmann::json::parse(*text);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// Runs `op` (a blocking setxattr) on a thread; meanwhile shows the progress of encoding and
// uploading the drafts `which` selects ("" = all) under `label` (cli.h's Progress: in place on
// a TTY, a plain line every few seconds otherwise): bytes staged so far that are encoded and
// uploaded, of all staged. Returns op's errno (0 on success).
int WithProgress(const std::string& root, const std::string& which, const std::string& label,
                 const std::function<int()>& op) {
  std::atomic<bool> done{false};
  std::atomic<int> result{0};
  std::thread worker([&] {
    result = op();
    done = true;
  });
  Progress progress(label, 0);
  while (!done) {
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    if (done) break;
    std::optional<nlohmann::json> st = StatusOf(root);
    if (!st) continue;
    uint64_t to_go = 0, staged = 0;
    for (const auto& d : (*st)["drafts"]) {
      if (!which.empty() && d.value("name", "") != which) continue;
      to_go += d.value("bytes_to_go", uint64_t{0});
      staged += d.value("staged_bytes", uint64_t{0});
    }
    progress.Update(staged - std::min(to_go, staged), staged);
  }
  worker.join();
  progress.Finish();
  return result;
}

// The root of the weightfs mount that holds `path`, or an error naming `path` and what it is on
// (not the root of whatever file system holds it: "/ is not a weightfs mount" misleads).
Expected<std::string> WeightfsRootOf(const std::string& path) {
  const std::string root = MountRootOf(path);
  std::optional<MountEntry> entry = FindMount(root);
  if (entry && entry->fstype == "fuse.weightfs") return root;
  std::string where;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    where = std::string(": ") + std::strerror(errno);
  } else if (entry) {
    where = " (it is on " + entry->fstype + ", mounted at " + root + ")";
  }
  return Status::InvalidArgument(path + " is not in a weightfs mount" + where +
                                 "; give the mount point of `weightfs mount BUCKET MOUNTPOINT`");
}

// The draft's name as the status report spells it ("acme/qwen@v2"), from its directory.
std::string DraftName(const std::string& root, const std::string& dir) {
  return std::filesystem::path(dir).lexically_normal().lexically_relative(root).string();
}

}  // namespace

int CommitMain(int argc, char** argv) {
  ArgParser args({"--as"}, {"--help", "-h"});
  if (auto rc = ParseArgs(args, argc, argv, kCommitHelp, 1)) return *rc;
  std::string dir = AbsolutePath(args.positionals()[0]);
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  const std::string as = args.GetOr("--as", "");
  std::optional<std::string> state = GetXattr(dir, "user.weightfs.state");
  if (!state) {
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0) return Fail(dir + ": " + std::strerror(errno));
    return Fail(dir + " is not a draft of a weightfs mount (make one with mkdir MOUNTPOINT/MODEL@VERSION)");
  }
  const std::string root = MountRootOf(dir);
  const std::string name = DraftName(root, dir);
  const auto start = std::chrono::steady_clock::now();
  std::fprintf(stderr, "committing %s%s\n", name.c_str(), as.empty() ? "" : (" as " + as).c_str());
  const int err = WithProgress(root, name, "commit " + name + " (encoded and uploaded)", [&] {
    return ::setxattr(dir.c_str(), "user.weightfs.commit", as.data(), as.size(), 0) == 0 ? 0 : errno;
  });
  if (err != 0) {
    std::optional<std::string> why = GetXattr(dir, "user.weightfs.error");
    return Fail("commit of " + name + " failed: " + (why ? *why : std::string(std::strerror(err))));
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::string leaf = std::filesystem::path(dir).filename().string();
  const std::string published =
      std::filesystem::path(dir).parent_path().string() + "/" + (as.empty() ? leaf : leaf.substr(0, leaf.rfind('@') + 1) + as);
  uint64_t logical = 0;
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(published, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    if (it->is_regular_file(ec)) logical += it->file_size(ec);
  }
  const std::optional<std::string> stored = GetXattr(published, "user.weightfs.stored_bytes");
  const std::optional<std::string> changed = GetXattr(published, "user.weightfs.changed_fraction");
  const double stored_bytes = stored ? std::atof(stored->c_str()) : 0;
  std::printf("published %s: %s logical, %s stored (%.1fx), %.3f%% of elements changed, in %.2f s\n",
              DraftName(root, published).c_str(), FormatBytes(static_cast<double>(logical)).c_str(),
              FormatBytes(stored_bytes).c_str(), stored_bytes > 0 ? static_cast<double>(logical) / stored_bytes : 0.0,
              changed ? 100 * std::atof(changed->c_str()) : 0.0, secs);
  return 0;
}

int SetParentMain(int argc, char** argv) {
  ArgParser args({}, {"--help", "-h"});
  if (auto rc = ParseArgs(args, argc, argv, kSetParentHelp, 2)) return *rc;
  std::string dir = AbsolutePath(args.positionals()[0]);
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  const std::string& version = args.positionals()[1];
  if (!GetXattr(dir, "user.weightfs.state")) {
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0) return Fail(dir + ": " + std::strerror(errno));
    return Fail(dir + " is not a draft of a weightfs mount (make one with mkdir MOUNTPOINT/MODEL@VERSION)");
  }
  const std::string name = DraftName(MountRootOf(dir), dir);
  if (::setxattr(dir.c_str(), "user.weightfs.parent", version.data(), version.size(), 0) != 0) {
    const int err = errno;
    std::optional<std::string> why = GetXattr(dir, "user.weightfs.error");
    return Fail("cannot set the parent of " + name + " to " + version + ": " +
                (why ? *why : std::string(std::strerror(err))));
  }
  std::printf("%s: parent is now %s\n", name.c_str(), version.c_str());
  return 0;
}

int DiscardMain(int argc, char** argv) {
  ArgParser args({}, {"--help", "-h"});
  if (auto rc = ParseArgs(args, argc, argv, kDiscardHelp, 1)) return *rc;
  std::string dir = AbsolutePath(args.positionals()[0]);
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  if (!GetXattr(dir, "user.weightfs.state")) {
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0) return Fail(dir + ": " + std::strerror(errno));
    return Fail(dir + " is not a draft of a weightfs mount (published versions cannot be discarded; "
                "`weightfs gc` retires old versions)");
  }
  const std::string name = DraftName(MountRootOf(dir), dir);
  if (::setxattr(dir.c_str(), "user.weightfs.discard", "", 0, 0) != 0) {
    const int err = errno;
    if (err == EBUSY) {
      return Fail("cannot discard " + name + ": it is being committed or a file of it is open for writing");
    }
    return Fail("cannot discard " + name + ": " + std::strerror(err));
  }
  std::printf("discarded draft %s\n", name.c_str());
  return 0;
}

// One paragraph of the metrics (user.weightfs.stats) for people; fs/metrics.h has the rest.
void PrintMetrics(const nlohmann::json& m) {
  auto num = [&](const char* section, const char* name) -> double {
    return m.contains(section) && (*m.find(section)).contains(name) ? m[section][name].get<double>() : 0.0;
  };
  std::printf("reads %.0f (%s); chunks asked %.0f, from memory or disk cache %.1f%%, built %.0f\n",
              num("reader", "reads"), FormatBytes(num("reader", "read_bytes")).c_str(), num("rates", "chunk_lookups"),
              100 * num("rates", "cache_hit_ratio"), num("materializer", "builds"));
  std::printf("fetched %s from the bucket for %s materialized; chain depth mean %.2f, max %.0f; build %.2f s, "
              "decode %.2f s\n",
              FormatBytes(num("materializer", "payload_bytes")).c_str(), FormatBytes(num("materializer", "built_bytes")).c_str(),
              num("rates", "mean_chain_depth"), num("materializer", "chain_depth_max"), num("materializer", "build_seconds"),
              num("materializer", "decode_seconds"));
  std::printf("queues: builds running %.0f, readahead waiting %.0f, encodes queued %.0f\n", num("reader", "builds_running"),
              num("reader", "readahead_waiting"), num("drafts", "queued_encodes"));
}

int StatusMain(int argc, char** argv) {
  ArgParser args({}, {"--json", "--prometheus", "--help", "-h"});
  if (auto rc = ParseArgs(args, argc, argv, kStatusHelp, 1)) return *rc;
  const std::string path = AbsolutePath(args.positionals()[0]);
  Expected<std::string> root = WeightfsRootOf(path);
  if (!root.ok()) return Fail(root.status().message());
  std::optional<nlohmann::json> st = StatusOf(*root);
  if (!st) return Fail(*root + " is a weightfs mount but its daemon does not answer (`weightfs unmount " + *root + "`)");
  const std::optional<std::string> stats_text = GetXattr(*root, "user.weightfs.stats");
  const nlohmann::json metrics =
      stats_text ? nlohmann::json::parse(*stats_text, nullptr, /*allow_exceptions=*/false) : nlohmann::json();
  if (args.Has("--prometheus")) {
    if (!stats_text) return Fail(*root + ": the daemon does not report its metrics");
    std::fputs(PrometheusText(*stats_text, *root).c_str(), stdout);
    return 0;
  }
  if (args.Has("--json")) {
    if (metrics.is_object()) (*st)["metrics"] = metrics;
    std::printf("%s\n", st->dump(2).c_str());
    return 0;
  }
  if (!st->value("enabled", false)) {
    std::printf("drafts are off on this mount%s\n",
                st->contains("disabled_reason") ? (": " + (*st)["disabled_reason"].get<std::string>()).c_str() : " (read-only)");
  }
  const auto& drafts = (*st)["drafts"];
  if (drafts.empty()) std::printf("no drafts\n");
  for (const auto& d : drafts) {
    std::printf("%s  (parent %s)  %s\n", d.value("name", "").c_str(),
                d["parent"].is_null() ? "none: a base" : d["parent"].get<std::string>().c_str(),
                d.value("state", "").c_str());
    std::printf("  files %llu, staged %llu (%s), encoded and uploaded %llu, to go %llu (%s), open for writing %llu\n",
                static_cast<unsigned long long>(d.value("files", uint64_t{0})),
                static_cast<unsigned long long>(d.value("staged_files", uint64_t{0})),
                FormatBytes(static_cast<double>(d.value("staged_bytes", uint64_t{0}))).c_str(),
                static_cast<unsigned long long>(d.value("encoded_files", uint64_t{0})),
                static_cast<unsigned long long>(d.value("pending_files", uint64_t{0})),
                FormatBytes(static_cast<double>(d.value("bytes_to_go", uint64_t{0}))).c_str(),
                static_cast<unsigned long long>(d.value("open_for_writing", uint64_t{0})));
    if (!d.value("error", "").empty()) std::printf("  last error: %s\n", d.value("error", "").c_str());
  }
  if (st->contains("cache")) {
    std::printf("chunk cache: %s of %s\n", FormatBytes(static_cast<double>((*st)["cache"].value("size_bytes", uint64_t{0}))).c_str(),
                FormatBytes(static_cast<double>((*st)["cache"].value("max_bytes", uint64_t{0}))).c_str());
  }
  if (metrics.is_object()) PrintMetrics(metrics);
  return 0;
}

std::optional<nlohmann::json> MountStatus(const std::string& root) { return StatusOf(root); }

int PublishDrafts(const std::string& mountpoint) {
  std::optional<nlohmann::json> st = StatusOf(mountpoint);
  if (!st || (*st)["drafts"].empty()) return 0;
  std::fprintf(stderr, "publishing %zu draft(s) of %s\n", (*st)["drafts"].size(), mountpoint.c_str());
  const int err = WithProgress(mountpoint, "", "publishing the drafts of " + mountpoint + " (encoded and uploaded)", [&] {
    return ::setxattr(mountpoint.c_str(), "user.weightfs.commit_all", "", 0, 0) == 0 ? 0 : errno;
  });
  if (err == 0) return 0;
  st = StatusOf(mountpoint);
  if (st) {
    for (const auto& d : (*st)["drafts"]) {
      if (!d.value("error", "").empty()) {
        std::fprintf(stderr, "weightfs: %s: %s\n", d.value("name", "").c_str(), d.value("error", "").c_str());
      }
    }
  }
  return err;
}

}  // namespace weightfs::cli

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

#include "core/manifest.h"
#include "fs/metrics.h"
#include "fs/mount_point.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace weightfs::cli {
namespace {

constexpr const char* kCommitHelp = R"(usage: weightfs commit MOUNTPOINT/MODEL@VERSION [--as NAME]
       weightfs commit MOUNTPOINT/MODEL@VERSION --parts N [--part ID] [--timeout S] [--no-wait]

Publishes a draft of a weightfs mount: waits until every file written into it is encoded
(deltas against the draft's parent) and uploaded, then creates the version's manifest in the
bucket (create-if-absent: if another writer took the name first, the commit fails and the draft
stays; commit it under another name with --as). Prints the stored bytes, ratio and time.
Files of the draft that are still open for writing make it fail: close them first.

A version written by several nodes (each training rank saves its own shards into a draft of
the same name on its own mount): every node runs `commit --parts N` with the same N. Each
uploads its part (the files it wrote or removed) and waits until all N parts are in; the
version is then published once, atomically, with every part's files (files no part wrote are
inherited from the parent). The first part fixes the parent: a draft with another parent is
refused. Two parts that write the same path: nothing is published, every part is kept.
See docs/parts.md.

options:
  --as NAME      publish under this version name instead of the draft's
  --parts N      this draft is one of N parts of the version (the world size)
  --part ID      this part's id (e.g. the rank; A-Z a-z 0-9 . _ -); default: made up once
                 per draft and kept in its journal, so a remounted node is never counted twice
  --timeout S    stop waiting after S seconds: exit 124, the part stays safe in the bucket
                 (running the same command again goes on waiting)
  --no-wait      return once this part is safe in the bucket (exit 0); the node whose part
                 completes the set publishes
  -h, --help     show this help

exit status: 0 published (or, with --no-wait, the part is in); 124 timed out waiting for the
other parts; 1 on a conflict or an error.
)";

constexpr const char* kDiscardHelp = R"(usage: weightfs discard MOUNTPOINT/MODEL@VERSION

Abandons a draft of a weightfs mount: forgets it and deletes its staging files. Nothing of it
was published and nothing is (packs it already uploaded are left to `weightfs gc`, which
removes them once the draft's lease has expired). `rm -r` of the draft directory does the same
one file at a time. Fails while the draft is being committed or a file of it is open for
writing.

A draft committed as a part (`commit --parts N`) takes the whole staged version with it, on
every node: its part records leave the bucket and the nodes waiting for it stop. From a node
that has no draft of it, MOUNTPOINT/MODEL@VERSION names the staged version alone.

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

// The draft was published between our look at it and our request: a commit resumed after a
// remount (the journal had it requested) finished first. The directory is the version now, and
// the request, made on what is no longer a draft, failed with EROFS (or ENOENT, ESTALE). The command's
// goal is met; failing it would tell a caller to redo a commit that is done.
bool PublishedMeanwhile(const std::string& dir, int err) {
  if (err != EROFS && err != ENOENT && err != ESTALE) return false;
  return !GetXattr(dir, "user.weightfs.state") && GetXattr(dir, "user.weightfs.stored_bytes").has_value();
}

// `weightfs commit DIR --parts N ...`: one part of a version written by several nodes.
int CommitPart(const ArgParser& args, const std::string& dir) {
  if (args.Has("--as")) return Fail("--as does not go with --parts: every part names the version by its draft");
  const std::string parts_text = args.GetOr("--parts", "");
  char* end = nullptr;
  const long parts = std::strtol(parts_text.c_str(), &end, 10);
  if (parts_text.empty() || *end != '\0' || parts < 1 || parts > 1000000) {
    return Fail("--parts " + parts_text + ": give the number of nodes writing the version (1 or more)");
  }
  int64_t timeout_ms = -1;
  if (std::optional<std::string> t = args.Get("--timeout")) {
    const double secs = std::strtod(t->c_str(), &end);
    if (t->empty() || *end != '\0' || secs < 0) return Fail("--timeout " + *t + ": give seconds (e.g. 600)");
    timeout_ms = static_cast<int64_t>(secs * 1000);
  }
  if (!GetXattr(dir, "user.weightfs.state")) {
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0) return Fail(dir + ": " + std::strerror(errno));
    // Published already: every part was in (this node's part resumed after a restart, and the
    // others completed the set meanwhile). The goal of the command is met.
    if (GetXattr(dir, "user.weightfs.stored_bytes")) {
      std::printf("%s is published (all %ld parts are in)\n", DraftName(MountRootOf(dir), dir).c_str(), parts);
      return 0;
    }
    return Fail(dir + " is not a draft of a weightfs mount (make one with mkdir MOUNTPOINT/MODEL@VERSION)");
  }
  const std::string root = MountRootOf(dir);
  const std::string name = DraftName(root, dir);
  const bool wait = !args.Has("--no-wait");
  nlohmann::json request = {{"parts", parts}, {"part", args.GetOr("--part", "")}, {"wait", wait},
                            {"timeout_ms", timeout_ms}};
  const std::string value = request.dump();
  const auto start = std::chrono::steady_clock::now();
  std::fprintf(stderr, "committing %s as one of %ld parts\n", name.c_str(), parts);
  // While the daemon waits for the other parts, say how many are in whenever that changes.
  std::atomic<bool> done{false};
  std::thread reporter([&] {
    std::string last;
    while (!done) {
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
      std::optional<nlohmann::json> st = StatusOf(root);
      if (!st) continue;
      for (const auto& d : (*st)["drafts"]) {
        if (d.value("name", "") != name) continue;
        const std::string now = d.value("part_state", "");
        if (!now.empty() && now != last && !done) std::fprintf(stderr, "%s: %s\n", name.c_str(), now.c_str());
        last = now;
      }
    }
  });
  const int err = ::setxattr(dir.c_str(), "user.weightfs.commit_part", value.data(), value.size(), 0) == 0 ? 0 : errno;
  done = true;
  reporter.join();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (err != 0 && PublishedMeanwhile(dir, err)) {
    std::printf("%s is published (all %ld parts are in)\n", name.c_str(), parts);
    return 0;
  }
  if (err != 0) {
    std::optional<std::string> why = GetXattr(dir, "user.weightfs.error");
    const std::string text = why ? *why : std::string(std::strerror(err));
    if (err == ETIMEDOUT) {
      std::fprintf(stderr, "weightfs: %s (after %.0f s)\n", text.c_str(), secs);
      return 124;
    }
    return Fail("commit of " + name + " failed: " + text);
  }
  // Published: the draft's name is the version now. Else (--no-wait) the part is in.
  if (GetXattr(dir, "user.weightfs.state")) {
    std::printf("part of %s is in the bucket; the version is published when all %ld parts are (%.2f s)\n",
                name.c_str(), parts, secs);
  } else {
    std::printf("published %s from %ld parts in %.2f s\n", name.c_str(), parts, secs);
  }
  return 0;
}

}  // namespace

int CommitMain(int argc, char** argv) {
  ArgParser args({"--as", "--parts", "--part", "--timeout"}, {"--no-wait", "--help", "-h"});
  if (auto rc = ParseArgs(args, argc, argv, kCommitHelp, 1)) return *rc;
  std::string dir = AbsolutePath(args.positionals()[0]);
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  const std::string as = args.GetOr("--as", "");
  if (args.Has("--parts")) return CommitPart(args, dir);
  if (args.Has("--part") || args.Has("--timeout") || args.Has("--no-wait")) {
    return Fail("--part, --timeout and --no-wait go with --parts N (a version written by N nodes)");
  }
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
  // What becomes of the files the draft inherits: kept as the parent's, or left out (shards a
  // written index no longer names: a reshard).
  if (std::optional<std::string> text = GetXattr(dir, "user.weightfs.inherited")) {
    const nlohmann::json plan = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
    const std::string parent = GetXattr(dir, "user.weightfs.parent").value_or("the parent");
    if (plan.is_object() && plan.contains("dropped") && plan["dropped"].is_object()) {
      for (const auto& [path, index] : plan["dropped"].items()) {
        std::fprintf(stderr, "leaving out %s of %s: %s, written into the draft, does not name it\n", path.c_str(),
                     parent.c_str(), index.is_string() ? index.get<std::string>().c_str() : "its index");
      }
    }
    if (plan.is_object() && plan.contains("kept") && plan["kept"].is_array() && !plan["kept"].empty()) {
      std::string list;
      size_t shown = 0;
      for (const auto& p : plan["kept"]) {
        if (!p.is_string() || shown == 8) continue;
        list += (shown++ ? ", " : "") + p.get<std::string>();
      }
      if (plan["kept"].size() > shown) list += " and " + std::to_string(plan["kept"].size() - shown) + " more";
      std::fprintf(stderr, "keeping %zu file%s of %s as %s: %s\n", plan["kept"].size(),
                   plan["kept"].size() == 1 ? "" : "s", parent.c_str(), plan["kept"].size() == 1 ? "it is" : "they are",
                   list.c_str());
    }
  }
  const int err = WithProgress(root, name, "commit " + name + " (encoded and uploaded)", [&] {
    return ::setxattr(dir.c_str(), "user.weightfs.commit", as.data(), as.size(), 0) == 0 ? 0 : errno;
  });
  if (err != 0 && !(as.empty() && PublishedMeanwhile(dir, err))) {
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
    // No draft here: a version staged in parts by other nodes, named by its path in the mount.
    Expected<std::string> root = WeightfsRootOf(std::filesystem::path(dir).parent_path().string());
    struct stat st {};
    if (root.ok() && ::stat(dir.c_str(), &st) != 0) {
      const std::string staged = DraftName(*root, dir);
      if (::setxattr(root->c_str(), "user.weightfs.discard_staged", staged.data(), staged.size(), 0) == 0) {
        std::printf("discarded the staged version %s (every node waiting for it stops; gc removes its packs)\n",
                    staged.c_str());
        return 0;
      }
      if (errno != ENOENT) return Fail("cannot discard the staged version " + staged + ": " + std::strerror(errno));
      return Fail(dir + ": no draft and no staged version of that name");
    }
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

// Staged versions (fs/drafts: Drafts::StagedJson's shape): who is in, who is late.
void PrintStaged(const nlohmann::json& staged) {
  for (const auto& v : staged) {
    const size_t in = v["in"].size();
    std::printf("staged %s@%s  (parent %s)  %zu of %d parts in\n", v.value("model", "").c_str(),
                v.value("version", "").c_str(),
                v["parent"].is_null() ? "none: a base" : v["parent"].get<std::string>().c_str(), in,
                v.value("parts", 0));
    for (const auto& p : v["in"]) {
      const int64_t ms = p.value("created_ms", int64_t{0});
      std::printf("  part %-24s host %-16s %llu files (%llu removed), %s stored, in since %s\n",
                  p.value("id", "").c_str(), p.value("host", "?").c_str(),
                  static_cast<unsigned long long>(p.value("files", uint64_t{0})),
                  static_cast<unsigned long long>(p.value("removed", uint64_t{0})),
                  FormatBytes(static_cast<double>(p.value("stored_bytes", uint64_t{0}))).c_str(),
                  ms ? FormatUtc(ms).c_str() : "?");
    }
    if (!v.value("conflict", "").empty()) std::printf("  cannot be published: %s\n", v.value("conflict", "").c_str());
  }
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
    if (d.contains("parts")) {
      std::printf("  part %s of %d: %s\n", d.value("part_id", "").c_str(), d.value("parts", 0),
                  d.value("part_state", "").c_str());
    }
    if (!d.value("error", "").empty()) std::printf("  last error: %s\n", d.value("error", "").c_str());
  }
  // Versions staged in parts in the bucket (by this node or others).
  if (std::optional<std::string> text = GetXattr(*root, "user.weightfs.staged")) {
    const nlohmann::json staged = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
    if (staged.is_array()) PrintStaged(staged);
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
  // Named: the ones to publish, and those left as they are (empty, or still their parent: a
  // mkdir alone is not a new version).
  std::vector<std::string> publish;
  for (const auto& d : (*st)["drafts"]) {
    const std::string name = d.value("name", "");
    if (d.value("files", uint64_t{0}) == 0) {
      std::fprintf(stderr, "draft %s has no files: not published\n", name.c_str());
    } else if (d.value("unchanged", false) && d.value("state", "") == "draft") {
      std::fprintf(stderr, "draft %s is unchanged from its parent %s: not published (it stays a draft; "
                   "`weightfs commit` publishes it, `weightfs discard` removes it)\n", name.c_str(),
                   d.value("parent", nlohmann::json("")).is_string() ? d["parent"].get<std::string>().c_str() : "");
    } else {
      publish.push_back(name);
    }
  }
  if (publish.empty()) return 0;
  std::string names;
  for (const std::string& n : publish) names += (names.empty() ? "" : ", ") + n;
  std::fprintf(stderr, "publishing %zu draft%s of %s: %s\n", publish.size(), publish.size() == 1 ? "" : "s",
               mountpoint.c_str(), names.c_str());
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

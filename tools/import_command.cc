// weightfs import: a TRL delta-sync bucket's steps as weightfs versions.
//
// Each step N of the source (hub/trl/trl_bucket.h: the newest anchor plus the deltas after it,
// synthesized as one model.safetensors) is materialized into a temporary file in the cache
// directory and pushed into the destination bucket as MODEL@step-N, its parent the previous
// imported step. Steps the destination already holds are skipped, so an interrupted import
// resumes. Disk: at most two steps' files at a time (the one being pushed and its parent, kept
// so that the push finds the parent's chunks through the cache's references instead of
// decoding them back out of the bucket); they are removed as soon as they are not needed.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <spdlog/spdlog.h>

#include "core/thread_pool.h"
#include "hub/engine/bucket.h"
#include "hub/engine/chunk_cache.h"
#include "hub/engine/materializer.h"
#include "hub/engine/version_reader.h"
#include "hub/engine/version_writer.h"
#include "hub/open_bucket.h"
#include "hub/open_store.h"
#include "hub/trl/trl_bucket.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "tools/logging.h"
#include "tools/store_args.h"

namespace weightfs::cli {
namespace {

constexpr const char* kImportHelp = R"(usage: weightfs import SRC_BUCKET DEST_BUCKET [options]

Imports a TRL delta-sync bucket (anchors/step_NNNNNN.safetensors full weights plus
deltas/step_NNNNNN.safetensors sparse patches, as TRL's async GRPO weight sync writes them)
into a weightfs bucket: every step N becomes the version MODEL@step-N (one file,
model.safetensors, exactly what `weightfs mount SRC_BUCKET` shows for that step), stored as a
delta against the previous imported step. Steps DEST_BUCKET already holds are skipped, so an
interrupted import resumes where it stopped. Prints, per step, the bytes TRL stored for it
(its anchor or delta file) against the bytes weightfs stored, and a total.

DEST_BUCKET must be a weightfs bucket (`weightfs init DEST_BUCKET`).

options:
  --model NAME         the model name in DEST_BUCKET      [SRC_BUCKET's last path component]
  --from-step N        first step to import                                   [the first]
  --to-step M          last step to import                                    [the last]
  --cache-dir DIR      chunk cache, and where each step's file is materialized for the push
                       [$WEIGHTFS_CACHE_DIR or ~/.cache/weightfs]
  --cache-size BYTES   bound on the cache (LRU eviction)                          [20GiB]
  --threads N          parallel chunk workers                                      [8]
  --keyframe-ratio X   as for push                                                 [1.0]
  --keyframe-depth N   as for push                                                 [64]
  --endpoint URL       S3 endpoint (both buckets)
  --region NAME        S3 region                                            [us-east-1]
  --no-sign-request    S3: send requests unsigned (a bucket open to anyone)
  --timeout SECONDS    give up on a request (retries included) after this long     [120]
  --log-level LEVEL    error, warn, info, debug                                   [warn]
  -h, --help           show this help
)";

std::string Times(uint64_t a, uint64_t b) {
  if (b == 0) return "inf";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2fx", static_cast<double>(a) / static_cast<double>(b));
  return buf;
}

// Removes a directory tree when it goes out of scope.
struct TempDirGuard {
  std::string path;
  ~TempDirGuard() {
    std::error_code ec;
    if (!path.empty()) std::filesystem::remove_all(path, ec);
  }
};

// Writes the version's file `file` (materialized chunk by chunk) to `path`.
Status MaterializeTo(Materializer& materializer, ThreadPool& pool, const Manifest& manifest,
                     const ManifestFile& file, const std::string& path) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return Status::IOError("creating " + path + ": " + std::strerror(errno));
  Progress progress("materialize " + manifest.model + "@" + manifest.version + "/" + file.path, file.size);
  uint64_t written = 0;
  Status s = ForEachChunk(materializer, pool, manifest, file, [&](size_t i, std::span<const uint8_t> bytes) -> Status {
    written += bytes.size();
    progress.Update(written);
    uint64_t off = file.chunks[i].offset;
    while (!bytes.empty()) {
      ssize_t n = ::pwrite(fd, bytes.data(), bytes.size(), static_cast<off_t>(off));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return Status::IOError("writing " + path + ": " + std::strerror(errno));
      bytes = bytes.subspan(static_cast<size_t>(n));
      off += static_cast<uint64_t>(n);
    }
    return Status::Ok();
  });
  progress.Finish();
  if (::close(fd) != 0 && s.ok()) s = Status::IOError("closing " + path + ": " + std::strerror(errno));
  return s;
}

Expected<uint64_t> ParseStep(const std::string& text) {
  Expected<double> v = ParseDouble(text);
  if (!v.ok() || *v < 0 || *v != static_cast<double>(static_cast<uint64_t>(*v))) {
    return Status::InvalidArgument("expected a step number, got '" + text + "'");
  }
  return static_cast<uint64_t>(*v);
}

}  // namespace

int ImportMain(int argc, char** argv) {
  ArgParser args({"--model", "--from-step", "--to-step", "--cache-dir", "--cache-size", "--threads",
                  "--keyframe-ratio", "--keyframe-depth", "--endpoint", "--region", "--timeout", "--log-level"},
                 {"--help", "-h", "--no-sign-request"});
  if (auto rc = ParseArgs(args, argc, argv, kImportHelp, 2)) return *rc;
  const std::string src_url = args.positionals()[0];
  const std::string dest_url = args.positionals()[1];
  if (Status s = SetUpCommandLog(args); !s.ok()) return Fail(s.message());

  uint64_t from = 0, to = UINT64_MAX;
  if (auto v = args.Get("--from-step")) {
    Expected<uint64_t> s = ParseStep(*v);
    if (!s.ok()) return Fail(s.status().message());
    from = *s;
  }
  if (auto v = args.Get("--to-step")) {
    Expected<uint64_t> s = ParseStep(*v);
    if (!s.ok()) return Fail(s.status().message());
    to = *s;
  }
  PushOptions opts;
  if (auto v = args.Get("--keyframe-ratio")) {
    Expected<double> r = ParseDouble(*v);
    if (!r.ok()) return Fail(r.status());
    opts.keyframes.max_chain_ratio = *r;
  }
  if (auto v = args.Get("--keyframe-depth")) {
    Expected<double> d = ParseDouble(*v);
    if (!d.ok() || *d < 1) return Fail("--keyframe-depth expects a count >= 1");
    opts.keyframes.max_depth = static_cast<uint32_t>(*d);
  }
  size_t threads = 8;
  if (auto v = args.Get("--threads")) {
    Expected<double> n = ParseDouble(*v);
    if (!n.ok() || *n < 1) return Fail("--threads expects a count >= 1");
    threads = static_cast<size_t>(*n);
  }
  uint64_t cache_size = 20ull << 30;
  if (auto v = args.Get("--cache-size")) {
    Expected<uint64_t> s = ParseSize(*v);
    if (!s.ok()) return Fail(s.status());
    cache_size = *s;
  }
  const std::string cache_dir = args.GetOr("--cache-dir", DefaultCacheDir());
  const std::string model = args.GetOr("--model", TrlModelNameFromUrl(src_url));
  if (Status s = ValidateModelName(model); !s.ok()) return Fail(s.WithContext("--model"));

  Expected<StoreOptions> so = StoreOptionsFromArgs(args);
  if (!so.ok()) return Fail(so.status());
  Expected<OpenedStore> src_store = OpenStore(src_url, *so);
  if (!src_store.ok()) return Fail(src_store.status());
  Expected<std::shared_ptr<TrlVersions>> trl = OpenTrlVersions(src_store->store, model);
  if (!trl.ok()) return Fail(trl.status());
  std::unique_ptr<Bucket> src = Bucket::FromDerived(src_store->store, *trl);
  Expected<OpenedStore> dest_store = OpenStore(dest_url, *so);
  if (!dest_store.ok()) return Fail(dest_store.status());
  Expected<std::unique_ptr<Bucket>> dest = Bucket::Open(dest_store->store);
  if (!dest.ok()) return Fail(dest.status());
  Expected<std::unique_ptr<ChunkCache>> cache = ChunkCache::Open(cache_dir, cache_size);
  if (!cache.ok()) return Fail(cache.status());
  ThreadPool pool(threads);

  Expected<std::vector<TrlStep>> steps = (*trl)->Steps();
  if (!steps.ok()) return Fail(steps.status());
  Expected<std::vector<VersionInfo>> src_versions = src->ListVersions(model);
  if (!src_versions.ok()) return Fail(src_versions.status());
  std::map<std::string, bool> is_version;
  for (const VersionInfo& v : *src_versions) is_version[v.version] = true;
  Expected<std::vector<VersionInfo>> existing = (*dest)->ListVersions(model);
  if (!existing.ok()) return Fail(existing.status());
  std::map<std::string, bool> in_dest;
  for (const VersionInfo& v : *existing) in_dest[v.version] = true;
  std::map<uint64_t, std::string> imported;  // step -> version name, of steps DEST holds
  for (const TrlStep& s : *steps) {
    if (in_dest.count(TrlVersionName(s.step))) imported[s.step] = TrlVersionName(s.step);
  }

  TempDirGuard tmp{cache_dir + "/import-tmp-" + std::to_string(::getpid())};
  std::error_code ec;
  std::filesystem::create_directories(tmp.path, ec);
  if (ec) return Fail("cannot create " + tmp.path + ": " + ec.message());

  Materializer materializer(src.get(), nullptr);
  std::shared_ptr<const Manifest> parent;
  std::string parent_file;  // the parent's materialized file, while the next push may use it
  uint64_t total_trl = 0, total_wfs = 0;
  size_t done = 0, skipped = 0;
  std::vector<const TrlStep*> todo;
  for (const TrlStep& s : *steps) {
    if (s.step >= from && s.step <= to && is_version.count(TrlVersionName(s.step))) todo.push_back(&s);
  }
  if (todo.empty()) return Fail("no steps of " + src_url + " in the range to import");
  std::printf("importing %zu steps of %s as %s@step-N into %s\n", todo.size(), src_url.c_str(), model.c_str(),
              dest_url.c_str());
  std::fflush(stdout);
  for (const TrlStep* s : todo) {
    const std::string version = TrlVersionName(s->step);
    if (imported.count(s->step)) {
      Expected<std::shared_ptr<const Manifest>> m = (*dest)->ReadManifest(model, version);
      if (!m.ok()) return Fail(m.status());
      parent = *m;
      ++skipped;
      std::fprintf(stderr, "import: %s@%s is already in %s; skipped\n", model.c_str(), version.c_str(),
                   dest_url.c_str());
      continue;
    }
    if (!parent) {
      // Resuming past the first step: the parent is the newest imported step before this one.
      auto before = imported.lower_bound(s->step);
      if (before != imported.begin()) {
        Expected<std::shared_ptr<const Manifest>> m = (*dest)->ReadManifest(model, std::prev(before)->second);
        if (!m.ok()) return Fail(m.status());
        parent = *m;
      }
    }
    std::fprintf(stderr, "import: %s@%s (%zu of %zu): materializing from %s\n", model.c_str(), version.c_str(),
                 done + skipped + 1, todo.size(), s->key.c_str());
    Expected<std::shared_ptr<const Manifest>> m = src->ReadManifest(model, version);
    if (!m.ok()) return Fail(m.status());
    std::vector<PushFile> files;
    for (const ManifestFile& f : (*m)->files) {
      const std::string local = tmp.path + "/" + version + "." + f.path;
      Status st = MaterializeTo(materializer, pool, **m, f, local);
      if (!st.ok()) return Fail(st);
      files.push_back({f.path, local});
    }
    std::shared_ptr<Progress> progress = std::make_shared<Progress>("push " + model + "@" + version, 0);
    opts.progress = [p = progress.get()](uint64_t d, uint64_t t) { p->Update(d, t); };
    Expected<PushResult> r = PushVersion(**dest, cache->get(), pool, {model, version}, parent, files, opts);
    progress->Finish();
    if (!r.ok()) return Fail(r.status().WithContext("pushing " + model + "@" + version));
    if (!parent_file.empty()) std::filesystem::remove(parent_file, ec);
    parent_file = files.empty() ? "" : files.front().local_path;
    for (size_t i = 1; i < files.size(); ++i) std::filesystem::remove(files[i].local_path, ec);
    parent = r->manifest;
    const uint64_t stored = r->manifest->stats.stored_bytes;
    total_trl += s->size;
    total_wfs += stored;
    ++done;
    std::printf("%s@%s (%s): TRL %s (%llu bytes), weightfs %s (%llu bytes), TRL/weightfs %s\n", model.c_str(),
                version.c_str(), s->anchor ? "anchor" : "delta", FormatBytes(static_cast<double>(s->size)).c_str(),
                static_cast<unsigned long long>(s->size), FormatBytes(static_cast<double>(stored)).c_str(),
                static_cast<unsigned long long>(stored), Times(s->size, stored).c_str());
    std::fflush(stdout);
  }
  if (done == 0) {
    std::printf("total: nothing to import; all %zu steps are already in %s\n", skipped, dest_url.c_str());
    return 0;
  }
  std::printf("total: %zu steps imported, %zu already there; TRL %s (%llu bytes), weightfs %s (%llu bytes), "
              "TRL/weightfs %s\n",
              done, skipped, FormatBytes(static_cast<double>(total_trl)).c_str(),
              static_cast<unsigned long long>(total_trl), FormatBytes(static_cast<double>(total_wfs)).c_str(),
              static_cast<unsigned long long>(total_wfs), Times(total_trl, total_wfs).c_str());
  return 0;
}

}  // namespace weightfs::cli

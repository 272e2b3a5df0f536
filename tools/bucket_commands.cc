// weightfs init / push / pull / cat / log / verify / gc: the bucket engine without FUSE.
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cmath>
#include <set>
#include <chrono>
#include <filesystem>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>

#include <nlohmann/json.hpp>

#include "hub/engine/bucket.h"
#include "hub/engine/chunk_cache.h"
#include "hub/engine/gc.h"
#include "hub/engine/lease.h"
#include "hub/engine/materializer.h"
#include "hub/engine/push_record.h"
#include "hub/engine/shared_tier.h"
#include "hub/engine/staged_version.h"
#include "hub/engine/version_reader.h"
#include "hub/engine/version_writer.h"
#include "hub/hf/hf_base.h"
#include "hub/open_bucket.h"
#include "hub/open_store.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "tools/logging.h"
#include "tools/push_sources.h"
#include "tools/store_args.h"

namespace weightfs::cli {
namespace {

constexpr const char* kBucketHelp = R"(
BUCKET is a directory (path or file:///path), a WebDAV server (http://host:port/prefix,
https://...), an S3 bucket (s3://bucket/prefix; endpoint from --endpoint or
AWS_ENDPOINT_URL, credentials as the AWS CLI finds them: AWS_ACCESS_KEY_ID and
AWS_SECRET_ACCESS_KEY, AWS_PROFILE in ~/.aws (keys, role_arn, credential_process), EKS
web identity, ECS/EKS container credentials, the EC2 instance role; region from --region
or AWS_REGION; anonymous only with --no-sign-request), or a Hugging
Face Storage Bucket (hf://buckets/NAMESPACE/NAME/prefix: reads from HF_ENDPOINT
[https://huggingface.co] with HF_TOKEN or the token file under HF_HOME; writes through the
Hub's S3 gateway (--endpoint or HF_S3_ENDPOINT [https://s3.hf.co]) with an HFAK... key pair
made on the Hub, in HF_S3_ACCESS_KEY_ID/HF_S3_SECRET_ACCESS_KEY or profile [hf] of
~/.aws/credentials (HF_S3_PROFILE; AWS keys are never sent to the Hub); create the bucket
first with `hf buckets create NAMESPACE/NAME`).

common options:
  --endpoint URL       S3 endpoint (MinIO, Ceph, R2, the Hub's S3 gateway...)
  --region NAME        S3 region                                        [us-east-1]
  --no-sign-request    S3: send requests unsigned (a bucket open to anyone);
                       without it, finding no AWS credentials is an error
  --timeout SECONDS    give up on a request (retries included) after this long;
                       waits the Hugging Face Hub asks for (429, up to its
                       5-minute window) are not counted                    [120]
  --log-level LEVEL    error, warn, info, debug                          [warn]
  -h, --help           show this help
)";

constexpr const char* kCacheHelp = R"(  --cache-dir DIR      local chunk cache: version N cached makes N+1 cost only its deltas
                       [$WEIGHTFS_CACHE_DIR or ~/.cache/weightfs]
  --cache-size BYTES   bound on the cache (LRU eviction)                   [20GiB]
  --no-cache           do not read or fill the cache
  --threads N          parallel chunk workers (decode and fetch)            [8]
  --stats              print requests made and bytes sent/received
)";

const std::vector<std::string> kCommonValues = {"--endpoint", "--region", "--timeout", "--log-level"};
const std::vector<std::string> kCommonFlags = {"--help", "-h", "--no-sign-request"};

std::vector<std::string> Concat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Everything a bucket command needs, built from the common options.
struct Context {
  OpenedStore opened;
  std::unique_ptr<Bucket> bucket;
  std::unique_ptr<ChunkCache> cache;
  std::unique_ptr<ThreadPool> pool;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();

  void PrintStats(const Materializer* m) const {
    const StoreCounters& c = opened.store->counters();
    std::fprintf(stderr,
                 "stats: %llu requests (%llu GET, %llu PUT), received %llu bytes (%s), sent %llu "
                 "bytes (%s)",
                 (unsigned long long)c.requests.load(), (unsigned long long)c.gets.load(),
                 (unsigned long long)c.puts.load(), (unsigned long long)c.bytes_received.load(),
                 FormatBytes(static_cast<double>(c.bytes_received.load())).c_str(),
                 (unsigned long long)c.bytes_sent.load(),
                 FormatBytes(static_cast<double>(c.bytes_sent.load())).c_str());
    if (opened.http) {
      std::fprintf(stderr, ", %llu HTTP retries", (unsigned long long)opened.http->stats().retries.load());
    }
    if (opened.shared) {
      const SharedTierStats& t = opened.shared->stats();
      std::fprintf(stderr, "; shared cache: %llu hits, %llu misses, %llu fills, %llu waits, %llu corrupt, %llu errors, "
                   "received %s",
                   (unsigned long long)t.hits.load(), (unsigned long long)t.misses.load(),
                   (unsigned long long)t.fills.load(), (unsigned long long)t.waits.load(),
                   (unsigned long long)t.corrupt.load(), (unsigned long long)t.errors.load(),
                   FormatBytes(static_cast<double>(t.bytes_received.load())).c_str());
    }
    if (m) {
      const MaterializerStats& s = m->stats();
      std::fprintf(stderr, "; chunks %llu (%llu from cache), payloads fetched %llu (%llu bytes), deltas applied %llu",
                   (unsigned long long)s.chunks.load(), (unsigned long long)s.cache_hits.load(),
                   (unsigned long long)s.payloads_fetched.load(),
                   (unsigned long long)s.payload_bytes.load(),
                   (unsigned long long)s.deltas_applied.load());
    }
    std::fprintf(stderr, "; %.2f s\n", Seconds());
  }
  double Seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
};

// `any_layout`: the read commands also open a TRL delta-sync bucket (read-only versions,
// hub/open_bucket.h); push and gc need a weightfs bucket.
Expected<Context> OpenContext(const ArgParser& args, const std::string& url, bool open_bucket,
                              bool with_cache, bool any_layout = false) {
  WFS_TRY(SetUpCommandLog(args));
  WFS_ASSIGN_OR_RETURN(StoreOptions so, StoreOptionsFromArgs(args));
  Context ctx;
  if (open_bucket) {
    WFS_ASSIGN_OR_RETURN(OpenedBucket ob, OpenBucketUrl(url, so, any_layout));
    ctx.opened = std::move(ob.store);
    ctx.bucket = std::move(ob.bucket);
  } else {
    WFS_ASSIGN_OR_RETURN(ctx.opened, OpenStore(url, so));
  }
  if (with_cache && !args.Has("--no-cache")) {
    uint64_t size = 20ull << 30;
    if (auto s = args.Get("--cache-size")) {
    WFS_ASSIGN_OR_RETURN(size, ParseSize(*s));
  }
    WFS_ASSIGN_OR_RETURN(ctx.cache, ChunkCache::Open(args.GetOr("--cache-dir", DefaultCacheDir()), size));
  }
  size_t threads = 8;
  if (auto t = args.Get("--threads")) {
    WFS_ASSIGN_OR_RETURN(double n, ParseDouble(*t));
    threads = std::max<size_t>(1, static_cast<size_t>(n));
  }
  ctx.pool = std::make_unique<ThreadPool>(threads);
  return ctx;
}

// Parses args; prints help (returns 0) or a usage error (returns 2). nullopt: go on.
std::optional<int> ParseOrHelp(ArgParser& args, int argc, char** argv, const std::string& help,
                               size_t min_positionals, size_t max_positionals) {
  Status s = args.Parse(argc, argv, 1);
  if (args.Has("--help") || args.Has("-h")) {
    std::fputs(help.c_str(), stdout);
    return 0;
  }
  if (!s.ok()) {
    std::fprintf(stderr, "weightfs %s: %s\n", argv[0], s.message().c_str());
    return 2;
  }
  if (args.positionals().size() < min_positionals || args.positionals().size() > max_positionals) {
    std::fprintf(stderr, "weightfs %s: wrong number of arguments (see --help)\n", argv[0]);
    return 2;
  }
  return std::nullopt;
}

// A usage error after parsing: prints it (exit code 2, like ParseOrHelp's).
int Usage(const std::string& message) {
  std::fprintf(stderr, "weightfs: %s\n", message.c_str());
  return 2;
}

std::function<void(uint64_t, uint64_t)> ProgressFn(const std::string& label,
                                                   std::shared_ptr<Progress>* holder) {
  *holder = std::make_shared<Progress>(label, 0);
  Progress* p = holder->get();
  return [p](uint64_t done, uint64_t total) { p->Update(done, total); };
}

std::string Ratio(uint64_t logical, uint64_t stored) {
  if (stored == 0) return "inf";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1fx", static_cast<double>(logical) / static_cast<double>(stored));
  return buf;
}

// ---- init -------------------------------------------------------------------------------------

int InitMain(int argc, char** argv) {
  ArgParser args(Concat(kCommonValues, {"--format"}), kCommonFlags);
  std::string help = std::string(R"(usage: weightfs init BUCKET [--format 1|2]

Makes BUCKET a weightfs bucket (writes weightfs.json); a no-op on a bucket that is one.

options:
  --format N           2 (default): versions are small heads plus binary chunk tables
                       (docs/format2.md); 1: whole JSON manifests, for a bucket that
                       weightfs releases before format 2 must still read
)") + kBucketHelp;
  if (auto rc = ParseOrHelp(args, argc, argv, help, 1, 1)) return *rc;
  const std::string url = args.positionals()[0];
  if (url.find("://") == std::string::npos || url.starts_with("file://")) {
    std::string path = url.starts_with("file://") ? url.substr(7) : url;
    std::error_code ec;
    std::filesystem::create_directories(path, ec);
  }
  Expected<Context> ctx = OpenContext(args, url, /*open_bucket=*/false, /*with_cache=*/false);
  if (!ctx.ok()) return Fail(ctx.status());
  const std::string format = args.GetOr("--format", "2");
  if (format != "1" && format != "2") return Usage("--format takes 1 or 2");
  Status s = Bucket::Init(*ctx->opened.store, format == "1" ? kManifestFormat : kManifestFormat2);
  if (!s.ok()) return Fail(s);
  std::printf("initialized weightfs bucket %s\n", ctx->opened.store->Describe().c_str());
  return 0;
}

// ---- push -------------------------------------------------------------------------------------

// Ctrl-C (or SIGTERM: a preempted job) during a push: says what stays in the bucket and how to
// go on, then exits 128 + the signal (130, 143). The handler only notes the signal; a thread of
// ours prints (it may take locks) and exits.
volatile std::sig_atomic_t g_push_interrupted = 0;

class PushInterruptReport {
 public:
  PushInterruptReport(std::shared_ptr<PushRecord> record, std::string bucket)
      : record_(std::move(record)), bucket_(std::move(bucket)) {
    struct sigaction sa {};
    sa.sa_handler = [](int sig) { g_push_interrupted = sig; };
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGINT, &sa, &old_int_);
    ::sigaction(SIGTERM, &sa, &old_term_);
    watcher_ = std::thread([this] {
      while (!done_) {
        if (g_push_interrupted) Report();
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    });
  }
  ~PushInterruptReport() {
    done_ = true;
    watcher_.join();
    ::sigaction(SIGINT, &old_int_, nullptr);
    ::sigaction(SIGTERM, &old_term_, nullptr);
  }
  PushInterruptReport(const PushInterruptReport&) = delete;
  PushInterruptReport& operator=(const PushInterruptReport&) = delete;

  // push --parts: this part is in the bucket (`command` waits for the others); from now on an
  // interrupt leaves the part there, and the version is published without this process.
  void PartSubmitted(std::string command) {
    std::lock_guard<std::mutex> lock(mu_);
    submitted_ = std::move(command);
  }

 private:
  [[noreturn]] void Report() {
    std::string submitted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      submitted = submitted_;
    }
    if (!submitted.empty()) {
      const std::string text = "\nweightfs: push interrupted while waiting for the other parts; this part is in the "
                               "bucket and counts: the version is published when the last part is in (" + submitted +
                               " again waits for it)";
      std::fprintf(stderr, "%s\n", text.c_str());
      std::fflush(stderr);
      std::_Exit(128 + static_cast<int>(g_push_interrupted));
    }
    std::string text = "\nweightfs: push interrupted; nothing was published.";
    if (!record_) {
      text += " The packs uploaded so far are not recorded (--no-cache): the same command sends everything again, "
              "and `weightfs gc " + bucket_ + "` removes them.";
    } else {
      const uint64_t kept = (record_->loaded() ? record_->loaded_bytes() : 0) + record_->recorded_bytes();
      text += " " + FormatBytes(static_cast<double>(kept)) + " of packs from this push are in the bucket, recorded in " +
              record_->path() + ": run the same command again to resume (they are not sent again); `weightfs gc " +
              bucket_ + "` removes them if you do not.";
    }
    std::fprintf(stderr, "%s\n", text.c_str());
    std::fflush(stderr);
    std::_Exit(128 + static_cast<int>(g_push_interrupted));
  }

  std::shared_ptr<PushRecord> record_;
  std::string bucket_;
  std::mutex mu_;
  std::string submitted_;  // guarded by mu_: non-empty once a part is in the bucket
  struct sigaction old_int_ {}, old_term_ {};
  std::atomic<bool> done_{false};
  std::thread watcher_;
};

// "no model NAME in the bucket", with the models it may have meant (a typo, the organisation
// forgotten) or, when none looks alike, a few that are there. `bucket_url` for the message.
std::string NoSuchModel(Bucket& bucket, const std::string& model, const std::string& bucket_url) {
  std::string message = "no model " + model + " in " + bucket_url;
  Expected<std::vector<VersionInfo>> all = bucket.ListVersions();
  if (!all.ok()) return message;
  std::vector<std::string> models;
  for (const VersionInfo& v : *all) {
    if (models.empty() || models.back() != v.model) models.push_back(v.model);
  }
  std::vector<std::string> alike = LookAlike(model, models);
  if (!alike.empty()) return message + "; did you mean " + OrList(alike) + "?";
  if (models.empty()) return message + " (it holds no models yet)";
  if (models.size() > 5) models.resize(5);
  return message + " (its models: " + OrList(models) + (all->size() > 5 ? ", ..." : "") + ")";
}

int PushMain(int argc, char** argv) {
  // `--base hf://ORG/REPO[@REV]` takes a value; a bare `--base` is a flag. Tell them apart here.
  std::vector<std::string> argv_copy(argv, argv + argc);
  for (size_t i = 0; i + 1 < argv_copy.size(); ++i) {
    if (argv_copy[i] == "--base" && argv_copy[i + 1].starts_with("hf://")) argv_copy[i] = "--base-repo";
  }
  std::vector<char*> argv_ptrs;
  for (std::string& a : argv_copy) argv_ptrs.push_back(a.data());
  argv = argv_ptrs.data();
  ArgParser args(Concat(kCommonValues, {"--parent", "--cache-dir", "--cache-size", "--threads",
                                        "--chunk-size", "--pack-size", "--keyframe-ratio",
                                        "--keyframe-depth", "--json", "--base-repo", "--base-name",
                                        "--parts", "--part", "--timeout", "--as"}),
                 Concat(kCommonFlags, {"--no-cache", "--stats", "--base", "--allow-no-weights", "--allow-nested",
                                       "--no-wait", "--allow-invalid"}));
  std::string help = std::string(R"(usage: weightfs push BUCKET MODEL@VERSION PATH... [options]
       weightfs push BUCKET MODEL@VERSION [PATH...] --base hf://ORG/REPO[@REVISION]

Encodes the files (PATH: files, or directories pushed with their relative paths) as a new
version and publishes it. Each chunk is stored as a delta against the same chunk of the parent
version, FULL when its delta chain gets long (keyframe policy), or not at all when unchanged.
Packs upload while encoding goes on; the manifest is created last with create-if-absent, so
a version is either fully published or invisible, and of two pushes of one name exactly one
wins. Interrupted (Ctrl-C, a preempted job, a bucket that went away), the same command again
resumes: the packs already in the bucket are not sent again (a record in the cache directory
says which chunks they hold; nothing without --no-cache).

options:
  --parent VERSION     version to delta against     [the model's latest; none for a new model]
  --as NAME            store the one FILE given under the path NAME: checkpoints saved as
                       step-0001.safetensors, step-0002.safetensors... are deltas of each
                       other only under one name (deltas pair files by path)
  --base               push as a base (no parent) even if the model has versions
  --base hf://ORG/REPO[@REVISION]
                       the parent is a model repo on the Hugging Face Hub (HF_ENDPOINT,
                       HF_TOKEN or the token file under HF_HOME) at REVISION's commit [main]:
                       it is registered once as MODEL@hf-<commit> (a manifest only; the bytes
                       stay in the repo, read from the local HF cache when there) and VERSION
                       is pushed as deltas against it. Without PATH only the base is registered.
  --base-name NAME     version name of that base                     [hf-<commit>]
  --allow-no-weights   publish even if no file is weights (.safetensors, .bin, .pt, .pth,
                       .ckpt, .gguf, .npy, .npz, .h5, .msgpack, .onnx, ...); refused otherwise
  --allow-nested       publish a directory that holds version directories (step-1/ step-2/,
                       or MODEL@VERSION/, each with weights) as one version; refused otherwise
  --allow-invalid      store a file that claims to be safetensors (by its name or its
                       header) and does not parse (truncated, a header that lies about its
                       tensors) as opaque bytes; refused otherwise, naming the file
  --chunk-size BYTES   chunk size                                           [4MiB]
  --pack-size BYTES    target pack size                                      [32MiB]
  --keyframe-ratio X   store a chunk FULL once its delta chain would exceed X times its FULL
                       size                                                  [1.0]
  --keyframe-depth N   ... or N deltas                                       [64]

A version written by several nodes (docs/parts.md), each pushing the files it holds:
  --parts N            this push is one of N parts of MODEL@VERSION; the version is published
                       once all N are in, with every part's files (files no part pushes are
                       inherited from the parent). The first part fixes the parent: later
                       ones use it (a different --parent is refused)
  --part ID            this part's id (the rank; A-Z a-z 0-9 . _ -)
                       [HOST-<hash of the PATHs>: the same push again is the same part]
  --timeout S          stop waiting for the other parts after S seconds: exit 124, this part
                       stays in the bucket (push again to go on waiting)
  --no-wait            return once this part is in the bucket
)") + kCacheHelp + kBucketHelp;
  if (auto rc = ParseOrHelp(args, argc, argv, help, 2, 1u << 20)) return *rc;
  const auto& pos = args.positionals();
  const std::optional<std::string> base_repo = args.Get("--base-repo");
  if (pos.size() < 3 && !base_repo) return Usage("push needs BUCKET MODEL@VERSION PATH...; see --help");
  if (base_repo && (args.Has("--base") || args.Has("--parent"))) {
    return Usage("--base hf://... names the parent; it cannot go with --parent or a bare --base");
  }
  Expected<VersionRef> target = ParseVersionRef(pos[1], /*version_required=*/true);
  if (!target.ok()) return Fail(target.status());
  std::vector<PushFile> files;
  for (size_t i = 2; i < pos.size(); ++i) {
    std::error_code ec;
    if (std::filesystem::is_directory(pos[i], ec)) {
      Expected<std::vector<PushFile>> under = FilesUnder(pos[i]);
      if (!under.ok()) return Fail(under.status());
      if (!args.Has("--allow-nested")) {
        if (Status s = CheckNotVersionParent(pos[i], *under); !s.ok()) return Fail(s.message());
      }
      files.insert(files.end(), under->begin(), under->end());
    } else if (std::filesystem::is_regular_file(pos[i], ec)) {
      files.push_back({std::filesystem::path(pos[i]).filename().string(), pos[i]});
    } else {
      return Fail(pos[i] + " is not a file or directory");
    }
  }
  if (std::optional<std::string> as = args.Get("--as")) {
    std::error_code ec;
    if (pos.size() != 3 || !std::filesystem::is_regular_file(pos[2], ec)) {
      return Usage("--as NAME renames one FILE; give exactly one file (not a directory)");
    }
    files[0].path = *as;
  }
  if (pos.size() > 2 && !args.Has("--allow-no-weights")) {
    if (Status s = CheckHasWeights({pos.begin() + 2, pos.end()}, files); !s.ok()) return Fail(s.message());
  }
  PushOptions opts;
  opts.allow_invalid = args.Has("--allow-invalid");
  auto size_opt = [&](const char* name, uint64_t* out) -> Status {
    if (auto v = args.Get(name)) {
    WFS_ASSIGN_OR_RETURN(*out, ParseSize(*v));
  }
    return Status::Ok();
  };
  if (Status s = size_opt("--chunk-size", &opts.chunk_bytes); !s.ok()) return Fail(s);
  if (Status s = size_opt("--pack-size", &opts.pack_bytes); !s.ok()) return Fail(s);
  if (opts.chunk_bytes == 0 || opts.chunk_bytes > kMaxChunkBytes) return Fail("--chunk-size must be in (0, 64MiB]");
  if (auto v = args.Get("--keyframe-ratio")) {
    Expected<double> r = ParseDouble(*v);
    if (!r.ok()) return Fail(r.status());
    opts.keyframes.max_chain_ratio = *r;
  }
  if (auto v = args.Get("--keyframe-depth")) {
    Expected<double> d = ParseDouble(*v);
    if (!d.ok()) return Fail(d.status());
    opts.keyframes.max_depth = static_cast<uint32_t>(*d);
  }
  Expected<Context> ctx = OpenContext(args, pos[0], true, true);
  if (!ctx.ok()) return Fail(ctx.status());
  std::shared_ptr<const Manifest> parent;
  if (base_repo) {
    std::shared_ptr<Progress> base_progress;
    auto fn = ProgressFn("register " + *base_repo, &base_progress);
    Expected<HfBaseResult> base = EnsureHfBase(*ctx->bucket, *ctx->pool, ctx->opened.http, target->model,
                                               *base_repo, args.GetOr("--base-name", ""), opts.chunk_bytes, fn);
    base_progress->Finish();
    if (!base.ok()) return Fail(base.status());
    parent = base->manifest;
    std::printf("%s %s@%s: %s at commit %s, %zu files, %s (stored in the bucket: the manifest only)\n",
                base->created ? "registered" : "using", target->model.c_str(), parent->version.c_str(),
                base->repo.c_str(), base->commit.c_str(), parent->files.size(),
                FormatBytes(static_cast<double>(parent->stats.logical_bytes)).c_str());
    if (pos.size() < 3) return 0;
    if (target->version == parent->version) return Usage("VERSION must differ from the base's name");
  } else if (args.Has("--parts") && !args.Has("--parent") && !args.Has("--base")) {
    // One of several parts: the parent is the staged version's, once its first part fixed it.
    Expected<std::optional<std::pair<int, std::optional<std::string>>>> intent =
        StagedVersion(*ctx->bucket, target->model, target->version).Intent();
    if (!intent.ok()) return Fail(intent.status());
    std::optional<std::string> fixed;
    // (No intent: published already, its staging cleared, or not staged yet.)
    Expected<std::shared_ptr<const Manifest>> published =
        *intent ? Expected<std::shared_ptr<const Manifest>>(Status::NotFound("staged"))
                : ctx->bucket->ReadManifest(target->model, target->version);
    if (*intent) {
      fixed = (*intent)->second;
    } else if (published.ok()) {
      // This push again once the version is published (a job's retry) is checked against the
      // version as published: encode against its parent (the latest is the version itself, or
      // a descendant of it, whose history holds it).
      fixed = (*published)->parent;
    } else if (published.status().kind() != ErrorKind::kNotFound) {
      return Fail(published.status());
    } else if (Expected<std::shared_ptr<const Manifest>> m = ctx->bucket->Latest(target->model); m.ok()) {
      fixed = (*m)->version;
    } else if (m.status().kind() != ErrorKind::kNotFound) {
      return Fail(m.status());
    }
    if (fixed) {
      Expected<std::shared_ptr<const Manifest>> m = ctx->bucket->ReadManifest(target->model, *fixed);
      if (!m.ok()) return Fail(m.status());
      parent = *m;
    }
  } else if (auto p = args.Get("--parent")) {
    Expected<std::shared_ptr<const Manifest>> m = ctx->bucket->ReadManifest(target->model, *p);
    if (!m.ok()) return Fail(m.status());
    parent = *m;
  } else if (!args.Has("--base")) {
    Expected<std::shared_ptr<const Manifest>> m = ctx->bucket->Latest(target->model);
    if (m.ok()) parent = *m;
    else if (m.status().kind() != ErrorKind::kNotFound) return Fail(m.status());
  }
  if (!parent && !args.Has("--base")) {
    // A new model: said, with the models the name may have meant (`push BUCKET rl@step-1` for
    // acme/rl stores a full base of a model nobody reads).
    std::string alike = NoSuchModel(*ctx->bucket, target->model, pos[0]);
    const size_t mean = alike.find("; did you mean ");
    std::printf("new model %s (no versions yet): storing a full base%s\n", target->model.c_str(),
                mean == std::string::npos ? "" : (" (" + alike.substr(mean + 2) +
                                                   " Push to that name to store deltas against it)")
                                                      .c_str());
  }
  // The record of what this push puts in the bucket, for the same push run again after an
  // interruption (hub/engine/push_record.h); keyed by bucket, version, parent and chunk size.
  std::shared_ptr<PushRecord> record;
  if (!args.Has("--no-cache")) {
    const std::string what = ctx->bucket->Describe() + "\n" + target->model + "@" + target->version + "\n" +
                             (parent ? parent->version : std::string("-")) + "\n" + std::to_string(opts.chunk_bytes) +
                             "\n" + args.GetOr("--part", "");
    record = std::make_shared<PushRecord>(PushRecord::PathFor(args.GetOr("--cache-dir", DefaultCacheDir()), what));
    opts.record = record.get();
    std::error_code ec;
    if (std::filesystem::file_size(record->path(), ec) > 64 && !ec) {
      std::printf("resuming an interrupted push of %s (its record: %s)\n", pos[1].c_str(), record->path().c_str());
      std::fflush(stdout);
    }
  }
  PushInterruptReport interrupt(record, pos[0]);
  auto say_resumed = [&](const PushResult& r) {
    if (r.resumed_chunks == 0) return;
    std::printf("resumed: %llu chunks (%s stored) were in the bucket from the interrupted push and were not sent again\n",
                (unsigned long long)r.resumed_chunks, FormatBytes(static_cast<double>(r.resumed_bytes)).c_str());
  };
  std::shared_ptr<Progress> progress;
  opts.progress = ProgressFn("push " + pos[1], &progress);
  if (args.Has("--parts")) {
    PushPartOptions part;
    Expected<double> n = ParseDouble(args.GetOr("--parts", ""));
    if (!n.ok() || *n < 1 || *n != static_cast<int>(*n)) return Fail("--parts: give the number of writers (1 or more)");
    part.parts = static_cast<int>(*n);
    part.wait = !args.Has("--no-wait");
    if (auto t = args.Get("--timeout")) {
      Expected<double> secs = ParseDouble(*t);
      if (!secs.ok() || *secs < 0) return Fail("--timeout " + *t + ": give seconds");
      part.deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(*secs * 1000));
    }
    if (auto id = args.Get("--part")) {
      part.id = *id;
    } else {
      std::string paths;
      for (size_t i = 2; i < pos.size(); ++i) paths += std::filesystem::absolute(pos[i]).lexically_normal().string() + "\n";
      part.id = StagedVersion::SanitizePartId(HostName()) + "-" +
                HashChunk(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(paths.data()), paths.size()))
                    .ToHex()
                    .substr(0, 8);
    }
    std::string last;
    part.progress = [&](const StagedState& st) {
      if (st.kind == StagedState::kWaiting) interrupt.PartSubmitted("the same command");
      const std::string line = std::to_string(st.in.size()) + " of " + std::to_string(part.parts) + " parts in";
      if (line != last && st.kind == StagedState::kWaiting) std::fprintf(stderr, "%s: %s\n", pos[1].c_str(), line.c_str());
      last = line;
    };
    PushResult result;
    Expected<StagedState> st = PushPart(*ctx->bucket, ctx->cache.get(), *ctx->pool, *target, parent, files, opts,
                                        part, &result);
    progress->Finish();
    say_resumed(result);
    if (!st.ok()) {
      if (st.status().kind() == ErrorKind::kTimeout) {
        std::fprintf(stderr, "weightfs: %s\n", st.status().message().c_str());
        return 124;
      }
      return Fail(st.status());
    }
    if (st->kind == StagedState::kPublished) {
      std::printf("published %s@%s from %d parts (this part %s: %zu files, stored %s); %.1f s\n",
                  target->model.c_str(), target->version.c_str(), part.parts, part.id.c_str(), files.size(),
                  FormatBytes(static_cast<double>(result.pack_bytes)).c_str(), ctx->Seconds());
    } else {
      std::printf("part %s of %s@%s is in the bucket (%zu of %d parts in; %zu files, stored %s); %.1f s\n",
                  part.id.c_str(), target->model.c_str(), target->version.c_str(), st->in.size(), part.parts,
                  files.size(), FormatBytes(static_cast<double>(result.pack_bytes)).c_str(), ctx->Seconds());
    }
    return 0;
  }
  Expected<PushResult> r = PushVersion(*ctx->bucket, ctx->cache.get(), *ctx->pool, *target, parent,
                                       files, opts);
  progress->Finish();
  if (!r.ok()) return Fail(r.status());
  say_resumed(*r);
  const Manifest& m = *r->manifest;
  std::printf("published %s@%s%s: %zu files, %s, stored %s (%s), %.2f%% of elements changed, "
              "chunks: %llu full, %llu delta, %llu unchanged; %zu packs; %.1f s\n",
              m.model.c_str(), m.version.c_str(),
              m.parent ? (" (parent " + *m.parent + ")").c_str() : " (base)", m.files.size(),
              FormatBytes(static_cast<double>(m.stats.logical_bytes)).c_str(),
              FormatBytes(static_cast<double>(m.stats.stored_bytes)).c_str(),
              Ratio(m.stats.logical_bytes, m.stats.stored_bytes).c_str(),
              100.0 * m.stats.changed_fraction(), (unsigned long long)r->full_chunks,
              (unsigned long long)r->delta_chunks, (unsigned long long)r->same_chunks, r->packs,
              ctx->Seconds());
  if (args.Has("--stats")) ctx->PrintStats(nullptr);
  return 0;
}

// ---- pull / verify / cat ------------------------------------------------------------------------

int PullMain(int argc, char** argv) {
  ArgParser args(Concat(Concat(kCommonValues, {"--cache-dir", "--cache-size", "--threads"}), kSharedCacheValues),
                 Concat(kCommonFlags, {"--no-cache", "--stats"}));
  std::string help = std::string(R"(usage: weightfs pull BUCKET MODEL@VERSION DEST [options]

Materializes a version into DEST (created if needed). Chunks come from the local cache when
there, else from the nearest cached ancestor plus the deltas after it, else from the keyframe.
Every chunk is verified before it is written; each file is written as FILE.weightfs-partial
and renamed only once its SHA-256 matches the manifest.

options:
)") + kCacheHelp + kSharedCacheHelp + kBucketHelp;
  if (auto rc = ParseOrHelp(args, argc, argv, help, 3, 3)) return *rc;
  const auto& pos = args.positionals();
  Expected<VersionRef> ref = ParseVersionRef(pos[1], true);
  if (!ref.ok()) return Fail(ref.status());
  Expected<Context> ctx = OpenContext(args, pos[0], true, true, /*any_layout=*/true);
  if (!ctx.ok()) return Fail(ctx.status());
  Expected<std::shared_ptr<const Manifest>> m = ctx->bucket->ReadFullManifest(ref->model, ref->version);
  if (!m.ok()) return Fail(m.status());
  std::error_code ec;
  std::filesystem::create_directories(pos[2], ec);
  if (ec) return Fail("cannot create " + pos[2] + ": " + ec.message());
  Materializer materializer(ctx->bucket.get(), ctx->cache.get());
  std::shared_ptr<Progress> progress;
  ReadOptions ro;
  ro.progress = ProgressFn("pull " + pos[1], &progress);
  // The cache gets copies of the chunks (not references to DEST): a pulled directory is often
  // deleted or overwritten once loaded, and the next pull must still find version N here.
  Status s = PullVersion(materializer, *ctx->pool, **m, pos[2], ro);
  progress->Finish();
  if (!s.ok()) return Fail(s);
  std::printf("pulled %s (%zu files, %s) into %s, SHA-256 verified; %.1f s\n", pos[1].c_str(),
              (*m)->files.size(), FormatBytes(static_cast<double>((*m)->stats.logical_bytes)).c_str(),
              pos[2].c_str(), ctx->Seconds());
  if (args.Has("--stats")) ctx->PrintStats(&materializer);
  return 0;
}

int VerifyMain(int argc, char** argv) {
  ArgParser args(Concat(kCommonValues, {"--threads"}), Concat(kCommonFlags, {"--stats"}));
  std::string help = std::string(R"(usage: weightfs verify BUCKET MODEL@VERSION [options]

Re-materializes every chunk of the version from the bucket (no cache), checks every chunk
hash and every file's SHA-256, and reports the first failure by file and chunk.
Exit status 0 only if everything verifies.

options:
  --threads N          parallel chunk workers                                [8]
  --stats              print requests made and bytes received
)") + kBucketHelp;
  if (auto rc = ParseOrHelp(args, argc, argv, help, 2, 2)) return *rc;
  const auto& pos = args.positionals();
  Expected<VersionRef> ref = ParseVersionRef(pos[1], true);
  if (!ref.ok()) return Fail(ref.status());
  Expected<Context> ctx = OpenContext(args, pos[0], true, false, /*any_layout=*/true);
  if (!ctx.ok()) return Fail(ctx.status());
  Expected<std::shared_ptr<const Manifest>> m = ctx->bucket->ReadFullManifest(ref->model, ref->version);
  if (!m.ok()) return Fail(m.status());
  Materializer materializer(ctx->bucket.get(), nullptr);
  std::shared_ptr<Progress> progress;
  ReadOptions ro;
  ro.progress = ProgressFn("verify " + pos[1], &progress);
  Status s = VerifyVersion(materializer, *ctx->pool, **m, ro);
  progress->Finish();
  if (args.Has("--stats")) ctx->PrintStats(&materializer);
  if (!s.ok()) return Fail("verify failed: " + s.ToString());
  std::printf("%s: %zu files, %zu chunks verified; %.1f s\n", pos[1].c_str(), (*m)->files.size(),
              static_cast<size_t>(materializer.stats().chunks.load()), ctx->Seconds());
  return 0;
}

int CatMain(int argc, char** argv) {
  ArgParser args(Concat(Concat(kCommonValues, {"--cache-dir", "--cache-size", "--offset", "--length", "--threads"}),
                        kSharedCacheValues),
                 Concat(kCommonFlags, {"--no-cache", "--stats"}));
  std::string help = std::string(R"(usage: weightfs cat BUCKET MODEL@VERSION/FILE [options]

Writes a file of a version (or a byte range of it) to stdout, materializing only the chunks
the range covers.

options:
  --offset N           first byte                                             [0]
  --length N           bytes to write                                         [to the end]
)") + kCacheHelp + kSharedCacheHelp + kBucketHelp;
  if (auto rc = ParseOrHelp(args, argc, argv, help, 2, 2)) return *rc;
  const auto& pos = args.positionals();
  const std::string& spec = pos[1];
  size_t at = spec.rfind('@');
  size_t slash = at == std::string::npos ? std::string::npos : spec.find('/', at);
  if (slash == std::string::npos) return Fail("expected MODEL@VERSION/FILE, got '" + spec + "'");
  Expected<VersionRef> ref = ParseVersionRef(spec.substr(0, slash), true);
  if (!ref.ok()) return Fail(ref.status());
  const std::string path = spec.substr(slash + 1);
  uint64_t offset = 0, length = UINT64_MAX;
  if (auto v = args.Get("--offset")) {
    Expected<uint64_t> o = ParseSize(*v);
    if (!o.ok()) return Fail(o.status());
    offset = *o;
  }
  if (auto v = args.Get("--length")) {
    Expected<uint64_t> l = ParseSize(*v);
    if (!l.ok()) return Fail(l.status());
    length = *l;
  }
  Expected<Context> ctx = OpenContext(args, pos[0], true, true, /*any_layout=*/true);
  if (!ctx.ok()) return Fail(ctx.status());
  Expected<std::shared_ptr<const Manifest>> m = ctx->bucket->ReadManifest(ref->model, ref->version);
  if (!m.ok()) return Fail(m.status());
  if (!(*m)->FindFile(path)) return Fail(spec + ": no such file in the version");
  Expected<std::shared_ptr<const ManifestFile>> rows = ctx->bucket->File(*m, path);
  if (!rows.ok()) return Fail(rows.status());
  const ManifestFile* file = rows->get();
  Materializer materializer(ctx->bucket.get(), ctx->cache.get());
  Status s = ReadRange(materializer, **m, *file, offset, length, [](std::span<const uint8_t> b) {
    if (std::fwrite(b.data(), 1, b.size(), stdout) != b.size()) {
      return Status::IOError("writing to stdout failed");
    }
    return Status::Ok();
  });
  std::fflush(stdout);
  if (args.Has("--stats")) ctx->PrintStats(&materializer);
  if (!s.ok()) return Fail(s);
  return 0;
}

// ---- log ----------------------------------------------------------------------------------------

// Whether a failure to read one manifest is that manifest's own (its bytes: corrupt, too large,
// a newer format, a bad name) rather than the bucket's (unreachable, refused credentials,
// timeouts), which every other manifest would hit too.
bool ManifestsOwnFailure(const Status& s) {
  switch (s.kind()) {
    case ErrorKind::kCorruption:
    case ErrorKind::kInvalidArgument:
    case ErrorKind::kResourceExhausted:
    case ErrorKind::kUnsupported: return true;
    default: return false;
  }
}

int LogMain(int argc, char** argv) {
  ArgParser args(Concat(kCommonValues, {"--last"}), Concat(kCommonFlags, {"--json"}));
  std::string help = std::string(R"(usage: weightfs log BUCKET [MODEL] [--last N] [--json]

Lists published versions, oldest first per model: parent, creation time, logical bytes,
bytes the version stored, ratio, and the fraction of elements that changed vs the parent.
Versions are printed as they are read (a model with thousands of versions streams, in bounded
memory); their order comes from the bucket's listing (each version's time marker), so
--last N (the newest N of each model) reads only those N versions.

A version whose manifest cannot be read (corrupt, too large, a newer format) is listed as
UNREADABLE after its model's other versions, with an error line on stderr naming it and why;
with --json its entry has "model", "version" and "error" instead of the other fields. The
other versions are listed as usual. Exit status: 0 when every version was read, 1 when any
could not be (or on any other error), 2 for a usage error. A bucket that cannot be listed or
stops answering (refused credentials, timeouts) fails the whole command.

options:
  --last N             only the newest N versions of each model
  --json               one JSON array of objects (streamed)
)") + kBucketHelp;
  if (auto rc = ParseOrHelp(args, argc, argv, help, 1, 2)) return *rc;
  const auto& pos = args.positionals();
  if (pos.size() > 1 && pos[1].find('@') != std::string::npos) {
    const std::string model = pos[1].substr(0, pos[1].find('@'));
    return Usage("log takes a MODEL, not MODEL@VERSION: `weightfs log " + pos[0] + " " + model +
                 "` lists the versions of " + model + " (--last N for the newest)");
  }
  std::optional<size_t> last;
  if (auto n = args.Get("--last")) {
    Expected<double> v = ParseDouble(*n);
    if (!v.ok() || *v < 1 || *v != static_cast<double>(static_cast<size_t>(*v))) return Usage("--last takes a count >= 1");
    last = static_cast<size_t>(*v);
  }
  Expected<Context> ctx = OpenContext(args, pos[0], true, false, /*any_layout=*/true);
  if (!ctx.ok()) return Fail(ctx.status());
  Expected<std::vector<VersionInfo>> versions =
      ctx->bucket->ListVersions(pos.size() > 1 ? pos[1] : "");
  if (!versions.ok()) return Fail(versions.status());
  const bool json = args.Has("--json");
  size_t unreadable = 0, printed = 0;
  bool header = false;
  if (json) std::printf("[");
  auto print_error = [&](const VersionInfo& v, const Status& error) {
    if (json) {
      std::printf("%s\n  %s", printed++ ? "," : "",
                  nlohmann::json{{"model", v.model}, {"version", v.version}, {"error", error.ToString()}}.dump().c_str());
    } else {
      printed++;
      std::printf("%-40s UNREADABLE (%s)\n", (v.model + "@" + v.version).c_str(),
                  std::string(ErrorKindName(error.kind())).c_str());
    }
  };
  // A parent that gc retired is named as gone (its deltas were rebased away).
  std::set<std::string> listed;
  for (const VersionInfo& v : *versions) listed.insert(v.model + "@" + v.version);
  auto parent_of = [&](const Manifest& m) -> std::string {
    if (!m.parent) return "-";
    return listed.count(m.model + "@" + *m.parent) ? *m.parent : *m.parent + " (gone)";
  };
  auto print = [&](const Manifest& m) {
    if (json) {
      const nlohmann::json j = {{"model", m.model}, {"version", m.version},
                                {"parent", m.parent ? nlohmann::json(*m.parent) : nlohmann::json(nullptr)},
                                {"parent_gone", m.parent && !listed.count(m.model + "@" + *m.parent)},
                                {"created", m.created}, {"files", m.files.size()},
                                {"logical_bytes", m.stats.logical_bytes}, {"stored_bytes", m.stats.stored_bytes},
                                {"changed_fraction", m.stats.changed_fraction()}};
      std::printf("%s\n  %s", printed++ ? "," : "", j.dump().c_str());
      return;
    }
    printed++;
    if (!header) {
      header = true;
      std::printf("%-40s %-14s %-24s %10s %10s %8s %8s\n", "VERSION", "PARENT", "CREATED", "SIZE",
                  "STORED", "RATIO", "CHANGED");
    }
    std::printf("%-40s %-14s %-24s %10s %10s %8s %7.2f%%\n", (m.model + "@" + m.version).c_str(),
                parent_of(m).c_str(), m.created.c_str(),
                FormatBytes(static_cast<double>(m.stats.logical_bytes)).c_str(),
                FormatBytes(static_cast<double>(m.stats.stored_bytes)).c_str(),
                Ratio(m.stats.logical_bytes, m.stats.stored_bytes).c_str(),
                100.0 * m.stats.changed_fraction());
  };
  // A manifest's own failure is reported; the bucket failing stops the command.
  auto read = [&](const VersionInfo& v) -> Expected<std::shared_ptr<const Manifest>> {
    return ctx->bucket->ReadManifest(v.model, v.version);
  };
  // Model by model (the listing is sorted by model): oldest first by the creation times the
  // listing gives; a version without a time marker has its head read for it.
  for (size_t begin = 0; begin < versions->size();) {
    size_t end = begin;
    while (end < versions->size() && (*versions)[end].model == (*versions)[begin].model) ++end;
    struct Entry {
      VersionInfo v;
      int64_t created_ms;
    };
    std::vector<Entry> entries;
    std::vector<std::pair<VersionInfo, Status>> bad;
    for (size_t i = begin; i < end; ++i) {
      const VersionInfo& v = (*versions)[i];
      if (v.created_ms) {
        entries.push_back({v, *v.created_ms});
        continue;
      }
      Expected<std::shared_ptr<const Manifest>> m = read(v);
      if (m.ok()) {
        entries.push_back({v, (*m)->created_ms});
      } else if (m.status().kind() == ErrorKind::kNotFound) {
        continue;  // removed since the listing (gc retired it)
      } else if (ManifestsOwnFailure(m.status())) {
        bad.emplace_back(v, m.status());
      } else {
        return Fail(m.status().WithContext("reading " + v.model + "@" + v.version));
      }
    }
    std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
      return std::tie(a.created_ms, a.v.version) < std::tie(b.created_ms, b.v.version);
    });
    if (last && entries.size() > *last) entries.erase(entries.begin(), entries.end() - static_cast<std::ptrdiff_t>(*last));
    for (const Entry& e : entries) {
      Expected<std::shared_ptr<const Manifest>> m = read(e.v);
      if (m.ok()) {
        print(**m);
      } else if (m.status().kind() == ErrorKind::kNotFound) {
        continue;
      } else if (ManifestsOwnFailure(m.status())) {
        bad.emplace_back(e.v, m.status());
      } else {
        return Fail(m.status().WithContext("reading " + e.v.model + "@" + e.v.version));
      }
      std::fflush(stdout);
    }
    std::sort(bad.begin(), bad.end(), [](const auto& a, const auto& b) { return a.first.version < b.first.version; });
    for (const auto& [v, error] : bad) {
      std::fprintf(stderr, "weightfs log: cannot read %s@%s: %s\n", v.model.c_str(), v.version.c_str(),
                   error.ToString().c_str());
      print_error(v, error);
      ++unreadable;
    }
    begin = end;
  }
  // Versions staged in parts, not published yet: who is in, who is late.
  nlohmann::json staged = nlohmann::json::array();
  if (!ctx->bucket->derived()) {
    Expected<std::vector<StagedSummary>> list = StagedVersion::List(*ctx->bucket, pos.size() > 1 ? pos[1] : "");
    if (!list.ok()) return Fail(list.status().WithContext("listing staged versions"));
    staged = nlohmann::json::parse(StagedJson(*list));
  }
  if (json) {
    for (nlohmann::json& v : staged) {
      v["staged"] = true;
      std::printf("%s\n  %s", printed++ ? "," : "", v.dump().c_str());
    }
    std::printf("%s]\n", printed ? "\n" : "");
  } else {
    if (printed == 0 && staged.empty() && pos.size() == 1) std::printf("no versions\n");
    PrintStaged(staged);
  }
  if (unreadable) {
    std::fprintf(stderr, "weightfs log: %zu version%s could not be read (see above)\n", unreadable,
                 unreadable == 1 ? "" : "s");
  }
  if (pos.size() > 1 && versions->empty() && staged.empty()) {
    std::fprintf(stderr, "weightfs log: %s\n", NoSuchModel(*ctx->bucket, pos[1], pos[0]).c_str());
    return 1;
  }
  return unreadable ? 1 : 0;
}

// ---- upgrade ------------------------------------------------------------------------------------

int UpgradeMain(int argc, char** argv) {
  ArgParser args(kCommonValues, Concat(kCommonFlags, {"--dry-run"}));
  std::string help = std::string(R"(usage: weightfs upgrade BUCKET [--dry-run]

Converts a bucket to format 2 in place (docs/format2.md): every version's manifest is rewritten
as a small head plus a binary table of its chunk rows (the table first, then the head over the
manifest, so a crash leaves every version readable, in one format or the other), every version
gets its time marker, and weightfs.json says format 2 last. Nothing else changes: the same
packs, the same bytes. Run it again after an interruption: it goes on where it stopped.

Stop readers and writers that use an older weightfs first: they cannot read format 2. A bucket
already in format 2 is checked (versions left in format 1 converted, markers added), and its
versions with a file of more than 512 chunk rows in one table get their tables rewritten in
blocks (a reader of one chunk then reads its block of rows, not the file's: docs/format2.md
"Blocks"; weightfs releases from before blocks cannot read such versions). The old tables
stay until `weightfs gc`.

options:
  --dry-run            count what would be converted, change nothing
)") + kBucketHelp;
  if (auto rc = ParseOrHelp(args, argc, argv, help, 1, 1)) return *rc;
  Expected<Context> ctx = OpenContext(args, args.positionals()[0], true, false);
  if (!ctx.ok()) return Fail(ctx.status());
  Bucket& bucket = *ctx->bucket;
  const bool dry = args.Has("--dry-run");
  Expected<std::vector<VersionInfo>> versions = bucket.ListVersions();
  if (!versions.ok()) return Fail(versions.status());
  size_t converted = 0, already = 0, markers = 0, blocked = 0;
  uint64_t before_bytes = 0, after_bytes = 0, rows = 0;
  std::shared_ptr<Progress> progress = std::make_shared<Progress>("upgrade", 0, "versions");
  for (size_t i = 0; i < versions->size(); ++i) {
    const VersionInfo& v = (*versions)[i];
    Expected<std::shared_ptr<const Manifest>> m = bucket.ReadManifest(v.model, v.version);
    if (!m.ok()) return Fail(m.status().WithContext("upgrading " + v.model + "@" + v.version));
    if ((*m)->format == kManifestFormat) {
      Expected<ObjectInfo> old_size = bucket.store().Head(Bucket::ManifestKey(v.model, v.version));
      if (old_size.ok()) before_bytes += old_size->size;
      const SerializedVersion sv = SerializeVersion(**m);
      after_bytes += sv.head.size() + sv.table.size();
      for (const ManifestFile& f : (*m)->files) rows += f.chunks.size();
      if (!dry) {
        if (Status s = bucket.ReplaceManifest(**m, kManifestFormat2); !s.ok()) {
          return Fail(s.WithContext("upgrading " + v.model + "@" + v.version));
        }
      }
      ++converted;
    } else if (std::any_of((*m)->files.begin(), (*m)->files.end(), [](const ManifestFile& f) {
                 return f.section.ShouldBeBlocks();
               })) {
      if (!dry) {
        Expected<std::shared_ptr<const Manifest>> full = bucket.ReadFullManifest(v.model, v.version);
        Status s = full.ok() ? bucket.ReplaceManifest(**full, kManifestFormat2) : full.status();
        if (!s.ok()) return Fail(s.WithContext("rewriting the table of " + v.model + "@" + v.version + " in blocks"));
      }
      ++blocked;
    } else {
      ++already;
    }
    if (!v.created_ms) {
      if (!dry) {
        if (Status s = bucket.store().Put(Bucket::TimeKey(v.model, v.version, (*m)->created_ms), {}); !s.ok()) {
          return Fail(s.WithContext("writing the time marker of " + v.model + "@" + v.version));
        }
      }
      ++markers;
    }
    progress->Update(i + 1, versions->size());
  }
  progress->Finish();
  if (!dry && bucket.format() != kManifestFormat2) {
    if (Status s = bucket.SetFormat(kManifestFormat2); !s.ok()) return Fail(s.WithContext("writing weightfs.json"));
  }
  std::printf("%s %zu versions to format 2 (%zu were already), %zu time markers%s\n", dry ? "would convert" : "converted",
              converted, already + blocked, markers, dry ? "" : ", weightfs.json says format 2");
  if (blocked) {
    std::printf("%s the tables of %zu versions in blocks of %llu rows%s\n", dry ? "would rewrite" : "rewrote", blocked,
                static_cast<unsigned long long>(kTableBlockRows), dry ? "" : " (their old tables go at the next gc)");
  }
  if (converted) {
    std::printf("metadata of the converted versions: %s -> %s (%.1f -> %.1f bytes per chunk row)\n",
                FormatBytes(static_cast<double>(before_bytes)).c_str(), FormatBytes(static_cast<double>(after_bytes)).c_str(),
                rows ? static_cast<double>(before_bytes) / static_cast<double>(rows) : 0.0,
                rows ? static_cast<double>(after_bytes) / static_cast<double>(rows) : 0.0);
  }
  return 0;
}

// ---- gc -----------------------------------------------------------------------------------------

int GcMain(int argc, char** argv) {
  ArgParser args(Concat(kCommonValues, {"--keep-last", "--staged-grace"}), Concat(kCommonFlags, {"--dry-run", "--no-rebase"}));
  std::string help = std::string(R"(usage: weightfs gc BUCKET [--keep-last N] [--staged-grace S] [--dry-run]

Removes packs that no published version references: leftovers of pushes that died. Packs
are left alone while any push holds a live lease (a push in progress). Dead leases (expired,
or of a process that no longer runs on this host) are removed.

Also removes temporary uploads (.weightfs-tmp/ in local and WebDAV buckets) that writes killed
before publishing left behind: those unchanged for an hour, and only while no push holds a
live lease (younger ones may be uploads in progress). The report counts them.

options:
  --keep-last N        also retire all but the newest N versions of each model; kept
                       versions whose deltas build on retired ones are rebased first (those
                       chunks are stored again as keyframes, the manifest is rewritten)
  --no-rebase          with --keep-last: keep old versions that newer ones build on instead
  --staged-grace S     a version staged in parts (commit/push --parts) that is not complete
                       keeps its parts' packs until a part has waited S seconds; then that
                       part's record and packs go (a node still waiting for it stops)
                                                                        [604800: 7 days]
  --dry-run            report what would be removed, remove nothing
)") + kBucketHelp;
  if (auto rc = ParseOrHelp(args, argc, argv, help, 1, 1)) return *rc;
  Expected<Context> ctx = OpenContext(args, args.positionals()[0], true, false);
  if (!ctx.ok()) return Fail(ctx.status());
  GcOptions opts;
  opts.dry_run = args.Has("--dry-run");
  opts.rebase = !args.Has("--no-rebase");
  if (auto k = args.Get("--keep-last")) {
    Expected<double> n = ParseDouble(*k);
    if (!n.ok() || *n < 1) return Fail("--keep-last expects a count >= 1");
    opts.keep_last = static_cast<size_t>(*n);
  }
  if (auto g = args.Get("--staged-grace")) {
    Expected<double> secs = ParseDouble(*g);
    if (!secs.ok() || *secs < 0) return Fail("--staged-grace expects seconds >= 0");
    opts.staged_grace = std::chrono::milliseconds(static_cast<int64_t>(*secs * 1000));
  }
  Expected<GcReport> r = CollectGarbage(*ctx->bucket, opts);
  if (!r.ok()) return Fail(r.status());
  const char* verb = opts.dry_run ? "would remove" : "removed";
  std::printf("%zu versions, %zu packs (%zu referenced); %s %zu unreferenced packs (%s)\n",
              r->versions, r->packs, r->live_packs, verb, r->deleted_packs,
              FormatBytes(static_cast<double>(r->deleted_bytes)).c_str());
  for (const std::string& v : r->retired) std::printf("%s version %s\n", opts.dry_run ? "would retire" : "retired", v.c_str());
  for (const std::string& v : r->rebased) std::printf("%s %s\n", opts.dry_run ? "would rebase" : "rebased", v.c_str());
  for (const std::string& v : r->kept_as_base) std::printf("kept %s: newer versions' deltas build on it\n", v.c_str());
  if (!r->rebased.empty()) {
    // Rebasing writes keyframes: the bucket can grow. Both sides said, and the difference.
    const double written = static_cast<double>(r->rebased_bytes), removed = static_cast<double>(r->deleted_bytes);
    std::printf("%s %s of keyframes for the rebased versions%s and %s %s: the bucket %s by %s\n",
                opts.dry_run ? "would write about" : "wrote", FormatBytes(written).c_str(),
                opts.dry_run ? " (estimated from their chains' keyframes)" : "", verb, FormatBytes(removed).c_str(),
                written > removed ? (opts.dry_run ? "would grow" : "grew") : (opts.dry_run ? "would shrink" : "shrank"),
                FormatBytes(std::abs(written - removed)).c_str());
  }
  if (r->deleted_temporaries) {
    std::printf("%s %zu temporary uploads left by interrupted writes (%s)\n", verb, r->deleted_temporaries,
                FormatBytes(static_cast<double>(r->deleted_temporary_bytes)).c_str());
  }
  if (r->recent_temporaries) {
    std::printf("kept %zu temporary upload(s) younger than an hour (possibly writes in progress)\n",
                r->recent_temporaries);
  }
  if (r->live_leases) {
    std::printf("left unreferenced packs%s alone: %zu push(es) in progress:",
                r->temporaries ? (" and " + std::to_string(r->temporaries) + " temporary upload(s)").c_str() : "",
                r->live_leases);
    for (const std::string& l : r->live_lease_names) std::printf(" %s", l.c_str());
    std::printf("\n");
  }
  if (r->dead_leases_removed) std::printf("removed %zu dead lease(s)\n", r->dead_leases_removed);
  if (r->staged_versions) {
    std::printf("kept the packs of %zu part(s) of %zu version(s) staged in parts (not complete yet)\n",
                r->staged_parts, r->staged_versions);
  }
  for (const std::string& p : r->expired_parts) {
    std::printf("%s %s: staged longer than --staged-grace\n", opts.dry_run ? "would expire" : "expired", p.c_str());
  }
  return 0;
}

}  // namespace

int BucketMain(const std::string& command, int argc, char** argv) {
  if (command == "init") return InitMain(argc, argv);
  if (command == "push") return PushMain(argc, argv);
  if (command == "pull") return PullMain(argc, argv);
  if (command == "cat") return CatMain(argc, argv);
  if (command == "log") return LogMain(argc, argv);
  if (command == "verify") return VerifyMain(argc, argv);
  if (command == "gc") return GcMain(argc, argv);
  if (command == "upgrade") return UpgradeMain(argc, argv);
  return -1;
}

}  // namespace weightfs::cli

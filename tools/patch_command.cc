// weightfs patch: sparse weight patches from an older version of a model to a newer one
// (hub/engine/weight_patcher.h), one safetensors file per weight file, for inference engines that hold
// the old version and apply `flat[idx] = val`.
#include <spdlog/spdlog.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include "core/thread_pool.h"
#include "core/chunk_plan.h"
#include "hub/engine/chunk_cache.h"
#include "hub/engine/materializer.h"
#include "hub/engine/weight_patcher.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "tools/logging.h"
#include "tools/store_args.h"

namespace weightfs::cli {
namespace {

constexpr const char* kPatchHelp = R"(usage: weightfs patch BUCKET MODEL@NEW --from OLD [FILE...] -o OUTDIR [options]

Writes, for each weight file of MODEL@NEW (default: every *.safetensors file; else the FILEs
named), OUTDIR/FILE: a sparse weight patch that turns OLD's tensors into NEW's, in the
convention of vLLM's SparseWeightPatch and TRL's delta weight sync. OLD must be NEW or an
ancestor of it (its parent, or further back along the parents).

A patch is a safetensors file. For each tensor NAME of NEW's file it holds
  nothing            when NAME is bit-identical in OLD and NEW;
  NAME.idx, NAME.val the flat (row-major) positions of the elements that differ, strictly
                     ascending, as I32 (I64 for a tensor of more than 2^31 elements), and
                     their new values in NAME's dtype. Apply with
                         flat = tensor.reshape(-1); flat[idx] = val
                     and the tensor is NEW's, bit for bit;
  NAME               the whole new tensor (NEW's dtype and shape) when NAME is new, its dtype
                     or shape changed, or a sparse form would not be smaller:
                     k x (index size + element size) >= elements x element size
                     (bf16 with I32 indices: a third of the elements changed; f32: half).
Its __metadata__: "sparse_weight_patch": "1" (the format version), "format":
"sparse_weight_patch" and "encoding": "raw" (TRL's keys), "model", "from", "to", "file",
"removed" (a JSON array of the tensors of OLD's file that NEW's lacks: drop them), "dense"
(a JSON array of the tensors given whole), "changed_elements", "total_elements".

The patch is made from the stored deltas: a chunk that did not change costs nothing, a chunk
whose chain of deltas leads from OLD's bytes to NEW's is OLD's chunk (from the cache when
this node holds it, else the bucket) with the deltas after it applied, their positions
taken from the payloads; other chunks (a keyframe in between) are materialized in both
versions and compared. NEW's chunks built this way go into the cache, so that a patch
from NEW to a later version fetches only the deltas after NEW.

Prints a line per file: tensors sparse/dense/removed/unchanged, changed elements, the
patch's bytes against the bytes the versions after OLD stored for the file, and what was
fetched from the bucket.

options:
  --from OLD           the version the engine holds (required)
  -o, --output DIR     where the patches go (created if needed; required)
  --cache-dir DIR      local chunk cache   [$WEIGHTFS_CACHE_DIR or ~/.cache/weightfs]
  --cache-size BYTES   bound on the cache (LRU eviction)                   [20GiB]
  --no-cache           do not read or fill the cache
  --threads N          parallel chunk workers (decode and fetch)            [8]
  --stats              also print how each chunk was found, and request counts
  --endpoint URL       S3 endpoint
  --region NAME        S3 region                                        [us-east-1]
  --no-sign-request    S3: send requests unsigned (a bucket open to anyone);
                       without it, finding no AWS credentials is an error
  --timeout SECONDS    give up on a request (retries included) after this long   [120]
  --log-level LEVEL    error, warn, info, debug                          [warn]
  -h, --help           show this help
)";

std::string Ratio(uint64_t a, uint64_t b) {
  if (b == 0) return a == 0 ? "-" : "inf";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2fx", static_cast<double>(a) / static_cast<double>(b));
  return buf;
}

std::string Bytes(uint64_t n) {
  return FormatBytes(static_cast<double>(n)) + " (" + std::to_string(n) + " bytes)";
}

// Writes to a file descriptor.
Status WriteAll(int fd, std::span<const uint8_t> bytes, const std::string& path) {
  while (!bytes.empty()) {
    const ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Status::IOError("writing " + path + ": " + std::strerror(errno));
    bytes = bytes.subspan(static_cast<size_t>(n));
  }
  return Status::Ok();
}

}  // namespace

int PatchMain(int argc, char** argv) {
  ArgParser args({"--from", "-o", "--output", "--cache-dir", "--cache-size", "--threads", "--endpoint", "--region",
                  "--timeout", "--log-level", "--shared-cache", "--shared-cache-size", "--shared-cache-endpoint"},
                 {"--help", "-h", "--no-cache", "--stats", "--no-sign-request"});
  Status parsed = args.Parse(argc, argv, 1);
  if (args.Has("--help") || args.Has("-h")) {
    std::fputs(kPatchHelp, stdout);
    std::fputs(kSharedCacheHelp, stdout);
    return 0;
  }
  auto usage = [&](const std::string& m) {
    std::fprintf(stderr, "weightfs patch: %s (see --help)\n", m.c_str());
    return 2;
  };
  if (!parsed.ok()) return usage(parsed.message());
  if (args.positionals().size() < 2) return usage("expected BUCKET MODEL@NEW");
  if (!args.Has("--from")) return usage("--from OLD is required");
  std::optional<std::string> out_dir = args.Get("-o");
  if (!out_dir) out_dir = args.Get("--output");
  if (!out_dir) return usage("-o OUTDIR is required");
  if (Status s = SetUpCommandLog(args); !s.ok()) return Fail(s.message());

  const std::string url = args.positionals()[0];
  Expected<VersionRef> ref = ParseVersionRef(args.positionals()[1], true);
  if (!ref.ok()) return Fail(ref.status());
  std::string from = *args.Get("--from");
  if (from.find('@') != std::string::npos) {  // MODEL@OLD is accepted too, for the same model
    Expected<VersionRef> f = ParseVersionRef(from, true);
    if (!f.ok()) return Fail(f.status());
    if (f->model != ref->model) return usage("--from names model " + f->model + ", not " + ref->model);
    from = f->version;
  }
  if (Status s = ValidateVersionName(from); !s.ok()) return Fail(s.WithContext("--from"));
  size_t threads = 8;
  if (auto t = args.Get("--threads")) {
    Expected<double> n = ParseDouble(*t);
    if (!n.ok() || *n < 1) return usage("--threads expects a count >= 1");
    threads = static_cast<size_t>(*n);
  }
  const auto start = std::chrono::steady_clock::now();
  auto seconds = [](std::chrono::steady_clock::time_point since) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
  };

  Expected<StoreOptions> so = StoreOptionsFromArgs(args);
  if (!so.ok()) return Fail(so.status());
  Expected<OpenedBucket> opened = OpenBucketUrl(url, *so, /*any_layout=*/true);
  if (!opened.ok()) return Fail(opened.status());
  std::unique_ptr<ChunkCache> cache;
  if (!args.Has("--no-cache")) {
    uint64_t size = 20ull << 30;
    if (auto s = args.Get("--cache-size")) {
      Expected<uint64_t> v = ParseSize(*s);
      if (!v.ok()) return Fail(v.status());
      size = *v;
    }
    Expected<std::unique_ptr<ChunkCache>> c = ChunkCache::Open(args.GetOr("--cache-dir", DefaultCacheDir()), size);
    if (!c.ok()) return Fail(c.status());
    cache = std::move(c).value();
    // NEW's chunks reach the cache on a thread of its own (ChunkCache::PutCopyBehind): the
    // builds go on while the last ones are written. Eight chunks at most wait (32 MiB).
    cache->set_write_behind(8 * kDefaultChunkBytes);
  }
  ThreadPool pool(threads);
  Materializer materializer(opened->bucket.get(), cache.get());
  std::error_code ec;
  std::filesystem::create_directories(*out_dir, ec);
  if (ec) return Fail("cannot create " + *out_dir + ": " + ec.message());
  PatchOptions options;
  options.cache = cache.get();
  options.spill_dir = *out_dir;
  Expected<std::unique_ptr<WeightPatcher>> patcher =
      WeightPatcher::Open(&materializer, &pool, ref->model, from, ref->version, options);
  if (!patcher.ok()) return Fail(patcher.status());

  std::vector<std::string> files(args.positionals().begin() + 2, args.positionals().end());
  if (files.empty()) files = (*patcher)->WeightFiles();
  if (files.empty()) return Fail(ref->model + "@" + ref->version + " has no .safetensors files");
  std::printf("patch %s@%s -> %s (%zu versions apart), %zu files into %s\n", ref->model.c_str(), from.c_str(),
              ref->version.c_str(), (*patcher)->chain().size() - 1, files.size(), out_dir->c_str());
  std::fflush(stdout);

  const StoreCounters& counters = opened->store.store->counters();
  PatchStats total;
  uint64_t total_fetched = 0, total_requests = 0;
  for (const std::string& file : files) {
    const auto t0 = std::chrono::steady_clock::now();
    const uint64_t bytes0 = counters.bytes_received.load(), requests0 = counters.requests.load();
    const std::string final_path = *out_dir + "/" + file;
    const std::string partial = final_path + ".weightfs-partial";
    std::filesystem::create_directories(std::filesystem::path(final_path).parent_path(), ec);
    if (ec) return Fail("cannot create the directory of " + final_path + ": " + ec.message());
    const int fd = ::open(partial.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return Fail("creating " + partial + ": " + std::strerror(errno));
    PatchStats st;
    Status s = (*patcher)->Write(file, [&](std::span<const uint8_t> b) { return WriteAll(fd, b, partial); }, &st);
    if (::close(fd) != 0 && s.ok()) s = Status::IOError("closing " + partial + ": " + std::strerror(errno));
    if (s.ok() && ::rename(partial.c_str(), final_path.c_str()) != 0) {
      s = Status::IOError("renaming " + partial + ": " + std::strerror(errno));
    }
    if (!s.ok()) {
      ::unlink(partial.c_str());
      return Fail(s);
    }
    const uint64_t fetched = counters.bytes_received.load() - bytes0;
    const uint64_t requests = counters.requests.load() - requests0;
    std::printf("%s: %llu sparse, %llu dense, %llu removed, %llu unchanged tensors; %llu of %llu elements changed "
                "(%.3f%%); patch %s, stored deltas %s, patch/stored %s; fetched %s in %llu requests, "
                "fetched/stored %s; %.2f s\n",
                file.c_str(), (unsigned long long)st.tensors_sparse, (unsigned long long)st.tensors_dense,
                (unsigned long long)st.tensors_removed, (unsigned long long)st.tensors_unchanged,
                (unsigned long long)st.elements_changed, (unsigned long long)st.elements,
                st.elements ? 100.0 * static_cast<double>(st.elements_changed) / static_cast<double>(st.elements) : 0.0,
                Bytes(st.patch_bytes).c_str(), Bytes(st.stored_delta_bytes).c_str(),
                Ratio(st.patch_bytes, st.stored_delta_bytes).c_str(), Bytes(fetched).c_str(),
                (unsigned long long)requests, Ratio(fetched, st.stored_delta_bytes).c_str(), seconds(t0));
    if (args.Has("--stats")) {
      std::printf("  chunks: %llu unchanged, %llu from deltas (%llu payloads, %s), %llu compared, %llu whole\n",
                  (unsigned long long)st.chunks_same, (unsigned long long)st.chunks_from_deltas,
                  (unsigned long long)st.delta_payloads, Bytes(st.delta_payload_bytes).c_str(),
                  (unsigned long long)st.chunks_compared, (unsigned long long)st.chunks_whole);
    }
    std::fflush(stdout);
    total.tensors_sparse += st.tensors_sparse;
    total.tensors_dense += st.tensors_dense;
    total.tensors_removed += st.tensors_removed;
    total.tensors_unchanged += st.tensors_unchanged;
    total.elements += st.elements;
    total.elements_changed += st.elements_changed;
    total.patch_bytes += st.patch_bytes;
    total.stored_delta_bytes += st.stored_delta_bytes;
    total_fetched += fetched;
    total_requests += requests;
  }
  std::printf("total: %llu sparse, %llu dense, %llu removed tensors; %llu of %llu elements changed; patch %s, "
              "stored deltas %s, patch/stored %s; fetched %s in %llu requests, fetched/stored %s; %.2f s\n",
              (unsigned long long)total.tensors_sparse, (unsigned long long)total.tensors_dense,
              (unsigned long long)total.tensors_removed, (unsigned long long)total.elements_changed,
              (unsigned long long)total.elements, Bytes(total.patch_bytes).c_str(),
              Bytes(total.stored_delta_bytes).c_str(), Ratio(total.patch_bytes, total.stored_delta_bytes).c_str(),
              Bytes(total_fetched).c_str(), (unsigned long long)total_requests,
              Ratio(total_fetched, total.stored_delta_bytes).c_str(), seconds(start));
  if (args.Has("--stats")) {
    const MaterializerStats& m = materializer.stats();
    std::printf("stats: %llu requests (%llu GET), received %s; materialized chunks %llu (%llu from cache), "
                "payloads fetched by the materializer %llu (%s)\n",
                (unsigned long long)counters.requests.load(), (unsigned long long)counters.gets.load(),
                Bytes(counters.bytes_received.load()).c_str(), (unsigned long long)m.chunks.load(),
                (unsigned long long)m.cache_hits.load(), (unsigned long long)m.payloads_fetched.load(),
                Bytes(m.payload_bytes.load()).c_str());
  }
  return 0;
}

}  // namespace weightfs::cli

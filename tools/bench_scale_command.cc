// weightfs bench scale: what metadata costs at the scale of a trillion-parameter model with
// thousands of versions, measured on a real bucket of the real format (docs/format2.md).
//
// The bucket is built directly (not by push, which would have to hash terabytes): one model of
// --files files of --chunks 4 MiB chunks in all (500,000 chunks = 2 TB a version), --versions
// versions in a chain. Payloads are real and stored once: every chunk of a version holds the
// same bytes (bf16-like weights; each version changes --changed of the elements of the
// previous one by one or two ulps), so a version stores one payload (a SPARSE delta against
// the previous version, or a FULL keyframe every --keyframe-depth versions) and its table has
// a row per chunk pointing at it. Chunk tables, heads, time markers and listings are exactly
// what a real run of that size has; only their compression differs (identical rows compress
// to nothing: docs/format2.md has what real rows cost). Whole-file SHA-256s are placeholders:
// nothing measured here reads a whole file.
//
// Then, through a real mount (the same binary, --memory-limit) with an empty cache: mount and
// the first `ls` of the model's directory, `ls -l` of it, `ls -l` of a version, the first 4 MiB
// read of a chunk whose chain is 1, 16 and 64 deltas deep, mkdir of a draft, and the daemon's
// peak RSS; outside it: `weightfs log` (all, and --last 10) and a push of a version (one small
// file: the metadata path of a push). Each line has its wall time and what the bucket was
// asked (requests, bytes): the request counts are what does not grow with versions x chunks.
#include <fcntl.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/chunk_codec.h"
#include "core/chunk_table.h"
#include "core/dtype.h"
#include "core/manifest.h"
#include "hub/engine/bucket.h"
#include "hub/engine/pack_writer.h"
#include "fs/mount_point.h"
#include "hub/store/local_store.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace weightfs::cli {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr const char* kScaleHelp = R"(usage: weightfs bench scale [options]

Builds a bucket of a simulated large model with many versions (real format, real payloads
stored once: every chunk of a version has the same bytes) and measures metadata operations
through a real mount and the CLI: mount + first ls, ls -l of the model and of a version, the
first read of a chunk at chain depth 1/16/64, mkdir of a draft, log, log --last 10, a push,
and the mount daemon's peak RSS. Every line shows the wall time and the bucket requests and
bytes it took. See docs/format2.md.

options:
  --chunks N           4 MiB chunks a version has, in all                      [500000]
  --versions N         versions in the chain                                     [1000]
  --files N            files the chunks are spread over                            [64]
  --changed X          fraction of elements a version changes                    [0.01]
  --keyframe-depth N   a FULL keyframe after this many deltas                      [64]
  --memory-limit B     the mount's --memory-limit                                  [1GiB]
  --chunk-bytes B      bytes a chunk (a single file of 300,000 16 KiB chunks has the rows
                       of a 1.2 TB file at 4 MiB, with small payloads)              [4MiB]
  --block-rows N       rows per block of a file's table section (1e9: one piece, as
                       before sections had blocks)                                  [512]
  --real-rows          every row its own: tensor names, random hashes, payloads one after
                       another with real delta lengths, as a real run's rows are (only the
                       rows read hold the real payload); else identical rows, which
                       compress to nothing
  --dir DIR            where the bucket, cache and mount go (kept: a second run with the
                       same options reuses the bucket)        [/tmp/weightfs-bench-scale]
  --json               one JSON object instead of the table
  -h, --help           show this help
)";

struct ScaleOptions {
  uint64_t chunk_bytes = 4ull << 20;
  bool real_rows = false;
  uint64_t block_rows = kTableBlockRows;
  uint64_t chunks = 500000;
  int versions = 1000;
  int files = 64;
  double changed = 0.01;
  int keyframe_depth = 64;
  uint64_t memory_limit = 1ull << 30;
  std::string dir = "/tmp/weightfs-bench-scale";
  bool json = false;
};

std::string Self() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "weightfs";
}

// Runs the weightfs binary with `args`; its exit code, output, time and peak RSS (children).
struct Run {
  int code = -1;
  std::string out;
  double seconds = 0;
  uint64_t max_rss = 0;
};
Run RunSelf(const std::vector<std::string>& args) {
  // Output goes to a file, not a pipe: a mount's daemon keeps its inherited descriptors open.
  Run r;
  char out_path[] = "/tmp/weightfs-bench-XXXXXX";
  const int out = ::mkstemp(out_path);
  if (out < 0) return r;
  ::unlink(out_path);
  const auto t0 = Clock::now();
  // posix_spawn, not fork: a forked child's peak RSS would count this process's pages until
  // its exec (the bucket just built here), and the figure is the command's own.
  std::vector<char*> argv;
  const std::string self = Self();
  argv.push_back(const_cast<char*>(self.c_str()));
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  ::posix_spawn_file_actions_init(&actions);
  ::posix_spawn_file_actions_adddup2(&actions, out, 1);
  ::posix_spawn_file_actions_adddup2(&actions, out, 2);
  pid_t pid = -1;
  const int spawned = ::posix_spawn(&pid, self.c_str(), &actions, nullptr, argv.data(), environ);
  ::posix_spawn_file_actions_destroy(&actions);
  if (spawned != 0) {
    ::close(out);
    r.out = std::string("cannot run ") + self + ": " + std::strerror(spawned);
    return r;
  }
  int status = 0;
  struct rusage ru {};
  ::wait4(pid, &status, 0, &ru);
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.max_rss = static_cast<uint64_t>(ru.ru_maxrss) * 1024;
  char buf[65536];
  for (ssize_t n; r.out.size() < (1 << 20) && (n = ::pread(out, buf, sizeof buf, static_cast<off_t>(r.out.size()))) > 0;) {
    r.out.append(buf, static_cast<size_t>(n));
  }
  ::close(out);
  return r;
}

// bf16-like weights: N(0, 0.02) rounded to bf16.
std::vector<uint8_t> Weights(size_t bytes, std::mt19937_64& rng) {
  std::vector<uint8_t> out(bytes);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  for (size_t i = 0; i + 1 < bytes; i += 2) {
    const float f = normal(rng);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint16_t b = static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
    out[i] = static_cast<uint8_t>(b);
    out[i + 1] = static_cast<uint8_t>(b >> 8);
  }
  return out;
}

// Moves `fraction` of the bf16 elements by one or two ulps.
void Step(std::vector<uint8_t>& w, double fraction, std::mt19937_64& rng) {
  const size_t n = w.size() / 2;
  std::uniform_int_distribution<size_t> pick(0, n - 1);
  const size_t changes = static_cast<size_t>(std::llround(static_cast<double>(n) * fraction));
  for (size_t k = 0; k < changes; ++k) {
    const size_t i = pick(rng);
    uint16_t b = static_cast<uint16_t>(w[2 * i] | (w[2 * i + 1] << 8));
    const int delta = (rng() & 1) ? 1 : ((rng() & 1) ? -1 : 2);
    b = static_cast<uint16_t>(b + delta);
    if ((b & 0x7f80) == 0x7f80) b = static_cast<uint16_t>(b - 2 * delta);  // no inf/nan
    w[2 * i] = static_cast<uint8_t>(b);
    w[2 * i + 1] = static_cast<uint8_t>(b >> 8);
  }
}

std::string VersionName(int k) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "v%05d", k);
  return buf;
}

// Realistic rows are keyed the way a pushed safetensors shard of a Kimi-K2-like MoE is: by tensor name and
// chunk index, 7 chunks of 4 MiB for each 7168 x 2048 bf16 expert projection, experts in layer
// order across the shards.
ChunkKey ChunkKeyOf(int file, uint64_t row, uint64_t rows_per_file) {
  constexpr uint64_t kPerTensor = 7;
  const uint64_t tensor = (static_cast<uint64_t>(file) * rows_per_file + row) / kPerTensor;
  static const char* kProj[] = {"gate_proj", "up_proj", "down_proj"};
  const uint64_t expert = tensor / 3, layer = expert / 384;
  char name[128];
  std::snprintf(name, sizeof name, "model.layers.%llu.mlp.experts.%llu.%s.weight", static_cast<unsigned long long>(layer + 1),
                static_cast<unsigned long long>(expert % 384), kProj[tensor % 3]);
  // A tensor split across two shards continues its index in the second.
  const uint64_t first_row_of_tensor = tensor * kPerTensor;
  const uint64_t file_start = static_cast<uint64_t>(file) * rows_per_file;
  const uint64_t index = static_cast<uint64_t>(file) * rows_per_file + row - std::max(first_row_of_tensor, file_start);
  return ChunkKey{name, index};
}

// The rows the mount reads (the first, which the push changes, and the middle one, read at each
// depth): with --real-rows, the only rows that hold the real payload.
uint64_t ProbeRow(uint64_t rows) { return rows / 2; }
bool IsProbeRow(uint64_t row, uint64_t rows) { return row == 0 || row == ProbeRow(rows); }

// Chain depth of version k (0: a keyframe).
int DepthOf(int k, int keyframe_depth) { return k % (keyframe_depth + 1); }

Status Build(const ScaleOptions& o, const std::string& bucket_dir, std::FILE* log) {
  std::error_code ec;
  fs::create_directories(bucket_dir, ec);
  WFS_ASSIGN_OR_RETURN(std::unique_ptr<LocalStore> local, LocalStore::Open(bucket_dir));
  std::shared_ptr<Store> store(std::move(local));
  WFS_TRY(Bucket::Init(*store));
  WFS_ASSIGN_OR_RETURN(std::unique_ptr<Bucket> bucket, Bucket::Open(store));
  bucket->set_table_block_rows(o.block_rows);
  std::mt19937_64 rng(7);
  const uint64_t chunk = o.chunk_bytes;
  std::vector<uint8_t> weights = Weights(chunk, rng), previous;
  ChunkCodec codec;
  std::vector<uint8_t> payload;
  Manifest m;
  m.model = "scale/m";
  m.chunk_bytes = chunk;
  const uint64_t per_file = (o.chunks + static_cast<uint64_t>(o.files) - 1) / static_cast<uint64_t>(o.files);
  uint64_t left = o.chunks;
  for (int f = 0; f < o.files && left > 0; ++f) {
    ManifestFile file;
    char name[64];
    std::snprintf(name, sizeof name, "shard-%05d-of-%05d.bin", f + 1, o.files);
    file.path = name;
    const uint64_t n = std::min(per_file, left);
    left -= n;
    file.size = n * chunk;
    file.sha256 = std::string(64, '0');  // a placeholder (see the top of this file)
    file.chunks.resize(n);
    for (uint64_t i = 0; i < n; ++i) {
      ManifestChunk& c = file.chunks[i];
      // Opaque shards (a push of one of them encodes against it); real rows have a real
      // model's keys, except the first, which the push below changes.
      c.key = o.real_rows && i > 0 ? ChunkKeyOf(f, i, per_file) : ChunkKey{"", i};
      c.offset = i * chunk;
      c.length = chunk;
    }
    m.files.push_back(std::move(file));
  }
  const int64_t t0 = 1767225600000;  // 2026-01-01
  uint64_t chain = 0, keyframe = 0;
  const auto start = Clock::now();
  for (int k = 0; k < o.versions; ++k) {
    const int depth = DepthOf(k, o.keyframe_depth);
    if (k > 0) {
      previous = weights;
      Step(weights, o.changed, rng);
    }
    ChunkEncoding encoding;
    if (depth == 0) {
      codec.EncodeFull(DType::kBF16, weights, &payload);
      encoding = static_cast<ChunkEncoding>(payload[5]);
      chain = 0;
      keyframe = payload.size();
    } else {
      encoding = codec.EncodeDelta(DType::kBF16, previous, weights, &payload);
      chain += payload.size();
    }
    PackWriter packs(store.get(), 64ull << 20, 1, 1);
    WFS_ASSIGN_OR_RETURN(PackSlot slot, packs.Add(payload));
    WFS_TRY(packs.Finish());
    const Hash128 hash = HashChunk(weights);
    m.version = VersionName(k);
    m.parent = k > 0 ? std::optional<std::string>(VersionName(k - 1)) : std::nullopt;
    m.versions = {m.version};
    if (depth > 0) m.versions.push_back(VersionName(k - 1));
    m.packs = {packs.PackHash(slot.pack)};
    m.created_ms = t0 + k * 60000;
    m.created = FormatUtc(m.created_ms);
    m.stats = {o.chunks * chunk, payload.size(),
               static_cast<uint64_t>(static_cast<double>(o.chunks * chunk / 2) * (k ? o.changed : 1.0)),
               o.chunks * chunk / 2};
    uint64_t fake_offset = slot.offset + payload.size();  // real rows' payloads, one after another
    for (ManifestFile& file : m.files) {
      for (size_t i = 0; i < file.chunks.size(); ++i) {
        ManifestChunk& c = file.chunks[i];
        c.hash = hash;
        c.encoding = encoding;
        c.ref = {0, slot.offset, payload.size()};
        c.origin = 0;
        c.base = depth > 0 ? 1 : 0;
        c.depth = static_cast<uint32_t>(depth);
        c.chain_bytes = chain;
        c.keyframe_bytes = keyframe;
        if (o.real_rows && !IsProbeRow(i, file.chunks.size())) {
          // Its own payload (never read): a length 0.5x..2x the real one, a random hash.
          const double scale = 0.5 + 1.5 * static_cast<double>(rng() % 1024) / 1024;
          c.ref = {0, fake_offset, std::max<uint64_t>(1, static_cast<uint64_t>(static_cast<double>(payload.size()) * scale))};
          fake_offset += c.ref.length;
          c.hash = Hash128{rng(), rng()};
          c.chain_bytes = depth ? static_cast<uint64_t>(static_cast<double>(chain) * scale) : c.ref.length;
          c.keyframe_bytes = depth ? static_cast<uint64_t>(static_cast<double>(keyframe) * scale) : c.ref.length;
          c.chain_bytes = std::max(c.chain_bytes, c.ref.length);
        }
      }
    }
    WFS_TRY(bucket->PublishManifest(m).WithContext("building " + m.version));
    if (log && (k % 50 == 49 || k + 1 == o.versions)) {
      std::fprintf(log, "\rbuilding: %d of %d versions (%.0f s)", k + 1, o.versions,
                   std::chrono::duration<double>(Clock::now() - start).count());
      std::fflush(log);
    }
  }
  if (log) std::fprintf(log, "\n");
  std::ofstream(bucket_dir + "/.bench-scale-done") << o.chunks << " " << o.versions << " " << o.files << "\n";
  return Status::Ok();
}

// What a version's table would cost with distinct payloads: the rows of one shard as a real run
// has them (tensor names of a Kimi-K2-like MoE, random hashes, payloads one after another in
// packs, with the lengths of real 4 MiB deltas at --changed), encoded as the bucket encodes them.
struct RealRows {
  double bytes_per_row = 0;
  double delta_per_chunk = 0;   // mean payload of a delta
  double keyframe_per_chunk = 0;
};
RealRows MeasureRealRows(const ScaleOptions& o) {
  constexpr uint64_t kChunk = 4ull << 20;  // what a real run's chunks are (whatever --chunk-bytes)
  std::mt19937_64 rng(11);
  ChunkCodec codec;
  std::vector<uint64_t> deltas;
  uint64_t full = 0;
  std::vector<uint8_t> payload;
  for (int k = 0; k < 8; ++k) {
    std::vector<uint8_t> w = Weights(kChunk, rng), before = w;
    Step(w, o.changed, rng);
    codec.EncodeDelta(DType::kBF16, before, w, &payload);
    deltas.push_back(payload.size());
    if (k == 0) {
      codec.EncodeFull(DType::kBF16, w, &payload);
      full = payload.size();
    }
  }
  const uint64_t rows = std::min<uint64_t>((o.chunks + static_cast<uint64_t>(o.files) - 1) / static_cast<uint64_t>(o.files), 1u << 20);
  std::vector<ManifestChunk> chunks(rows);
  // Real updates are not uniform: each tensor has its own rate of change (here 0.5x..2x), each
  // chunk its own count (binomial), each keyframe its own size; a row's chain is the sum of its
  // own deltas.
  std::uniform_real_distribution<double> tensor_rate(0.5, 2.0), chunk_noise(0.98, 1.02), keyframe_noise(0.95, 1.05);
  double mean_delta = 0;
  for (uint64_t d : deltas) mean_delta += static_cast<double>(d) / static_cast<double>(deltas.size());
  uint64_t pack_offset = 0;
  int pack = 0;
  std::string tensor;
  double rate = 1;
  for (uint64_t i = 0; i < rows; ++i) {
    ManifestChunk& c = chunks[i];
    c.key = ChunkKeyOf(1, i, rows);
    if (c.key.tensor != tensor) {
      tensor = c.key.tensor;
      rate = tensor_rate(rng);
    }
    c.offset = i * kChunk;
    c.length = kChunk;
    c.hash = Hash128{rng(), rng()};
    c.encoding = ChunkEncoding::kSparse;
    auto delta = [&] { return static_cast<uint64_t>(mean_delta * rate * chunk_noise(rng)); };
    const uint64_t len = delta();
    if (pack_offset + len > (64ull << 20)) {
      ++pack;
      pack_offset = 0;
    }
    c.ref = {static_cast<uint32_t>(pack), pack_offset, len};
    pack_offset += len;
    c.origin = 0;
    c.base = 1;
    c.depth = 17;
    c.chain_bytes = len;
    for (int d = 1; d < 17; ++d) c.chain_bytes += delta();
    c.keyframe_bytes = static_cast<uint64_t>(static_cast<double>(full) * keyframe_noise(rng));
  }
  RealRows r;
  r.bytes_per_row = static_cast<double>(EncodeChunkSection(chunks).bytes.size()) / static_cast<double>(rows);
  for (uint64_t d : deltas) r.delta_per_chunk += static_cast<double>(d) / static_cast<double>(deltas.size());
  r.keyframe_per_chunk = static_cast<double>(full);
  return r;
}

struct Counters {
  uint64_t requests = 0, bytes = 0;
};
Counters MountCounters(const std::string& mnt) {
  Counters c;
  char buf[1 << 16];
  const ssize_t n = ::getxattr(mnt.c_str(), "user.weightfs.stats", buf, sizeof buf);
  if (n <= 0) return c;
  const nlohmann::json j = nlohmann::json::parse(std::string(buf, static_cast<size_t>(n)), nullptr, false);
  if (!j.is_object() || !j.contains("bucket")) return c;
  c.requests = j["bucket"].value("requests", uint64_t{0});
  c.bytes = j["bucket"].value("bytes_received", uint64_t{0});
  return c;
}

struct Line {
  std::string what;
  double seconds = 0;
  uint64_t requests = 0, bytes = 0;
  std::string note;
  uint64_t peak_rss = 0;  // of a CLI command
};

}  // namespace

int BenchScaleMain(int argc, char** argv) {
  ArgParser args({"--chunks", "--versions", "--files", "--changed", "--keyframe-depth", "--memory-limit", "--dir",
                  "--chunk-bytes", "--block-rows"},
                 {"--json", "--real-rows", "--help", "-h"});
  if (auto rc = ParseArgs(args, argc, argv, kScaleHelp, 0)) return *rc;
  ScaleOptions o;
  auto count = [&](const char* name, auto* out, double lo, double hi) -> bool {
    if (auto v = args.Get(name)) {
      Expected<double> d = ParseDouble(*v);
      if (!d.ok() || *d < lo || *d > hi) return false;
      *out = static_cast<std::remove_pointer_t<decltype(out)>>(*d);
    }
    return true;
  };
  if (!count("--chunks", &o.chunks, 1, 1e8) || !count("--versions", &o.versions, 1, 1e6) ||
      !count("--files", &o.files, 1, 1e5) || !count("--changed", &o.changed, 1e-6, 0.5) ||
      !count("--keyframe-depth", &o.keyframe_depth, 1, 1000) || !count("--block-rows", &o.block_rows, 1, 1e9)) {
    std::fprintf(stderr, "weightfs: bench scale: a bad value (see --help)\n");
    return 2;
  }
  if (auto v = args.Get("--memory-limit")) {
    Expected<uint64_t> b = ParseSize(*v);
    if (!b.ok()) return Fail(b.status());
    o.memory_limit = *b;
  }
  if (auto v = args.Get("--chunk-bytes")) {
    Expected<uint64_t> b = ParseSize(*v);
    if (!b.ok()) return Fail(b.status());
    if (*b < 4096 || *b > (64ull << 20) || *b % 2) return Fail("--chunk-bytes: 4 KiB .. 64 MiB, even");
    o.chunk_bytes = *b;
  }
  o.real_rows = args.Has("--real-rows");
  const uint64_t chunk = o.chunk_bytes;
  o.dir = AbsolutePath(args.GetOr("--dir", o.dir));
  o.json = args.Has("--json");
  std::FILE* log = o.json ? nullptr : stderr;
  char tag[96];
  std::snprintf(tag, sizeof tag, "c%llu-v%d-f%d-d%d-b%llu-r%llu%s", static_cast<unsigned long long>(o.chunks), o.versions,
                o.files, o.keyframe_depth, static_cast<unsigned long long>(o.chunk_bytes),
                static_cast<unsigned long long>(o.block_rows), o.real_rows ? "-real" : "");
  const std::string bucket_dir = o.dir + "/bucket-" + tag;
  const std::string mnt = o.dir + "/mnt", cache = o.dir + "/cache";
  std::error_code ec;
  if (!fs::exists(bucket_dir + "/.bench-scale-done")) {
    fs::remove_all(bucket_dir, ec);
    const auto t = Clock::now();
    if (Status s = Build(o, bucket_dir, log); !s.ok()) return Fail(s);
    if (log) std::fprintf(log, "built %s in %.0f s\n", bucket_dir.c_str(), std::chrono::duration<double>(Clock::now() - t).count());
  }
  uint64_t bucket_bytes = 0, table_bytes = 0, head_bytes = 0;
  for (auto it = fs::recursive_directory_iterator(bucket_dir, ec); !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (!it->is_regular_file(ec)) continue;
    const uint64_t size = it->file_size(ec);
    bucket_bytes += size;
    const std::string p = it->path().string();
    if (p.find("/tables/") != std::string::npos) table_bytes += size;
    if (p.find("/versions/") != std::string::npos) head_bytes += size;
  }
  fs::remove_all(cache, ec);
  if (FindMount(mnt)) (void)Unmount(mnt, true);
  fs::create_directories(mnt, ec);
  std::vector<Line> lines;
  auto measure = [&](const std::string& what, const std::function<std::string()>& op) {
    const Counters before = MountCounters(mnt);
    const auto t = Clock::now();
    const std::string note = op();
    const double secs = std::chrono::duration<double>(Clock::now() - t).count();
    const Counters after = MountCounters(mnt);
    lines.push_back({what, secs, after.requests - before.requests, after.bytes - before.bytes, note});
  };
  const std::string limit = std::to_string(o.memory_limit);
  // The peak RSS of every mount daemon this run starts (read before each unmount).
  uint64_t daemon_rss = 0;
  auto note_daemon_rss = [&] {
    char buf[64];
    const ssize_t n = ::getxattr(mnt.c_str(), "user.weightfs.pid", buf, sizeof buf - 1);
    if (n <= 0) return;
    buf[n] = 0;
    std::ifstream status("/proc/" + std::string(buf) + "/status");
    for (std::string l; std::getline(status, l);) {
      if (l.rfind("VmHWM:", 0) == 0) daemon_rss = std::max<uint64_t>(daemon_rss, std::strtoull(l.c_str() + 6, nullptr, 10) * 1024);
    }
  };
  // Mount, and the first listing of the model's directory.
  {
    const auto t = Clock::now();
    Run r = RunSelf({"mount", bucket_dir, mnt, "--cache-dir", cache, "--memory-limit", limit, "--log-file",
                     o.dir + "/mount.log"});
    if (r.code != 0) return Fail("mount failed: " + r.out);
    size_t entries = 0;
    for (const auto& e : fs::directory_iterator(mnt + "/scale", ec)) {
      (void)e;
      ++entries;
    }
    const Counters c = MountCounters(mnt);
    lines.push_back({"mount + first ls of the model dir", std::chrono::duration<double>(Clock::now() - t).count(),
                     c.requests, c.bytes, std::to_string(entries) + " entries"});
  }
  measure("ls -l of the model dir (every version)", [&] {
    size_t n = 0;
    for (const auto& e : fs::directory_iterator(mnt + "/scale", ec)) {
      struct stat st {};
      if (::lstat(e.path().c_str(), &st) == 0) ++n;
    }
    return std::to_string(n) + " stat";
  });
  const int newest = o.versions - 1;
  measure("ls -l of a version dir (not yet read)", [&] {
    size_t n = 0;
    for (const auto& e : fs::directory_iterator(mnt + "/scale/m@" + VersionName(newest / 2), ec)) {
      struct stat st {};
      if (::lstat(e.path().c_str(), &st) == 0) ++n;
    }
    return std::to_string(n) + " files";
  });
  // First reads at depths 1, 16, 64, each on a fresh mount with an empty cache: the newest
  // version of that depth whose chain the mount did not preload (it reads the heads of the 16
  // newest versions), so that each figure is what a cold read of that depth costs.
  auto remount = [&]() -> std::string {
    note_daemon_rss();
    (void)RunSelf({"unmount", mnt, "--keep-drafts"});
    fs::remove_all(cache, ec);
    Run r = RunSelf({"mount", bucket_dir, mnt, "--cache-dir", cache, "--memory-limit", limit, "--log-file",
                     o.dir + "/mount.log"});
    if (r.code != 0) return "mount failed: " + r.out;
    for (const auto& e : fs::directory_iterator(mnt + "/scale", ec)) (void)e;
    return "";
  };
  constexpr int kPreloaded = 16;
  for (int want : {1, 16, 64}) {
    if (want > o.keyframe_depth) continue;
    int k = newest - kPreloaded;
    while (k >= 0 && DepthOf(k, o.keyframe_depth) != want) --k;
    if (k < 0) continue;
    if (std::string failed = remount(); !failed.empty()) return Fail(failed);
    char name[64];
    std::snprintf(name, sizeof name, "shard-%05d-of-%05d.bin", 1, o.files);
    const std::string path = mnt + "/scale/m@" + VersionName(k) + "/" + name;
    const uint64_t rows = std::min<uint64_t>(o.chunks, (o.chunks + o.files - 1) / o.files);
    measure("first chunk read at depth " + std::to_string(want), [&] {
      int fd = ::open(path.c_str(), O_RDONLY);
      if (fd < 0) return std::string("open failed: ") + std::strerror(errno);
      // The middle chunk: in a file of many rows, far from the rows an open reads. Only it:
      // the kernel's readahead would read its neighbours too (which, with --real-rows, have
      // no payload to read), and so would the mount's after 2 MiB of a sequential run; the
      // first MiB of a chunk materializes all of it.
      std::vector<uint8_t> buf(std::min<uint64_t>(chunk, 1 << 20));
      (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
      const ssize_t got = ::pread(fd, buf.data(), buf.size(), static_cast<off_t>(ProbeRow(rows) * chunk));
      ::close(fd);
      return got == static_cast<ssize_t>(buf.size()) ? VersionName(k) : std::string("short read");
    });
  }
  // The newest version's first chunk of the first shard: what the push below changes.
  std::vector<uint8_t> newest_chunk(chunk);
  measure("first chunk read of the newest version (head preloaded)", [&] {
    char name[64];
    std::snprintf(name, sizeof name, "shard-%05d-of-%05d.bin", 1, o.files);
    const int fd = ::open((mnt + "/scale/m@" + VersionName(newest) + "/" + name).c_str(), O_RDONLY);
    if (fd < 0) return std::string("open failed: ") + std::strerror(errno);
    (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);  // (see above)
    ssize_t got = ::pread(fd, newest_chunk.data(), std::min<uint64_t>(chunk, 1 << 20), 0);
    if (got == static_cast<ssize_t>(std::min<uint64_t>(chunk, 1 << 20)) && chunk > (1 << 20)) {
      // The rest of the chunk (already materialized: no bucket request), for the push below.
      got = ::pread(fd, newest_chunk.data(), chunk, 0);
    }
    ::close(fd);
    if (got != static_cast<ssize_t>(chunk)) newest_chunk.clear();
    return std::string(got == static_cast<ssize_t>(chunk) ? VersionName(newest) : "short read");
  });
  measure("mkdir of a draft", [&] {
    const std::string draft = mnt + "/scale/m@draft-1";
    const int rc = ::mkdir(draft.c_str(), 0755);
    const std::string note = rc == 0 ? "" : std::string("failed: ") + std::strerror(errno);
    (void)::rmdir(draft.c_str());
    if (rc == 0) (void)RunSelf({"discard", draft});
    return note;
  });
  note_daemon_rss();
  (void)RunSelf({"unmount", mnt, "--keep-drafts"});
  // The CLI: log, log --last 10, and a push (one small file: the metadata path of a push).
  Run logged = RunSelf({"log", bucket_dir, "scale/m"});
  lines.push_back({"log (every version)", logged.seconds, 0, 0,
                   (logged.code == 0 ? "" : "failed; ") + std::string("peak RSS ") + FormatBytes(static_cast<double>(logged.max_rss)),
                   logged.max_rss});
  Run last = RunSelf({"log", bucket_dir, "scale/m", "--last", "10"});
  lines.push_back({"log --last 10", last.seconds, 0, 0,
                   (last.code == 0 ? "" : "failed; ") + std::string("peak RSS ") + FormatBytes(static_cast<double>(last.max_rss)),
                   last.max_rss});
  {
    // A push of a version whose one file is the newest version's first shard's first chunk,
    // stepped: encoded as a delta against the latest (its default parent), whose chunk it
    // materializes from the bucket through its chain.
    const std::string src = o.dir + "/push-src";
    fs::remove_all(src, ec);
    fs::create_directories(src, ec);
    std::mt19937_64 rng(static_cast<uint64_t>(::getpid()));
    if (newest_chunk.empty()) newest_chunk = Weights(chunk, rng);
    Step(newest_chunk, o.changed, rng);
    char name_buf[64];
    std::snprintf(name_buf, sizeof name_buf, "/shard-%05d-of-%05d.bin", 1, o.files);
    std::ofstream(src + name_buf, std::ios::binary)
        .write(reinterpret_cast<const char*>(newest_chunk.data()), static_cast<std::streamsize>(newest_chunk.size()));
    const std::string name = "scale/m@push-" + std::to_string(::getpid());
    Run pushed = RunSelf({"push", bucket_dir, name, src, "--no-cache"});
    std::string stored;
    if (pushed.code == 0) {
      Run info = RunSelf({"log", bucket_dir, "scale/m", "--last", "1", "--json"});
      const nlohmann::json j = nlohmann::json::parse(info.out, nullptr, false);
      if (j.is_array() && !j.empty() && j.back().is_object()) {
        stored = "stored " + FormatBytes(static_cast<double>(j.back().value("stored_bytes", uint64_t{0}))) + "; ";
      }
    }
    lines.push_back({"push of a delta version (one chunk)", pushed.seconds, 0, 0,
                     (pushed.code == 0 ? stored : "failed: " + pushed.out) + std::string("peak RSS ") +
                         FormatBytes(static_cast<double>(pushed.max_rss)),
                     pushed.max_rss});
    // Leave the bucket as built, for the next run.
    fs::remove(bucket_dir + "/models/scale/m/versions/push-" + std::to_string(::getpid()) + ".json", ec);
    for (const auto& e : fs::directory_iterator(bucket_dir + "/models/scale/m/times", ec)) {
      if (e.path().filename().string().find("-push-") != std::string::npos) fs::remove(e.path(), ec);
    }
  }
  const double rows = static_cast<double>(o.chunks) * o.versions;
  const RealRows real = MeasureRealRows(o);
  const double head_per_version = static_cast<double>(head_bytes) / o.versions;
  const double meta_per_version = real.bytes_per_row * static_cast<double>(o.chunks) + head_per_version;
  const double delta_per_version = real.delta_per_chunk * static_cast<double>(o.chunks);
  if (o.json) {
    nlohmann::json j;
    j["chunks"] = o.chunks;
    j["versions"] = o.versions;
    j["files"] = o.files;
    j["chunk_bytes"] = o.chunk_bytes;
    j["block_rows"] = o.block_rows;
    j["memory_limit"] = o.memory_limit;
    j["bucket_bytes"] = bucket_bytes;
    j["table_bytes"] = table_bytes;
    j["head_bytes"] = head_bytes;
    j["daemon_peak_rss"] = daemon_rss;
    j["real_row_bytes"] = real.bytes_per_row;
    j["metadata_per_version"] = meta_per_version;
    j["delta_per_version"] = delta_per_version;
    j["lines"] = nlohmann::json::array();
    for (const Line& l : lines) {
      j["lines"].push_back({{"what", l.what}, {"seconds", l.seconds}, {"requests", l.requests}, {"bytes", l.bytes}, {"note", l.note}, {"peak_rss", l.peak_rss}});
    }
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("bench scale: %llu chunks of %s in %d files (%s a version), %d versions, keyframe every %d\n",
              static_cast<unsigned long long>(o.chunks), FormatBytes(static_cast<double>(chunk)).c_str(), o.files,
              FormatBytes(static_cast<double>(o.chunks * chunk)).c_str(), o.versions, o.keyframe_depth + 1);
  std::printf("bucket %s: heads %s, tables %s (%.2f bytes a row%s)\n", FormatBytes(static_cast<double>(bucket_bytes)).c_str(),
              FormatBytes(static_cast<double>(head_bytes)).c_str(), FormatBytes(static_cast<double>(table_bytes)).c_str(),
              static_cast<double>(table_bytes) / rows,
              o.real_rows ? ", every row its own" : ": identical rows compress away; see below");
  std::printf("%-40s %10s %9s %11s  %s\n", "operation", "seconds", "requests", "received", "");
  for (const Line& l : lines) {
    std::printf("%-40s %10.3f %9llu %11s  %s\n", l.what.c_str(), l.seconds, static_cast<unsigned long long>(l.requests),
                FormatBytes(static_cast<double>(l.bytes)).c_str(), l.note.c_str());
  }
  std::printf("tables of distinct rows (a shard's rows with tensor names, random hashes, payload lengths of real\n"
              "  4 MiB deltas at %.2f%% changed): %.1f bytes a row; metadata a version %s (head %s) = %.3f%% of its\n"
              "  delta (%s; a keyframe chunk is %s)\n",
              100 * o.changed, real.bytes_per_row, FormatBytes(meta_per_version).c_str(), FormatBytes(head_per_version).c_str(),
              100 * meta_per_version / delta_per_version, FormatBytes(delta_per_version).c_str(),
              FormatBytes(real.keyframe_per_chunk).c_str());
  std::printf("mount daemon peak RSS %s (--memory-limit %s)\n", FormatBytes(static_cast<double>(daemon_rss)).c_str(),
              FormatBytes(static_cast<double>(o.memory_limit)).c_str());
  return 0;
}

}  // namespace weightfs::cli

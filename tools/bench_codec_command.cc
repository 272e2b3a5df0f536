// weightfs bench codec: the delta codec measured against zstd, zstd --patch-from, the sparse
// index+value format used for RL weight sync today, and the empirical entropy floor, all in one
// run on the same files. See --help.
#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/chunk_plan.h"
#include "core/element_ops.h"
#include "core/file_codec.h"
#include "core/hash.h"
#include "core/thread_pool.h"
#include "hub/engine/mapped_file.h"
#include "tools/checkpoint_generator.h"
#include "tools/cli.h"
#include "tools/commands.h"

extern char** environ;

namespace weightfs::cli {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr const char* kHelp = R"(usage: weightfs bench codec OLD NEW [options]
       weightfs bench codec OLD_DIR NEW_DIR [options]
       weightfs bench codec --generate [options]

Measures the weightfs chunk codec on a pair of files (NEW encoded against OLD), on every pair
of same-named files in two version directories (plus a total), or on pairs taken from
checkpoint sequences generated with `weightfs gen`'s simulated training. For each
pair it prints one table, all numbers measured in this run:

  changed          fraction of elements whose bits differ (tensor elements; bytes elsewhere)
  entropy floor    changed positions coded as Bernoulli(p) plus the empirical entropy of the
                   changed values' differences (order-preserving integer difference per element)
  weightfs DELTA   NEW as chunk deltas against OLD (what a node holding OLD downloads)
  weightfs FULL    NEW compressed on its own (keyframes)
  sparse idx+val   int32 index + new value per changed element (today's RL weight-sync format)
  zstd -3          the zstd CLI on NEW
  zstd -3 --patch-from=OLD, zstd -19 --long=31 --patch-from=OLD   the zstd CLI
  speeds           encode and decode MB/s of NEW's bytes, weightfs on 1 thread and all threads,
                   the zstd CLI on 1 thread (-T1) and all threads (-T0); decode is checked
                   bit-exact against NEW.

options:
  --json                 one JSON object per pair on stdout instead of tables
  --threads N            threads for "all threads" (default: all cores)
  --chunk-size SIZE      chunk size (default 4MiB)
  --zstd19 MODE          when to run zstd -19 --long=31 --patch-from (slow, ~1 MB/s): sparse
                         (pairs under 30% changed, default), all, or none
  --zstd19-max-size SIZE skip it for files larger than this (default 256MiB, ~5 min each)
  --no-zstd              skip every zstd CLI baseline
generated sequences (--generate):
  --params N             parameters of the generated model (default 25M)
  --work-dir DIR         where to generate (default: a new directory under $TMPDIR or /tmp)
  --keep                 keep the generated files
  --scenarios LIST       comma-separated subset of (default: all):
                           rl-1e-6, rl-3e-6, rl-1e-5, rl-1e-4  one AdamW step at that lr (bf16)
                           multi-step     ten steps at lr 1e-6 between the two versions
                           header-change  a step in which a tensor and metadata are added
                           sft            fifty steps at lr 2e-5 (dense changes)
                           fp32           one step of fp32 weights (every element changes)
                           optimizer      the optimizer-state blob (opaque bytes)
)";

struct Options {
  bool json = false;
  size_t threads = 0;
  uint64_t chunk_bytes = kDefaultChunkBytes;
  std::string zstd19 = "sparse";
  uint64_t zstd19_max_size = 256ull << 20;
  bool no_zstd = false;
};

// ---- running the zstd CLI ----------------------------------------------------------------

struct CmdResult {
  bool ok = false;
  double seconds = 0;
};

// Runs argv with stdout redirected to `out_path` ("/dev/null" to discard), timing the run.
CmdResult RunTimed(const std::vector<std::string>& args, const std::string& out_path) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
  pid_t pid;
  auto t0 = Clock::now();
  int rc = posix_spawnp(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  CmdResult r;
  if (rc != 0) return r;
  int status = 0;
  waitpid(pid, &status, 0);
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  r.ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  return r;
}

uint64_t FileSize(const std::string& path) {
  std::error_code ec;
  auto s = fs::file_size(path, ec);
  return ec ? 0 : s;
}

// ---- statistics of a pair ----------------------------------------------------------------

struct PairStats {
  uint64_t compared = 0;  // elements compared
  uint64_t changed = 0;
  double value_bits = 0;             // empirical entropy of the changed differences, total bits
  uint64_t unpaired_bytes = 0;       // chunks with no same-size parent chunk (counted as stored)
};

PairStats ComputePairStats(std::span<const uint8_t> old_file, std::span<const uint8_t> new_file,
                           const EncodedFile& delta) {
  PairStats st;
  std::unordered_map<uint64_t, uint64_t> hist;  // key: width << 56 ^ difference
  uint64_t changed_total = 0;
  for (const EncodedChunk& c : delta.chunks) {
    if (!c.parent || c.parent->length != c.spec.length) {
      st.unpaired_bytes += c.payload_bytes;
      continue;
    }
    const size_t width = c.spec.dtype == DType::kOpaque ? 1 : DTypeSize(c.spec.dtype);
    const bool is_float = DTypeIsFloat(c.spec.dtype);
    const uint8_t* a = old_file.data() + c.parent->offset;
    const uint8_t* b = new_file.data() + c.spec.offset;
    const uint64_t n = c.spec.length / width;
    st.compared += n;
    if (c.encoding == ChunkEncoding::kSame) continue;
    auto scan = [&]<typename T>() {
      for (uint64_t i = 0; i < n; ++i) {
        const T x = elem::Load<T>(a + i * sizeof(T)), y = elem::Load<T>(b + i * sizeof(T));
        if (x == y) continue;
        ++changed_total;
        const T d = T(elem::ToOrd(y, is_float) - elem::ToOrd(x, is_float));
        ++hist[(uint64_t{sizeof(T)} << 56) ^ uint64_t(d)];
      }
    };
    elem::DispatchWidth(width, scan);
  }
  st.changed = changed_total;
  for (const auto& [key, count] : hist) {
    const double q = static_cast<double>(count) / static_cast<double>(changed_total);
    st.value_bits -= static_cast<double>(count) * std::log2(q);
  }
  return st;
}

double BernoulliBits(uint64_t n, uint64_t k) {
  if (n == 0 || k == 0 || k == n) return 0;
  const double p = static_cast<double>(k) / static_cast<double>(n);
  return static_cast<double>(n) * (-p * std::log2(p) - (1 - p) * std::log2(1 - p));
}

// ---- weightfs encode / decode --------------------------------------------------------------

struct Encoded {
  EncodedFile file;
  std::vector<std::vector<uint8_t>> payloads;
};

Encoded EncodeOnce(FileEncoder& encoder, std::span<const uint8_t> file,
                   std::span<const uint8_t> parent) {
  Encoded e;
  std::mutex mu;
  std::map<size_t, std::vector<uint8_t>> collected;
  e.file = encoder.Encode(file, parent, [&](size_t i, std::span<const uint8_t> p) {
    std::vector<uint8_t> copy(p.begin(), p.end());
    std::lock_guard<std::mutex> lock(mu);
    collected[i] = std::move(copy);
  });
  e.payloads.resize(e.file.chunks.size());
  for (auto& [i, p] : collected) e.payloads[i] = std::move(p);
  return e;
}

template <typename F>
double BestSeconds(int reps, F&& f) {
  double best = 1e300;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

struct Speeds {
  double enc_1 = 0, enc_n = 0, dec_1 = 0, dec_n = 0;  // MB/s of NEW's bytes
};

// ---- one pair -----------------------------------------------------------------------------

struct PairReport {
  std::string name;
  std::string old_path, new_path;
  uint64_t new_bytes = 0;
  double changed_fraction = 0;
  uint64_t delta_bytes = 0, full_bytes = 0;
  double floor_bytes = 0;
  uint64_t sparse_format_bytes = 0;
  std::map<std::string, uint64_t> encodings;  // chunk counts per encoding
  Speeds delta_speed, full_speed;
  bool exact = false;
  std::optional<uint64_t> zstd3_bytes, zstd3_patch_bytes, zstd19_patch_bytes;
  double zstd3_enc_1 = 0, zstd3_enc_n = 0, zstd3_dec = 0, zstd19_patch_enc = 0, zstd3_patch_enc = 0;
};

std::string TempPath(const std::string& tag) {
  const char* tmp = std::getenv("TMPDIR");
  std::string dir = tmp && *tmp ? tmp : "/tmp";
  return dir + "/weightfs-bench-" + std::to_string(getpid()) + "-" + tag;
}

Expected<PairReport> BenchPair(const std::string& name, const std::string& old_path,
                               const std::string& new_path, const Options& opt) {
  WFS_ASSIGN_OR_RETURN(MappedFile old_map, MappedFile::Open(old_path));
  WFS_ASSIGN_OR_RETURN(MappedFile new_map, MappedFile::Open(new_path));
  old_map.Prefault();
  new_map.Prefault();
  const auto old_b = old_map.bytes();
  const auto new_b = new_map.bytes();
  PairReport r;
  r.name = name;
  r.old_path = old_path;
  r.new_path = new_path;
  r.new_bytes = new_b.size();
  const double mb = static_cast<double>(new_b.size()) / 1e6;

  ThreadPool pool_n(opt.threads);
  ThreadPool pool_1(1);
  const int reps = new_b.size() < (256u << 20) ? 3 : 1;

  FileEncoder encoder_n(&pool_n, EncodeOptions{}, opt.chunk_bytes);
  FileEncoder encoder_1(&pool_1, EncodeOptions{}, opt.chunk_bytes);
  FileDecoder decoder_n(&pool_n), decoder_1(&pool_1);

  // DELTA
  Encoded delta;
  r.delta_speed.enc_n = mb / BestSeconds(reps, [&] { delta = EncodeOnce(encoder_n, new_b, old_b); });
  r.delta_speed.enc_1 = mb / BestSeconds(reps, [&] { (void)EncodeOnce(encoder_1, new_b, old_b); });
  r.delta_bytes = delta.file.payload_bytes();
  for (const EncodedChunk& c : delta.file.chunks) ++r.encodings[std::string(ChunkEncodingName(c.encoding))];

  std::vector<uint8_t> out(new_b.size());
  std::memset(out.data(), 0, out.size());
  auto source = [&](size_t i) -> Expected<std::span<const uint8_t>> {
    return std::span<const uint8_t>(delta.payloads[i]);
  };
  Status st;
  r.delta_speed.dec_n = mb / BestSeconds(reps, [&] { st = decoder_n.Decode(delta.file, source, old_b, out); });
  r.exact = st.ok() && std::memcmp(out.data(), new_b.data(), new_b.size()) == 0;
  r.delta_speed.dec_1 = mb / BestSeconds(reps, [&] { st = decoder_1.Decode(delta.file, source, old_b, out); });
  r.exact = r.exact && st.ok() && std::memcmp(out.data(), new_b.data(), new_b.size()) == 0;

  // FULL
  Encoded full;
  r.full_speed.enc_n = mb / BestSeconds(1, [&] { full = EncodeOnce(encoder_n, new_b, {}); });
  r.full_bytes = full.file.payload_bytes();
  auto full_source = [&](size_t i) -> Expected<std::span<const uint8_t>> {
    return std::span<const uint8_t>(full.payloads[i]);
  };
  r.full_speed.dec_n = mb / BestSeconds(1, [&] { st = decoder_n.Decode(full.file, full_source, {}, out); });
  r.exact = r.exact && st.ok() && std::memcmp(out.data(), new_b.data(), new_b.size()) == 0;
  full = Encoded{};

  // Floor and the sparse index+value format.
  PairStats ps = ComputePairStats(old_b, new_b, delta.file);
  r.changed_fraction = ps.compared ? static_cast<double>(ps.changed) / static_cast<double>(ps.compared) : 0;
  r.floor_bytes = (BernoulliBits(ps.compared, ps.changed) + ps.value_bits) / 8.0 +
                  static_cast<double>(ps.unpaired_bytes);
  {
    uint64_t sparse = 0;
    for (const EncodedChunk& c : delta.file.chunks) {
      if (!c.parent || c.parent->length != c.spec.length) {
        sparse += c.spec.length;  // shipped whole
        continue;
      }
      if (c.encoding == ChunkEncoding::kSame) continue;
      const size_t width = c.spec.dtype == DType::kOpaque ? 1 : DTypeSize(c.spec.dtype);
      const uint8_t* a = old_b.data() + c.parent->offset;
      const uint8_t* b = new_b.data() + c.spec.offset;
      for (uint64_t i = 0; i < c.spec.length; i += width) {
        if (std::memcmp(a + i, b + i, width) != 0) sparse += 4 + width;
      }
    }
    r.sparse_format_bytes = sparse;
  }

  // zstd CLI baselines.
  if (!opt.no_zstd) {
    const std::string z = TempPath("z3");
    auto c1 = RunTimed({"zstd", "-3", "-T1", "-q", "-f", "-c", new_path}, z);
    if (c1.ok) {
      r.zstd3_bytes = FileSize(z);
      r.zstd3_enc_1 = mb / c1.seconds;
      auto cn = RunTimed({"zstd", "-3", "-T0", "-q", "-f", "-c", new_path}, "/dev/null");
      r.zstd3_enc_n = cn.ok ? mb / cn.seconds : 0;
      double best = 1e300;
      for (int i = 0; i < reps; ++i) {
        auto d = RunTimed({"zstd", "-d", "-q", "-c", z}, "/dev/null");
        if (d.ok) best = std::min(best, d.seconds);
      }
      r.zstd3_dec = best < 1e300 ? mb / best : 0;
    }
    std::remove(z.c_str());
    const std::string patch_from = "--patch-from=" + old_path;
    auto p3 = RunTimed({"zstd", "-3", "-T1", "-q", "-f", "-c", patch_from, new_path}, z);
    if (p3.ok) {
      r.zstd3_patch_bytes = FileSize(z);
      r.zstd3_patch_enc = mb / p3.seconds;
    }
    std::remove(z.c_str());
    const bool run19 = (opt.zstd19 == "all" || (opt.zstd19 == "sparse" && r.changed_fraction < 0.30)) &&
                       new_b.size() <= opt.zstd19_max_size;
    if (!run19 && opt.zstd19 != "none" && new_b.size() > opt.zstd19_max_size) {
      std::fprintf(stderr, "weightfs: %s is larger than --zstd19-max-size; zstd -19 --patch-from skipped\n",
                   new_path.c_str());
    }
    if (run19) {
      auto p19 = RunTimed({"zstd", "-19", "--long=31", "-T1", "-q", "-f", "-c", patch_from, new_path}, z);
      if (p19.ok) {
        r.zstd19_patch_bytes = FileSize(z);
        r.zstd19_patch_enc = mb / p19.seconds;
      }
      std::remove(z.c_str());
    }
  }
  return r;
}

// ---- printing ------------------------------------------------------------------------------

void PrintTable(const PairReport& r) {
  const double nb = static_cast<double>(r.new_bytes);
  auto row = [&](const char* label, double bytes, const char* extra = "") {
    std::printf("  %-36s %14.0f  %9.1fx  %8.3f x floor%s\n", label, bytes, nb / std::max(bytes, 1.0),
                bytes / std::max(r.floor_bytes, 1.0), extra);
  };
  std::printf("\n== %s: %s -> %s\n", r.name.c_str(), r.old_path.c_str(), r.new_path.c_str());
  std::printf("  NEW %s, changed %.3f%% of elements, chunks:", FormatBytes(nb).c_str(),
              100 * r.changed_fraction);
  for (const auto& [k, v] : r.encodings) std::printf(" %s=%llu", k.c_str(), static_cast<unsigned long long>(v));
  std::printf("\n  %-36s %14s  %10s  %14s\n", "", "bytes", "ratio", "vs floor");
  row("entropy floor", r.floor_bytes);
  row("weightfs DELTA", static_cast<double>(r.delta_bytes));
  row("weightfs FULL", static_cast<double>(r.full_bytes));
  row("sparse int32 idx + value", static_cast<double>(r.sparse_format_bytes));
  if (r.zstd3_bytes) row("zstd -3 of NEW", static_cast<double>(*r.zstd3_bytes));
  if (r.zstd3_patch_bytes) row("zstd -3 --patch-from", static_cast<double>(*r.zstd3_patch_bytes));
  if (r.zstd19_patch_bytes) row("zstd -19 --long=31 --patch-from", static_cast<double>(*r.zstd19_patch_bytes));
  std::printf("  speeds (MB/s of NEW)                  encode 1T   encode all   decode 1T   decode all\n");
  std::printf("  %-36s %10.0f  %11.0f  %10.0f  %11.0f\n", "weightfs DELTA", r.delta_speed.enc_1,
              r.delta_speed.enc_n, r.delta_speed.dec_1, r.delta_speed.dec_n);
  std::printf("  %-36s %10s  %11.0f  %10s  %11.0f\n", "weightfs FULL", "", r.full_speed.enc_n, "",
              r.full_speed.dec_n);
  if (r.zstd3_bytes) {
    std::printf("  %-36s %10.0f  %11.0f  %10.0f  %11s\n", "zstd -3 (CLI)", r.zstd3_enc_1, r.zstd3_enc_n,
                r.zstd3_dec, "");
  }
  if (r.zstd3_patch_bytes) std::printf("  %-36s %10.1f\n", "zstd -3 --patch-from (CLI)", r.zstd3_patch_enc);
  if (r.zstd19_patch_bytes) std::printf("  %-36s %10.2f\n", "zstd -19 --long=31 --patch-from", r.zstd19_patch_enc);
  std::printf("  ratios: DELTA/floor %.3f", static_cast<double>(r.delta_bytes) / std::max(r.floor_bytes, 1.0));
  std::printf("  DELTA/sparse-idx %.3f", static_cast<double>(r.delta_bytes) / std::max<double>(1, static_cast<double>(r.sparse_format_bytes)));
  if (r.zstd19_patch_bytes) std::printf("  DELTA/zstd19-patch %.3f", static_cast<double>(r.delta_bytes) / static_cast<double>(*r.zstd19_patch_bytes));
  std::printf("  DELTA/FULL %.3f", static_cast<double>(r.delta_bytes) / std::max<double>(1, static_cast<double>(r.full_bytes)));
  if (r.zstd19_patch_bytes && r.zstd19_patch_enc > 0) std::printf("\n          encode speed vs zstd-19-patch %.0fx (1T)", r.delta_speed.enc_1 / r.zstd19_patch_enc);
  if (r.zstd3_bytes && r.zstd3_enc_1 > 0) std::printf("  vs zstd -3 %.2fx (1T) %.2fx (all)", r.delta_speed.enc_1 / r.zstd3_enc_1, r.delta_speed.enc_n / std::max(r.zstd3_enc_n, 1e-9));
  if (r.zstd3_dec > 0) std::printf("  decode vs zstd -d %.2fx (1T) %.2fx (all)", r.delta_speed.dec_1 / r.zstd3_dec, r.delta_speed.dec_n / r.zstd3_dec);
  std::printf("\n  bit-exact decode: %s\n", r.exact ? "yes" : "NO");
  std::fflush(stdout);
}

void PrintJson(const PairReport& r) {
  nlohmann::json j;
  j["name"] = r.name;
  j["old"] = r.old_path;
  j["new"] = r.new_path;
  j["changed_fraction"] = r.changed_fraction;
  j["new_bytes"] = r.new_bytes;
  j["delta_bytes"] = r.delta_bytes;
  j["full_bytes"] = r.full_bytes;
  j["entropy_floor_bytes"] = r.floor_bytes;
  j["sparse_index_value_bytes"] = r.sparse_format_bytes;
  j["encode_mb_s"] = r.delta_speed.enc_n;
  j["decode_mb_s"] = r.delta_speed.dec_n;
  j["encode_mb_s_1thread"] = r.delta_speed.enc_1;
  j["decode_mb_s_1thread"] = r.delta_speed.dec_1;
  j["full_encode_mb_s"] = r.full_speed.enc_n;
  j["full_decode_mb_s"] = r.full_speed.dec_n;
  j["exact"] = r.exact;
  j["chunk_encodings"] = r.encodings;
  if (r.zstd3_bytes) {
    j["zstd3_bytes"] = *r.zstd3_bytes;
    j["zstd3_encode_mb_s_1thread"] = r.zstd3_enc_1;
    j["zstd3_encode_mb_s"] = r.zstd3_enc_n;
    j["zstd3_decode_mb_s"] = r.zstd3_dec;
  }
  if (r.zstd3_patch_bytes) j["zstd3_patch_bytes"] = *r.zstd3_patch_bytes;
  if (r.zstd19_patch_bytes) {
    j["zstd19_patch_bytes"] = *r.zstd19_patch_bytes;
    j["zstd19_patch_encode_mb_s"] = r.zstd19_patch_enc;
  }
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);
}

// ---- generated scenarios ---------------------------------------------------------------------

struct Scenario {
  std::string name;
  GenOptions gen;
  std::string old_version, new_version, file;  // file: relative path inside the version dirs
};

std::vector<Scenario> AllScenarios(uint64_t params) {
  auto base = [&](double lr, int versions) {
    GenOptions g;
    g.params = params;
    g.versions = versions;
    g.lr = lr;
    g.shard_size = uint64_t{1} << 50;  // one file per version
    g.seed = 7;
    return g;
  };
  std::vector<Scenario> s;
  s.push_back({"rl-1e-6", base(1e-6, 4), "v003", "v004", "model.safetensors"});
  s.push_back({"rl-3e-6", base(3e-6, 4), "v003", "v004", "model.safetensors"});
  s.push_back({"rl-1e-5", base(1e-5, 4), "v003", "v004", "model.safetensors"});
  s.push_back({"rl-1e-4", base(1e-4, 4), "v003", "v004", "model.safetensors"});
  {
    Scenario m{"multi-step", base(1e-6, 1), "v000", "v001", "model.safetensors"};
    m.gen.steps_per_version = 10;
    s.push_back(m);
  }
  {
    Scenario h{"header-change", base(1e-5, 2), "v001", "v002", "model.safetensors"};
    h.gen.header_change_at = 2;
    s.push_back(h);
  }
  {
    Scenario sft{"sft", base(2e-5, 1), "v000", "v001", "model.safetensors"};
    sft.gen.steps_per_version = 50;
    s.push_back(sft);
  }
  {
    Scenario f{"fp32", base(1e-6, 2), "v001", "v002", "model.safetensors"};
    f.gen.dtype = DType::kF32;
    s.push_back(f);
  }
  {
    Scenario o{"optimizer", base(1e-5, 2), "v001", "v002", "optimizer.bin"};
    o.gen.opaque_size = params;  // ~bytes of one fp32 state for a quarter of the parameters
    s.push_back(o);
  }
  return s;
}

int RunGenerated(const ArgParser& args, const Options& opt) {
  uint64_t params = 25'000'000;
  if (auto p = args.Get("--params")) {
    auto v = ParseSize(*p);
    if (!v.ok()) return Fail(v.status());
    params = *v;
  }
  std::string want = args.GetOr("--scenarios", "");
  std::vector<Scenario> scenarios;
  for (Scenario& s : AllScenarios(params)) {
    if (want.empty() || ("," + want + ",").find("," + s.name + ",") != std::string::npos) {
      scenarios.push_back(std::move(s));
    }
  }
  if (scenarios.empty()) return Fail("no scenario matches --scenarios " + want + " (see --help)");
  const bool own_dir = !args.Has("--work-dir");
  const std::string work = own_dir ? TempPath("gen") : *args.Get("--work-dir");
  int failures = 0;
  for (Scenario& s : scenarios) {
    s.gen.out_dir = work + "/" + s.name;
    std::error_code ec;
    fs::remove_all(s.gen.out_dir, ec);
    if (!opt.json) {
      std::fprintf(stderr, "generating %s (%.1fM parameters)...\n", s.name.c_str(),
                   static_cast<double>(params) / 1e6);
    }
    Progress progress("generating " + s.name, 1);
    auto gen = GenerateCheckpoints(s.gen, [&](uint64_t done, uint64_t total) {
      progress.Update(done, total);
    });
    progress.Finish();
    if (!gen.ok()) return Fail(gen.status().WithContext("generating " + s.name));
    auto r = BenchPair(s.name, s.gen.out_dir + "/" + s.old_version + "/" + s.file,
                       s.gen.out_dir + "/" + s.new_version + "/" + s.file, opt);
    if (!r.ok()) return Fail(r.status());
    failures += !r->exact;
    opt.json ? PrintJson(*r) : PrintTable(*r);
    if (own_dir || !args.Has("--keep")) fs::remove_all(s.gen.out_dir, ec);
  }
  if (own_dir && !args.Has("--keep")) {
    std::error_code ec;
    fs::remove_all(work, ec);
  }
  return failures ? Fail("decode was not bit-exact") : 0;
}

// Two version directories (e.g. two checkpoints of a sharded model): every file of NEW with a
// namesake in OLD is one pair; a total over all pairs follows.
int RunDirectories(const std::string& old_dir, const std::string& new_dir, const Options& opt) {
  std::vector<std::string> files;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(new_dir, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (it->is_regular_file()) files.push_back(fs::relative(it->path(), new_dir).string());
  }
  if (ec) return Fail("cannot list " + new_dir + ": " + ec.message());
  std::sort(files.begin(), files.end());
  PairReport total;
  total.name = "total";
  total.old_path = old_dir;
  total.new_path = new_dir;
  total.exact = true;
  int pairs = 0;
  double changed = 0, enc_s = 0, dec_s = 0;
  for (const std::string& rel : files) {
    const std::string old_file = old_dir + "/" + rel;
    if (!fs::is_regular_file(old_file, ec)) {
      std::fprintf(stderr, "weightfs: %s has no counterpart in %s; skipped\n", rel.c_str(), old_dir.c_str());
      continue;
    }
    auto r = BenchPair(rel, old_file, new_dir + "/" + rel, opt);
    if (!r.ok()) return Fail(r.status());
    opt.json ? PrintJson(*r) : PrintTable(*r);
    ++pairs;
    const double mb = static_cast<double>(r->new_bytes) / 1e6;
    total.new_bytes += r->new_bytes;
    total.delta_bytes += r->delta_bytes;
    total.full_bytes += r->full_bytes;
    total.floor_bytes += r->floor_bytes;
    total.sparse_format_bytes += r->sparse_format_bytes;
    total.exact = total.exact && r->exact;
    changed += r->changed_fraction * static_cast<double>(r->new_bytes);
    enc_s += mb / std::max(r->delta_speed.enc_n, 1e-9);
    dec_s += mb / std::max(r->delta_speed.dec_n, 1e-9);
    for (const auto& [k, v] : r->encodings) total.encodings[k] += v;
    auto add = [](std::optional<uint64_t>& t, const std::optional<uint64_t>& x) {
      if (x) t = t.value_or(0) + *x;
    };
    add(total.zstd3_bytes, r->zstd3_bytes);
    add(total.zstd3_patch_bytes, r->zstd3_patch_bytes);
    add(total.zstd19_patch_bytes, r->zstd19_patch_bytes);
  }
  if (pairs == 0) return Fail("no file of " + new_dir + " has a counterpart in " + old_dir);
  const double mb = static_cast<double>(total.new_bytes) / 1e6;
  total.changed_fraction = changed / std::max<double>(1, static_cast<double>(total.new_bytes));
  total.delta_speed.enc_n = mb / std::max(enc_s, 1e-9);
  total.delta_speed.dec_n = mb / std::max(dec_s, 1e-9);
  if (opt.json) {
    PrintJson(total);
  } else {
    std::printf("\n== total over %d files (sizes summed; speeds over all files, all threads)\n", pairs);
    std::printf("  NEW %s, changed %.3f%%: DELTA %llu bytes (%.1fx), FULL %llu (%.2fx), floor %.0f, "
                "DELTA/floor %.3f, bit-exact %s\n",
                FormatBytes(static_cast<double>(total.new_bytes)).c_str(), 100 * total.changed_fraction,
                static_cast<unsigned long long>(total.delta_bytes),
                static_cast<double>(total.new_bytes) / std::max<double>(1, static_cast<double>(total.delta_bytes)),
                static_cast<unsigned long long>(total.full_bytes),
                static_cast<double>(total.new_bytes) / std::max<double>(1, static_cast<double>(total.full_bytes)),
                total.floor_bytes, static_cast<double>(total.delta_bytes) / std::max(total.floor_bytes, 1.0),
                total.exact ? "yes" : "NO");
  }
  return total.exact ? 0 : Fail("decode was not bit-exact");
}

}  // namespace

int BenchCodecMain(int argc, char** argv) {
  ArgParser args({"--threads", "--chunk-size", "--zstd19", "--zstd19-max-size", "--params",
                  "--work-dir", "--scenarios"},
                 {"--json", "--generate", "--keep", "--no-zstd", "--help", "-h"});
  if (Status s = args.Parse(argc, argv, 1); !s.ok()) return Fail(s);
  if (args.Has("--help") || args.Has("-h")) {
    std::fputs(kHelp, stdout);
    return 0;
  }
  Options opt;
  opt.json = args.Has("--json");
  opt.no_zstd = args.Has("--no-zstd");
  opt.zstd19 = args.GetOr("--zstd19", "sparse");
  if (opt.zstd19 != "sparse" && opt.zstd19 != "all" && opt.zstd19 != "none") {
    return Fail("--zstd19 takes sparse, all or none");
  }
  if (auto m = args.Get("--zstd19-max-size")) {
    auto v = ParseSize(*m);
    if (!v.ok()) return Fail(v.status().WithContext("--zstd19-max-size"));
    opt.zstd19_max_size = *v;
  }
  if (auto t = args.Get("--threads")) {
    auto v = ParseSize(*t);
    if (!v.ok() || *v == 0 || *v > 1024) return Fail("--threads takes a number from 1 to 1024");
    opt.threads = *v;
  }
  if (auto c = args.Get("--chunk-size")) {
    auto v = ParseSize(*c);
    if (!v.ok() || *v < 4096 || *v > kMaxChunkBytes) return Fail("--chunk-size takes 4KiB..64MiB");
    opt.chunk_bytes = *v;
  }
  if (args.Has("--generate")) return RunGenerated(args, opt);
  if (args.positionals().size() != 2) {
    std::fputs(kHelp, stderr);
    return 2;
  }
  const std::string old_path = args.positionals()[0], new_path = args.positionals()[1];
  std::error_code ec;
  if (fs::is_directory(old_path, ec) && fs::is_directory(new_path, ec)) {
    return RunDirectories(old_path, new_path, opt);
  }
  auto r = BenchPair(fs::path(new_path).filename().string(), old_path, new_path, opt);
  if (!r.ok()) return Fail(r.status());
  opt.json ? PrintJson(*r) : PrintTable(*r);
  return r->exact ? 0 : Fail("decode was not bit-exact");
}

}  // namespace weightfs::cli

// parser_bench: time and peak memory of the two parsers that read untrusted, model-sized input
// (ParseManifest, ParseSafetensorsHeader). Not a test: no assertions on time; it prints numbers.
// Each parse runs in a freshly executed process (this binary, reading the input from a file) so
// that its peak RSS is its own.
//
//   parser_bench manifest [CHUNKS]          a valid manifest of CHUNKS rows (default 500000)
//   parser_bench bomb                       ~200 MB of repeated rows in ~20 KB of zstd
//   parser_bench safetensors [TENSORS...]   a valid header of TENSORS tensors (default 70000)
//   parser_bench parse-manifest FILE [LIMIT] parses one manifest file (PARSER_BENCH_KEEP=1 keeps
//                                           the files generated above in /tmp, e.g. for perf)
//   parser_bench parse-safetensors FILE DATA_BYTES TENSORS
//
// Peak memory is the process's VmHWM after the parse minus its VmRSS before it (after the input
// was read).
#include <sys/wait.h>
#include <zstd.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "core/manifest.h"
#include "core/safetensors.h"

namespace weightfs {
namespace {

// A field of /proc/self/status in KiB ("VmRSS", "VmHWM").
long StatusKib(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string prefix = std::string(field) + ":";
  while (std::getline(in, line)) {
    if (line.rfind(prefix, 0) == 0) return std::strtol(line.c_str() + prefix.size(), nullptr, 10);
  }
  return -1;
}

std::vector<uint8_t> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

void WriteFile(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// In the child: times `parse` and prints it with the peak memory it added.
template <typename Parse>
int Measure(const std::string& label, Parse parse) {
  const long before = StatusKib("VmRSS");
  const auto t0 = std::chrono::steady_clock::now();
  const bool ok = parse();
  const auto t1 = std::chrono::steady_clock::now();
  const long peak = StatusKib("VmHWM");
  std::printf("%-48s %s %8.3f s  peak +%.1f MiB\n", label.c_str(), ok ? "ok    " : "FAILED",
              std::chrono::duration<double>(t1 - t0).count(), (peak - before) / 1024.0);
  return ok ? 0 : 1;
}

// Runs this binary with `args` and waits for it.
void RunChild(const std::vector<std::string>& args) {
  std::fflush(stdout);
  const pid_t pid = fork();
  if (pid == 0) {
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv("/proc/self/exe", argv.data());
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
}

Manifest BigManifest(size_t chunks) {
  // Like a large sharded checkpoint: 4 MiB chunks in 32 files, three versions of history.
  constexpr size_t kFiles = 32;
  Manifest m;
  m.model = "org/team/big-model";
  m.version = "v3";
  m.parent = "v2";
  m.created = "2027-01-31T23:59:59.999Z";
  m.created_ms = ParseUtc(m.created).value();
  m.versions = {"v3", "v2", "v1"};
  std::mt19937_64 rng(7);
  for (uint64_t p = 0; p < 400; ++p) m.packs.push_back(Hash128{rng(), rng()});
  for (size_t f = 0; f < kFiles; ++f) {
    ManifestFile file;
    char name[64];
    std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", f + 1, kFiles);
    file.path = name;
    file.sha256 = std::string(64, "0123456789abcdef"[f % 16]);
    uint64_t offset = 0;
    const size_t n = chunks / kFiles;
    for (size_t k = 0; k < n; ++k) {
      ManifestChunk c;
      const uint64_t length = k == 0 ? 123456 : kDefaultChunkBytes;
      c.key = k == 0 ? ChunkKey{kHeaderChunkName, 0}
                     : ChunkKey{"model.layers." + std::to_string(k / 24) + ".mlp.experts." +
                                    std::to_string(k / 3 % 8) + ".down_proj.weight",
                                k % 3};
      c.offset = offset;
      c.length = length;
      c.hash = Hash128{rng(), rng()};
      const bool delta = rng() % 4 != 0;
      c.encoding = delta ? ChunkEncoding::kSparse : ChunkEncoding::kFull;
      c.ref = {static_cast<uint32_t>(rng() % m.packs.size()), rng() % (1ull << 36),
               40 + rng() % (delta ? 200000 : length)};
      c.origin = static_cast<uint32_t>(rng() % 3);
      if (delta) {
        c.base = 1 + static_cast<uint32_t>(rng() % 2);
        c.depth = 1 + static_cast<uint32_t>(rng() % 64);
        c.chain_bytes = c.depth * 100000ull;
        c.keyframe_bytes = 3000000;
      }
      file.chunks.push_back(std::move(c));
      offset += length;
    }
    file.size = offset;
    m.stats.logical_bytes += offset;
    m.files.push_back(std::move(file));
  }
  return m;
}

std::vector<uint8_t> BigHeader(size_t tensors) {
  std::vector<TensorInfo> ts;
  ts.reserve(tensors);
  for (size_t i = 0; i < tensors; ++i) {
    TensorInfo t;
    t.name = "model.layers." + std::to_string(i / 512) + ".mlp.experts." + std::to_string(i % 512) +
             ".w";
    t.dtype = DType::kBF16;
    t.shape = {1 + i % 7, 3};
    ts.push_back(std::move(t));
  }
  return BuildSafetensorsHeader(ts, {{"format", "pt"}});
}

int BenchManifest(size_t chunks) {
  const Manifest m = BigManifest(chunks);
  const std::vector<uint8_t> bytes = SerializeManifest(m);
  const std::string path = "/tmp/parser_bench_manifest." + std::to_string(getpid());
  WriteFile(path, bytes);
  std::printf("manifest: %zu chunk rows, %zu bytes stored, %llu bytes of JSON\n", chunks, bytes.size(),
              ZSTD_getFrameContentSize(bytes.data(), bytes.size()));
  RunChild({"parser_bench", "parse-manifest", path});
  if (std::getenv("PARSER_BENCH_KEEP") == nullptr) std::remove(path.c_str());
  return 0;
}

// The bomb: ~200 MB of JSON that zstd packs into ~20 KB, here one valid file entry and
// then the same chunk row over and over (so the reader fails at the second row, after reading
// it all). Parsed with the default limit and with a mount's (a quarter of --memory-limit 1G).
int BenchBomb() {
  Manifest m = BigManifest(32);
  m.files.resize(1);
  std::vector<uint8_t> plain;
  {
    std::vector<uint8_t> one = SerializeManifest(m);  // small: plain JSON
    std::string text(one.begin(), one.end());
    const size_t rows = text.find("\"chunks\":[") + 10;
    const size_t row_end = text.find("]", rows) + 1;
    const std::string row = text.substr(rows, row_end - rows);
    std::string bomb = text.substr(0, row_end);
    while (bomb.size() < (200u << 20)) bomb += "," + row;
    bomb += text.substr(row_end);
    plain.assign(bomb.begin(), bomb.end());
  }
  std::vector<uint8_t> z(ZSTD_compressBound(plain.size()));
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, 19);
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_windowLog, 23);
  z.resize(ZSTD_compress2(cctx, z.data(), z.size(), plain.data(), plain.size()));
  ZSTD_freeCCtx(cctx);
  const std::string path = "/tmp/parser_bench_bomb." + std::to_string(getpid());
  WriteFile(path, z);
  std::printf("bomb: %zu bytes of JSON in %zu bytes of zstd\n", plain.size(), z.size());
  RunChild({"parser_bench", "parse-manifest", path, std::to_string(kDefaultMaxManifestJsonBytes)});
  RunChild({"parser_bench", "parse-manifest", path, std::to_string(256ull << 20)});
  if (std::getenv("PARSER_BENCH_KEEP") == nullptr) std::remove(path.c_str());
  return 0;
}

int ParseManifestFile(const std::string& path, uint64_t limit = kDefaultMaxManifestJsonBytes) {
  const std::vector<uint8_t> bytes = ReadFile(path);
  return Measure("ParseManifest (JSON limit " + std::to_string(limit >> 20) + " MiB)", [&] {
    Expected<Manifest> back = ParseManifest(bytes, {}, {}, limit);
    if (!back.ok()) std::printf("  %s\n", back.status().ToString().substr(0, 200).c_str());
    size_t rows = 0;
    if (back.ok()) {
      for (const ManifestFile& f : back->files) rows += f.chunks.size();
    }
    return back.ok() && rows > 0;
  });
}

int BenchSafetensors(const std::vector<size_t>& counts) {
  for (size_t n : counts) {
    const std::vector<uint8_t> prefix = BigHeader(n);
    const std::string path = "/tmp/parser_bench_header." + std::to_string(getpid());
    WriteFile(path, prefix);
    uint64_t data = 0;
    for (size_t i = 0; i < n; ++i) data += (1 + i % 7) * 3 * 2;
    RunChild({"parser_bench", "parse-safetensors", path, std::to_string(data), std::to_string(n)});
    if (std::getenv("PARSER_BENCH_KEEP") == nullptr) std::remove(path.c_str());
  }
  return 0;
}

int ParseSafetensorsFile(const std::string& path, uint64_t data, size_t n) {
  const std::vector<uint8_t> prefix = ReadFile(path);
  return Measure("ParseSafetensorsHeader " + std::to_string(n) + " tensors (" +
                     std::to_string(prefix.size() >> 10) + " KiB)",
                 [&] {
                   Expected<SafetensorsHeader> h = ParseSafetensorsHeader(prefix, prefix.size() + data);
                   if (!h.ok()) std::printf("  %s\n", h.status().ToString().c_str());
                   return h.ok() && h->tensors.size() == n;
                 });
}

}  // namespace
}  // namespace weightfs

int main(int argc, char** argv) {
  const std::string what = argc > 1 ? argv[1] : "";
  if (what == "manifest") {
    return weightfs::BenchManifest(argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 500000);
  }
  if (what == "safetensors") {
    std::vector<size_t> counts;
    for (int i = 2; i < argc; ++i) counts.push_back(std::strtoull(argv[i], nullptr, 10));
    if (counts.empty()) counts = {70000};
    return weightfs::BenchSafetensors(counts);
  }
  if (what == "bomb") return weightfs::BenchBomb();
  if (what == "parse-manifest" && argc == 3) return weightfs::ParseManifestFile(argv[2]);
  if (what == "parse-manifest" && argc == 4) {
    return weightfs::ParseManifestFile(argv[2], std::strtoull(argv[3], nullptr, 10));
  }
  if (what == "parse-safetensors" && argc == 5) {
    return weightfs::ParseSafetensorsFile(argv[2], std::strtoull(argv[3], nullptr, 10),
                                          std::strtoull(argv[4], nullptr, 10));
  }
  std::fprintf(stderr, "usage: parser_bench manifest [CHUNKS] | safetensors [TENSORS...]\n");
  return 2;
}

// libFuzzer target for core/manifest: ParseManifest on arbitrary bytes (JSON or a zstd frame).
// Beyond "never crash, never throw", a refused input must be refused with a kind a caller can
// map (Corruption, Unsupported, ResourceExhausted), and every accepted manifest must satisfy what
// the reader promises -- checked here independently of the reader's own code -- and survive
// SerializeManifest -> ParseManifest unchanged, as JSON and zstd-compressed.
//
//   cmake -DWEIGHTFS_FUZZ=ON -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang ...
//   ./manifest_fuzz -max_total_time=60 corpus/
// A seed corpus is any set of manifests, e.g. SerializeManifest output of small test manifests
// (keep seeds below -max_len, 4096 bytes by default, or raise it).
#include <zstd.h>

#include <cstddef>
#include <cstdint>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "core/manifest.h"
#include "tests/fuzz/fuzz_input.h"

namespace {

using weightfs::ErrorKind;
using weightfs::Manifest;
using weightfs::ManifestChunk;
using weightfs::ManifestFile;
using weightfs::fuzz::Check;

bool SameChunk(const ManifestChunk& a, const ManifestChunk& b) {
  return a.key == b.key && a.offset == b.offset && a.length == b.length && a.hash == b.hash &&
         a.encoding == b.encoding && a.ref.pack == b.ref.pack && a.ref.offset == b.ref.offset &&
         a.ref.length == b.ref.length && a.origin == b.origin && a.base == b.base &&
         a.depth == b.depth && a.chain_bytes == b.chain_bytes &&
         a.keyframe_bytes == b.keyframe_bytes;
}

bool Same(const Manifest& a, const Manifest& b) {
  if (a.model != b.model || a.version != b.version || a.parent != b.parent ||
      a.created != b.created || a.created_ms != b.created_ms || a.chunk_bytes != b.chunk_bytes ||
      a.versions != b.versions || a.packs != b.packs ||
      a.stats.logical_bytes != b.stats.logical_bytes ||
      a.stats.stored_bytes != b.stats.stored_bytes ||
      a.stats.changed_elements != b.stats.changed_elements ||
      a.stats.elements != b.stats.elements || a.files.size() != b.files.size()) {
    return false;
  }
  for (size_t i = 0; i < a.files.size(); ++i) {
    const ManifestFile& fa = a.files[i];
    const ManifestFile& fb = b.files[i];
    if (fa.path != fb.path || fa.size != fb.size || fa.sha256 != fb.sha256 ||
        fa.chunks.size() != fb.chunks.size()) {
      return false;
    }
    for (size_t k = 0; k < fa.chunks.size(); ++k) {
      if (!SameChunk(fa.chunks[k], fb.chunks[k])) return false;
    }
  }
  return true;
}

bool IsLowerHex(const std::string& s, size_t n) {
  if (s.size() != n) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

// What an accepted manifest promises (core/manifest.h), restated without the reader's code.
void CheckInvariants(const Manifest& m) {
  Check(weightfs::ValidateModelName(m.model).ok());
  Check(weightfs::ValidateVersionName(m.version).ok());
  if (m.parent) {
    Check(weightfs::ValidateVersionName(*m.parent).ok());
    Check(*m.parent != m.version);
  }
  auto when = weightfs::ParseUtc(m.created);
  Check(when.ok() && *when == m.created_ms);
  Check(m.chunk_bytes > 0 && m.chunk_bytes <= weightfs::kMaxChunkBytes);
  Check(!m.versions.empty() && m.versions[0] == m.version);
  std::set<std::string> versions;
  for (const std::string& v : m.versions) {
    Check(weightfs::ValidateVersionName(v).ok());
    Check(versions.insert(v).second);
  }

  std::set<std::string> paths;
  for (size_t i = 0; i < m.files.size(); ++i) {
    const ManifestFile& f = m.files[i];
    Check(weightfs::ValidateFilePath(f.path).ok());
    if (i > 0) Check(m.files[i - 1].path < f.path);
    paths.insert(f.path);
    Check(m.FindFile(f.path) == &f);
    Check(IsLowerHex(f.sha256, 64));
    uint64_t cursor = 0;
    std::set<weightfs::ChunkKey> keys;
    for (size_t k = 0; k < f.chunks.size(); ++k) {
      const ManifestChunk& c = f.chunks[k];
      Check(c.offset == cursor);  // no gap, no overlap
      Check(c.length > 0 && c.length <= weightfs::kMaxChunkBytes);
      Check(c.length <= f.size - cursor);
      cursor += c.length;
      Check(keys.insert(c.key).second);
      Check(f.ChunkAt(c.offset) == k && f.ChunkAt(c.offset + c.length - 1) == k);
      const int enc = static_cast<int>(c.encoding);
      Check(enc >= 1 && enc <= 5);
      Check(c.ref.pack < m.packs.size());
      Check(c.ref.length >= weightfs::kPayloadHeaderBytes);
      Check(c.origin < m.versions.size());
      if (c.is_delta()) {
        Check(c.base >= 1 && c.base < m.versions.size() && c.depth >= 1);
      } else {
        Check(c.base == 0 && c.depth == 0);
      }
      // KeyframePolicy's sum must not wrap for any accepted chunk.
      Check(c.chain_bytes <= UINT64_MAX / 4 && c.keyframe_bytes <= UINT64_MAX / 4);
    }
    Check(cursor == f.size);  // the chunks cover the file
  }
  // No file is also a directory of another file.
  for (const std::string& p : paths) {
    for (size_t slash = p.find('/'); slash != std::string::npos; slash = p.find('/', slash + 1)) {
      Check(paths.count(p.substr(0, slash)) == 0);
    }
  }
}

void CheckRoundTrip(const Manifest& m) {
  const std::vector<uint8_t> bytes = weightfs::SerializeManifest(m);
  auto again = weightfs::ParseManifest(bytes, m.model, m.version);
  Check(again.ok());
  Check(Same(m, *again));
  Check(weightfs::SerializeManifest(*again) == bytes);  // deterministic

  // Readers accept the compressed form of any manifest, not only of large ones.
  std::vector<uint8_t> z(ZSTD_compressBound(bytes.size()));
  const size_t n = ZSTD_compress(z.data(), z.size(), bytes.data(), bytes.size(), 1);
  Check(!ZSTD_isError(n));
  z.resize(n);
  auto unz = weightfs::ParseManifest(z);
  Check(unz.ok() && Same(m, *unz));

  // Stored under another name, the same bytes are refused.
  auto other = weightfs::ParseManifest(bytes, m.model + "x", m.version);
  Check(!other.ok() && other.status().kind() == ErrorKind::kCorruption);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto parsed = weightfs::ParseManifest(std::span<const uint8_t>(data, size));
  if (!parsed.ok()) {
    const ErrorKind kind = parsed.status().kind();
    Check(kind == ErrorKind::kCorruption || kind == ErrorKind::kUnsupported ||
          kind == ErrorKind::kResourceExhausted);
    Check(!parsed.status().message().empty());
    return 0;
  }
  CheckInvariants(*parsed);
  CheckRoundTrip(*parsed);
  return 0;
}

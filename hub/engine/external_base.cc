#include "hub/engine/external_base.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "core/chunk_plan.h"
#include "core/hash.h"
#include "core/safetensors.h"
#include "hub/engine/lease.h"  // NowMs

namespace weightfs {
namespace {

constexpr uint64_t kWindowBytes = 128ull << 20;  // >= 2 x kMaxChunkBytes
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

}  // namespace

Expected<Manifest> BuildExternalBase(const VersionRef& target, std::vector<ExternalBaseFile> files,
                                     ThreadPool& pool, uint64_t chunk_bytes,
                                     const std::function<void(uint64_t, uint64_t)>& progress) {
  WFS_TRY(ValidateModelName(target.model));
  WFS_TRY(ValidateVersionName(target.version));
  std::sort(files.begin(), files.end(),
            [](const ExternalBaseFile& a, const ExternalBaseFile& b) { return a.path < b.path; });
  Manifest m;
  m.model = target.model;
  m.version = target.version;
  m.versions = {target.version};
  m.chunk_bytes = chunk_bytes;
  uint64_t total = 0, done = 0;
  for (const ExternalBaseFile& f : files) total += f.size;
  for (size_t i = 0; i < files.size(); ++i) {
    const ExternalBaseFile& f = files[i];
    auto where = [&](const Status& s) { return s.WithContext(f.source); };
    WFS_TRY(ValidateFilePath(f.path));
    WFS_TRY(ValidateSourceName(f.source));
    if (i > 0 && files[i - 1].path == f.path) return Status::InvalidArgument("file " + f.path + " listed twice");

    // The plan needs the safetensors header (when the file is one): its first 8 + N bytes.
    std::vector<uint8_t> prefix;
    if (f.size >= 8) {
      Expected<std::vector<uint8_t>> head = f.read(0, 8);
      if (!head.ok()) return where(head.status());
      uint64_t n = 0;
      std::memcpy(&n, head->data(), 8);  // little-endian, as safetensors says
      if (n <= kMaxHeaderBytes && 8 + n <= f.size) {
        Expected<std::vector<uint8_t>> whole = f.read(0, 8 + n);
        if (!whole.ok()) return where(whole.status());
        prefix = std::move(whole).value();
      }
    }
    const ChunkPlan plan = prefix.empty() ? PlanChunks(std::nullopt, f.size, chunk_bytes)
                                          : PlanFile(prefix, f.size, chunk_bytes);
    ManifestFile mf;
    mf.path = f.path;
    mf.size = f.size;
    mf.chunks.resize(plan.chunks.size());
    const uint32_t source = m.SourceIndex(f.source);
    Sha256 sha;
    // Windows of whole chunks: read, hash the chunks in parallel, feed SHA-256 in order.
    size_t next = 0;
    while (next < plan.chunks.size()) {
      const uint64_t start = plan.chunks[next].offset;
      size_t end = next;
      while (end < plan.chunks.size() &&
             (end == next || plan.chunks[end].offset + plan.chunks[end].length - start <= kWindowBytes)) {
        ++end;
      }
      const uint64_t length = plan.chunks[end - 1].offset + plan.chunks[end - 1].length - start;
      Expected<std::vector<uint8_t>> window = f.read(start, length);
      if (!window.ok()) return where(window.status());
      if (window->size() != length) {
        return where(Status::IOError("short read: " + std::to_string(window->size()) + " of " +
                                     std::to_string(length) + " bytes at offset " + std::to_string(start)));
      }
      const std::span<const uint8_t> bytes(*window);
      pool.ParallelFor(end - next, [&](size_t k, size_t) {
        const ChunkSpec& spec = plan.chunks[next + k];
        ManifestChunk& c = mf.chunks[next + k];
        c.key = spec.key;
        c.offset = spec.offset;
        c.length = spec.length;
        c.hash = HashChunk(bytes.subspan(spec.offset - start, spec.length));
        c.encoding = ChunkEncoding::kExternal;
        c.ref = PayloadRef{source, spec.offset, spec.length};
        c.keyframe_bytes = spec.length;  // what a cold read of it fetches
      });
      sha.Update(bytes);
      for (size_t k = next; k < end; ++k) {
        const ChunkSpec& spec = plan.chunks[k];
        if (spec.role == ChunkRole::kTensor) {
          const size_t width = std::max<size_t>(1, DTypeSize(spec.dtype));
          m.stats.elements += spec.length / width;
        }
      }
      done += length;
      if (progress) progress(done, total);
      next = end;
    }
    mf.sha256 = sha.FinishHex();
    if (!f.sha256.empty() && f.sha256 != mf.sha256) {
      return where(Status::Corruption("SHA-256 of the bytes read is " + mf.sha256 +
                                      ", the source says " + f.sha256));
    }
    m.stats.logical_bytes += f.size;
    m.files.push_back(std::move(mf));
  }
  m.stats.changed_elements = m.stats.elements;  // a base: everything is new
  m.stats.stored_bytes = 0;
  m.created = FormatUtc(NowMs());
  // Round trip through the parser: what we publish must be what readers accept.
  WFS_ASSIGN_OR_RETURN(Manifest checked, ParseManifest(SerializeManifest(m), m.model, m.version));
  return checked;
}

}  // namespace weightfs

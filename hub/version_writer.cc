#include "hub/version_writer.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>

#include <spdlog/spdlog.h>

#include "core/file_codec.h"
#include "hub/lease.h"
#include "hub/mapped_file.h"
#include "hub/materializer.h"
#include "hub/pack_writer.h"

namespace weightfs {
namespace {

// Elements of `a` and `b` (same length) that differ, for elements of `width` bytes.
uint64_t CountChanged(std::span<const uint8_t> a, std::span<const uint8_t> b, size_t width) {
  uint64_t changed = 0;
  const size_t n = a.size() / width;
  size_t i = 0;
  // Skip equal stretches 64 bytes at a time; most of a sparse update is equal.
  const size_t block = 64 / width * width;
  while (i < n) {
    size_t off = i * width;
    if (off + block <= a.size() && std::memcmp(a.data() + off, b.data() + off, block) == 0) {
      i += block / width;
      continue;
    }
    changed += std::memcmp(a.data() + off, b.data() + off, width) != 0;
    ++i;
  }
  return changed;
}

struct PendingChunk {
  ManifestChunk entry;
  bool fresh = false;
  PackSlot slot;
};

}  // namespace

Expected<std::vector<PushFile>> FilesUnder(const std::string& dir) {
  namespace fs = std::filesystem;
  std::vector<PushFile> files;
  std::error_code ec;
  fs::recursive_directory_iterator it(dir, fs::directory_options::none, ec);
  if (ec) return Status::NotFound("cannot read directory " + dir + ": " + ec.message());
  for (; it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (ec) return Status::IOError("reading " + dir + ": " + ec.message());
    const std::string name = it->path().filename().string();
    if (!name.empty() && name[0] == '.') {
      if (it->is_directory()) it.disable_recursion_pending();
      continue;
    }
    if (!it->is_regular_file()) continue;
    files.push_back({fs::relative(it->path(), dir).string(), it->path().string()});
  }
  std::sort(files.begin(), files.end(),
            [](const PushFile& a, const PushFile& b) { return a.path < b.path; });
  return files;
}

Expected<PushResult> PushVersion(Bucket& bucket, ChunkCache* cache, ThreadPool& pool,
                                 const VersionRef& target, std::shared_ptr<const Manifest> parent,
                                 std::vector<PushFile> files, const PushOptions& options) {
  WFS_TRY(ValidateModelName(target.model));
  WFS_TRY(ValidateVersionName(target.version));
  const std::string name = target.model + "@" + target.version;
  std::sort(files.begin(), files.end(),
            [](const PushFile& a, const PushFile& b) { return a.path < b.path; });
  for (size_t i = 0; i < files.size(); ++i) {
    WFS_TRY(ValidateFilePath(files[i].path));
    if (i > 0 && files[i].path == files[i - 1].path) {
      return Status::InvalidArgument("file '" + files[i].path + "' given twice");
    }
  }
  if (files.empty()) return Status::InvalidArgument("nothing to push: no files given");

  // Fail before uploading anything if the version exists already.
  if (Expected<ObjectInfo> existing = bucket.store().Head(Bucket::ManifestKey(target.model, target.version));
      existing.ok()) {
    return Status::Conflict("version " + name + " already exists in " + bucket.Describe());
  }

  std::vector<MappedFile> mapped;
  uint64_t total_bytes = 0;
  for (const PushFile& f : files) {
    Expected<MappedFile> m = MappedFile::Open(f.local_path);
    if (!m.ok()) return m.status();
    total_bytes += m->size();
    mapped.push_back(std::move(m).value());
  }

  Manifest manifest;
  manifest.model = target.model;
  manifest.version = target.version;
  manifest.versions = {target.version};
  manifest.chunk_bytes = options.chunk_bytes;
  if (parent) {
    if (parent->model != target.model) {
      return Status::InvalidArgument("parent " + parent->model + "@" + parent->version +
                                     " belongs to another model");
    }
    manifest.parent = parent->version;
  }

  WFS_ASSIGN_OR_RETURN(std::unique_ptr<Lease> lease, Lease::Acquire(&bucket.store(), name));
  PackWriter packs(&bucket.store(), options.pack_bytes, options.uploaders, options.max_packs_in_flight);
  Materializer parents(&bucket, cache);
  std::mutex mu;  // guards manifest tables, first_error, progress state
  Status first_error;
  uint64_t done_bytes = 0;
  // Changed fraction counts tensor elements; bytes of other data (headers, opaque files) count
  // only when a version has no tensors at all.
  uint64_t other_changed = 0, other_elements = 0;
  PushResult result;
  std::vector<std::unique_ptr<ChunkCodec>> codecs(pool.size());
  std::vector<std::vector<uint8_t>> buffers(pool.size());

  for (size_t fi = 0; fi < files.size(); ++fi) {
    const std::span<const uint8_t> data = mapped[fi].bytes();
    const std::string& path = files[fi].path;
    std::error_code abs_ec;
    const std::string local_abs = std::filesystem::absolute(files[fi].local_path, abs_ec).string();
    ChunkPlan plan = PlanFile(data, data.size(), options.chunk_bytes);
    const ManifestFile* pfile = parent ? parent->FindFile(path) : nullptr;
    std::map<ChunkKey, size_t> parent_index;
    if (pfile) {
      for (size_t i = 0; i < pfile->chunks.size(); ++i) parent_index.emplace(pfile->chunks[i].key, i);
    }
    // SHA-256 of the whole file, alongside the chunk loop.
    std::string sha;
    std::thread sha_thread([&] {
      Sha256 h;
      h.Update(data);
      sha = h.FinishHex();
    });
    std::vector<PendingChunk> pending(plan.chunks.size());
    pool.ParallelFor(plan.chunks.size(), [&](size_t i, size_t slot) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (!first_error.ok()) return;
      }
      if (!codecs[slot]) codecs[slot] = std::make_unique<ChunkCodec>(options.encode);
      ChunkCodec& codec = *codecs[slot];
      std::vector<uint8_t>& payload = buffers[slot];
      const ChunkSpec& spec = plan.chunks[i];
      const auto bytes = data.subspan(spec.offset, spec.length);
      PendingChunk& p = pending[i];
      ManifestChunk& e = p.entry;
      e.key = spec.key;
      e.offset = spec.offset;
      e.length = spec.length;
      e.hash = HashChunk(bytes);
      const size_t width = spec.dtype == DType::kOpaque ? 1 : std::max<size_t>(1, DTypeSize(spec.dtype));
      uint64_t elements = spec.length / width, changed = elements;
      auto fail = [&](const Status& s) {
        std::lock_guard<std::mutex> lock(mu);
        if (first_error.ok()) first_error = s.WithContext(path + " " + DescribeChunk(spec.key));
      };

      auto it = pfile ? parent_index.find(spec.key) : parent_index.end();
      const ManifestChunk* pc = it != parent_index.end() ? &pfile->chunks[it->second] : nullptr;
      bool keyframe = true;
      if (pc && pc->hash == e.hash && pc->length == e.length) {
        // Unchanged: inherit the parent's recipe, translated into this manifest's tables.
        std::lock_guard<std::mutex> lock(mu);
        e.encoding = pc->encoding;
        e.ref = pc->ref;  // ref.pack indexes the parent's pack table until the rebuild below
        e.origin = manifest.VersionIndex(parent->versions[pc->origin]);
        e.base = pc->is_delta() ? manifest.VersionIndex(parent->versions[pc->base]) : 0;
        e.depth = pc->depth;
        e.chain_bytes = pc->chain_bytes;
        e.keyframe_bytes = pc->keyframe_bytes;
        changed = 0;
        result.same_chunks++;
      } else {
        if (pc) {
          Expected<ByteBuffer> pbytes = parents.Chunk(*parent, *pfile, it->second);
          if (!pbytes.ok()) return fail(pbytes.status().WithContext("materializing the parent's chunk"));
          ChunkEncoding enc = codec.EncodeDelta(spec.dtype, *pbytes, bytes, &payload);
          if (pbytes->size() == bytes.size()) changed = CountChanged(*pbytes, bytes, width);
          if (enc != ChunkEncoding::kFull && enc != ChunkEncoding::kRaw &&
              !options.keyframes.NeedsKeyframe(*pc, payload.size())) {
            keyframe = false;
            e.encoding = enc;
            e.depth = pc->depth + 1;
            e.chain_bytes = pc->chain_bytes + payload.size();
            e.keyframe_bytes = pc->keyframe_bytes;
            std::lock_guard<std::mutex> lock(mu);
            e.base = manifest.VersionIndex(parent->version);
          } else if (enc != ChunkEncoding::kFull && enc != ChunkEncoding::kRaw) {
            codec.EncodeFull(spec.dtype, bytes, &payload);
          }
        } else {
          codec.EncodeFull(spec.dtype, bytes, &payload);
        }
        if (keyframe) {
          e.encoding = static_cast<ChunkEncoding>(payload[5]);
          e.depth = 0;
          e.chain_bytes = 0;
          e.keyframe_bytes = payload.size();
          e.base = 0;
        }
        e.origin = 0;
        e.ref.length = payload.size();
        Expected<PackSlot> slot_or = packs.Add(payload);
        if (!slot_or.ok()) return fail(slot_or.status());
        p.slot = *slot_or;
        p.fresh = true;
      }
      if (cache && options.cache_new_chunks) {
        (void)cache->PutReference(e.hash, local_abs, spec.offset, spec.length);
      }
      std::lock_guard<std::mutex> lock(mu);
      if (p.fresh) {
        (keyframe ? result.full_chunks : result.delta_chunks)++;
        manifest.stats.stored_bytes += e.ref.length;
      }
      if (spec.role == ChunkRole::kTensor) {
        manifest.stats.changed_elements += changed;
        manifest.stats.elements += elements;
      } else {
        other_changed += changed;
        other_elements += elements;
      }
      done_bytes += spec.length;
      if (options.progress) options.progress(done_bytes, total_bytes);
    });
    sha_thread.join();
    if (!first_error.ok()) break;
    ManifestFile mf;
    mf.path = path;
    mf.size = data.size();
    mf.sha256 = sha;
    for (PendingChunk& p : pending) mf.chunks.push_back(p.entry);
    manifest.files.push_back(std::move(mf));
    // Remember the pack slots by file and chunk; resolved once the packs have names.
    for (size_t i = 0; i < pending.size(); ++i) {
      if (pending[i].fresh) {
        manifest.files.back().chunks[i].ref.pack = static_cast<uint32_t>(pending[i].slot.pack);
        manifest.files.back().chunks[i].ref.offset = pending[i].slot.offset;
        manifest.files.back().chunks[i].origin = 0;
      }
    }
    manifest.stats.logical_bytes += data.size();
  }
  if (manifest.stats.elements == 0) {
    manifest.stats.changed_elements = other_changed;
    manifest.stats.elements = other_elements;
  }
  Status upload = packs.Finish();
  if (!first_error.ok()) return first_error.WithContext("pushing " + name);
  if (!upload.ok()) return upload.WithContext("pushing " + name);

  // Fresh chunks (origin 0) hold pack sequence numbers in ref.pack, inherited ones indices
  // into the parent's pack table. Build this version's table so both point into it.
  std::map<Hash128, uint32_t> pack_index;
  for (ManifestFile& f : manifest.files) {
    for (ManifestChunk& c : f.chunks) {
      const Hash128& h = c.origin == 0 ? packs.PackHash(c.ref.pack) : parent->packs[c.ref.pack];
      auto [it, inserted] = pack_index.emplace(h, static_cast<uint32_t>(manifest.packs.size()));
      if (inserted) manifest.packs.push_back(h);
      c.ref.pack = it->second;
    }
  }
  manifest.created = FormatUtc(NowMs());
  Status published = bucket.PublishManifest(manifest);
  if (!published.ok()) return published;
  // Reading it back through the bucket validates what we wrote and caches it.
  WFS_ASSIGN_OR_RETURN(result.manifest, bucket.ReadManifest(target.model, target.version));
  result.packs = packs.pack_count();
  result.pack_bytes = packs.bytes_uploaded();
  return result;
}

}  // namespace weightfs

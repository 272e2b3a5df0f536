#include "hub/engine/version_writer.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <set>

#include <spdlog/spdlog.h>

#include "core/file_codec.h"
#include "core/mutex.h"
#include "core/safetensors.h"
#include "hub/engine/lease.h"
#include "hub/engine/materializer.h"
#include "hub/engine/pack_writer.h"
#include "hub/engine/push_record.h"
#include "hub/engine/staged_version.h"

namespace weightfs {
namespace {

// A safetensors file with no file of its path in the parent is stored whole: deltas pair files
// by path (a delta's base is the same path in its base version). When a parent file of
// another name holds the same tensors (checkpoints saved as step-0001.safetensors,
// step-0002.safetensors...), say so: stored under that name it would cost only its changes.
// Looks at a few parent files at most (a section read each); the warning is all it does.
void WarnIfRenamed(Bucket& bucket, const std::shared_ptr<const Manifest>& parent, const std::string& path,
                   const ChunkPlan& plan) {
  std::set<std::string> tensors;
  for (const ChunkSpec& c : plan.chunks) {
    if (c.role == ChunkRole::kTensor) tensors.insert(c.key.tensor);
  }
  if (tensors.empty()) return;
  size_t looked = 0;
  for (const ManifestFile& f : parent->files) {
    if (!f.path.ends_with(".safetensors")) continue;
    if (looked++ == 8) break;
    Expected<std::shared_ptr<const ManifestFile>> rows = bucket.File(parent, f);
    if (!rows.ok()) return;
    size_t same = 0;
    std::set<std::string> seen;
    for (const ManifestChunk& c : (*rows)->chunks) {
      if (!c.key.tensor.empty() && c.key.tensor != kHeaderChunkName && seen.insert(c.key.tensor).second) {
        same += tensors.count(c.key.tensor);
      }
    }
    if (same * 10 >= tensors.size() * 9) {
      spdlog::warn("{} has no file of that path in {}@{} and is stored whole (deltas pair files by path); {} there "
                   "holds the same tensors: saved under that name it would store only its changes (weightfs push "
                   "BUCKET MODEL@VERSION FILE --as {}, or in a draft: cp FILE DRAFT/{})",
                   path, parent->model, parent->version, f.path, f.path, f.path);
      return;
    }
  }
}

// The bytes CheckSafetensors needs of `data`: its 8 + N header prefix when the first 8 bytes
// give a length that fits the file (else its first 8 bytes, enough for a verdict). In memory:
// a view; by descriptor: read into `storage`.
Expected<std::span<const uint8_t>> HeaderBytes(const FileBytes& data, std::vector<uint8_t>* storage) {
  if (data.in_memory()) return data.memory();
  storage->resize(std::min<uint64_t>(data.size(), 8));
  WFS_TRY(data.Read(0, *storage));
  if (Expected<uint64_t> prefix = SafetensorsPrefixLength(*storage); prefix.ok() && *prefix <= data.size()) {
    storage->resize(*prefix);
    WFS_TRY(data.Read(8, std::span<uint8_t>(*storage).subspan(8)));
  }
  return std::span<const uint8_t>(*storage);
}

// A file's SHA-256 fed by the encode loop's workers, chunk by chunk in file order (the chunks
// must tile the file: Tiles). Thread-safe.
class OrderedSha {
 public:
  // Whether the plan's chunks tile [0, size) in index order (PlanChunks promises it).
  static bool Tiles(const ChunkPlan& plan, uint64_t size) {
    uint64_t at = 0;
    for (const ChunkSpec& c : plan.chunks) {
      if (c.offset != at) return false;
      at += c.length;
    }
    return at == size;
  }

  // Chunk `index`'s place in the hash: Hash(its bytes) once it is the next to hash; a Turn that
  // ends without hashing (an error, an exception) abandons the hash and wakes every waiter.
  class Turn {
   public:
    Turn(OrderedSha& sha, size_t index) : sha_(sha), index_(index) {}
    Turn(const Turn&) = delete;
    Turn& operator=(const Turn&) = delete;
    ~Turn() {
      if (hashed_) return;
      {
        MutexLock lock(sha_.mu_);
        sha_.abandoned_ = true;
      }
      sha_.cv_.NotifyAll();
    }
    void Hash(std::span<const uint8_t> bytes) {
      {
        MutexLock lock(sha_.mu_);
        sha_.cv_.Wait(sha_.mu_, [&]() WFS_REQUIRES(sha_.mu_) { return sha_.next_ == index_ || sha_.abandoned_; });
        if (sha_.abandoned_) return;
      }
      sha_.hash_.Update(bytes);  // only the turn's holder touches it
      {
        MutexLock lock(sha_.mu_);
        sha_.next_ = index_ + 1;
      }
      hashed_ = true;
      sha_.cv_.NotifyAll();
    }

   private:
    OrderedSha& sha_;
    size_t index_;
    bool hashed_ = false;
  };

  // The hex digest, or nullopt if a chunk was not hashed. After the loop.
  std::optional<std::string> Finish() {
    MutexLock lock(mu_);
    if (abandoned_) return std::nullopt;
    return hash_.FinishHex();
  }

 private:
  Mutex mu_;
  CondVar cv_;
  size_t next_ WFS_GUARDED_BY(mu_) = 0;
  bool abandoned_ WFS_GUARDED_BY(mu_) = false;
  Sha256 hash_;
};

struct PendingChunk {
  ManifestChunk entry;
  bool fresh = false;
  PackSlot slot;
};

// Fresh chunks hold their pack's sequence number in ref.pack until Finish; a payload an
// interrupted push uploaded (PushOptions::record) holds this plus its index in resumed_packs.
constexpr uint32_t kResumedPack = 1u << 31;

}  // namespace

Expected<std::vector<PushFile>> FilesUnder(const std::string& dir) {
  namespace fs = std::filesystem;
  std::vector<PushFile> files;
  std::error_code ec;
  const fs::path base = fs::path(dir).lexically_normal();
  fs::recursive_directory_iterator it(dir, fs::directory_options::none, ec);
  if (ec) return Status::NotFound("cannot read directory " + dir + ": " + ec.message());
  for (; it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (ec) return Status::IOError("reading " + dir + ": " + ec.message());
    const std::string name = it->path().filename().string();
    if (!name.empty() && name[0] == '.') {
      if (it->is_directory()) it.disable_recursion_pending();
      continue;
    }
    // Symlinks to regular files are followed (a Hugging Face cache snapshot is a directory of
    // symlinks into ../../blobs/); symlinked directories are not descended into.
    if (!it->is_regular_file()) continue;
    // Lexically: fs::relative would resolve the symlink and name the blob ("../../blobs/...").
    files.push_back({it->path().lexically_normal().lexically_relative(base).generic_string(), it->path().string()});
  }
  std::sort(files.begin(), files.end(),
            [](const PushFile& a, const PushFile& b) { return a.path < b.path; });
  return files;
}

struct VersionEncoder::State {
  Bucket& bucket;
  ChunkCache* cache;
  ThreadPool& pool;
  std::shared_ptr<const Manifest> parent;
  const PushOptions& options;
  const uint64_t total_bytes;
  PackWriter packs;
  Materializer parents;
  Manifest manifest;
  // Guards manifest tables, first_error, progress state while ParallelFor runs. Not
  // WFS_GUARDED_BY: the single-threaded steps between the loops use them without it.
  Mutex mu;
  Status first_error;
  uint64_t done_bytes = 0;
  // Changed fraction counts tensor elements; bytes of other data (headers, opaque files) count
  // only when a version has no tensors at all.
  uint64_t other_changed = 0, other_elements = 0;
  PushResult result;
  std::vector<std::unique_ptr<ChunkCodec>> codecs;
  std::vector<std::vector<uint8_t>> buffers;
  // Each chunk is copied here before it is hashed and encoded: the codec reads its input in
  // several passes and must see the same bytes in each (a draft's staging file written again
  // while it is encoded, a pushed file changed on disk). The copy costs ~0.3 ms a 4 MiB chunk.
  std::vector<ByteBuffer> snapshots;  // (ByteBuffer: growing one does not zero it)
  std::vector<Hash128> resumed_packs;   // (under mu)
  std::map<Hash128, uint32_t> resumed_index;

  State(Bucket& b, ChunkCache* c, ThreadPool& p, std::shared_ptr<const Manifest> par,
        const PushOptions& o, uint64_t total)
      : bucket(b), cache(c), pool(p), parent(std::move(par)), options(o), total_bytes(total),
        packs(&b.store(), o.pack_bytes, o.uploaders, o.max_packs_in_flight), parents(&b, c),
        codecs(p.size()), buffers(p.size()), snapshots(p.size()) {
    if (o.record) {
      packs.set_on_uploaded([r = o.record](size_t seq, const Hash128& h, uint64_t n) { r->PackUploaded(seq, h, n); });
    }
  }
};

VersionEncoder::VersionEncoder(Bucket& bucket, ChunkCache* cache, ThreadPool& pool,
                               const VersionRef& target, std::shared_ptr<const Manifest> parent,
                               const PushOptions& options, uint64_t total_bytes)
    : state_(std::make_unique<State>(bucket, cache, pool, std::move(parent), options, total_bytes)) {
  Manifest& m = state_->manifest;
  m.model = target.model;
  m.version = target.version;
  m.versions = {target.version};
  m.chunk_bytes = options.chunk_bytes;
  if (state_->parent) {
    m.parent = state_->parent->version;
    if (state_->parent->format == kManifestFormat2) m.inherited_from = state_->parent->table;
  }
  // A parent whose history holds this version's own name (the version itself, or a descendant
  // of it) would map the chunks inherited from that version onto this one's own (origin 0: the
  // fresh packs), a wrong pack or an out-of-range read: refused.
  if (state_->parent) {
    for (const std::string& v : state_->parent->versions) {
      if (v == target.version) {
        state_->first_error = Status::InvalidArgument(
            "cannot encode " + target.model + "@" + target.version + " against " + state_->parent->model + "@" +
            state_->parent->version + ": its history already holds " + target.version);
        break;
      }
    }
  }
}

VersionEncoder::~VersionEncoder() = default;

Status VersionEncoder::AddFile(const std::string& path, const FileBytes& data, const std::string& local_path) {
  State& st = *state_;
  if (!st.first_error.ok()) return st.first_error;
  const std::shared_ptr<const Manifest>& parent = st.parent;
  const PushOptions& options = st.options;
  Manifest& manifest = st.manifest;
  Mutex& mu = st.mu;
  std::string local_abs;
  if (!local_path.empty()) {
    std::error_code abs_ec;
    local_abs = std::filesystem::absolute(local_path, abs_ec).string();
  }
  // One parse of the header: the plan's and the check's.
  std::vector<uint8_t> prefix_bytes;
  WFS_ASSIGN_OR_RETURN(const std::span<const uint8_t> prefix, HeaderBytes(data, &prefix_bytes));
  const Expected<std::optional<SafetensorsHeader>> header = CheckSafetensors(path, prefix, data.size());
  if (!header.ok()) {
    if (!options.allow_invalid) {
      return Status::InvalidArgument(std::string(header.status().message()) +
                                     "; fix the file or leave it out, or store it as opaque bytes with --allow-invalid");
    }
    spdlog::warn("{}; stored as opaque bytes (--allow-invalid)", header.status().message());
  }
  static const std::optional<SafetensorsHeader> kOpaque;
  ChunkPlan plan = PlanChunks(header.ok() ? *header : kOpaque, data.size(), options.chunk_bytes);
  // The parent's file of this path, with its rows (format 2 reads the file's table section).
  std::shared_ptr<const ManifestFile> pfile_rows;
  if (const ManifestFile* head_file = parent ? parent->FindFile(path) : nullptr) {
    Expected<std::shared_ptr<const ManifestFile>> rows = st.bucket.File(parent, *head_file);
    if (!rows.ok()) return rows.status().WithContext("the parent's " + path);
    pfile_rows = std::move(rows).value();
  }
  const ManifestFile* pfile = pfile_rows.get();
  if (!pfile && parent && plan.safetensors) WarnIfRenamed(st.bucket, parent, path, plan);
  std::map<ChunkKey, size_t> parent_index;
  if (pfile) {
    for (size_t i = 0; i < pfile->chunks.size(); ++i) parent_index.emplace(pfile->chunks[i].key, i);
  }
  // SHA-256 of the whole file, fed by the chunk loop in chunk order from each chunk's private
  // copy (the plan's chunks tile the file): the file is read once, not twice (a second read was
  // a third of the encoder's kernel time). The loop hands chunks out in order, so a worker waits
  // for its turn at most one chunk's hashing.
  if (!OrderedSha::Tiles(plan, data.size())) {
    return Status::Corruption("the chunk plan of " + path + " does not tile the file");
  }
  OrderedSha ordered;
  std::vector<PendingChunk> pending(plan.chunks.size());
  auto encode_chunk = [&](size_t i, size_t slot) {
    OrderedSha::Turn turn(ordered, i);  // (a chunk left without hashing abandons the hash)
    {
      MutexLock lock(mu);
      if (!st.first_error.ok()) return;
    }
    if (!st.codecs[slot]) st.codecs[slot] = std::make_unique<ChunkCodec>(options.encode);
    ChunkCodec& codec = *st.codecs[slot];
    std::vector<uint8_t>& payload = st.buffers[slot];
    const ChunkSpec& spec = plan.chunks[i];
    // A private copy: a file that changes under the encoder must not yield a hash of one state
    // and a payload of another.
    ByteBuffer& snapshot = st.snapshots[slot];
    snapshot.resize(spec.length);
    if (Status read = data.Read(spec.offset, snapshot); !read.ok()) {
      MutexLock lock(mu);
      if (st.first_error.ok()) st.first_error = read.WithContext(path);
      return;
    }
    const std::span<const uint8_t> bytes(snapshot);
    turn.Hash(bytes);
    PendingChunk& p = pending[i];
    ManifestChunk& e = p.entry;
    e.key = spec.key;
    e.offset = spec.offset;
    e.length = spec.length;
    e.hash = HashChunk(bytes);
    const size_t width = spec.dtype == DType::kOpaque ? 1 : std::max<size_t>(1, DTypeSize(spec.dtype));
    uint64_t elements = spec.length / width, changed = elements;
    auto fail = [&](const Status& s) {
      MutexLock lock(mu);
      if (st.first_error.ok()) st.first_error = s.WithContext(path + " " + DescribeChunk(spec.key));
    };

    auto it = pfile ? parent_index.find(spec.key) : parent_index.end();
    const ManifestChunk* pc = it != parent_index.end() ? &pfile->chunks[it->second] : nullptr;
    bool keyframe = true;
    if (pc && pc->hash == e.hash && pc->length == e.length) {
      // Unchanged: inherit the parent's recipe, translated into this manifest's tables.
      MutexLock lock(mu);
      e.encoding = pc->encoding;
      e.ref = pc->ref;  // ref.pack indexes the parent's pack table until Finish
      e.origin = manifest.VersionIndex(parent->versions[pc->origin]);
      e.base = pc->is_delta() ? manifest.VersionIndex(parent->versions[pc->base]) : 0;
      e.depth = pc->depth;
      e.chain_bytes = pc->chain_bytes;
      e.keyframe_bytes = pc->keyframe_bytes;
      changed = 0;
      st.result.same_chunks++;
    } else if (const PushRecord::Chunk* r = options.record ? options.record->Find(path, i) : nullptr;
               r && r->offset == spec.offset && r->length == spec.length && r->input == e.hash &&
               (!r->base || (pc && pc->hash == *r->base))) {
      // Encoded and uploaded by an interrupted run of this push, from these very bytes (and,
      // for a delta, this very parent chunk): its payload is in the bucket already.
      keyframe = !r->base;
      e.encoding = r->encoding;
      e.depth = r->depth;
      e.chain_bytes = r->chain_bytes;
      e.keyframe_bytes = r->keyframe_bytes;
      e.origin = 0;
      e.ref.length = r->payload_bytes;
      changed = r->changed;
      MutexLock lock(mu);
      e.base = r->base ? manifest.VersionIndex(parent->version) : 0;
      auto [at, added] = st.resumed_index.emplace(r->pack, static_cast<uint32_t>(st.resumed_packs.size()));
      if (added) st.resumed_packs.push_back(r->pack);
      p.slot = PackSlot{kResumedPack + at->second, r->pack_offset};
      p.fresh = true;
      st.result.resumed_chunks++;
      st.result.resumed_bytes += r->payload_bytes;
    } else {
      if (pc) {
        Expected<ByteBuffer> pbytes = st.parents.Chunk(*parent, *pfile, it->second);
        if (!pbytes.ok()) return fail(pbytes.status().WithContext("materializing the parent's chunk"));
        // (The changed elements are counted from the changes the encoder finds: a count of
        // its own was 12-15% of encode time.)
        ChunkEncoding enc = codec.EncodeDelta(spec.dtype, *pbytes, bytes, &payload, &changed);
        if (enc != ChunkEncoding::kFull && enc != ChunkEncoding::kRaw &&
            !options.keyframes.NeedsKeyframe(*pc, payload.size())) {
          keyframe = false;
          e.encoding = enc;
          e.depth = pc->depth + 1;
          e.chain_bytes = pc->chain_bytes + payload.size();
          e.keyframe_bytes = pc->keyframe_bytes;
          MutexLock lock(mu);
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
      Expected<PackSlot> slot_or = st.packs.Add(payload);
      if (!slot_or.ok()) return fail(slot_or.status());
      p.slot = *slot_or;
      p.fresh = true;
      if (options.record) {
        PushRecord::Chunk rc;
        rc.offset = e.offset;
        rc.length = e.length;
        rc.input = e.hash;
        if (!keyframe) rc.base = pc->hash;
        rc.encoding = e.encoding;
        rc.depth = e.depth;
        rc.chain_bytes = e.chain_bytes;
        rc.keyframe_bytes = e.keyframe_bytes;
        rc.pack_offset = p.slot.offset;
        rc.payload_bytes = e.ref.length;
        rc.changed = changed;
        options.record->Add(path, i, rc, p.slot.pack);
      }
    }
    MutexLock lock(mu);
    if (p.fresh) {
      (keyframe ? st.result.full_chunks : st.result.delta_chunks)++;
      manifest.stats.stored_bytes += e.ref.length;
    }
    if (spec.role == ChunkRole::kTensor) {
      manifest.stats.changed_elements += changed;
      manifest.stats.elements += elements;
    } else {
      st.other_changed += changed;
      st.other_elements += elements;
    }
    st.done_bytes += spec.length;
    if (options.progress) options.progress(st.done_bytes, st.total_bytes);
  };
  // An exception in the loop (an allocation failing) fails this file, like an error does.
  try {
    st.pool.ParallelFor(plan.chunks.size(), encode_chunk);
  } catch (...) {
    Status s = StatusOfCurrentException("encoding " + path);
    MutexLock lock(mu);
    if (st.first_error.ok()) st.first_error = std::move(s);
  }
  if (!st.first_error.ok()) return st.first_error;
  const std::optional<std::string> sha = ordered.Finish();
  if (!sha) return Status::IOError(path + ": the file's SHA-256 missed a chunk");
  if (st.cache && options.cache_new_chunks && !local_abs.empty()) {
    // One index file for the whole file (not a cache file per chunk): the next push, whose
    // parent this version is, finds its bases in it.
    std::vector<ChunkRef> refs;
    refs.reserve(pending.size());
    for (const PendingChunk& p : pending) refs.push_back({p.entry.hash, p.entry.offset, p.entry.length});
    (void)st.cache->PutReferences(local_abs, refs);
  }
  ManifestFile mf;
  mf.path = path;
  mf.size = data.size();
  mf.sha256 = *sha;
  for (PendingChunk& p : pending) mf.chunks.push_back(p.entry);
  // Fresh chunks remember their pack slot; resolved once the packs have names.
  for (size_t i = 0; i < pending.size(); ++i) {
    if (pending[i].fresh) {
      mf.chunks[i].ref.pack = static_cast<uint32_t>(pending[i].slot.pack);
      mf.chunks[i].ref.offset = pending[i].slot.offset;
      mf.chunks[i].origin = 0;
    }
  }
  manifest.files.push_back(std::move(mf));
  manifest.stats.logical_bytes += data.size();
  return Status::Ok();
}

std::array<uint64_t, 4> VersionEncoder::Tally() const {
  const State& st = *state_;
  return {st.manifest.stats.elements, st.manifest.stats.changed_elements, st.other_elements, st.other_changed};
}

Expected<Manifest> VersionEncoder::Finish(PushResult* result) {
  State& st = *state_;
  Manifest& manifest = st.manifest;
  st.result.tensor_elements = manifest.stats.elements;
  st.result.tensor_changed = manifest.stats.changed_elements;
  st.result.other_elements = st.other_elements;
  st.result.other_changed = st.other_changed;
  if (manifest.stats.elements == 0) {
    manifest.stats.changed_elements = st.other_changed;
    manifest.stats.elements = st.other_elements;
  }
  Status upload = st.packs.Finish();
  if (!st.first_error.ok()) return st.first_error;
  if (!upload.ok()) return upload;
  // Fresh chunks (origin 0) hold pack sequence numbers in ref.pack, inherited ones indices
  // into the parent's pack table. Build this version's table so both point into it.
  std::map<Hash128, uint32_t> pack_index;
  for (ManifestFile& f : manifest.files) {
    for (ManifestChunk& c : f.chunks) {
      if (c.is_external()) {  // inherited from the parent: its index into the parent's sources
        c.ref.pack = manifest.SourceIndex(st.parent->sources[c.ref.pack]);
        continue;
      }
      const Hash128 h = c.origin != 0                  ? st.parent->packs[c.ref.pack]
                        : c.ref.pack >= kResumedPack ? st.resumed_packs[c.ref.pack - kResumedPack]
                                                     : st.packs.PackHash(c.ref.pack);
      auto [it, inserted] = pack_index.emplace(h, static_cast<uint32_t>(manifest.packs.size()));
      if (inserted) manifest.packs.push_back(h);
      c.ref.pack = it->second;
    }
  }
  manifest.created = FormatUtc(NowMs());
  if (result) {
    *result = st.result;
    result->packs = st.packs.pack_count();
    result->pack_bytes = st.packs.bytes_uploaded();
  }
  return std::move(manifest);
}

void AppendFileFrom(const Manifest& src, const ManifestFile& file, Manifest* dst, bool src_is_dst) {
  ManifestFile out = file;
  auto version = [&](uint32_t i) -> uint32_t {
    return (src_is_dst && i == 0) ? 0 : dst->VersionIndex(src.versions[i]);
  };
  for (ManifestChunk& c : out.chunks) {
    c.ref.pack = c.is_external() ? dst->SourceIndex(src.sources[c.ref.pack])
                                 : dst->PackIndex(src.packs[c.ref.pack]);
    c.origin = version(c.origin);
    c.base = c.is_delta() ? version(c.base) : 0;
  }
  auto at = std::lower_bound(dst->files.begin(), dst->files.end(), out.path,
                             [](const ManifestFile& f, const std::string& p) { return f.path < p; });
  dst->files.insert(at, std::move(out));
}

Status CheckPushFiles(const VersionRef& target, const Manifest* parent, std::vector<PushFile>* files) {
  WFS_TRY(ValidateModelName(target.model));
  WFS_TRY(ValidateVersionName(target.version));
  std::sort(files->begin(), files->end(), [](const PushFile& a, const PushFile& b) { return a.path < b.path; });
  for (size_t i = 0; i < files->size(); ++i) {
    WFS_TRY(ValidateFilePath((*files)[i].path));
    if (i > 0 && (*files)[i].path == (*files)[i - 1].path) {
      return Status::InvalidArgument("file '" + (*files)[i].path + "' given twice");
    }
  }
  if (parent && parent->model != target.model) {
    return Status::InvalidArgument("parent " + parent->model + "@" + parent->version + " belongs to another model");
  }
  return Status::Ok();
}

Expected<Manifest> EncodePushFiles(Bucket& bucket, ChunkCache* cache, ThreadPool& pool, const VersionRef& target,
                                   std::shared_ptr<const Manifest> parent, const std::vector<PushFile>& files,
                                   const PushOptions& options, const std::string& what, PushResult* result) {
  std::vector<FileBytes> opened;
  uint64_t total_bytes = 0;
  for (const PushFile& f : files) {
    Expected<FileBytes> o = FileBytes::Open(f.local_path);
    if (!o.ok()) return o.status();
    total_bytes += o->size();
    opened.push_back(std::move(o).value());
  }
  auto truncated = [&](size_t fi) {
    return Status::IOError(files[fi].local_path + " was truncated while it was being read; nothing was "
                           "published (push it again once it is complete)");
  };
  // (The caller holds the lease: gc leaves the record's packs alone from here on.)
  if (options.record && !options.record->loaded()) WFS_TRY(options.record->Load(bucket.store(), pool));
  VersionEncoder encoder(bucket, cache, pool, target, std::move(parent), options, total_bytes);
  for (size_t fi = 0; fi < files.size(); ++fi) {
    Status s = encoder.AddFile(files[fi].path, opened[fi], files[fi].local_path);
    if (!s.ok()) return opened[fi].Shrank() ? truncated(fi) : s.WithContext(what);
  }
  Expected<Manifest> manifest = encoder.Finish(result);
  if (!manifest.ok()) return manifest.status().WithContext(what);
  return manifest;
}

Expected<PushResult> PushVersion(Bucket& bucket, ChunkCache* cache, ThreadPool& pool,
                                 const VersionRef& target, std::shared_ptr<const Manifest> parent,
                                 std::vector<PushFile> files, const PushOptions& options) {
  const std::string name = target.model + "@" + target.version;
  WFS_TRY(CheckPushFiles(target, parent.get(), &files));
  if (files.empty()) return Status::InvalidArgument("nothing to push: no files given");

  // Fail before uploading anything if the version exists already, or other writers are
  // staging it in parts (docs/parts.md): a one-writer push would publish one part's view.
  if (Expected<ObjectInfo> existing = bucket.store().Head(Bucket::ManifestKey(target.model, target.version));
      existing.ok()) {
    return Status::Conflict("version " + name + " already exists in " + bucket.Describe());
  }
  if (Expected<bool> staged = StagedVersion::IsStaged(bucket, target.model, target.version); !staged.ok()) {
    return staged.status();
  } else if (*staged) {
    return Status::Conflict("version " + name + " is being written in parts by other writers (`weightfs log` shows "
                            "them); push this one's files with --parts N, or under another name");
  }

  WFS_ASSIGN_OR_RETURN(std::unique_ptr<Lease> lease, Lease::Acquire(&bucket.store(), name));
  PushResult result;
  Expected<Manifest> manifest = EncodePushFiles(bucket, cache, pool, target, parent, files, options,
                                                "pushing " + name, &result);
  if (!manifest.ok()) return manifest.status();
  Status published = bucket.PublishManifest(*manifest);
  if (!published.ok()) return published;
  if (options.record) options.record->Remove();  // published: nothing to resume
  // Reading it back through the bucket validates what we wrote (format 2: the head and every
  // section of its table).
  WFS_ASSIGN_OR_RETURN(result.manifest, bucket.ReadFullManifest(target.model, target.version));
  return result;
}

}  // namespace weightfs

#include "hub/engine/weight_patcher.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "core/hash.h"
#include "core/safetensors.h"
#include "hub/engine/version_reader.h"

namespace weightfs {
namespace {

// The data section while the header is not known yet: an unlinked temporary file.
class SpillFile {
 public:
  SpillFile() = default;
  SpillFile(const SpillFile&) = delete;
  SpillFile& operator=(const SpillFile&) = delete;
  ~SpillFile() {
    if (fd_ >= 0) ::close(fd_);
  }

  Status Open(const std::string& dir) {
    const std::string d = dir.empty() ? std::filesystem::temp_directory_path().string() : dir;
    fd_ = ::open(d.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (fd_ < 0) {  // a file system without O_TMPFILE: a named file, unlinked at once
      std::string name = d + "/.weightfs-patch-XXXXXX";
      fd_ = ::mkostemp(name.data(), O_CLOEXEC);
      if (fd_ < 0) {
        return StatusOfErrno(errno, "creating a temporary file in " + d);
      }
      ::unlink(name.c_str());
    }
    dir_ = d;
    return Status::Ok();
  }

  Status Append(std::span<const uint8_t> bytes) {
    while (!bytes.empty()) {
      const ssize_t n = ::write(fd_, bytes.data(), bytes.size());
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const std::string m = "writing a temporary file in " + dir_ + ": " + std::strerror(errno);
        return errno == ENOSPC ? Status::ResourceExhausted(m) : Status::IOError(m);
      }
      bytes = bytes.subspan(static_cast<size_t>(n));
      size_ += static_cast<uint64_t>(n);
    }
    return Status::Ok();
  }

  // Everything appended, in order, to `sink`.
  Status CopyTo(const PatchSink& sink) {
    std::vector<uint8_t> buffer(std::min<uint64_t>(size_, 4 << 20));
    for (uint64_t off = 0; off < size_;) {
      const size_t want = static_cast<size_t>(std::min<uint64_t>(buffer.size(), size_ - off));
      const ssize_t n = ::pread(fd_, buffer.data(), want, static_cast<off_t>(off));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return StatusOfErrno(errno, "reading a temporary file in " + dir_);
      WFS_TRY(sink(std::span<const uint8_t>(buffer.data(), static_cast<size_t>(n))));
      off += static_cast<uint64_t>(n);
    }
    return Status::Ok();
  }

  uint64_t size() const { return size_; }

 private:
  int fd_ = -1;
  std::string dir_;
  uint64_t size_ = 0;
};

// Whether the elem bytes at a and b are the same: loads of the element's width, not a libc
// call per element (a patch tests every position its deltas name, ~1% of a model's elements).
inline bool SameElement(const uint8_t* a, const uint8_t* b, size_t elem) {
  switch (elem) {
    case 1: return *a == *b;
    case 2: {
      uint16_t x, y;
      std::memcpy(&x, a, 2);
      std::memcpy(&y, b, 2);
      return x == y;
    }
    case 4: {
      uint32_t x, y;
      std::memcpy(&x, a, 4);
      std::memcpy(&y, b, 4);
      return x == y;
    }
    case 8: {
      uint64_t x, y;
      std::memcpy(&x, a, 8);
      std::memcpy(&y, b, 8);
      return x == y;
    }
    default: return std::memcmp(a, b, elem) == 0;
  }
}

// Element positions where a and b differ (same length, a multiple of elem; elem in 1, 2, 4, 8).
void DiffElements(std::span<const uint8_t> a, std::span<const uint8_t> b, size_t elem,
                  std::vector<uint32_t>* out) {
  out->clear();
  const size_t n = a.size() / elem;
  const size_t per = 64 / elem;  // elements in a 64-byte block
  size_t i = 0;
  for (; i + per <= n; i += per) {
    if (std::memcmp(a.data() + i * elem, b.data() + i * elem, 64) == 0) continue;
    for (size_t j = i; j < i + per; ++j) {
      if (!SameElement(a.data() + j * elem, b.data() + j * elem, elem)) out->push_back(static_cast<uint32_t>(j));
    }
  }
  for (; i < n; ++i) {
    if (!SameElement(a.data() + i * elem, b.data() + i * elem, elem)) out->push_back(static_cast<uint32_t>(i));
  }
}


// How a chunk's contribution was found.
enum class ChunkPath { kSame, kDeltas, kCompared, kWhole };

struct ChunkResult {
  Status status;
  ChunkPath path = ChunkPath::kSame;
  std::vector<uint32_t> positions;  // elements of the chunk whose bits differ, ascending
  ByteBuffer values;                // their new bytes, in the same order
  ByteBuffer bytes;                 // NEW's chunk (every path but kSame)
  uint64_t payloads = 0;
  uint64_t payload_bytes = 0;
};

// Empties a result for the next chunk, keeping its buffers' memory: each window of a patch
// reuses the results of the one before, so the chunks built into them do not fault in fresh
// pages (a tenth of `weightfs patch`'s CPU when each chunk had new buffers).
void Reuse(ChunkResult* r) {
  r->status = Status::Ok();
  r->path = ChunkPath::kSame;
  r->positions.clear();
  r->values.clear();
  r->bytes.clear();
  r->payloads = 0;
  r->payload_bytes = 0;
}

// A file's rows of one tensor: [first, first + count).
struct RowRange {
  size_t first = 0;
  size_t count = 0;
};

// One tensor of NEW's file and what becomes of it.
struct TensorPlan {
  const TensorInfo* info = nullptr;  // in NEW's header
  const TensorInfo* old = nullptr;   // same name in OLD's header, when its dtype and shape match
  RowRange rows;                     // NEW's rows
  uint64_t elements = 0;
  size_t elem = 1;
  bool dense = false;                // given whole (decided up front, or once sparse stops paying)
};

// The rows of each tensor of a safetensors file, checked against its header: they must tile
// each tensor's bytes in index order.
Expected<std::unordered_map<std::string, RowRange>> RowsByTensor(const ManifestFile& file,
                                                                 const SafetensorsHeader& header,
                                                                 const std::string& what) {
  std::unordered_map<std::string, RowRange> out;
  for (size_t i = 1; i < file.chunks.size();) {
    const std::string& name = file.chunks[i].key.tensor;
    size_t j = i;
    while (j < file.chunks.size() && file.chunks[j].key.tensor == name) ++j;
    if (!out.emplace(name, RowRange{i, j - i}).second) {
      return Status::Corruption(what + ": the chunks of tensor '" + name + "' are not contiguous");
    }
    i = j;
  }
  for (const TensorInfo& t : header.tensors) {
    auto it = out.find(t.name);
    const RowRange r = it == out.end() ? RowRange{} : it->second;
    uint64_t at = header.data_offset + t.begin;
    for (size_t k = 0; k < r.count; ++k) {
      const ManifestChunk& c = file.chunks[r.first + k];
      if (c.key.index != k || c.offset != at || c.length % DTypeSize(t.dtype) != 0) {
        return Status::Corruption(what + ": the chunks of tensor '" + t.name + "' do not match its header");
      }
      at += c.length;
    }
    if (at != header.data_offset + t.end) {
      return Status::Corruption(what + ": the chunks of tensor '" + t.name + "' do not cover it");
    }
  }
  return out;
}

// Appends the entries of one chunk's changed elements: each position (plus `first`, the
// chunk's first element in its tensor) as a little-endian index of idx_width (4 or 8) bytes to
// idx, and its elem bytes of `bytes` to val; sized once, written in place.
void AppendSparse(const std::vector<uint32_t>& positions, std::span<const uint8_t> bytes, uint64_t first,
                  size_t idx_width, size_t elem, ByteBuffer* idx, ByteBuffer* val) {
  const size_t k = positions.size();
  size_t at = idx->size();
  idx->resize(at + k * idx_width);
  uint8_t* out = idx->data() + at;
  for (uint32_t pos : positions) {
    const uint64_t v = first + pos;
    for (size_t b = 0; b < idx_width; ++b) out[b] = static_cast<uint8_t>(v >> (8 * b));
    out += idx_width;
  }
  at = val->size();
  val->resize(at + k * elem);
  uint8_t* v = val->data() + at;
  for (uint32_t pos : positions) {
    std::memcpy(v, bytes.data() + static_cast<size_t>(pos) * elem, elem);
    v += elem;
  }
}

std::string JsonList(const std::vector<std::string>& names) { return nlohmann::json(names).dump(); }

// The patch of one file of NEW against OLD, as WeightPatcher::Write builds it: Plan reads both
// files' rows and headers and decides what becomes of each tensor; Emit computes NEW's rows a
// window at a time on the pool (Compute: the same as OLD's, OLD's bytes with the deltas after
// them, a comparison, or whole) and streams the sparse tensors into a spill file, then the
// header and the data into the sink. Members are named as the steps call them.
struct FilePatch {
  FilePatch(Materializer& m, ThreadPool& p, const PatchOptions& o, const std::vector<std::shared_ptr<const Manifest>>& c,
            const std::string& file, PatchStats& st)
      : materializer(m), pool(p), options(o), chain(c), path(file), stats(st), bucket(*m.bucket()),
        to_m(c.front()), from_m(c.back()), to(*to_m), from(*from_m),
        new_name(to.model + "@" + to.version + " " + path), old_name(from.model + "@" + from.version + " " + path),
        codecs(p.size()) {
    limits.verify_parent = false;  // the final bytes are checked against NEW's Hash128
    limits.verify_output = false;
  }

  Status Plan();
  Status Emit(const PatchSink& sink);

  Expected<std::optional<SafetensorsHeader>> ReadHeader(const Manifest& m, const ManifestFile& rows);
  // Walks a chunk's chain of deltas back from NEW's row to a row with OLD's bytes. The links
  // to apply, newest first; nullopt when the chain does not reach OLD's bytes through deltas.
  Expected<std::optional<std::vector<ChainLink>>> Walk(const ManifestChunk& start, size_t row_index,
                                                       const Hash128& old_hash);
  // Positions and new values of OLD's chunk `old` turned into NEW's by the chain `steps`
  // (newest first). False when a step does not fit (its length is not the chunk's): the caller
  // compares instead.
  // NEW's bytes go into out->bytes (its memory reused).
  Expected<bool> FromDeltas(size_t r, const std::vector<ChainLink>& steps, std::span<const uint8_t> old, size_t elem,
                            ChunkCodec& codec, ChunkResult* out);
  // Everything about one tensor row of NEW's file. Runs on the pool.
  Status Compute(size_t r, size_t slot, ChunkResult* out);
  Status AddEntry(std::string name, DType dtype, std::vector<uint64_t> shape);
  // The tensor being consumed is done: its entries (sparse or dense) join the output.
  Status Finish(TensorPlan& p);
  // NEW's bytes of row r: the result's, or materialized now (a row that was the same as OLD's).
  Status WriteWhole(size_t r, const ChunkResult* result);
  // Tensors without rows (no elements) before `plan` are finished in their place.
  Status FinishEmptyBefore(size_t plan);

  Materializer& materializer;
  ThreadPool& pool;
  const PatchOptions& options;
  const std::vector<std::shared_ptr<const Manifest>>& chain;  // NEW, ..., OLD
  const std::string& path;
  PatchStats& stats;
  Bucket& bucket;
  const std::shared_ptr<const Manifest>& to_m;
  const std::shared_ptr<const Manifest>& from_m;
  const Manifest& to;
  const Manifest& from;
  const std::string new_name, old_name;
  std::vector<std::unique_ptr<ChunkCodec>> codecs;  // one per pool slot
  DecodeLimits limits;

  // Plan's.
  std::shared_ptr<const ManifestFile> new_rows, old_rows;
  std::optional<SafetensorsHeader> new_header, old_header;
  std::unordered_map<std::string, RowRange> new_by_tensor, old_by_tensor;
  std::unordered_map<std::string, const TensorInfo*> old_tensors;
  std::vector<TensorPlan> plans;
  std::vector<uint32_t> plan_of_row;  // the plan of each of NEW's rows (UINT32_MAX: the header)
  std::vector<std::string> removed;   // OLD's tensors NEW does not have

  // Emit's.
  SpillFile spill;
  std::vector<TensorInfo> entries;  // the output's tensors, in spill order
  std::set<std::string> emitted;
  std::vector<std::string> dense_names;
  ByteBuffer idx, val;  // the tensor being consumed: its sparse output so far
  uint64_t count = 0;
  size_t next_plan = 0;  // plans before it are finished
};

Expected<std::optional<SafetensorsHeader>> FilePatch::ReadHeader(const Manifest& m, const ManifestFile& rows) {
  if (rows.chunks.empty() || rows.chunks[0].key.tensor != kHeaderChunkName) return std::optional<SafetensorsHeader>();
  WFS_ASSIGN_OR_RETURN(ByteBuffer bytes, materializer.Chunk(m, rows, 0));
  Expected<SafetensorsHeader> h = ParseSafetensorsHeader(bytes, rows.size);
  if (!h.ok()) return h.status().WithContext(m.model + "@" + m.version + " " + rows.path);
  return std::optional<SafetensorsHeader>(std::move(h).value());
}

Status FilePatch::Plan() {
  if (!to.FindFile(path)) return Status::NotFound(to.model + "@" + to.version + " has no file " + path);
  // The rows of the file in every version its chains may pass through, fetched together.
  if (!to.derived) {
    bucket.PrefetchManifests(to.model, to.versions);
    bucket.PrefetchFiles(to.model, std::span<const std::string>(to.versions).subspan(1), path);
  }
  WFS_ASSIGN_OR_RETURN(new_rows, bucket.File(to_m, path));
  if (from.FindFile(path)) {
    WFS_ASSIGN_OR_RETURN(old_rows, bucket.File(from_m, path));
  }

  // Headers.
  WFS_ASSIGN_OR_RETURN(new_header, ReadHeader(to, *new_rows));
  if (!new_header) {
    return Status::InvalidArgument(new_name + " is not a safetensors file; a weight patch is made of tensors");
  }
  if (old_rows) {
    WFS_ASSIGN_OR_RETURN(old_header, ReadHeader(from, *old_rows));  // not safetensors: no tensors
  }
  WFS_ASSIGN_OR_RETURN(new_by_tensor, RowsByTensor(*new_rows, *new_header, new_name));
  if (old_header) {
    WFS_ASSIGN_OR_RETURN(old_by_tensor, RowsByTensor(*old_rows, *old_header, old_name));
    for (const TensorInfo& t : old_header->tensors) old_tensors[t.name] = &t;
  }

  // What becomes of each tensor, and which tensor each row belongs to.
  plan_of_row.assign(new_rows->chunks.size(), UINT32_MAX);
  std::unordered_set<std::string> new_names;
  for (const TensorInfo& t : new_header->tensors) {
    TensorPlan p;
    p.info = &t;
    p.elem = DTypeSize(t.dtype);
    p.elements = t.size() / p.elem;
    if (auto it = new_by_tensor.find(t.name); it != new_by_tensor.end()) p.rows = it->second;
    auto old = old_tensors.find(t.name);
    if (old != old_tensors.end() && old->second->dtype == t.dtype && old->second->shape == t.shape) {
      p.old = old->second;
    }
    p.dense = p.old == nullptr;
    for (size_t k = 0; k < p.rows.count; ++k) plan_of_row[p.rows.first + k] = static_cast<uint32_t>(plans.size());
    new_names.insert(t.name);
    plans.push_back(p);
  }
  if (old_header) {
    for (const TensorInfo& t : old_header->tensors) {
      if (!new_names.count(t.name)) removed.push_back(t.name);
    }
    std::sort(removed.begin(), removed.end());
  }

  // Stored bytes of the steps from OLD to NEW, for the caller's comparison.
  for (size_t v = 0; v + 1 < chain.size(); ++v) {
    if (!chain[v]->FindFile(path)) continue;
    WFS_ASSIGN_OR_RETURN(std::shared_ptr<const ManifestFile> rows, bucket.File(chain[v], path));
    for (const ManifestChunk& c : rows->chunks) {
      if (c.origin == 0 && !c.is_external()) stats.stored_delta_bytes += c.ref.length;
    }
  }
  return Status::Ok();
}

Expected<std::optional<std::vector<ChainLink>>> FilePatch::Walk(const ManifestChunk& start, size_t row_index,
                                                                const Hash128& old_hash) {
  std::vector<ChainLink> steps;
  ChainLink cur{to_m, &to, new_rows, new_rows.get(), &start};
  while (cur.chunk->hash != old_hash) {
    if (!cur.chunk->is_delta()) return std::optional<std::vector<ChainLink>>();
    steps.push_back(cur);
    Expected<ChainLink> base = bucket.DeltaBase(cur);
    if (!base.ok()) return base.status().WithContext(DescribeChunkOf(to, *new_rows, row_index));
    cur = std::move(base).value();
  }
  return std::optional<std::vector<ChainLink>>(std::move(steps));
}

Expected<bool> FilePatch::FromDeltas(size_t r, const std::vector<ChainLink>& steps, std::span<const uint8_t> old,
                                     size_t elem, ChunkCodec& codec, ChunkResult* out) {
  const ManifestChunk& row = new_rows->chunks[r];
  ByteBuffer& work = out->bytes;
  work.assign(old.begin(), old.end());
  ByteBuffer payload, decoded;
  std::vector<uint32_t>& all = out->positions;
  std::vector<uint32_t> step;
  all.clear();
  for (size_t i = steps.size(); i-- > 0;) {
    const ChainLink& s = steps[i];
    auto where = [&](const Status& st) { return st.WithContext(s.Describe()); };
    WFS_TRY(where(bucket.ReadPayload(*s.manifest, *s.chunk, &payload)));
    out->payloads++;
    out->payload_bytes += payload.size();
    Expected<PayloadInfo> info = ChunkCodec::Inspect(payload, limits);
    if (!info.ok()) return where(info.status());
    if (info->raw_len != work.size() || info->parent_len != work.size()) return false;
    if (info->decodes_in_place() && DTypeSize(info->dtype) == elem) {
      WFS_TRY(where(codec.ApplyInPlace(payload, work, &step, limits)));
    } else {
      decoded.resize(work.size());
      WFS_TRY(where(codec.Decode(payload, work, decoded, limits)));
      DiffElements(work, decoded, elem, &step);
      work.swap(decoded);
    }
    const size_t mid = all.size();
    all.insert(all.end(), step.begin(), step.end());
    std::inplace_merge(all.begin(), all.begin() + static_cast<ptrdiff_t>(mid), all.end());
    all.erase(std::unique(all.begin(), all.end()), all.end());
  }
  if (HashChunk(work) != row.hash) {
    return Status::Corruption("OLD's chunk with the deltas after it does not match NEW's chunk hash")
        .WithContext(DescribeChunkOf(to, *new_rows, r));
  }
  // Only the elements that differ from OLD's: a chain may change an element and change it back.
  size_t kept = 0;
  for (uint32_t p : all) {
    if (static_cast<uint64_t>(p) * elem + elem > work.size()) {
      return Status::Corruption("a delta names an element outside its chunk").WithContext(DescribeChunkOf(to, *new_rows, r));
    }
    if (!SameElement(work.data() + p * elem, old.data() + p * elem, elem)) all[kept++] = p;
  }
  all.resize(kept);
  if (options.cache) options.cache->PutCopyBehind(row.hash, work);
  return true;
}

Status FilePatch::Compute(size_t r, size_t slot, ChunkResult* out) {
  const TensorPlan& p = plans[plan_of_row[r]];
  const ManifestChunk& row = new_rows->chunks[r];
  if (p.dense) {
    WFS_ASSIGN_OR_RETURN(out->bytes, materializer.Chunk(to, *new_rows, r));
    out->path = ChunkPath::kWhole;
    return Status::Ok();
  }
  // OLD's chunk of the same key, when it covers the same elements of the tensor.
  const uint64_t in_tensor = row.offset - (new_header->data_offset + p.info->begin);
  const ManifestChunk* old_row = nullptr;
  size_t old_index = 0;
  if (auto it = old_by_tensor.find(p.info->name); it != old_by_tensor.end() && row.key.index < it->second.count) {
    old_index = it->second.first + row.key.index;
    const ManifestChunk& c = old_rows->chunks[old_index];
    if (c.length == row.length && c.offset - (old_header->data_offset + p.old->begin) == in_tensor) old_row = &c;
  }
  if (old_row && old_row->hash == row.hash) {
    out->path = ChunkPath::kSame;
    return Status::Ok();
  }
  ByteBuffer old_copy;
  ChunkBytes old_shared;  // (the materializer's pooled buffer: no fresh memory per chunk)
  std::span<const uint8_t> old;
  if (old_row) {
    std::optional<std::vector<ChainLink>> steps;
    if (!to.derived) {
      WFS_ASSIGN_OR_RETURN(steps, Walk(row, r, old_row->hash));
    }
    WFS_ASSIGN_OR_RETURN(old_shared, materializer.Shared(from, *old_rows, old_index));
    old = old_shared.span();
    if (steps) {
      if (!codecs[slot]) codecs[slot] = std::make_unique<ChunkCodec>();
      WFS_ASSIGN_OR_RETURN(bool done, FromDeltas(r, *steps, old, p.elem, *codecs[slot], out));
      if (done) {
        out->path = ChunkPath::kDeltas;
        return Status::Ok();
      }
    }
  } else {
    // Chunked differently in OLD: the same elements, read by range.
    old_copy.reserve(row.length);
    WFS_TRY(ReadRange(materializer, from, *old_rows, old_header->data_offset + p.old->begin + in_tensor, row.length,
                      [&](std::span<const uint8_t> b) {
                        old_copy.insert(old_copy.end(), b.begin(), b.end());
                        return Status::Ok();
                      }));
    if (old_copy.size() != row.length) return Status::Corruption(old_name + ": short read of tensor '" + p.info->name + "'");
    old = old_copy;
  }
  WFS_ASSIGN_OR_RETURN(out->bytes, materializer.Chunk(to, *new_rows, r));
  DiffElements(old, out->bytes, p.elem, &out->positions);
  out->path = ChunkPath::kCompared;
  return Status::Ok();
}

Status FilePatch::AddEntry(std::string name, DType dtype, std::vector<uint64_t> shape) {
  if (!emitted.insert(name).second) {
    return Status::InvalidArgument(new_name + ": two tensors would both be written as '" + name +
                                   "' (a tensor named like another's .idx or .val)");
  }
  TensorInfo t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.shape = std::move(shape);
  entries.push_back(std::move(t));
  return Status::Ok();
}

Status FilePatch::Finish(TensorPlan& p) {
  stats.tensors++;
  stats.elements += p.elements;
  if (p.dense) {
    stats.tensors_dense++;
    dense_names.push_back(p.info->name);
    return AddEntry(p.info->name, p.info->dtype, p.info->shape);
  }
  if (count == 0) {
    stats.tensors_unchanged++;
    return Status::Ok();
  }
  stats.tensors_sparse++;
  stats.elements_changed += count;
  WFS_TRY(spill.Append(idx));
  WFS_TRY(spill.Append(val));
  WFS_TRY(AddEntry(p.info->name + ".idx", PatchIndexDType(p.elements), {count}));
  WFS_TRY(AddEntry(p.info->name + ".val", p.info->dtype, {count}));
  idx.clear();
  val.clear();
  count = 0;
  return Status::Ok();
}

Status FilePatch::WriteWhole(size_t r, const ChunkResult* result) {
  if (result && result->path != ChunkPath::kSame) return spill.Append(result->bytes);
  WFS_ASSIGN_OR_RETURN(ByteBuffer bytes, materializer.Chunk(to, *new_rows, r));
  return spill.Append(bytes);
}

Status FilePatch::FinishEmptyBefore(size_t plan) {
  for (; next_plan < plan; ++next_plan) {
    if (plans[next_plan].rows.count == 0) WFS_TRY(Finish(plans[next_plan]));
  }
  return Status::Ok();
}

Status FilePatch::Emit(const PatchSink& sink) {
  WFS_TRY(spill.Open(options.spill_dir));
  // Tensor rows in file order, a window at a time; tensors without rows (no elements) are
  // finished in their place.
  std::vector<size_t> work;
  for (size_t r = 0; r < new_rows->chunks.size(); ++r) {
    if (plan_of_row[r] != UINT32_MAX) work.push_back(r);
  }
  const size_t window = std::max<size_t>(2, pool.size() * 2);
  std::vector<ChunkResult> results(window);
  for (size_t start = 0; start < work.size(); start += window) {
    const size_t n = std::min(window, work.size() - start);
    pool.ParallelFor(n, [&](size_t i, size_t slot) {
      Reuse(&results[i]);
      try {
        results[i].status = Compute(work[start + i], slot, &results[i]);
      } catch (...) {
        results[i].status = StatusOfCurrentException("computing a patch chunk");
      }
    });
    for (size_t i = 0; i < n; ++i) {
      ChunkResult& res = results[i];
      const size_t r = work[start + i];
      if (!res.status.ok()) return res.status;
      TensorPlan& p = plans[plan_of_row[r]];
      WFS_TRY(FinishEmptyBefore(plan_of_row[r]));
      stats.delta_payloads += res.payloads;
      stats.delta_payload_bytes += res.payload_bytes;
      switch (res.path) {
        case ChunkPath::kSame: stats.chunks_same++; break;
        case ChunkPath::kDeltas: stats.chunks_from_deltas++; break;
        case ChunkPath::kCompared: stats.chunks_compared++; break;
        case ChunkPath::kWhole: stats.chunks_whole++; break;
      }
      if (p.dense) {
        WFS_TRY(WriteWhole(r, &res));
      } else {
        const ManifestChunk& row = new_rows->chunks[r];
        const uint64_t first_elem = (row.offset - (new_header->data_offset + p.info->begin)) / p.elem;
        const size_t idx_width = DTypeSize(PatchIndexDType(p.elements));
        AppendSparse(res.positions, res.bytes, first_elem, idx_width, p.elem, &idx, &val);
        count += res.positions.size();
        if (count * (idx_width + p.elem) >= p.elements * p.elem) {
          // Sparse no longer pays: the whole tensor instead. Its rows before this one are
          // materialized again (from the cache when it holds them); later windows compute
          // whole chunks directly.
          p.dense = true;
          idx.clear();
          val.clear();
          count = 0;
          for (size_t before = p.rows.first; before < r; ++before) WFS_TRY(WriteWhole(before, nullptr));
          WFS_TRY(WriteWhole(r, &res));
        }
      }
      Reuse(&res);  // (its memory is the next window's)
      if (r + 1 == p.rows.first + p.rows.count) {
        WFS_TRY(Finish(p));
        next_plan = plan_of_row[r] + 1;
      }
    }
  }
  WFS_TRY(FinishEmptyBefore(plans.size()));

  std::map<std::string, std::string> metadata{
      {"sparse_weight_patch", kPatchFormatVersion},
      {"format", "sparse_weight_patch"},
      {"encoding", "raw"},
      {"model", to.model},
      {"from", from.version},
      {"to", to.version},
      {"file", path},
      {"removed", JsonList(removed)},
      {"dense", JsonList(dense_names)},
      {"changed_elements", std::to_string(stats.elements_changed)},
      {"total_elements", std::to_string(stats.elements)},
  };
  stats.tensors_removed = removed.size();
  std::vector<uint8_t> header = BuildSafetensorsHeader(entries, metadata);
  if (!entries.empty() && entries.back().end != spill.size()) {
    return Status::Corruption("patch data is " + std::to_string(spill.size()) + " bytes, its header says " +
                            std::to_string(entries.back().end));
  }
  WFS_TRY(sink(header));
  WFS_TRY(spill.CopyTo(sink));
  stats.patch_bytes = header.size() + spill.size();
  return Status::Ok();
}

}  // namespace

DType PatchIndexDType(uint64_t elements) {
  return elements > (uint64_t{1} << 31) ? DType::kI64 : DType::kI32;
}

Expected<std::unique_ptr<WeightPatcher>> WeightPatcher::Open(Materializer* materializer, ThreadPool* pool,
                                                            const std::string& model,
                                                            const std::string& from_version,
                                                            const std::string& to_version,
                                                            PatchOptions options) {
  Bucket& bucket = *materializer->bucket();
  WFS_ASSIGN_OR_RETURN(std::shared_ptr<const Manifest> to, bucket.ReadManifest(model, to_version));
  WFS_ASSIGN_OR_RETURN(std::shared_ptr<const Manifest> from, bucket.ReadManifest(model, from_version));
  std::vector<std::shared_ptr<const Manifest>> chain{to};
  std::set<std::string> seen{to->version};
  while (chain.back()->version != from->version) {
    const Manifest& m = *chain.back();
    if (!m.parent) {
      std::string path;
      for (size_t i = chain.size(); i-- > 0;) path += (path.empty() ? "" : " -> ") + chain[i]->version;
      return Status::InvalidArgument(model + "@" + from_version + " is not an ancestor of " + model + "@" +
                                     to_version + " (its ancestry: " + path +
                                     "); a patch goes from an older version of the same line");
    }
    if (!seen.insert(*m.parent).second) {
      return Status::Corruption(model + "@" + m.version + ": its ancestry loops back to " + *m.parent);
    }
    Expected<std::shared_ptr<const Manifest>> parent = bucket.ReadManifest(model, *m.parent);
    if (!parent.ok()) {
      return parent.status().WithContext("reading " + model + "@" + *m.parent + ", an ancestor of " + model +
                                         "@" + to_version);
    }
    chain.push_back(std::move(parent).value());
  }
  return std::unique_ptr<WeightPatcher>(new WeightPatcher(materializer, pool, std::move(options), std::move(chain)));
}

std::vector<std::string> WeightPatcher::WeightFiles() const {
  std::vector<std::string> out;
  for (const ManifestFile& f : to().files) {
    if (f.path.ends_with(".safetensors")) out.push_back(f.path);
  }
  return out;
}

Status WeightPatcher::Write(const std::string& path, const PatchSink& sink, PatchStats* stats) {
  *stats = PatchStats{};
  FilePatch patch(*materializer_, *pool_, options_, chain_, path, *stats);
  WFS_TRY(patch.Plan());
  return patch.Emit(sink);
}

}  // namespace weightfs

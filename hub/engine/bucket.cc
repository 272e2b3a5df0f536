#include "hub/engine/bucket.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <functional>
#include <map>
#include <set>
#include <system_error>
#include <thread>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "core/chunk_table.h"
#include "core/file_codec.h"
#include "core/manifest_checks.h"
#include "hub/store/http_client.h"

namespace weightfs {

Expected<std::vector<ObjectInfo>> ListAll(Store& store, std::string_view prefix) {
  std::vector<ObjectInfo> all;
  std::string continuation;
  while (true) {
    WFS_ASSIGN_OR_RETURN(ListPage page, store.List(prefix, continuation));
    for (ObjectInfo& o : page.objects) all.push_back(std::move(o));
    if (page.continuation.empty()) break;
    if (page.continuation == continuation) return Status::IOError("listing does not advance");
    continuation = std::move(page.continuation);
  }
  return all;
}

namespace {

// What a manifest (or a head) and a file's rows take in memory, roughly: for the caches' budget.
uint64_t MemoryOf(const ManifestFile& f) {
  return sizeof(ManifestFile) + f.path.size() + f.sha256.size() + ChunkRowsMemory(f.chunks);
}

uint64_t MemoryOf(const Manifest& m) {
  uint64_t n = sizeof(Manifest) + m.model.size() + m.created.size() + m.packs.size() * sizeof(Hash128);
  for (const std::string& v : m.versions) n += sizeof(std::string) + v.size();
  for (const std::string& v : m.sources) n += sizeof(std::string) + v.size();
  for (const ManifestFile& f : m.files) n += MemoryOf(f);
  return n;
}

// Manifests and sections of many versions are read 8 at a time.
constexpr size_t kParallelReads = 8;
void Parallel(size_t n, const std::function<void(size_t)>& fn) { RequestsInParallel(n, kParallelReads, fn); }

}  // namespace

Status Bucket::Init(Store& store, int format) {
  std::string marker = nlohmann::json{{"format", format}}.dump() + "\n";
  Status s = store.Put(kMarkerKey, {reinterpret_cast<const uint8_t*>(marker.data()), marker.size()},
                       PutMode::kCreateIfAbsent);
  if (s.kind() != ErrorKind::kConflict) return s;
  // Already a bucket: fine if it is ours.
  std::shared_ptr<Store> unowned(&store, [](Store*) {});
  return Open(unowned).status();
}

Expected<std::unique_ptr<Bucket>> Bucket::Open(std::shared_ptr<Store> store) {
  Expected<std::vector<uint8_t>> marker = store->Get(kMarkerKey);
  if (!marker.ok()) {
    if (marker.status().kind() == ErrorKind::kNotFound) {
      return Status::NotFound("bucket " + store->Describe() +
                              " has no weightfs.json; run `weightfs init " + store->Describe() + "`");
    }
    return marker.status().WithContext("opening bucket " + store->Describe());
  }
  nlohmann::json j = nlohmann::json::parse(marker->begin(), marker->end(), nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("format") ||
      !j["format"].is_number_integer()) {
    return Status::Corruption("bucket " + store->Describe() + ": weightfs.json is not valid");
  }
  const int64_t format = j["format"].get<int64_t>();
  if (format != kManifestFormat && format != kManifestFormat2) {
    return Status::Unsupported("bucket " + store->Describe() + " has format " +
                               j["format"].dump() + "; this weightfs reads formats 1 and 2 (upgrade weightfs)");
  }
  return std::unique_ptr<Bucket>(new Bucket(std::move(store), static_cast<int>(format)));
}

std::unique_ptr<Bucket> Bucket::FromDerived(std::shared_ptr<Store> store,
                                           std::shared_ptr<DerivedVersions> derived) {
  std::unique_ptr<Bucket> b(new Bucket(std::move(store)));
  b->derived_ = std::move(derived);
  return b;
}

std::string Bucket::ManifestKey(std::string_view model, std::string_view version) {
  return "models/" + std::string(model) + "/versions/" + std::string(version) + ".json";
}

std::string Bucket::TimeKey(std::string_view model, std::string_view version, int64_t created_ms) {
  char ms[32];
  std::snprintf(ms, sizeof ms, "%013lld", static_cast<long long>(std::max<int64_t>(created_ms, 0)));
  return "models/" + std::string(model) + "/times/" + ms + "-" + std::string(version);
}

std::string Bucket::FileKey(std::string_view model, std::string_view version, const Hash128& table,
                            std::string_view path) {
  std::string k = std::string(model) + "@" + std::string(version);
  k.push_back('\0');
  k.append(table.ToHex());
  k.push_back('\0');
  k.append(path);
  return k;
}

void Bucket::set_metadata_budget(uint64_t bytes) {
  manifests_.set_max_bytes(bytes / 2);
  files_.set_max_bytes(bytes / 2 - bytes / 16);
  indexes_.set_max_bytes(bytes / 16);
}

Expected<std::vector<VersionInfo>> Bucket::ListVersions(std::string_view model, bool with_sub_models) {
  if (derived_) {
    if (!with_sub_models || model.empty()) return derived_->ListVersions(model);
    WFS_ASSIGN_OR_RETURN(std::vector<VersionInfo> all, derived_->ListVersions({}));
    std::erase_if(all, [&](const VersionInfo& v) { return !ModelUnder(v.model, model); });
    return all;
  }
  std::string prefix = "models/";
  if (!model.empty()) {
    WFS_TRY(ValidateModelName(model));
    prefix += std::string(model) + "/";
  }
  WFS_ASSIGN_OR_RETURN(std::vector<ObjectInfo> objects, ListAll(*store_, prefix));
  std::vector<VersionInfo> out;
  std::map<std::pair<std::string_view, std::string_view>, int64_t> times;
  for (const ObjectInfo& o : objects) {
    // models/<model>/versions/<version>.json, models/<model>/times/<13 digits>-<version>;
    // anything else under models/ is ignored.
    std::string_view key = o.key;
    if (size_t t = key.rfind("/times/"); t != std::string_view::npos && t >= 7) {
      std::string_view rest = key.substr(t + 7);
      std::string_view m = key.substr(7, t - 7);
      if (rest.size() >= 15 && rest[13] == '-' &&
          std::all_of(rest.begin(), rest.begin() + 13, [](char c) { return c >= '0' && c <= '9'; })) {
        int64_t ms = 0;
        for (size_t i = 0; i < 13; ++i) ms = ms * 10 + (rest[i] - '0');
        times[{m, rest.substr(14)}] = ms;
        continue;
      }
    }
    constexpr std::string_view kMid = "/versions/";
    size_t mid = key.rfind(kMid);
    if (mid == std::string_view::npos || mid < 7 || !key.ends_with(".json")) continue;
    std::string_view m = key.substr(7, mid - 7);
    std::string_view v = key.substr(mid + kMid.size(), key.size() - mid - kMid.size() - 5);
    if (!ValidateModelName(m).ok() || !ValidateVersionName(v).ok()) continue;
    if (!model.empty() && m != model && !with_sub_models) continue;  // a sub-organisation's models, not this one
    out.push_back({std::string(m), std::string(v), std::nullopt});
  }
  for (VersionInfo& v : out) {
    if (auto it = times.find({v.model, v.version}); it != times.end()) v.created_ms = it->second;
  }
  std::sort(out.begin(), out.end(), [](const VersionInfo& a, const VersionInfo& b) {
    return std::tie(a.model, a.version) < std::tie(b.model, b.version);
  });
  return out;
}

Expected<std::shared_ptr<const Manifest>> Bucket::ReadManifest(std::string_view model,
                                                               std::string_view version) {
  WFS_TRY(ValidateModelName(model));
  WFS_TRY(ValidateVersionName(version));
  if (derived_) return derived_->ReadManifest(model, version);
  const std::string key = ManifestKey(model, version);
  if (std::shared_ptr<const Manifest> cached = manifests_.Get(key)) return cached;
  WFS_ASSIGN_OR_RETURN(std::shared_ptr<const Manifest> read, ReadStoredManifest(model, version));
  return manifests_.Put(key, read, MemoryOf(*read));
}

Expected<std::shared_ptr<const Manifest>> Bucket::ReadStoredManifest(std::string_view model,
                                                                     std::string_view version, bool uncached) {
  const std::string key = ManifestKey(model, version);
  // A stored manifest is its JSON or a zstd frame of it (at worst slightly larger): an object
  // beyond that is refused without being read whole.
  const uint64_t max_json = std::min<uint64_t>(max_manifest_json_bytes_, 1ull << 50);
  const uint64_t max_object = max_json + (max_json >> 7) + (1 << 20);
  Expected<std::vector<uint8_t>> bytes = uncached ? store_->GetUncached(key, ByteRange{0, max_object + 1})
                                                  : store_->Get(key, ByteRange{0, max_object + 1});
  if (!bytes.ok()) {
    if (bytes.status().kind() == ErrorKind::kNotFound) {
      return Status::NotFound("version " + std::string(model) + "@" + std::string(version) +
                              " does not exist in " + store_->Describe());
    }
    return bytes.status();
  }
  if (bytes->size() > max_object) {
    return Status::ResourceExhausted("manifest " + std::string(model) + "@" + std::string(version) + ": " +
                                     store_->Describe() + "/" + key + " holds more than " +
                                     std::to_string(max_object) + " bytes, more than a manifest of at most " +
                                     std::to_string(max_manifest_json_bytes_) + " bytes of JSON can");
  }
  Expected<Manifest> parsed = ParseManifest(*bytes, model, version, max_manifest_json_bytes_);
  if (!parsed.ok()) return parsed.status().WithContext(store_->Describe() + "/" + key);
  return std::make_shared<const Manifest>(std::move(parsed).value());
}

Expected<std::shared_ptr<const Manifest>> Bucket::ReadCurrentManifest(std::string_view model,
                                                                      std::string_view version) {
  const std::string one[] = {std::string(version)};
  WFS_TRY(Revalidate(model, one, std::chrono::steady_clock::now()).status());
  return ReadManifest(model, version);
}

bool Bucket::SameHead(const Manifest& a, const Manifest& b) {
  if (a.format != b.format || a.model != b.model || a.version != b.version) return false;
  if (a.format == kManifestFormat2) return a.table == b.table && a.table_size == b.table_size;
  return a.packs == b.packs && SerializeManifest(a) == SerializeManifest(b);  // (format 1: rare, small buckets)
}

Expected<size_t> Bucket::Revalidate(std::string_view model, std::span<const std::string> versions,
                                    std::chrono::steady_clock::time_point failed_at) {
  if (derived_) return size_t{0};
  WFS_TRY(ValidateModelName(model));
  std::lock_guard<std::mutex> lock(revalidate_mu_);
  if (auto it = revalidated_.find(model); it != revalidated_.end() && it->second.started >= failed_at) {
    return it->second.changed;
  }
  Revalidation& record = revalidated_[std::string(model)];
  record = {std::chrono::steady_clock::now(), 0};
  std::vector<std::pair<std::string_view, std::shared_ptr<const Manifest>>> held;
  std::set<std::string_view> seen;
  for (const std::string& v : versions) {
    if (!seen.insert(v).second) continue;
    if (std::shared_ptr<const Manifest> m = manifests_.Get(ManifestKey(model, v))) held.emplace_back(v, std::move(m));
  }
  std::vector<Expected<std::shared_ptr<const Manifest>>> read(held.size(), Status::IOError("not read"));
  Parallel(held.size(), [&](size_t i) { read[i] = ReadStoredManifest(model, held[i].first, /*uncached=*/true); });
  size_t changed = 0;
  for (size_t i = 0; i < held.size(); ++i) {
    const std::string_view v = held[i].first;
    if (read[i].ok() && SameHead(**read[i], *held[i].second)) continue;
    if (!read[i].ok() && read[i].status().kind() != ErrorKind::kNotFound) return read[i].status();
    ++changed;
    Forget(model, v);
    head_generation_++;
    if (read[i].ok()) {
      spdlog::info("{}@{} was rewritten in {} since this process read it (gc's rebase?): its new head replaces it",
                   model, v, store_->Describe());
      (void)manifests_.Put(ManifestKey(model, v), *read[i], MemoryOf(**read[i]));
    } else {
      spdlog::info("{}@{} is gone from {} (retired by gc?)", model, v, store_->Describe());
    }
  }
  record.changed = changed;
  return changed;
}

Expected<std::shared_ptr<const ManifestFile>> Bucket::File(const std::shared_ptr<const Manifest>& manifest,
                                                           const ManifestFile& file) {
  if (file.AllRows()) return std::shared_ptr<const ManifestFile>(manifest, &file);
  return File(*manifest, file);
}

Expected<ByteBuffer> Bucket::ReadSection(const Manifest& manifest, const ManifestFile& file, uint64_t from,
                                         uint64_t to, const std::string& what) {
  ByteBuffer bytes;
  const std::string table_key = TableKey(manifest.table);
  Status got = store_->GetInto(table_key, ByteRange{file.section.offset + from, to - from}, &bytes);
  if (!got.ok()) {
    if (got.kind() == ErrorKind::kNotFound || got.kind() == ErrorKind::kInvalidArgument) {
      return Status::Corruption(what + ": " + table_key + " is missing or shorter than its head says (" +
                                got.message() + ")");
    }
    return got.WithContext(what);
  }
  if (bytes.size() != to - from) return Status::Corruption(what + ": " + table_key + " is truncated");
  return bytes;
}

ManifestFile Bucket::RowsHolder(const ManifestFile& head) const {
  ManifestFile f;
  f.path = head.path;
  f.size = head.size;
  f.sha256 = head.sha256;
  f.section = head.section;
  f.rows_loaded = true;
  return f;
}

Expected<std::shared_ptr<const ManifestFile>> Bucket::File(const Manifest& m, const ManifestFile& file) {
  if (file.AllRows()) return std::shared_ptr<const ManifestFile>(std::shared_ptr<const void>(), &file);
  const Manifest* manifest = &m;
  const std::string key = FileKey(manifest->model, manifest->version, manifest->table, file.path);
  if (std::shared_ptr<const ManifestFile> cached = files_.Get(key)) return cached;
  const std::string where = "the chunk table of " + manifest->model + "@" + manifest->version + "/" + file.path;
  if (file.section.index_length != 0) {
    // Every block, one at a time (a tool that processes the whole file); not cached whole.
    WFS_ASSIGN_OR_RETURN(std::shared_ptr<const TableBlockIndex> index, BlockIndex(m, file));
    auto all = std::make_shared<ManifestFile>(RowsHolder(file));
    all->chunks.reserve(file.section.rows);
    for (size_t k = 0; k < index->blocks(); ++k) {
      WFS_ASSIGN_OR_RETURN(std::shared_ptr<const ManifestFile> block, Block(m, file, *index, k));
      all->chunks.insert(all->chunks.end(), block->chunks.begin(), block->chunks.end());
    }
    if (std::optional<size_t> dup = manifest_checks::FirstRepeatedKey(all->chunks)) {
      return Status::Corruption(where + ": row " + std::to_string(*dup) + " repeats the key of an earlier row");
    }
    return std::shared_ptr<const ManifestFile>(std::move(all));
  }
  if (file.section.ShouldBeBlocks() && !warned_one_piece_.exchange(true)) {
    // Written before blocks: every reader of one chunk decodes the whole file's rows.
    spdlog::warn("{}: {} rows in one table section (written by a weightfs from before table blocks): each read "
                 "decodes all of them; `weightfs upgrade {}` rewrites such tables in blocks (said once)",
                 where, file.section.rows, store_->Describe());
  }
  WFS_ASSIGN_OR_RETURN(ByteBuffer section, ReadSection(m, file, 0, file.section.length, where));
  const ChunkTableLimits limits{manifest->versions.size(), manifest->packs.size(), manifest->sources.size()};
  Expected<std::vector<ManifestChunk>> rows =
      DecodeChunkTable(std::span<const uint8_t>(section.data(), section.size()), file, limits,
                       std::max<uint64_t>(files_.max_bytes(), 64ull << 20));
  if (!rows.ok()) return rows.status().WithContext(manifest->model + "@" + manifest->version);
  auto resolved = std::make_shared<ManifestFile>(RowsHolder(file));
  resolved->chunks = std::move(rows).value();
  return files_.Put(key, resolved, MemoryOf(*resolved));
}

Expected<std::shared_ptr<const TableBlockIndex>> Bucket::BlockIndex(const Manifest& m, const ManifestFile& file,
                                                                     std::span<const uint8_t> section) {
  return indexes_.GetOrLoad(
      FileKey(m.model, m.version, m.table, file.path),
      [&]() -> Expected<std::shared_ptr<const TableBlockIndex>> {
        ByteBuffer read;
        std::span<const uint8_t> frame = section.first(std::min<uint64_t>(section.size(), file.section.index_length));
        if (section.empty()) {
          const std::string where = "the block index of " + m.model + "@" + m.version + "/" + file.path;
          WFS_ASSIGN_OR_RETURN(read, ReadSection(m, file, 0, file.section.index_length, where));
          frame = std::span<const uint8_t>(read.data(), read.size());
        }
        Expected<TableBlockIndex> index = DecodeTableIndex(frame, file);
        if (!index.ok()) return index.status().WithContext(m.model + "@" + m.version);
        return std::make_shared<const TableBlockIndex>(std::move(index).value());
      },
      [](const TableBlockIndex& index) { return index.Memory(); });
}

Expected<std::shared_ptr<const ManifestFile>> Bucket::Block(const Manifest& m, const ManifestFile& file,
                                                            const TableBlockIndex& index, size_t k,
                                                            std::span<const uint8_t> section) {
  return files_.GetOrLoad(
      BlockKey(FileKey(m.model, m.version, m.table, file.path), k),
      [&]() -> Expected<std::shared_ptr<const ManifestFile>> {
        ByteBuffer read;
        std::span<const uint8_t> frame;
        if (section.empty()) {
          const std::string where = "block " + std::to_string(k) + " of the chunk table of " + m.model + "@" +
                                    m.version + "/" + file.path;
          WFS_ASSIGN_OR_RETURN(read, ReadSection(m, file, index.starts[k], index.starts[k + 1], where));
          frame = std::span<const uint8_t>(read.data(), read.size());
        } else {
          frame = section.subspan(index.starts[k], index.starts[k + 1] - index.starts[k]);  // (DecodeTableIndex: in it)
        }
        const RowSpan span{k * index.block_rows, index.RowsOf(k, file.section.rows), index.offsets[k],
                           index.offsets[k + 1] - index.offsets[k]};
        const ChunkTableLimits limits{m.versions.size(), m.packs.size(), m.sources.size()};
        Expected<std::vector<ManifestChunk>> rows = DecodeChunkRows(frame, file, span, limits);
        if (!rows.ok()) return rows.status().WithContext(m.model + "@" + m.version);
        auto block = std::make_shared<ManifestFile>(RowsHolder(file));
        block->chunks = std::move(rows).value();
        block->first_row = span.first_row;
        return std::shared_ptr<const ManifestFile>(std::move(block));
      },
      [](const ManifestFile& f) { return MemoryOf(f); });
}

Expected<std::shared_ptr<const ManifestFile>> Bucket::BlockWhere(const Manifest& m, const ManifestFile& file,
                                                                 const std::function<size_t(const TableBlockIndex&)>& pick) {
  // A small section whose index is not known yet is read whole, in one request (its index and
  // the block wanted from the same bytes) rather than two: below this size a round trip costs
  // more than the bytes.
  ByteBuffer whole;
  if (file.section.length <= kWholeSectionBytes && !indexes_.Contains(FileKey(m.model, m.version, m.table, file.path))) {
    const std::string where = "the chunk table of " + m.model + "@" + m.version + "/" + file.path;
    WFS_ASSIGN_OR_RETURN(whole, ReadSection(m, file, 0, file.section.length, where));
  }
  const std::span<const uint8_t> section(whole.data(), whole.size());
  WFS_ASSIGN_OR_RETURN(std::shared_ptr<const TableBlockIndex> index, BlockIndex(m, file, section));
  return Block(m, file, *index, pick(*index), section);
}

Expected<std::shared_ptr<const ManifestFile>> Bucket::RowsAt(const Manifest& m, const ManifestFile& file,
                                                             uint64_t offset) {
  if (file.section.index_length == 0 || m.format != kManifestFormat2) return File(m, file);
  return BlockWhere(m, file, [offset](const TableBlockIndex& index) { return index.BlockAt(offset); });
}

Expected<std::shared_ptr<const ManifestFile>> Bucket::RowsOfRow(const Manifest& m, const ManifestFile& file,
                                                                uint64_t row) {
  if (file.section.index_length == 0 || m.format != kManifestFormat2) return File(m, file);
  return BlockWhere(m, file, [row](const TableBlockIndex& index) {
    return std::min(index.BlockOfRow(row), index.blocks() - 1);
  });
}

std::string Bucket::KnownRowsKey(const Manifest& m, const ManifestFile& file, uint64_t row) {
  std::string key = FileKey(m.model, m.version, m.table, file.path);
  if (file.section.index_length == 0) return key;
  std::shared_ptr<const TableBlockIndex> index = indexes_.Get(key);
  if (!index) return {};
  return BlockKey(key, std::min(index->BlockOfRow(row), index->blocks() - 1));
}

Expected<std::shared_ptr<const ManifestFile>> Bucket::File(const std::shared_ptr<const Manifest>& manifest,
                                                           std::string_view path) {
  const ManifestFile* f = manifest->FindFile(path);
  if (!f) {
    return Status::NotFound(manifest->model + "@" + manifest->version + " has no file " + std::string(path));
  }
  return File(manifest, *f);
}

void Bucket::PrefetchFiles(std::string_view model, std::span<const std::string> versions, std::string_view path,
                           uint64_t row) {
  if (derived_) return;
  std::vector<std::string_view> missing;
  for (const std::string& v : versions) {
    std::shared_ptr<const Manifest> head = manifests_.Get(ManifestKey(model, v));
    const ManifestFile* f = head ? head->FindFile(path) : nullptr;
    if (!head || (f && !f->rows_loaded && !files_.Contains(KnownRowsKey(*head, *f, row)))) missing.push_back(v);
    if (missing.size() == kMaxPrefetch) break;
  }
  if (missing.size() < 2) return;
  Parallel(missing.size(), [&](size_t i) {
    Expected<std::shared_ptr<const Manifest>> m = ReadManifest(model, missing[i]);
    if (!m.ok()) return;
    if (const ManifestFile* f = (*m)->FindFile(path); f && f->section.rows > 0) (void)RowsOfRow(**m, *f, row);
  });
}

Expected<std::shared_ptr<const Manifest>> Bucket::ReadFullManifest(std::string_view model, std::string_view version) {
  WFS_ASSIGN_OR_RETURN(std::shared_ptr<const Manifest> head, ReadManifest(model, version));
  if (head->format != kManifestFormat2) return head;
  auto full = std::make_shared<Manifest>(*head);
  for (ManifestFile& f : full->files) {
    WFS_ASSIGN_OR_RETURN(std::shared_ptr<const ManifestFile> resolved, File(head, f));
    f.chunks = resolved->chunks;
    f.rows_loaded = true;
  }
  return std::shared_ptr<const Manifest>(std::move(full));
}

Expected<std::vector<VersionTime>> Bucket::VersionTimes(std::string_view model) {
  WFS_TRY(ValidateModelName(model));
  std::vector<VersionTime> out;
  if (derived_) {
    WFS_ASSIGN_OR_RETURN(std::vector<VersionInfo> versions, ListVersions(model));
    for (const VersionInfo& v : versions) {
      WFS_ASSIGN_OR_RETURN(std::shared_ptr<const Manifest> m, ReadManifest(v.model, v.version));
      out.push_back({v.version, m->created_ms});
    }
  } else {
    // One listing of the model's keys holds both its versions and its time markers.
    const std::string prefix = "models/" + std::string(model) + "/";
    WFS_ASSIGN_OR_RETURN(std::vector<ObjectInfo> objects, ListAll(*store_, prefix));
    std::map<std::string, int64_t> timed;
    std::vector<std::string> versions;
    const std::string times = prefix + "times/", names = prefix + "versions/";
    for (const ObjectInfo& o : objects) {
      std::string_view key = o.key;
      if (key.starts_with(times)) {
        std::string_view rest = key.substr(times.size());
        if (rest.size() < 15 || rest[13] != '-') continue;
        int64_t ms = 0;
        bool digits = true;
        for (size_t i = 0; i < 13; ++i) {
          if (rest[i] < '0' || rest[i] > '9') digits = false;
          ms = ms * 10 + (rest[i] - '0');
        }
        std::string_view v = rest.substr(14);
        if (!digits || !ValidateVersionName(v).ok()) continue;
        timed[std::string(v)] = ms;
      } else if (key.starts_with(names) && key.ends_with(".json")) {
        std::string_view v = key.substr(names.size(), key.size() - names.size() - 5);
        if (ValidateVersionName(v).ok()) versions.emplace_back(v);
      }
    }
    // A marker without its version (retired by gc midway) is ignored; a version without a
    // marker has its head read.
    std::vector<std::string> unmarked;
    for (const std::string& v : versions) {
      auto it = timed.find(v);
      if (it != timed.end()) {
        out.push_back({v, it->second});
      } else {
        unmarked.push_back(v);
      }
    }
    std::vector<Expected<std::shared_ptr<const Manifest>>> read(unmarked.size(), Status::IOError("not read"));
    Parallel(unmarked.size(), [&](size_t i) { read[i] = ReadManifest(model, unmarked[i]); });
    for (size_t i = 0; i < unmarked.size(); ++i) {
      if (!read[i].ok()) return read[i].status();
      out.push_back({unmarked[i], (*read[i])->created_ms});
    }
  }
  std::sort(out.begin(), out.end(), [](const VersionTime& a, const VersionTime& b) {
    return std::tie(a.created_ms, a.version) < std::tie(b.created_ms, b.version);
  });
  return out;
}

void Bucket::PrefetchManifests(std::string_view model, std::span<const std::string> versions) {
  if (derived_) return;
  std::vector<std::string_view> missing;
  for (const std::string& v : versions) {
    if (!manifests_.Contains(ManifestKey(model, v))) missing.push_back(v);
    if (missing.size() == kMaxPrefetch) break;
  }
  if (missing.size() < 2) return;  // the walk reads one as fast
  // Errors (an allocation failing included) are left to the ReadManifest that needs it.
  Parallel(missing.size(), [&](size_t i) { (void)ReadManifest(model, missing[i]); });
}

void Bucket::Forget(std::string_view model, std::string_view version) {
  manifests_.Erase(ManifestKey(model, version));
  std::string prefix = std::string(model) + "@" + std::string(version);
  prefix.push_back('\0');
  files_.ErasePrefix(prefix);
  indexes_.ErasePrefix(prefix);
}

Status Bucket::PublishManifest(const Manifest& manifest) {
  if (!derived_ && manifest.inherited_from && manifest.parent && format_ == kManifestFormat2) {
    // The parent as it is now: gc may have rewritten it (or retired it) since its rows were
    // copied, and rows of a rewritten head may name payloads and bases that are gone.
    Expected<std::shared_ptr<const Manifest>> now = ReadStoredManifest(manifest.model, *manifest.parent, /*uncached=*/true);
    if (!now.ok()) {
      if (now.status().kind() != ErrorKind::kNotFound) return now.status().WithContext("checking the parent");
      return Status::Conflict("the parent " + manifest.model + "@" + *manifest.parent + " of " + manifest.model + "@" +
                              manifest.version + " is gone from " + store_->Describe() +
                              " (retired by `gc --keep-last` while this version was written); nothing was "
                              "published: write it again on a version that is kept");
    }
    if ((*now)->format == kManifestFormat2 && (*now)->table != *manifest.inherited_from) {
      if (std::shared_ptr<const Manifest> cached = manifests_.Get(ManifestKey(manifest.model, *manifest.parent));
          cached && !SameHead(*cached, **now)) {
        Forget(manifest.model, *manifest.parent);
        head_generation_++;
      }
      std::map<std::string, std::shared_ptr<const ManifestFile>> held;
      Status failed;
      Manifest rebound = manifest;
      Status st = RebindInheritedRows(&rebound, **now, [&](const std::string& path) -> const ManifestFile* {
        const ManifestFile* head = (*now)->FindFile(path);
        if (!head) return nullptr;
        Expected<std::shared_ptr<const ManifestFile>> rows = File(**now, *head);
        if (!rows.ok()) {
          if (failed.ok()) failed = rows.status();
          return nullptr;
        }
        return (held[path] = *rows).get();
      });
      if (!failed.ok()) return failed.WithContext("reading the rows of the parent " + manifest.model + "@" + *manifest.parent);
      WFS_TRY(st.WithContext("publishing " + manifest.model + "@" + manifest.version));
      if (manifest.inherited_from != Hash128{}) {
        spdlog::info("{}@{}: its parent {} was rewritten in the bucket while it was written (gc's rebase); its "
                     "inherited rows are the new head's", manifest.model, manifest.version, *manifest.parent);
      }
      rebound.inherited_from.reset();
      return PublishManifest(rebound);
    }
  }
  if (derived_) {
    return Status::Unsupported("bucket " + store_->Describe() +
                               " is not a weightfs bucket (its versions are derived from another "
                               "layout) and is read-only; `weightfs import` it into one");
  }
  for (const ManifestFile& f : manifest.files) {
    if (!f.rows_loaded) return Status::InvalidArgument("publishing " + manifest.model + "@" + manifest.version + ": the rows of " + f.path + " are not loaded");
  }
  std::vector<uint8_t> bytes;
  if (format_ == kManifestFormat2) {
    // The table first (named by its hash: two writers racing for one name each write their
    // own), then the head that names it, created if absent: the one publishing step.
    SerializedVersion v = SerializeVersion(manifest, table_block_rows_);
    WFS_TRY(store_->Put(TableKey(v.table_hash), v.table).WithContext("writing the chunk table of " +
                                                                    manifest.model + "@" + manifest.version));
    bytes = std::move(v.head);
  } else {
    bytes = SerializeManifest(manifest);
  }
  Status s = store_->Put(ManifestKey(manifest.model, manifest.version), bytes,
                         PutMode::kCreateIfAbsent);
  if (s.kind() == ErrorKind::kConflict) {
    return Status::Conflict("version " + manifest.model + "@" + manifest.version +
                            " was already published in " + store_->Describe() +
                            " (another writer won); push under another version name");
  }
  WFS_TRY(s);
  // The time marker: after the version exists (a reader never sees a marker of a version that
  // is not there, except one gc is retiring). A writer that dies here leaves a version whose
  // time is read from its head. Its failure fails nothing: the version is published.
  // (From `created`, what readers parse: writers need not have set created_ms.)
  const Expected<int64_t> created = ParseUtc(manifest.created);
  (void)store_->Put(TimeKey(manifest.model, manifest.version, created.ok() ? *created : manifest.created_ms), {});
  return Status::Ok();
}

Status Bucket::ReplaceManifest(const Manifest& manifest, int format) {
  if (derived_) return Status::Unsupported("bucket " + store_->Describe() + " is read-only");
  if (format == 0) format = manifest.format;
  for (const ManifestFile& f : manifest.files) {
    if (!f.rows_loaded) return Status::InvalidArgument("rewriting " + manifest.model + "@" + manifest.version + ": the rows of " + f.path + " are not loaded");
  }
  std::vector<uint8_t> bytes;
  if (format == kManifestFormat2) {
    SerializedVersion v = SerializeVersion(manifest, table_block_rows_);
    WFS_TRY(store_->Put(TableKey(v.table_hash), v.table));
    bytes = std::move(v.head);
  } else {
    bytes = SerializeManifest(manifest);
  }
  WFS_TRY(store_->Put(ManifestKey(manifest.model, manifest.version), bytes, PutMode::kOverwrite));
  Forget(manifest.model, manifest.version);
  head_generation_++;
  return Status::Ok();
}

Status Bucket::SetFormat(int format) {
  std::string marker = nlohmann::json{{"format", format}}.dump() + "\n";
  WFS_TRY(store_->Put(kMarkerKey, {reinterpret_cast<const uint8_t*>(marker.data()), marker.size()},
                      PutMode::kOverwrite));
  format_ = format;
  return Status::Ok();
}

Expected<std::shared_ptr<const Manifest>> Bucket::Latest(std::string_view model) {
  WFS_ASSIGN_OR_RETURN(std::vector<VersionTime> times, VersionTimes(model));
  if (times.empty()) return Status::NotFound("model " + std::string(model) + " has no versions in " + store_->Describe());
  return ReadManifest(model, times.back().version);
}

std::string DescribeChunkOf(const Manifest& manifest, const ManifestFile& file, size_t index) {
  std::string s = manifest.model + "@" + manifest.version + " " + file.path;
  if (index < file.chunks.size()) s += " " + DescribeChunk(file.chunks[index].key);
  return s;
}

Expected<ChainLink> Bucket::DeltaBase(const ChainLink& link) {
  const std::string& base_version = link.manifest->versions[link.chunk->base];
  Expected<std::shared_ptr<const Manifest>> bm = ReadManifest(link.manifest->model, base_version);
  if (!bm.ok()) return bm.status().WithContext("reading base version " + base_version);
  ChainLink base;
  const size_t row = link.index();
  const ManifestFile* head_file = (*bm)->FindFile(link.file->path);
  if (head_file && head_file->size > 0) {
    // The rows near the same row: versions of a file usually share their layout.
    Expected<std::shared_ptr<const ManifestFile>> rows = RowsOfRow(**bm, *head_file, row);
    if (!rows.ok()) return rows.status().WithContext("reading base version " + base_version);
    base.file_holder = std::move(rows).value();
    base.file = base.file_holder.get();
    base.chunk = base.file->FindChunkNear(link.chunk->key, row - base.file->first_row);
    if (!base.chunk && !base.file->AllRows()) {
      // Another layout: the other blocks, one at a time (never the whole file at once).
      Expected<std::shared_ptr<const TableBlockIndex>> index = BlockIndex(**bm, *head_file);
      if (!index.ok()) return index.status().WithContext("reading base version " + base_version);
      for (size_t k = 0; k < (*index)->blocks() && !base.chunk; ++k) {
        Expected<std::shared_ptr<const ManifestFile>> block = Block(**bm, *head_file, **index, k);
        if (!block.ok()) return block.status().WithContext("reading base version " + base_version);
        base.file_holder = std::move(block).value();
        base.file = base.file_holder.get();
        base.chunk = base.file->FindChunkNear(link.chunk->key, 0);
      }
    }
  }
  if (!base.chunk) {
    return Status::Corruption("the delta's base chunk is missing from " + link.manifest->model + "@" + base_version);
  }
  // Strictly decreasing, not "one less": gc's rebasing turns a base into a keyframe (depth 0)
  // under deltas that still say they are deeper.
  if (base.chunk->depth >= link.chunk->depth) {
    return Status::Corruption("delta chain depth does not decrease at " + link.manifest->model + "@" + base_version);
  }
  base.manifest_holder = std::move(bm).value();
  base.manifest = base.manifest_holder.get();
  return base;
}

Status Bucket::ReadPayload(const Manifest& manifest, const ManifestChunk& chunk, ByteBuffer* out) {
  const PayloadRef& ref = chunk.ref;
  const bool external = chunk.is_external();
  std::string key;
  if (external) {
    if (ref.pack >= manifest.sources.size()) return Status::Corruption("payload names no source");
    key = manifest.sources[ref.pack];
    if (!external_) return Status::Unsupported("this weightfs cannot read external sources").WithContext("fetching " + key);
    Expected<std::vector<uint8_t>> bytes = external_->Read(key, ref.offset, ref.length);
    if (!bytes.ok()) return bytes.status().WithContext("fetching " + key);
    out->assign(bytes->begin(), bytes->end());
  } else {
    if (ref.pack >= manifest.packs.size()) return Status::Corruption("payload names no pack");
    key = PackKey(manifest.packs[ref.pack]);
    Status st = store_->GetInto(key, ByteRange{ref.offset, ref.length}, out);
    if (st.kind() == ErrorKind::kInvalidArgument) {
      // A store refuses a range whose offset is past the end of the object (store.h). If that is
      // why, the pack has none of the bytes the manifest references: a truncated pack, corrupt
      // like one that ends inside the payload (below), not a bad request.
      Expected<ObjectInfo> info = store_->Head(key);
      if (info.ok() && info->size < ref.offset + ref.length) {
        st = Status::Ok();
        out->clear();
      }
    }
    if (!st.ok()) return st.WithContext("fetching " + key);
  }
  if (out->size() != ref.length) {
    return Status::Corruption(std::string(external ? "source " : "pack ") + key + " is truncated: " +
                              std::to_string(out->size()) + " of " + std::to_string(ref.length) +
                              " payload bytes at offset " + std::to_string(ref.offset));
  }
  return Status::Ok();
}

Expected<bool> Bucket::HasPack(const Hash128& pack) {
  Expected<ObjectInfo> head = store_->Head(PackKey(pack));
  if (head.ok()) return true;
  if (head.status().kind() == ErrorKind::kNotFound) return false;
  return head.status();
}

}  // namespace weightfs

// Bucket: the weightfs layout (docs/format2.md) on top of a Store.
//
//   weightfs.json                              {"format": 2} (or 1: a bucket not upgraded)
//   models/<model>/versions/<version>.json     per published version, created once: its head
//                                              (format 2: small, the rows are in its table) or
//                                              its whole manifest (format 1)
//   models/<model>/times/<ms>-<version>        empty; the version's creation time in its name,
//                                              so `ls` and "latest" need only a listing
//   packs/<32 hex>                             immutable packs of chunk payloads (XXH3-128)
//   tables/<32 hex>                            format 2 chunk tables, a section per file, read
//                                              by range (named by their XXH3-128: two writers
//                                              racing for a name each write their own)
//   leases/<id>.json                           pushes in progress (gc leaves their packs alone)
//
// Every version is read as what it is (a bucket upgraded part way holds both formats); the
// bucket's format says what new versions are written as.
//
// Memory: heads (manifests) and decoded file tables are immutable once published; the Bucket
// keeps the ones it has read in caches bounded by bytes (set_metadata_budget) and hands out
// shared pointers to them, which keep them alive while held.
//
// Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/chunk_table.h"
#include "core/manifest.h"
#include "hub/engine/byte_lru.h"
#include "hub/engine/derived_versions.h"
#include "hub/engine/external_source.h"
#include "hub/store/store.h"

namespace weightfs {

struct VersionInfo {
  std::string model;
  std::string version;
  // From the version's time marker, when it has one (format 2 writers make one for every
  // version): its creation time without reading its head.
  std::optional<int64_t> created_ms;
};

// A version's creation time as its time marker names it (Unix ms).
struct VersionTime {
  std::string version;
  int64_t created_ms = 0;
};

// Whether `model` is `prefix` or a model under it ("acme/qwen" is under "acme"; "acme2/x" is
// not); every model is under "".
inline bool ModelUnder(std::string_view model, std::string_view prefix) {
  return prefix.empty() || model == prefix ||
         (model.size() > prefix.size() && model.starts_with(prefix) && model[prefix.size()] == '/');
}

// "acme/qwen@v3 model.safetensors tensor 'wte' chunk 2" for messages.
std::string DescribeChunkOf(const Manifest& manifest, const ManifestFile& file, size_t index);

// One link of a chunk's delta chain: a version's row of a file, and what keeps it alive. The
// chain's first link is usually the caller's (holders null); Bucket::DeltaBase reads the next.
struct ChainLink {
  std::shared_ptr<const Manifest> manifest_holder;  // null: the caller keeps `manifest` alive
  const Manifest* manifest = nullptr;
  std::shared_ptr<const ManifestFile> file_holder;  // keeps `file` (its rows) alive, or null
  const ManifestFile* file = nullptr;
  const ManifestChunk* chunk = nullptr;

  // The chunk's row in the whole file (`file` may hold a block of its rows).
  size_t index() const { return static_cast<size_t>(file->first_row) + static_cast<size_t>(chunk - file->chunks.data()); }
  std::string Describe() const { return DescribeChunkOf(*manifest, *file, index()); }
};

class Bucket {
 public:
  // Writes weightfs.json unless the bucket already has one (then checks its format). `format`:
  // what versions are written as (1 only for buckets older weightfs must still read).
  static Status Init(Store& store, int format = kManifestFormat2);
  // Checks weightfs.json; a bucket without one gets an error that says to run `weightfs init`.
  static Expected<std::unique_ptr<Bucket>> Open(std::shared_ptr<Store> store);
  // A read-only bucket whose versions `derived` makes from another layout (a TRL delta-sync
  // bucket): listing and manifests come from it, publishing is Unsupported.
  static std::unique_ptr<Bucket> FromDerived(std::shared_ptr<Store> store,
                                             std::shared_ptr<DerivedVersions> derived);
  // Non-null for a bucket made by FromDerived.
  DerivedVersions* derived() const { return derived_.get(); }
  // Where kExternal recipes read from (a base model in a Hugging Face repo). Set once, before
  // the bucket is shared between threads; null: such recipes fail with a clear error.
  void set_external_sources(std::shared_ptr<ExternalSources> sources) { external_ = std::move(sources); }
  ExternalSources* external_sources() const { return external_.get(); }
  // The most JSON one manifest may hold (inflated, if stored compressed); a larger one is
  // ResourceExhausted for that version. ParseManifest's peak memory is about twice what the
  // manifest holds, so a process with a memory budget sets a fraction of it. Set once, before
  // the bucket is shared between threads.
  void set_max_manifest_json_bytes(uint64_t bytes) { max_manifest_json_bytes_ = bytes; }
  // Bytes the caches of heads, file rows and block indexes may keep (a half, 7/16, 1/16).
  // Default 256 MiB.
  void set_metadata_budget(uint64_t bytes);
  // Rows per block of the table sections this bucket writes (core/chunk_table.h). Tests, and
  // the scale bench's comparison with sections in one piece, set others; set once, before the
  // bucket is shared between threads.
  void set_table_block_rows(uint64_t rows) { table_block_rows_ = std::max<uint64_t>(rows, 1); }
  // What new versions are written as (weightfs.json's format).
  int format() const { return format_; }

  Store& store() { return *store_; }
  std::string Describe() const { return store_->Describe(); }

  // Every published version, optionally of one model (and its sub-organisation), sorted by
  // model then version name.
  // `model` empty: every model. Else that model's versions, and with `with_sub_models` those of
  // the models under it too ("acme" lists acme/qwen, acme/llama/8b...): one listing of
  // models/<model>/, for a mount of part of a bucket (--prefix).
  Expected<std::vector<VersionInfo>> ListVersions(std::string_view model = {}, bool with_sub_models = false);
  // Reads the manifests of `versions` of `model` that are not cached yet, several at a time
  // (errors are left to the ReadManifest that needs them). A materializer walking a chunk's
  // chain back otherwise reads and parses them one after another.
  void PrefetchManifests(std::string_view model, std::span<const std::string> versions);
  // Parsed, validated manifest (NotFound naming model@version if absent). Format 2: the head,
  // whose files' rows are not loaded (File loads them).
  Expected<std::shared_ptr<const Manifest>> ReadManifest(std::string_view model,
                                                         std::string_view version);
  // `file` (of `manifest`) with its rows: itself when they are loaded, else read from the
  // version's table (one ranged read of the file's section, validated, cached; of a section in
  // blocks, every block in turn, not cached whole: for tools, a reader of part of the file
  // takes RowsAt's).
  Expected<std::shared_ptr<const ManifestFile>> File(const std::shared_ptr<const Manifest>& manifest,
                                                     const ManifestFile& file);
  // The same for a manifest the caller keeps alive (the result does not own it when the rows
  // are the manifest's own).
  Expected<std::shared_ptr<const ManifestFile>> File(const Manifest& manifest, const ManifestFile& file);
  // The file of that path, resolved; NotFound if the version has none.
  Expected<std::shared_ptr<const ManifestFile>> File(const std::shared_ptr<const Manifest>& manifest,
                                                     std::string_view path);
  // The rows of `file` (of `manifest`; a head's file or any block of it) that hold byte
  // `offset` of it: all of them when its section is one table, else the block of them that
  // holds it (a section in blocks, core/chunk_table.h: its index and that block are read by
  // range, validated and cached). What a reader of part of a file needs. REQUIRES: offset <
  // file.size.
  Expected<std::shared_ptr<const ManifestFile>> RowsAt(const Manifest& manifest, const ManifestFile& file,
                                                       uint64_t offset);
  // The same for the file's row `row` (a row past the last: the last block's).
  Expected<std::shared_ptr<const ManifestFile>> RowsOfRow(const Manifest& manifest, const ManifestFile& file,
                                                          uint64_t row);
  // Reads the rows near row `row` of `path` (the whole section, or the block holding it) in
  // `versions` of `model` that are not cached yet, several at a time (a chain walk needs them
  // in each version); errors are left to the call that needs them.
  void PrefetchFiles(std::string_view model, std::span<const std::string> versions, std::string_view path,
                     uint64_t row = 0);
  // The manifest with every file's rows loaded (tools that process whole versions: push's
  // parent, gc, verify). Not cached as a whole.
  Expected<std::shared_ptr<const Manifest>> ReadFullManifest(std::string_view model, std::string_view version);
  // Every version of `model` with its creation time, from the time markers (one listing);
  // versions without one (written by an older weightfs, or a writer that died right after
  // publishing) have their heads read. Sorted by (time, name): the last is the latest.
  Expected<std::vector<VersionTime>> VersionTimes(std::string_view model);
  // Drops a manifest from the in-memory cache (after gc removed it).
  void Forget(std::string_view model, std::string_view version);
  // Heads are immutable except for in-place rewrites that keep every file's bytes (gc's rebase,
  // `weightfs upgrade`; ReplaceManifest), which another process may do at any time. Reads the
  // heads of `versions` of `model` this cache holds again, straight from the store (those it
  // does not hold are read fresh when asked for), and replaces the ones rewritten since (their
  // rows go with them) and forgets the ones gone. Returns how many heads changed or went.
  // Called when a chain read with cached heads failed at `failed_at` (Materializer::Build): a
  // check of the model that started after that instant already saw every rewrite the failure
  // can be due to (a rewrite comes before the deletes that make old rows fail), so it is not
  // done again and its count is returned. One check at a time (they are rare).
  Expected<size_t> Revalidate(std::string_view model, std::span<const std::string> versions,
                              std::chrono::steady_clock::time_point failed_at);
  // ReadManifest of a head checked against the store first (Revalidate of that one head): for
  // what a version is about to be built on (a draft's parent), where a head rewritten since
  // this process read it would give rows that are gone.
  Expected<std::shared_ptr<const Manifest>> ReadCurrentManifest(std::string_view model, std::string_view version);
  // Counts the heads Revalidate and ReplaceManifest replaced or dropped: a reader that saw it
  // change across a failed read used heads that have been replaced since.
  uint64_t head_generation() const { return head_generation_.load(); }
  // Whether two heads of a version are the same publication of it (format 2: the same table).
  static bool SameHead(const Manifest& a, const Manifest& b);
  // Publishes a manifest with create-if-absent: Conflict if the version exists.
  Status PublishManifest(const Manifest& manifest);
  // Overwrites a published version's manifest with `manifest` (same files and bytes, other
  // recipes: gc's rebase; `weightfs upgrade`), in `format` (0: the manifest's own). Format 2
  // writes the new table first, then the head: a crash leaves the old or the new version.
  Status ReplaceManifest(const Manifest& manifest, int format = 0);
  // Makes weightfs.json say `format` (after `weightfs upgrade` converted every version):
  // from then on versions are written in it.
  Status SetFormat(int format);
  // The newest version (by creation time, then name) of `model`, or NotFound.
  Expected<std::shared_ptr<const Manifest>> Latest(std::string_view model);

  // The link a delta (`link.chunk->is_delta()`) is applied to: its base version's row of the
  // same key in the same file (near the same index). Corruption when the base version has no
  // such row or its depth does not decrease (a hostile manifest cannot make a walk loop); the
  // base version's read errors otherwise. The one chain walk of the engine: the materializer
  // walks to a keyframe or a cached ancestor, the weight patcher to the bytes of an older
  // version.
  Expected<ChainLink> DeltaBase(const ChainLink& link);
  // The stored payload of `chunk` (of `manifest`) into `out`: its pack's range, or an external
  // source's bytes. Corruption when the pack (or source) holds fewer bytes than the row says.
  Status ReadPayload(const Manifest& manifest, const ManifestChunk& chunk, ByteBuffer* out);
  // Whether the pack is in the bucket (a HEAD); the store's error when it cannot say.
  Expected<bool> HasPack(const Hash128& pack);

  static std::string ManifestKey(std::string_view model, std::string_view version);
  static std::string TimeKey(std::string_view model, std::string_view version, int64_t created_ms);
  static std::string PackKey(const Hash128& pack) { return "packs/" + pack.ToHex(); }
  static std::string TableKey(const Hash128& table) { return "tables/" + table.ToHex(); }
  static constexpr const char* kMarkerKey = "weightfs.json";
  static constexpr const char* kLeasePrefix = "leases/";

 private:
  explicit Bucket(std::shared_ptr<Store> store, int format = kManifestFormat2)
      : store_(std::move(store)), format_(format) {}
  // A cache key of a file's rows: "model@version\0table\0path". The table is in it because a
  // version's head can be rewritten (gc's rebase, `weightfs upgrade`): rows are only ever
  // handed out with the head that names their table.
  static std::string FileKey(std::string_view model, std::string_view version, const Hash128& table,
                             std::string_view path);

  std::shared_ptr<Store> store_;
  std::shared_ptr<DerivedVersions> derived_;
  std::shared_ptr<ExternalSources> external_;
  uint64_t max_manifest_json_bytes_ = kDefaultMaxManifestJsonBytes;
  uint64_t table_block_rows_ = kTableBlockRows;
  std::atomic<bool> warned_one_piece_{false};  // a large one-table section was read (and said so)
  std::atomic<int> format_;
  struct Revalidation {
    std::chrono::steady_clock::time_point started;
    size_t changed = 0;
  };
  std::atomic<uint64_t> head_generation_{0};
  std::mutex revalidate_mu_;  // held through a check
  std::map<std::string, Revalidation, std::less<>> revalidated_;  // by model; guarded by revalidate_mu_
  // ReadManifest without the cache (the result is not put in it); `uncached`: past any cache
  // of the store's too (Store::GetUncached), for checks that must see a rewrite.
  Expected<std::shared_ptr<const Manifest>> ReadStoredManifest(std::string_view model, std::string_view version,
                                                               bool uncached = false);
  // A section in blocks: its index, and block k (a ManifestFile holding those rows), from the
  // cache, else decoded from `section` (the whole section's bytes) when given, else read.
  Expected<std::shared_ptr<const TableBlockIndex>> BlockIndex(const Manifest& manifest, const ManifestFile& file,
                                                              std::span<const uint8_t> section = {});
  Expected<std::shared_ptr<const ManifestFile>> Block(const Manifest& manifest, const ManifestFile& file,
                                                      const TableBlockIndex& index, size_t k,
                                                      std::span<const uint8_t> section = {});
  // The block `pick` chooses from the index: from the cache, or read (the index first, unless
  // the section is small enough to read whole at once).
  Expected<std::shared_ptr<const ManifestFile>> BlockWhere(const Manifest& manifest, const ManifestFile& file,
                                                           const std::function<size_t(const TableBlockIndex&)>& pick);
  // A section in blocks of at most this many bytes is read whole, in one request, when its
  // index is not cached: a round trip to S3 (~10-30 ms) costs more than 128 KiB (~2 ms at a
  // connection's ~60 MB/s). A sharded 1T model's sections (~150 KB) are just above it.
  static constexpr uint64_t kWholeSectionBytes = 128 << 10;
  // Reads bytes [from, to) of `file`'s section.
  Expected<ByteBuffer> ReadSection(const Manifest& manifest, const ManifestFile& file, uint64_t from, uint64_t to,
                                   const std::string& what);
  // The cache key of block k of the file whose FileKey is `file_key`.
  static std::string BlockKey(const std::string& file_key, size_t k) { return file_key + "#" + std::to_string(k); }
  // The cache key of the rows holding row `row` when this process knows it without a read,
  // else empty.
  std::string KnownRowsKey(const Manifest& manifest, const ManifestFile& file, uint64_t row);
  ManifestFile RowsHolder(const ManifestFile& head) const;
  ByteLru<Manifest> manifests_{128ull << 20};  // by ManifestKey
  ByteLru<ManifestFile> files_{128ull << 20};  // by FileKey (+ "#k" for block k)
  ByteLru<TableBlockIndex> indexes_{16ull << 20};  // by FileKey
  // How many manifests PrefetchManifests reads at most (a chain is at most this deep in
  // versions worth prefetching).
  static constexpr size_t kMaxPrefetch = 128;
};

// Lists every key under `prefix`, following continuations.
Expected<std::vector<ObjectInfo>> ListAll(Store& store, std::string_view prefix);

}  // namespace weightfs

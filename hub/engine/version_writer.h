// PushVersion: encodes local files as a new version of a model and publishes it.
//
// Each file is planned into chunks (core/chunk_plan.h) and each chunk paired with the parent
// version's chunk of the same file path and key. A chunk equal to its parent inherits the
// parent's recipe and stores nothing; a changed one is delta-encoded against the parent's bytes
// (taken from the chunk cache, or materialized from the bucket) unless the keyframe policy says
// its chain is long enough, then it is stored FULL. Payloads go into packs uploaded in the
// background while encoding continues. Publishing is last: a lease under leases/ first tells
// `gc` that packs are being written, then the packs, then the manifest with create-if-absent.
// A push that dies at any point leaves at most orphaned packs (gc removes them) and never a
// visible partial version; two pushes of the same MODEL@VERSION: exactly one wins, the other
// gets Conflict.
//
// Memory: one chunk and its payload per encode thread, plus at most `max_packs_in_flight`
// packs. The new version's chunks are recorded in the cache as references to the pushed files.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/chunk_codec.h"
#include "core/manifest.h"
#include "core/thread_pool.h"
#include "hub/engine/bucket.h"
#include "hub/engine/chunk_cache.h"
#include "hub/engine/file_bytes.h"

namespace weightfs {

class PushRecord;

struct PushFile {
  std::string path;        // inside the version ("model-00001-of-00002.safetensors")
  std::string local_path;  // file to read
};

struct PushOptions {
  uint64_t chunk_bytes = kDefaultChunkBytes;
  uint64_t pack_bytes = 32ull << 20;
  size_t uploaders = 4;
  size_t max_packs_in_flight = 4;
  KeyframePolicy keyframes;
  EncodeOptions encode;
  // Record every chunk of the pushed files in the cache as a reference to the local file, so
  // the next push (whose parent this version is) finds its bases without the bucket.
  bool cache_new_chunks = true;
  // Store a file that claims to be safetensors (by name or header) and is not one (truncated,
  // a header that does not parse or lies) as opaque bytes, with a warning, instead of refusing
  // it: a broken checkpoint must not become @latest by accident (CheckSafetensors).
  bool allow_invalid = false;
  // Called from worker threads (serialized) with logical bytes done and total.
  std::function<void(uint64_t done, uint64_t total)> progress;
  // What an interrupted run of this push already uploaded (hub/engine/push_record.h): chunks whose
  // bytes and delta base match a recorded one reuse its payload; every chunk encoded now is
  // recorded once its pack is uploaded. Null: none.
  PushRecord* record = nullptr;
};

struct PushResult {
  std::shared_ptr<const Manifest> manifest;
  size_t packs = 0;
  uint64_t pack_bytes = 0;
  uint64_t full_chunks = 0, delta_chunks = 0, same_chunks = 0;
  // What the changed fraction is made of: tensor elements, and bytes of other data (headers,
  // opaque files; they count only in a version without tensors). Parts encoded separately add.
  uint64_t tensor_elements = 0, tensor_changed = 0, other_elements = 0, other_changed = 0;
  // Chunks whose payload an interrupted run had uploaded (PushOptions::record), and its bytes.
  uint64_t resumed_chunks = 0, resumed_bytes = 0;
};

// The pieces PushVersion is made of, for callers that encode a version a file at a time (the
// mount's drafts encode each file when it is closed, and assemble the version at commit).
//
// VersionEncoder encodes files into a manifest under construction; its packs upload in the
// background. It neither takes a lease nor publishes: the caller does both. Not thread-safe
// (AddFile parallelizes inside, over `pool`).
class VersionEncoder {
 public:
  // `total_bytes` (0 = unknown) is what options.progress reports as the total.
  VersionEncoder(Bucket& bucket, ChunkCache* cache, ThreadPool& pool, const VersionRef& target,
                 std::shared_ptr<const Manifest> parent, const PushOptions& options,
                 uint64_t total_bytes = 0);
  ~VersionEncoder();
  VersionEncoder(const VersionEncoder&) = delete;
  VersionEncoder& operator=(const VersionEncoder&) = delete;

  // Encodes `data` as the version's file `path` against the parent's file of the same path.
  // `local_path` (may be empty) is where the bytes live, for the cache's references.
  // Files must be added in path order.
  Status AddFile(const std::string& path, const FileBytes& data, const std::string& local_path);
  Status AddFile(const std::string& path, std::span<const uint8_t> data, const std::string& local_path) {
    return AddFile(path, FileBytes(data), local_path);
  }
  // The element tallies so far, as PushResult counts them (tensor elements, tensor changed,
  // other elements, other changed): the difference around an AddFile is that file's.
  std::array<uint64_t, 4> Tally() const;
  // Waits for the uploads and returns the manifest (created = now), not yet published.
  Expected<Manifest> Finish(PushResult* result = nullptr);

  struct State;

 private:
  std::unique_ptr<State> state_;
};

// Appends `file` of `src` to `dst`, translating its recipes into dst's pack and version tables.
// `src_is_dst` says that src's own version (versions[0]) is dst's (an encoded part of the same
// version, perhaps under another name); otherwise it is an older version, named by its name.
void AppendFileFrom(const Manifest& src, const ManifestFile& file, Manifest* dst, bool src_is_dst);

// The checks every push makes of its files before anything is uploaded: sorted by path, each
// path valid and given once, the parent of the same model.
Status CheckPushFiles(const VersionRef& target, const Manifest* parent, std::vector<PushFile>* files);

// Maps and encodes `files` (checked by CheckPushFiles) into a manifest whose packs are uploaded,
// not yet published: push's and push --parts' encode. The caller holds a lease. IOError if a
// file was truncated while it was read. `what` names the push in errors.
Expected<Manifest> EncodePushFiles(Bucket& bucket, ChunkCache* cache, ThreadPool& pool, const VersionRef& target,
                                   std::shared_ptr<const Manifest> parent, const std::vector<PushFile>& files,
                                   const PushOptions& options, const std::string& what, PushResult* result);

// `parent` null: the version is a base (every chunk FULL). `pool` runs the encode loop.
Expected<PushResult> PushVersion(Bucket& bucket, ChunkCache* cache, ThreadPool& pool,
                                 const VersionRef& target,
                                 std::shared_ptr<const Manifest> parent,
                                 std::vector<PushFile> files, const PushOptions& options);

// Lists `dir` recursively as PushFiles (paths relative to it, sorted); skips dot files.
Expected<std::vector<PushFile>> FilesUnder(const std::string& dir);

}  // namespace weightfs

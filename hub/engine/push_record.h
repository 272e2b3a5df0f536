// PushRecord: what an interrupted push already put in the bucket, kept in the cache directory,
// so that the same push run again sends only the rest.
//
// A push uploads packs as it encodes and publishes at the end; killed in between (Ctrl-C, a
// preempted job), its packs sit in the bucket unreferenced until gc. The record notes, for every
// chunk the push encoded whose pack is in the bucket, where its payload is and what it was
// encoded from: the chunk's XXH3-128, and for a delta the parent chunk's. The same push again
// (same bucket, version and parent: one record file per such key) reuses a recorded payload for
// a chunk whose bytes and delta base are still exactly those, and encodes and uploads the rest.
// Nothing is trusted blindly: the bytes are read and hashed as always (the file's SHA-256 and
// each chunk's hash are computed anew), and each recorded pack is checked to be in the bucket
// when the record is opened (gc may have removed it since). A line is appended only after its
// pack's upload succeeded, so a crash loses at most the lines of packs in flight (those are
// then sent again; gc removes the copies). The record is removed once the version is published.
//
// Format: JSON lines; the first names the record's key, each other one is a chunk. A line that
// does not parse (the last one, cut by a crash) is skipped.
//
// Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/hash.h"
#include "core/manifest.h"
#include "core/mutex.h"
#include "core/status.h"
#include "core/thread_pool.h"
#include "hub/store/store.h"

namespace weightfs {

class PushRecord {
 public:
  struct Chunk {
    uint64_t offset = 0, length = 0;  // in the file
    Hash128 input;                    // XXH3-128 of the chunk's bytes
    std::optional<Hash128> base;      // a delta: the parent chunk it was encoded against
    ChunkEncoding encoding = ChunkEncoding::kFull;
    uint32_t depth = 0;
    uint64_t chain_bytes = 0, keyframe_bytes = 0;
    Hash128 pack;
    uint64_t pack_offset = 0, payload_bytes = 0;
    uint64_t changed = 0;  // changed elements, for the version's statistics
  };

  // The record file of a push of `what` (bucket URL, model@version, parent) under `dir`.
  static std::string PathFor(const std::string& dir, const std::string& what);
  explicit PushRecord(std::string path) : path_(std::move(path)) {}
  ~PushRecord();
  PushRecord(const PushRecord&) = delete;
  PushRecord& operator=(const PushRecord&) = delete;

  // Reads the record (creating it and its directory if needed), keeping the entries whose packs
  // `store` still has (HEADs on `pool`). Call once, holding the push's lease (so that gc cannot
  // remove a pack once it is found here), before the encoder uses it.
  Status Load(Store& store, ThreadPool& pool) WFS_EXCLUDES(mu_);
  bool loaded() const { return loaded_; }

  // A recorded chunk `index` of `file`, or null.
  const Chunk* Find(const std::string& file, size_t index) const;
  // A chunk encoded now into pack number `pack_seq` (PackWriter's): recorded once that pack is
  // uploaded (at once if it is already).
  void Add(const std::string& file, size_t index, const Chunk& chunk, size_t pack_seq) WFS_EXCLUDES(mu_);
  // PackWriter's upload callback.
  void PackUploaded(size_t seq, const Hash128& hash, uint64_t bytes) WFS_EXCLUDES(mu_);
  // Removes the file (the push published).
  void Remove() WFS_EXCLUDES(mu_);

  const std::string& path() const { return path_; }
  // What the record held when opened: chunks, distinct packs and their bytes in the bucket.
  size_t loaded_chunks() const { return chunks_.size(); }
  size_t loaded_packs() const { return loaded_packs_; }
  uint64_t loaded_bytes() const { return loaded_bytes_; }
  // Bytes of packs recorded by this run (what an interruption now would keep).
  uint64_t recorded_bytes() const WFS_EXCLUDES(mu_);

 private:
  void WriteLocked(const std::string& file, size_t index, const Chunk& c) WFS_REQUIRES(mu_);

  const std::string path_;
  std::atomic<bool> loaded_{false};
  std::map<std::pair<std::string, size_t>, Chunk> chunks_;  // loaded; read-only after Load
  size_t loaded_packs_ = 0;
  uint64_t loaded_bytes_ = 0;
  mutable Mutex mu_;
  int fd_ WFS_GUARDED_BY(mu_) = -1;
  struct Pending {
    std::string file;
    size_t index;
    Chunk chunk;
  };
  std::map<size_t, std::vector<Pending>> pending_ WFS_GUARDED_BY(mu_);  // by pack sequence number
  std::map<size_t, Hash128> uploaded_ WFS_GUARDED_BY(mu_);
  uint64_t recorded_bytes_ WFS_GUARDED_BY(mu_) = 0;
};

}  // namespace weightfs

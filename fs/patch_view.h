// PatchView: the read-only `.patch` directory of every published version (docs/patch.md).
//
//   MNT/acme/qwen@v3/.patch/                        hidden (not in readdir of the version),
//                                                   lists v3's nearest ancestors (up to 64;
//                                                   a lookup of any ancestor works)
//   MNT/acme/qwen@v3/.patch/v1/                     v3's *.safetensors files (same subdirs)
//   MNT/acme/qwen@v3/.patch/v1/model.safetensors    the sparse patch v1 -> v3 (hub/engine/weight_patcher.h)
//
// A patch file is generated on its first lookup/getattr/open (its size must be exact in stat)
// into <cache-dir>/patches/<xxh3-128 of model, OLD, NEW, path>.safetensors: written to a
// temporary name, renamed when complete, reused afterwards (also by a later mount: a file
// whose safetensors header parses, ends exactly at the file's size and whose metadata names
// the same model/from/to/file is taken as it is; the directory is private to the cache). Reads
// are preads of that file. Concurrent first uses of a patch generate it once. The directory is
// bounded (`max_bytes`): after each generation the least recently used patches (by mtime,
// refreshed on reuse) are deleted beyond it. Generation failures are EIO with a log line.
//
// Inode numbers are in [kFirstIno, kEndIno), below the drafts' range. Thread-safe.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/mutex.h"
#include "core/thread_annotations.h"
#include "core/thread_pool.h"
#include "hub/engine/bucket.h"
#include "hub/engine/chunk_cache.h"
#include "hub/engine/materializer.h"
#include "fs/namespace.h"

namespace weightfs {

struct PatchViewOptions {
  std::string dir;               // where patch files are kept (made if missing)
  uint64_t max_bytes = 4ull << 30;
  size_t list_ancestors = 64;    // ancestors `ls .patch` shows
  uid_t uid = 0;
  gid_t gid = 0;
  mode_t file_mode = 0444;  // as the published files' (NamespaceOptions)
  mode_t dir_mode = 0555;
  double timeout_s = 86400;
};

class PatchView {
 public:
  static constexpr uint64_t kFirstIno = 1ull << 47;
  static constexpr uint64_t kEndIno = 1ull << 48;
  static bool Owns(uint64_t ino) { return ino >= kFirstIno && ino < kEndIno; }
  static constexpr const char* kDirName = ".patch";

  // All must outlive the view; `cache` may be null.
  PatchView(Bucket* bucket, Materializer* materializer, ChunkCache* cache, PatchViewOptions options);
  ~PatchView();

  // The `.patch` directory of version directory `version_ino` (model@version).
  Status LookupRoot(uint64_t version_ino, const std::string& model, const std::string& version, NodeAttr* out);
  Status Lookup(uint64_t parent, std::string_view name, NodeAttr* out);
  Status GetAttr(uint64_t ino, NodeAttr* out);
  Status ReadDir(uint64_t ino, std::vector<DirEntry>* out);
  // An fd open for reading on the patch file (the caller closes it).
  Status Open(uint64_t ino, int* fd);
  // True for patch files (whose attributes cost a generation).
  bool IsFile(uint64_t ino) const;

  struct Stats {
    uint64_t generated = 0;
    uint64_t reused = 0;
    uint64_t failures = 0;
    uint64_t evicted = 0;
  };
  Stats stats() const;

 private:
  enum class Kind : uint8_t { kRoot, kFrom, kDir, kFile };
  struct Node {
    uint64_t ino = 0;
    Kind kind = Kind::kRoot;
    uint64_t parent = 0;  // kRoot: the version directory
    std::string model, to, from;
    std::string path;     // kDir: "" (kFrom) or "a/b"; kFile: the file's path in NEW
    int64_t mtime_ms = 0;
  };
  struct Flight {
    bool done = false;
    Status status;
  };

  const Node* NodeOf(uint64_t ino) const WFS_REQUIRES(mu_);  // (nodes_ may grow and move)
  // A copy of the node, taken under mu_ (nullopt: not ours).
  std::optional<Node> CopyOf(uint64_t ino) const;
  uint64_t NodeFor(Kind kind, uint64_t parent, const std::string& model, const std::string& to,
                   const std::string& from, const std::string& path, int64_t mtime_ms);
  void Fill(const Node& n, uint64_t size, NodeAttr* out) const;
  // NEW's manifest.
  Status Manifest(const std::string& model, const std::string& version, std::shared_ptr<const weightfs::Manifest>* out);
  // Is `from` an ancestor of model@to? `listed`: the nearest ones, for readdir.
  Status Ancestors(const Node& root, std::vector<std::string>* listed);
  Status IsAncestor(const Node& root, const std::string& from, bool* yes);
  // The patch file of `n` (a kFile), generated if needed; its path and size.
  Status Ensure(const Node& n, std::string* file, uint64_t* size);
  Status Generate(const Node& n, const std::string& file);
  bool Valid(const Node& n, const std::string& file, uint64_t* size) const;
  void Evict(const std::string& keep);

  Bucket* const bucket_;
  Materializer* const materializer_;
  ChunkCache* const cache_;
  const PatchViewOptions options_;
  std::unique_ptr<ThreadPool> pool_;
  Mutex gen_mu_;  // one generation at a time (the pool's threads do the work)

  mutable Mutex mu_;
  std::vector<Node> nodes_ WFS_GUARDED_BY(mu_);                 // nodes_[ino - kFirstIno]
  std::map<std::string, uint64_t> by_key_ WFS_GUARDED_BY(mu_);  // node identity -> ino
  std::map<uint64_t, std::vector<std::string>> ancestors_ WFS_GUARDED_BY(mu_);  // root ino -> nearest ancestors
  // Patch file -> its generation (a Flight's fields are guarded by mu_ too).
  std::map<std::string, std::shared_ptr<Flight>> flights_ WFS_GUARDED_BY(mu_);
  CondVar flight_done_;
  Stats stats_ WFS_GUARDED_BY(mu_);
};

}  // namespace weightfs

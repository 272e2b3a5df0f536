// Namespace: the directory tree a mount shows, built from a bucket's published versions.
//
//   /                                  root
//   /acme/                             a model's organisation, one directory per '/' component
//   /acme/qwen@v1/                     one directory per published version (immutable)
//   /acme/qwen@v1/model.safetensors    the version's files and sub-directories
//   /acme/qwen@latest -> qwen@v3       the newest version (by creation time, then name)
//
// Inode numbers are assigned on first sight and stay stable for the life of the Namespace
// (nodes are never freed; a version that disappears from the bucket loses its directory
// entry, its inode keeps answering). Inode 1 is the root.
//
// Freshness: directories above the versions re-list the bucket when their listing is older than
// `refresh` (one List per interval for the whole bucket), so versions published elsewhere
// appear in listings and @latest within that interval; their attributes and entries get that
// interval as timeout. A lookup of an exact "name@version" the listing does not have checks the
// bucket for that version (one head read; at most `probe_rate` a second for the whole mount,
// an absent answer kept for `probe_negative_ttl`), so a version published on another node can
// be opened as soon as it exists (RL weight sync: `weightfs wait`). NewestVersion re-lists one
// model's versions on demand, under the same rate. Version directories and everything in them
// are immutable: long timeouts.
//
// Laziness: the listing only creates names. A version's manifest is read when its attributes
// are needed (a summary is kept: creation time, parent, stats) and again when its contents are
// (then the file nodes hold it). `name@latest` reads the summaries of that model's versions.
// Memory therefore grows with the versions a user looks into, not with the bucket.
//
// Thread-safe. Bucket I/O (listing, manifests) never runs under the lock; racing loaders of the
// same thing both load it and the first to install wins.
#pragma once

#include <sys/stat.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/mutex.h"
#include "core/thread_annotations.h"
#include "core/manifest.h"
#include "core/status.h"
#include "hub/engine/bucket.h"

namespace weightfs {

// The parent xattr, on a published version ("model@parent") and on a draft directory (the
// parent's version name; set while the draft is unchanged: fs/drafts/xattrs.cc).
inline constexpr const char* kXattrParent = "user.weightfs.parent";

struct NamespaceOptions {
  std::chrono::milliseconds refresh{10000};  // re-list directories above versions this often
  double immutable_timeout_s = 86400;        // attr/entry timeout inside versions
  uid_t uid = 0;                             // owner shown for every node
  gid_t gid = 0;
  // Permission bits of published files and of directories (read and execute bits only:
  // published versions are read-only). With default_permissions the kernel enforces them.
  mode_t file_mode = 0444;
  mode_t dir_mode = 0555;
  // The directories above the versions are writable by their owner (mkdir makes drafts in
  // them): dir_mode plus the owner's write bit (0755 by default).
  bool writable_dirs = false;
  // Direct checks of version names not (yet) in the listing: at most this many a second (0:
  // none, a version appears with the next listing); an absent answer is reused this long.
  double probe_rate = 20;
  std::chrono::milliseconds probe_negative_ttl{200};
  // --prefix: only the models under this model path ("acme", "acme/qwen") are shown, listed
  // (one listing of models/<prefix>/) and probed; paths stay those of the whole bucket, so
  // MNT/acme/qwen@v3 is the same path on every node whatever it mounts. "": every model.
  std::string prefix;
};

// A node's attributes as a FUSE reply needs them (copied out under the lock).
struct NodeAttr {
  uint64_t ino = 0;
  struct stat st {};
  double timeout_s = 0;  // for both the attributes and the directory entry
  // The attributes' own, when it differs (negative: timeout_s). A draft's nodes keep their
  // names uncached (a commit gives the name to the published version) but their attributes
  // change only through this mount, which the kernel sees.
  double attr_timeout_s = -1;
  double AttrTimeout() const { return attr_timeout_s >= 0 ? attr_timeout_s : timeout_s; }
};

struct DirEntry {
  std::string name;
  uint64_t ino = 0;
  mode_t type = 0;  // S_IFDIR, S_IFREG or S_IFLNK
};

// A file of a published version, as the read path needs it: `file` (with its rows loaded)
// points into `rows`, which keeps it alive with `manifest`.
struct VersionFile {
  std::shared_ptr<const Manifest> manifest;
  const ManifestFile* file = nullptr;
  std::shared_ptr<const ManifestFile> rows;
};

class Namespace {
 public:
  static constexpr uint64_t kRootIno = 1;

  // `bucket` must outlive the Namespace.
  Namespace(Bucket* bucket, NamespaceOptions options);
  ~Namespace();
  Namespace(const Namespace&) = delete;
  Namespace& operator=(const Namespace&) = delete;

  // Errors: NotFound (no such entry / inode), InvalidArgument for ENOTDIR-like misuse is
  // reported as NotFound too; bucket failures keep their kind.
  Expected<NodeAttr> Lookup(uint64_t parent, std::string_view name);
  Expected<NodeAttr> GetAttr(uint64_t ino);
  // Attributes of several nodes; manifests they need are read in parallel. A node whose
  // attributes cannot be had is left out (and logged).
  std::vector<NodeAttr> GetAttrs(std::span<const uint64_t> inos);
  Expected<std::string> ReadLink(uint64_t ino);
  // "." and ".." first, then the entries in name order.
  Expected<std::vector<DirEntry>> ReadDir(uint64_t ino);
  Expected<VersionFile> Open(uint64_t ino);

  // Extended attributes (user.weightfs.*) of version directories and their files.
  // NotFound when the node has no such attribute (ENODATA to the caller).
  Expected<std::string> GetXattr(uint64_t ino, std::string_view name);
  Expected<std::vector<std::string>> ListXattr(uint64_t ino);

  // The path of a directory above the versions ("" for the root, "acme", "acme/sub"): where
  // drafts and new model directories can be made. nullopt for any other node.
  std::optional<std::string> DirPath(uint64_t ino) const;
  bool IsDirectory(uint64_t ino) const;
  // A published version's directory: its model and version (the patch view hangs under it).
  // nullopt for any other node.
  std::optional<std::pair<std::string, std::string>> VersionOf(uint64_t ino) const;
  // True for version directories and everything in them: they never change.
  bool IsImmutable(uint64_t ino) const;
  size_t inode_count() const;
  // Forces the next directory access to re-list the bucket.
  void Invalidate();
  // A version this mount has just published (a draft's commit): shown at once, before the
  // draft that held its name goes, so its path never answers ENOENT in between; a listing that
  // began before the publish does not remove it.
  void AddPublished(std::shared_ptr<const Manifest> manifest);
  // The newest version of the model of `ino` (a version directory, or the name@latest link; the
  // kernel allows user.* attributes on directories only), from a listing of
  // that model's versions made now (one listing of its time markers), unless one was made less
  // than 1/probe_rate s ago (then that one's). New versions it finds are shown at once.
  Expected<std::string> NewestVersion(uint64_t ino);

 private:
  enum class Kind : uint8_t { kDir, kVersionDir, kVersionSubdir, kFile, kLatestLink };
  static bool IsDir(Kind k) {
    return k == Kind::kDir || k == Kind::kVersionDir || k == Kind::kVersionSubdir;
  }

  struct VersionSummary {
    int64_t created_ms = 0;
    std::optional<std::string> parent;
    uint64_t stored_bytes = 0;
    double changed_fraction = 0;
    uint32_t top_subdirs = 0;  // directories directly inside the version
  };

  struct Node {
    uint64_t ino = 0;
    Kind kind = Kind::kDir;
    uint64_t parent = 0;
    std::string name;
    std::string model;    // kVersionDir, kLatestLink: the model; kDir: its path ("" for the root)
    std::string version;  // kVersionDir
    // kDir: changes when its entries do. Others use their version's creation time.
    int64_t mtime_ms = 0;
    std::map<std::string, uint64_t, std::less<>> children;  // directories
    uint32_t subdirs = 0;                                    // directories among children
    // kVersionDir: its creation time from the listing (the version's time marker) — enough
    // for its attributes, so `ls -l` of a model's directory reads no manifest; the summary
    // once read (xattrs, a version without a marker); the manifest once its contents are built.
    std::optional<int64_t> listed_created_ms;
    std::optional<VersionSummary> summary;
    bool contents_built = false;
    // kVersionSubdir, kFile, and kVersionDir once built: the version's manifest.
    std::shared_ptr<const Manifest> manifest;
    const ManifestFile* file = nullptr;  // kFile
    uint64_t version_ino = 0;            // kVersionSubdir, kFile: their version directory
  };

  // A model's versions and its name@latest link.
  struct Model {
    uint64_t dir = 0;        // directory holding "leaf@version" entries
    std::string leaf;        // last component of the model name
    std::map<std::string, uint64_t> versions;  // version name -> version directory
    uint64_t link = 0;       // the name@latest node (0 until first needed)
    std::string latest;      // "leaf@version", valid when latest_generation == generation
    uint64_t generation = 0;         // bumped when `versions` changes
    uint64_t latest_generation = ~0ull;
  };

  // These take mu_ themselves and do bucket I/O without it.
  Status RefreshIfStale() WFS_EXCLUDES(mu_);
  // `name` ("leaf@version") in directory `dir` is not listed: is it a version published since?
  // True when it was found (and added).
  Expected<bool> Probe(uint64_t dir, std::string_view name) WFS_EXCLUDES(mu_);
  Status EnsureSummaries(std::span<const uint64_t> version_inos) WFS_EXCLUDES(mu_);
  Status EnsureContents(uint64_t version_ino) WFS_EXCLUDES(mu_);
  // `old`, a head the nodes hold, checked against the bucket: when it was rewritten in place
  // (gc's rebase: same files and bytes, new rows), every node holding it takes the new head,
  // which is returned; NotFound when it was not.
  Expected<std::shared_ptr<const Manifest>> TakeRewrittenHead(const Manifest& old) WFS_EXCLUDES(mu_);
  Expected<std::string> EnsureLatest(const std::string& model) WFS_EXCLUDES(mu_);
  // What a node's attributes depend on (summary, latest target), loaded.
  Status EnsureAttrInputs(uint64_t ino) WFS_EXCLUDES(mu_);

  // With mu_ held.
  Node* NodeLocked(uint64_t ino) const WFS_REQUIRES(mu_);
  Node& NewNodeLocked(Kind kind, uint64_t parent, std::string name) WFS_REQUIRES(mu_);
  void AddChildLocked(Node& dir, const std::string& name, uint64_t child) WFS_REQUIRES(mu_);
  void RemoveChildLocked(Node& dir, const std::string& name) WFS_REQUIRES(mu_);
  uint64_t DirForModelLocked(const std::string& model, std::string* leaf) WFS_REQUIRES(mu_);
  // `listing_seq`: publish_seq_ when the listing began.
  void ApplyListingLocked(const std::vector<VersionInfo>& versions, uint64_t listing_seq) WFS_REQUIRES(mu_);
  // The version's directory node (made if new). `created_ms`: from its time marker.
  uint64_t AddVersionLocked(const std::string& model, const std::string& version,
                            std::optional<int64_t> created_ms = std::nullopt) WFS_REQUIRES(mu_);
  // A version directory's creation time, if known without reading anything.
  static std::optional<int64_t> CreatedMs(const Node& n) {
    if (n.summary) return n.summary->created_ms;
    return n.listed_created_ms;
  }
  void UpdateLatestLinkLocked(const std::string& name, Model& m) WFS_REQUIRES(mu_);
  // Shows a version found outside a listing (a probe, a model's re-listing), protected from a
  // listing that began before it like AddPublished's.
  void AddFoundLocked(const std::string& model, const std::string& version, std::optional<int64_t> created_ms)
      WFS_REQUIRES(mu_);
  // One probe's worth of the rate (token bucket, burst of one second's worth).
  bool TakeProbeTokenLocked() WFS_REQUIRES(mu_);
  void BuildContentsLocked(Node& version, std::shared_ptr<const Manifest> manifest) WFS_REQUIRES(mu_);
  Status FillAttrLocked(const Node& node, NodeAttr* out) const WFS_REQUIRES(mu_);
  int64_t VersionTimeLocked(const Node& node) const WFS_REQUIRES(mu_);

  static VersionSummary Summarize(const Manifest& m);
  int64_t NowMs() const;

  Bucket* const bucket_;
  const NamespaceOptions options_;
  const int64_t start_ms_;

  // Lock order: mu_ is a leaf (nothing else is acquired under it); never held across bucket
  // I/O or a FUSE reply.
  mutable Mutex mu_;
  std::vector<std::unique_ptr<Node>> nodes_ WFS_GUARDED_BY(mu_);  // nodes_[ino - 1]
  std::map<std::string, Model> models_ WFS_GUARDED_BY(mu_);
  // Refresh: one listing at a time; the others serve the previous listing (or wait for the
  // first one).
  bool listed_ WFS_GUARDED_BY(mu_) = false;
  bool refreshing_ WFS_GUARDED_BY(mu_) = false;
  bool invalidated_ WFS_GUARDED_BY(mu_) = false;
  std::chrono::steady_clock::time_point listed_at_ WFS_GUARDED_BY(mu_);
  Status last_refresh_ WFS_GUARDED_BY(mu_);
  // Versions published through AddPublished ("model@version" -> publish_seq_ then).
  std::map<std::string, uint64_t> published_ WFS_GUARDED_BY(mu_);
  uint64_t publish_seq_ WFS_GUARDED_BY(mu_) = 0;
  CondVar refreshed_;
  // Probes: "model@version" found absent -> when (bounded: oldest dropped beyond kMaxAbsent).
  std::map<std::string, std::chrono::steady_clock::time_point> absent_ WFS_GUARDED_BY(mu_);
  double probe_tokens_ WFS_GUARDED_BY(mu_) = 0;
  std::chrono::steady_clock::time_point tokens_at_ WFS_GUARDED_BY(mu_);
  // NewestVersion: model -> when its versions were last re-listed, and the newest then.
  std::map<std::string, std::pair<std::chrono::steady_clock::time_point, std::string>> model_listed_ WFS_GUARDED_BY(mu_);
  static constexpr size_t kMaxAbsent = 4096;
};

}  // namespace weightfs

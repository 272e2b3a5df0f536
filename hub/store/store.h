// Store: a bucket of immutable-ish objects addressed by key — the one interface weightfs needs
// from a local directory, an HTTP/WebDAV server, S3 or a Hugging Face bucket.
//
// Keys are relative paths ("models/acme/qwen/versions/v1.json", "packs/ab12..."): non-empty
// '/'-separated components of [A-Za-z0-9._@=+-], no "." or ".." components, at most 1024
// bytes. ValidateKey enforces that wherever a key comes from outside.
//
// Errors carry a kind (NotFound, Conflict, Timeout, Auth, Corruption, IOError), the key and
// the backend's message; never credentials. Implementations are thread-safe: any number of
// threads may call any method concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/bytes.h"
#include "core/status.h"

namespace weightfs {

struct ByteRange {
  uint64_t offset = 0;
  std::optional<uint64_t> length;  // nullopt: to the end of the object
};

struct ObjectInfo {
  std::string key;
  uint64_t size = 0;
  int64_t modified_ms = 0;  // from List: last modification, Unix ms by the store's clock; 0: unknown
};

struct ListPage {
  std::vector<ObjectInfo> objects;  // sorted by key
  std::string continuation;         // empty when this is the last page
};

// An object a write left under the store's temporary prefix (Store::ListTemporaries).
struct TemporaryObject {
  std::string key;          // ".weightfs-tmp/<name>", as Delete takes it
  uint64_t size = 0;
  int64_t modified_ms = 0;  // last modification, Unix ms by the store's clock; 0: unknown
};

enum class PutMode {
  kOverwrite,       // replace any existing object
  kCreateIfAbsent,  // fail with Conflict if the key exists (manifests: exactly one writer wins)
};

class Store {
 public:
  virtual ~Store() = default;

  // The object's bytes, or the requested range of them (a range past the end is clipped; an
  // offset past the end is InvalidArgument).
  virtual Expected<std::vector<uint8_t>> Get(std::string_view key,
                                             std::optional<ByteRange> range = std::nullopt) = 0;
  // Get into the caller's buffer (resized to the bytes read): a store that reads in place
  // (local files) skips the zero-filled vector, its page faults and a copy; a chain's payloads
  // go into reused buffers. The default calls Get and copies.
  virtual Status GetInto(std::string_view key, ByteRange range, ByteBuffer* out);
  // Get from the bucket itself, past any cache of its objects in between (a shared tier:
  // hub/engine/shared_tier.h): for a read that must see an object rewritten in place since
  // (Bucket::Revalidate). The default is Get.
  virtual Expected<std::vector<uint8_t>> GetUncached(std::string_view key,
                                                     std::optional<ByteRange> range = std::nullopt) {
    return Get(key, range);
  }
  // Stores `data` under `key`. Readers never see a partially written object.
  virtual Status Put(std::string_view key, std::span<const uint8_t> data,
                     PutMode mode = PutMode::kOverwrite) = 0;
  virtual Expected<ObjectInfo> Head(std::string_view key) = 0;
  // Objects whose key starts with `prefix`, in key order, at most `max_keys` per page; pass
  // the previous page's continuation to get the next.
  virtual Expected<ListPage> List(std::string_view prefix, std::string_view continuation = {},
                                  size_t max_keys = 1000) = 0;
  // Removes the object; NotFound if there is none.
  virtual Status Delete(std::string_view key) = 0;
  // What writes left behind: a store whose Put uploads to a temporary key and then renames it
  // into place (LocalStore, WebDavStore: under `.weightfs-tmp/`) leaves the temporary object
  // when the writer dies in between. They are never part of List; Delete(key) removes one (gc
  // does, once they are old enough: hub/engine/gc.h). Default: none (S3 writes in one request).
  virtual Expected<std::vector<TemporaryObject>> ListTemporaries();
  // The bucket's address for messages (never with credentials).
  virtual std::string Describe() const = 0;
};

// InvalidArgument naming the rule a key breaks, or OK.
Status ValidateKey(std::string_view key);

}  // namespace weightfs

// LocalStore: a bucket in a local or shared-filesystem directory (`file:///path` or a plain
// path) — the embedded default.
//
// Every write goes to a temporary file under <root>/.weightfs-tmp/, is fsynced, then renamed
// into place (overwrite) or hard-linked (create-if-absent: link() fails with EEXIST when the key
// exists, which is atomic on POSIX filesystems including NFSv3+), and the parent directory is
// fsynced. Readers therefore see either the old object, the new one, or none; never a prefix.
// Thread-safe and safe for several processes sharing the directory.
#pragma once

#include <memory>
#include <string>

#include "hub/store/store.h"

namespace weightfs {

class LocalStore : public Store {
 public:
  // `root` must exist and be a directory.
  static Expected<std::unique_ptr<LocalStore>> Open(const std::string& root);

  Expected<std::vector<uint8_t>> Get(std::string_view key,
                                     std::optional<ByteRange> range = std::nullopt) override;
  Status GetInto(std::string_view key, ByteRange range, ByteBuffer* out) override;
  Status Put(std::string_view key, std::span<const uint8_t> data,
             PutMode mode = PutMode::kOverwrite) override;
  Expected<ObjectInfo> Head(std::string_view key) override;
  Expected<ListPage> List(std::string_view prefix, std::string_view continuation = {},
                          size_t max_keys = 1000) override;
  Status Delete(std::string_view key) override;
  Expected<std::vector<TemporaryObject>> ListTemporaries() override;
  std::string Describe() const override;

 private:
  explicit LocalStore(std::string root) : root_(std::move(root)) {}
  std::string PathOf(std::string_view key) const;
  // Get's read into a vector or a ByteBuffer (no zero-fill).
  template <typename Buffer>
  Status ReadRange(std::string_view key, std::optional<ByteRange> range, Buffer* out);

  const std::string root_;  // absolute, without a trailing slash
};

}  // namespace weightfs

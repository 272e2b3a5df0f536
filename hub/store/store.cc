#include "hub/store/store.h"

namespace weightfs {

Status Store::GetInto(std::string_view key, ByteRange range, ByteBuffer* out) {
  WFS_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, Get(key, range));
  out->assign(bytes.begin(), bytes.end());
  return Status::Ok();
}

Expected<std::vector<TemporaryObject>> Store::ListTemporaries() { return std::vector<TemporaryObject>{}; }

Status ValidateKey(std::string_view key) {
  auto bad = [&](const char* rule) {
    std::string shown(key.substr(0, 80));
    for (char& c : shown) {
      if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7e) c = '?';
    }
    return Status::InvalidArgument("invalid key '" + shown + "': " + rule);
  };
  if (key.empty()) return bad("empty");
  if (key.size() > 1024) return bad("longer than 1024 bytes");
  if (key.front() == '/') return bad("absolute");
  size_t start = 0;
  while (start <= key.size()) {
    size_t end = key.find('/', start);
    if (end == std::string_view::npos) end = key.size();
    const std::string_view part = key.substr(start, end - start);
    if (part.empty()) return bad("empty path component");
    if (part == "." || part == "..") return bad("'.' or '..' component");
    for (char c : part) {
      const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                      c == '.' || c == '_' || c == '-' || c == '@' || c == '=' || c == '+';
      if (!ok) return bad("character outside [A-Za-z0-9._@=+-]");
    }
    start = end + 1;
  }
  return Status::Ok();
}

}  // namespace weightfs

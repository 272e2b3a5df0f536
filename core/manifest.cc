#include "core/manifest.h"

#include <zstd.h>

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <set>

#include <nlohmann/json.hpp>

#include "core/file_codec.h"

namespace weightfs {
namespace {

using json = nlohmann::json;

constexpr size_t kCompressAbove = 64 << 10;
constexpr uint64_t kMaxManifestBytes = 1ull << 30;  // decompressed
constexpr uint64_t kMaxFileSize = 1ull << 50;
constexpr uint32_t kMaxDepth = 100000;
constexpr uint64_t kMaxPayloadBytes = 2 * kMaxChunkBytes + 4096;

bool NameChar(char c, bool path) {
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) return true;
  if (c == '.' || c == '_' || c == '-') return true;
  return path && (c == '@' || c == '=' || c == '+');
}

Status ValidateComponents(std::string_view what, std::string_view s, size_t max_len, bool path,
                          bool allow_slash) {
  if (s.empty()) return Status::InvalidArgument(std::string(what) + " is empty");
  if (s.size() > max_len) {
    return Status::InvalidArgument(std::string(what) + " is longer than " +
                                   std::to_string(max_len) + " bytes");
  }
  size_t start = 0;
  while (true) {
    size_t slash = allow_slash ? s.find('/', start) : std::string_view::npos;
    std::string_view comp = s.substr(start, slash == std::string_view::npos ? s.npos : slash - start);
    if (comp.empty() || comp == "." || comp == "..") {
      return Status::InvalidArgument(std::string(what) + " '" + std::string(s) +
                                     "' has an empty, '.' or '..' component");
    }
    for (char c : comp) {
      if (!NameChar(c, path)) {
        return Status::InvalidArgument(std::string(what) + " '" + std::string(s) +
                                       "' contains a character outside [A-Za-z0-9._-" +
                                       (path ? "@=+" : "") + "]");
      }
    }
    if (slash == std::string_view::npos) break;
    start = slash + 1;
  }
  return Status::Ok();
}

// A name inside a manifest that fails validation is damaged data from the bucket (Corruption,
// EIO to a reader), not a caller's mistake (InvalidArgument, EINVAL).
Status AsCorruption(const Status& s) { return s.ok() ? s : Status::Corruption(s.message()); }

bool IsHex(std::string_view s, size_t n) {
  if (s.size() != n) return false;
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

// Typed accessors that turn a missing or mistyped field into a Corruption status.
Expected<uint64_t> U64(const json& j, const char* what) {
  if (!j.is_number_unsigned()) {
    if (j.is_number_integer() && j.get<int64_t>() >= 0) return static_cast<uint64_t>(j.get<int64_t>());
    return Status::Corruption(std::string(what) + " is not a non-negative integer");
  }
  return j.get<uint64_t>();
}

Expected<std::string> Str(const json& j, const char* what) {
  if (!j.is_string()) return Status::Corruption(std::string(what) + " is not a string");
  return j.get<std::string>();
}

const json* Field(const json& obj, const char* name) {
  auto it = obj.find(name);
  return it == obj.end() ? nullptr : &*it;
}

Expected<std::vector<uint8_t>> Decompress(std::span<const uint8_t> bytes) {
  unsigned long long size = ZSTD_getFrameContentSize(bytes.data(), bytes.size());
  if (size == ZSTD_CONTENTSIZE_ERROR || size == ZSTD_CONTENTSIZE_UNKNOWN) {
    return Status::Corruption("manifest: not a valid zstd frame");
  }
  if (size > kMaxManifestBytes) return Status::ResourceExhausted("manifest larger than 1 GiB");
  // The declared size is a claim, and it sizes the allocation below. Every block that yields
  // output costs at least 4 bytes (3 of header) and yields at most 128 KiB, so no frame expands
  // more than 32768x: a 20-byte frame claiming 1 GiB is refused here instead of costing 1 GiB.
  if (size > static_cast<uint64_t>(bytes.size()) * 32768) {
    return Status::Corruption("manifest: zstd frame of " + std::to_string(bytes.size()) +
                              " bytes claims " + std::to_string(size) + " bytes");
  }
  std::vector<uint8_t> out(size);
  size_t n = ZSTD_decompress(out.data(), out.size(), bytes.data(), bytes.size());
  if (ZSTD_isError(n) || n != size) return Status::Corruption("manifest: zstd frame does not decode");
  return out;
}

Status ParseChunkRow(const json& row, const Manifest& m, ManifestChunk* c) {
  if (!row.is_array() || row.size() != 14) return Status::Corruption("chunk row is not an array of 14");
  WFS_ASSIGN_OR_RETURN(c->key.tensor, Str(row[0], "chunk tensor"));
  WFS_ASSIGN_OR_RETURN(c->key.index, U64(row[1], "chunk index"));
  WFS_ASSIGN_OR_RETURN(c->offset, U64(row[2], "chunk offset"));
  WFS_ASSIGN_OR_RETURN(c->length, U64(row[3], "chunk length"));
  WFS_ASSIGN_OR_RETURN(std::string hash, Str(row[4], "chunk hash"));
  WFS_ASSIGN_OR_RETURN(c->hash, Hash128::FromHex(hash));
  WFS_ASSIGN_OR_RETURN(uint64_t enc, U64(row[5], "chunk encoding"));
  WFS_ASSIGN_OR_RETURN(uint64_t pack, U64(row[6], "chunk pack"));
  WFS_ASSIGN_OR_RETURN(c->ref.offset, U64(row[7], "chunk pack offset"));
  WFS_ASSIGN_OR_RETURN(c->ref.length, U64(row[8], "chunk pack length"));
  WFS_ASSIGN_OR_RETURN(uint64_t origin, U64(row[9], "chunk origin"));
  WFS_ASSIGN_OR_RETURN(uint64_t base, U64(row[10], "chunk base"));
  WFS_ASSIGN_OR_RETURN(uint64_t depth, U64(row[11], "chunk depth"));
  WFS_ASSIGN_OR_RETURN(c->chain_bytes, U64(row[12], "chunk chain bytes"));
  WFS_ASSIGN_OR_RETURN(c->keyframe_bytes, U64(row[13], "chunk keyframe bytes"));
  if (c->key.tensor.size() > 4096) return Status::Corruption("tensor name longer than 4096 bytes");
  if (enc < 1 || enc > 6) return Status::Corruption("unknown chunk encoding " + std::to_string(enc));
  c->encoding = static_cast<ChunkEncoding>(enc);
  if (c->length == 0 || c->length > kMaxChunkBytes) {
    return Status::Corruption("chunk length " + std::to_string(c->length) + " out of range");
  }
  if (c->is_external()) {
    if (pack >= m.sources.size()) {
      return Status::Corruption("chunk names source " + std::to_string(pack) + " of " + std::to_string(m.sources.size()));
    }
    if (c->ref.length != c->length || c->ref.offset > kMaxFileSize) {
      return Status::Corruption("external chunk's source range out of bounds");
    }
  } else {
    if (pack >= m.packs.size()) return Status::Corruption("chunk names pack " + std::to_string(pack) + " of " + std::to_string(m.packs.size()));
    if (c->ref.length < kPayloadHeaderBytes || c->ref.length > kMaxPayloadBytes ||
        c->ref.offset > (1ull << 48)) {
      return Status::Corruption("chunk payload range out of bounds");
    }
  }
  c->ref.pack = static_cast<uint32_t>(pack);
  if (origin >= m.versions.size()) return Status::Corruption("chunk origin out of range");
  if (depth > kMaxDepth) return Status::Corruption("chunk chain depth out of range");
  // No chain holds more than kMaxDepth payloads of kMaxPayloadBytes; larger counts would wrap
  // KeyframePolicy's sum (and the writer's) around u64.
  if (c->chain_bytes > kMaxDepth * kMaxPayloadBytes) {
    return Status::Corruption("chunk chain bytes out of range");
  }
  if (c->keyframe_bytes > kMaxPayloadBytes) {
    return Status::Corruption("chunk keyframe bytes out of range");
  }
  c->origin = static_cast<uint32_t>(origin);
  c->depth = static_cast<uint32_t>(depth);
  if (c->is_delta()) {
    if (base == 0 || base >= m.versions.size()) return Status::Corruption("delta chunk's base version out of range");
    if (depth == 0) return Status::Corruption("delta chunk with depth 0");
    c->base = static_cast<uint32_t>(base);
  } else {
    if (base != 0 || depth != 0) return Status::Corruption("keyframe chunk with a base");
    c->base = 0;
  }
  return Status::Ok();
}

Status ParseFile(const json& jf, const Manifest& m, ManifestFile* f) {
  if (!jf.is_object()) return Status::Corruption("file entry is not an object");
  const json* path = Field(jf, "path");
  if (!path) return Status::Corruption("file entry without a path");
  WFS_ASSIGN_OR_RETURN(f->path, Str(*path, "file path"));
  WFS_TRY(AsCorruption(ValidateFilePath(f->path)));  // the caller adds "manifest M@V"
  auto ctx = [&](const Status& s) { return s.WithContext("file '" + f->path + "'"); };
  const json* size = Field(jf, "size");
  const json* sha = Field(jf, "sha256");
  const json* chunks = Field(jf, "chunks");
  if (!size || !sha || !chunks || !chunks->is_array()) return ctx(Status::Corruption("missing size, sha256 or chunks"));
  Expected<uint64_t> sz = U64(*size, "size");
  if (!sz.ok()) return ctx(sz.status());
  f->size = *sz;
  if (f->size > kMaxFileSize) return ctx(Status::Corruption("file size out of range"));
  Expected<std::string> sh = Str(*sha, "sha256");
  if (!sh.ok() || !IsHex(*sh, 64)) return ctx(Status::Corruption("sha256 is not 64 lowercase hex digits"));
  f->sha256 = *sh;
  if (chunks->size() > f->size) return ctx(Status::Corruption("more chunks than bytes"));
  f->chunks.resize(chunks->size());
  uint64_t pos = 0;
  std::set<ChunkKey> keys;
  for (size_t i = 0; i < chunks->size(); ++i) {
    ManifestChunk& c = f->chunks[i];
    Status s = ParseChunkRow((*chunks)[i], m, &c);
    if (!s.ok()) return ctx(s.WithContext("chunk " + std::to_string(i)));
    if (c.offset != pos) return ctx(Status::Corruption("chunk " + std::to_string(i) + " does not start where the previous one ends"));
    pos += c.length;
    if (pos > f->size) return ctx(Status::Corruption("chunks extend past the file size"));
    if (!keys.insert(c.key).second) return ctx(Status::Corruption("duplicate chunk key " + DescribeChunk(c.key)));
  }
  if (pos != f->size) return ctx(Status::Corruption("chunks do not cover the file"));
  return Status::Ok();
}

}  // namespace

std::optional<size_t> ManifestFile::FindChunk(const ChunkKey& key) const {
  // Chunks of one tensor are contiguous and in index order; a linear scan would be O(n) per
  // lookup, so callers that pair whole files build a map. This is for single lookups.
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (chunks[i].key == key) return i;
  }
  return std::nullopt;
}

size_t ManifestFile::ChunkAt(uint64_t offset) const {
  auto it = std::upper_bound(chunks.begin(), chunks.end(), offset,
                             [](uint64_t off, const ManifestChunk& c) { return off < c.offset; });
  return static_cast<size_t>(it - chunks.begin()) - 1;
}

const ManifestFile* Manifest::FindFile(std::string_view path) const {
  auto it = std::lower_bound(files.begin(), files.end(), path,
                             [](const ManifestFile& f, std::string_view p) { return f.path < p; });
  return it != files.end() && it->path == path ? &*it : nullptr;
}

uint32_t Manifest::VersionIndex(const std::string& name) {
  for (size_t i = 0; i < versions.size(); ++i) {
    if (versions[i] == name) return static_cast<uint32_t>(i);
  }
  versions.push_back(name);
  return static_cast<uint32_t>(versions.size() - 1);
}

uint32_t Manifest::SourceIndex(const std::string& source) {
  for (size_t i = sources.size(); i-- > 0;) {
    if (sources[i] == source) return static_cast<uint32_t>(i);
  }
  sources.push_back(source);
  return static_cast<uint32_t>(sources.size() - 1);
}

uint32_t Manifest::PackIndex(const Hash128& pack) {
  for (size_t i = packs.size(); i-- > 0;) {
    if (packs[i] == pack) return static_cast<uint32_t>(i);
  }
  packs.push_back(pack);
  return static_cast<uint32_t>(packs.size() - 1);
}

std::vector<uint8_t> SerializeManifest(const Manifest& m) {
  json j;
  j["format"] = kManifestFormat;
  j["model"] = m.model;
  j["version"] = m.version;
  j["parent"] = m.parent ? json(*m.parent) : json(nullptr);
  j["created"] = m.created;
  j["chunk_bytes"] = m.chunk_bytes;
  j["versions"] = m.versions;
  json packs = json::array();
  for (const Hash128& p : m.packs) packs.push_back(p.ToHex());
  j["packs"] = std::move(packs);
  if (!m.sources.empty()) j["sources"] = m.sources;
  j["stats"] = {{"logical_bytes", m.stats.logical_bytes},
                {"stored_bytes", m.stats.stored_bytes},
                {"changed_elements", m.stats.changed_elements},
                {"elements", m.stats.elements}};
  json files = json::array();
  for (const ManifestFile& f : m.files) {
    json rows = json::array();
    for (const ManifestChunk& c : f.chunks) {
      rows.push_back(json::array({c.key.tensor, c.key.index, c.offset, c.length, c.hash.ToHex(),
                                  static_cast<int>(c.encoding), c.ref.pack, c.ref.offset,
                                  c.ref.length, c.origin, c.base, c.depth, c.chain_bytes,
                                  c.keyframe_bytes}));
    }
    files.push_back({{"path", f.path}, {"size", f.size}, {"sha256", f.sha256}, {"chunks", std::move(rows)}});
  }
  j["files"] = std::move(files);
  std::string text = j.dump();
  if (text.size() <= kCompressAbove) return std::vector<uint8_t>(text.begin(), text.end());
  std::vector<uint8_t> out(ZSTD_compressBound(text.size()));
  size_t n = ZSTD_compress(out.data(), out.size(), text.data(), text.size(), 6);
  out.resize(ZSTD_isError(n) ? 0 : n);
  if (out.empty()) return std::vector<uint8_t>(text.begin(), text.end());
  return out;
}

Expected<Manifest> ParseManifest(std::span<const uint8_t> bytes, std::string_view expected_model,
                                 std::string_view expected_version) {
  std::vector<uint8_t> inflated;
  if (bytes.size() >= 4 && bytes[0] == 0x28 && bytes[1] == 0xB5 && bytes[2] == 0x2F &&
      bytes[3] == 0xFD) {
    WFS_ASSIGN_OR_RETURN(inflated, Decompress(bytes));
    bytes = inflated;
  }
  if (bytes.size() > kMaxManifestBytes) return Status::ResourceExhausted("manifest larger than 1 GiB");
  json j = json::parse(bytes.begin(), bytes.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Status::Corruption("manifest is not a JSON object");
  const json* format = Field(j, "format");
  if (!format || !format->is_number_integer()) return Status::Corruption("manifest has no format");
  if (format->get<int64_t>() != kManifestFormat) {
    return Status::Unsupported("manifest format " + format->dump() +
                               " (this weightfs reads format 1; upgrade weightfs)");
  }
  Manifest m;
  for (const char* name : {"model", "version", "created", "chunk_bytes", "versions", "packs", "files"}) {
    if (!Field(j, name)) return Status::Corruption(std::string("manifest has no '") + name + "'");
  }
  WFS_ASSIGN_OR_RETURN(m.model, Str(j["model"], "model"));
  WFS_ASSIGN_OR_RETURN(m.version, Str(j["version"], "version"));
  WFS_TRY(AsCorruption(ValidateModelName(m.model)).WithContext("manifest"));
  WFS_TRY(AsCorruption(ValidateVersionName(m.version)).WithContext("manifest"));
  if (!expected_model.empty() && m.model != expected_model) {
    return Status::Corruption("manifest names model '" + m.model + "' but is stored under '" + std::string(expected_model) + "'");
  }
  if (!expected_version.empty() && m.version != expected_version) {
    return Status::Corruption("manifest names version '" + m.version + "' but is stored under '" + std::string(expected_version) + "'");
  }
  auto ctx = [&](const Status& s) { return s.WithContext("manifest " + m.model + "@" + m.version); };
  if (const json* p = Field(j, "parent"); p && !p->is_null()) {
    Expected<std::string> parent = Str(*p, "parent");
    if (!parent.ok()) return ctx(parent.status());
    WFS_TRY(ctx(AsCorruption(ValidateVersionName(*parent))));
    if (*parent == m.version) return ctx(Status::Corruption("version is its own parent"));
    m.parent = *parent;
  }
  Expected<std::string> created = Str(j["created"], "created");
  if (!created.ok()) return ctx(created.status());
  m.created = *created;
  Expected<int64_t> when = ParseUtc(m.created);
  if (!when.ok()) return ctx(when.status());
  m.created_ms = *when;
  Expected<uint64_t> cb = U64(j["chunk_bytes"], "chunk_bytes");
  if (!cb.ok()) return ctx(cb.status());
  if (*cb == 0 || *cb > kMaxChunkBytes) return ctx(Status::Corruption("chunk_bytes out of range"));
  m.chunk_bytes = *cb;
  const json& versions = j["versions"];
  if (!versions.is_array() || versions.empty() || versions.size() > 1000000) {
    return ctx(Status::Corruption("versions is not a non-empty array"));
  }
  std::set<std::string> seen;
  for (const json& v : versions) {
    Expected<std::string> name = Str(v, "versions entry");
    if (!name.ok()) return ctx(name.status());
    WFS_TRY(ctx(AsCorruption(ValidateVersionName(*name))));
    if (!seen.insert(*name).second) return ctx(Status::Corruption("duplicate entry in versions"));
    m.versions.push_back(*name);
  }
  if (m.versions[0] != m.version) return ctx(Status::Corruption("versions[0] is not the version itself"));
  const json& packs = j["packs"];
  if (!packs.is_array()) return ctx(Status::Corruption("packs is not an array"));
  for (const json& p : packs) {
    Expected<std::string> hex = Str(p, "pack");
    if (!hex.ok() || !IsHex(*hex, 32)) return ctx(Status::Corruption("pack name is not 32 hex digits"));
    m.packs.push_back(*Hash128::FromHex(*hex));
  }
  if (const json* sources = Field(j, "sources")) {
    if (!sources->is_array() || sources->size() > 1000000) return ctx(Status::Corruption("sources is not an array"));
    std::set<std::string> seen_sources;
    for (const json& src : *sources) {
      Expected<std::string> name = Str(src, "source");
      if (!name.ok()) return ctx(name.status());
      WFS_TRY(ctx(AsCorruption(ValidateSourceName(*name))));
      if (!seen_sources.insert(*name).second) return ctx(Status::Corruption("duplicate entry in sources"));
      m.sources.push_back(*name);
    }
  }
  if (const json* st = Field(j, "stats"); st && st->is_object()) {
    auto get = [&](const char* name, uint64_t* out) {
      if (const json* v = Field(*st, name)) {
        if (Expected<uint64_t> x = U64(*v, name); x.ok()) *out = *x;
      }
    };
    get("logical_bytes", &m.stats.logical_bytes);
    get("stored_bytes", &m.stats.stored_bytes);
    get("changed_elements", &m.stats.changed_elements);
    get("elements", &m.stats.elements);
  }
  const json& files = j["files"];
  if (!files.is_array()) return ctx(Status::Corruption("files is not an array"));
  m.files.resize(files.size());
  for (size_t i = 0; i < files.size(); ++i) {
    WFS_TRY(ctx(ParseFile(files[i], m, &m.files[i])));
    if (i > 0 && !(m.files[i - 1].path < m.files[i].path)) {
      return ctx(Status::Corruption("files are not sorted by path or repeat one"));
    }
  }
  // A file path must not also be a directory of another file ("a" and "a/b").
  for (size_t i = 1; i < m.files.size(); ++i) {
    const std::string& prev = m.files[i - 1].path;
    for (size_t k = i; k < m.files.size() && m.files[k].path.compare(0, prev.size(), prev) == 0; ++k) {
      if (m.files[k].path.size() > prev.size() && m.files[k].path[prev.size()] == '/') {
        return ctx(Status::Corruption("'" + prev + "' is both a file and a directory"));
      }
    }
  }
  return m;
}

Status ValidateModelName(std::string_view model) {
  return ValidateComponents("model name", model, 256, /*path=*/false, /*allow_slash=*/true);
}

Status ValidateVersionName(std::string_view version) {
  return ValidateComponents("version name", version, 128, /*path=*/false, /*allow_slash=*/false);
}

Status ValidateFilePath(std::string_view path) {
  return ValidateComponents("file path", path, 1024, /*path=*/true, /*allow_slash=*/true);
}

Status ValidateSourceName(std::string_view source) {
  constexpr std::string_view kScheme = "hf://";
  auto bad = [&](const std::string& why) {
    return Status::InvalidArgument("source '" + std::string(source.substr(0, 200)) + "': " + why);
  };
  if (!source.starts_with(kScheme)) return bad("does not start with hf://");
  std::string_view rest = source.substr(kScheme.size());
  const size_t at = rest.find('@');
  if (at == std::string_view::npos) return bad("names no @COMMIT");
  std::string_view repo = rest.substr(0, at);
  if (repo.starts_with("buckets/") || repo.starts_with("datasets/") || repo.starts_with("spaces/")) {
    return bad("is not a model repo");
  }
  if (std::count(repo.begin(), repo.end(), '/') > 1) return bad("repo id has more than ORG/NAME");
  if (Status s = ValidateModelName(repo); !s.ok()) return bad(s.message());
  std::string_view after = rest.substr(at + 1);
  if (after.size() < 42 || after[40] != '/' || !IsHex(after.substr(0, 40), 40)) {
    return bad("commit is not 40 lowercase hex digits followed by /PATH");
  }
  if (Status s = ValidateFilePath(after.substr(41)); !s.ok()) return bad(s.message());
  return Status::Ok();
}

Expected<VersionRef> ParseVersionRef(std::string_view text, bool version_required) {
  VersionRef ref;
  size_t at = text.rfind('@');
  if (at == std::string_view::npos) {
    if (version_required) {
      return Status::InvalidArgument("'" + std::string(text) + "' names no version; write MODEL@VERSION");
    }
    ref.model = std::string(text);
  } else {
    ref.model = std::string(text.substr(0, at));
    ref.version = std::string(text.substr(at + 1));
    WFS_TRY(ValidateVersionName(ref.version));
  }
  WFS_TRY(ValidateModelName(ref.model));
  return ref;
}

std::string FormatUtc(int64_t unix_ms) {
  // Floor division: -1 ms is 23:59:59.999 of the day before, not ".-01".
  int64_t secs = unix_ms / 1000;
  int ms = static_cast<int>(unix_ms % 1000);
  if (ms < 0) {
    ms += 1000;
    --secs;
  }
  std::time_t t = static_cast<std::time_t>(secs);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[40];
  size_t n = std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%S", &tm);
  std::snprintf(buf + n, sizeof(buf) - n, ".%03dZ", ms);
  return buf;
}

// Exactly "YYYY-MM-DDTHH:MM:SS[.f...]Z" with every field in range (strptime would take spaces,
// one-digit fields and February 31, and stop at a NUL).
Expected<int64_t> ParseUtc(std::string_view text) {
  auto bad = [&] {  // quotes at most 64 bytes: the text may be anything a manifest holds
    return Status::Corruption("'" + std::string(text.substr(0, 64)) +
                              (text.size() > 64 ? "...'" : "'") + " is not an RFC 3339 UTC time");
  };
  auto digits = [&](size_t pos, size_t len) {
    int v = 0;
    for (size_t i = pos; i < pos + len; ++i) {
      if (text[i] < '0' || text[i] > '9') return -1;
      v = v * 10 + (text[i] - '0');
    }
    return v;
  };
  if (text.size() < 20 || text[4] != '-' || text[7] != '-' || text[10] != 'T' || text[13] != ':' ||
      text[16] != ':') {
    return bad();
  }
  const int year = digits(0, 4), month = digits(5, 2), day = digits(8, 2);
  const int hour = digits(11, 2), minute = digits(14, 2), second = digits(17, 2);
  static constexpr int kDaysInMonth[] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
  const bool leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
  if (year < 0 || month < 1 || month > 12 || day < 1 ||
      day > kDaysInMonth[month - 1] + (month == 2 && leap) || hour < 0 || hour > 23 ||
      minute < 0 || minute > 59 || second < 0 || second > 60 /* leap second */) {
    return bad();
  }
  size_t pos = 19;
  int64_t ms = 0;
  if (text[pos] == '.') {
    size_t n = 0;
    for (++pos; pos < text.size() && text[pos] >= '0' && text[pos] <= '9'; ++pos, ++n) {
      if (n < 3) ms = ms * 10 + (text[pos] - '0');
    }
    if (n == 0) return bad();
    for (; n < 3; ++n) ms *= 10;
  }
  if (text.substr(pos) != "Z") return bad();
  std::tm tm{};
  tm.tm_year = year - 1900;
  tm.tm_mon = month - 1;
  tm.tm_mday = day;
  tm.tm_hour = hour;
  tm.tm_min = minute;
  tm.tm_sec = second;
  return static_cast<int64_t>(timegm(&tm)) * 1000 + ms;
}

}  // namespace weightfs

#include "core/manifest.h"

#include "core/ascii.h"
#include "core/chunk_table.h"

#include <zstd.h>

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <map>

#include <nlohmann/json.hpp>


namespace weightfs {
namespace {

using json = nlohmann::json;

constexpr size_t kCompressAbove = 64 << 10;

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
    // File paths: NAME_MAX of every local file system a version is pulled to, and of the mount.
    if (path && comp.size() > 255) {
      return Status::InvalidArgument(std::string(what) + " has a component longer than 255 bytes");
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

}  // namespace

std::optional<size_t> ManifestFile::FindChunk(const ChunkKey& key) const {
  // Chunks of one tensor are contiguous and in index order; a linear scan would be O(n) per
  // lookup, so callers that pair whole files build a map. This is for single lookups.
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (chunks[i].key == key) return i;
  }
  return std::nullopt;
}

const ManifestChunk* ManifestFile::FindChunkNear(const ChunkKey& key, size_t hint) const {
  if (hint < chunks.size() && chunks[hint].key == key) return &chunks[hint];
  const std::optional<size_t> i = FindChunk(key);
  return i ? &chunks[*i] : nullptr;
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

Status RebindInheritedRows(Manifest* m, const Manifest& parent,
                           const std::function<const ManifestFile*(const std::string&)>& rows) {
  std::map<Hash128, uint32_t> pack_index;
  for (size_t i = 0; i < m->packs.size(); ++i) pack_index.emplace(m->packs[i], static_cast<uint32_t>(i));
  auto pack_of = [&](const Hash128& h) {
    auto [it, added] = pack_index.emplace(h, static_cast<uint32_t>(m->packs.size()));
    if (added) m->packs.push_back(h);
    return it->second;
  };
  auto version_of = [&](uint32_t i) -> Expected<uint32_t> {
    if (i >= parent.versions.size()) return Status::Corruption("a row of " + parent.model + "@" + parent.version + " names no version");
    return m->VersionIndex(parent.versions[i]);
  };
  for (ManifestFile& f : m->files) {
    const ManifestFile* pf = nullptr;
    std::multimap<Hash128, size_t> by_hash;  // built on first need
    for (size_t ci = 0; ci < f.chunks.size(); ++ci) {
      ManifestChunk& c = f.chunks[ci];
      if (c.origin == 0) continue;
      if (!pf && !(pf = rows(f.path))) {
        return Status::Corruption(m->model + "@" + m->version + "/" + f.path + " inherits chunks from " + parent.model +
                                  "@" + parent.version + ", which has no such file now");
      }
      const ManifestChunk* found = nullptr;
      if (ci < pf->chunks.size() && pf->chunks[ci].hash == c.hash && pf->chunks[ci].length == c.length) {
        found = &pf->chunks[ci];
      } else {
        if (by_hash.empty()) {
          for (size_t i = 0; i < pf->chunks.size(); ++i) by_hash.emplace(pf->chunks[i].hash, i);
        }
        for (auto [it, end] = by_hash.equal_range(c.hash); it != end && !found; ++it) {
          if (pf->chunks[it->second].length == c.length) found = &pf->chunks[it->second];
        }
      }
      if (!found) {
        return Status::Corruption(m->model + "@" + m->version + "/" + f.path + ": chunk " + std::to_string(ci) +
                                  " inherited from " + parent.model + "@" + parent.version +
                                  " is not among its bytes now");
      }
      ManifestChunk out = *found;
      out.key = c.key;
      out.offset = c.offset;
      if (out.is_external()) {
        if (found->ref.pack >= parent.sources.size()) return Status::Corruption("a row of " + parent.version + " names no source");
        out.ref.pack = m->SourceIndex(parent.sources[found->ref.pack]);
      } else {
        if (found->ref.pack >= parent.packs.size()) return Status::Corruption("a row of " + parent.version + " names no pack");
        out.ref.pack = pack_of(parent.packs[found->ref.pack]);
      }
      WFS_ASSIGN_OR_RETURN(out.origin, version_of(found->origin));
      if (out.is_delta()) {
        WFS_ASSIGN_OR_RETURN(out.base, version_of(found->base));
      } else {
        out.base = 0;
      }
      c = out;
    }
  }
  // Only the packs the rows use.
  std::vector<uint32_t> renumber(m->packs.size(), UINT32_MAX);
  std::vector<Hash128> used;
  for (ManifestFile& f : m->files) {
    for (ManifestChunk& c : f.chunks) {
      if (c.is_external()) continue;
      if (c.ref.pack >= renumber.size()) return Status::Corruption("a row names no pack");
      if (renumber[c.ref.pack] == UINT32_MAX) {
        renumber[c.ref.pack] = static_cast<uint32_t>(used.size());
        used.push_back(m->packs[c.ref.pack]);
      }
      c.ref.pack = renumber[c.ref.pack];
    }
  }
  m->packs = std::move(used);
  return Status::Ok();
}

namespace {

std::vector<uint8_t> MaybeCompress(const std::string& text) {
  if (text.size() <= kCompressAbove) return std::vector<uint8_t>(text.begin(), text.end());
  std::vector<uint8_t> out(ZSTD_compressBound(text.size()));
  size_t n = ZSTD_compress(out.data(), out.size(), text.data(), text.size(), 6);
  out.resize(ZSTD_isError(n) ? 0 : n);
  if (out.empty()) return std::vector<uint8_t>(text.begin(), text.end());
  return out;
}

// The fields format 1 and 2 share.
json TopFields(const Manifest& m, int format) {
  json j;
  j["format"] = format;
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
  return j;
}

}  // namespace

SerializedVersion SerializeVersion(const Manifest& m, uint64_t block_rows) {
  SerializedVersion out;
  json files = json::array();
  for (const ManifestFile& f : m.files) {
    const EncodedSection section = EncodeChunkSection(f.chunks, block_rows);
    json where = json::array({out.table.size(), section.bytes.size()});
    if (section.index_length) where.push_back(section.index_length);
    files.push_back({{"path", f.path},
                     {"size", f.size},
                     {"sha256", f.sha256},
                     {"rows", f.chunks.size()},
                     {"section", std::move(where)}});
    out.table.insert(out.table.end(), section.bytes.begin(), section.bytes.end());
  }
  out.table_hash = HashChunk(out.table);
  json j = TopFields(m, kManifestFormat2);
  j["table"] = {{"pack", out.table_hash.ToHex()}, {"size", out.table.size()}};
  j["files"] = std::move(files);
  out.head = MaybeCompress(j.dump());
  return out;
}

std::vector<uint8_t> SerializeManifest(const Manifest& m) {
  json j = TopFields(m, kManifestFormat);
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
  if (after.size() < 42 || after[40] != '/' || !IsLowerHex(after.substr(0, 40), 40)) {
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
Expected<int64_t> ParseUtc(std::string_view text, UtcForm form) {
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
  const size_t shortest = form == UtcForm::kStrict ? 20 : 19;  // (kAnyOffset: no zone at all)
  if (text.size() < shortest || text[4] != '-' || text[7] != '-' || text[10] != 'T' || text[13] != ':' ||
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
  if (pos < text.size() && text[pos] == '.') {
    size_t n = 0;
    for (++pos; pos < text.size() && text[pos] >= '0' && text[pos] <= '9'; ++pos, ++n) {
      if (n < 3) ms = ms * 10 + (text[pos] - '0');
    }
    if (n == 0) return bad();
    for (; n < 3; ++n) ms *= 10;
  }
  // The zone: "Z"; or, in kAnyOffset, "+hh:mm", "-hh:mm" or nothing (UTC).
  const std::string_view zone = text.substr(pos);
  int64_t offset_s = 0;
  if (zone != "Z") {
    if (form == UtcForm::kStrict) return bad();
    if (!zone.empty()) {
      if (zone.size() != 6 || (zone[0] != '+' && zone[0] != '-') || zone[3] != ':') return bad();
      const int oh = digits(pos + 1, 2), om = digits(pos + 4, 2);
      if (oh < 0 || oh > 23 || om < 0 || om > 59) return bad();
      offset_s = (zone[0] == '+' ? 1 : -1) * (oh * 3600 + om * 60);
    }
  }
  std::tm tm{};
  tm.tm_year = year - 1900;
  tm.tm_mon = month - 1;
  tm.tm_mday = day;
  tm.tm_hour = hour;
  tm.tm_min = minute;
  tm.tm_sec = second;
  return (static_cast<int64_t>(timegm(&tm)) - offset_s) * 1000 + ms;
}

}  // namespace weightfs

#include "hub/engine/staged_version.h"

#include <unistd.h>

#include <algorithm>
#include <map>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "core/safetensors.h"
#include "hub/engine/lease.h"
#include "hub/engine/materializer.h"
#include "hub/engine/push_record.h"
#include "hub/engine/version_writer.h"

namespace weightfs {
namespace {

constexpr std::string_view kRecordMagic = "WFSPART1\n";
// A record's first line is read by range for listings; a longer one is read whole.
constexpr uint64_t kMetaProbeBytes = 64 << 10;

std::string Text(std::span<const uint8_t> bytes) {
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

std::span<const uint8_t> Bytes(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

std::string ParentText(const std::optional<std::string>& parent) {
  return parent ? *parent : std::string("(none: a base)");
}

nlohmann::json MetaJson(const PartMeta& m) {
  nlohmann::json j = {{"id", m.id},
                      {"parts", m.parts},
                      {"parent", m.parent ? nlohmann::json(*m.parent) : nlohmann::json(nullptr)},
                      {"host", m.host},
                      {"pid", m.pid},
                      {"created_ms", m.created_ms},
                      {"removed", m.removed},
                      {"files", m.files},
                      {"logical_bytes", m.logical_bytes},
                      {"stored_bytes", m.stored_bytes},
                      {"tally", m.tally}};
  return j;
}

// "staging/<model>@<version>/<rest>" -> {"<model>@<version>", rest}.
std::optional<std::pair<std::string, std::string>> SplitStagingKey(std::string_view key) {
  constexpr std::string_view kTop = "staging/";
  if (!key.starts_with(kTop)) return std::nullopt;
  key.remove_prefix(kTop.size());
  const size_t at = key.find('@');
  if (at == std::string_view::npos) return std::nullopt;
  const size_t slash = key.find('/', at);
  if (slash == std::string_view::npos) return std::nullopt;
  return std::pair<std::string, std::string>{std::string(key.substr(0, slash)), std::string(key.substr(slash + 1))};
}

}  // namespace

StagedVersion::StagedVersion(Bucket& bucket, std::string model, std::string version)
    : bucket_(bucket), model_(std::move(model)), version_(std::move(version)), prefix_(Prefix(model_, version_)) {}

std::string StagedVersion::Prefix(std::string_view model, std::string_view version) {
  return "staging/" + std::string(model) + "@" + std::string(version) + "/";
}

Status StagedVersion::ValidatePartId(std::string_view id) {
  if (id.empty() || id.size() > 64 || id[0] == '.' ||
      !std::all_of(id.begin(), id.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
      })) {
    return Status::InvalidArgument("part id '" + std::string(id) +
                                   "': use 1 to 64 of A-Z a-z 0-9 . _ - (not starting with '.'), e.g. the rank");
  }
  return Status::Ok();
}

std::string StagedVersion::SanitizePartId(std::string_view text) {
  std::string out;
  for (char c : text.substr(0, 40)) {
    out.push_back(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' ? c : '-');
  }
  if (out.empty()) out = "node";
  return out;
}

Expected<bool> StagedVersion::IsStaged(Bucket& bucket, std::string_view model, std::string_view version) {
  WFS_ASSIGN_OR_RETURN(ListPage page, bucket.store().List(Prefix(model, version), {}, 1));
  return !page.objects.empty();
}

// ---- records --------------------------------------------------------------------------------

std::vector<uint8_t> StagedVersion::SerializeRecord(const PartRecord& part) {
  std::string head(kRecordMagic);
  head += MetaJson(part.meta).dump();
  head.push_back('\n');
  Manifest m = part.manifest;
  m.format = kManifestFormat;
  if (m.created.empty()) m.created = FormatUtc(part.meta.created_ms ? part.meta.created_ms : NowMs());
  std::vector<uint8_t> body = SerializeManifest(m);
  std::vector<uint8_t> out(head.begin(), head.end());
  out.insert(out.end(), body.begin(), body.end());
  return out;
}

Expected<PartMeta> StagedVersion::ParseMeta(std::span<const uint8_t> bytes) {
  const std::string_view text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  if (!text.starts_with(kRecordMagic)) return Status::Corruption("not a weightfs part record (no WFSPART1 line)");
  const size_t end = text.find('\n', kRecordMagic.size());
  if (end == std::string_view::npos) return Status::Corruption("part record: its first line has no end");
  PartMeta m;
  try {
    const nlohmann::json j = nlohmann::json::parse(text.substr(kRecordMagic.size(), end - kRecordMagic.size()));
    // Numbers are checked for their type before they are read: nlohmann converts a float or a
    // negative number to an unsigned one without a word (undefined for a value out of range).
    auto count = [&](const char* key, bool required) -> uint64_t {
      if (!j.contains(key)) {
        if (required) throw std::runtime_error(std::string("no \"") + key + "\"");
        return 0;
      }
      const nlohmann::json& v = j.at(key);
      if (!v.is_number_unsigned()) throw std::runtime_error(std::string("\"") + key + "\" is not a count");
      return v.get<uint64_t>();
    };
    auto text_of = [&](const nlohmann::json& v, const char* what) {
      if (!v.is_string()) throw std::runtime_error(std::string(what) + " is not a string");
      return v.get<std::string>();
    };
    if (!j.is_object()) throw std::runtime_error("the first line is not a JSON object");
    m.id = text_of(j.at("id"), "\"id\"");
    const uint64_t parts = count("parts", true);
    if (parts > 1000000) throw std::runtime_error("\"parts\" is over 1,000,000");
    m.parts = static_cast<int>(parts);
    if (!j.at("parent").is_null()) m.parent = text_of(j.at("parent"), "\"parent\"");
    if (j.contains("host")) m.host = text_of(j.at("host"), "\"host\"");
    m.pid = static_cast<int64_t>(std::min<uint64_t>(count("pid", false), INT64_MAX));
    m.created_ms = static_cast<int64_t>(std::min<uint64_t>(count("created_ms", false), INT64_MAX));
    if (j.contains("removed")) {
      if (!j.at("removed").is_array()) throw std::runtime_error("\"removed\" is not a list");
      for (const nlohmann::json& r : j.at("removed")) m.removed.push_back(text_of(r, "a removed path"));
    }
    m.files = count("files", false);
    m.logical_bytes = count("logical_bytes", false);
    m.stored_bytes = count("stored_bytes", false);
    if (j.contains("tally")) {
      const nlohmann::json& t = j.at("tally");
      if (!t.is_array() || t.size() != 4) throw std::runtime_error("\"tally\" is not 4 counts");
      for (size_t i = 0; i < 4; ++i) {
        if (!t[i].is_number_unsigned()) throw std::runtime_error("\"tally\" is not 4 counts");
        m.tally[i] = t[i].get<uint64_t>();
      }
    }
  } catch (const std::exception& e) {
    return Status::Corruption(std::string("part record: ") + e.what());
  }
  WFS_TRY(ValidatePartId(m.id));
  if (m.parts < 1) return Status::Corruption("part record " + m.id + ": parts < 1");
  if (m.parent) WFS_TRY(ValidateVersionName(*m.parent));
  for (const std::string& p : m.removed) WFS_TRY(ValidateFilePath(p));
  return m;
}

Expected<PartRecord> StagedVersion::ParseRecord(std::span<const uint8_t> bytes, std::string_view model,
                                                std::string_view version) {
  PartRecord r;
  WFS_ASSIGN_OR_RETURN(r.meta, ParseMeta(bytes));
  const std::string_view text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  const size_t body = text.find('\n', kRecordMagic.size()) + 1;
  Expected<Manifest> m = ParseManifest(bytes.subspan(body), model, version);
  if (!m.ok()) return m.status().WithContext("part record " + r.meta.id);
  r.manifest = std::move(m).value();
  if (r.manifest.parent != r.meta.parent) {
    return Status::Corruption("part record " + r.meta.id + ": its manifest's parent is not the record's");
  }
  return r;
}

// ---- intent ---------------------------------------------------------------------------------

Expected<std::optional<std::pair<int, std::optional<std::string>>>> StagedVersion::Intent() {
  Expected<std::vector<uint8_t>> bytes = bucket_.store().Get(prefix_ + "intent.json");
  if (!bytes.ok()) {
    if (bytes.status().kind() == ErrorKind::kNotFound) return std::optional<std::pair<int, std::optional<std::string>>>{};
    return bytes.status();
  }
  try {
    const nlohmann::json j = nlohmann::json::parse(Text(*bytes));
    std::optional<std::string> parent;
    if (!j.at("parent").is_null()) {
      if (!j.at("parent").is_string()) throw std::runtime_error("\"parent\" is not a string");
      parent = j.at("parent").get<std::string>();
      WFS_TRY(ValidateVersionName(*parent));
    }
    const nlohmann::json& n = j.at("parts");
    if (!n.is_number_unsigned() || n.get<uint64_t>() < 1 || n.get<uint64_t>() > 1000000) {
      throw std::runtime_error("\"parts\" is not a count from 1 to 1,000,000");
    }
    return std::optional<std::pair<int, std::optional<std::string>>>{{static_cast<int>(n.get<uint64_t>()), parent}};
  } catch (const std::exception& e) {
    return Status::Corruption(bucket_.Describe() + "/" + prefix_ + "intent.json: " + e.what());
  }
}

Expected<int64_t> StagedVersion::IntentCreatedMs() {
  Expected<std::vector<uint8_t>> bytes = bucket_.store().Get(prefix_ + "intent.json");
  if (!bytes.ok()) return bytes.status().kind() == ErrorKind::kNotFound ? Expected<int64_t>(int64_t{0}) : bytes.status();
  const nlohmann::json j = nlohmann::json::parse(Text(*bytes), nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("created_ms") || !j.at("created_ms").is_number_unsigned()) return int64_t{0};
  return static_cast<int64_t>(std::min<uint64_t>(j.at("created_ms").get<uint64_t>(), INT64_MAX));
}

Status StagedVersion::Join(int parts, const std::optional<std::string>& parent) {
  const std::string name = model_ + "@" + version_;
  if (parts < 1) return Status::InvalidArgument("--parts must be at least 1");
  if (bucket_.store().Head(Bucket::ManifestKey(model_, version_)).ok()) return Status::Ok();
  const nlohmann::json intent = {{"parts", parts},
                                 {"parent", parent ? nlohmann::json(*parent) : nlohmann::json(nullptr)},
                                 {"host", HostName()},
                                 {"created_ms", NowMs()}};
  const std::string text = intent.dump();
  Status put = bucket_.store().Put(prefix_ + "intent.json", Bytes(text), PutMode::kCreateIfAbsent);
  if (put.ok()) {
    joined_ = {parts, parent};
    return put;
  }
  if (put.kind() != ErrorKind::kConflict) return put.WithContext("staging " + name);
  WFS_ASSIGN_OR_RETURN(auto fixed, Intent());
  if (!fixed) return Status::IOError("staging " + name + ": its intent vanished while it was read; try again");
  if (fixed->first != parts) {
    return Status::Conflict(name + " is staged as " + std::to_string(fixed->first) + " parts, and this part says " +
                            std::to_string(parts) + "; every node must give the same --parts (or `weightfs discard` "
                            "the staged version and start again)");
  }
  if (fixed->second != parent) {
    return Status::Conflict(name + " is staged with parent " + ParentText(fixed->second) + " (fixed by the first part), "
                            "and this part was encoded against " + ParentText(parent) +
                            "; nothing of this part was published. Make its draft with that parent "
                            "(`weightfs set-parent` before writing) or push with --parent " + ParentText(fixed->second));
  }
  joined_ = {parts, parent};
  return Status::Ok();
}

// ---- one look -------------------------------------------------------------------------------

Expected<StagedState> StagedVersion::Submit(const PartRecord& part) {
  WFS_TRY(ValidatePartId(part.meta.id));
  if (joined_ != std::pair(part.meta.parts, part.meta.parent)) WFS_TRY(Join(part.meta.parts, part.meta.parent));
  if (!bucket_.store().Head(Bucket::ManifestKey(model_, version_)).ok()) {
    const std::vector<uint8_t> record = SerializeRecord(part);
    WFS_TRY(bucket_.store().Put(prefix_ + "parts/" + part.meta.id, record)
                .WithContext("putting part " + part.meta.id + " of " + model_ + "@" + version_));
    // A new submission may end a conflict (the part no longer writes the path): judge anew.
    Status gone = bucket_.store().Delete(prefix_ + "conflict");
    if (!gone.ok() && gone.kind() != ErrorKind::kNotFound) return gone;
    spdlog::info("part {} of {}@{} is in the bucket ({} files written, {} removed, {} bytes stored)", part.meta.id,
                 model_, version_, part.meta.files, part.meta.removed.size(), part.meta.stored_bytes);
  }
  return Step(part, /*publish_now=*/true);
}

Status StagedVersion::Holds(const Manifest& head, const PartRecord& ours) {
  const std::string name = model_ + "@" + version_;
  if (head.parent != ours.meta.parent) {
    return Status::Conflict(name + " was published with parent " + ParentText(head.parent) + ", not " +
                            ParentText(ours.meta.parent) + " as part " + ours.meta.id + " was");
  }
  auto shared = std::make_shared<const Manifest>(head);
  for (const ManifestFile& f : ours.manifest.files) {
    Expected<std::shared_ptr<const ManifestFile>> there = bucket_.File(shared, f.path);
    const char* why = nullptr;
    if (!there.ok()) {
      if (there.status().kind() != ErrorKind::kNotFound) return there.status();
      why = "does not hold";
    } else if ((*there)->size != f.size || (*there)->sha256 != f.sha256 ||
               (*there)->chunks.size() != f.chunks.size()) {
      why = "holds another";
    } else {
      for (size_t c = 0; c < f.chunks.size() && !why; ++c) {
        if ((*there)->chunks[c].hash != f.chunks[c].hash || (*there)->chunks[c].length != f.chunks[c].length) {
          why = "holds another";
        }
      }
    }
    if (why) {
      return Status::Conflict(name + " was published, but it " + why + " " + f.path + " than part " + ours.meta.id +
                              " wrote (another writer published the name, or an earlier submission of this part was "
                              "published); the draft is kept: commit it under another name");
    }
  }
  for (const std::string& p : ours.meta.removed) {
    if (head.FindFile(p)) {
      return Status::Conflict(name + " was published with " + p + ", which part " + ours.meta.id + " removed");
    }
  }
  return Status::Ok();
}

Expected<StagedState> StagedVersion::Step(const PartRecord& ours, bool publish_now) {
  StagedState state;
  auto published = [&]() -> Expected<bool> {
    Expected<std::shared_ptr<const Manifest>> head = bucket_.ReadManifest(model_, version_);
    if (!head.ok()) {
      if (head.status().kind() == ErrorKind::kNotFound) return false;
      return head.status();
    }
    Status holds = Holds(**head, ours);
    if (holds.ok()) {
      state.kind = StagedState::kPublished;
      state.published = *head;
    } else if (holds.kind() == ErrorKind::kConflict) {
      state.kind = StagedState::kConflict;
      state.message = holds.message();
    } else {
      return holds;
    }
    return true;
  };
  WFS_ASSIGN_OR_RETURN(bool done, published());
  if (done) return state;

  WFS_ASSIGN_OR_RETURN(std::vector<ObjectInfo> objects, ListAll(bucket_.store(), prefix_));
  bool intent = false, conflict = false, ours_in = false;
  for (const ObjectInfo& o : objects) {
    const std::string_view rest = std::string_view(o.key).substr(prefix_.size());
    if (rest == "intent.json") intent = true;
    if (rest == "conflict") conflict = true;
    if (rest.starts_with("parts/")) {
      StagedPart p{std::string(rest.substr(6)), o.size, std::nullopt};
      if (p.id == ours.meta.id) ours_in = true;
      state.in.push_back(std::move(p));
    }
  }
  if (intent && !intent_) {
    WFS_ASSIGN_OR_RETURN(intent_, Intent());  // fixed once made: read once
  }
  if (intent && intent_) {
    state.parts = intent_->first;
    state.parent = intent_->second;
  }
  if (state.parts == 0) state.parts = ours.meta.parts;
  if (!ours_in) {
    // (The version may have been published, and its staging cleared, since the first look.)
    WFS_ASSIGN_OR_RETURN(bool now, published());
    if (now) return state;
    state.kind = StagedState::kGone;
    state.message = "the record of part " + ours.meta.id + " of " + model_ + "@" + version_ +
                    " is gone from the bucket: the staged version was discarded (`weightfs discard`) or expired "
                    "(`weightfs gc --staged-grace`); nothing was published. Commit again to stage it anew";
    return state;
  }
  if (conflict) {
    Expected<std::vector<uint8_t>> why = bucket_.store().Get(prefix_ + "conflict");
    if (why.ok()) {
      state.kind = StagedState::kConflict;
      state.message = Text(*why);
      return state;
    }
  }
  if (state.parts > 0 && static_cast<int>(state.in.size()) > state.parts) {
    std::string ids;
    for (const StagedPart& p : state.in) ids += (ids.empty() ? "" : ", ") + p.id;
    state.kind = StagedState::kConflict;
    state.message = model_ + "@" + version_ + " has " + std::to_string(state.in.size()) + " part records for " +
                    std::to_string(state.parts) + " parts (" + ids +
                    "): a part was submitted under two ids; `weightfs discard` it and commit every part again";
    return state;
  }
  if (state.parts == 0 || static_cast<int>(state.in.size()) < state.parts) {
    complete_since_.reset();
    return state;
  }
  const auto now = std::chrono::steady_clock::now();
  if (!complete_since_) complete_since_ = now;
  if (!publish_now) {
    // The completer should have published: the writers step in one after another, in the
    // order of their ids (5 s, then 2 s apart), so that a dead completer costs one reader of
    // the N records, not N of them.
    size_t position = 0;
    for (const StagedPart& p : state.in) position += p.id < ours.meta.id;
    const auto turn = kPublishFallback + std::chrono::milliseconds(2000) * static_cast<int64_t>(position);
    if (now - *complete_since_ < turn) return state;
  }
  return Publish(ours, std::move(state));
}

Expected<StagedState> StagedVersion::Publish(const PartRecord& ours, StagedState state) {
  const std::string name = model_ + "@" + version_;
  WFS_ASSIGN_OR_RETURN(std::vector<PartRecord> parts, ReadParts());
  if (static_cast<int>(parts.size()) < state.parts) return state;  // a record went meanwhile (a discard)
  for (const PartRecord& p : parts) {
    if (p.meta.parts != state.parts) {
      state.kind = StagedState::kConflict;
      state.message = name + ": part " + p.meta.id + " was written for " + std::to_string(p.meta.parts) +
                      " parts, the version is staged for " + std::to_string(state.parts) +
                      "; nothing was published (`weightfs discard` it and commit every part again)";
      return state;
    }
  }
  Expected<Manifest> m = Assemble(parts);
  if (!m.ok()) {
    if (m.status().kind() != ErrorKind::kConflict) return m.status();
    state.kind = StagedState::kConflict;
    state.message = m.status().message();
    // Every writer reads the reason instead of assembling again; a new submission clears it.
    (void)bucket_.store().Put(prefix_ + "conflict", Bytes(state.message));
    spdlog::error("{}", state.message);
    return state;
  }
  Status put = bucket_.PublishManifest(*m);
  if (!put.ok() && put.kind() != ErrorKind::kConflict) return put.WithContext("publishing " + name);
  WFS_ASSIGN_OR_RETURN(std::shared_ptr<const Manifest> head, bucket_.ReadManifest(model_, version_));
  // Our head (assembled from every record, ours included) holds our part; another's is checked.
  Status holds = put.ok() ? Status::Ok() : Holds(*head, ours);
  if (!holds.ok()) {
    if (holds.kind() != ErrorKind::kConflict) return holds;
    state.kind = StagedState::kConflict;
    state.message = holds.message();
    return state;
  }
  if (put.ok()) {
    spdlog::info("published {} from {} parts", name, parts.size());
    // The staging objects are history now (best effort: gc clears what is left).
    (void)Discard();
  }
  state.kind = StagedState::kPublished;
  state.published = head;
  return state;
}

Expected<StagedState> StagedVersion::Wait(const PartRecord& ours, std::chrono::steady_clock::time_point deadline,
                           const std::function<bool()>& cancelled,
                           const std::function<void(const StagedState&)>& progress) {
  const std::string name = model_ + "@" + version_;
  auto interval = std::chrono::milliseconds(50);
  size_t last_in = SIZE_MAX;
  while (true) {
    Expected<StagedState> looked = Step(ours);
    // (Timeout from here on means the deadline: a bucket request that timed out is an I/O error.)
    if (!looked.ok()) {
      return looked.status().kind() == ErrorKind::kTimeout ? Status::IOError(looked.status().message())
                                                           : looked.status();
    }
    StagedState st = std::move(looked).value();
    if (progress && (st.in.size() != last_in || st.kind != StagedState::kWaiting)) progress(st);
    last_in = st.in.size();
    switch (st.kind) {
      case StagedState::kPublished: return st;
      case StagedState::kConflict:
      case StagedState::kGone: return Status::Conflict(st.message);
      case StagedState::kWaiting: break;
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline || (cancelled && cancelled())) {
      return Status::Timeout(name + ": " + std::to_string(st.in.size()) + " of " + std::to_string(st.parts) +
                             " parts are in; part " + ours.meta.id +
                             " is safe in the bucket (run the same command again to go on waiting)");
    }
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(interval, deadline - now));
    // Every waiter lists the staging prefix once per interval: with many parts, less often
    // (1 s, plus 10 ms a part, at most 10 s).
    const auto most = std::min(std::chrono::milliseconds(1000) + std::chrono::milliseconds(10) * st.parts,
                               std::chrono::milliseconds(10000));
    interval = std::min<std::chrono::milliseconds>(interval * 3 / 2, most);
  }
}

Expected<size_t> StagedVersion::Discard() {
  WFS_ASSIGN_OR_RETURN(std::vector<ObjectInfo> objects, ListAll(bucket_.store(), prefix_));
  // Records first, the intent last: a writer that sees its record gone stops.
  std::stable_partition(objects.begin(), objects.end(),
                        [&](const ObjectInfo& o) { return o.key != prefix_ + "intent.json"; });
  size_t n = 0;
  for (const ObjectInfo& o : objects) {
    Status s = bucket_.store().Delete(o.key);
    if (!s.ok() && s.kind() != ErrorKind::kNotFound) return s.WithContext("discarding " + model_ + "@" + version_);
    n++;
  }
  return n;
}

Expected<std::vector<PartRecord>> StagedVersion::ReadParts() {
  WFS_ASSIGN_OR_RETURN(std::vector<ObjectInfo> objects, ListAll(bucket_.store(), prefix_ + "parts/"));
  std::vector<PartRecord> out;
  for (const ObjectInfo& o : objects) {
    Expected<std::vector<uint8_t>> bytes = bucket_.store().Get(o.key);
    if (!bytes.ok()) {
      if (bytes.status().kind() == ErrorKind::kNotFound) continue;  // replaced or discarded meanwhile
      return bytes.status();
    }
    Expected<PartRecord> r = ParseRecord(*bytes, model_, version_);
    if (!r.ok()) return r.status().WithContext(bucket_.Describe() + "/" + o.key);
    if (r->meta.id != o.key.substr(o.key.rfind('/') + 1)) {
      return Status::Corruption(bucket_.Describe() + "/" + o.key + " names itself part " + r->meta.id);
    }
    out.push_back(std::move(r).value());
  }
  return out;
}

// ---- assembly -------------------------------------------------------------------------------

Expected<Manifest> StagedVersion::Assemble(const std::vector<PartRecord>& parts) {
  const std::string name = model_ + "@" + version_;
  if (parts.empty()) return Status::InvalidArgument(name + ": no parts to assemble");
  const std::optional<std::string> parent = parts[0].meta.parent;
  for (const PartRecord& p : parts) {
    if (p.meta.parent != parent) {
      return Status::Conflict(name + ": part " + p.meta.id + " has parent " + ParentText(p.meta.parent) + ", part " +
                              parts[0].meta.id + " " + ParentText(parent) + "; nothing was published");
    }
  }
  std::map<std::string, std::string> written;              // path -> part id
  std::map<std::string, std::vector<std::string>> removed;  // path -> part ids
  std::vector<std::string> conflicts;
  for (const PartRecord& p : parts) {
    for (const ManifestFile& f : p.manifest.files) {
      auto [it, fresh] = written.emplace(f.path, p.meta.id);
      if (!fresh) conflicts.push_back(f.path + " is written by part " + it->second + " and by part " + p.meta.id);
    }
    for (const std::string& r : p.meta.removed) removed[r].push_back(p.meta.id);
  }
  for (const auto& [path, ids] : removed) {
    if (auto w = written.find(path); w != written.end()) {
      conflicts.push_back(path + " is written by part " + w->second + " and removed by part " + ids[0]);
    }
  }
  // The parent's head; the rows of only the files it passes on (a section each).
  std::shared_ptr<const Manifest> base;
  if (parent) {
    WFS_ASSIGN_OR_RETURN(base, bucket_.ReadManifest(model_, *parent));
  }

  Manifest m;
  m.model = model_;
  m.version = version_;
  m.versions = {version_};
  m.parent = parent;
  // The parts were encoded against the parent's head as each node had it: checked, and
  // rebound, when it is published (Bucket::PublishManifest).
  if (parent) m.inherited_from = Hash128{};
  m.chunk_bytes = base ? base->chunk_bytes : kDefaultChunkBytes;
  std::array<uint64_t, 4> tally{};
  if (base) {
    for (const ManifestFile& pf : base->files) {
      if (written.count(pf.path) || removed.count(pf.path)) continue;
      WFS_ASSIGN_OR_RETURN(std::shared_ptr<const ManifestFile> rows, bucket_.File(base, pf));
      AppendFileFrom(*base, *rows, &m, /*src_is_dst=*/false);
      m.stats.logical_bytes += pf.size;
      std::pair<uint64_t, uint64_t> e{0, pf.size};
      if (count_elements_) {
        Expected<std::pair<uint64_t, uint64_t>> counted = count_elements_(*base, *rows);
        if (!counted.ok()) return counted.status().WithContext("counting the elements of " + pf.path);
        e = *counted;
      }
      tally[0] += e.first;
      tally[2] += e.second;
    }
  }
  bool chunked = false;
  for (const PartRecord& p : parts) {
    for (const ManifestFile& f : p.manifest.files) {
      if (!chunked) m.chunk_bytes = p.manifest.chunk_bytes;
      chunked = true;
      AppendFileFrom(p.manifest, f, &m, /*src_is_dst=*/true);
    }
    m.stats.logical_bytes += p.meta.logical_bytes;
    m.stats.stored_bytes += p.meta.stored_bytes;
    for (size_t i = 0; i < 4; ++i) tally[i] += p.meta.tally[i];
  }
  // A file where another part made a directory of the same name (a/b beside a).
  std::set<std::string> paths;
  for (const ManifestFile& f : m.files) paths.insert(f.path);
  for (const ManifestFile& f : m.files) {
    for (std::string d = f.path; d.rfind('/') != std::string::npos;) {
      d.resize(d.rfind('/'));
      if (paths.count(d)) conflicts.push_back(d + " is a file in one part and a directory (of " + f.path + ") in another");
    }
  }
  if (!conflicts.empty()) {
    std::string text = name + " cannot be published: ";
    for (size_t i = 0; i < conflicts.size() && i < 5; ++i) text += (i ? "; " : "") + conflicts[i];
    if (conflicts.size() > 5) text += "; and " + std::to_string(conflicts.size() - 5) + " more";
    text += ". Nothing was published and every part's data is kept (in the bucket and in the drafts). To go on, "
            "`weightfs discard` the version (from any node: it abandons every part), write the drafts again with "
            "each path in one part only, and commit every part again";
    return Status::Conflict(text);
  }
  if (m.files.empty()) return Status::InvalidArgument(name + ": the parts leave the version with no files");
  const bool tensors = tally[0] > 0;
  m.stats.elements = tensors ? tally[0] : tally[2];
  m.stats.changed_elements = tensors ? tally[1] : tally[3];
  m.created = FormatUtc(NowMs());
  m.created_ms = NowMs();
  return m;
}

// ---- listing --------------------------------------------------------------------------------

Expected<std::vector<StagedSummary>> StagedVersion::List(Bucket& bucket, std::string_view model) {
  std::string prefix = "staging/";
  if (!model.empty()) prefix += std::string(model) + "@";
  WFS_ASSIGN_OR_RETURN(std::vector<ObjectInfo> objects, ListAll(bucket.store(), prefix));
  std::map<std::string, StagedSummary> by_name;
  for (const ObjectInfo& o : objects) {
    auto split = SplitStagingKey(o.key);
    if (!split) continue;
    const auto& [name, rest] = *split;
    const size_t at = name.rfind('@');
    StagedSummary& s = by_name[name];
    s.model = name.substr(0, at);
    s.version = name.substr(at + 1);
    if (rest.starts_with("parts/")) {
      StagedPart p{rest.substr(6), o.size, std::nullopt};
      Expected<std::vector<uint8_t>> head =
          bucket.store().Get(o.key, ByteRange{0, std::min<uint64_t>(o.size, kMetaProbeBytes)});
      if (head.ok() && o.size > kMetaProbeBytes) {
        const std::string_view t(reinterpret_cast<const char*>(head->data()), head->size());
        if (t.find('\n', kRecordMagic.size()) == std::string_view::npos) head = bucket.store().Get(o.key);
      }
      if (head.ok()) {
        if (Expected<PartMeta> meta = ParseMeta(*head); meta.ok()) p.meta = std::move(meta).value();
      }
      s.in.push_back(std::move(p));
    } else if (rest == "conflict") {
      if (Expected<std::vector<uint8_t>> why = bucket.store().Get(o.key); why.ok()) s.conflict = Text(*why);
    } else if (rest == "intent.json") {
      StagedVersion v(bucket, s.model, s.version);
      if (Expected<std::optional<std::pair<int, std::optional<std::string>>>> fixed = v.Intent(); fixed.ok() && *fixed) {
        s.parts = (*fixed)->first;
        s.parent = (*fixed)->second;
      }
    }
  }
  std::vector<StagedSummary> out;
  for (auto& [name, s] : by_name) {
    // A version published and its staging not yet cleared is not staged.
    if (bucket.store().Head(Bucket::ManifestKey(s.model, s.version)).ok()) continue;
    for (const StagedPart& p : s.in) {
      if (p.meta) s.created_ms = s.created_ms ? std::min(s.created_ms, p.meta->created_ms) : p.meta->created_ms;
    }
    out.push_back(std::move(s));
  }
  return out;
}

std::string StagedJson(const std::vector<StagedSummary>& staged) {
  nlohmann::json j = nlohmann::json::array();
  for (const StagedSummary& s : staged) {
    nlohmann::json v = {{"model", s.model}, {"version", s.version}, {"parts", s.parts},
                        {"parent", s.parent ? nlohmann::json(*s.parent) : nlohmann::json(nullptr)},
                        {"conflict", s.conflict}, {"in", nlohmann::json::array()}};
    for (const StagedPart& p : s.in) {
      nlohmann::json e = {{"id", p.id}, {"record_bytes", p.record_bytes}};
      if (p.meta) {
        e["host"] = p.meta->host;
        e["files"] = p.meta->files;
        e["removed"] = p.meta->removed.size();
        e["stored_bytes"] = p.meta->stored_bytes;
        e["logical_bytes"] = p.meta->logical_bytes;
        e["created_ms"] = p.meta->created_ms;
      }
      v["in"].push_back(std::move(e));
    }
    j.push_back(std::move(v));
  }
  return j.dump();
}

Expected<std::pair<uint64_t, uint64_t>> ElementsOfFile(Materializer& materializer, const Manifest& manifest,
                                                       const ManifestFile& file) {
  if (file.chunks.empty() || file.chunks[0].key.tensor != kHeaderChunkName) {
    return std::pair<uint64_t, uint64_t>{0, file.size};
  }
  WFS_ASSIGN_OR_RETURN(ByteBuffer header, materializer.Chunk(manifest, file, 0));
  WFS_ASSIGN_OR_RETURN(SafetensorsHeader h, ParseSafetensorsHeader(header, file.size));
  uint64_t elements = 0;
  for (const TensorInfo& t : h.tensors) elements += t.size() / std::max<size_t>(1, DTypeSize(t.dtype));
  return std::pair<uint64_t, uint64_t>{elements, file.chunks[0].length};
}

Expected<StagedState> PushPart(Bucket& bucket, ChunkCache* cache, ThreadPool& pool, const VersionRef& target,
                               std::shared_ptr<const Manifest> parent, std::vector<PushFile> files,
                               const PushOptions& options, const PushPartOptions& part, PushResult* result) {
  WFS_TRY(StagedVersion::ValidatePartId(part.id));
  const std::string name = target.model + "@" + target.version;
  WFS_TRY(CheckPushFiles(target, parent.get(), &files));
  std::optional<std::string> parent_name;
  if (parent) parent_name = parent->version;
  StagedVersion staged(bucket, target.model, target.version);
  Materializer materializer(&bucket, cache);
  staged.set_element_counter([&materializer](const Manifest& m, const ManifestFile& f) {
    return ElementsOfFile(materializer, m, f);
  });
  WFS_TRY(staged.Join(part.parts, parent_name));

  // The lease covers the packs until the record names them (gc's order: hub/engine/gc.h).
  WFS_ASSIGN_OR_RETURN(std::unique_ptr<Lease> lease, Lease::Acquire(&bucket.store(), name + " part " + part.id));
  PushResult local;
  PushResult& r = result ? *result : local;
  PartRecord record;
  WFS_ASSIGN_OR_RETURN(record.manifest, EncodePushFiles(bucket, cache, pool, target, parent, files, options,
                                                        "pushing part " + part.id + " of " + name, &r));
  record.meta.id = part.id;
  record.meta.parts = part.parts;
  record.meta.parent = parent_name;
  record.meta.host = HostName();
  record.meta.pid = ::getpid();
  record.meta.created_ms = NowMs();
  record.meta.files = record.manifest.files.size();
  record.meta.logical_bytes = record.manifest.stats.logical_bytes;
  record.meta.stored_bytes = record.manifest.stats.stored_bytes;
  record.meta.tally = {r.tensor_elements, r.tensor_changed, r.other_elements, r.other_changed};
  WFS_ASSIGN_OR_RETURN(StagedState st, staged.Submit(record));
  if (options.record) options.record->Remove();  // the part is in: its packs are referenced
  lease.reset();
  if (part.progress) part.progress(st);
  if (st.kind == StagedState::kConflict || st.kind == StagedState::kGone) return Status::Conflict(st.message);
  if (st.kind == StagedState::kWaiting && part.wait) {
    WFS_ASSIGN_OR_RETURN(st, staged.Wait(record, part.deadline, {}, part.progress));
  }
  return st;
}

}  // namespace weightfs

#include "hub/engine/push_record.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include <spdlog/spdlog.h>

#include "hub/engine/bucket.h"
#include "hub/store/local_file.h"

namespace weightfs {

namespace {

constexpr int kRecordVersion = 1;

std::string KeyHash(const std::string& what) {
  return HashChunk(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(what.data()), what.size()))
      .ToHex()
      .substr(0, 16);
}

// A line's own check (XXH3-64 of the line without it): a line a disk or an editor damaged is
// skipped, never trusted to say where a payload is.
uint64_t LineCheck(const nlohmann::json& without_check) {
  const std::string text = without_check.dump();
  return Hash64(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
}

std::optional<Hash128> HashField(const nlohmann::json& j, const char* key) {
  if (!j.contains(key) || !j[key].is_string()) return std::nullopt;
  Expected<Hash128> h = Hash128::FromHex(j[key].get<std::string>());
  if (!h.ok()) return std::nullopt;
  return *h;
}

}  // namespace

std::string PushRecord::PathFor(const std::string& dir, const std::string& what) {
  return dir + "/pushes/" + KeyHash(what) + ".jsonl";
}

Status PushRecord::Load(Store& store, ThreadPool& pool) {
  PushRecord* r = this;
  const std::string& path = path_;
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  if (ec) return Status::IOError("cannot create " + std::filesystem::path(path).parent_path().string() + ": " + ec.message());
  std::map<std::pair<std::string, size_t>, Chunk> read;
  {
    std::ifstream in(path);
    std::string line;
    bool header = false;
    while (std::getline(in, line)) {
      nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (!j.is_object()) continue;  // a line cut by a crash
      if (!header) {
        if (j.value("weightfs_push_record", 0) != kRecordVersion) break;  // not ours to read
        header = true;
        continue;
      }
      try {
        if (!j.contains("k") || !j["k"].is_number_unsigned()) continue;
        const uint64_t check = j["k"].get<uint64_t>();
        j.erase("k");
        if (LineCheck(j) != check) continue;
        Chunk c;
        c.offset = j.at("o").get<uint64_t>();
        c.length = j.at("l").get<uint64_t>();
        c.encoding = static_cast<ChunkEncoding>(j.at("e").get<int>());
        c.depth = j.at("d").get<uint32_t>();
        c.chain_bytes = j.at("cb").get<uint64_t>();
        c.keyframe_bytes = j.at("kb").get<uint64_t>();
        c.pack_offset = j.at("po").get<uint64_t>();
        c.payload_bytes = j.at("pl").get<uint64_t>();
        c.changed = j.at("c").get<uint64_t>();
        const std::optional<Hash128> input = HashField(j, "h"), pack = HashField(j, "p");
        if (!input || !pack) continue;
        c.input = *input;
        c.pack = *pack;
        c.base = HashField(j, "b");
        if (c.encoding == ChunkEncoding::kSame || c.encoding == ChunkEncoding::kExternal ||
            c.encoding > ChunkEncoding::kExternal || (c.base.has_value() != (c.depth > 0))) {
          continue;
        }
        read[{j.at("f").get<std::string>(), j.at("i").get<size_t>()}] = c;
      } catch (const std::exception&) {
        continue;
      }
    }
  }
  // Keep what the bucket still has (gc removes unreferenced packs once no push holds a lease).
  std::vector<Hash128> packs;
  {
    std::set<Hash128> distinct;
    for (const auto& [k, c] : read) distinct.insert(c.pack);
    packs.assign(distinct.begin(), distinct.end());
  }
  std::vector<int> present(packs.size(), 0);
  std::vector<uint64_t> sizes(packs.size(), 0);
  pool.ParallelFor(packs.size(), [&](size_t i, size_t) {
    Expected<ObjectInfo> info = store.Head(Bucket::PackKey(packs[i]));
    present[i] = info.ok() ? 1 : 0;
    if (info.ok()) sizes[i] = info->size;
  });
  std::map<Hash128, uint64_t> kept;
  for (size_t i = 0; i < packs.size(); ++i) {
    if (present[i]) kept[packs[i]] = sizes[i];
  }
  if (kept.size() < packs.size()) {
    spdlog::info("push record {}: {} of its {} packs are no longer in the bucket (gc?): their chunks are sent again",
                 path, packs.size() - kept.size(), packs.size());
  }
  for (auto& [k, c] : read) {
    auto it = kept.find(c.pack);
    if (it == kept.end() || c.pack_offset + c.payload_bytes > it->second) continue;
    r->chunks_.emplace(k, c);
  }
  r->loaded_packs_ = kept.size();
  for (const auto& [h, size] : kept) r->loaded_bytes_ += size;
  // Rewritten with what is kept, then appended to.
  if (Status st = WriteAtomically(path, nlohmann::json{{"weightfs_push_record", kRecordVersion}}.dump() + "\n",
                                  AtomicWrite{.mode = 0644, .durable = false});
      !st.ok()) {
    return st.WithContext("cannot write the push record " + path);
  }
  MutexLock lock(r->mu_);
  r->fd_ = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  if (r->fd_ < 0) return StatusOfErrno(errno, "opening the push record " + path);
  for (const auto& [k, c] : r->chunks_) r->WriteLocked(k.first, k.second, c);
  loaded_ = true;
  return Status::Ok();
}

PushRecord::~PushRecord() {
  MutexLock lock(mu_);
  if (fd_ >= 0) ::close(fd_);
}

const PushRecord::Chunk* PushRecord::Find(const std::string& file, size_t index) const {
  auto it = chunks_.find({file, index});
  return it == chunks_.end() ? nullptr : &it->second;
}

void PushRecord::WriteLocked(const std::string& file, size_t index, const Chunk& c) {
  if (fd_ < 0) return;
  nlohmann::json j = {{"f", file},
                      {"i", index},
                      {"o", c.offset},
                      {"l", c.length},
                      {"h", c.input.ToHex()},
                      {"e", static_cast<int>(c.encoding)},
                      {"d", c.depth},
                      {"cb", c.chain_bytes},
                      {"kb", c.keyframe_bytes},
                      {"p", c.pack.ToHex()},
                      {"po", c.pack_offset},
                      {"pl", c.payload_bytes},
                      {"c", c.changed}};
  if (c.base) j["b"] = c.base->ToHex();
  j["k"] = LineCheck(j);
  const std::string line = j.dump() + "\n";
  // One write per line (O_APPEND): a crash leaves whole lines and at most one cut line.
  if (::write(fd_, line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
    spdlog::warn("push record {}: cannot append ({}); an interrupted push would send these chunks again", path_,
                 std::strerror(errno));
    ::close(fd_);
    fd_ = -1;
  }
}

void PushRecord::Add(const std::string& file, size_t index, const Chunk& chunk, size_t pack_seq) {
  MutexLock lock(mu_);
  if (auto it = uploaded_.find(pack_seq); it != uploaded_.end()) {
    Chunk c = chunk;
    c.pack = it->second;
    WriteLocked(file, index, c);
    return;
  }
  pending_[pack_seq].push_back({file, index, chunk});
}

void PushRecord::PackUploaded(size_t seq, const Hash128& hash, uint64_t bytes) {
  MutexLock lock(mu_);
  uploaded_[seq] = hash;
  recorded_bytes_ += bytes;
  auto it = pending_.find(seq);
  if (it == pending_.end()) return;
  for (Pending& p : it->second) {
    p.chunk.pack = hash;
    WriteLocked(p.file, p.index, p.chunk);
  }
  pending_.erase(it);
}

uint64_t PushRecord::recorded_bytes() const {
  MutexLock lock(mu_);
  return recorded_bytes_;
}

void PushRecord::Remove() {
  MutexLock lock(mu_);
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  ::unlink(path_.c_str());
}

}  // namespace weightfs

#include "hub/engine/shared_tier.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "core/hash.h"

namespace weightfs {
namespace {

constexpr char kTierMagic[8] = {'W', 'F', 'S', 'T', 'I', 'E', 'R', '1'};
// magic, header bytes, block bytes, offset, length, fill time, key length.
constexpr size_t kFixedHeader = 8 + 4 + 4 + 8 + 8 + 8 + 2;
// The first read of a slice asks for this much: the whole header of a 32 MiB slice of 64 KiB
// blocks (~4 KiB) and the start of its bytes.
constexpr uint64_t kHeaderProbe = 16 << 10;
constexpr const char* kFillSuffix = ".fill";

int64_t UnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}
int64_t SteadyMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void PutLe(std::vector<uint8_t>& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
uint64_t GetLe(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

std::string DefaultNode() {
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "unknown");
  return std::string(host) + ":" + std::to_string(getpid());
}

}  // namespace

// A tier object's header, parsed and checked.
struct SharedTierStore::Header {
  uint64_t header_bytes = 0;
  uint32_t block_bytes = 0;
  uint64_t offset = 0;  // of the slice in the bucket's object
  uint64_t length = 0;  // bytes the slice holds
  int64_t filled_ms = 0;
  std::vector<uint64_t> block_hashes;
};

SharedTierStore::SharedTierStore(std::shared_ptr<Store> origin, std::shared_ptr<Store> tier,
                                 const std::string& bucket_id, SharedTierOptions options)
    : StoreWrapper(std::move(origin)),
      tier_(std::move(tier)),
      options_(std::move(options)),
      headers_(options_.header_cache_bytes) {
  if (options_.node.empty()) options_.node = DefaultNode();
  options_.slice_bytes = std::max<uint64_t>(options_.slice_bytes, 64 << 10);
  options_.block_bytes = std::clamp<uint32_t>(options_.block_bytes, 4 << 10, 16 << 20);
  for (int i = 0; i < kPutThreads; ++i) putters_.emplace_back([this] { PutLoop(); });
  prefetcher_ = std::thread([this] { PrefetchLoop(); });
  const Hash128 id = HashChunk(std::span(reinterpret_cast<const uint8_t*>(bucket_id.data()), bucket_id.size()));
  prefix_ = "weightfs-tier/" + id.ToHex().substr(0, 16) + "/";
}

SharedTierStore::~SharedTierStore() {
  {
    MutexLock lock(prefetch_mu_);
    closing_ = true;
    prefetch_cv_.NotifyAll();
  }
  prefetcher_.join();
  {
    MutexLock lock(put_mu_);
    stopping_ = true;
    put_cv_.NotifyAll();
  }
  for (std::thread& t : putters_) t.join();
}

SharedTierStore::Kind SharedTierStore::KindOf(std::string_view key) {
  if (key.starts_with("packs/") || key.starts_with("tables/")) return Kind::kSliced;
  if (key == "weightfs.json") return Kind::kTimed;
  if (key.starts_with("models/") && key.ends_with(".json")) {
    const size_t slash = key.rfind('/');
    if (slash != std::string_view::npos && slash >= 9 && key.substr(0, slash).ends_with("/versions")) {
      return Kind::kTimed;
    }
  }
  return Kind::kNone;
}

std::string SharedTierStore::SliceKey(std::string_view key, uint64_t index) const {
  return prefix_ + std::string(key) + "/" + std::to_string(index);
}

bool SharedTierStore::BackingOff() const { return SteadyMs() < backoff_until_ms_.load(); }

void SharedTierStore::TierFailed(const Status& status) {
  stats_.errors++;
  backoff_until_ms_ = SteadyMs() + options_.backoff.count();
  tier_log_.Log("shared cache " + tier_->Describe() + ": " + status.ToString() + "; reading from the bucket for " +
                std::to_string(options_.backoff.count() / 1000) + " s");
}

void SharedTierStore::Corrupt(const std::string& tier_key, const std::string& why) {
  stats_.corrupt++;
  headers_.Erase(tier_key);
  corrupt_log_.Log("shared cache object " + tier_->Describe() + "/" + tier_key + " " + why +
                   ": treated as a miss, filled again from the bucket");
}

Expected<std::vector<uint8_t>> SharedTierStore::Get(std::string_view key, std::optional<ByteRange> range) {
  const Kind kind = KindOf(key);
  if (kind == Kind::kNone) return inner_->Get(key, range);
  if (BackingOff()) {
    stats_.bypassed++;
    return inner_->Get(key, range);
  }
  const uint64_t offset = range ? range->offset : 0;
  const bool bounded = range && range->length.has_value();
  const uint64_t end = bounded && *range->length <= UINT64_MAX - offset ? offset + *range->length : UINT64_MAX;
  if (end == offset) return inner_->Get(key, range);  // the Store contract's edge cases: the bucket's own answer

  if (kind == Kind::kTimed) {
    auto r = ReadSlice(key, kind, 0, offset, end - offset);
    if (!r.ok()) return r.status();
    // Not in the tier and nobody could put it there, too large for one slice, or a range past
    // its end: the bucket's answer.
    if (!r->has_value() || (*r)->second > options_.slice_bytes || offset > (*r)->second) return inner_->Get(key, range);
    return std::move((*r)->first);
  }

  const uint64_t s = options_.slice_bytes;
  std::vector<uint8_t> out;
  uint64_t pos = offset;
  while (pos < end) {
    const uint64_t index = pos / s;
    const uint64_t start = index * s;
    const uint64_t in = pos - start;
    const uint64_t n = std::min(end, start + s) - pos;
    auto r = ReadSlice(key, kind, index, in, n);
    if (!r.ok()) return r.status();
    if (!r->has_value() || in > (*r)->second) {
      // The tier cannot serve this piece: the rest from the bucket, exactly what was asked.
      if (pos == offset) return inner_->Get(key, range);
      WFS_ASSIGN_OR_RETURN(std::vector<uint8_t> rest,
                           inner_->Get(key, ByteRange{pos, end == UINT64_MAX ? std::nullopt
                                                                             : std::optional<uint64_t>(end - pos)}));
      out.insert(out.end(), rest.begin(), rest.end());
      return out;
    }
    const uint64_t slice_size = (*r)->second;
    std::vector<uint8_t>& piece = (*r)->first;
    if (out.empty() && pos == offset) {
      out = std::move(piece);
    } else {
      out.insert(out.end(), piece.begin(), piece.end());
    }
    if (slice_size < s) break;  // the object ends in this slice
    pos = start + s;
  }
  return out;
}

Expected<std::vector<uint8_t>> SharedTierStore::GetUncached(std::string_view key, std::optional<ByteRange> range) {
  Expected<std::vector<uint8_t>> bytes = inner_->GetUncached(key, range);
  // A head read past the tier (Bucket::Revalidate: it may have been rewritten) refreshes the
  // tier's copy, when the whole object was read.
  const bool whole = !range || (range->offset == 0 && (!range->length || (bytes.ok() && bytes->size() < *range->length)));
  if (KindOf(key) == Kind::kTimed && bytes.ok() && whole && bytes->size() <= options_.slice_bytes && !BackingOff()) {
    const std::string tier_key = SliceKey(key, 0);
    headers_.Erase(tier_key);
    // Without a fill marker: a fill racing with this one puts the same bytes.
    auto header = std::make_shared<Header>();
    const std::vector<uint8_t> object = BuildObject(key, 0, *bytes, header.get());
    if (Status s = tier_->Put(tier_key, object); !s.ok()) {
      TierFailed(s);
    } else {
      headers_.Put(tier_key, header, header->header_bytes + sizeof(Header));
    }
  }
  return bytes;
}

Expected<std::optional<std::pair<std::vector<uint8_t>, uint64_t>>> SharedTierStore::ReadSlice(
    std::string_view key, Kind kind, uint64_t index, uint64_t offset, uint64_t length) {
  using Piece = std::pair<std::vector<uint8_t>, uint64_t>;
  const std::string tier_key = SliceKey(key, index);
  // From the tier: the header (memory, else one ranged read), then the blocks asked for.
  // Whether what the tier holds failed its checks (then a fill replaces it without looking at
  // it again). Another thread's finding counts too: that costs at most a second fill.
  const uint64_t corrupt_before = stats_.corrupt.load();
  auto from_tier = [&]() -> std::optional<Piece> {
    Expected<std::shared_ptr<const Header>> h = ReadHeader(tier_key, key, kind, index);
    if (!h.ok()) {
      TierFailed(h.status());
      return std::nullopt;
    }
    if (!*h) return std::nullopt;
    const Header& header = **h;
    if (offset > header.length) return Piece{{}, header.length};
    Expected<std::vector<uint8_t>> bytes =
        ReadBlocks(tier_key, header, offset, std::min(length, header.length - offset));
    if (!bytes.ok()) return std::nullopt;  // ReadBlocks counted and logged it
    stats_.hits++;
    stats_.bytes_received += bytes->size();
    return Piece{std::move(bytes).value(), header.length};
  };
  // [offset, offset + length) of a slice's bytes this process holds, and the slice's size.
  auto cut = [&](const std::vector<uint8_t>& d) -> Piece {
    if (offset > d.size()) return Piece{{}, d.size()};
    const uint64_t n = std::min<uint64_t>(length, d.size() - offset);
    return Piece{std::vector<uint8_t>(d.begin() + static_cast<ptrdiff_t>(offset),
                                      d.begin() + static_cast<ptrdiff_t>(offset + n)),
                 d.size()};
  };
  // A slice this process filled whose put is still on its way: from memory.
  auto from_pending = [&]() -> std::optional<Piece> {
    std::shared_ptr<const std::vector<uint8_t>> d;
    {
      MutexLock lock(put_mu_);
      auto it = pending_.find(tier_key);
      if (it == pending_.end()) return std::nullopt;
      d = it->second;
    }
    return cut(*d);
  };
  // A read of slice i after slice i-1 of the same object reads on: the next slice is filled
  // ahead (RL readers read whole steps; a lone reader of one tensor touches one or two slices).
  auto served = [&](std::optional<Piece> piece) -> std::optional<Piece> {
    if (piece && kind == Kind::kSliced && options_.read_ahead && piece->second == options_.slice_bytes) {
      ReadOn(key, index);
    }
    return piece;
  };
  if (auto mine = from_pending()) return served(std::move(mine));
  if (auto hit = from_tier()) return served(std::move(hit));
  if (BackingOff()) return std::optional<Piece>();
  if (auto mine = from_pending()) return served(std::move(mine));  // filled meanwhile by another thread
  stats_.misses++;
  WFS_ASSIGN_OR_RETURN(FillResult fill, Fill(key, kind, index, /*recheck=*/stats_.corrupt.load() == corrupt_before));
  if (fill.data) return served(cut(*fill.data));
  if (fill.in_tier) {
    if (auto hit = from_tier()) return served(std::move(hit));
  }
  return std::optional<Piece>();
}

void SharedTierStore::ReadOn(std::string_view key, uint64_t index) {
  MutexLock lock(prefetch_mu_);
  const std::string k(key);
  auto it = last_slice_.find(k);
  const bool sequential = it != last_slice_.end() && (it->second + 1 == index || it->second == index);
  if (it == last_slice_.end() && last_slice_.size() >= 4096) last_slice_.clear();
  last_slice_[k] = std::max(index, it != last_slice_.end() ? it->second : index);
  if (!sequential || prefetch_queue_.size() >= 4 || closing_) return;
  const std::string next = SliceKey(key, index + 1);
  if (!prefetched_.insert(next).second) return;
  if (prefetched_.size() > 4096) prefetched_ = {next};
  prefetch_queue_.emplace_back(k, index + 1);
  prefetch_cv_.NotifyAll();
}

void SharedTierStore::PrefetchLoop() {
  MutexLock lock(prefetch_mu_);
  while (true) {
    prefetch_cv_.Wait(prefetch_mu_, [&]() WFS_REQUIRES(prefetch_mu_) { return closing_ || !prefetch_queue_.empty(); });
    if (closing_) return;
    auto [key, index] = std::move(prefetch_queue_.front());
    prefetch_queue_.pop_front();
    lock.Unlock();
    const std::string tier_key = SliceKey(key, index);
    bool there = BackingOff();
    {
      MutexLock put_lock(put_mu_);
      there = there || pending_.count(tier_key) > 0;
    }
    if (!there) {
      Expected<std::shared_ptr<const Header>> h = ReadHeader(tier_key, key, Kind::kSliced, index);
      there = !h.ok() || *h != nullptr;
    }
    if (!there) {
      stats_.prefetches++;
      (void)Fill(key, Kind::kSliced, index, /*recheck=*/true);  // a bucket error is the reader's to see
    }
    lock.Lock();
  }
}

Expected<std::shared_ptr<const SharedTierStore::Header>> SharedTierStore::ReadHeader(const std::string& tier_key,
                                                                                    std::string_view key, Kind kind,
                                                                                    uint64_t index) {
  auto fresh = [&](const Header& h) {
    return kind != Kind::kTimed || UnixMs() - h.filled_ms <= options_.head_ttl.count();
  };
  if (std::shared_ptr<const Header> cached = headers_.Get(tier_key)) {
    if (fresh(*cached)) return cached;
    headers_.Erase(tier_key);
  }
  Expected<std::vector<uint8_t>> probe = tier_->Get(tier_key, ByteRange{0, kHeaderProbe});
  if (!probe.ok()) {
    if (probe.status().kind() == ErrorKind::kNotFound) return std::shared_ptr<const Header>();
    return probe.status();
  }
  std::vector<uint8_t> raw = std::move(probe).value();
  if (raw.size() < kFixedHeader || std::memcmp(raw.data(), kTierMagic, 8) != 0) {
    Corrupt(tier_key, "does not start with a weightfs tier header");
    return std::shared_ptr<const Header>();
  }
  auto h = std::make_shared<Header>();
  h->header_bytes = GetLe(raw.data() + 8, 4);
  h->block_bytes = static_cast<uint32_t>(GetLe(raw.data() + 12, 4));
  h->offset = GetLe(raw.data() + 16, 8);
  h->length = GetLe(raw.data() + 24, 8);
  h->filled_ms = static_cast<int64_t>(GetLe(raw.data() + 32, 8));
  const uint64_t key_len = GetLe(raw.data() + 40, 2);
  const uint64_t blocks = h->block_bytes ? (h->length + h->block_bytes - 1) / h->block_bytes : 0;
  if (h->block_bytes < 1024 || h->length > options_.slice_bytes || key_len != key.size() ||
      h->header_bytes != kFixedHeader + key_len + 8 * blocks + 8) {
    Corrupt(tier_key, "has a header that does not describe a slice of " + std::string(key));
    return std::shared_ptr<const Header>();
  }
  if (raw.size() < h->header_bytes) {
    Expected<std::vector<uint8_t>> rest = tier_->Get(tier_key, ByteRange{raw.size(), h->header_bytes - raw.size()});
    if (!rest.ok()) {
      if (rest.status().kind() == ErrorKind::kNotFound) return std::shared_ptr<const Header>();
      return rest.status();
    }
    raw.insert(raw.end(), rest->begin(), rest->end());
    if (raw.size() < h->header_bytes) {
      Corrupt(tier_key, "is truncated inside its header");
      return std::shared_ptr<const Header>();
    }
  }
  const uint8_t* p = raw.data();
  const uint64_t sum_at = h->header_bytes - 8;
  if (Hash64(std::span(p, sum_at)) != GetLe(p + sum_at, 8)) {
    Corrupt(tier_key, "has a header that fails its checksum");
    return std::shared_ptr<const Header>();
  }
  const uint64_t expected_offset = kind == Kind::kTimed ? 0 : index * options_.slice_bytes;
  if (std::string_view(reinterpret_cast<const char*>(p + kFixedHeader), key_len) != key ||
      h->offset != expected_offset) {
    Corrupt(tier_key, "holds another object's bytes");
    return std::shared_ptr<const Header>();
  }
  h->block_hashes.resize(blocks);
  for (uint64_t i = 0; i < blocks; ++i) h->block_hashes[i] = GetLe(p + kFixedHeader + key_len + 8 * i, 8);
  if (!fresh(*h)) {
    spdlog::debug("shared cache: {} is older than {} ms: fetching {} again", tier_key, options_.head_ttl.count(), key);
    return std::shared_ptr<const Header>();
  }
  headers_.Put(tier_key, h, h->header_bytes + sizeof(Header));
  return std::shared_ptr<const Header>(h);
}

Expected<std::vector<uint8_t>> SharedTierStore::ReadBlocks(const std::string& tier_key, const Header& h,
                                                           uint64_t offset, uint64_t length) {
  if (length == 0) return std::vector<uint8_t>();
  const uint64_t b = h.block_bytes;
  const uint64_t first = offset / b;
  const uint64_t last = (offset + length - 1) / b;  // inclusive
  const uint64_t from = first * b;
  const uint64_t to = std::min(h.length, (last + 1) * b);
  Expected<std::vector<uint8_t>> got = tier_->Get(tier_key, ByteRange{h.header_bytes + from, to - from});
  if (!got.ok()) {
    if (got.status().kind() == ErrorKind::kNotFound) {
      headers_.Erase(tier_key);  // evicted or emptied since its header was read
    } else {
      TierFailed(got.status());
    }
    return got.status();
  }
  if (got->size() != to - from) {
    Corrupt(tier_key, "is truncated (" + std::to_string(got->size()) + " of " + std::to_string(to - from) +
                          " bytes at offset " + std::to_string(from) + ")");
    return Status::Corruption("truncated");
  }
  for (uint64_t i = first; i <= last; ++i) {
    const uint64_t at = (i - first) * b;
    const uint64_t n = std::min<uint64_t>(b, got->size() - at);
    if (Hash64(std::span(*got).subspan(at, n)) != h.block_hashes[i]) {
      Corrupt(tier_key, "has a block (" + std::to_string(i) + ") that fails its checksum");
      return Status::Corruption("block checksum");
    }
  }
  std::vector<uint8_t> out = std::move(got).value();
  const uint64_t skip = offset - from;
  if (skip) out.erase(out.begin(), out.begin() + static_cast<ptrdiff_t>(skip));
  out.resize(length);
  return out;
}

Expected<SharedTierStore::FillResult> SharedTierStore::Fill(std::string_view key, Kind kind, uint64_t index,
                                                            bool recheck) {
  const std::string tier_key = SliceKey(key, index);
  std::promise<Expected<FillResult>> promise;
  std::shared_future<Expected<FillResult>> future;
  bool leader = false;
  {
    MutexLock lock(fills_mu_);
    auto it = fills_.find(tier_key);
    if (it != fills_.end()) {
      future = it->second;
    } else {
      future = promise.get_future().share();
      fills_.emplace(tier_key, future);
      leader = true;
    }
  }
  if (!leader) return future.get();
  Expected<FillResult> result = FillAcrossNodes(key, kind, index, recheck);
  {
    MutexLock lock(fills_mu_);
    fills_.erase(tier_key);
  }
  promise.set_value(result);
  return result;
}

Expected<SharedTierStore::FillResult> SharedTierStore::FillAcrossNodes(std::string_view key, Kind kind,
                                                                      uint64_t index, bool recheck) {
  const std::string tier_key = SliceKey(key, index);
  const std::string marker = tier_key + kFillSuffix;
  const int64_t started = SteadyMs();
  bool waited = false;
  for (int attempt = 0; attempt < 16; ++attempt) {
    const std::string body =
        nlohmann::json{{"node", options_.node}, {"expires_ms", UnixMs() + options_.fill_timeout.count()}}.dump();
    Status taken = tier_->Put(marker, std::span(reinterpret_cast<const uint8_t*>(body.data()), body.size()),
                              PutMode::kCreateIfAbsent);
    if (taken.ok()) {
      // Another node may have filled it and let go of its marker since this one looked (not
      // when what is there is what failed its checks).
      Expected<std::shared_ptr<const Header>> h =
          recheck ? ReadHeader(tier_key, key, kind, index) : std::shared_ptr<const Header>();
      if (h.ok() && *h) {
        (void)tier_->Delete(marker);
        return FillResult{nullptr, true};
      }
      return FetchAndPut(key, kind, index, tier_key);
    }
    if (taken.kind() != ErrorKind::kConflict) {
      TierFailed(taken);
      return FillResult{};
    }
    // Another node fills it: wait for the slice, for the marker to go (then take it), or for
    // the marker to expire (a dead filler: remove it, then take it).
    if (!waited) {
      stats_.waits++;
      waited = true;
    }
    std::chrono::milliseconds pause(5);
    while (true) {
      Expected<std::shared_ptr<const Header>> h = ReadHeader(tier_key, key, kind, index);
      if (!h.ok()) {
        TierFailed(h.status());
        return FillResult{};
      }
      if (*h) return FillResult{nullptr, true};
      Expected<std::vector<uint8_t>> m = tier_->Get(marker);
      if (!m.ok() && m.status().kind() != ErrorKind::kNotFound) {
        TierFailed(m.status());
        return FillResult{};
      }
      if (!m.ok()) break;  // the filler finished or gave up: look again, then take it
      int64_t expires = 0;
      auto j = nlohmann::json::parse(m->begin(), m->end(), nullptr, false);
      if (j.is_object() && j.contains("expires_ms") && j["expires_ms"].is_number_integer()) {
        expires = j["expires_ms"].get<int64_t>();
      }
      if (UnixMs() > expires) {
        spdlog::info("shared cache: the fill of {} by {} expired; taking it over", tier_key,
                     j.is_object() && j.contains("node") && j["node"].is_string() ? j["node"].get<std::string>()
                                                                                 : std::string("?"));
        (void)tier_->Delete(marker);
        break;
      }
      if (closing_.load()) return FillResult{};  // a prefetch at shutdown: nobody waits for it
      if (SteadyMs() - started > options_.max_wait.count()) {
        stats_.wait_timeouts++;
        spdlog::info("shared cache: waited {} ms for another node's fill of {}; reading the bucket",
                     options_.max_wait.count(), tier_key);
        return FillResult{};
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 3 / 2, std::chrono::milliseconds(100));
    }
  }
  return FillResult{};
}

Expected<std::vector<uint8_t>> SharedTierStore::FetchSlice(std::string_view key, Kind kind, uint64_t index) {
  // A head is read whole (one byte more than a slice tells one too large for the tier).
  if (kind == Kind::kTimed) return inner_->Get(key, ByteRange{0, options_.slice_bytes + 1});
  // The first part alone (most tables and small packs end in it: one request), then the rest
  // side by side: one stream from S3 or the Hub's CDN carries ~100 MB/s, and the slice's
  // readers wait for all of it. A part that comes back short is where the object ends; the
  // parts after it are past the end (empty, or an error that does not matter).
  const uint64_t start = index * options_.slice_bytes;
  const uint64_t parts = std::clamp<uint64_t>(options_.slice_bytes / (16 << 10), 1, options_.fetch_parts);
  const uint64_t part = (options_.slice_bytes + parts - 1) / parts;
  WFS_ASSIGN_OR_RETURN(std::vector<uint8_t> out, inner_->Get(key, ByteRange{start, std::min(part, options_.slice_bytes)}));
  if (out.size() < part || parts == 1) return out;
  std::vector<std::future<Expected<std::vector<uint8_t>>>> rest;
  const std::string k(key);
  for (uint64_t i = 1; i < parts; ++i) {
    const uint64_t at = start + i * part, n = std::min(part, options_.slice_bytes - i * part);
    rest.push_back(std::async(std::launch::async, [this, k, at, n] { return inner_->Get(k, ByteRange{at, n}); }));
  }
  std::vector<Expected<std::vector<uint8_t>>> got;
  for (auto& f : rest) got.push_back(f.get());
  for (uint64_t i = 1; i < parts; ++i) {
    Expected<std::vector<uint8_t>>& g = got[i - 1];
    if (!g.ok()) return g.status();
    out.insert(out.end(), g->begin(), g->end());
    if (out.size() < (i + 1) * part) break;  // the object ends in this part
  }
  return out;
}

std::vector<uint8_t> SharedTierStore::BuildObject(std::string_view key, uint64_t offset,
                                                  std::span<const uint8_t> data, Header* header) const {
  const uint32_t b = options_.block_bytes;
  const uint64_t blocks = (data.size() + b - 1) / b;
  header->header_bytes = kFixedHeader + key.size() + 8 * blocks + 8;
  header->block_bytes = b;
  header->offset = offset;
  header->length = data.size();
  header->filled_ms = UnixMs();
  std::vector<uint8_t> object;
  object.reserve(header->header_bytes + data.size());
  object.insert(object.end(), kTierMagic, kTierMagic + 8);
  PutLe(object, header->header_bytes, 4);
  PutLe(object, b, 4);
  PutLe(object, header->offset, 8);
  PutLe(object, header->length, 8);
  PutLe(object, static_cast<uint64_t>(header->filled_ms), 8);
  PutLe(object, key.size(), 2);
  object.insert(object.end(), key.begin(), key.end());
  header->block_hashes.resize(blocks);
  for (uint64_t i = 0; i < blocks; ++i) {
    const uint64_t from = i * b;
    header->block_hashes[i] = Hash64(data.subspan(from, std::min<uint64_t>(b, data.size() - from)));
    PutLe(object, header->block_hashes[i], 8);
  }
  PutLe(object, Hash64(object), 8);
  object.insert(object.end(), data.begin(), data.end());
  return object;
}

Expected<SharedTierStore::FillResult> SharedTierStore::FetchAndPut(std::string_view key, Kind kind, uint64_t index,
                                                                   const std::string& tier_key) {
  Expected<std::vector<uint8_t>> fetched = FetchSlice(key, kind, index);
  if (!fetched.ok() || fetched->size() > options_.slice_bytes) {
    (void)tier_->Delete(tier_key + kFillSuffix);
    if (!fetched.ok()) return fetched.status();
    return FillResult{std::make_shared<const std::vector<uint8_t>>(std::move(fetched).value()), false};
  }
  PendingPut put{std::string(key), kind, index, tier_key,
                 std::make_shared<const std::vector<uint8_t>>(std::move(fetched).value())};
  FillResult result{put.data, false};
  // The reader has its bytes now; the tier gets them behind it (other nodes wait on the marker,
  // which goes once they are in; this process reads them from pending_ meanwhile). A full
  // queue puts them here.
  {
    MutexLock lock(put_mu_);
    pending_[tier_key] = put.data;
    if (queued_bytes_ + put.data->size() <= kMaxQueuedSlices * options_.slice_bytes || puts_.empty()) {
      queued_bytes_ += put.data->size();
      puts_.push_back(std::move(put));
      put_cv_.NotifyAll();
      return result;
    }
  }
  PutFilled(put);
  MutexLock lock(put_mu_);
  pending_.erase(tier_key);
  return result;
}

void SharedTierStore::PutFilled(const PendingPut& p) {
  auto header = std::make_shared<Header>();
  const std::vector<uint8_t> object =
      BuildObject(p.key, p.kind == Kind::kTimed ? 0 : p.index * options_.slice_bytes, *p.data, header.get());
  Status put = tier_->Put(p.tier_key, object);
  (void)tier_->Delete(p.tier_key + kFillSuffix);
  if (!put.ok()) {
    TierFailed(put);
    return;
  }
  stats_.fills++;
  stats_.bytes_filled += object.size();
  headers_.Erase(p.tier_key);
  headers_.Put(p.tier_key, header, header->header_bytes + sizeof(Header));
  MaybeEvict(object.size());
}

void SharedTierStore::PutLoop() {
  MutexLock lock(put_mu_);
  while (true) {
    put_cv_.Wait(put_mu_, [&]() WFS_REQUIRES(put_mu_) { return stopping_ || !puts_.empty(); });
    if (puts_.empty()) return;  // stopping, and every put done
    PendingPut p = std::move(puts_.front());
    puts_.pop_front();
    ++putting_;
    lock.Unlock();
    PutFilled(p);
    lock.Lock();
    --putting_;
    queued_bytes_ -= p.data->size();
    pending_.erase(p.tier_key);
    put_cv_.NotifyAll();
  }
}

void SharedTierStore::Flush() {
  MutexLock lock(put_mu_);
  put_cv_.Wait(put_mu_, [&]() WFS_REQUIRES(put_mu_) { return puts_.empty() && putting_ == 0; });
}

void SharedTierStore::MaybeEvict(uint64_t filled_now) {
  if (options_.max_bytes == 0) return;
  if (filled_since_check_.fetch_add(filled_now) + filled_now < std::max<uint64_t>(options_.max_bytes / 16, 1)) return;
  if (evicting_.exchange(true)) return;
  filled_since_check_ = 0;
  // Every tier object of this bucket, oldest fill first (the tier's modification time; objects
  // without one go first, in key order).
  std::vector<ObjectInfo> all;
  uint64_t total = 0;
  std::string continuation;
  Status listed;
  do {
    Expected<ListPage> page = tier_->List(prefix_, continuation);
    if (!page.ok()) {
      listed = page.status();
      break;
    }
    for (ObjectInfo& o : page->objects) {
      if (o.key.ends_with(kFillSuffix)) continue;
      total += o.size;
      all.push_back(std::move(o));
    }
    continuation = page->continuation;
  } while (!continuation.empty());
  if (!listed.ok()) {
    TierFailed(listed);
  } else if (total > options_.max_bytes) {
    std::stable_sort(all.begin(), all.end(),
                     [](const ObjectInfo& a, const ObjectInfo& b) { return a.modified_ms < b.modified_ms; });
    const uint64_t target = options_.max_bytes / 10 * 9;
    uint64_t removed = 0, count = 0;
    for (const ObjectInfo& o : all) {
      if (total <= target) break;
      Status d = tier_->Delete(o.key);
      if (!d.ok() && d.kind() != ErrorKind::kNotFound) {
        TierFailed(d);
        break;
      }
      headers_.Erase(o.key);
      total -= o.size;
      removed += o.size;
      ++count;
    }
    stats_.evictions += count;
    spdlog::info("shared cache: removed {} objects ({} bytes) filled longest ago; {} bytes of this bucket remain "
                 "(--shared-cache-size {})",
                 count, removed, total, options_.max_bytes);
  }
  evicting_ = false;
}

}  // namespace weightfs

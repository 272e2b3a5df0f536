#include "hub/trl/trl_bucket.h"

#include <algorithm>
#include <chrono>
#include <charconv>
#include <cstring>
#include <functional>
#include <future>
#include <list>
#include <map>
#include <new>
#include <unordered_map>
#include <utility>

#include <spdlog/spdlog.h>

#include "core/hash.h"
#include "core/manifest.h"
#include "core/mutex.h"
#include "core/safetensors.h"
#include "hub/engine/byte_lru.h"
#include "hub/engine/bucket.h"

namespace weightfs {
namespace {

constexpr std::string_view kFileName = "model.safetensors";
constexpr std::string_view kAnchorDir = "anchors/";
constexpr std::string_view kDeltaDir = "deltas/";
constexpr std::string_view kStepPrefix = "step_";
constexpr std::string_view kSuffix = ".safetensors";
constexpr std::string_view kFormat = "sparse_weight_patch";
constexpr std::string_view kV0AnchorFormat = "anchor_checkpoint";
constexpr std::string_view kEmptyDelta = "__empty_delta__";

// "step_000012.safetensors" -> 12 (digits only, at most 18 of them); nullopt otherwise.
std::optional<uint64_t> ParseStepFile(std::string_view name) {
  if (!name.starts_with(kStepPrefix) || !name.ends_with(kSuffix)) return std::nullopt;
  std::string_view digits = name.substr(kStepPrefix.size(), name.size() - kStepPrefix.size() - kSuffix.size());
  if (digits.empty() || digits.size() > 18) return std::nullopt;
  uint64_t v = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  return v;
}

std::optional<uint64_t> ParseVersionStep(std::string_view version) {
  constexpr std::string_view kPrefix = "step-";
  if (!version.starts_with(kPrefix)) return std::nullopt;
  std::string_view digits = version.substr(kPrefix.size());
  if (digits.empty() || digits.size() > 18 || (digits.size() > 1 && digits[0] == '0')) return std::nullopt;
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v);
  if (ec != std::errc() || p != digits.data() + digits.size()) return std::nullopt;
  return v;
}

uint64_t NumElements(const TensorInfo& t) { return t.size() / DTypeSize(t.dtype); }

std::string ShapeText(const std::vector<uint64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// A name from a file, for messages: bounded and without control bytes.
std::string Quoted(std::string_view name) {
  std::string out = "'";
  for (size_t i = 0; i < name.size() && i < 96; ++i) {
    const auto c = static_cast<unsigned char>(name[i]);
    out += (c < 0x20 || c == 0x7f) ? '?' : static_cast<char>(c);
  }
  if (name.size() > 96) out += "...";
  return out + "'";
}

// An immutable snapshot of the bucket's step files.
struct Listing {
  std::map<uint64_t, TrlStep> steps;
  std::vector<uint64_t> anchors;  // ascending
  // The newest anchor at or below `step`, or nullopt.
  std::optional<uint64_t> AnchorAtOrBelow(uint64_t step) const {
    auto it = std::upper_bound(anchors.begin(), anchors.end(), step);
    if (it == anchors.begin()) return std::nullopt;
    return *(it - 1);
  }
  // Steps that are versions: at or after the first anchor.
  bool IsVersion(uint64_t step) const { return !anchors.empty() && step >= anchors.front() && steps.count(step); }
};

// Where a tensor of a synthesized file comes from.
struct TensorSource {
  uint64_t anchor_step = 0;
  std::string key;          // the anchor's key
  uint64_t file_offset = 0; // of the tensor's data in the anchor file
  TensorInfo info;          // as the anchor defines it (begin/end relative to its data section)
};

// The synthesized model.safetensors of every step whose newest anchor is `anchor_step`.
struct Layout {
  uint64_t anchor_step = 0;
  std::map<std::string, TensorSource> sources;  // the union of the anchors' tensors so far
  std::vector<uint8_t> header_bytes;            // the 8 + N prefix
  SafetensorsHeader header;                     // parsed back from header_bytes
  std::unordered_map<std::string, size_t> by_name;  // index into header.tensors
  ChunkPlan plan;
};

struct DeltaParam {
  TensorInfo idx;
  TensorInfo val;
};

// A validated delta file header.
struct DeltaHeader {
  uint64_t data_offset = 0;
  std::string encoding;  // "gap_delta", "raw", or "" (V1/V0, or V2 without the key: by dtype)
  std::map<std::string, DeltaParam> params;
};

struct Patch {
  std::vector<uint64_t> idx;  // strictly increasing element indices
  std::vector<uint8_t> val;   // idx.size() elements of the tensor's dtype
  size_t elem = 1;
  uint64_t Cost() const { return idx.size() * sizeof(uint64_t) + val.size() + 64; }
};

class TrlVersionsImpl final : public TrlVersions {
 public:
  TrlVersionsImpl(std::shared_ptr<Store> store, std::string model, const TrlOptions& options)
      : store_(std::move(store)), model_(std::move(model)), options_(options),
        delta_headers_(std::max<size_t>(1, options.max_cached_delta_headers)),
        patches_(options.patch_cache_bytes) {}

  const std::string& model() const override { return model_; }
  const TrlStats& stats() const override { return stats_; }

  // Lists the store; the new snapshot replaces the old one.
  Expected<std::shared_ptr<const Listing>> Refresh() {
    auto listing = std::make_shared<Listing>();
    for (std::string_view dir : {kAnchorDir, kDeltaDir}) {
      WFS_ASSIGN_OR_RETURN(std::vector<ObjectInfo> objects, ListAll(*store_, dir));
      const bool anchor = dir == kAnchorDir;
      for (ObjectInfo& o : objects) {
        std::optional<uint64_t> step = ParseStepFile(std::string_view(o.key).substr(dir.size()));
        if (!step) continue;  // anything else (sub-directories, other files) is not TRL's
        auto [it, inserted] = listing->steps.emplace(*step, TrlStep{*step, anchor, o.key, o.size});
        if (!inserted) {
          // TRL writes exactly one file per step; if both exist the anchor is the full state.
          spdlog::warn("TRL bucket {}: step {} has both {} and {}; using the anchor", store_->Describe(), *step,
                       it->second.key, o.key);
          if (anchor) it->second = TrlStep{*step, anchor, o.key, o.size};
        }
      }
    }
    for (const auto& [step, s] : listing->steps) {
      if (s.anchor) listing->anchors.push_back(step);
    }
    MutexLock lock(mu_);
    listing_ = listing;
    return std::shared_ptr<const Listing>(listing);
  }

  Expected<std::vector<TrlStep>> Steps() override {
    WFS_ASSIGN_OR_RETURN(std::shared_ptr<const Listing> l, Refresh());
    std::vector<TrlStep> out;
    for (const auto& [step, s] : l->steps) out.push_back(s);
    return out;
  }

  Expected<std::vector<VersionInfo>> ListVersions(std::string_view model) override {
    WFS_ASSIGN_OR_RETURN(std::shared_ptr<const Listing> l, Refresh());
    std::vector<VersionInfo> out;
    if (!model.empty() && model != model_) return out;
    for (const auto& [step, s] : l->steps) {
      if (l->IsVersion(step)) out.push_back({model_, TrlVersionName(step)});
    }
    std::sort(out.begin(), out.end(), [](const VersionInfo& a, const VersionInfo& b) {
      return std::tie(a.model, a.version) < std::tie(b.model, b.version);
    });
    return out;
  }

  Expected<std::shared_ptr<const Manifest>> ReadManifest(std::string_view model,
                                                         std::string_view version) override {
    auto missing = [&] {
      return Status::NotFound("version " + std::string(model) + "@" + std::string(version) +
                              " does not exist in " + store_->Describe() + " (a TRL bucket: versions are " +
                              model_ + "@step-N for its anchor and delta steps)");
    };
    const std::optional<uint64_t> step = ParseVersionStep(version);
    if (model != model_ || !step) return missing();
    {
      MutexLock lock(mu_);
      if (auto it = manifests_.find(*step); it != manifests_.end()) return it->second;
    }
    WFS_ASSIGN_OR_RETURN(std::shared_ptr<const Listing> l, ListingWith(*step));
    if (!l->IsVersion(*step)) return missing();
    WFS_ASSIGN_OR_RETURN(std::shared_ptr<const Layout> layout, LayoutFor(*l, *l->AnchorAtOrBelow(*step)));
    auto m = std::make_shared<Manifest>();
    m->model = model_;
    m->version = TrlVersionName(*step);
    auto it = l->steps.find(*step);
    if (it != l->steps.begin() && l->IsVersion(std::prev(it)->first)) m->parent = TrlVersionName(std::prev(it)->first);
    // TRL files carry no time the listing gives us; the versions are shown as created when the
    // bucket was opened, one millisecond apart in step order (so name@latest is the last step).
    m->created_ms = opened_ms_ + static_cast<int64_t>(std::min<uint64_t>(*step, uint64_t{1} << 40));
    m->created = FormatUtc(m->created_ms);
    m->chunk_bytes = options_.chunk_bytes;
    m->versions = {m->version};
    m->derived = true;
    ManifestFile f;
    f.path = std::string(kFileName);
    f.size = layout->plan.file_size;
    const TrlStep& s = it->second;
    for (const ChunkSpec& c : layout->plan.chunks) {
      ManifestChunk mc;
      mc.key = c.key;
      mc.offset = c.offset;
      mc.length = c.length;
      mc.encoding = ChunkEncoding::kFull;
      mc.hash = ChunkId(s, layout->anchor_step, c.key);
      f.chunks.push_back(std::move(mc));
    }
    for (const TensorInfo& t : layout->header.tensors) m->stats.elements += NumElements(t);
    m->stats.logical_bytes = f.size;
    m->stats.stored_bytes = s.size;
    m->files.push_back(std::move(f));
    MutexLock lock(mu_);
    auto [pos, inserted] = manifests_.emplace(*step, m);
    if (inserted) {
      manifest_order_.push_back(*step);
      while (manifest_order_.size() > kMaxCachedManifests) {
        manifests_.erase(manifest_order_.front());
        manifest_order_.pop_front();
      }
    }
    return pos->second;
  }

  Status Materialize(const Manifest& manifest, const ManifestFile& file, size_t index,
                     std::span<uint8_t> out) override {
    Status s = MaterializeChunk(manifest, file, index, out);
    if (!s.ok()) {
      return s.WithContext(manifest.model + "@" + manifest.version + " " + file.path + " chunk " +
                           std::to_string(index));
    }
    return s;
  }

 private:
  static constexpr size_t kMaxCachedManifests = 256;

  // The current listing if it has `step`, else a fresh one.
  Expected<std::shared_ptr<const Listing>> ListingWith(uint64_t step) {
    {
      MutexLock lock(mu_);
      if (listing_ && listing_->IsVersion(step)) return std::shared_ptr<const Listing>(listing_);
    }
    return Refresh();
  }

  // An identifier of chunk `key` of step `s` (unique per step, tensor and chunk index; the step
  // file's size and the anchor it builds on are in it so that a replaced file gets new ids).
  Hash128 ChunkId(const TrlStep& s, uint64_t anchor, const ChunkKey& key) const {
    std::string id = "trl\n" + store_->Describe() + "\n" + model_ + "\n" + std::to_string(s.step) + "\n" +
                     std::to_string(s.size) + "\n" + std::to_string(anchor) + "\n" + key.tensor + "\n" +
                     std::to_string(key.index);
    return HashChunk({reinterpret_cast<const uint8_t*>(id.data()), id.size()});
  }

  // The 8 + N prefix of a step file, parsed and checked against its size.
  Expected<SafetensorsHeader> ReadHeader(const TrlStep& s) {
    stats_.header_reads++;
    if (s.size < 8) return Status::Corruption(s.key + ": " + std::to_string(s.size) + " bytes is too short for safetensors");
    // Two ranged reads, the length and then exactly the header: never a byte of tensor data.
    WFS_ASSIGN_OR_RETURN(std::vector<uint8_t> prefix, store_->Get(s.key, ByteRange{0, 8}));
    if (prefix.size() < 8) return Status::Corruption(s.key + ": short read of its header");
    Expected<uint64_t> need = SafetensorsPrefixLength(prefix);
    if (!need.ok()) return need.status().WithContext(s.key);
    if (*need - 8 > options_.max_header_bytes) {
      return Status::Corruption(s.key + ": safetensors header of " + std::to_string(*need - 8) +
                                " bytes exceeds the bound of " + std::to_string(options_.max_header_bytes));
    }
    if (*need > s.size) {
      return Status::Corruption(s.key + ": header length " + std::to_string(*need) + " exceeds the file size " +
                                std::to_string(s.size));
    }
    WFS_ASSIGN_OR_RETURN(std::vector<uint8_t> rest, store_->Get(s.key, ByteRange{8, *need - 8}));
    if (rest.size() != *need - 8) return Status::Corruption(s.key + ": short read of its header");
    prefix.insert(prefix.end(), rest.begin(), rest.end());
    Expected<SafetensorsHeader> h = ParseSafetensorsHeader(prefix, s.size);
    if (!h.ok()) return h.status().WithContext(s.key);
    return h;
  }

  Expected<std::shared_ptr<const SafetensorsHeader>> AnchorHeader(const TrlStep& s) {
    {
      MutexLock lock(mu_);
      if (auto it = anchor_headers_.find(s.key); it != anchor_headers_.end() && it->second.first == s.size) {
        return it->second.second;
      }
    }
    WFS_ASSIGN_OR_RETURN(SafetensorsHeader h, ReadHeader(s));
    const auto& md = h.metadata;
    if (auto f = md.find("format"); f != md.end() && f->second != kFormat && f->second != kV0AnchorFormat) {
      return Status::Corruption(s.key + ": __metadata__ format is " + Quoted(f->second) + ", not sparse_weight_patch");
    }
    if (auto sp = md.find("sparse"); sp != md.end() && sp->second != "False") {
      return Status::Corruption(s.key + ": an anchor whose __metadata__ says sparse=" + Quoted(sp->second));
    }
    auto shared = std::make_shared<const SafetensorsHeader>(std::move(h));
    MutexLock lock(mu_);
    anchor_headers_[s.key] = {s.size, shared};
    return std::shared_ptr<const SafetensorsHeader>(shared);
  }

  // The layout of steps whose newest anchor is `anchor`: built on the layout of the anchor
  // before it (an anchor overlays the state, replacing the tensors it holds).
  Expected<std::shared_ptr<const Layout>> LayoutFor(const Listing& l, uint64_t anchor) {
    // Walk back to the newest anchor <= `anchor` with a cached layout.
    auto end = std::upper_bound(l.anchors.begin(), l.anchors.end(), anchor);
    std::shared_ptr<const Layout> base;
    auto first = l.anchors.begin();
    {
      MutexLock lock(mu_);
      for (auto it = end; it != l.anchors.begin();) {
        --it;
        if (auto c = layouts_.find(*it); c != layouts_.end()) {
          base = c->second;
          first = it + 1;
          break;
        }
      }
    }
    if (base && first == end) return base;
    for (auto it = first; it != end; ++it) {
      const TrlStep& s = l.steps.at(*it);
      WFS_ASSIGN_OR_RETURN(std::shared_ptr<const SafetensorsHeader> h, AnchorHeader(s));
      auto layout = std::make_shared<Layout>();
      layout->anchor_step = *it;
      if (base) layout->sources = base->sources;
      for (const TensorInfo& t : h->tensors) {
        layout->sources[t.name] = TensorSource{*it, s.key, h->data_offset + t.begin, t};
      }
      std::vector<TensorInfo> tensors;
      for (const auto& [name, src] : layout->sources) {
        TensorInfo t;
        t.name = name;
        t.dtype = src.info.dtype;
        t.shape = src.info.shape;
        t.begin = 0;
        t.end = src.info.size();
        tensors.push_back(std::move(t));
      }
      layout->header_bytes = BuildSafetensorsHeader(tensors, h->metadata);
      const uint64_t file_size = layout->header_bytes.size() + (tensors.empty() ? 0 : tensors.back().end);
      Expected<SafetensorsHeader> parsed = ParseSafetensorsHeader(layout->header_bytes, file_size);
      if (!parsed.ok()) return parsed.status().WithContext("the synthesized header of step " + std::to_string(*it));
      layout->header = std::move(parsed).value();
      for (size_t i = 0; i < layout->header.tensors.size(); ++i) layout->by_name[layout->header.tensors[i].name] = i;
      layout->plan = PlanChunks(layout->header, file_size, options_.chunk_bytes);
      MutexLock lock(mu_);
      auto [pos, inserted] = layouts_.emplace(*it, std::move(layout));
      base = pos->second;
    }
    if (!base) return Status::NotFound("no anchor at or below step " + std::to_string(anchor));
    return base;
  }

  Expected<std::shared_ptr<const DeltaHeader>> GetDeltaHeader(const TrlStep& s) {
    bool hit = false;
    return delta_headers_.GetOrLoad(
        s.key + "\n" + std::to_string(s.size),
        [&]() -> Expected<std::shared_ptr<const DeltaHeader>> {
          WFS_ASSIGN_OR_RETURN(SafetensorsHeader h, ReadHeader(s));
          WFS_ASSIGN_OR_RETURN(DeltaHeader d, ValidateDelta(s, h));
          return std::make_shared<const DeltaHeader>(std::move(d));
        },
        [](const DeltaHeader&) { return uint64_t{1}; }, &hit);
  }

  static Expected<DeltaHeader> ValidateDelta(const TrlStep& s, const SafetensorsHeader& h) {
    const auto& md = h.metadata;
    auto f = md.find("format");
    if (f == md.end() || f->second != kFormat) {
      return Status::Corruption(s.key + ": __metadata__ format is " +
                                (f == md.end() ? std::string("missing") : Quoted(f->second)) +
                                ", not sparse_weight_patch (not a TRL delta)");
    }
    if (auto sp = md.find("sparse"); sp != md.end() && sp->second != "True") {
      return Status::Corruption(s.key + ": a delta whose __metadata__ says sparse=" + Quoted(sp->second));
    }
    if (auto mv = md.find("model_version"); mv != md.end()) {
      uint64_t v = 0;
      auto [p, ec] = std::from_chars(mv->second.data(), mv->second.data() + mv->second.size(), v);
      if (ec != std::errc() || p != mv->second.data() + mv->second.size() || v != s.step) {
        return Status::Corruption(s.key + ": __metadata__ model_version " + Quoted(mv->second) +
                                  " does not match its step " + std::to_string(s.step));
      }
    }
    DeltaHeader d;
    d.data_offset = h.data_offset;
    if (auto e = md.find("encoding"); e != md.end()) {
      if (e->second == "nvcomp_cascaded") {
        return Status::Unsupported(s.key + ": indices encoded with nvcomp_cascaded (GPU-only nvCOMP) are not "
                                   "supported; sync with delta_sync encoding gap_delta or raw");
      }
      if (e->second != "gap_delta" && e->second != "raw") {
        return Status::Corruption(s.key + ": unknown index encoding " + Quoted(e->second));
      }
      d.encoding = e->second;
    }
    int layout = 0;  // 2: .idx/.val, 1: .indices/.values
    for (const TensorInfo& t : h.tensors) {
      if (t.name == kEmptyDelta) continue;
      const size_t dot = t.name.rfind('.');
      const std::string_view suffix = dot == std::string::npos ? std::string_view() : std::string_view(t.name).substr(dot + 1);
      const int kind = suffix == "idx" || suffix == "val" ? 2 : suffix == "indices" || suffix == "values" ? 1 : 0;
      if (kind == 0 || dot == 0) {
        return Status::Corruption(s.key + ": tensor " + Quoted(t.name) +
                                  " is neither NAME.idx/NAME.val nor NAME.indices/NAME.values");
      }
      if (layout != 0 && kind != layout) {
        return Status::Corruption(s.key + ": mixes .idx/.val and .indices/.values tensors");
      }
      layout = kind;
      if (t.shape.size() != 1) {
        return Status::Corruption(s.key + ": tensor " + Quoted(t.name) + " has shape " + ShapeText(t.shape) +
                                  ", not [nnz]");
      }
      DeltaParam& p = d.params[t.name.substr(0, dot)];
      (suffix == "idx" || suffix == "indices" ? p.idx : p.val) = t;
    }
    if (layout == 1 && d.encoding == "gap_delta") {
      return Status::Corruption(s.key + ": .indices tensors are absolute int32, but __metadata__ says gap_delta");
    }
    if (layout == 1) d.encoding = "raw";
    for (const auto& [name, p] : d.params) {
      if (p.idx.name.empty() || p.val.name.empty()) {
        return Status::Corruption(s.key + ": parameter " + Quoted(name) + " has " +
                                  (p.idx.name.empty() ? "values but no indices" : "indices but no values"));
      }
      if (p.idx.shape[0] != p.val.shape[0]) {
        return Status::Corruption(s.key + ": parameter " + Quoted(name) + " has " + std::to_string(p.idx.shape[0]) +
                                  " indices but " + std::to_string(p.val.shape[0]) + " values");
      }
    }
    return d;
  }

  // The decoded patch of `tensor` (its definition `t`) in delta step `s`; null if the delta
  // does not touch it.
  Expected<std::shared_ptr<const Patch>> GetPatch(const TrlStep& s, const TensorInfo& t) {
    WFS_ASSIGN_OR_RETURN(std::shared_ptr<const DeltaHeader> d, GetDeltaHeader(s));
    auto pit = d->params.find(t.name);
    if (pit == d->params.end()) return std::shared_ptr<const Patch>();
    const DeltaParam& p = pit->second;
    const std::string what = s.key + " tensor " + Quoted(t.name);
    const uint64_t numel = NumElements(t);
    if (p.val.dtype != t.dtype) {
      return Status::Corruption(what + ": values are " + std::string(DTypeName(p.val.dtype)) + " but the tensor is " +
                                std::string(DTypeName(t.dtype)));
    }
    if (p.idx.shape[0] > numel) {
      return Status::Corruption(what + ": " + std::to_string(p.idx.shape[0]) + " changes in a tensor of " +
                                std::to_string(numel) + " elements");
    }
    bool hit = false;
    Expected<std::shared_ptr<const Patch>> patch = patches_.GetOrLoad(
        s.key + "\n" + std::to_string(s.size) + "\n" + t.name,
        [&]() -> Expected<std::shared_ptr<const Patch>> {
          stats_.patch_fetches++;
          // One read when the two tensors are adjacent (TRL's writer puts them side by side).
          const TensorInfo& lo = p.idx.begin <= p.val.begin ? p.idx : p.val;
          const TensorInfo& hi = p.idx.begin <= p.val.begin ? p.val : p.idx;
          std::vector<uint8_t> idx_bytes, val_bytes;
          if (lo.end == hi.begin) {
            WFS_ASSIGN_OR_RETURN(std::vector<uint8_t> both, ReadExact(s.key, d->data_offset + lo.begin, hi.end - lo.begin, what));
            const auto split = both.begin() + static_cast<std::ptrdiff_t>(lo.size());
            std::vector<uint8_t> first(both.begin(), split), second(split, both.end());
            idx_bytes = std::move(&lo == &p.idx ? first : second);
            val_bytes = std::move(&lo == &p.idx ? second : first);
          } else {
            WFS_ASSIGN_OR_RETURN(idx_bytes, ReadExact(s.key, d->data_offset + p.idx.begin, p.idx.size(), what));
            WFS_ASSIGN_OR_RETURN(val_bytes, ReadExact(s.key, d->data_offset + p.val.begin, p.val.size(), what));
          }
          auto out = std::make_shared<Patch>();
          WFS_ASSIGN_OR_RETURN(out->idx, DecodeTrlIndices(idx_bytes, p.idx.dtype, d->encoding, numel, what));
          out->val = std::move(val_bytes);
          out->elem = DTypeSize(t.dtype);
          return std::shared_ptr<const Patch>(std::move(out));
        },
        [](const Patch& x) { return x.Cost(); }, &hit);
    if (hit) stats_.patch_hits++;
    return patch;
  }

  Expected<std::vector<uint8_t>> ReadExact(const std::string& key, uint64_t offset, uint64_t length,
                                           const std::string& what) {
    if (length == 0) return std::vector<uint8_t>();
    Expected<std::vector<uint8_t>> r = store_->Get(key, ByteRange{offset, length});
    if (!r.ok()) return r.status().WithContext(what);
    if (r->size() != length) {
      return Status::Corruption(what + ": read " + std::to_string(r->size()) + " of " + std::to_string(length) +
                                " bytes at offset " + std::to_string(offset) + " (the file is shorter than its header says)");
    }
    return r;
  }

  Status MaterializeChunk(const Manifest& manifest, const ManifestFile& file, size_t index, std::span<uint8_t> out) {
    const std::optional<uint64_t> step = ParseVersionStep(manifest.version);
    if (manifest.model != model_ || !step || file.path != kFileName || index >= file.chunks.size()) {
      return Status::InvalidArgument("not a chunk of a version of this TRL bucket");
    }
    WFS_ASSIGN_OR_RETURN(std::shared_ptr<const Listing> l, ListingWith(*step));
    if (!l->IsVersion(*step)) return Status::NotFound("step " + std::to_string(*step) + " is no longer in the bucket");
    WFS_ASSIGN_OR_RETURN(std::shared_ptr<const Layout> layout, LayoutFor(*l, *l->AnchorAtOrBelow(*step)));
    const ManifestChunk& c = file.chunks[index];
    if (index >= layout->plan.chunks.size() || layout->plan.chunks[index].key != c.key ||
        layout->plan.chunks[index].offset != c.offset || layout->plan.chunks[index].length != c.length ||
        out.size() != c.length) {
      return Status::InvalidArgument("the manifest does not match the bucket's files (were they replaced?)");
    }
    if (c.key.tensor == kHeaderChunkName) {
      if (c.offset + c.length > layout->header_bytes.size()) return Status::InvalidArgument("header chunk out of range");
      std::memcpy(out.data(), layout->header_bytes.data() + c.offset, c.length);
      return Status::Ok();
    }
    auto ti = layout->by_name.find(c.key.tensor);
    if (ti == layout->by_name.end()) return Status::InvalidArgument("no tensor " + Quoted(c.key.tensor));
    const TensorInfo& t = layout->header.tensors[ti->second];
    const TensorSource& src = layout->sources.at(t.name);
    const uint64_t rel = c.offset - (layout->header.data_offset + t.begin);
    const size_t elem = DTypeSize(t.dtype);
    // The anchor's bytes of this range.
    WFS_ASSIGN_OR_RETURN(std::vector<uint8_t> base,
                         ReadExact(src.key, src.file_offset + rel, c.length, src.key + " tensor " + Quoted(t.name)));
    stats_.anchor_bytes += base.size();
    std::memcpy(out.data(), base.data(), base.size());
    // Then every delta after that anchor, in step order.
    const uint64_t e0 = rel / elem, e1 = (rel + c.length) / elem;
    for (auto it = l->steps.upper_bound(src.anchor_step); it != l->steps.end() && it->first <= *step; ++it) {
      if (it->second.anchor) continue;  // an anchor without this tensor: it did not change
      WFS_ASSIGN_OR_RETURN(std::shared_ptr<const Patch> p, GetPatch(it->second, t));
      if (!p) continue;
      auto k = std::lower_bound(p->idx.begin(), p->idx.end(), e0);
      for (; k != p->idx.end() && *k < e1; ++k) {
        const size_t j = static_cast<size_t>(k - p->idx.begin());
        std::memcpy(out.data() + (*k - e0) * elem, p->val.data() + j * elem, elem);
      }
    }
    return Status::Ok();
  }

  std::shared_ptr<Store> store_;
  const std::string model_;
  const TrlOptions options_;
  const int64_t opened_ms_ = std::chrono::duration_cast<std::chrono::milliseconds>(
                                 std::chrono::system_clock::now().time_since_epoch())
                                 .count() / 1000 * 1000;
  TrlStats stats_;
  ByteLru<DeltaHeader> delta_headers_;  // cost 1 each: bounded by count
  ByteLru<Patch> patches_;              // bounded by bytes
  // Lock order: mu_ is a leaf (the caches have their own mutexes, never taken under mu_).
  Mutex mu_;  // never held across store I/O
  std::shared_ptr<const Listing> listing_ WFS_GUARDED_BY(mu_);
  // key -> (size, header)
  std::map<std::string, std::pair<uint64_t, std::shared_ptr<const SafetensorsHeader>>> anchor_headers_
      WFS_GUARDED_BY(mu_);
  std::map<uint64_t, std::shared_ptr<const Layout>> layouts_ WFS_GUARDED_BY(mu_);  // by anchor step
  std::map<uint64_t, std::shared_ptr<const Manifest>> manifests_ WFS_GUARDED_BY(mu_);
  std::list<uint64_t> manifest_order_ WFS_GUARDED_BY(mu_);
};

}  // namespace

std::string TrlVersionName(uint64_t step) { return "step-" + std::to_string(step); }

Expected<std::vector<uint64_t>> DecodeTrlIndices(std::span<const uint8_t> bytes, DType dtype,
                                                 std::string_view encoding, uint64_t numel,
                                                 std::string_view what) {
  auto bad = [&](const std::string& m) { return Status::Corruption(std::string(what) + ": " + m); };
  bool gaps;
  if (encoding == "raw") {
    if (dtype != DType::kI32) return bad("raw indices must be I32, not " + std::string(DTypeName(dtype)));
    gaps = false;
  } else if (encoding == "gap_delta") {
    if (dtype != DType::kU16 && dtype != DType::kU32) {
      return bad("gap_delta indices must be U16 or U32, not " + std::string(DTypeName(dtype)));
    }
    gaps = true;
  } else if (encoding.empty()) {
    if (dtype == DType::kI32) {
      gaps = false;
    } else if (dtype == DType::kU16 || dtype == DType::kU32) {
      gaps = true;
    } else {
      return bad("indices of dtype " + std::string(DTypeName(dtype)) + " (expected I32, U16 or U32)");
    }
  } else {
    return bad("unknown index encoding " + Quoted(encoding));
  }
  const size_t w = DTypeSize(dtype);
  if (bytes.size() % w != 0) return bad("index bytes are not a whole number of elements");
  const size_t n = bytes.size() / w;
  if (n > numel) return bad(std::to_string(n) + " indices for " + std::to_string(numel) + " elements");
  std::vector<uint64_t> out;
  out.reserve(n);
  uint64_t next = 0;  // the smallest index allowed next
  for (size_t k = 0; k < n; ++k) {
    const uint8_t* p = bytes.data() + k * w;
    uint64_t v;
    if (w == 2) {
      v = static_cast<uint64_t>(p[0]) | static_cast<uint64_t>(p[1]) << 8;
    } else {
      const uint32_t u = static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
                         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
      if (!gaps && static_cast<int32_t>(u) < 0) {
        return bad("index " + std::to_string(static_cast<int32_t>(u)) + " at position " + std::to_string(k) + " is negative");
      }
      v = u;
    }
    uint64_t idx;
    if (gaps) {
      idx = next + v;  // idx[k] = idx[k-1] + 1 + gap[k], idx[-1] = -1
    } else {
      if (v < next) {
        return bad("indices not strictly increasing at position " + std::to_string(k) + " (" + std::to_string(v) +
                   " after " + std::to_string(out.back()) + ")");
      }
      idx = v;
    }
    if (idx >= numel) {
      return bad("index " + std::to_string(idx) + " at position " + std::to_string(k) + " is out of range for " +
                 std::to_string(numel) + " elements");
    }
    out.push_back(idx);
    next = idx + 1;
  }
  return out;
}

Expected<std::shared_ptr<TrlVersions>> OpenTrlVersions(std::shared_ptr<Store> store, std::string model,
                                                       const TrlOptions& options) {
  WFS_TRY(ValidateModelName(model));
  auto impl = std::make_shared<TrlVersionsImpl>(store, std::move(model), options);
  WFS_ASSIGN_OR_RETURN(std::shared_ptr<const Listing> l, impl->Refresh());
  if (l->steps.empty()) {
    return Status::NotFound("bucket " + store->Describe() +
                            " holds no TRL delta-sync layout either (no anchors/step_NNNNNN.safetensors or "
                            "deltas/step_NNNNNN.safetensors)");
  }
  return std::shared_ptr<TrlVersions>(std::move(impl));
}

}  // namespace weightfs

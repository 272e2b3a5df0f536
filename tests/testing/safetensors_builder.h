// SafetensorsBuilder: the bytes of a safetensors file for tests — tensors of given dtypes and
// shapes, with given data or a deterministic pattern, and __metadata__ — laid out by the
// product's own writer (core/safetensors.h: BuildSafetensorsHeader, in the order added). For a
// parser test, RawHeader puts any JSON (malformed too) behind the length prefix instead.
// Build() returns the bytes, WriteTo(path) writes them. Header-only, without GoogleTest.
//
//   auto bytes = test::SafetensorsBuilder()
//                    .Add("w", DType::kBF16, {4, 3})            // 24 pattern bytes
//                    .Add("b", DType::kF32, {2}, my_eight_bytes)
//                    .Metadata("format", "pt")
//                    .Build();
#pragma once

#include <cstdint>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/safetensors.h"

namespace weightfs::test {

// A tensor description with offsets left for the writer to assign.
inline TensorInfo TensorSpec(std::string name, DType dtype, std::vector<uint64_t> shape) {
  TensorInfo t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.shape = std::move(shape);
  return t;
}

// The 8-byte little-endian length prefix of a header of `n` bytes.
inline std::vector<uint8_t> SafetensorsLengthPrefix(uint64_t n) {
  std::vector<uint8_t> out(8);
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(n >> (8 * i));
  return out;
}

class SafetensorsBuilder {
 public:
  // A tensor whose data is `bytes` (not checked against shape x dtype: a test may want a
  // mismatch).
  SafetensorsBuilder& Add(std::string name, DType dtype, std::vector<uint64_t> shape, std::vector<uint8_t> bytes) {
    tensors_.push_back({TensorSpec(std::move(name), dtype, std::move(shape)), std::move(bytes)});
    return *this;
  }
  // A tensor of shape x dtype bytes of the pattern (see Seed).
  SafetensorsBuilder& Add(std::string name, DType dtype, std::vector<uint64_t> shape) {
    tensors_.push_back({TensorSpec(std::move(name), dtype, std::move(shape)), std::nullopt});
    return *this;
  }
  // The same for a TensorInfo (its begin and end are ignored: the writer assigns them).
  SafetensorsBuilder& Add(const TensorInfo& t) { return Add(t.name, t.dtype, t.shape); }
  SafetensorsBuilder& Add(const std::vector<TensorInfo>& ts) {
    for (const TensorInfo& t : ts) Add(t);
    return *this;
  }
  SafetensorsBuilder& Metadata(std::string key, std::string value) {
    metadata_[std::move(key)] = std::move(value);
    return *this;
  }
  SafetensorsBuilder& Metadata(const std::map<std::string, std::string>& md) {
    for (const auto& [k, v] : md) metadata_[k] = v;
    return *this;
  }
  // The pattern of tensors added without data: byte i of the data section is i * 37 + seed.
  SafetensorsBuilder& Seed(uint64_t seed) {
    seed_ = seed;
    return *this;
  }
  // Uses `json` verbatim as the header (no padding) instead of the one the tensors describe;
  // the tensors' data still follows it.
  SafetensorsBuilder& RawHeader(std::string_view json) {
    raw_header_ = std::string(json);
    return *this;
  }
  // Bytes after the tensors' data (a data section longer than the header says).
  SafetensorsBuilder& Trailing(std::vector<uint8_t> bytes) {
    trailing_ = std::move(bytes);
    return *this;
  }

  // The 8 + N prefix: length and header JSON.
  std::vector<uint8_t> Header() const { return Layout().first; }
  // Where the data section starts (8 + N).
  uint64_t DataOffset() const { return Header().size(); }
  // The tensors with the offsets (relative to the data section) the header gives them.
  std::vector<TensorInfo> Tensors() const {
    std::vector<TensorInfo> infos;
    for (const auto& e : tensors_) infos.push_back(e.info);
    (void)BuildSafetensorsHeader(infos, metadata_);
    return infos;
  }

  std::vector<uint8_t> Build() const {
    auto [out, infos] = Layout();
    const uint64_t data_start = out.size();
    for (size_t i = 0; i < tensors_.size(); ++i) {
      if (tensors_[i].bytes) {
        out.insert(out.end(), tensors_[i].bytes->begin(), tensors_[i].bytes->end());
      } else {
        for (uint64_t k = 0; k < infos[i].size(); ++k) {
          out.push_back(static_cast<uint8_t>((out.size() - data_start) * 37 + seed_));
        }
      }
    }
    out.insert(out.end(), trailing_.begin(), trailing_.end());
    return out;
  }

  // Writes Build() to `path`; false if it cannot.
  bool WriteTo(const std::string& path) const {
    const std::vector<uint8_t> bytes = Build();
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    f.close();
    return f.good();
  }

 private:
  struct Entry {
    TensorInfo info;
    std::optional<std::vector<uint8_t>> bytes;
  };

  std::pair<std::vector<uint8_t>, std::vector<TensorInfo>> Layout() const {
    std::vector<TensorInfo> infos;
    for (const auto& e : tensors_) infos.push_back(e.info);
    std::vector<uint8_t> header = BuildSafetensorsHeader(infos, metadata_);
    if (raw_header_) {
      header = SafetensorsLengthPrefix(raw_header_->size());
      header.insert(header.end(), raw_header_->begin(), raw_header_->end());
    }
    return {std::move(header), std::move(infos)};
  }

  std::vector<Entry> tensors_;
  std::map<std::string, std::string> metadata_;
  uint64_t seed_ = 0;
  std::optional<std::string> raw_header_;
  std::vector<uint8_t> trailing_;
};

}  // namespace weightfs::test

// libFuzzer target for core/safetensors. Each input is tried twice: as a whole file (its size is
// the file size), and as a data-section size plus header JSON (see LLVMFuzzerTestOneInput).
// Beyond "never crash", every accepted header must satisfy what the reader promises -- tensors
// inside the data section, sorted, tiling it exactly, size matching shape x dtype -- and must
// survive BuildSafetensorsHeader -> ParseSafetensorsHeader unchanged.
//
//   cmake -DWEIGHTFS_FUZZ=ON -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang ...
//   ./safetensors_fuzz -max_total_time=60 corpus/
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "core/safetensors.h"
#include "tests/testing/safetensors_builder.h"

namespace {

using weightfs::DType;
using weightfs::SafetensorsHeader;
using weightfs::TensorInfo;

void Check(bool condition) {
  if (!condition) __builtin_trap();
}

// Independent of the reader's arithmetic: product(shape) * size, or false when the non-zero
// factors overflow u64 (the reader's rule).
bool Bytes(const TensorInfo& t, uint64_t* out) {
  uint64_t product = weightfs::DTypeSize(t.dtype);
  bool empty = false;
  for (uint64_t d : t.shape) {
    if (d == 0) {
      empty = true;
      continue;
    }
    if (product > UINT64_MAX / d) return false;
    product *= d;
  }
  *out = empty ? 0 : product;
  return true;
}

void CheckInvariants(const SafetensorsHeader& h, uint64_t file_size) {
  Check(h.header_size > 0 && h.header_size <= weightfs::kMaxSafetensorsHeaderBytes);
  Check(h.data_offset == 8 + h.header_size);
  Check(h.file_size == file_size);
  Check(h.data_offset <= file_size);
  const uint64_t data_size = file_size - h.data_offset;
  uint64_t cursor = 0;
  const TensorInfo* prev = nullptr;
  for (const TensorInfo& t : h.tensors) {
    Check(!t.name.empty() && t.name != "__metadata__");
    Check(t.dtype != DType::kOpaque);
    Check(t.begin == cursor);  // contiguous from 0: no gap, no overlap
    Check(t.begin <= t.end && t.end <= data_size);
    uint64_t bytes = 0;
    Check(Bytes(t, &bytes));
    Check(bytes == t.size());
    if (prev != nullptr) {
      Check(std::tie(prev->begin, prev->end, prev->name) < std::tie(t.begin, t.end, t.name));
    }
    cursor = t.end;
    prev = &t;
  }
  Check(cursor == data_size);
}

void CheckRoundTrip(const SafetensorsHeader& h) {
  std::vector<TensorInfo> tensors = h.tensors;
  const std::vector<uint8_t> prefix = weightfs::BuildSafetensorsHeader(tensors, h.metadata);
  Check(prefix.size() % 8 == 0);
  // Already contiguous in this order, so Build keeps every offset.
  for (size_t i = 0; i < tensors.size(); ++i) {
    Check(tensors[i].begin == h.tensors[i].begin && tensors[i].end == h.tensors[i].end);
  }
  auto n = weightfs::SafetensorsPrefixLength(prefix);
  Check(n.ok() && *n == prefix.size());

  const uint64_t data_size = h.file_size - h.data_offset;
  auto again = weightfs::ParseSafetensorsHeader(prefix, prefix.size() + data_size);
  Check(again.ok());
  Check(again->header_size == prefix.size() - 8);
  Check(again->metadata == h.metadata);
  Check(again->tensors.size() == h.tensors.size());
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    const TensorInfo& a = again->tensors[i];
    const TensorInfo& b = h.tensors[i];
    Check(a.name == b.name && a.dtype == b.dtype && a.shape == b.shape && a.begin == b.begin &&
          a.end == b.end);
  }
}

void FuzzFile(std::span<const uint8_t> file, uint64_t file_size) {
  auto prefix_length = weightfs::SafetensorsPrefixLength(file);
  auto parsed = weightfs::ParseSafetensorsHeader(file, file_size);
  if (!parsed.ok()) {
    Check(parsed.status().kind() == weightfs::ErrorKind::kCorruption ||
          parsed.status().kind() == weightfs::ErrorKind::kResourceExhausted);
    // The reader's catch-all for nlohmann exceptions must stay unreachable. (Match the start:
    // other messages quote input bytes, which may spell anything.)
    Check(parsed.status().message().rfind("safetensors header: unexpected JSON exception", 0) ==
          std::string::npos);
    return;
  }
  Check(prefix_length.ok() && *prefix_length == parsed->data_offset);
  CheckInvariants(*parsed, file_size);
  CheckRoundTrip(*parsed);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // 1. The input is a whole file.
  FuzzFile(std::span<const uint8_t>(data, size), size);

  // 2. The input is a u16 data-section size followed by the header JSON; the length field is
  // filled in. Random files almost never get N and the data size both right, so without this
  // few inputs would reach the tensor checks and the round trip.
  if (size >= 2) {
    const uint64_t data_size = data[0] | (uint64_t{data[1]} << 8);
    const std::vector<uint8_t> prefix =
        weightfs::test::SafetensorsBuilder()
            .RawHeader(std::string_view(reinterpret_cast<const char*>(data) + 2, size - 2))
            .Header();
    FuzzFile(prefix, prefix.size() + data_size);
  }
  return 0;
}

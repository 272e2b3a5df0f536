// Safetensors: a strict reader and a writer of the safetensors file header.
//
// File layout (https://github.com/huggingface/safetensors):
//   u64 little-endian N | N bytes of UTF-8 JSON header | data section
// The JSON is an object: "__metadata__" (optional, string -> string) and, for every tensor,
//   "name": {"dtype": "BF16", "shape": [d0, d1, ...], "data_offsets": [begin, end]}
// with offsets relative to the start of the data section.
//
// The reader is strict because its output drives the chunk plan and the codecs: the header
// length is bounded, the JSON must parse, every dtype must be one safetensors defines, offsets
// must lie inside the file, tensors must tile the data section contiguously without overlap or
// gaps, and shape x dtype size must equal the byte range. Anything else is rejected with a
// Corruption status naming the tensor and the rule; callers then treat the file as opaque bytes
// (a file that is not valid safetensors is not an error for weightfs).
//
// Pure functions over bytes; thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"

namespace weightfs {

// Header JSON larger than this is rejected (the reference implementation uses 100 MB).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull << 20;

struct TensorInfo {
  std::string name;
  DType dtype = DType::kOpaque;
  std::vector<uint64_t> shape;
  uint64_t begin = 0;  // byte offset relative to the data section
  uint64_t end = 0;    // one past the last byte, relative to the data section
  uint64_t size() const { return end - begin; }
};

struct SafetensorsHeader {
  uint64_t header_size = 0;      // N: bytes of JSON (including any trailing padding spaces)
  uint64_t data_offset = 0;      // 8 + N: where the data section starts in the file
  uint64_t file_size = 0;        // data_offset + data section size
  std::vector<TensorInfo> tensors;  // sorted by begin offset
  std::map<std::string, std::string> metadata;  // "__metadata__", kept verbatim
};

// Reads the first 8 bytes of a file. Returns the total prefix length (8 + N) a caller must
// read to call ParseSafetensorsHeader, or Corruption if N is zero or above the bound.
// REQUIRES: prefix.size() >= 8 (otherwise Corruption).
Expected<uint64_t> SafetensorsPrefixLength(std::span<const uint8_t> prefix);

// Parses and validates the header. `prefix` holds at least the first 8 + N bytes of the file;
// `file_size` is the size of the whole file (the data section must end exactly there).
Expected<SafetensorsHeader> ParseSafetensorsHeader(std::span<const uint8_t> prefix,
                                                   uint64_t file_size);

// A file to be stored, read as safetensors: its header when it is one, nullopt for opaque bytes
// (PlanFile's verdict, from one parse). A file that claims to be safetensors and is not is
// InvalidArgument naming `path` and what is wrong (truncated, JSON that does not parse, a
// tensor outside the file or over another...). It claims to by its name (`*.safetensors`) or
// by its first bytes (a header length that fits the file, then '{'). `file` holds the whole
// file (at least the 8 + N prefix, else no verdict: nullopt), `file_size` bytes in all.
Expected<std::optional<SafetensorsHeader>> CheckSafetensors(std::string_view path, std::span<const uint8_t> file,
                                                            uint64_t file_size);

// Builds the 8 + N prefix bytes of a safetensors file for `tensors` laid out in the given order
// (their begin/end are rewritten to be contiguous from 0), padded with spaces so that the data
// section starts at a multiple of 8 bytes, as the reference writer does.
std::vector<uint8_t> BuildSafetensorsHeader(std::vector<TensorInfo>& tensors,
                                            const std::map<std::string, std::string>& metadata);

}  // namespace weightfs

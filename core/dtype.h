// DType: the element types safetensors defines, and what the codecs need to know about them.
// Plain value type; all functions are pure and thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace weightfs {

enum class DType : uint8_t {
  kOpaque = 0,  // not a tensor: bytes of unknown structure (headers, non-safetensors files)
  kF64 = 1,
  kF32 = 2,
  kF16 = 3,
  kBF16 = 4,
  kF8E4M3 = 5,
  kF8E5M2 = 6,
  kI64 = 7,
  kI32 = 8,
  kI16 = 9,
  kI8 = 10,
  kU64 = 11,
  kU32 = 12,
  kU16 = 13,
  kU8 = 14,
  kBool = 15,
};
inline constexpr int kDTypeCount = 16;

// Bytes per element; 1 for kOpaque.
size_t DTypeSize(DType dt);
// True for the floating-point formats (sign-magnitude bit patterns).
bool DTypeIsFloat(DType dt);
// The safetensors spelling ("BF16", "F8_E4M3", ...); "OPAQUE" for kOpaque.
std::string_view DTypeName(DType dt);
// Parses a safetensors dtype string; nullopt when unknown.
std::optional<DType> ParseDType(std::string_view name);
// Decodes a dtype byte read from untrusted input; nullopt when out of range.
std::optional<DType> DTypeFromByte(uint8_t b);

}  // namespace weightfs

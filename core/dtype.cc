#include "core/dtype.h"

#include <array>

namespace weightfs {
namespace {

struct DTypeInfo {
  std::string_view name;
  uint8_t size;
  bool is_float;
};

constexpr std::array<DTypeInfo, kDTypeCount> kInfo = {{
    {"OPAQUE", 1, false},
    {"F64", 8, true},
    {"F32", 4, true},
    {"F16", 2, true},
    {"BF16", 2, true},
    {"F8_E4M3", 1, true},
    {"F8_E5M2", 1, true},
    {"I64", 8, false},
    {"I32", 4, false},
    {"I16", 2, false},
    {"I8", 1, false},
    {"U64", 8, false},
    {"U32", 4, false},
    {"U16", 2, false},
    {"U8", 1, false},
    {"BOOL", 1, false},
}};

}  // namespace

size_t DTypeSize(DType dt) { return kInfo[static_cast<size_t>(dt)].size; }
bool DTypeIsFloat(DType dt) { return kInfo[static_cast<size_t>(dt)].is_float; }
std::string_view DTypeName(DType dt) { return kInfo[static_cast<size_t>(dt)].name; }

std::optional<DType> ParseDType(std::string_view name) {
  for (size_t i = 1; i < kInfo.size(); ++i) {
    if (kInfo[i].name == name) return static_cast<DType>(i);
  }
  return std::nullopt;
}

std::optional<DType> DTypeFromByte(uint8_t b) {
  if (b >= kDTypeCount) return std::nullopt;
  return static_cast<DType>(b);
}

}  // namespace weightfs

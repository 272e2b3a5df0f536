// Small byte helpers the suites share (each test file had its own copy; a unity build puts several
// test files in one translation unit, where two copies collide). Header-only, no GoogleTest.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/hash.h"

namespace weightfs::test {

// Whether AddressSanitizer is on (it maps terabytes of shadow memory, and makes the JSON DOM
// ~10x slower): suites size their work by it.
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(memory_sanitizer)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
#else
inline constexpr bool kSanitized = false;
#endif

inline std::vector<uint8_t> Bytes(const std::string& s) { return {s.begin(), s.end()}; }

inline std::span<const uint8_t> AsBytes(std::string_view s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

inline std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::vector<uint8_t> out(n);
  std::mt19937 rng(seed);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

// A distinct, recognizable hash for row n.
inline Hash128 H(uint64_t n) { return Hash128{0x0123456789abcdefull ^ n, n * 0x9e3779b97f4a7c15ull}; }

// float -> bf16, round to nearest even (NaN stays NaN).
inline uint16_t Bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFF) > 0x7F800000) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// A zstd frame (RFC 8878) by hand that inflates to `prefix`, `fill` bytes of `c`, then `suffix`:
// the fill in RLE blocks of 128 KiB (4 bytes each, so 200 MiB cost ~6 KiB), the rest in raw
// blocks. The frame declares `claimed` bytes (the truth by default) and a window of
// 2^window_log bytes (not single-segment).
inline std::vector<uint8_t> RleFrame(std::string_view prefix, char c, uint64_t fill, std::string_view suffix,
                                     std::optional<uint64_t> claimed = std::nullopt, int window_log = 17) {
  std::vector<uint8_t> f = {0x28, 0xB5, 0x2F, 0xFD, 0xC0, static_cast<uint8_t>((window_log - 10) << 3)};
  const uint64_t size = claimed.value_or(prefix.size() + fill + suffix.size());
  for (int i = 0; i < 8; ++i) f.push_back(static_cast<uint8_t>(size >> (8 * i)));
  auto block = [&](uint32_t type, uint32_t n, bool last) {
    const uint32_t header = (n << 3) | (type << 1) | (last ? 1u : 0u);
    for (int i = 0; i < 3; ++i) f.push_back(static_cast<uint8_t>(header >> (8 * i)));
  };
  auto raw = [&](std::string_view bytes, bool last) {
    for (size_t at = 0; at < bytes.size() || (last && at == 0); at += 128 << 10) {
      const std::string_view part = bytes.substr(at, 128 << 10);
      block(0, static_cast<uint32_t>(part.size()), last && at + part.size() >= bytes.size());
      f.insert(f.end(), part.begin(), part.end());
      if (part.empty()) break;
    }
  };
  if (!prefix.empty()) raw(prefix, false);
  for (uint64_t left = fill; left > 0;) {
    const uint32_t n = static_cast<uint32_t>(std::min<uint64_t>(left, 128 << 10));
    block(1, n, false);
    f.push_back(static_cast<uint8_t>(c));
    left -= n;
  }
  raw(suffix, true);
  return f;
}

}  // namespace weightfs::test

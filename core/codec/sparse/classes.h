// Exponent classes of the sparse codec (internal to core/codec/sparse): which class each
// element of the parent falls in, and the bit tricks the sweeps use to find a class's members
// in a block of 64 elements. Every body version and sweep shares these; they sit in hot loops,
// so they are defined here, inline. Pure functions; thread-safe.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "core/dtype.h"
#include "core/element_ops.h"

namespace weightfs::sparse::detail {

constexpr int kMaxClasses = 16;
constexpr uint8_t kNoClass = 0xFF;  // padding after the last element

struct ExponentField {
  int shift = 0;
  uint32_t mask = 0;  // 0: no classes for this dtype
};

inline ExponentField ExponentOf(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return {7, 0xFF};
    case DType::kF16: return {10, 0x1F};
    case DType::kF32: return {23, 0xFF};
    case DType::kF64: return {52, 0x7FF};
    case DType::kF8E4M3: return {3, 0xF};
    case DType::kF8E5M2: return {2, 0x1F};
    default: return {0, 0};
  }
}

template <typename T>
void ComputeClasses(const uint8_t* parent, size_t n, ExponentField f, int e_lo, int k,
                    uint8_t* classes) {
  const int top = k - 1;
  size_t i = 0;
#if defined(__SSE2__)
  if constexpr (sizeof(T) == 2) {
    // bf16 and f16, 16 elements per step: exponent field, saturating subtract of e_lo (clamps
    // below at 0), min with the top class (the field is at most 0xFF, so signed min is exact),
    // packed to bytes. The decoder runs this over every element of every delta of a chain.
    const __m128i mask = _mm_set1_epi16(static_cast<int16_t>(f.mask));
    const __m128i lo = _mm_set1_epi16(static_cast<int16_t>(e_lo));
    const __m128i hi = _mm_set1_epi16(static_cast<int16_t>(top));
    const __m128i shift = _mm_cvtsi32_si128(f.shift);
    auto classes8 = [&](const uint8_t* p) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      const __m128i e = _mm_and_si128(_mm_srl_epi16(v, shift), mask);
      return _mm_min_epi16(_mm_subs_epu16(e, lo), hi);
    };
    for (; i + 16 <= n; i += 16) {
      const __m128i a = classes8(parent + i * 2);
      const __m128i b = classes8(parent + i * 2 + 16);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(classes + i), _mm_packus_epi16(a, b));
    }
  }
#endif
  for (; i < n; ++i) {
    const int e = static_cast<int>((elem::Load<T>(parent + i * sizeof(T)) >> f.shift) & f.mask);
    const int c = std::clamp(e - e_lo, 0, top);
    classes[i] = static_cast<uint8_t>(c);
  }
}

// Bit j set when classes[j] == c, for the 64 bytes at p.
inline uint64_t ClassMask(const uint8_t* p, uint8_t c) {
#if defined(__SSE2__)
  const __m128i v = _mm_set1_epi8(static_cast<char>(c));
  uint64_t m = 0;
  for (int q = 0; q < 4; ++q) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * q));
    m |= static_cast<uint64_t>(static_cast<uint16_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(x, v))))
         << (16 * q);
  }
  return m;
#else
  uint64_t m = 0;
  for (int j = 0; j < 64; ++j) m |= static_cast<uint64_t>(p[j] == c) << j;
  return m;
#endif
}

// kSelectInByte[k][b]: index of the k-th set bit of byte b (0 when b has fewer bits).
inline constexpr auto kSelectInByte = [] {
  std::array<std::array<uint8_t, 256>, 8> t{};
  for (int b = 0; b < 256; ++b) {
    int k = 0;
    for (int i = 0; i < 8; ++i) {
      if (b & (1 << i)) t[k++][b] = static_cast<uint8_t>(i);
    }
  }
  return t;
}();

// Index of the k-th (0-based) set bit, branch-free (broadword select: byte popcounts, their
// prefix sums by one multiply, the target byte by a SIMD-within-a-register compare, then a
// table). REQUIRES: k < popcount(x).
[[gnu::always_inline]] inline int SelectBit(uint64_t x, uint32_t k) {
  constexpr uint64_t kOnes = 0x0101010101010101ull;
  constexpr uint64_t kMsbs = 0x8080808080808080ull;
  uint64_t s = x - ((x >> 1) & 0x5555555555555555ull);
  s = (s & 0x3333333333333333ull) + ((s >> 2) & 0x3333333333333333ull);
  s = ((s + (s >> 4)) & 0x0F0F0F0F0F0F0F0Full) * kOnes;  // byte i: bits set in bytes 0..i
  const uint64_t le = ((uint64_t{k} * kOnes) | kMsbs) - s;  // msb set where prefix <= k
  const int byte = std::popcount(le & kMsbs);
  const auto before = static_cast<uint32_t>(((s << 8) >> (8 * byte)) & 0xFF);
  const auto bits = static_cast<uint32_t>((x >> (8 * byte)) & 0xFF);
  return 8 * byte + kSelectInByte[k - before][bits];
}

// Exponent class parameters of two-byte floats, for blocks that compute their classes from the
// parent's elements (the fused sweep: no class array written and read back).
struct ClassParams {
  int shift;
  uint32_t mask;
  int e_lo;
  int top;  // k - 1
};

}  // namespace weightfs::sparse::detail

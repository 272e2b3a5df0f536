// Element-level helpers shared by the codecs: unaligned loads and stores, the order-preserving
// integer view of floats, zigzag, and dispatch on element width. Also used by the codec
// benchmark, whose entropy floor must measure differences exactly as the codec forms them.
// Pure inline functions; thread-safe.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace weightfs::elem {

template <typename T>
inline T Load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}
template <typename T>
inline void Store(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

// Order-preserving map of a sign-magnitude float bit pattern to an unsigned integer (a
// bijection on all bit patterns, NaNs included); identity for integers. A small change of a
// float value becomes a small integer difference, also across zero (-0 and +0 are adjacent).
template <typename T>
inline T ToOrd(T u, bool is_float) {
  constexpr T kSign = T(T(1) << (sizeof(T) * 8 - 1));
  if (!is_float) return u;
  return (u & kSign) ? T(~u) : T(u | kSign);
}
template <typename T>
inline T FromOrd(T o, bool is_float) {
  constexpr T kSign = T(T(1) << (sizeof(T) * 8 - 1));
  if (!is_float) return o;
  return (o & kSign) ? T(o & T(~kSign)) : T(~o);
}
template <typename T>
inline T ZigZag(T d) {
  using S = std::make_signed_t<T>;
  return T(T(d << 1) ^ T(S(d) >> (sizeof(T) * 8 - 1)));
}
template <typename T>
inline T UnZigZag(T z) {
  return T(T(z >> 1) ^ T(T(0) - T(z & 1)));
}

inline int BitLength(uint64_t v) { return 64 - std::countl_zero(v); }

// Calls fn.template operator()<T>() with T the unsigned integer of `width` bytes (1, 2, 4, 8).
template <typename Fn>
decltype(auto) DispatchWidth(size_t width, Fn&& fn) {
  switch (width) {
    case 2: return fn.template operator()<uint16_t>();
    case 4: return fn.template operator()<uint32_t>();
    case 8: return fn.template operator()<uint64_t>();
    default: return fn.template operator()<uint8_t>();
  }
}

}  // namespace weightfs::elem

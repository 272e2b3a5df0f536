// Helpers shared by the libFuzzer targets: a reader that carves typed fields out of the fuzz
// input (returning zeros once it runs out), and a check that traps so the fuzzer records it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

namespace weightfs::fuzz {

inline void Check(bool condition) {
  if (!condition) __builtin_trap();
}

class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  uint8_t U8() {
    if (n_ == 0) return 0;
    --n_;
    return *p_++;
  }
  uint16_t U16() { return static_cast<uint16_t>(U8() | (U8() << 8)); }
  std::span<const uint8_t> Take(size_t k) {
    k = std::min(k, n_);
    std::span<const uint8_t> s(p_, k);
    p_ += k;
    n_ -= k;
    return s;
  }
  std::span<const uint8_t> Rest() { return Take(n_); }
  bool empty() const { return n_ == 0; }

 private:
  const uint8_t* p_;
  size_t n_;
};

}  // namespace weightfs::fuzz

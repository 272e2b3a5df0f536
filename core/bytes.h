// ByteBuffer: a std::vector<uint8_t> whose resize() does not zero the new bytes.
//
// Chunk buffers are resized to a few MiB and then overwritten entirely (by a decoder, a read or
// a copy); zero-filling them first costs a full extra pass over memory, measured at ~20% of a
// cached chunk read. Anything that reads a ByteBuffer must first write what it reads.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace weightfs {

template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  using std::allocator<T>::allocator;
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;  // default-init: no zeroing for trivial types
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

using ByteBuffer = std::vector<uint8_t, DefaultInitAllocator<uint8_t>>;

}  // namespace weightfs

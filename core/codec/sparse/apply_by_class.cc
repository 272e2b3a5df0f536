// The class sweep of the sparse codec's decoder: maps class-local indices to positions and
// applies the differences, block by block, with the instruction set chosen at run time
// (SSE2, AVX2 or AVX-512; the blocks are in blocks.h), and that choice (BestSimd, g_simd).
// Both body versions decode through it when they have exponent classes.
#include <algorithm>
#include <atomic>
#include <bit>
#include <vector>

#include "core/codec/sparse/blocks.h"
#include "core/codec/sparse/internal.h"

namespace weightfs::sparse::detail {
namespace {

// Applies changes given per class as class-local indices (local[class_start[c]..
// class_start[c + 1]) ascending, with their differences) in one sweep over the blocks: per
// block, every class counts its members there (a fixed loop over the classes, no branch), a
// bit mask records which classes have a change in the block, and only those patch (the block
// is copied from the parent first, so the order of patches within it does not matter). The
// mask replaced a branch per class and block that mispredicted about half the time at 5-10%
// changed. Returns false if an index lies beyond the class's members. Block::Select(mask, r)
// is the position of the r-th set bit of mask.
// (Not always_inline: the ISA wrappers below flatten it, with their own target.)
//
// With a ClassParams (two-byte floats, AVX2 or AVX-512), `classes` holds only the last block's
// 64 classes (padded with kNoClass) and every other block computes its classes from the parent
// in registers; in place, a block is read before it is patched.
template <typename Block, typename T, typename Writer>
bool ApplyByClassT(const uint8_t* classes, const ClassParams* fused, size_t n, int k,
                   const uint32_t* class_start, const uint32_t* local, const T* diffs,
                   Writer& writer_ref) {
  Writer writer = writer_ref;  // a local copy lives in registers across the stores
  uint32_t seen[kMaxClasses] = {};  // members of the class before the current block
  uint32_t next[kMaxClasses];       // the class's next change
  uint32_t next_local[kMaxClasses]; // its class-local index (UINT32_MAX: none left)
  for (int c = 0; c < k; ++c) {
    next[c] = class_start[c];
    next_local[c] = class_start[c] < class_start[c + 1] ? local[class_start[c]] : UINT32_MAX;
  }
  size_t remaining = class_start[k];
  const size_t blocks = (n + 63) / 64;
  for (size_t b = 0; b < blocks && remaining != 0; ++b) {
    const size_t first = b * 64;
    const Block block = [&] {
      if constexpr (Block::kFusable) {
        if (fused != nullptr) {
          return first + 64 <= n ? Block(writer.parent + first * sizeof(T), *fused) : Block(classes);
        }
      }
      return Block(classes + first);
    }();
    writer.CopyBlock(first);
    uint64_t masks[kMaxClasses];
    uint32_t before[kMaxClasses];
    uint32_t hits = 0;
    for (int c = 0; c < k; ++c) {
      masks[c] = block.Mask(static_cast<uint8_t>(c));
      before[c] = seen[c];
      seen[c] += static_cast<uint32_t>(std::popcount(masks[c]));
      hits |= static_cast<uint32_t>(next_local[c] < seen[c]) << c;
    }
    for (; hits != 0; hits &= hits - 1) {
      const int c = std::countr_zero(hits);
      const uint32_t end = class_start[c + 1];
      uint32_t j = next[c];
      do {
        const size_t pos = first + static_cast<size_t>(
                                       Block::Select(masks[c], local[j] - before[c]));
        writer.Patch(pos, diffs[j]);
      } while (++j < end && local[j] < seen[c]);
      remaining -= j - next[c];
      next[c] = j;
      next_local[c] = j < end ? local[j] : UINT32_MAX;
    }
  }
  writer_ref = writer;
  return remaining == 0;
}

#if defined(__x86_64__)
template <typename T, typename Writer>
[[gnu::target("avx2"), gnu::flatten]] bool ApplyByClassAvx2(
    const uint8_t* classes, const ClassParams* fused, size_t n, int k, const uint32_t* class_start,
    const uint32_t* local, const T* diffs, Writer& writer) {
  return ApplyByClassT<BlockAvx2>(classes, fused, n, k, class_start, local, diffs, writer);
}
template <typename T, typename Writer>
[[gnu::target("avx512f,avx512bw,bmi2"), gnu::flatten]] bool ApplyByClassAvx512(
    const uint8_t* classes, const ClassParams* fused, size_t n, int k, const uint32_t* class_start,
    const uint32_t* local, const T* diffs, Writer& writer) {
  return ApplyByClassT<BlockAvx512>(classes, fused, n, k, class_start, local, diffs, writer);
}
#endif

}  // namespace

Simd BestSimd() {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("bmi2")) return Simd::kAvx512;
  if (__builtin_cpu_supports("avx2")) return Simd::kAvx2;
#endif
  return Simd::kSse2;
}

std::atomic<Simd> g_simd{BestSimd()};

template <typename T, typename Writer>
bool ApplyByClass(const uint8_t* parent, ExponentField f, int e_lo, size_t n, int k,
                  const uint32_t* class_start, const uint32_t* local, const T* diffs,
                  Scratch* scratch, Writer& writer) {
  const Simd simd = g_simd.load(std::memory_order_relaxed);
  std::vector<uint8_t>& classes = scratch->classes;
  ClassParams params{f.shift, f.mask, e_lo, k - 1};
  const ClassParams* fused = nullptr;
  if (sizeof(T) == 2 && simd != Simd::kSse2) {
    // Fused: only the last, partial block's classes are computed here.
    classes.assign(64, kNoClass);
    const size_t tail = n % 64;
    ComputeClasses<T>(parent + (n - tail) * sizeof(T), tail, f, e_lo, k, classes.data());
    fused = &params;
  } else {
    classes.resize((n + 63) / 64 * 64);
    std::fill(classes.begin() + static_cast<ptrdiff_t>(n), classes.end(), kNoClass);
    ComputeClasses<T>(parent, n, f, e_lo, k, classes.data());
  }
  switch (simd) {
#if defined(__x86_64__)
    case Simd::kAvx512:
      return ApplyByClassAvx512(classes.data(), fused, n, k, class_start, local, diffs, writer);
    case Simd::kAvx2:
      return ApplyByClassAvx2(classes.data(), fused, n, k, class_start, local, diffs, writer);
#endif
    default:
      return ApplyByClassT<BlockSse2>(classes.data(), nullptr, n, k, class_start, local, diffs, writer);
  }
}

#define WFS_INSTANTIATE(T)                                                                      \
  template bool ApplyByClass<T, OutputWriter<T>>(const uint8_t*, ExponentField, int, size_t,    \
                                                 int, const uint32_t*, const uint32_t*,         \
                                                 const T*, Scratch*, OutputWriter<T>&);         \
  template bool ApplyByClass<T, RecordingWriter<T>>(const uint8_t*, ExponentField, int, size_t, \
                                                    int, const uint32_t*, const uint32_t*,      \
                                                    const T*, Scratch*, RecordingWriter<T>&);
WFS_SPARSE_FOR_EACH_WIDTH(WFS_INSTANTIATE)
#undef WFS_INSTANTIATE

}  // namespace weightfs::sparse::detail

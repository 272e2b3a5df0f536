// What the files of the sparse codec share (internal to core/codec/sparse): the range-coder
// binarizations both body versions use, a body's fixed header, the output writers the sweeps
// patch through, the run-time SIMD choice, and the entry points each file offers the others:
//   sparse_coder.cc   public API; the encoder's and decoder's top level (DecodeT)
//   body_v1.cc        version 1, adaptive range coding (EncodeAdaptiveT, DecodeAdaptiveT)
//   body_v2.cc        version 2, static tables and rANS (EncodeStaticT, DecodeStaticT)
//   apply_by_class.cc the class sweep per instruction set and the SIMD choice (ApplyByClass)
//   chain.cc          one sweep for a run of deltas (DecodeChainT)
// The entry points (last section) are function templates defined in the file named and
// instantiated there for every element width (WFS_SPARSE_FOR_EACH_WIDTH); the rest is defined
// here, inline: much of it runs in the decoders' hot loops.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "core/codec/sparse/classes.h"
#include "core/codec/sparse/sparse_coder.h"
#include "core/dtype.h"
#include "core/element_ops.h"
#include "core/range_coder.h"
#include "core/status.h"

// X(T) for every element type of elem::DispatchWidth: explicit instantiations.
#define WFS_SPARSE_FOR_EACH_WIDTH(X) X(uint8_t) X(uint16_t) X(uint32_t) X(uint64_t)

namespace weightfs::sparse::detail {

// ---- range-coder binarizations shared by the version 1 stream and the version 2 class table --

// Sets every probability of an array of rc::Prob (of any shape) to its initial value.
template <typename A>
void FillProbs(A& array) {
  rc::Prob* p = reinterpret_cast<rc::Prob*>(&array);
  std::fill(p, p + sizeof(A) / sizeof(rc::Prob), rc::kProbInit);
}

// Equiprobable bits of any width, in steps of at most 16.
inline void EncodeWide(rc::RangeEncoder& enc, uint64_t v, int nbits) {
  while (nbits > 16) {
    nbits -= 16;
    enc.EncodeBits(static_cast<uint32_t>(v >> nbits) & 0xFFFF, 16);
  }
  if (nbits > 0) enc.EncodeBits(static_cast<uint32_t>(v & ((uint64_t{1} << nbits) - 1)), nbits);
}
[[gnu::always_inline]] inline uint64_t DecodeWide(rc::RangeDecoder& dec, int nbits) {
  uint64_t v = 0;
  while (nbits > 16) {
    nbits -= 16;
    v = (v << 16) | dec.DecodeBits(16);
  }
  if (nbits > 0) v = (v << nbits) | dec.DecodeBits(nbits);
  return v;
}

// Elias-gamma binarization of v >= 1 for rare symbols (counts, escapes): bit length through an
// adaptive 6-bit tree, kTreeBits adaptive mantissa bits, the rest equiprobable.
template <int kTreeBits>
void EncodeGamma(rc::RangeEncoder& enc, rc::Prob* len_probs, rc::Prob (*mant_probs)[1 << kTreeBits],
                 uint64_t v) {
  const int len = elem::BitLength(v);
  enc.EncodeTree(len_probs, 6, static_cast<uint32_t>(len - 1));
  const int m = len - 1;
  const uint64_t rest = v - (uint64_t{1} << m);
  const int top = std::min(m, kTreeBits);
  enc.EncodeTree(mant_probs[len], top, static_cast<uint32_t>(rest >> (m - top)));
  EncodeWide(enc, rest, m - top);
}

// Returns 0 when the decoded bit length exceeds max_len (a corrupt stream).
template <int kTreeBits>
uint64_t DecodeGamma(rc::RangeDecoder& dec, rc::Prob* len_probs,
                     rc::Prob (*mant_probs)[1 << kTreeBits], int max_len) {
  const int len = static_cast<int>(dec.DecodeTree(len_probs, 6)) + 1;
  if (len > max_len) return 0;
  const int m = len - 1;
  const int top = std::min(m, kTreeBits);
  uint64_t rest = dec.DecodeTree(mant_probs[len], top);
  rest = (rest << (m - top)) | DecodeWide(dec, m - top);
  return (uint64_t{1} << m) + rest;
}

// ---- a body's fixed fields ------------------------------------------------------------------

constexpr uint64_t kBodyVersion2 = 2;  // the top byte of a version 2 body's count

// The fixed fields of a body (both versions), validated.
struct BodyHeader {
  uint64_t count = 0;    // changed elements
  uint64_t version = 0;  // 0 (version 1) or kBodyVersion2
  int e_lo = 0;
  int k = 1;
  bool is_float = false;
  ExponentField f;
};

template <typename T>
Status ParseHeader(DType dtype, std::span<const uint8_t> body, size_t n, BodyHeader* h) {
  if (body.size() < 11) return Status::Corruption("sparse body shorter than its header");
  std::memcpy(&h->count, body.data(), 8);
  h->version = h->count >> 56;  // 0 in version 1, whose count is below 2^32
  h->count &= (uint64_t{1} << 56) - 1;
  if (h->version != 0 && h->version != kBodyVersion2) {
    return Status::Corruption("sparse body has unknown version " + std::to_string(h->version));
  }
  uint16_t e_lo;
  std::memcpy(&e_lo, body.data() + 8, 2);
  h->e_lo = e_lo;
  h->k = body[10];
  if (h->count > n) {
    return Status::Corruption("sparse body claims " + std::to_string(h->count) + " changes in " +
                              std::to_string(n) + " elements");
  }
  // No bound of the count by the body size: a regular pattern (every 4th element +1) costs the
  // adaptive coder far less than a bit per change, so any such bound rejects streams the encoder
  // writes (found by chunk_roundtrip_fuzz). count <= n already caps a forged count's work at
  // that of decoding a genuine chunk of this size.
  h->is_float = DTypeIsFloat(dtype) && DTypeSize(dtype) == sizeof(T);
  h->f = h->is_float ? ExponentOf(dtype) : ExponentField{};
  if (h->k < 1 || h->k > kMaxClasses ||
      (h->k > 1 && (h->f.mask == 0 || h->e_lo > static_cast<int>(h->f.mask)))) {
    return Status::Corruption("sparse body has an invalid class table");
  }
  return Status::Ok();
}

// ---- output ---------------------------------------------------------------------------------

// Builds the output front to back: copies the parent's elements up to `pos`, then writes the
// changed element. Copying in step with the changes keeps every touched line in cache; a bulk
// copy first (large memcpy uses non-temporal stores) and scattered updates after it measured
// a cache miss per change.
template <typename T>
struct OutputWriter {
  const uint8_t* parent;
  uint8_t* out;
  size_t n;
  size_t done = 0;  // elements [0, done) are written
  bool is_float;

  // Copies the parent's elements [done, end) (nothing to copy when decoding in place).
  void CopyTo(size_t end) {
    if (end > done && out != parent) std::memcpy(out + done * sizeof(T), parent + done * sizeof(T), (end - done) * sizeof(T));
    done = end;
  }
  // Adds d to the already copied element at pos (REQUIRES: pos < done). elem::ToOrd and
  // FromOrd without their branch on is_float, which the sweep's compiled loop tested per change.
  [[gnu::always_inline]] void Patch(size_t pos, T d) {
    constexpr int kTop = static_cast<int>(sizeof(T) * 8 - 1);
    constexpr T kSign = T(T(1) << kTop);
    const T float_mask = T(T(0) - T(is_float));
    uint8_t* slot = out + pos * sizeof(T);
    const T u = elem::Load<T>(slot);
    const T ord = T(u ^ (float_mask & T(T(T(0) - T(u >> kTop)) | kSign)));
    const T o = T(ord + d);
    elem::Store<T>(slot, T(o ^ (float_mask & T(T(T(o >> kTop) - T(1)) | kSign))));
  }
  // Copies the parent's block of 64 elements at `first` (and anything before it not yet copied).
  // REQUIRES: first is a multiple of 64, >= done - 64.
  [[gnu::always_inline]] void CopyBlock(size_t first) {
    if (out != parent && first == done && first + 64 <= n) {
      std::memcpy(out + first * sizeof(T), parent + first * sizeof(T), 64 * sizeof(T));
      done = first + 64;
    } else {
      CopyTo(std::min(first + 64, n));
    }
  }
  void Change(size_t pos, T d) {
    CopyTo(pos + 1);
    Patch(pos, d);
  }
  void Finish() { CopyTo(n); }
};

// An OutputWriter that also notes each changed position, for DecodeRecording. The sweep writes
// a block's changes class by class, so the positions come out ascending per block of 64 but
// not within it; DecodeRecording sorts them. `record` has room for the body's change count
// (each change is written exactly once, else the body is rejected).
template <typename T>
struct RecordingWriter : OutputWriter<T> {
  uint32_t* record = nullptr;
  size_t recorded = 0;
  [[gnu::always_inline]] void Patch(size_t pos, T d) {
    record[recorded++] = static_cast<uint32_t>(pos);
    OutputWriter<T>::Patch(pos, d);
  }
  void Change(size_t pos, T d) {
    this->CopyTo(pos + 1);
    Patch(pos, d);
  }
};

// The decoded differences as elements of T (two bytes each for bf16, which keeps a 4 MiB chunk's
// ~140K changes in L2 between decoding them and applying them).
template <typename T>
T* DiffBuffer(std::vector<uint8_t>& buffer, size_t count) {
  buffer.resize(count * sizeof(T));
  return reinterpret_cast<T*>(buffer.data());  // new[]'s alignment suffices for T
}

// ---- the instruction set of the sweeps (apply_by_class.cc) ----------------------------------

// The best the CPU has (SetSimd's kBest).
Simd BestSimd();
// The one in use: BestSimd() unless SetSimd chose another.
extern std::atomic<Simd> g_simd;

// ---- entry points of the files --------------------------------------------------------------

// body_v1.cc. Writes the version 1 body: the adaptive range-coded stream (see sparse_coder.h).
// Changes come grouped by class: the o-th is positions[order[o]], class-local index
// local[order[o]], classes in [start[c], start[c + 1]).
template <typename T>
void EncodeAdaptiveT(const uint8_t* parent, const uint8_t* data, bool is_float, int e_lo, int k,
                     const std::vector<uint32_t>& positions, const std::vector<uint32_t>& order,
                     const std::vector<uint32_t>& local, const uint32_t* start,
                     std::vector<uint8_t>* out);

// body_v1.cc. Decodes a version 1 body (header h, parsed) through `writer` (set up by DecodeT)
// and finishes the output.
template <typename T, typename Writer>
Status DecodeAdaptiveT(std::span<const uint8_t> body, const BodyHeader& h, const uint8_t* parent,
                       size_t n, Scratch* scratch, Writer writer);

// body_v2.cc. Writes the version 2 body (see sparse_coder.h); changes as EncodeAdaptiveT takes
// them.
template <typename T>
void EncodeStaticT(const uint8_t* parent, const uint8_t* data, bool is_float, int e_lo, int k,
                   const std::vector<uint32_t>& positions, const std::vector<uint32_t>& order,
                   const std::vector<uint32_t>& local, const uint32_t* start,
                   std::vector<uint8_t>* out);

// body_v2.cc. Decodes the version 2 stream (body from its start) into class-local indices and
// differences, class by class (class_start as ApplyByClass takes them), into local and
// diff_bytes (elements of T).
template <typename T>
Status DecodeStaticT(std::span<const uint8_t> body, uint64_t count, int k, size_t n,
                     Scratch* scratch, uint32_t* class_start, std::vector<uint32_t>& local,
                     std::vector<uint8_t>& diff_bytes);

// apply_by_class.cc. Applies changes given per class as class-local indices (local[class_start[c]
// .. class_start[c + 1]) ascending, with their differences) through `writer`, in one sweep over
// the chunk with the instruction set of g_simd. False if an index lies beyond its class's
// members. Writer: OutputWriter<T> or RecordingWriter<T>.
template <typename T, typename Writer>
bool ApplyByClass(const uint8_t* parent, ExponentField f, int e_lo, size_t n, int k,
                  const uint32_t* class_start, const uint32_t* local, const T* diffs,
                  Scratch* scratch, Writer& writer);

// sparse_coder.cc. Decodes a body of either version. With a `recorded` vector
// (RecordingWriter), also the positions changed, in the order the writer patched them.
// Instantiated there for OutputWriter<T> (chain.cc decodes single bodies with it).
template <typename T, typename Writer = OutputWriter<T>>
Status DecodeT(DType dtype, std::span<const uint8_t> body, const uint8_t* parent, uint8_t* out,
               size_t n, Scratch* scratch, std::vector<uint32_t>* recorded = nullptr);

// chain.cc. DecodeChain for elements of T.
template <typename T>
Status DecodeChainT(DType dtype, std::span<const std::span<const uint8_t>> bodies, uint8_t* data,
                    size_t n, Scratch* scratch, size_t* failed);

}  // namespace weightfs::sparse::detail

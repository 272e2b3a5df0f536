#include "core/chunk_codec.h"

#include <zstd.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>

#include "core/codec/sparse/sparse_coder.h"
#include "core/element_ops.h"
#include "core/hash.h"

static_assert(std::endian::native == std::endian::little,
              "weightfs payloads are little-endian; a big-endian port needs byte swaps here");

namespace weightfs {

std::string_view ChunkEncodingName(ChunkEncoding e) {
  switch (e) {
    case ChunkEncoding::kSame: return "same";
    case ChunkEncoding::kFull: return "full";
    case ChunkEncoding::kSparse: return "sparse";
    case ChunkEncoding::kDense: return "dense";
    case ChunkEncoding::kPatch: return "patch";
    case ChunkEncoding::kRaw: return "raw";
    case ChunkEncoding::kExternal: return "external";
  }
  return "unknown";
}

namespace {

constexpr uint8_t kPayloadMagic[4] = {'W', 'F', 'S', 'C'};
constexpr uint8_t kFormatVersion = 1;

void Set64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }
uint64_t Get64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

void WriteHeader(std::vector<uint8_t>* out, ChunkEncoding enc, DType dtype, uint64_t raw_len,
                 uint64_t parent_len, uint64_t raw_hash, uint64_t parent_hash) {
  out->resize(kPayloadHeaderBytes);
  uint8_t* p = out->data();
  std::memcpy(p, kPayloadMagic, 4);
  p[4] = kFormatVersion;
  p[5] = static_cast<uint8_t>(enc);
  p[6] = static_cast<uint8_t>(dtype);
  p[7] = 0;
  Set64(p + 8, raw_len);
  Set64(p + 16, parent_len);
  Set64(p + 24, raw_hash);
  Set64(p + 32, parent_hash);
}

// The element width the codecs work with: the dtype's when it tiles the data, else bytes.
size_t Width(DType dtype, size_t len) {
  const size_t e = DTypeSize(dtype);
  return (len % e == 0) ? e : 1;
}

using elem::DispatchWidth;
using elem::FromOrd;
using elem::Load;
using elem::Store;
using elem::ToOrd;
using elem::UnZigZag;
using elem::ZigZag;

// Splits n transformed elements into sizeof(T) byte planes: planes[k * n + i] = byte k of f(i).
template <typename T, typename F>
void SplitPlanes(size_t n, uint8_t* planes, F&& f) {
  for (size_t i = 0; i < n; ++i) {
    const T v = f(i);
    for (size_t k = 0; k < sizeof(T); ++k) planes[k * n + i] = static_cast<uint8_t>(v >> (8 * k));
  }
}
template <typename T, typename F>
void JoinPlanes(size_t n, const uint8_t* planes, F&& f) {
  for (size_t i = 0; i < n; ++i) {
    T v = 0;
    for (size_t k = 0; k < sizeof(T); ++k) v |= T(T(planes[k * n + i]) << (8 * k));
    f(i, v);
  }
}

// The element types to try for the byte-plane encodings. Bytes of unknown structure (optimizer
// states, pickles, other containers) are mostly arrays of fp32 at 4-byte aligned offsets, so
// they are also tried as F32; the payload records the interpretation that won.
std::vector<DType> DenseInterpretations(DType dtype, size_t len) {
  if (dtype == DType::kOpaque && len % 4 == 0 && len >= 4) return {DType::kOpaque, DType::kF32};
  return {dtype};
}

}  // namespace

// ---- ChunkCodec ---------------------------------------------------------------------------

struct ChunkCodec::Impl {
  EncodeOptions options;
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  ZSTD_DCtx* dctx = ZSTD_createDCtx();
  std::vector<uint8_t> planes;  // scratch: transformed byte planes
  std::vector<uint32_t> positions;
  sparse::Scratch sparse_scratch;
  std::vector<PayloadInfo> chain_infos;                 // DecodeChainInPlace
  std::vector<std::span<const uint8_t>> chain_bodies;  // DecodeChainInPlace
  std::vector<uint8_t> candidate;
  std::vector<uint8_t> full_alt;
  std::vector<uint8_t> zstd_out;

  ~Impl() {
    ZSTD_freeCCtx(cctx);
    ZSTD_freeDCtx(dctx);
  }

  // Appends one zstd frame per plane (n bytes each, `count` planes in `planes`).
  void CompressPlanes(size_t count, size_t n, int level, std::vector<uint8_t>* out) {
    const size_t sizes_at = out->size();
    out->resize(out->size() + 8 * count);
    const size_t bound = ZSTD_compressBound(n);
    uint8_t* dst = EnsureScratch(bound);
    for (size_t k = 0; k < count; ++k) {
      size_t r = ZSTD_compressCCtx(cctx, dst, bound, planes.data() + k * n, n, level);
      if (ZSTD_isError(r)) r = 0;  // cannot happen with a bound-sized buffer; caught on decode
      out->insert(out->end(), dst, dst + r);
      Set64(out->data() + sizes_at + 8 * k, r);
    }
  }

  Status DecompressPlanes(std::span<const uint8_t> body, size_t count, size_t n) {
    if (body.size() < 8 * count) return Status::Corruption("plane table truncated");
    // Validate the whole table (sizes, frame headers) before allocating anything, so a forged
    // header cannot make us reserve raw_len bytes for a payload that is not there.
    size_t at = 8 * count;
    for (size_t k = 0; k < count; ++k) {
      const uint64_t size = Get64(body.data() + 8 * k);
      if (size > body.size() - at) return Status::Corruption("plane " + std::to_string(k) + " truncated");
      const unsigned long long content = ZSTD_getFrameContentSize(body.data() + at, size);
      if (content != n) {
        return Status::Corruption("plane " + std::to_string(k) + " frame size " +
                                  (ZSTD_isError(content) || content == ZSTD_CONTENTSIZE_UNKNOWN ||
                                           content == ZSTD_CONTENTSIZE_ERROR
                                       ? std::string("unreadable")
                                       : std::to_string(content)) +
                                  " != " + std::to_string(n));
      }
      at += size;
    }
    if (at != body.size()) return Status::Corruption("trailing bytes after the last plane");
    if (planes.size() < count * n) planes.resize(count * n);
    at = 8 * count;
    for (size_t k = 0; k < count; ++k) {
      const uint64_t size = Get64(body.data() + 8 * k);
      ZSTD_DCtx_reset(dctx, ZSTD_reset_session_and_parameters);
      const size_t r = ZSTD_decompressDCtx(dctx, planes.data() + k * n, n, body.data() + at, size);
      if (ZSTD_isError(r) || r != n) {
        return Status::Corruption("plane " + std::to_string(k) + ": " +
                                  (ZSTD_isError(r) ? ZSTD_getErrorName(r) : "short frame"));
      }
      at += size;
    }
    return Status::Ok();
  }

  void EncodeFullBody(DType dtype, std::span<const uint8_t> data, std::vector<uint8_t>* out) {
    const size_t width = Width(dtype, data.size());
    const size_t n = data.size() / width;
    const bool rotate = DTypeIsFloat(dtype) && width > 1;
    planes.resize(data.size());
    DispatchWidth(width, [&]<typename T>() {
      SplitPlanes<T>(n, planes.data(), [&](size_t i) {
        const T v = Load<T>(data.data() + i * sizeof(T));
        return rotate ? std::rotl(v, 1) : v;
      });
    });
    CompressPlanes(width, n, options.full_level, out);
  }

  void EncodeDenseBody(DType dtype, std::span<const uint8_t> parent, std::span<const uint8_t> data,
                       std::vector<uint8_t>* out) {
    const size_t width = Width(dtype, data.size());
    const size_t n = data.size() / width;
    const bool is_float = DTypeIsFloat(dtype) && width == DTypeSize(dtype);
    planes.resize(data.size());
    DispatchWidth(width, [&]<typename T>() {
      SplitPlanes<T>(n, planes.data(), [&](size_t i) {
        const T a = ToOrd(Load<T>(parent.data() + i * sizeof(T)), is_float);
        const T b = ToOrd(Load<T>(data.data() + i * sizeof(T)), is_float);
        return ZigZag<T>(T(b - a));
      });
    });
    CompressPlanes(width, n, options.full_level, out);
  }

  // An estimate of zstd's output for `data` from a few spread samples (~1/32 of a large chunk),
  // cheap enough to run on every chunk. (Uses the scratch buffer: callers copy out first.)
  size_t EstimateCompressed(std::span<const uint8_t> data) {
    constexpr size_t kSample = 4096, kSamples = 32;
    if (data.size() <= kSample * kSamples) {
      const size_t bound = ZSTD_compressBound(data.size());
      const size_t r = ZSTD_compressCCtx(cctx, EnsureScratch(bound), bound, data.data(),
                                         data.size(), 1);
      return ZSTD_isError(r) ? data.size() : r;
    }
    size_t total = 0;
    const size_t step = (data.size() - kSample) / (kSamples - 1);
    uint8_t* dst = EnsureScratch(ZSTD_compressBound(kSample));
    for (size_t i = 0; i < kSamples; ++i) {
      const size_t r = ZSTD_compressCCtx(cctx, dst, ZSTD_compressBound(kSample),
                                         data.data() + i * step, kSample, 1);
      total += ZSTD_isError(r) ? kSample : r;
    }
    return static_cast<size_t>(static_cast<double>(total) * static_cast<double>(data.size()) /
                               static_cast<double>(kSample * kSamples));
  }

  // Scratch for zstd output: grows once, never shrinks, so repeated encodes do not zero-fill
  // and fault in fresh pages for every candidate.
  uint8_t* EnsureScratch(size_t n) {
    if (zstd_out.size() < n) zstd_out.resize(n);
    return zstd_out.data();
  }

  bool EncodePatchBody(std::span<const uint8_t> parent, std::span<const uint8_t> data,
                       std::vector<uint8_t>* out) {
    ZSTD_CCtx_reset(cctx, ZSTD_reset_session_and_parameters);
    // Small chunks (headers) are structured text where a high level pays; on large chunks of
    // noise-like bytes a high level only burns time.
    const int level = data.size() <= (256u << 10) ? options.patch_level : 1;
    ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, level);
    const int wlog = std::clamp(elem::BitLength(parent.size() + data.size()), 10, 27);
    ZSTD_CCtx_setParameter(cctx, ZSTD_c_windowLog, wlog);
    ZSTD_CCtx_refPrefix(cctx, parent.data(), parent.size());
    const size_t bound = ZSTD_compressBound(data.size());
    uint8_t* dst = EnsureScratch(bound);
    const size_t r = ZSTD_compress2(cctx, dst, bound, data.data(), data.size());
    ZSTD_CCtx_reset(cctx, ZSTD_reset_session_and_parameters);
    if (ZSTD_isError(r)) return false;
    out->insert(out->end(), dst, dst + r);
    return true;
  }
};

ChunkCodec::ChunkCodec(EncodeOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->options = options;
}
ChunkCodec::~ChunkCodec() = default;

void ChunkCodec::EncodeFull(DType dtype, std::span<const uint8_t> data, std::vector<uint8_t>* out) {
  if (Width(dtype, data.size()) != DTypeSize(dtype)) dtype = DType::kOpaque;
  EncodeFullHashed(dtype, data, Hash64(data), out);
}

void ChunkCodec::EncodeFullHashed(DType dtype, std::span<const uint8_t> data, uint64_t hash,
                                  std::vector<uint8_t>* out) {
  bool first = true;
  for (DType as : DenseInterpretations(dtype, data.size())) {
    std::vector<uint8_t>& dst = first ? *out : impl_->full_alt;
    WriteHeader(&dst, ChunkEncoding::kFull, as, data.size(), 0, hash, 0);
    impl_->EncodeFullBody(as, data, &dst);
    if (!first && dst.size() < out->size()) out->swap(dst);
    first = false;
  }
  if (out->size() >= kPayloadHeaderBytes + data.size()) {
    WriteHeader(out, ChunkEncoding::kRaw, dtype, data.size(), 0, hash, 0);
    out->insert(out->end(), data.begin(), data.end());
  }
}

ChunkEncoding ChunkCodec::EncodeDelta(DType dtype, std::span<const uint8_t> parent,
                                      std::span<const uint8_t> data, std::vector<uint8_t>* out,
                                      uint64_t* changed) {
  out->clear();
  if (Width(dtype, data.size()) != DTypeSize(dtype)) dtype = DType::kOpaque;
  const EncodeOptions& opt = impl_->options;
  std::vector<uint8_t>& cand = impl_->candidate;
  ChunkEncoding best = ChunkEncoding::kSame;
  // Keeps the candidate in `cand` if it is the smallest so far.
  auto consider = [&](ChunkEncoding enc) {
    if (out->empty() || cand.size() < out->size()) {
      out->swap(cand);
      best = enc;
    }
  };
  uint64_t hash = 0, parent_hash = 0;
  bool hashed = false;
  auto hashes = [&] {
    if (!hashed) {
      hash = Hash64(data);
      parent_hash = Hash64(parent);
      hashed = true;
    }
  };

  bool try_patch = dtype == DType::kOpaque;
  if (parent.size() == data.size()) {
    const size_t width = Width(dtype, data.size());
    const size_t n = data.size() / width;
    const auto cap = static_cast<size_t>(static_cast<double>(n) * opt.sparse_max_fraction);
    const bool scanned = n <= std::numeric_limits<uint32_t>::max();
    const bool sparse_ok = scanned && sparse::FindChanges(width, parent.data(), data.data(), n, cap, &impl_->positions);
    if (changed) {
      // Past its cap FindChanges stops at the change it could not keep: counted on from there.
      const size_t from = sparse_ok ? n : scanned ? impl_->positions.back() + 1 : 0;
      *changed = (scanned ? impl_->positions.size() : 0) +
                 sparse::CountChanges(width, parent.data() + from * width, data.data() + from * width, n - from);
    }
    if (sparse_ok && impl_->positions.empty()) return ChunkEncoding::kSame;
    hashes();
    if (sparse_ok) {
      WriteHeader(&cand, ChunkEncoding::kSparse, dtype, data.size(), parent.size(), hash,
                  parent_hash);
      sparse::Encode(dtype, width, parent.data(), data.data(), n, impl_->positions,
                     opt.exponent_class_max_fraction, opt.sparse_body_version,
                     &impl_->sparse_scratch, &cand, opt.sparse_force_classes);
      consider(ChunkEncoding::kSparse);
      // Byte planes + zstd cannot go much below ~1 bit per byte on noise-like weights: when the
      // sparse stream is already this small, DENSE is not worth its encoding time, and FULL only
      // when the new chunk itself is highly compressible (a tensor reset to zeros), which a
      // sample tells cheaply.
      if (static_cast<double>(out->size()) <=
          static_cast<double>(data.size()) * opt.sparse_sufficient_bits_per_byte / 8.0) {
        if (impl_->EstimateCompressed(data) < 2 * out->size()) {
          EncodeFullHashed(dtype, data, hash, &cand);
          consider(static_cast<ChunkEncoding>(cand[5]));
        }
        return best;
      }
    }
    for (DType as : DenseInterpretations(dtype, data.size())) {
      WriteHeader(&cand, ChunkEncoding::kDense, as, data.size(), parent.size(), hash, parent_hash);
      impl_->EncodeDenseBody(as, parent, data, &cand);
      consider(ChunkEncoding::kDense);
    }
  } else {
    try_patch = true;
  }
  hashes();
  if (try_patch && !parent.empty()) {
    WriteHeader(&cand, ChunkEncoding::kPatch, dtype, data.size(), parent.size(), hash, parent_hash);
    if (impl_->EncodePatchBody(parent, data, &cand)) consider(ChunkEncoding::kPatch);
  }
  EncodeFullHashed(dtype, data, hash, &cand);
  consider(static_cast<ChunkEncoding>(cand[5]));
  return best;
}

Expected<PayloadInfo> ChunkCodec::Inspect(std::span<const uint8_t> payload,
                                          const DecodeLimits& limits) {
  if (payload.size() < kPayloadHeaderBytes) {
    return Status::Corruption("payload of " + std::to_string(payload.size()) +
                              " bytes is shorter than its 40-byte header");
  }
  const uint8_t* p = payload.data();
  if (std::memcmp(p, kPayloadMagic, 4) != 0) return Status::Corruption("payload has no WFSC magic");
  if (p[4] != kFormatVersion) {
    return Status::Unsupported("payload format version " + std::to_string(p[4]) +
                               " (this weightfs reads version 1; upgrade weightfs)");
  }
  PayloadInfo info;
  if (p[5] < 1 || p[5] > 5) return Status::Corruption("unknown payload encoding " + std::to_string(p[5]));
  info.encoding = static_cast<ChunkEncoding>(p[5]);
  auto dtype = DTypeFromByte(p[6]);
  if (!dtype) return Status::Corruption("unknown payload dtype " + std::to_string(p[6]));
  info.dtype = *dtype;
  if (p[7] != 0) return Status::Corruption("payload flags set");
  info.raw_len = Get64(p + 8);
  info.parent_len = Get64(p + 16);
  info.raw_hash = Get64(p + 24);
  info.parent_hash = Get64(p + 32);
  if (info.raw_len > limits.max_raw_len) {
    return Status::ResourceExhausted("payload decodes to " + std::to_string(info.raw_len) +
                                     " bytes, above the limit of " +
                                     std::to_string(limits.max_raw_len));
  }
  if (info.raw_len % DTypeSize(info.dtype) != 0) {
    return Status::Corruption("payload length is not a whole number of elements");
  }
  if (info.is_delta()) {
    if (info.parent_len > limits.max_raw_len) return Status::Corruption("parent length out of range");
    if (info.encoding != ChunkEncoding::kPatch && info.parent_len != info.raw_len) {
      return Status::Corruption("element-wise delta with parent length != length");
    }
  } else if (info.parent_len != 0 || info.parent_hash != 0) {
    return Status::Corruption("self-contained payload names a parent");
  }
  if (info.encoding == ChunkEncoding::kRaw && payload.size() != kPayloadHeaderBytes + info.raw_len) {
    return Status::Corruption("raw payload length mismatch");
  }
  return info;
}

Status ChunkCodec::Decode(std::span<const uint8_t> payload, std::span<const uint8_t> parent,
                          std::span<uint8_t> out, const DecodeLimits& limits) {
  try {
    return DecodeUnguarded(payload, parent, out, limits);
  } catch (...) {  // scratch sized within the limits, and still more than there is
    return StatusOfCurrentException("decoding a payload");
  }
}

Status ChunkCodec::DecodeUnguarded(std::span<const uint8_t> payload, std::span<const uint8_t> parent,
                                   std::span<uint8_t> out, const DecodeLimits& limits) {
  WFS_ASSIGN_OR_RETURN(PayloadInfo info, Inspect(payload, limits));
  if (out.size() != info.raw_len) {
    return Status::InvalidArgument("output buffer of " + std::to_string(out.size()) +
                                   " bytes for a chunk of " + std::to_string(info.raw_len));
  }
  if (info.is_delta()) {
    if (parent.size() != info.parent_len) {
      return Status::InvalidArgument("delta needs a parent of " + std::to_string(info.parent_len) +
                                     " bytes, got " + std::to_string(parent.size()));
    }
    if (limits.verify_parent && Hash64(parent) != info.parent_hash) {
      return Status::Corruption("delta was encoded against a different parent chunk");
    }
  }
  if (info.is_delta() && !out.empty() && !parent.empty() &&
      out.data() < parent.data() + parent.size() &&
      parent.data() < out.data() + out.size() &&
      !(info.decodes_in_place() && out.data() == parent.data())) {
    return Status::InvalidArgument("output buffer overlaps the parent chunk");
  }
  const std::span<const uint8_t> body = payload.subspan(kPayloadHeaderBytes);
  const size_t width = DTypeSize(info.dtype);
  const size_t n = info.raw_len / width;
  const bool is_float = DTypeIsFloat(info.dtype);
  switch (info.encoding) {
    case ChunkEncoding::kRaw:
      if (!out.empty()) std::memcpy(out.data(), body.data(), out.size());
      break;
    case ChunkEncoding::kFull: {
      WFS_TRY(impl_->DecompressPlanes(body, width, n));
      const bool rotate = is_float && width > 1;
      DispatchWidth(width, [&]<typename T>() {
        JoinPlanes<T>(n, impl_->planes.data(), [&](size_t i, T v) {
          Store<T>(out.data() + i * sizeof(T), rotate ? std::rotr(v, 1) : v);
        });
      });
      break;
    }
    case ChunkEncoding::kDense: {
      WFS_TRY(impl_->DecompressPlanes(body, width, n));
      DispatchWidth(width, [&]<typename T>() {
        JoinPlanes<T>(n, impl_->planes.data(), [&](size_t i, T z) {
          const T a = ToOrd(Load<T>(parent.data() + i * sizeof(T)), is_float);
          Store<T>(out.data() + i * sizeof(T), FromOrd(T(a + UnZigZag<T>(z)), is_float));
        });
      });
      break;
    }
    case ChunkEncoding::kSparse: {
      WFS_TRY(sparse::Decode(info.dtype, width, body, parent.data(), out.data(), n,
                             &impl_->sparse_scratch));
      break;
    }
    case ChunkEncoding::kPatch: {
      ZSTD_DCtx* dctx = impl_->dctx;
      const unsigned long long content = ZSTD_getFrameContentSize(body.data(), body.size());
      if (content != info.raw_len) return Status::Corruption("patch frame size mismatch");
      ZSTD_DCtx_reset(dctx, ZSTD_reset_session_and_parameters);
      ZSTD_DCtx_setParameter(dctx, ZSTD_d_windowLogMax, 27);
      ZSTD_DCtx_refPrefix(dctx, parent.data(), parent.size());
      const size_t r = ZSTD_decompressDCtx(dctx, out.data(), out.size(), body.data(), body.size());
      ZSTD_DCtx_reset(dctx, ZSTD_reset_session_and_parameters);
      if (ZSTD_isError(r) || r != out.size()) {
        return Status::Corruption(std::string("patch frame: ") +
                                  (ZSTD_isError(r) ? ZSTD_getErrorName(r) : "short"));
      }
      break;
    }
    case ChunkEncoding::kSame:
    case ChunkEncoding::kExternal:  // Inspect refuses both; kept for -Wswitch
      return Status::Corruption("payload encoding " + std::to_string(static_cast<int>(info.encoding)));
  }
  if (limits.verify_output && Hash64(out) != info.raw_hash) {
    return Status::Corruption("decoded chunk does not match its checksum");
  }
  return Status::Ok();
}

Status ChunkCodec::DecodeChainInPlace(std::span<const std::span<const uint8_t>> payloads,
                                      std::span<uint8_t> data, const DecodeLimits& limits,
                                      size_t* failed) {
  try {
    return DecodeChainUnguarded(payloads, data, limits, failed);
  } catch (...) {
    if (failed != nullptr) *failed = 0;
    return StatusOfCurrentException("decoding a chain of payloads");
  }
}

Status ChunkCodec::DecodeChainUnguarded(std::span<const std::span<const uint8_t>> payloads,
                                        std::span<uint8_t> data, const DecodeLimits& limits,
                                        size_t* failed) {
  size_t at = 0;
  if (failed == nullptr) failed = &at;
  if (payloads.empty()) return Status::Ok();
  std::vector<PayloadInfo>& infos = impl_->chain_infos;
  infos.clear();
  for (size_t i = 0; i < payloads.size(); ++i) {
    *failed = i;
    WFS_ASSIGN_OR_RETURN(PayloadInfo info, Inspect(payloads[i], limits));
    if (!info.decodes_in_place() || info.raw_len != data.size()) {
      return Status::InvalidArgument("chain payload " + std::to_string(i) + " (" +
                                     std::string(ChunkEncodingName(info.encoding)) + ", " +
                                     std::to_string(info.raw_len) + " bytes) does not decode in place on " +
                                     std::to_string(data.size()) + " bytes");
    }
    infos.push_back(info);
  }
  DecodeLimits each = limits;
  if (!limits.verify_parent) each.verify_output = false;  // the final bytes are checked below
  std::vector<std::span<const uint8_t>>& bodies = impl_->chain_bodies;
  for (size_t i = 0; i < payloads.size();) {
    *failed = i;
    size_t j = i + 1;
    if (!limits.verify_parent && infos[i].encoding == ChunkEncoding::kSparse) {
      while (j < payloads.size() && infos[j].encoding == ChunkEncoding::kSparse &&
             infos[j].dtype == infos[i].dtype) {
        ++j;
      }
    }
    if (j - i == 1) {
      WFS_TRY(Decode(payloads[i], data, data, each));
    } else {
      bodies.clear();
      for (size_t r = i; r < j; ++r) bodies.push_back(payloads[r].subspan(kPayloadHeaderBytes));
      const size_t width = DTypeSize(infos[i].dtype);
      size_t bad = 0;
      Status st = sparse::DecodeChain(infos[i].dtype, width, bodies, data.data(),
                                      data.size() / width, &impl_->sparse_scratch, &bad);
      if (!st.ok()) {
        *failed = i + bad;
        return st;
      }
    }
    i = j;
  }
  *failed = payloads.size() - 1;
  if (!limits.verify_parent && limits.verify_output && Hash64(data) != infos.back().raw_hash) {
    return Status::Corruption("decoded chunk does not match its checksum");
  }
  return Status::Ok();
}

Status ChunkCodec::ApplyInPlace(std::span<const uint8_t> payload, std::span<uint8_t> data,
                                std::vector<uint32_t>* changed, const DecodeLimits& limits) {
  try {
    return ApplyInPlaceUnguarded(payload, data, changed, limits);
  } catch (...) {
    return StatusOfCurrentException("applying a payload");
  }
}

Status ChunkCodec::ApplyInPlaceUnguarded(std::span<const uint8_t> payload, std::span<uint8_t> data,
                                         std::vector<uint32_t>* changed, const DecodeLimits& limits) {
  changed->clear();
  WFS_ASSIGN_OR_RETURN(PayloadInfo info, Inspect(payload, limits));
  if (!info.decodes_in_place() || info.raw_len != data.size()) {
    return Status::InvalidArgument("payload (" + std::string(ChunkEncodingName(info.encoding)) + ", " +
                                   std::to_string(info.raw_len) + " bytes) does not decode in place on " +
                                   std::to_string(data.size()) + " bytes");
  }
  if (limits.verify_parent && Hash64(data) != info.parent_hash) {
    return Status::Corruption("delta was encoded against a different parent chunk");
  }
  const std::span<const uint8_t> body = payload.subspan(kPayloadHeaderBytes);
  const size_t width = DTypeSize(info.dtype);
  const size_t n = info.raw_len / width;
  if (info.encoding == ChunkEncoding::kSparse) {
    WFS_TRY(sparse::DecodeRecording(info.dtype, width, body, data.data(), n, &impl_->sparse_scratch,
                                    changed));
  } else {
    WFS_TRY(impl_->DecompressPlanes(body, width, n));
    const bool is_float = DTypeIsFloat(info.dtype);
    DispatchWidth(width, [&]<typename T>() {
      JoinPlanes<T>(n, impl_->planes.data(), [&](size_t i, T z) {
        if (z == 0) return;  // zigzag(0) == 0: the element keeps its value
        uint8_t* p = data.data() + i * sizeof(T);
        Store<T>(p, FromOrd(T(ToOrd(Load<T>(p), is_float) + UnZigZag<T>(z)), is_float));
        changed->push_back(static_cast<uint32_t>(i));
      });
    });
  }
  if (limits.verify_output && Hash64(data) != info.raw_hash) {
    return Status::Corruption("decoded chunk does not match its checksum");
  }
  return Status::Ok();
}

Expected<std::vector<uint8_t>> ChunkCodec::Decode(std::span<const uint8_t> payload,
                                                  std::span<const uint8_t> parent,
                                                  const DecodeLimits& limits) {
  WFS_ASSIGN_OR_RETURN(PayloadInfo info, Inspect(payload, limits));
  // A payload whose body could not possibly expand to raw_len is rejected before allocating:
  // zstd frames expand at most ~2^17x (a 3-byte block per 128 KiB), and a sparse or raw body
  // needs its parent or its bytes.
  const uint64_t body = payload.size() - kPayloadHeaderBytes;
  if (info.encoding == ChunkEncoding::kFull || info.encoding == ChunkEncoding::kDense ||
      info.encoding == ChunkEncoding::kPatch) {
    if (info.raw_len / (uint64_t{1} << 16) > body + 1) {
      return Status::Corruption("payload body too small for its decoded length");
    }
  }
  std::vector<uint8_t> out;
  try {
    out.resize(info.raw_len);
  } catch (...) {  // within the limits, and still more than there is
    return StatusOfCurrentException("allocating a decoded chunk");
  }
  WFS_TRY(Decode(payload, parent, out, limits));
  return out;
}

}  // namespace weightfs

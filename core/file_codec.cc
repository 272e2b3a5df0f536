#include "core/file_codec.h"

#include <map>

#include "core/mutex.h"

namespace weightfs {

uint64_t EncodedFile::payload_bytes() const {
  uint64_t total = 0;
  for (const EncodedChunk& c : chunks) total += c.payload_bytes;
  return total;
}

uint64_t EncodedFile::count(ChunkEncoding e) const {
  uint64_t n = 0;
  for (const EncodedChunk& c : chunks) n += c.encoding == e;
  return n;
}

std::string DescribeChunk(const ChunkKey& key) {
  if (key.tensor == kHeaderChunkName) return "header chunk";
  if (key.tensor.empty()) return "bytes chunk " + std::to_string(key.index);
  return "tensor '" + key.tensor + "' chunk " + std::to_string(key.index);
}

FileEncoder::FileEncoder(ThreadPool* pool, EncodeOptions options, uint64_t chunk_bytes)
    : pool_(pool), options_(options), chunk_bytes_(chunk_bytes) {}

EncodedFile FileEncoder::Encode(std::span<const uint8_t> file, std::span<const uint8_t> parent,
                                const PayloadSink& sink) {
  EncodedFile result;
  result.plan = PlanFile(file, file.size(), chunk_bytes_);
  std::map<ChunkKey, const ChunkSpec*> parent_chunks;
  ChunkPlan parent_plan;
  if (!parent.empty()) {
    parent_plan = PlanFile(parent, parent.size(), chunk_bytes_);
    for (const ChunkSpec& c : parent_plan.chunks) parent_chunks.emplace(c.key, &c);
  }
  result.chunks.resize(result.plan.chunks.size());
  codecs_.resize(pool_->size());
  buffers_.resize(pool_->size());
  auto& codecs = codecs_;
  auto& buffers = buffers_;
  pool_->ParallelFor(result.plan.chunks.size(), [&](size_t i, size_t slot) {
    if (!codecs[slot]) codecs[slot] = std::make_unique<ChunkCodec>(options_);
    const ChunkSpec& spec = result.plan.chunks[i];
    const auto data = file.subspan(spec.offset, spec.length);
    EncodedChunk& out = result.chunks[i];
    out.spec = spec;
    out.hash = HashChunk(data);
    std::vector<uint8_t>& payload = buffers[slot];
    auto it = parent_chunks.find(spec.key);
    if (it != parent_chunks.end() && it->second->dtype == spec.dtype) {
      const ChunkSpec& p = *it->second;
      out.parent = p;
      out.encoding = codecs[slot]->EncodeDelta(spec.dtype, parent.subspan(p.offset, p.length),
                                               data, &payload);
    } else {
      codecs[slot]->EncodeFull(spec.dtype, data, &payload);
      out.encoding = static_cast<ChunkEncoding>(payload[5]);
    }
    if (out.encoding == ChunkEncoding::kSame) {
      out.payload_bytes = 0;
      return;
    }
    out.payload_bytes = payload.size();
    sink(i, payload);
  });
  return result;
}

FileDecoder::FileDecoder(ThreadPool* pool, DecodeLimits limits) : pool_(pool), limits_(limits) {
  limits_.verify_output = false;  // every chunk is checked against its Hash128 below
}

Status FileDecoder::Decode(const EncodedFile& encoded, const PayloadSource& payloads,
                           std::span<const uint8_t> parent, std::span<uint8_t> out) {
  if (out.size() != encoded.plan.file_size) {
    return Status::InvalidArgument("output size does not match the encoded file");
  }
  codecs_.resize(pool_->size());
  auto& codecs = codecs_;
  Mutex mu;
  Status first_error;  // guarded by mu (a local: the analysis cannot check it); read once ParallelFor returned
  pool_->ParallelFor(encoded.chunks.size(), [&](size_t i, size_t slot) {
    if (!codecs[slot]) codecs[slot] = std::make_unique<ChunkCodec>();
    const EncodedChunk& c = encoded.chunks[i];
    auto fail = [&](const Status& s) {
      MutexLock lock(mu);
      if (first_error.ok()) first_error = s.WithContext(DescribeChunk(c.spec.key));
    };
    if (c.spec.offset > out.size() || c.spec.length > out.size() - c.spec.offset) {
      return fail(Status::Corruption("chunk lies outside the file"));
    }
    std::span<uint8_t> dst = out.subspan(c.spec.offset, c.spec.length);
    std::span<const uint8_t> parent_bytes;
    if (c.parent) {
      if (c.parent->offset > parent.size() || c.parent->length > parent.size() - c.parent->offset) {
        return fail(Status::Corruption("parent chunk lies outside the parent file"));
      }
      parent_bytes = parent.subspan(c.parent->offset, c.parent->length);
    }
    if (c.encoding == ChunkEncoding::kSame) {
      if (parent_bytes.size() != dst.size()) return fail(Status::Corruption("same-as-parent chunk of another size"));
      std::copy(parent_bytes.begin(), parent_bytes.end(), dst.begin());
    } else {
      Expected<std::span<const uint8_t>> payload = payloads(i);
      if (!payload.ok()) return fail(payload.status());
      Status s = codecs[slot]->Decode(*payload, parent_bytes, dst, limits_);
      if (!s.ok()) return fail(s);
    }
    if (HashChunk(dst) != c.hash) return fail(Status::Corruption("chunk hash mismatch"));
  });
  return first_error;
}

}  // namespace weightfs

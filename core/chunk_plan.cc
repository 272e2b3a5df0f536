#include "core/chunk_plan.h"

#include <algorithm>

namespace weightfs {

ChunkPlan PlanChunks(const std::optional<SafetensorsHeader>& header, uint64_t file_size,
                     uint64_t chunk_bytes) {
  chunk_bytes = std::clamp<uint64_t>(chunk_bytes, 1, kMaxChunkBytes);
  ChunkPlan plan;
  plan.file_size = file_size;
  if (!header) {
    uint64_t index = 0;
    for (uint64_t off = 0; off < file_size; off += chunk_bytes, ++index) {
      plan.chunks.push_back(ChunkSpec{ChunkKey{"", index}, ChunkRole::kOpaque, DType::kOpaque, off,
                                      std::min(chunk_bytes, file_size - off)});
    }
    return plan;
  }
  plan.safetensors = true;
  plan.chunks.push_back(ChunkSpec{ChunkKey{kHeaderChunkName, 0}, ChunkRole::kHeader,
                                  DType::kOpaque, 0, header->data_offset});
  for (const TensorInfo& t : header->tensors) {
    const uint64_t elem = DTypeSize(t.dtype);
    const uint64_t step = std::max<uint64_t>(elem, chunk_bytes / elem * elem);
    uint64_t index = 0;
    for (uint64_t off = 0; off < t.size(); off += step, ++index) {
      plan.chunks.push_back(ChunkSpec{ChunkKey{t.name, index}, ChunkRole::kTensor, t.dtype,
                                      header->data_offset + t.begin + off,
                                      std::min(step, t.size() - off)});
    }
  }
  return plan;
}

ChunkPlan PlanFile(std::span<const uint8_t> file_prefix, uint64_t file_size, uint64_t chunk_bytes) {
  std::optional<SafetensorsHeader> header;
  if (file_prefix.size() >= 8) {
    Expected<uint64_t> prefix_len = SafetensorsPrefixLength(file_prefix);
    if (prefix_len.ok() && *prefix_len <= file_prefix.size()) {
      Expected<SafetensorsHeader> parsed = ParseSafetensorsHeader(file_prefix, file_size);
      if (parsed.ok()) header = std::move(parsed).value();
    }
  }
  return PlanChunks(header, file_size, chunk_bytes);
}

}  // namespace weightfs

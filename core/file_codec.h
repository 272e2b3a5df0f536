// FileEncoder / FileDecoder: a whole file through the chunk codec, in parallel across chunks.
//
// Encoding plans the new file (core/chunk_plan.h), pairs each chunk with the parent file's
// chunk of the same key (tensor name + chunk index, so shifted offsets still pair), and encodes
// it as a delta against that chunk, or FULL when there is none. Chunks equal to their parent
// store nothing (kSame). Payloads go to a sink as they are produced; memory in flight is one
// chunk (plus its payload) per thread, whatever the file size.
//
// Both classes are thread-compatible (one call at a time per object); they run their loops on
// a shared ThreadPool.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "core/chunk_codec.h"
#include "core/chunk_plan.h"
#include "core/hash.h"
#include "core/thread_pool.h"

namespace weightfs {

struct EncodedChunk {
  ChunkSpec spec;             // where the chunk lies in the new file
  ChunkEncoding encoding = ChunkEncoding::kFull;
  Hash128 hash;               // of the chunk's bytes
  uint64_t payload_bytes = 0; // 0 for kSame
  std::optional<ChunkSpec> parent;  // the parent chunk it was coded against (delta or kSame)
};

struct EncodedFile {
  ChunkPlan plan;
  std::vector<EncodedChunk> chunks;  // one per plan.chunks entry, same order
  uint64_t payload_bytes() const;
  uint64_t count(ChunkEncoding e) const;
};

// Called once per chunk that has a payload, from worker threads, concurrently: the sink must
// be thread-safe. The span is valid only during the call.
using PayloadSink = std::function<void(size_t chunk_index, std::span<const uint8_t> payload)>;

class FileEncoder {
 public:
  FileEncoder(ThreadPool* pool, EncodeOptions options = {},
              uint64_t chunk_bytes = kDefaultChunkBytes);

  // Encodes `file` against `parent` (empty span: no parent, every chunk FULL). Both are the
  // whole files' bytes (typically mmapped). Never fails on content: any bytes encode.
  EncodedFile Encode(std::span<const uint8_t> file, std::span<const uint8_t> parent,
                     const PayloadSink& sink);

 private:
  ThreadPool* pool_;
  EncodeOptions options_;
  uint64_t chunk_bytes_;
  // One codec and payload buffer per pool slot, kept across calls (their scratch memory is
  // reused instead of faulted in again).
  std::vector<std::unique_ptr<ChunkCodec>> codecs_;
  std::vector<std::vector<uint8_t>> buffers_;
};

// Returns the payload of chunk i (empty for kSame).
using PayloadSource = std::function<Expected<std::span<const uint8_t>>(size_t chunk_index)>;

class FileDecoder {
 public:
  explicit FileDecoder(ThreadPool* pool, DecodeLimits limits = {});

  // Rebuilds the file described by `encoded` into `out` (exactly plan.file_size bytes) from the
  // payloads and the parent file's bytes. Every chunk is checked against its Hash128. Returns
  // the first error (naming the chunk) if any chunk fails.
  Status Decode(const EncodedFile& encoded, const PayloadSource& payloads,
                std::span<const uint8_t> parent, std::span<uint8_t> out);

 private:
  ThreadPool* pool_;
  DecodeLimits limits_;
  std::vector<std::unique_ptr<ChunkCodec>> codecs_;  // one per pool slot, kept across calls
};

// "tensor 'model.embed_tokens.weight' chunk 3" / "header" / "bytes chunk 7" for messages.
std::string DescribeChunk(const ChunkKey& key);

}  // namespace weightfs

// External bases: a version whose files stay where they already are — a model repo on the
// Hugging Face Hub at a pinned commit — and whose manifest only describes them.
//
// BuildExternalBase reads each file once (from the local Hugging Face cache when the file is
// there, else by ranged reads), plans it into chunks like push does, and records every chunk
// as a kExternal recipe: "bytes [offset, offset+length) of source S", with the XXH3-128 of those
// bytes. Nothing is uploaded: the manifest is the whole cost of the base in the bucket. Versions
// pushed on top of it store deltas against it as against any parent, and a reader materializes
// a base chunk with one ranged read of the source (hub/engine/external_source.h), verified against its
// hash, so reading one tensor fetches from the repo only that tensor's chunks.
//
// Memory: one window of at most kWindowBytes per call, whatever the file sizes. The files' SHA-256
// are computed while reading and, when the caller knows them (the Hub's LFS oid), must match.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/manifest.h"
#include "core/status.h"
#include "core/thread_pool.h"

namespace weightfs {

struct ExternalBaseFile {
  std::string path;    // in the version ("model-00001-of-00004.safetensors")
  std::string source;  // manifest source string, "hf://ORG/REPO@COMMIT/PATH"
  uint64_t size = 0;
  std::string sha256;  // known digest (64 hex) to check, or empty
  // Exactly `length` bytes at `offset` of the file. Called from the calling thread only.
  std::function<Expected<std::vector<uint8_t>>(uint64_t offset, uint64_t length)> read;
};

// The manifest of `target` (no parent; `created` set to now). `progress(done, total)` is called
// with bytes read. Errors name the file.
Expected<Manifest> BuildExternalBase(const VersionRef& target, std::vector<ExternalBaseFile> files,
                                     ThreadPool& pool, uint64_t chunk_bytes = kDefaultChunkBytes,
                                     const std::function<void(uint64_t, uint64_t)>& progress = {});

}  // namespace weightfs

// Reading whole versions: pull (materialize into a directory), verify (re-derive every chunk
// from the bucket and check every hash), and ranged reads of one file (cat).
//
// Chunks are materialized in parallel (through a Materializer, so the cache and the nearest
// cached ancestor are used), in windows of a bounded number of chunks, and consumed in file
// order so that the whole-file SHA-256 is computed on the way. Memory: one window of chunks.
//
// Pull writes each file to DEST/<path>.weightfs-partial and renames it into place only after
// its SHA-256 matches the manifest, so DEST never holds a wrong byte under a file's real name.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "core/manifest.h"
#include "core/thread_pool.h"
#include "hub/engine/materializer.h"

namespace weightfs {

struct ReadOptions {
  // Pull records each written file's chunks here as references (ChunkCache::PutReferences).
  ChunkCache* cache = nullptr;
  // Called (serialized) with logical bytes done and total.
  std::function<void(uint64_t done, uint64_t total)> progress;
};

// Calls `consume(chunk_index, bytes)` for every chunk of `file` in order; stops at the first
// error (its own or consume's). `pool` sets the parallelism.
Status ForEachChunk(Materializer& materializer, ThreadPool& pool, const Manifest& manifest,
                    const ManifestFile& file,
                    const std::function<Status(size_t, std::span<const uint8_t>)>& consume);

Status PullVersion(Materializer& materializer, ThreadPool& pool, const Manifest& manifest,
                   const std::string& dest_dir, const ReadOptions& options = {});

// Materializes every chunk and checks every chunk hash and file SHA-256. Returns the first
// failure, naming the file and chunk.
Status VerifyVersion(Materializer& materializer, ThreadPool& pool, const Manifest& manifest,
                     const ReadOptions& options = {});

// Bytes [offset, offset + length) of `file` (clipped to its size), passed to `sink` in order.
Status ReadRange(Materializer& materializer, const Manifest& manifest, const ManifestFile& file,
                 uint64_t offset, uint64_t length,
                 const std::function<Status(std::span<const uint8_t>)>& sink);

}  // namespace weightfs

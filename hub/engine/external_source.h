// ExternalSources: files outside the bucket that a manifest's recipes may read raw bytes from —
// today a base model kept in a Hugging Face model repo at a pinned commit.
//
// A manifest names each such file once in its `sources` table with a source string
//   hf://ORG/REPO@COMMIT/PATH        (COMMIT: 40 lowercase hex digits; PATH: the file in the repo)
// and a chunk with encoding kExternal reads bytes [ref.offset, ref.offset + ref.length) of
// sources[ref.pack]; the bytes are the chunk (no codec), verified against its hash like any
// other chunk. A version pushed on top of such a base therefore stores only its deltas, and a
// reader fetches from the repo only the byte ranges its chunks need.
//
// Implementations are thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace weightfs {

class ExternalSources {
 public:
  virtual ~ExternalSources() = default;
  // Exactly `length` bytes at `offset` of `source` (a short read is an error). Errors name the
  // source (never a credential).
  virtual Expected<std::vector<uint8_t>> Read(std::string_view source, uint64_t offset,
                                              uint64_t length) = 0;
};

}  // namespace weightfs

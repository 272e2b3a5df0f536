// libFuzzer target for hub/engine/reference_index: ParseReferenceIndex on arbitrary bytes (an index file
// under a chunk cache's refs/ is a file anyone with access can write). Beyond "never crash, never
// throw", a refused input is Corruption with a message, and an accepted index keeps what the
// chunk cache relies on — an absolute path, every row a chunk inside the file — and survives
// SerializeReferenceIndex -> ParseReferenceIndex byte for byte.
//
//   cmake -DWEIGHTFS_FUZZ=ON -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang ...
//   ./reference_index_fuzz -max_total_time=60 corpus/
// Seeds: index files from a cache directory (<cache>/refs/*).
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "core/chunk_plan.h"
#include "hub/engine/reference_index.h"
#include "tests/fuzz/fuzz_input.h"

using weightfs::fuzz::Check;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> bytes(data, size);
  auto parsed = weightfs::ParseReferenceIndex(bytes);
  if (!parsed.ok()) {
    Check(parsed.status().kind() == weightfs::ErrorKind::kCorruption);
    Check(!parsed.status().message().empty());
    return 0;
  }
  Check(!parsed->path.empty() && parsed->path[0] == '/' &&
        parsed->path.size() <= weightfs::kMaxReferencePath);
  for (const weightfs::ChunkRef& r : parsed->rows) {
    Check(r.length > 0 && r.length <= weightfs::kMaxChunkBytes);
    Check(r.offset <= parsed->file_size && r.length <= parsed->file_size - r.offset);
  }
  const std::vector<uint8_t> again = weightfs::SerializeReferenceIndex(*parsed);
  Check(again.size() == size && std::equal(again.begin(), again.end(), bytes.begin()));
  return 0;
}

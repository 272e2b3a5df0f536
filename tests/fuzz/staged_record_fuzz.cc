// libFuzzer target for hub/engine/staged_version: a part record (staging/<model>@<version>/parts/<id>)
// is read by every node that publishes a version written in parts, and anyone who can write
// the bucket can write one. Beyond "never crash, never throw": a refused record has a message;
// an accepted one names a valid part id, and serializing it and parsing it again gives the same
// part (id, N, parent, removed paths, files and their rows).
//
//   cmake -DWEIGHTFS_FUZZ=ON -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang ...
//   ./staged_record_fuzz -max_total_time=60 corpus/
// Seeds: records from a bucket's staging/ (e.g. a `weightfs commit --parts 2 --timeout 1` left).
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "hub/engine/staged_version.h"
#include "tests/fuzz/fuzz_input.h"

using weightfs::fuzz::Check;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> bytes(data, size);
  auto meta = weightfs::StagedVersion::ParseMeta(bytes);
  if (!meta.ok()) Check(!meta.status().message().empty());
  auto parsed = weightfs::StagedVersion::ParseRecord(bytes, "acme/m", "v1");
  if (!parsed.ok()) {
    Check(!parsed.status().message().empty());
    return 0;
  }
  Check(meta.ok());
  Check(weightfs::StagedVersion::ValidatePartId(parsed->meta.id).ok());
  Check(parsed->meta.parts >= 1);
  const std::vector<uint8_t> again = weightfs::StagedVersion::SerializeRecord(*parsed);
  auto reparsed = weightfs::StagedVersion::ParseRecord(again, "acme/m", "v1");
  Check(reparsed.ok());
  Check(reparsed->meta.id == parsed->meta.id && reparsed->meta.parts == parsed->meta.parts &&
        reparsed->meta.parent == parsed->meta.parent && reparsed->meta.removed == parsed->meta.removed);
  Check(reparsed->manifest.files.size() == parsed->manifest.files.size());
  for (size_t i = 0; i < parsed->manifest.files.size(); ++i) {
    const auto& a = parsed->manifest.files[i];
    const auto& b = reparsed->manifest.files[i];
    Check(a.path == b.path && a.size == b.size && a.sha256 == b.sha256 && a.chunks.size() == b.chunks.size());
  }
  return 0;
}

// libFuzzer target for hub/trl/trl_bucket: TRL delta-sync files from the fuzzer, read end to end.
// An in-memory store holds a valid anchor at step 1 (or, when the input says so, a fuzzed one),
// optionally a second valid anchor at step 5 that overlays part of the state, and up to four
// fuzzed step files; the target opens it with OpenTrlVersions, lists the versions, reads every
// manifest and materializes every chunk of every version. Errors are fine; a crash, hang, trap,
// unbounded allocation or an error of an unexpected kind is a finding. DecodeTrlIndices is also
// fed the raw input under every encoding.
//
// Input: byte 0 = options (bit 0: the first file is the anchor of step 1, replacing the valid
// one; bits 1-2: chunk size 8 << n; bit 3: add the anchor of step 5; bit 4: a patch cache too
// small to keep anything). Then files, each [u8 flags][u16 length][length bytes]: flags bits
// 1-3 pick the step (2 + n, as a delta), and bit 0 says the bytes are [u16 n][n bytes of header
// JSON][tensor data] (the 8-byte length prefix is filled in), else a whole file.
//
//   ./trl_patch_fuzz -max_len=2048 -rss_limit_mb=2048 corpus/
#include <spdlog/spdlog.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string_view>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "hub/engine/bucket.h"
#include "hub/trl/trl_bucket.h"
#include "hub/store/store.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/testing/mem_store.h"
#include "tests/testing/safetensors_builder.h"

namespace {

using weightfs::DType;
using weightfs::ErrorKind;
using weightfs::Status;
using weightfs::fuzz::Check;

struct Tensor {
  std::string name;
  DType dtype;
  std::vector<uint64_t> shape;
};

// A TRL file of `tensors` (their data a pattern of `step`) with the metadata of step `step`.
std::vector<uint8_t> Safetensors(const std::vector<Tensor>& tensors, uint64_t step) {
  weightfs::test::SafetensorsBuilder b;
  for (const Tensor& t : tensors) b.Add(t.name, t.dtype, t.shape);
  return b.Metadata("format", "sparse_weight_patch")
      .Metadata("sparse", "False")
      .Metadata("model_version", std::to_string(step))
      .Seed(step)
      .Build();
}

// Step 1's anchor: every tensor; step 5's: part of them, one redefined with another shape.
const std::vector<uint8_t>& Anchor1() {
  static const auto* a = new std::vector<uint8_t>(Safetensors(
      {{"model.w", DType::kBF16, {3, 5}}, {"model.b", DType::kF32, {7}}, {"x", DType::kU8, {9}},
       {"e", DType::kBF16, {0}}},
      1));
  return *a;
}
const std::vector<uint8_t>& Anchor5() {
  static const auto* a = new std::vector<uint8_t>(
      Safetensors({{"model.b", DType::kF32, {2, 3}}, {"y", DType::kI64, {3}}}, 5));
  return *a;
}

std::string StepKey(bool anchor, uint64_t step) {
  char name[64];
  std::snprintf(name, sizeof(name), "%s/step_%06llu.safetensors", anchor ? "anchors" : "deltas",
                static_cast<unsigned long long>(step));
  return name;
}

// A file from the fuzzer: whole, or header JSON + data with the length prefix filled in.
std::vector<uint8_t> FileFrom(std::span<const uint8_t> bytes, bool framed) {
  if (!framed) return {bytes.begin(), bytes.end()};
  weightfs::fuzz::Reader r(bytes.data(), bytes.size());
  const std::span<const uint8_t> json = r.Take(r.U16());
  const std::span<const uint8_t> data = r.Rest();
  return weightfs::test::SafetensorsBuilder()
      .RawHeader(std::string_view(reinterpret_cast<const char*>(json.data()), json.size()))
      .Trailing({data.begin(), data.end()})
      .Build();
}

bool ExpectedKind(const Status& s) {
  const ErrorKind k = s.kind();
  return k == ErrorKind::kCorruption || k == ErrorKind::kUnsupported || k == ErrorKind::kNotFound ||
         k == ErrorKind::kResourceExhausted;
}

void FuzzBucket(const uint8_t* data, size_t size) {
  weightfs::fuzz::Reader in(data, size);
  const uint8_t options = in.U8();
  auto store = std::make_shared<weightfs::test::MemStore>("mem://fuzz");
  bool anchor_fuzzed = options & 1;
  if (!anchor_fuzzed) Check(store->Put(StepKey(true, 1), Anchor1(), weightfs::PutMode::kOverwrite).ok());
  if (options & 8) Check(store->Put(StepKey(true, 5), Anchor5(), weightfs::PutMode::kOverwrite).ok());
  for (int n = 0; n < 4 && !in.empty(); ++n) {
    const uint8_t flags = in.U8();
    const std::vector<uint8_t> file = FileFrom(in.Take(in.U16()), flags & 1);
    if (anchor_fuzzed) {
      Check(store->Put(StepKey(true, 1), file, weightfs::PutMode::kOverwrite).ok());
      anchor_fuzzed = false;
      continue;
    }
    Check(store->Put(StepKey(false, 2 + ((flags >> 1) & 7)), file, weightfs::PutMode::kOverwrite).ok());
  }

  weightfs::TrlOptions opt;
  opt.chunk_bytes = uint64_t{8} << ((options >> 1) & 3);
  if (options & 16) opt.patch_cache_bytes = 1;
  auto trl = weightfs::OpenTrlVersions(store, "fuzz/model", opt);
  if (!trl.ok()) {
    Check(ExpectedKind(trl.status()));
    return;
  }
  auto versions = (*trl)->ListVersions("");
  Check(versions.ok());
  for (const weightfs::VersionInfo& v : *versions) {
    auto m = (*trl)->ReadManifest(v.model, v.version);
    if (!m.ok()) {
      Check(ExpectedKind(m.status()));
      continue;
    }
    for (const weightfs::ManifestFile& f : (*m)->files) {
      uint64_t cursor = 0;
      std::vector<uint8_t> header;
      bool header_ok = true;
      for (size_t i = 0; i < f.chunks.size(); ++i) {
        const weightfs::ManifestChunk& c = f.chunks[i];
        Check(c.offset == cursor && c.length > 0);
        const bool is_header = c.key.tensor == weightfs::kHeaderChunkName;
        if (!is_header) Check(c.length <= opt.chunk_bytes);
        cursor += c.length;
        std::vector<uint8_t> out(c.length);
        Status s = (*trl)->Materialize(**m, f, i, out);
        if (!s.ok()) {
          Check(ExpectedKind(s));
          header_ok = header_ok && !is_header;
          continue;
        }
        if (is_header) header.insert(header.end(), out.begin(), out.end());
      }
      Check(cursor == f.size);
      // The synthesized header is a valid safetensors header of the synthesized file.
      if (header_ok) Check(weightfs::ParseSafetensorsHeader(header, f.size).ok());
    }
  }
}

void FuzzIndices(const uint8_t* data, size_t size) {
  if (size < 2) return;
  const uint64_t numel = uint64_t{data[0]} << (data[1] % 64);
  const std::span<const uint8_t> bytes(data + 2, size - 2);
  for (DType dt : {DType::kI32, DType::kU16, DType::kU32, DType::kI64, DType::kU8}) {
    for (const char* enc : {"", "raw", "gap_delta", "nvcomp_cascaded"}) {
      auto idx = weightfs::DecodeTrlIndices(bytes, dt, enc, numel, "fuzz");
      if (!idx.ok()) {
        Check(idx.status().kind() == ErrorKind::kCorruption);
        continue;
      }
      for (size_t k = 0; k < idx->size(); ++k) {
        Check((*idx)[k] < numel);
        if (k > 0) Check((*idx)[k - 1] < (*idx)[k]);
      }
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);  // warnings about hostile files are expected
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzBucket(data, size);
  FuzzIndices(data, size);
  return 0;
}

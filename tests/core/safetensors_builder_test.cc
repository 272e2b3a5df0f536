// The test kit's safetensors builder (tests/testing/safetensors_builder.h): what it builds is a
// file the strict reader accepts, with the given data or the documented pattern, the metadata,
// and a raw header verbatim when asked; WriteTo writes the same bytes.
#include "tests/testing/safetensors_builder.h"

#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace weightfs {
namespace {

TEST(SafetensorsBuilderTest, BuildsAFileTheReaderAccepts) {
  test::SafetensorsBuilder b;
  b.Add("w", DType::kBF16, {4, 3}).Add("b", DType::kF32, {2}, {1, 2, 3, 4, 5, 6, 7, 8}).Metadata("format", "pt").Seed(5);
  const std::vector<uint8_t> file = b.Build();
  auto h = ParseSafetensorsHeader(file, file.size());
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->data_offset, b.DataOffset());
  EXPECT_EQ(h->data_offset % 8, 0u);
  EXPECT_EQ(h->metadata.at("format"), "pt");
  ASSERT_EQ(h->tensors.size(), 2u);
  EXPECT_EQ(h->tensors[0].name, "w");
  EXPECT_EQ(h->tensors[0].size(), 24u);
  EXPECT_EQ(h->tensors[1].name, "b");
  const std::vector<TensorInfo> tensors = b.Tensors();
  ASSERT_EQ(tensors.size(), 2u);
  EXPECT_EQ(tensors[1].begin, 24u);
  EXPECT_EQ(tensors[1].end, 32u);
  // The pattern: byte i of the data section is i * 37 + seed; given data verbatim.
  for (uint64_t i = 0; i < 24; ++i) EXPECT_EQ(file[h->data_offset + i], static_cast<uint8_t>(i * 37 + 5)) << i;
  EXPECT_EQ(std::vector<uint8_t>(file.end() - 8, file.end()), (std::vector<uint8_t>{1, 2, 3, 4, 5, 6, 7, 8}));
}

TEST(SafetensorsBuilderTest, RawHeaderAndTrailingBytesAreVerbatim) {
  const std::vector<uint8_t> file =
      test::SafetensorsBuilder().RawHeader(R"({"__metadata__":null})").Trailing({9, 9}).Build();
  ASSERT_EQ(file.size(), 8u + 21u + 2u);
  EXPECT_EQ(std::vector<uint8_t>(file.begin(), file.begin() + 8), test::SafetensorsLengthPrefix(21));
  EXPECT_EQ(std::string(file.begin() + 8, file.begin() + 29), R"({"__metadata__":null})");
  EXPECT_FALSE(ParseSafetensorsHeader(file, file.size()).ok());
}

TEST(SafetensorsBuilderTest, WritesToAPath) {
  const std::filesystem::path path =
      std::filesystem::temp_directory_path() / ("wfs-builder-" + std::to_string(::getpid()) + ".safetensors");
  test::SafetensorsBuilder b;
  b.Add(test::TensorSpec("x", DType::kI64, {3}));
  ASSERT_TRUE(b.WriteTo(path.string()));
  std::ifstream in(path, std::ios::binary);
  const std::vector<uint8_t> got((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(got, b.Build());
  std::filesystem::remove(path);
  EXPECT_FALSE(b.WriteTo((path / "no" / "such" / "dir").string()));
}

}  // namespace
}  // namespace weightfs

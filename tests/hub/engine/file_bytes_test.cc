// FileBytes: the encoder's reads of a file, from memory or by pread, and a file that shrinks
// under them (an error, never a signal).
#include "hub/engine/file_bytes.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <numeric>
#include <vector>

#include <gtest/gtest.h>

namespace weightfs {
namespace {

namespace fs = std::filesystem;

class FileBytesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = fs::temp_directory_path() / ("wfs-file-bytes-" + std::to_string(::getpid()));
    bytes_.resize(3 << 20);
    std::iota(bytes_.begin(), bytes_.end(), uint8_t{7});
    std::ofstream(path_, std::ios::binary).write(reinterpret_cast<const char*>(bytes_.data()),
                                                 static_cast<std::streamsize>(bytes_.size()));
  }
  void TearDown() override { fs::remove(path_); }

  fs::path path_;
  std::vector<uint8_t> bytes_;
};

TEST_F(FileBytesTest, ADescriptorReadsWhatMemoryHolds) {
  Expected<FileBytes> file = FileBytes::Open(path_.string());
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  const FileBytes memory(bytes_);
  ASSERT_EQ(file->size(), bytes_.size());
  EXPECT_FALSE(file->in_memory());
  EXPECT_TRUE(memory.in_memory());
  for (const auto& [offset, length] : {std::pair<uint64_t, size_t>{0, 8}, {4095, 70001}, {(3 << 20) - 5, 5}, {17, 0}}) {
    std::vector<uint8_t> a(length), b(length);
    ASSERT_TRUE(file->Read(offset, a).ok());
    ASSERT_TRUE(memory.Read(offset, b).ok());
    EXPECT_EQ(a, b) << "at " << offset;
    EXPECT_TRUE(std::equal(a.begin(), a.end(), bytes_.begin() + static_cast<ptrdiff_t>(offset)));
  }
  std::vector<uint8_t> past(10);
  EXPECT_EQ(file->Read(bytes_.size() - 5, past).kind(), ErrorKind::kInvalidArgument);
  EXPECT_EQ(memory.Read(bytes_.size() - 5, past).kind(), ErrorKind::kInvalidArgument);
}

TEST_F(FileBytesTest, AFileThatShrinksUnderAReaderIsAnErrorNamingIt) {
  Expected<FileBytes> file = FileBytes::Open(path_.string());
  ASSERT_TRUE(file.ok());
  EXPECT_FALSE(file->Shrank());
  fs::resize_file(path_, 1 << 20);
  EXPECT_TRUE(file->Shrank());
  std::vector<uint8_t> out(2 << 20);
  const Status s = file->Read(0, out);
  EXPECT_EQ(s.kind(), ErrorKind::kIOError);
  EXPECT_NE(s.message().find(path_.string()), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("ended at 1048576 bytes"), std::string::npos) << s.ToString();
  // What is still there reads as it was.
  std::vector<uint8_t> head(1 << 20);
  ASSERT_TRUE(file->Read(0, head).ok());
  EXPECT_TRUE(std::equal(head.begin(), head.end(), bytes_.begin()));
}

TEST_F(FileBytesTest, OpenRefusesWhatIsNotARegularFile) {
  EXPECT_EQ(FileBytes::Open(path_.parent_path().string()).status().kind(), ErrorKind::kInvalidArgument);
  EXPECT_FALSE(FileBytes::Open((path_.string() + ".missing")).ok());
}

}  // namespace
}  // namespace weightfs

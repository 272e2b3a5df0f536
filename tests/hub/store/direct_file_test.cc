// hub/store/direct_file.h: direct reads of any range, and a streamed write's bounded page cache.
#include "hub/store/direct_file.h"
#include "hub/store/local_file.h"
#include "tests/testing/bytes.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

namespace weightfs {
namespace {

namespace fs = std::filesystem;

constexpr long kTmpfsMagic = 0x01021994;

class DirectFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("wfs-direct-file-" + std::to_string(::getpid()) + "-" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    path_ = (dir_ / "f").string();
  }
  void TearDown() override { fs::remove_all(dir_); }

  // The file's pages in the page cache (mincore of a map of it).
  size_t ResidentPages(uint64_t size) {
    const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return SIZE_MAX;
    void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (map == MAP_FAILED) return SIZE_MAX;
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    std::vector<unsigned char> in((size + page - 1) / page);
    size_t resident = 0;
    if (::mincore(map, size, in.data()) == 0) {
      for (unsigned char c : in) resident += c & 1;
    } else {
      resident = SIZE_MAX;
    }
    ::munmap(map, size);
    return resident;
  }

  fs::path dir_;
  std::string path_;
};

TEST_F(DirectFileTest, ReadsAnyRangeAsTheCacheDoes) {
  const std::vector<uint8_t> bytes = test::RandomBytes((5 << 20) + 1234, 7);  // past the 4 MiB buffer
  {
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(PwriteAll(fd, bytes.data(), bytes.size(), 0, "f").ok());
    ::close(fd);
  }
  const int fd = OpenDirect(path_, O_RDONLY);
  if (fd < 0) GTEST_SKIP() << "no direct I/O on " << dir_;
  struct Case {
    uint64_t offset, size;
  };
  const std::vector<Case> cases = {
      {0, 1}, {1, 4095}, {4095, 2}, {4096, 4096}, {100, 3 << 20}, {12345, (4 << 20) + 7},
      {0, bytes.size()}, {bytes.size() - 10, 10}, {bytes.size() - 10, 100}, {bytes.size(), 10}, {bytes.size() + 5000, 1},
  };
  for (const Case& c : cases) {
    std::vector<uint8_t> out(c.size, 0xEE);
    int error = -1;
    const uint64_t got = PreadDirect(fd, out.data(), c.size, c.offset, &error);
    const uint64_t want = c.offset >= bytes.size() ? 0 : std::min<uint64_t>(c.size, bytes.size() - c.offset);
    EXPECT_EQ(error, 0);
    ASSERT_EQ(got, want) << "at " << c.offset << " for " << c.size;
    EXPECT_TRUE(std::equal(out.begin(), out.begin() + static_cast<ptrdiff_t>(got), bytes.begin() + static_cast<ptrdiff_t>(c.offset)))
        << "at " << c.offset << " for " << c.size;
  }
  ::close(fd);
}

TEST_F(DirectFileTest, ReadsTheDirtyPagesOfABufferedWrite) {
  // A direct read sees what a buffered write left in the cache (the kernel writes it back
  // first): the staging file's head and tail are written so.
  const int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  const std::vector<uint8_t> bytes = test::RandomBytes(100000, 3);
  ASSERT_TRUE(PwriteAll(fd, bytes.data(), bytes.size(), 0, "f").ok());
  const int direct = OpenDirect(path_, O_RDONLY);
  if (direct < 0) {
    ::close(fd);
    GTEST_SKIP() << "no direct I/O on " << dir_;
  }
  std::vector<uint8_t> out(bytes.size());
  EXPECT_EQ(PreadDirect(direct, out.data(), out.size(), 0), bytes.size());
  EXPECT_EQ(out, bytes);
  ::close(direct);
  ::close(fd);
}

// PreadAroundCache: the same bytes whether they are cached or not; bytes not cached stay out of
// the cache (where the file system does direct I/O), cached ones are read from it.
TEST_F(DirectFileTest, AReadAroundTheCacheLeavesTheCacheAsItWas) {
  const std::vector<uint8_t> bytes = test::RandomBytes((6 << 20) + 777, 13);
  const int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(PwriteAll(fd, bytes.data(), bytes.size(), 0, "f").ok());
  ASSERT_EQ(::fdatasync(fd), 0);
  EXPECT_TRUE(AllInPageCache(fd, 0, bytes.size()));  // just written
  EXPECT_TRUE(AllInPageCache(fd, 123, 0));
  ASSERT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
  struct statfs sfs {};
  ASSERT_EQ(::fstatfs(fd, &sfs), 0);
  const bool tmpfs = sfs.f_type == kTmpfsMagic;  // (its pages are the file: never dropped)
  if (!tmpfs) {
    EXPECT_FALSE(AllInPageCache(fd, 5000, 1 << 20));
  }
  const int direct = OpenDirect(path_, O_RDONLY);
  const bool direct_io = direct >= 0;
  if (direct_io) ::close(direct);
  struct Case {
    uint64_t offset, size;
  };
  for (const Case c : {Case{0, 1}, Case{4095, 2}, Case{100, (4 << 20) + 9}, Case{0, bytes.size()},
                       Case{bytes.size() - 10, 100}}) {
    const int rfd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);  // one descriptor per read, as its callers
    ASSERT_GE(rfd, 0);
    std::vector<uint8_t> out(c.size, 0xEE);
    int error = -1;
    const uint64_t want = std::min<uint64_t>(c.size, bytes.size() - c.offset);
    ASSERT_EQ(PreadAroundCache(rfd, out.data(), c.size, c.offset, &error), want) << c.offset;
    EXPECT_EQ(error, 0);
    EXPECT_TRUE(std::equal(out.begin(), out.begin() + static_cast<ptrdiff_t>(want), bytes.begin() + static_cast<ptrdiff_t>(c.offset)))
        << "at " << c.offset << " for " << c.size;
    ::close(rfd);
  }
  if (direct_io && !tmpfs) {
    EXPECT_EQ(ResidentPages(bytes.size()), 0u) << "a read around the cache filled it";
  }
  // Cached: read from the cache (and the same bytes).
  std::vector<uint8_t> all(bytes.size());
  ASSERT_TRUE(PreadAll(fd, all.data(), all.size(), 0, "f").ok());
  EXPECT_TRUE(AllInPageCache(fd, 0, bytes.size()));
  std::vector<uint8_t> out(3 << 20);
  ASSERT_EQ(PreadAroundCache(fd, out.data(), out.size(), 99), out.size());
  EXPECT_TRUE(std::equal(out.begin(), out.end(), bytes.begin() + 99));
  EXPECT_EQ(::fcntl(fd, F_GETFL) & O_DIRECT, 0) << "a cached range is read through the cache";
  ::close(fd);
}

TEST_F(DirectFileTest, AStreamedWriteKeepsTwoWindowsCachedAndItsBytesWhole) {
  const uint64_t w = StreamedWrites::kWindowBytes;
  const uint64_t size = 8 * w + 12345;
  const std::vector<uint8_t> bytes = test::RandomBytes(size, 11);
  const int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  StreamedWrites streamed;
  EXPECT_FALSE(streamed.dropped());
  for (uint64_t off = 0; off < size;) {  // 1 MiB writes, like a FUSE writer's
    const uint64_t n = std::min<uint64_t>(1 << 20, size - off);
    ASSERT_TRUE(PwriteAll(fd, bytes.data() + off, n, off, "f").ok());
    streamed.Wrote(fd, off, off + n);
    off += n;
  }
  EXPECT_TRUE(streamed.dropped());
  struct statfs sfs {};
  ASSERT_EQ(::fstatfs(fd, &sfs), 0);
  if (sfs.f_type != kTmpfsMagic) {  // (tmpfs pages are the file: nothing to drop)
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    EXPECT_LE(ResidentPages(size), (3 * w + 12345) / page + 1) << "more than the last windows stayed cached";
  }
  // The bytes, read back through the cache and around it.
  std::vector<uint8_t> back(size);
  ASSERT_TRUE(PreadAll(fd, back.data(), size, 0, "f").ok());
  EXPECT_EQ(back, bytes);
  ::close(fd);
}

TEST_F(DirectFileTest, WritesOutOfOrderDropNothingAndLoseNothing) {
  const uint64_t w = StreamedWrites::kWindowBytes;
  const uint64_t size = 4 * w;
  const std::vector<uint8_t> bytes = test::RandomBytes(size, 5);
  const int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  StreamedWrites streamed;
  // Back to front, a window's half at a time: no write is the stream's next.
  for (uint64_t off = size; off > 0;) {
    off -= w / 2;
    ASSERT_TRUE(PwriteAll(fd, bytes.data() + off, w / 2, off, "f").ok());
    streamed.Wrote(fd, off, off + w / 2);
  }
  EXPECT_FALSE(streamed.dropped());
  std::vector<uint8_t> back(size);
  ASSERT_TRUE(PreadAll(fd, back.data(), size, 0, "f").ok());
  EXPECT_EQ(back, bytes);
  ::close(fd);
}

}  // namespace
}  // namespace weightfs

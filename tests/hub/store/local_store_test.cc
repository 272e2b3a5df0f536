#include "hub/store/local_store.h"
#include "tests/testing/bytes.h"

#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace weightfs {
namespace {

using test::Bytes;

namespace fs = std::filesystem;

class LocalStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("wfs-local-store-" + std::to_string(::getpid()) + "-" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
    auto s = LocalStore::Open(root_.string());
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    store_ = std::move(s).value();
  }
  void TearDown() override { fs::remove_all(root_); }

  fs::path root_;
  std::unique_ptr<LocalStore> store_;
};

TEST_F(LocalStoreTest, PutGetHeadRangesAndOverwrite) {
  ASSERT_TRUE(store_->Put("packs/ab/cd", Bytes("hello world")).ok());
  auto all = store_->Get("packs/ab/cd");
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(*all, Bytes("hello world"));
  auto part = store_->Get("packs/ab/cd", ByteRange{6, 5});
  ASSERT_TRUE(part.ok());
  EXPECT_EQ(*part, Bytes("world"));
  auto clipped = store_->Get("packs/ab/cd", ByteRange{6, 100});
  EXPECT_EQ(*clipped, Bytes("world"));
  auto tail = store_->Get("packs/ab/cd", ByteRange{11, std::nullopt});
  ASSERT_TRUE(tail.ok());
  EXPECT_TRUE(tail->empty());
  EXPECT_EQ(store_->Get("packs/ab/cd", ByteRange{12, 1}).status().kind(), ErrorKind::kInvalidArgument);
  auto info = store_->Head("packs/ab/cd");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->size, 11u);
  ASSERT_TRUE(store_->Put("packs/ab/cd", Bytes("new")).ok());
  EXPECT_EQ(*store_->Get("packs/ab/cd"), Bytes("new"));
  ASSERT_TRUE(store_->Put("empty", {}).ok());
  EXPECT_TRUE(store_->Get("empty")->empty());
}

TEST_F(LocalStoreTest, MissingObjectsAreNotFound) {
  EXPECT_EQ(store_->Get("nope").status().kind(), ErrorKind::kNotFound);
  EXPECT_EQ(store_->Head("a/b").status().kind(), ErrorKind::kNotFound);
  EXPECT_EQ(store_->Delete("a/b").kind(), ErrorKind::kNotFound);
  ASSERT_TRUE(store_->Put("a/b", Bytes("x")).ok());
  EXPECT_EQ(store_->Get("a").status().kind(), ErrorKind::kNotFound);  // a directory, not an object
  EXPECT_TRUE(store_->Delete("a/b").ok());
  EXPECT_EQ(store_->Get("a/b").status().kind(), ErrorKind::kNotFound);
}

TEST_F(LocalStoreTest, CreateIfAbsentHasExactlyOneWinnerAcrossThreads) {
  constexpr int kThreads = 8;
  std::atomic<int> wins{0}, conflicts{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Status s = store_->Put("models/m/versions/v1.json", Bytes("writer " + std::to_string(t)),
                             PutMode::kCreateIfAbsent);
      if (s.ok()) ++wins;
      else if (s.kind() == ErrorKind::kConflict) ++conflicts;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(wins.load(), 1);
  EXPECT_EQ(conflicts.load(), kThreads - 1);
  auto got = store_->Get("models/m/versions/v1.json");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(std::string(got->begin(), got->end()).rfind("writer ", 0), 0u);
  // No temporary files are left behind, and none is listed.
  EXPECT_TRUE(fs::is_empty(root_ / ".weightfs-tmp"));
}

TEST_F(LocalStoreTest, ListIsSortedPrefixedAndPaginated) {
  for (const char* k : {"packs/03", "packs/01", "packs/02", "models/a/versions/v1.json", "packsx"}) {
    ASSERT_TRUE(store_->Put(k, Bytes(k)).ok());
  }
  std::vector<std::string> keys;
  std::string cont;
  int pages = 0;
  do {
    auto page = store_->List("packs/", cont, 2);
    ASSERT_TRUE(page.ok());
    for (const auto& o : page->objects) keys.push_back(o.key);
    cont = page->continuation;
    ++pages;
  } while (!cont.empty() && pages < 10);
  EXPECT_EQ(keys, (std::vector<std::string>{"packs/01", "packs/02", "packs/03"}));
  EXPECT_EQ(pages, 2);
  auto all = store_->List("");
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->objects.size(), 5u);  // the temporary directory is never listed
  EXPECT_EQ(store_->List("models/a/")->objects.at(0).size, std::string("models/a/versions/v1.json").size());
  EXPECT_TRUE(store_->List("nothing/here/")->objects.empty());
}

TEST(StoreKeyTest, HostileKeysAreRejected) {
  for (const char* k : {"", "/abs", "a//b", "a/../b", "..", "./a", "a/", "sp ace", "nul\x01", "a\\b"}) {
    EXPECT_EQ(ValidateKey(k).kind(), ErrorKind::kInvalidArgument) << k;
  }
  EXPECT_EQ(ValidateKey(std::string(1025, 'a')).kind(), ErrorKind::kInvalidArgument);
  for (const char* k : {"weightfs.json", "models/org/name/versions/step-100.json", "packs/0a1b",
                        "a/b@c=d+e_f-g.h"}) {
    EXPECT_TRUE(ValidateKey(k).ok()) << k;
  }
}

TEST(LocalStoreOpenTest, MissingRootSaysWhatToDo) {
  auto s = LocalStore::Open("/nonexistent/weightfs/bucket");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().kind(), ErrorKind::kNotFound);
  EXPECT_NE(s.status().message().find("does not exist; make it a bucket with `weightfs init /nonexistent/weightfs/bucket`"),
            std::string::npos)
      << s.status().message();
}

// A regular file given as a bucket is not "missing": the message says what it is.
TEST(LocalStoreOpenTest, AFileIsNotABucketAndTheMessageSaysSo) {
  const fs::path file = fs::temp_directory_path() / ("wfs-not-a-bucket-" + std::to_string(::getpid()));
  { std::ofstream(file) << "x"; }
  auto s = LocalStore::Open(file.string());
  fs::remove(file);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().kind(), ErrorKind::kInvalidArgument);
  EXPECT_NE(s.status().message().find(file.string() + " is a file, not a bucket"), std::string::npos)
      << s.status().message();
  EXPECT_EQ(s.status().message().find("does not exist"), std::string::npos) << s.status().message();
}

TEST_F(LocalStoreTest, HostileKeysNeverTouchTheFilesystem) {
  EXPECT_EQ(store_->Put("../escape", Bytes("x")).kind(), ErrorKind::kInvalidArgument);
  EXPECT_FALSE(fs::exists(root_.parent_path() / "escape"));
  EXPECT_EQ(store_->Get("/etc/passwd").status().kind(), ErrorKind::kInvalidArgument);
}

}  // namespace
}  // namespace weightfs

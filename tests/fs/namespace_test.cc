// The mount's tree without FUSE: organisation directories, one directory per version, the
// latest link, attributes, xattrs, stable inode numbers and refresh.
#include "fs/namespace.h"

#include <thread>

#include <gtest/gtest.h>

#include "tests/fs/test_bucket.h"

namespace weightfs {
namespace {

using testing::RandomBytes;
using testing::TestBucket;

class NamespaceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    v0_ = bucket_.Push("acme/m", "v0", {{"a.bin", RandomBytes(300000, 1)}, {"sub/dir/b.bin", RandomBytes(1000, 2)}});
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // distinct creation times
    auto a1 = RandomBytes(300000, 1);
    a1[12345] ^= 1;
    v1_ = bucket_.Push("acme/m", "v1", {{"a.bin", a1}, {"sub/dir/b.bin", RandomBytes(1000, 2)}});
    bucket_.Push("top", "base", {{"x", RandomBytes(10, 3)}});
    ASSERT_TRUE(v0_ && v1_);
  }

  NamespaceOptions Options(std::chrono::milliseconds refresh = std::chrono::hours(1)) {
    NamespaceOptions o;
    o.refresh = refresh;
    o.uid = 1234;
    o.gid = 5678;
    return o;
  }

  static std::vector<std::string> Names(const std::vector<DirEntry>& entries) {
    std::vector<std::string> out;
    for (const DirEntry& e : entries) out.push_back(e.name);
    return out;
  }

  TestBucket bucket_{::testing::UnitTest::GetInstance()->current_test_info()->name()};
  std::shared_ptr<const Manifest> v0_, v1_;
};

TEST_F(NamespaceTest, ShowsOrganisationsVersionsAndLatest) {
  Namespace ns(&bucket_.bucket(), Options());
  auto root = ns.ReadDir(Namespace::kRootIno);
  ASSERT_TRUE(root.ok()) << root.status().ToString();
  EXPECT_EQ(Names(*root), (std::vector<std::string>{".", "..", "acme", "top@base", "top@latest"}));
  auto acme = ns.Lookup(Namespace::kRootIno, "acme");
  ASSERT_TRUE(acme.ok());
  EXPECT_TRUE(S_ISDIR(acme->st.st_mode));
  auto versions = ns.ReadDir(acme->ino);
  ASSERT_TRUE(versions.ok());
  EXPECT_EQ(Names(*versions), (std::vector<std::string>{".", "..", "m@latest", "m@v0", "m@v1"}));
  auto link = ns.Lookup(acme->ino, "m@latest");
  ASSERT_TRUE(link.ok());
  EXPECT_TRUE(S_ISLNK(link->st.st_mode));
  auto target = ns.ReadLink(link->ino);
  ASSERT_TRUE(target.ok());
  EXPECT_EQ(*target, "m@v1");
  EXPECT_EQ(link->st.st_size, 4);
  EXPECT_FALSE(ns.Lookup(acme->ino, "m@v7").ok());
  EXPECT_EQ(ns.Lookup(acme->ino, "m@v7").status().kind(), ErrorKind::kNotFound);
}

TEST_F(NamespaceTest, AttributesComeFromTheManifest) {
  Namespace ns(&bucket_.bucket(), Options());
  auto acme = ns.Lookup(Namespace::kRootIno, "acme");
  auto v1 = ns.Lookup(acme->ino, "m@v1");
  ASSERT_TRUE(v1.ok());
  EXPECT_EQ(v1->st.st_mode, S_IFDIR | 0555);
  // Not known from the listing (a version's sub-directories are in its head): 1, "unknown",
  // which find(1) and fts take as "do not count sub-directories by links". Exact once read.
  EXPECT_EQ(v1->st.st_nlink, 1u);
  ASSERT_TRUE(ns.ReadDir(v1->ino).ok());
  EXPECT_EQ(ns.GetAttr(v1->ino)->st.st_nlink, 3u);  // ".", its entry, and "sub/.."
  EXPECT_EQ(v1->st.st_uid, 1234u);
  EXPECT_EQ(v1->st.st_gid, 5678u);
  EXPECT_EQ(v1->st.st_mtim.tv_sec * 1000 + v1->st.st_mtim.tv_nsec / 1000000, v1_->created_ms);
  EXPECT_GE(v1->timeout_s, 3600);
  auto a = ns.Lookup(v1->ino, "a.bin");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->st.st_mode, S_IFREG | 0444);
  EXPECT_EQ(a->st.st_size, 300000);
  EXPECT_EQ(a->st.st_nlink, 1u);
  EXPECT_EQ(a->st.st_mtim.tv_sec, v1_->created_ms / 1000);
  auto sub = ns.Lookup(v1->ino, "sub");
  ASSERT_TRUE(sub.ok());
  auto dir = ns.Lookup(sub->ino, "dir");
  ASSERT_TRUE(dir.ok());
  auto b = ns.Lookup(dir->ino, "b.bin");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->st.st_size, 1000);
  auto file = ns.Open(b->ino);
  ASSERT_TRUE(file.ok());
  EXPECT_EQ(file->file->path, "sub/dir/b.bin");
  EXPECT_FALSE(ns.Open(sub->ino).ok());
  auto root = ns.GetAttr(Namespace::kRootIno);
  ASSERT_TRUE(root.ok());
  EXPECT_LE(root->timeout_s, 3600);  // above versions: the refresh interval
}

TEST_F(NamespaceTest, ExtendedAttributes) {
  Namespace ns(&bucket_.bucket(), Options());
  auto acme = ns.Lookup(Namespace::kRootIno, "acme");
  auto v0 = ns.Lookup(acme->ino, "m@v0");
  auto v1 = ns.Lookup(acme->ino, "m@v1");
  ASSERT_TRUE(v0.ok() && v1.ok());
  EXPECT_EQ(ns.GetXattr(v1->ino, "user.weightfs.parent").value(), "acme/m@v0");
  EXPECT_EQ(ns.GetXattr(v0->ino, "user.weightfs.parent").status().kind(), ErrorKind::kNotFound);
  EXPECT_EQ(ns.GetXattr(v1->ino, "user.weightfs.stored_bytes").value(), std::to_string(v1_->stats.stored_bytes));
  EXPECT_EQ(std::stod(ns.GetXattr(v1->ino, "user.weightfs.changed_fraction").value()),
            std::stod(std::to_string(v1_->stats.changed_fraction())));
  EXPECT_EQ(ns.ListXattr(v0->ino).value(),
            (std::vector<std::string>{"user.weightfs.stored_bytes", "user.weightfs.changed_fraction"}));
  auto a = ns.Lookup(v1->ino, "a.bin");
  EXPECT_EQ(ns.GetXattr(a->ino, "user.weightfs.sha256").value(), v1_->FindFile("a.bin")->sha256);
  EXPECT_EQ(ns.GetXattr(a->ino, "user.weightfs.parent").value(), "acme/m@v0");
  // One chunk of a.bin changed: v1 stored a small delta for it, nothing for the others.
  uint64_t stored = std::stoull(ns.GetXattr(a->ino, "user.weightfs.stored_bytes").value());
  EXPECT_GT(stored, 0u);
  EXPECT_LT(stored, 10000u);
  EXPECT_EQ(ns.GetXattr(a->ino, "user.weightfs.nope").status().kind(), ErrorKind::kNotFound);
  EXPECT_TRUE(ns.ListXattr(acme->ino).value().empty());
}

TEST_F(NamespaceTest, NewVersionsAppearAfterTheRefreshIntervalWithStableInodes) {
  NamespaceOptions listing_only = Options(std::chrono::hours(1));
  listing_only.probe_rate = 0;  // (probes: the next test)
  Namespace slow(&bucket_.bucket(), listing_only);
  Namespace fast(&bucket_.bucket(), Options(std::chrono::milliseconds(0)));
  auto acme_slow = slow.Lookup(Namespace::kRootIno, "acme");
  auto acme_fast = fast.Lookup(Namespace::kRootIno, "acme");
  auto v0_before = fast.Lookup(acme_fast->ino, "m@v0");
  ASSERT_TRUE(acme_slow.ok() && acme_fast.ok() && v0_before.ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  bucket_.Push("acme/m", "v2", {{"a.bin", RandomBytes(300000, 9)}});
  EXPECT_FALSE(slow.Lookup(acme_slow->ino, "m@v2").ok());  // listed an hour ago: not yet
  EXPECT_EQ(slow.ReadLink(slow.Lookup(acme_slow->ino, "m@latest")->ino).value(), "m@v1");
  EXPECT_TRUE(fast.Lookup(acme_fast->ino, "m@v2").ok());
  EXPECT_EQ(fast.ReadLink(fast.Lookup(acme_fast->ino, "m@latest")->ino).value(), "m@v2");
  auto v0_after = fast.Lookup(acme_fast->ino, "m@v0");
  ASSERT_TRUE(v0_after.ok());
  EXPECT_EQ(v0_after->ino, v0_before->ino);
}

TEST_F(NamespaceTest, ALookupOfAnUnlistedVersionChecksTheBucketForItAtOnce) {
  Namespace ns(&bucket_.bucket(), Options(std::chrono::hours(1)));
  auto acme = ns.Lookup(Namespace::kRootIno, "acme");
  ASSERT_TRUE(acme.ok());
  EXPECT_EQ(ns.ReadLink(ns.Lookup(acme->ino, "m@latest")->ino).value(), "m@v1");
  EXPECT_EQ(ns.Lookup(acme->ino, "m@v2").status().kind(), ErrorKind::kNotFound);
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  bucket_.Push("acme/m", "v2", {{"a.bin", RandomBytes(300000, 9)}});
  // Listed an hour ago, but asked by name: checked (once the 200 ms of the absent answer pass).
  bool found = false;
  for (int i = 0; i < 100 && !found; ++i) {
    found = ns.Lookup(acme->ino, "m@v2").ok();
    if (!found) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(found);
  auto entries = ns.ReadDir(acme->ino);
  ASSERT_TRUE(entries.ok());
  const std::vector<std::string> names = Names(*entries);
  EXPECT_EQ(std::count(names.begin(), names.end(), "m@v2"), 1);
  EXPECT_EQ(ns.ReadLink(ns.Lookup(acme->ino, "m@latest")->ino).value(), "m@v2");
  // Names that cannot be versions are not checked.
  for (const char* name : {"m@latest", "m@", "@v2", "m"}) {
    EXPECT_EQ(ns.Lookup(acme->ino, name).ok(), std::string(name) == "m@latest") << name;
  }
}

TEST_F(NamespaceTest, AFailedFirstListingIsAnErrorALaterOneKeepsThePreviousListing) {
  Namespace ns(&bucket_.bucket(), Options(std::chrono::milliseconds(0)));
  bucket_.faults().Fail(test::FaultStore::On(test::StoreOp::kList), Status::IOError("injected failure listing"));
  auto failed = ns.ReadDir(Namespace::kRootIno);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().kind(), ErrorKind::kIOError);
  bucket_.faults().Clear();
  auto listed = ns.ReadDir(Namespace::kRootIno);
  ASSERT_TRUE(listed.ok());
  bucket_.faults().Fail(test::FaultStore::On(test::StoreOp::kList), Status::IOError("injected failure listing"));
  auto kept = ns.ReadDir(Namespace::kRootIno);
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(Names(*kept), Names(*listed));
  bucket_.faults().Clear();
}

}  // namespace
}  // namespace weightfs

// MemStore (tests/testing/mem_store.h) against the generic Store contract
// (tests/testing/store_conformance.h): the in-memory store other suites use behaves as a bucket does.
#include <gtest/gtest.h>

#include "tests/testing/mem_store.h"
#include "tests/testing/store_conformance.h"

namespace weightfs {
namespace {

TEST(MemStoreConformanceTest, MeetsTheStoreContract) {
  test::MemStore store;
  // A neighbour outside the scope is neither listed nor touched.
  ASSERT_TRUE(store.Put("conformance-neighbour/x", test::ConformanceBytes("keep")).ok());
  test::RunStoreConformance(store, "conformance");
  EXPECT_EQ(*store.Get("conformance-neighbour/x"), test::ConformanceBytes("keep"));
  EXPECT_EQ(store.size(), 1u);
}

TEST(MemStoreConformanceTest, RecordsReadsOnlyWhenAsked) {
  test::MemStore store;
  ASSERT_TRUE(store.Put("a/b", test::ConformanceBytes("hello world")).ok());
  ASSERT_TRUE(store.Get("a/b", ByteRange{6, 100}).ok());
  EXPECT_TRUE(store.TakeReads().empty());
  store.SetRecordReads(true);
  ASSERT_TRUE(store.Get("a/b", ByteRange{6, 100}).ok());
  ASSERT_TRUE(store.Get("a/b").ok());
  const auto reads = store.TakeReads();
  ASSERT_EQ(reads.size(), 2u);
  EXPECT_EQ(reads[0].key, "a/b");
  EXPECT_EQ(reads[0].begin, 6u);
  EXPECT_EQ(reads[0].end, 11u);
  EXPECT_EQ(reads[1].begin, 0u);
  EXPECT_EQ(reads[1].end, 11u);
  EXPECT_TRUE(store.TakeReads().empty());
}

}  // namespace
}  // namespace weightfs

// LocalStore against the generic Store contract (tests/testing/store_conformance.h).
#include <gtest/gtest.h>

#include <filesystem>

#include "hub/store/local_store.h"
#include "tests/testing/store_conformance.h"
#include "tests/testing/test_servers.h"

namespace weightfs {
namespace {

TEST(LocalStoreConformanceTest, MeetsTheStoreContract) {
  test::TempDir dir("local-conformance");
  ASSERT_TRUE(dir.ok());
  auto store = LocalStore::Open(dir.path());
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  // A neighbour outside the scope is neither listed nor touched.
  ASSERT_TRUE((*store)->Put("conformance-neighbour/x", test::ConformanceBytes("keep")).ok());
  test::RunStoreConformance(**store, "conformance");
  EXPECT_EQ(*(*store)->Get("conformance-neighbour/x"), test::ConformanceBytes("keep"));
  // Nothing is left behind in the temporary directory.
  EXPECT_TRUE(std::filesystem::is_empty(dir.Join(".weightfs-tmp")));
}

}  // namespace
}  // namespace weightfs

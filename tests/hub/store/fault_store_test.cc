// The test kit's fault-injecting wrapper (tests/testing/fault_store.h) over its in-memory store
// (tests/testing/mem_store.h): rules by operation and key prefix, N times after M, throwing,
// holding calls until released, counting calls.
#include "tests/testing/fault_store.h"

#include <gtest/gtest.h>

#include <future>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "tests/testing/mem_store.h"
#include "tests/testing/bytes.h"

namespace weightfs {
namespace {

using test::Bytes;

using test::FaultStore;
using test::StoreOp;

TEST(FaultStoreTest, FailsMatchingCallsAfterSomeForSomeTimes) {
  auto mem = std::make_shared<test::MemStore>();
  FaultStore store(mem);
  store.Fail(FaultStore::On(StoreOp::kPut, "packs/").After(1).Times(2), Status::IOError("injected"));
  EXPECT_TRUE(store.Put("packs/a", Bytes("a")).ok());
  EXPECT_EQ(store.Put("packs/b", Bytes("b")).kind(), ErrorKind::kIOError);
  EXPECT_TRUE(store.Put("other/c", Bytes("c")).ok());  // another prefix: not matched
  EXPECT_EQ(store.Put("packs/d", Bytes("d")).kind(), ErrorKind::kIOError);
  EXPECT_TRUE(store.Put("packs/e", Bytes("e")).ok());  // the two failures are spent
  EXPECT_FALSE(mem->Head("packs/b").ok());
  EXPECT_FALSE(mem->Head("packs/d").ok());
  EXPECT_TRUE(store.Get("packs/a").ok());  // another operation: not matched
  EXPECT_EQ(store.Calls(StoreOp::kPut), 5u);
  EXPECT_EQ(store.Calls(StoreOp::kPut, "packs/"), 4u);
  EXPECT_EQ(store.Calls(StoreOp::kGet), 1u);
  EXPECT_EQ(store.Calls(), 6u);

  store.Fail(FaultStore::On(StoreOp::kAny), Status::Timeout("down"));
  EXPECT_EQ(store.List("").status().kind(), ErrorKind::kTimeout);
  EXPECT_EQ(store.Head("packs/a").status().kind(), ErrorKind::kTimeout);
  EXPECT_EQ(store.Delete("packs/a").kind(), ErrorKind::kTimeout);
  store.Clear();
  EXPECT_TRUE(store.Delete("packs/a").ok());
}

TEST(FaultStoreTest, ThrowsBadAlloc) {
  FaultStore store(std::make_shared<test::MemStore>());
  store.ThrowBadAlloc(FaultStore::On(StoreOp::kGet, "packs/"));
  ASSERT_TRUE(store.Put("packs/a", Bytes("a")).ok());
  EXPECT_THROW((void)store.Get("packs/a"), std::bad_alloc);
  store.Clear();
  EXPECT_TRUE(store.Get("packs/a").ok());
}

TEST(FaultStoreTest, HeldCallsWaitForRelease) {
  FaultStore store(std::make_shared<test::MemStore>());
  store.Hold(FaultStore::On(StoreOp::kPut, "m/"));
  auto first = std::async(std::launch::async, [&] { return store.Put("m/v1", Bytes("1"), PutMode::kCreateIfAbsent); });
  auto second = std::async(std::launch::async, [&] { return store.Put("m/v1", Bytes("2"), PutMode::kCreateIfAbsent); });
  ASSERT_TRUE(store.WaitHeld(2));
  EXPECT_EQ(store.held(), 2);
  EXPECT_TRUE(store.Put("x/y", Bytes("free")).ok());  // not held
  EXPECT_FALSE(store.Head("m/v1").ok());               // neither held Put has happened
  store.Release();
  const Status a = first.get(), b = second.get();
  EXPECT_EQ(a.ok() + b.ok(), 1) << a.ToString() << " / " << b.ToString();
  EXPECT_EQ((a.kind() == ErrorKind::kConflict) + (b.kind() == ErrorKind::kConflict), 1);
  EXPECT_EQ(store.held(), 0);
  EXPECT_TRUE(store.Put("m/v2", Bytes("3")).ok());  // released rules are gone
}

}  // namespace
}  // namespace weightfs

// SharedTierStore (hub/engine/shared_tier.h) in one process: several "nodes" (stores over one
// origin and one tier) read a pack; the origin, counted, serves each slice once; tier objects
// that are corrupt, truncated, foreign, stale, gone, or a tier that fails, cost a fetch from the
// origin and never a wrong byte. The same through real mounts: tests/fs/shared_cache_test.cc.
#include "hub/engine/shared_tier.h"

#include <future>
#include <random>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/testing/fault_store.h"
#include "tests/testing/mem_store.h"

namespace weightfs {
namespace {

using test::FaultStore;
using test::MemStore;
using test::StoreOp;

constexpr const char* kPack = "packs/0123456789abcdef0123456789abcdef";
constexpr uint64_t kSlice = 64 << 10;

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> out(n);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

class SharedTierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    pack_ = RandomBytes(16 * kSlice + 12345, 1);  // 16 whole slices and a short one
    ASSERT_TRUE(origin_mem_->Put(kPack, pack_).ok());
  }

  SharedTierOptions Options() const {
    SharedTierOptions o;
    o.slice_bytes = kSlice;
    o.block_bytes = 4 << 10;
    o.max_wait = std::chrono::milliseconds(5'000);
    o.read_ahead = false;  // exact counts (ReadingOnFillsTheNextSliceAhead has it on)
    return o;
  }
  std::unique_ptr<SharedTierStore> Node(SharedTierOptions o, std::shared_ptr<Store> tier = nullptr) {
    return std::make_unique<SharedTierStore>(origin_, tier ? tier : tier_, "s3://bucket/run", o);
  }
  std::unique_ptr<SharedTierStore> Node() { return Node(Options()); }

  std::vector<uint8_t> Expect(uint64_t offset, uint64_t length) const {
    const uint64_t end = std::min<uint64_t>(pack_.size(), offset + length);
    return std::vector<uint8_t>(pack_.begin() + static_cast<ptrdiff_t>(offset),
                                pack_.begin() + static_cast<ptrdiff_t>(end));
  }
  uint64_t OriginBytes() const { return origin_->counters().bytes_received.load(); }
  // The tier objects of the pack, oldest first by name (slice index).
  std::vector<std::string> TierKeys() {
    std::vector<std::string> keys;
    Expected<ListPage> page = tier_->List("weightfs-tier/", {}, 100000);
    EXPECT_TRUE(page.ok());
    if (page.ok()) {
      for (const ObjectInfo& o : page->objects) keys.push_back(o.key);
    }
    return keys;
  }

  std::vector<uint8_t> pack_;
  std::shared_ptr<MemStore> origin_mem_ = std::make_shared<MemStore>("mem://origin");
  std::shared_ptr<CountingStore> origin_ = std::make_shared<CountingStore>(origin_mem_);
  std::shared_ptr<MemStore> tier_ = std::make_shared<MemStore>("mem://tier");
};

TEST_F(SharedTierTest, NodesSharingATierFetchEachSliceOnceFromTheBucket) {
  auto a = Node(), b = Node(), c = Node();
  // Node a reads a payload inside one slice, one across a slice boundary, and the tail.
  for (auto [off, len] : std::vector<std::pair<uint64_t, uint64_t>>{
           {100, 5000}, {kSlice - 10, 30}, {16 * kSlice + 12000, 1000}}) {
    Expected<std::vector<uint8_t>> got = a->Get(kPack, ByteRange{off, len});
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(*got, Expect(off, len)) << off;
  }
  a->Flush();
  EXPECT_EQ(a->stats().fills.load(), 3u);  // slices 0, 1 and 16
  EXPECT_EQ(OriginBytes(), 2 * kSlice + 12345);
  // Node b reads everything: only the slices a did not fill come from the origin.
  Expected<std::vector<uint8_t>> all = b->Get(kPack);
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  EXPECT_EQ(*all, pack_);
  EXPECT_EQ(OriginBytes(), pack_.size());
  b->Flush();
  EXPECT_EQ(b->stats().fills.load(), 14u);
  EXPECT_EQ(b->stats().hits.load(), 3u);
  // Node c: every range from the tier, nothing from the origin; reads of a payload read the
  // blocks it covers, not the slice.
  std::mt19937 rng(2);
  for (int i = 0; i < 200; ++i) {
    const uint64_t off = rng() % pack_.size(), len = 1 + rng() % (3 * kSlice);
    Expected<std::vector<uint8_t>> got = c->Get(kPack, ByteRange{off, len});
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ASSERT_EQ(*got, Expect(off, len)) << off << "+" << len;
  }
  EXPECT_EQ(OriginBytes(), pack_.size());
  EXPECT_EQ(c->stats().fills.load(), 0u);
  EXPECT_EQ(c->stats().corrupt.load(), 0u);
  const uint64_t small_read = c->stats().bytes_received.load();
  (void)c->Get(kPack, ByteRange{5 * kSlice + 100, 200});
  EXPECT_LE(c->stats().bytes_received.load() - small_read, 8u << 10);  // two 4 KiB blocks at most
}

TEST_F(SharedTierTest, ReadingOnFillsTheNextSliceAhead) {
  SharedTierOptions o = Options();
  o.read_ahead = true;
  auto a = Node(o);
  // Slices 0 and 1 one after the other: slice 2 is filled ahead.
  ASSERT_TRUE(a->Get(kPack, ByteRange{0, kSlice}).ok());
  ASSERT_TRUE(a->Get(kPack, ByteRange{kSlice, kSlice}).ok());
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (OriginBytes() < 3 * kSlice && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(a->stats().prefetches.load(), 1u);
  Expected<std::vector<uint8_t>> got = a->Get(kPack, ByteRange{2 * kSlice + 7, 1000});
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, Expect(2 * kSlice + 7, 1000));
  a->Flush();
  // Slice 2 came from the prefetch; reading it read on to slice 3.
  EXPECT_LE(OriginBytes(), 4 * kSlice);
  // A read here and there is not reading on.
  auto b = Node(o);
  ASSERT_TRUE(b->Get(kPack, ByteRange{10 * kSlice, 10}).ok());
  ASSERT_TRUE(b->Get(kPack, ByteRange{5 * kSlice, 10}).ok());
  EXPECT_EQ(b->stats().prefetches.load(), 0u);
}

TEST_F(SharedTierTest, RangesAtAndPastTheEndAnswerAsTheBucketDoes) {
  auto a = Node();
  for (uint64_t off : {uint64_t(pack_.size()), uint64_t(pack_.size() - 1), uint64_t(16 * kSlice), uint64_t(0)}) {
    Expected<std::vector<uint8_t>> got = a->Get(kPack, ByteRange{off, std::nullopt});
    ASSERT_TRUE(got.ok()) << off << ": " << got.status().ToString();
    EXPECT_EQ(*got, Expect(off, pack_.size())) << off;
  }
  Expected<std::vector<uint8_t>> past = a->Get(kPack, ByteRange{pack_.size() + 1, 10});
  ASSERT_FALSE(past.ok());
  EXPECT_EQ(past.status().kind(), ErrorKind::kInvalidArgument);
  Expected<std::vector<uint8_t>> missing = a->Get("packs/ffffffffffffffffffffffffffffffff", ByteRange{0, 10});
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().kind(), ErrorKind::kNotFound);
  // An object that is a whole number of slices.
  const std::vector<uint8_t> even = RandomBytes(2 * kSlice, 3);
  ASSERT_TRUE(origin_mem_->Put("tables/00000000000000000000000000000001", even).ok());
  for (int pass = 0; pass < 2; ++pass) {
    Expected<std::vector<uint8_t>> got = Node()->Get("tables/00000000000000000000000000000001");
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(*got, even);
  }
}

TEST_F(SharedTierTest, ConcurrentNodesFillEachSliceOnce) {
  // The origin is slow, so that nodes miss the same slices at the same time.
  auto slow = std::make_shared<FaultStore>(origin_mem_);
  slow->Delay(FaultStore::On(StoreOp::kGet, "packs/"), std::chrono::milliseconds(30));
  origin_ = std::make_shared<CountingStore>(slow);
  std::vector<std::unique_ptr<SharedTierStore>> nodes;
  for (int i = 0; i < 4; ++i) nodes.push_back(Node());
  std::vector<std::future<std::string>> readers;
  for (int n = 0; n < 4; ++n) {
    for (int t = 0; t < 3; ++t) {
      readers.push_back(std::async(std::launch::async, [&, n, t]() -> std::string {
        std::mt19937 rng(static_cast<uint32_t>(10 * n + t));
        for (int i = 0; i < 40; ++i) {
          const uint64_t off = rng() % pack_.size(), len = 1 + rng() % (kSlice + 1000);
          Expected<std::vector<uint8_t>> got = nodes[n]->Get(kPack, ByteRange{off, len});
          if (!got.ok()) return got.status().ToString();
          if (*got != Expect(off, len)) return "wrong bytes at " + std::to_string(off);
        }
        return "";
      }));
    }
  }
  for (auto& r : readers) EXPECT_EQ(r.get(), "");
  for (auto& n : nodes) n->Flush();
  uint64_t fills = 0, waits = 0, timeouts = 0;
  for (const auto& n : nodes) {
    fills += n->stats().fills.load();
    waits += n->stats().waits.load();
    timeouts += n->stats().wait_timeouts.load();
  }
  EXPECT_EQ(timeouts, 0u);
  EXPECT_LE(fills, 17u);
  EXPECT_GT(waits, 0u) << "no node waited for another's fill: the test did not race";
  EXPECT_LE(OriginBytes(), pack_.size()) << "a slice was fetched from the origin twice";
  const std::vector<std::string> keys = TierKeys();
  EXPECT_TRUE(std::none_of(keys.begin(), keys.end(), [](const std::string& k) { return k.ends_with(".fill"); }))
      << "a fill marker was left behind";
}

TEST_F(SharedTierTest, CorruptTruncatedAndForeignTierObjectsAreMissesNeverWrongBytes) {
  auto a = Node();
  ASSERT_TRUE(a->Get(kPack).ok());
  a->Flush();
  ASSERT_EQ(TierKeys().size(), 17u);
  auto slice = [&](int i) { return a->tier_prefix() + kPack + "/" + std::to_string(i); };
  tier_->Object(slice(0))[9000] ^= 0x20;                      // a flipped bit in the bytes
  tier_->Object(slice(1)).resize(tier_->Object(slice(1)).size() - 100);  // truncated
  tier_->Object(slice(2))[0] = 'X';                           // not a tier object
  tier_->Object(slice(3))[20] ^= 1;                           // a header that fails its checksum
  tier_->Object(slice(4)) = tier_->Object(slice(5));          // another slice's object
  const uint64_t before = OriginBytes();
  auto b = Node();
  Expected<std::vector<uint8_t>> all = b->Get(kPack);
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  EXPECT_EQ(*all, pack_);
  b->Flush();
  EXPECT_EQ(b->stats().corrupt.load(), 5u);
  EXPECT_EQ(b->stats().fills.load(), 5u);
  EXPECT_EQ(OriginBytes() - before, 5 * kSlice);
  // They were filled again: the next node reads everything from the tier.
  auto c = Node();
  ASSERT_TRUE(c->Get(kPack).ok());
  EXPECT_EQ(c->stats().corrupt.load(), 0u);
  EXPECT_EQ(OriginBytes() - before, 5 * kSlice);
}

TEST_F(SharedTierTest, ATierThatFailsCostsSpeedNotErrors) {
  auto failing = std::make_shared<FaultStore>(tier_);
  failing->Fail(FaultStore::On(StoreOp::kAny), Status::IOError("connection refused (injected)"));
  SharedTierOptions o = Options();
  o.backoff = std::chrono::milliseconds(60'000);
  auto a = Node(o, failing);
  for (int i = 0; i < 3; ++i) {
    Expected<std::vector<uint8_t>> got = a->Get(kPack, ByteRange{uint64_t(i) * 1000, 70'000});
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(*got, Expect(uint64_t(i) * 1000, 70'000));
  }
  EXPECT_EQ(a->stats().errors.load(), 1u);   // then it backs off:
  EXPECT_EQ(a->stats().bypassed.load(), 2u);  // the next reads go straight to the bucket
  EXPECT_EQ(OriginBytes(), 3u * 70'000);      // exactly what was asked, not whole slices
  // The tier emptied while nodes use it (header cached, object gone): a miss, filled again.
  failing->Clear();
  auto b = Node();
  ASSERT_TRUE(b->Get(kPack, ByteRange{0, 100}).ok());
  b->Flush();
  ASSERT_TRUE(tier_->Delete(TierKeys()[0]).ok());
  Expected<std::vector<uint8_t>> again = b->Get(kPack, ByteRange{200, 100});
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(*again, Expect(200, 100));
}

TEST_F(SharedTierTest, ADeadFillersMarkerIsTakenOverAndALiveOneIsWaitedForBoundedly) {
  auto probe = Node();
  const std::string slice0 = probe->tier_prefix() + kPack + "/0";
  auto marker = [](int64_t expires_ms) {
    const std::string s = nlohmann::json{{"node", "dead-host:1"}, {"expires_ms", expires_ms}}.dump();
    return std::vector<uint8_t>(s.begin(), s.end());
  };
  const int64_t now = std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::system_clock::now().time_since_epoch()).count();
  // Expired: taken over at once.
  ASSERT_TRUE(tier_->Put(slice0 + ".fill", marker(now - 1000)).ok());
  Expected<std::vector<uint8_t>> got = probe->Get(kPack, ByteRange{0, 10});
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, Expect(0, 10));
  probe->Flush();
  EXPECT_EQ(probe->stats().fills.load(), 1u);
  // Alive but never filling: waited for at most max_wait, then the origin (only the range asked).
  const std::string slice1 = probe->tier_prefix() + kPack + "/1";
  ASSERT_TRUE(tier_->Put(slice1 + ".fill", marker(now + 600'000)).ok());
  SharedTierOptions o = Options();
  o.max_wait = std::chrono::milliseconds(300);
  auto waiter = Node(o);
  const uint64_t before = OriginBytes();
  const auto start = std::chrono::steady_clock::now();
  got = waiter->Get(kPack, ByteRange{kSlice + 5, 10});
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, Expect(kSlice + 5, 10));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(waiter->stats().wait_timeouts.load(), 1u);
  EXPECT_EQ(OriginBytes() - before, 10u);
}

TEST_F(SharedTierTest, HeadsAreSharedForTheirTtlAndReadPastTheTierWhenTheyMustBeCurrent) {
  const std::string head = "models/acme/m/versions/v1.json";
  const std::string v1 = R"({"version": "v1", "table": "a"})", v2 = R"({"version": "v1", "table": "b"})";
  ASSERT_TRUE(origin_mem_->Put(head, std::vector<uint8_t>(v1.begin(), v1.end())).ok());
  auto text = [](const Expected<std::vector<uint8_t>>& b) {
    return b.ok() ? std::string(b->begin(), b->end()) : b.status().ToString();
  };
  {
    auto a = Node();
    EXPECT_EQ(text(a->Get(head, ByteRange{0, 1 << 20})), v1);
    a->Flush();
  }
  // Rewritten in place (gc's rebase): within the TTL other nodes get the tier's copy...
  ASSERT_TRUE(origin_mem_->Put(head, std::vector<uint8_t>(v2.begin(), v2.end())).ok());
  const uint64_t before = OriginBytes();
  EXPECT_EQ(text(Node()->Get(head, ByteRange{0, 1 << 20})), v1);
  EXPECT_EQ(OriginBytes(), before);
  // ... a reader that must see a rewrite reads past it, and refreshes it for everyone...
  EXPECT_EQ(text(Node()->GetUncached(head, ByteRange{0, 1 << 20})), v2);
  EXPECT_EQ(text(Node()->Get(head, ByteRange{0, 1 << 20})), v2);
  // ... and a copy older than the TTL is fetched again.
  ASSERT_TRUE(origin_mem_->Put(head, std::vector<uint8_t>(v1.begin(), v1.end())).ok());
  SharedTierOptions o = Options();
  o.head_ttl = std::chrono::milliseconds(0);
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(text(Node(o)->Get(head, ByteRange{0, 1 << 20})), v1);
  // A version not published yet is not remembered as missing.
  const std::string v3 = "models/acme/m/versions/v3.json";
  EXPECT_EQ(Node()->Get(v3).status().kind(), ErrorKind::kNotFound);
  ASSERT_TRUE(origin_mem_->Put(v3, std::vector<uint8_t>(v1.begin(), v1.end())).ok());
  EXPECT_EQ(text(Node()->Get(v3)), v1);
}

TEST_F(SharedTierTest, ListingsMarkersAndLeasesGoToTheBucket) {
  ASSERT_TRUE(origin_mem_->Put("models/acme/m/times/0000000000001-v1", {}).ok());
  ASSERT_TRUE(origin_mem_->Put("leases/x", std::vector<uint8_t>{1, 2}).ok());
  auto a = Node();
  EXPECT_TRUE(a->Get("leases/x").ok());
  EXPECT_TRUE(a->Get("models/acme/m/times/0000000000001-v1").ok());
  Expected<ListPage> page = a->List("models/");
  ASSERT_TRUE(page.ok());
  EXPECT_EQ(page->objects.size(), 1u);
  ASSERT_TRUE(a->Put("leases/y", std::vector<uint8_t>{3}).ok());
  EXPECT_TRUE(origin_mem_->Head("leases/y").ok());
  EXPECT_EQ(tier_->size(), 0u);
}

TEST_F(SharedTierTest, ASizeBoundKeepsTheTierUnderIt) {
  SharedTierOptions o = Options();
  o.max_bytes = 5 * kSlice;
  auto a = Node(o);
  for (int pass = 0; pass < 2; ++pass) {
    Expected<std::vector<uint8_t>> all = a->Get(kPack);
    ASSERT_TRUE(all.ok()) << all.status().ToString();
    EXPECT_EQ(*all, pack_);
  }
  a->Flush();
  uint64_t total = 0;
  Expected<ListPage> page = tier_->List("weightfs-tier/", {}, 100000);
  ASSERT_TRUE(page.ok());
  for (const ObjectInfo& i : page->objects) total += i.size;
  EXPECT_GT(a->stats().evictions.load(), 0u);
  // Checked every max_bytes/16 filled: at most that much over.
  EXPECT_LE(total, o.max_bytes + o.max_bytes / 16 + kSlice);
}

}  // namespace
}  // namespace weightfs

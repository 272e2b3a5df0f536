// RunStoreConformance: the Store contract (hub/store/store.h) as one reusable battery of GoogleTest
// checks, run against every backend (LocalStore, WebDAV, S3, ...) so that they all behave
// alike where callers rely on it: bytes round-trip exactly, ranges clip, missing objects are
// NotFound, create-if-absent has exactly one winner, listings are sorted, filtered by prefix
// and paginated by the last key, temporaries are never listed, hostile keys are refused.
//
// Everything happens under `scope` (a valid key such as "conformance-1234", used as a
// directory) so that runs sharing a bucket do not collide; the scope must be empty at the
// start and is emptied at the end. Keys stay within what every backend can hold (no
// components starting with '.', which nginx's WebDAV listing hides).
//
// Call it from a TEST body; it uses ASSERT_*, so check HasFatalFailure() after it if more
// follows. Uses up to 8 threads at once against `store`.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "hub/store/store.h"

namespace weightfs::test {

inline std::vector<uint8_t> ConformanceBytes(const std::string& s) { return {s.begin(), s.end()}; }

inline std::vector<uint8_t> ConformanceRandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> out(n);
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t v = rng();
    for (size_t j = 0; j < 8 && i + j < n; ++j) out[i + j] = static_cast<uint8_t>(v >> (8 * j));
  }
  return out;
}

// All keys under `prefix`, following continuations with pages of `page_size`.
inline std::vector<ObjectInfo> ConformanceListAll(Store& store, const std::string& prefix, size_t page_size,
                                                  int* pages = nullptr) {
  std::vector<ObjectInfo> all;
  std::string cont;
  int n = 0;
  do {
    auto page = store.List(prefix, cont, page_size);
    EXPECT_TRUE(page.ok()) << "List(" << prefix << ", " << cont << "): " << page.status().ToString();
    if (!page.ok()) break;
    EXPECT_LE(page->objects.size(), page_size);
    for (auto& o : page->objects) all.push_back(o);
    if (!page->continuation.empty()) {
      EXPECT_FALSE(page->objects.empty());
      if (!page->objects.empty()) {
        EXPECT_EQ(page->continuation, page->objects.back().key);
      }
    }
    cont = page->continuation;
    ++n;
  } while (!cont.empty() && n < 10000);
  if (pages != nullptr) *pages = n;
  return all;
}

inline std::vector<std::string> ConformanceKeys(const std::vector<ObjectInfo>& objects) {
  std::vector<std::string> keys;
  for (const auto& o : objects) keys.push_back(o.key);
  return keys;
}

inline void RunStoreConformance(Store& store, const std::string& scope) {
  ASSERT_TRUE(ValidateKey(scope).ok()) << "scope must be a valid key: " << scope;
  const std::string s = scope + "/";
  auto K = [&](const std::string& k) { return s + k; };
  SCOPED_TRACE("store " + store.Describe() + ", scope " + scope);
  {
    auto before = store.List(s);
    ASSERT_TRUE(before.ok()) << before.status().ToString();
    ASSERT_TRUE(before->objects.empty()) << "scope " << scope << " is not empty in " << store.Describe();
    EXPECT_TRUE(before->continuation.empty());
  }

  // Missing objects.
  EXPECT_EQ(store.Get(K("missing")).status().kind(), ErrorKind::kNotFound);
  EXPECT_EQ(store.Get(K("missing"), ByteRange{1, 2}).status().kind(), ErrorKind::kNotFound);
  EXPECT_EQ(store.Head(K("missing/deeper")).status().kind(), ErrorKind::kNotFound);
  EXPECT_EQ(store.Delete(K("missing")).kind(), ErrorKind::kNotFound);

  // Round trips: every byte value, an empty object, a multi-MiB object.
  std::vector<uint8_t> all_bytes(256 * 3);
  for (size_t i = 0; i < all_bytes.size(); ++i) all_bytes[i] = static_cast<uint8_t>(i * 7 + 3);
  ASSERT_TRUE(store.Put(K("bin/all-bytes"), all_bytes).ok());
  {
    auto got = store.Get(K("bin/all-bytes"));
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(*got, all_bytes);
    auto info = store.Head(K("bin/all-bytes"));
    ASSERT_TRUE(info.ok()) << info.status().ToString();
    EXPECT_EQ(info->size, all_bytes.size());
    EXPECT_EQ(info->key, K("bin/all-bytes"));
  }
  { Status st = store.Put(K("bin/empty"), {}); ASSERT_TRUE(st.ok()) << st.ToString(); }
  {
    auto got = store.Get(K("bin/empty"));
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_TRUE(got->empty());
    EXPECT_EQ(store.Head(K("bin/empty"))->size, 0u);
    auto range = store.Get(K("bin/empty"), ByteRange{0, std::nullopt});
    ASSERT_TRUE(range.ok()) << range.status().ToString();
    EXPECT_TRUE(range->empty());
    EXPECT_EQ(store.Get(K("bin/empty"), ByteRange{1, 1}).status().kind(), ErrorKind::kInvalidArgument);
  }
  const std::vector<uint8_t> big = ConformanceRandomBytes((3 << 20) + 17, 42);
  ASSERT_TRUE(store.Put(K("bin/big"), big).ok());
  {
    auto got = store.Get(K("bin/big"));
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_TRUE(*got == big) << "3 MiB object differs after a round trip";
    auto mid = store.Get(K("bin/big"), ByteRange{1 << 20, 1 << 20});
    ASSERT_TRUE(mid.ok()) << mid.status().ToString();
    EXPECT_TRUE(std::equal(mid->begin(), mid->end(), big.begin() + (1 << 20)) && mid->size() == (1u << 20));
  }

  // Ranges: inside, clipped, open-ended, empty at the end, past the end, zero length.
  const std::vector<uint8_t> hello = ConformanceBytes("hello world");
  ASSERT_TRUE(store.Put(K("r/hello"), hello).ok());
  struct Case {
    uint64_t offset;
    std::optional<uint64_t> length;
    std::string want;
  };
  for (const Case& c : std::vector<Case>{{0, 5, "hello"},
                                         {6, 5, "world"},
                                         {6, 100, "world"},
                                         {6, std::nullopt, "world"},
                                         {0, std::nullopt, "hello world"},
                                         {10, 1, "d"},
                                         {11, std::nullopt, ""},
                                         {11, 5, ""},
                                         {3, 0, ""},
                                         {11, 0, ""},
                                         {4, std::numeric_limits<uint64_t>::max(), "o world"}}) {
    auto got = store.Get(K("r/hello"), ByteRange{c.offset, c.length});
    ASSERT_TRUE(got.ok()) << "range " << c.offset << "+" << (c.length ? std::to_string(*c.length) : "end") << ": "
                          << got.status().ToString();
    EXPECT_EQ(std::string(got->begin(), got->end()), c.want)
        << "range " << c.offset << "+" << (c.length ? std::to_string(*c.length) : "end");
  }
  for (uint64_t off : {uint64_t{12}, uint64_t{1000}}) {
    EXPECT_EQ(store.Get(K("r/hello"), ByteRange{off, 1}).status().kind(), ErrorKind::kInvalidArgument) << off;
    EXPECT_EQ(store.Get(K("r/hello"), ByteRange{off, std::nullopt}).status().kind(), ErrorKind::kInvalidArgument)
        << off;
    EXPECT_EQ(store.Get(K("r/hello"), ByteRange{off, 0}).status().kind(), ErrorKind::kInvalidArgument) << off;
  }

  // Overwrite replaces, shrinking or growing.
  ASSERT_TRUE(store.Put(K("r/hello"), ConformanceBytes("new")).ok());
  EXPECT_EQ(*store.Get(K("r/hello")), ConformanceBytes("new"));
  EXPECT_EQ(store.Head(K("r/hello"))->size, 3u);
  ASSERT_TRUE(store.Put(K("r/hello"), ConformanceBytes("longer than before")).ok());
  EXPECT_EQ(*store.Get(K("r/hello")), ConformanceBytes("longer than before"));

  // Create-if-absent: a new key is created; an existing one is a Conflict and stays unchanged.
  ASSERT_TRUE(store.Put(K("m/versions/v1.json"), ConformanceBytes("first"), PutMode::kCreateIfAbsent).ok());
  {
    const Status again = store.Put(K("m/versions/v1.json"), ConformanceBytes("second"), PutMode::kCreateIfAbsent);
    EXPECT_EQ(again.kind(), ErrorKind::kConflict) << again.ToString();
    EXPECT_EQ(*store.Get(K("m/versions/v1.json")), ConformanceBytes("first"));
  }
  // ... and with 8 racing writers exactly one wins, with its own bytes.
  {
    constexpr int kThreads = 8;
    std::atomic<int> wins{0}, conflicts{0}, winner{-1};
    std::vector<std::string> errors(kThreads);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        const Status st = store.Put(K("m/versions/race.json"), ConformanceBytes("writer " + std::to_string(t)),
                                    PutMode::kCreateIfAbsent);
        if (st.ok()) {
          ++wins;
          winner = t;
        } else if (st.kind() == ErrorKind::kConflict) {
          ++conflicts;
        } else {
          errors[t] = st.ToString();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (const auto& e : errors) EXPECT_EQ(e, "");
    EXPECT_EQ(wins.load(), 1);
    EXPECT_EQ(conflicts.load(), kThreads - 1);
    auto got = store.Get(K("m/versions/race.json"));
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(std::string(got->begin(), got->end()), "writer " + std::to_string(winner.load()));
  }

  // A "directory" is not an object.
  EXPECT_EQ(store.Get(K("m")).status().kind(), ErrorKind::kNotFound);
  EXPECT_EQ(store.Head(K("m/versions")).status().kind(), ErrorKind::kNotFound);

  // Listing: byte order across '-', '.', '/' (0x2D < 0x2E < 0x2F), nested collections, every
  // key character, prefixes that end inside a component, pagination of every size.
  const std::vector<std::string> listed = {
      "l/a-z", "l/a.b", "l/a/c", "l/a/d/e", "l/a@b=c+d_e", "l/ab", "l/b/x/y/z", "l/b0", "lx/not-in-l"};
  for (const auto& k : listed) ASSERT_TRUE(store.Put(K(k), ConformanceBytes(k + "!")).ok()) << k;
  {
    const auto all = ConformanceListAll(store, K("l/"), 1000);
    std::vector<std::string> want;
    for (const auto& k : listed) {
      if (k.rfind("l/", 0) == 0) want.push_back(K(k));
    }
    std::sort(want.begin(), want.end());
    EXPECT_EQ(ConformanceKeys(all), want);
    for (const auto& o : all) EXPECT_EQ(o.size, o.key.size() - s.size() + 1) << o.key;
    for (size_t page_size : {1, 2, 3, 7}) {
      int pages = 0;
      EXPECT_EQ(ConformanceKeys(ConformanceListAll(store, K("l/"), page_size, &pages)), want) << page_size;
      EXPECT_EQ(static_cast<size_t>(pages), (want.size() + page_size - 1) / page_size) << page_size;
    }
    // Prefixes ending inside a component.
    EXPECT_EQ(ConformanceKeys(ConformanceListAll(store, K("l/a"), 2)),
              (std::vector<std::string>{K("l/a-z"), K("l/a.b"), K("l/a/c"), K("l/a/d/e"), K("l/a@b=c+d_e"),
                                        K("l/ab")}));
    EXPECT_EQ(ConformanceKeys(ConformanceListAll(store, K("l/a/"), 1)),
              (std::vector<std::string>{K("l/a/c"), K("l/a/d/e")}));
    EXPECT_EQ(ConformanceKeys(ConformanceListAll(store, K("l/b"), 1000)),
              (std::vector<std::string>{K("l/b/x/y/z"), K("l/b0")}));
    EXPECT_EQ(ConformanceKeys(ConformanceListAll(store, K("l"), 1000)).size(), want.size() + 1);
    EXPECT_TRUE(ConformanceListAll(store, K("l/nothing/here/"), 10).empty());
    EXPECT_TRUE(ConformanceListAll(store, K("zzz"), 10).empty());
    // A continuation that is not a listed key still means "keys after it".
    auto after = store.List(K("l/"), K("l/a/czz"), 2);
    ASSERT_TRUE(after.ok()) << after.status().ToString();
    EXPECT_EQ(ConformanceKeys(after->objects), (std::vector<std::string>{K("l/a/d/e"), K("l/a@b=c+d_e")}));
    EXPECT_EQ(after->continuation, K("l/a@b=c+d_e"));
    auto last = store.List(K("l/"), K("l/b/x/y/z"), 1);
    ASSERT_TRUE(last.ok());
    EXPECT_EQ(ConformanceKeys(last->objects), (std::vector<std::string>{K("l/b0")}));
    EXPECT_TRUE(last->continuation.empty());
  }
  {
    // The whole scope: everything written so far and nothing else (no temporaries).
    const auto keys = ConformanceKeys(ConformanceListAll(store, s, 4));
    EXPECT_TRUE(std::is_sorted(keys.begin(), keys.end()));
    EXPECT_EQ(keys.size(), 6u + listed.size()) << ::testing::PrintToString(keys);
    for (const auto& k : keys) EXPECT_EQ(k.find(".weightfs-tmp"), std::string::npos) << k;
  }

  // Concurrent independent writers and readers.
  {
    constexpr int kThreads = 8, kPerThread = 4;
    std::vector<std::string> errors(kThreads);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < kPerThread && errors[t].empty(); ++i) {
          const std::string key = K("par/t" + std::to_string(t) + "/o" + std::to_string(i));
          const auto data = ConformanceRandomBytes(1000 + static_cast<size_t>(t * 97 + i), static_cast<uint64_t>(t * 100 + i));
          Status st = store.Put(key, data);
          if (!st.ok()) {
            errors[t] = st.ToString();
            break;
          }
          auto got = store.Get(key);
          if (!got.ok()) errors[t] = got.status().ToString();
          else if (*got != data) errors[t] = key + ": bytes differ";
        }
      });
    }
    for (auto& t : threads) t.join();
    for (const auto& e : errors) EXPECT_EQ(e, "");
    EXPECT_EQ(ConformanceListAll(store, K("par/"), 5).size(), static_cast<size_t>(kThreads * kPerThread));
  }

  // Hostile keys never reach the backend.
  for (const std::string& bad :
       std::vector<std::string>{"", "/abs", "a//b", "a/../b", "..", "sp ace", "a\\b", std::string("nul\0x", 5)}) {
    EXPECT_EQ(store.Get(bad).status().kind(), ErrorKind::kInvalidArgument) << bad;
    EXPECT_EQ(store.Head(bad).status().kind(), ErrorKind::kInvalidArgument) << bad;
    EXPECT_EQ(store.Put(bad, ConformanceBytes("x")).kind(), ErrorKind::kInvalidArgument) << bad;
    EXPECT_EQ(store.Delete(bad).kind(), ErrorKind::kInvalidArgument) << bad;
  }

  // Delete removes exactly the object; the scope ends empty.
  ASSERT_TRUE(store.Delete(K("r/hello")).ok());
  EXPECT_EQ(store.Get(K("r/hello")).status().kind(), ErrorKind::kNotFound);
  EXPECT_EQ(store.Head(K("r/hello")).status().kind(), ErrorKind::kNotFound);
  EXPECT_EQ(store.Delete(K("r/hello")).kind(), ErrorKind::kNotFound);
  for (const auto& o : ConformanceListAll(store, s, 1000)) {
    EXPECT_TRUE(store.Delete(o.key).ok()) << o.key;
  }
  auto after = store.List(s);
  ASSERT_TRUE(after.ok());
  EXPECT_TRUE(after->objects.empty()) << ::testing::PrintToString(ConformanceKeys(after->objects));
}

}  // namespace weightfs::test

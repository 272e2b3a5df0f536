// S3Store against a real S3-compatible server (s3rver, started once for the suite) and, for
// what s3rver does not do, through tests/testing/s3_precondition_proxy.py in front of it:
//   - s3rver ignores If-None-Match: *  -> the proxy decides conditional writes atomically;
//   - s3rver never checks SigV4 signatures (only the access key id) -> the proxy answers
//     SignatureDoesNotMatch, ExpiredToken, wrong-region errors on demand; an unknown key id is
//     refused by s3rver itself (InvalidAccessKeyId);
//   - s3rver lists keys in directory-walk order ("a/c" before "a-z") and its start-after
//     pagination drops keys because of it -> the proxy answers ListObjectsV2 from s3rver's
//     full listing sorted as S3 does (the direct listing test uses keys where both orders agree);
//   - s3rver has no AbortMultipartUpload (405) -> the abort is counted at the proxy;
//   - a response lost after the server applied the write -> the proxy resets the connection
//     after forwarding.
// The SigV4 arithmetic is pinned by AWS's own vectors in s3_signer_test.cc.
#include "hub/store/s3_store.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/testing/s3_test_server.h"
#include "tests/testing/test_servers.h"
#include "tests/testing/store_conformance.h"
#include "tests/testing/bytes.h"

namespace weightfs {
namespace {

using test::Bytes;
using test::RandomBytes;

// No AWS_* variable of the machine running the tests leaks in.
AwsEnvLookup EmptyEnv() {
  return [](std::string_view) -> std::optional<std::string> { return std::nullopt; };
}

class S3StoreTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = new test::S3rverServer("wfs-test");
    start_ = server_->Start();
    if (start_) {
      proxy_ = new test::S3PreconditionProxy();
      start_ = proxy_->Start(server_->endpoint());
    }
    HttpOptions o;
    o.max_attempts = 4;
    o.backoff_base = std::chrono::milliseconds(5);
    o.backoff_max = std::chrono::milliseconds(50);
    o.total_timeout = std::chrono::milliseconds(30'000);
    o.stall_timeout = std::chrono::milliseconds(10'000);
    http_ = new std::shared_ptr<HttpClient>(std::make_shared<HttpClient>(o));
  }
  static void TearDownTestSuite() {
    delete proxy_;
    delete server_;
    delete http_;
    proxy_ = nullptr;
    server_ = nullptr;
    http_ = nullptr;
  }

  void SetUp() override {
    ASSERT_TRUE(start_) << start_.message();
    ASSERT_TRUE(proxy_->Control("fail=&drop=0"));
    prefix_ = std::string("t/") + ::testing::UnitTest::GetInstance()->current_test_info()->name();
  }
  void TearDown() override {
    if (proxy_) (void)proxy_->Control("fail=&drop=0");
  }

  S3Options Options(const std::string& endpoint) const {
    S3Options o;
    o.endpoint = endpoint;
    o.region = "us-east-1";
    o.credentials = test::S3rverServer::Credentials();
    o.env = EmptyEnv();
    return o;
  }
  std::unique_ptr<Store> Open(const S3Options& o, const std::string& bucket = "wfs-test") {
    auto s = OpenS3Store("s3://" + bucket + "/" + prefix_, o, *http_);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? std::move(s).value() : nullptr;
  }
  std::unique_ptr<Store> Direct() { return Open(Options(server_->endpoint())); }
  std::unique_ptr<Store> ViaProxy() { return Open(Options(proxy_->endpoint())); }

  static test::S3rverServer* server_;
  static test::S3PreconditionProxy* proxy_;
  static std::shared_ptr<HttpClient>* http_;
  static ::testing::AssertionResult start_;
  std::string prefix_;
};

test::S3rverServer* S3StoreTest::server_ = nullptr;
test::S3PreconditionProxy* S3StoreTest::proxy_ = nullptr;
std::shared_ptr<HttpClient>* S3StoreTest::http_ = nullptr;
::testing::AssertionResult S3StoreTest::start_ = ::testing::AssertionFailure() << "not started";

// Through the proxy, because the contract's racing create-if-absent writers need
// If-None-Match: * honoured; everything else is forwarded to s3rver unchanged.
TEST_F(S3StoreTest, MeetsTheStoreContract) {
  auto store = ViaProxy();
  ASSERT_TRUE(store);
  ASSERT_TRUE(store->Put("conformance-neighbour/x", Bytes("keep")).ok());
  test::RunStoreConformance(*store, "conformance");
  EXPECT_EQ(*store->Get("conformance-neighbour/x"), Bytes("keep"));
}

TEST_F(S3StoreTest, PutGetHeadRangesAndOverwrite) {
  auto store = Direct();
  ASSERT_TRUE(store);
  ASSERT_TRUE(store->Put("packs/ab/cd", Bytes("hello world")).ok());
  auto all = store->Get("packs/ab/cd");
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  EXPECT_EQ(*all, Bytes("hello world"));
  auto part = store->Get("packs/ab/cd", ByteRange{6, 5});
  ASSERT_TRUE(part.ok()) << part.status().ToString();
  EXPECT_EQ(*part, Bytes("world"));
  EXPECT_EQ(*store->Get("packs/ab/cd", ByteRange{6, 100}), Bytes("world"));  // clipped
  EXPECT_EQ(*store->Get("packs/ab/cd", ByteRange{0, 1}), Bytes("h"));        // s3rver sends all for 0-0
  EXPECT_EQ(*store->Get("packs/ab/cd", ByteRange{3, std::nullopt}), Bytes("lo world"));
  auto at_end = store->Get("packs/ab/cd", ByteRange{11, std::nullopt});  // S3: 416; contract: empty
  ASSERT_TRUE(at_end.ok()) << at_end.status().ToString();
  EXPECT_TRUE(at_end->empty());
  auto at_end_zero = store->Get("packs/ab/cd", ByteRange{11, 0});
  ASSERT_TRUE(at_end_zero.ok()) << at_end_zero.status().ToString();
  EXPECT_TRUE(at_end_zero->empty());
  EXPECT_EQ(store->Get("packs/ab/cd", ByteRange{12, 1}).status().kind(), ErrorKind::kInvalidArgument);
  EXPECT_EQ(store->Get("packs/ab/cd", ByteRange{12, 0}).status().kind(), ErrorKind::kInvalidArgument);
  auto info = store->Head("packs/ab/cd");
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->key, "packs/ab/cd");
  EXPECT_EQ(info->size, 11u);
  ASSERT_TRUE(store->Put("packs/ab/cd", Bytes("new")).ok());
  EXPECT_EQ(*store->Get("packs/ab/cd"), Bytes("new"));
  ASSERT_TRUE(store->Put("empty", {}).ok());
  auto empty = store->Get("empty");
  ASSERT_TRUE(empty.ok()) << empty.status().ToString();
  EXPECT_TRUE(empty->empty());
  EXPECT_EQ(store->Head("empty")->size, 0u);
}

TEST_F(S3StoreTest, KeysWithReservedCharactersRoundTrip) {
  auto store = Direct();
  ASSERT_TRUE(store);
  const std::string key = "models/acme/qwen@step-1=a+b/versions/v_1.json";
  ASSERT_TRUE(store->Put(key, Bytes("x")).ok());
  EXPECT_EQ(*store->Get(key), Bytes("x"));
  auto page = store->List("models/acme/");
  ASSERT_TRUE(page.ok()) << page.status().ToString();
  ASSERT_EQ(page->objects.size(), 1u);
  EXPECT_EQ(page->objects[0].key, key);
  EXPECT_EQ(store->Put("../escape", Bytes("x")).kind(), ErrorKind::kInvalidArgument);
  EXPECT_EQ(store->Get("a//b").status().kind(), ErrorKind::kInvalidArgument);
}

TEST_F(S3StoreTest, MissingObjectsAreNotFound) {
  auto store = Direct();
  ASSERT_TRUE(store);
  auto get = store->Get("nope");
  EXPECT_EQ(get.status().kind(), ErrorKind::kNotFound) << get.status().ToString();
  EXPECT_EQ(store->Get("nope", ByteRange{5, 5}).status().kind(), ErrorKind::kNotFound);
  EXPECT_EQ(store->Head("a/b").status().kind(), ErrorKind::kNotFound);
  // S3 answers 204 to a DELETE of a missing key; the Store contract says NotFound.
  EXPECT_EQ(store->Delete("a/b").kind(), ErrorKind::kNotFound);
  ASSERT_TRUE(store->Put("a/b", Bytes("x")).ok());
  EXPECT_EQ(store->Get("a").status().kind(), ErrorKind::kNotFound);  // a prefix, not an object
  EXPECT_TRUE(store->Delete("a/b").ok());
  EXPECT_EQ(store->Get("a/b").status().kind(), ErrorKind::kNotFound);
  EXPECT_EQ(store->Delete("a/b").kind(), ErrorKind::kNotFound);
}

TEST_F(S3StoreTest, MissingBucketIsNotFoundAndSaysSo) {
  auto store = Open(Options(server_->endpoint()), "no-such-bucket");
  ASSERT_TRUE(store);
  auto get = store->Get("k");
  EXPECT_EQ(get.status().kind(), ErrorKind::kNotFound);
  EXPECT_NE(get.status().message().find("bucket 'no-such-bucket' does not exist"), std::string::npos)
      << get.status().message();
  auto list = store->List("");
  EXPECT_EQ(list.status().kind(), ErrorKind::kNotFound);
  EXPECT_NE(list.status().message().find("does not exist"), std::string::npos) << list.status().message();
  EXPECT_EQ(store->Put("k", Bytes("x")).kind(), ErrorKind::kNotFound);
}

TEST_F(S3StoreTest, ListPaginatesUnderThePrefix) {
  auto store = Direct();
  ASSERT_TRUE(store);
  std::vector<std::string> keys;
  for (int i = 0; i < 7; ++i) keys.push_back("packs/p" + std::to_string(i));
  for (const auto& k : keys) ASSERT_TRUE(store->Put(k, Bytes(k)).ok());
  ASSERT_TRUE(store->Put("models/m/versions/v1.json", Bytes("m")).ok());
  // A sibling prefix ("t/<name>-other") must not leak into this store's listing.
  prefix_ += "-other";
  auto other = Direct();
  ASSERT_TRUE(other->Put("packs/zzz", Bytes("no")).ok());

  std::vector<std::string> seen;
  std::string token;
  int pages = 0;
  do {
    auto page = store->List("packs/", token, 3);
    ASSERT_TRUE(page.ok()) << page.status().ToString();
    EXPECT_LE(page->objects.size(), 3u);
    for (const auto& o : page->objects) {
      seen.push_back(o.key);
      EXPECT_EQ(o.size, o.key.size());
    }
    token = page->continuation;
    ASSERT_LT(++pages, 10);
  } while (!token.empty());
  EXPECT_EQ(pages, 3);
  EXPECT_EQ(seen, keys);
  auto everything = store->List("");
  ASSERT_TRUE(everything.ok());
  EXPECT_EQ(everything->objects.size(), 8u);
  EXPECT_TRUE(everything->continuation.empty());
  EXPECT_TRUE(store->List("nothing-here/")->objects.empty());
}

TEST_F(S3StoreTest, MultipartUploadAboveTheThreshold) {
  S3Options o = Options(proxy_->endpoint());  // the proxy counts the parts
  o.multipart_threshold = 5u << 20;
  o.part_size = 5u << 20;
  o.multipart_parallelism = 3;
  auto store = Open(o);
  ASSERT_TRUE(store);
  const auto data = RandomBytes((12u << 20) + 123, 7);  // 3 parts: 5 MiB, 5 MiB, 2 MiB + 123
  const auto before = proxy_->Stats();
  ASSERT_TRUE(store->Put("packs/big", data).ok());
  const auto after = proxy_->Stats();
  EXPECT_EQ(after.at("part_uploads") - before.at("part_uploads"), 3u);
  EXPECT_EQ(after.at("completes") - before.at("completes"), 1u);
  auto got = store->Get("packs/big");
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(*got == data);
  // A range across the first part boundary.
  auto cross = store->Get("packs/big", ByteRange{(5u << 20) - 10, 20});
  ASSERT_TRUE(cross.ok());
  EXPECT_TRUE(std::equal(cross->begin(), cross->end(), data.begin() + (5u << 20) - 10));
  EXPECT_EQ(store->Head("packs/big")->size, data.size());
  // Below the threshold: one PUT.
  ASSERT_TRUE(store->Put("packs/small", RandomBytes(5u << 20, 8)).ok());
  EXPECT_EQ(proxy_->Stats().at("part_uploads"), after.at("part_uploads"));
}

TEST_F(S3StoreTest, FailedPartAbortsTheUploadAndReportsTheError) {
  S3Options o = Options(proxy_->endpoint());
  o.multipart_threshold = 5u << 20;
  o.part_size = 5u << 20;
  o.multipart_parallelism = 1;
  auto store = Open(o);
  ASSERT_TRUE(store);
  ASSERT_TRUE(proxy_->Control("fail=403:AccessDenied&match=partNumber%3D2"));
  const auto before = proxy_->Stats();
  const Status s = store->Put("packs/big", RandomBytes((10u << 20) + 1, 9));
  EXPECT_EQ(s.kind(), ErrorKind::kAuth) << s.ToString();
  EXPECT_NE(s.message().find("part 2"), std::string::npos) << s.message();
  const auto after = proxy_->Stats();
  EXPECT_EQ(after.at("aborts") - before.at("aborts"), 1u);  // s3rver answers 405 to it: logged
  EXPECT_EQ(after.at("completes"), before.at("completes"));
  ASSERT_TRUE(proxy_->Control("fail="));
  EXPECT_EQ(store->Head("packs/big").status().kind(), ErrorKind::kNotFound);
}

TEST_F(S3StoreTest, CreateIfAbsentConflictsWhenTheKeyExists) {
  auto store = ViaProxy();
  ASSERT_TRUE(store);
  ASSERT_TRUE(store->Put("models/m/versions/v1.json", Bytes("first"), PutMode::kCreateIfAbsent).ok());
  const Status again = store->Put("models/m/versions/v1.json", Bytes("second"), PutMode::kCreateIfAbsent);
  EXPECT_EQ(again.kind(), ErrorKind::kConflict) << again.ToString();
  EXPECT_EQ(*store->Get("models/m/versions/v1.json"), Bytes("first"));
  // Overwrite still replaces.
  ASSERT_TRUE(store->Put("models/m/versions/v1.json", Bytes("third")).ok());
  EXPECT_EQ(*store->Get("models/m/versions/v1.json"), Bytes("third"));
}

TEST_F(S3StoreTest, CreateIfAbsentHasExactlyOneWinnerAmongRacingWriters) {
  auto store = ViaProxy();
  ASSERT_TRUE(store);
  constexpr int kThreads = 8;
  std::atomic<int> wins{0}, conflicts{0}, others{0};
  std::vector<std::thread> threads;
  const auto before = proxy_->Stats();
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const Status s = store->Put("models/m/versions/v1.json", Bytes("writer " + std::to_string(t)),
                                  PutMode::kCreateIfAbsent);
      if (s.ok()) ++wins;
      else if (s.kind() == ErrorKind::kConflict) ++conflicts;
      else ++others;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(wins.load(), 1);
  EXPECT_EQ(conflicts.load(), kThreads - 1);
  EXPECT_EQ(others.load(), 0);
  auto got = store->Get("models/m/versions/v1.json");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(std::string(got->begin(), got->end()).rfind("writer ", 0), 0u);
  // Writers that lost the HEAD race were refused by the conditional PUT itself.
  const auto after = proxy_->Stats();
  EXPECT_GE(after.at("conditional") - before.at("conditional"), 1u);
}

TEST_F(S3StoreTest, CreateIfAbsentRetryAfterALostResponseFindsItsOwnWrite) {
  auto store = ViaProxy();
  ASSERT_TRUE(store);
  ASSERT_TRUE(proxy_->Control("drop=1"));
  const auto before = proxy_->Stats();
  const Status s = store->Put("models/m/versions/v2.json", Bytes("manifest bytes"), PutMode::kCreateIfAbsent);
  EXPECT_TRUE(s.ok()) << s.ToString();
  const auto after = proxy_->Stats();
  EXPECT_EQ(after.at("dropped") - before.at("dropped"), 1u);
  EXPECT_EQ(after.at("precondition_failed") - before.at("precondition_failed"), 1u);  // the retry
  EXPECT_EQ(*store->Get("models/m/versions/v2.json"), Bytes("manifest bytes"));
}

TEST_F(S3StoreTest, MultipartCreateIfAbsentRetryAfterALostResponseComparesTheBytes) {
  // s3rver's multipart ETag is the MD5 of the whole object (AWS: MD5 of the part MD5s + "-N"),
  // so this goes through the read-back comparison.
  S3Options o = Options(proxy_->endpoint());
  o.multipart_threshold = 5u << 20;
  o.part_size = 5u << 20;
  auto store = Open(o);
  ASSERT_TRUE(store);
  const auto data = RandomBytes((6u << 20) + 5, 11);
  ASSERT_TRUE(proxy_->Control("drop=1"));
  const Status s = store->Put("models/m/versions/big.json", data, PutMode::kCreateIfAbsent);
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(*store->Get("models/m/versions/big.json") == data);
  const Status again = store->Put("models/m/versions/big.json", data, PutMode::kCreateIfAbsent);
  EXPECT_EQ(again.kind(), ErrorKind::kConflict) << again.ToString();
}

TEST_F(S3StoreTest, ConditionalRequestConflictIsRetried) {
  auto store = ViaProxy();
  ASSERT_TRUE(store);
  ASSERT_TRUE(proxy_->Control("fail=409:ConditionalRequestConflict&count=1&match=PUT"));
  const Status s = store->Put("models/m/versions/v3.json", Bytes("x"), PutMode::kCreateIfAbsent);
  EXPECT_TRUE(s.ok()) << s.ToString();
}

TEST_F(S3StoreTest, SlowDownIsRetriedByTheClient) {
  auto store = ViaProxy();
  ASSERT_TRUE(store);
  ASSERT_TRUE(store->Put("packs/x", Bytes("payload")).ok());
  ASSERT_TRUE(proxy_->Control("fail=503:SlowDown&count=2"));
  auto got = store->Get("packs/x");
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, Bytes("payload"));
}

TEST_F(S3StoreTest, UnknownAccessKeyIsAnAuthErrorWithAHint) {
  // s3rver itself refuses an access key id it does not know.
  S3Options o = Options(server_->endpoint());
  o.credentials = AwsCredentials{"AKIDUNKNOWN", "the-secret-value", "", "profile 'ci' in /x/credentials"};
  auto store = Open(o);
  ASSERT_TRUE(store);
  auto got = store->Get("k");
  ASSERT_EQ(got.status().kind(), ErrorKind::kAuth) << got.status().ToString();
  EXPECT_NE(got.status().message().find("InvalidAccessKeyId"), std::string::npos) << got.status().message();
  EXPECT_NE(got.status().message().find("profile 'ci' in /x/credentials"), std::string::npos);
  EXPECT_EQ(got.status().message().find("the-secret-value"), std::string::npos);
  EXPECT_EQ(store->Put("k", Bytes("x")).kind(), ErrorKind::kAuth);
  EXPECT_EQ(store->List("").status().kind(), ErrorKind::kAuth);
  EXPECT_EQ(store->Describe().find("the-secret-value"), std::string::npos);
  EXPECT_EQ(store->Describe().find("AKIDUNKNOWN"), std::string::npos);
}

TEST_F(S3StoreTest, AuthErrorsFromS3MapToAuthWithoutSecrets) {
  // s3rver never checks signatures: the proxy plays the S3 answers.
  S3Options o = Options(proxy_->endpoint());
  o.credentials = AwsCredentials{"S3RVER", "secret-never-shown", "token-never-shown", "environment"};
  auto store = Open(o);
  ASSERT_TRUE(store);
  struct Case {
    const char* code;
    const char* hint;
  };
  for (const Case& c : {Case{"SignatureDoesNotMatch", "secret access key does not match"},
                        Case{"ExpiredToken", "expired"}, Case{"AccessDenied", "check the AWS credentials"},
                        Case{"InvalidToken", "check the AWS credentials"}}) {
    ASSERT_TRUE(proxy_->Control(std::string("fail=403:") + c.code));
    auto got = store->Get("k");
    EXPECT_EQ(got.status().kind(), ErrorKind::kAuth) << c.code << ": " << got.status().ToString();
    EXPECT_NE(got.status().message().find(c.code), std::string::npos) << got.status().message();
    EXPECT_NE(got.status().message().find(c.hint), std::string::npos) << got.status().message();
    EXPECT_EQ(got.status().message().find("never-shown"), std::string::npos) << got.status().message();
  }
  ASSERT_TRUE(proxy_->Control("fail=400:AuthorizationHeaderMalformed&region=eu-west-1"));
  auto wrong_region = store->Get("k");
  EXPECT_EQ(wrong_region.status().kind(), ErrorKind::kInvalidArgument) << wrong_region.status().ToString();
  EXPECT_NE(wrong_region.status().message().find("AWS_REGION=eu-west-1"), std::string::npos)
      << wrong_region.status().message();
  ASSERT_TRUE(proxy_->Control("fail=412:PreconditionFailed"));
  EXPECT_EQ(store->Get("k").status().kind(), ErrorKind::kConflict);
}

// Issue 29, item 1: never unsigned without being asked. With nothing in the chain (an empty
// environment, no instance metadata) the open fails and says what it looked at and what to
// pass; with --no-sign-request the requests go unsigned.
TEST_F(S3StoreTest, AnonymousAccessOnlyWhenAskedSendsUnsignedRequests) {
  S3Options o = Options(server_->endpoint());
  o.credentials.reset();
  o.env = [](std::string_view n) -> std::optional<std::string> {
    if (n == "AWS_EC2_METADATA_DISABLED") return "true";
    return std::nullopt;
  };
  auto refused = OpenS3Store("s3://wfs-test/" + prefix_, o, *http_);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().kind(), ErrorKind::kAuth);
  for (const char* said : {"no AWS credentials found", "the environment (AWS_ACCESS_KEY_ID)", "AWS_EC2_METADATA_DISABLED",
                           "--no-sign-request", "container endpoint", "web identity"}) {
    EXPECT_NE(refused.status().message().find(said), std::string::npos) << said << " in " << refused.status().ToString();
  }
  o.no_sign_request = true;
  auto store = Open(o);
  ASSERT_TRUE(store);
  ASSERT_TRUE(store->Put("anon", Bytes("a")).ok());
  EXPECT_EQ(*store->Get("anon"), Bytes("a"));
}

TEST_F(S3StoreTest, VirtualHostedAddressing) {
  S3Options o = Options(server_->virtual_host_endpoint());
  o.addressing = S3Options::Addressing::kVirtualHosted;
  auto store = Open(o);
  ASSERT_TRUE(store);
  ASSERT_TRUE(store->Put("packs/vh", Bytes("virtual")).ok());
  EXPECT_EQ(*store->Get("packs/vh", ByteRange{1, 3}), Bytes("irt"));
  auto page = store->List("packs/");
  ASSERT_TRUE(page.ok()) << page.status().ToString();
  ASSERT_EQ(page->objects.size(), 1u);
  // The same object seen path-style.
  EXPECT_EQ(*Direct()->Get("packs/vh"), Bytes("virtual"));
}

// Issue 26, item 3: a bit flipped on the way up. Every PUT carries Content-MD5 (which real S3
// servers check) and its answer's ETag is compared with it (s3rver checks nothing, but its ETag
// is the MD5 of what it stored): each Put either stores exactly its bytes or fails saying so,
// and a flipped create-if-absent object is not left under its key. Single PUTs and multipart
// parts, through a proxy flipping one bit in 30% of PUT bodies, then in all of them.
TEST_F(S3StoreTest, BitsFlippedOnTheWayUpAreNeverStoredSilently) {
  test::FaultProxy flipper;
  test::FaultProxy::Options fo;
  fo.seed = 7;
  fo.extra_args = {"--flip-put-rate", "0.3"};
  ASSERT_TRUE(flipper.Start(proxy_->endpoint(), fo));
  S3Options o = Options(flipper.url());
  o.multipart_threshold = 5u << 20;
  o.part_size = 5u << 20;
  auto store = Open(o);
  ASSERT_TRUE(store);
  auto direct = ViaProxy();
  int ok = 0, failed = 0, silent = 0;
  for (int i = 0; i < 24; ++i) {
    const std::vector<uint8_t> body = RandomBytes(i % 6 == 5 ? (11u << 20) : 1000 + 7919u * i, 100 + i);
    const std::string key = "flip/" + std::to_string(i);
    const PutMode mode = i % 2 ? PutMode::kCreateIfAbsent : PutMode::kOverwrite;
    Status put = store->Put(key, body, mode);
    auto back = direct->Get(key);
    if (put.ok()) {
      ++ok;
      if (!back.ok() || *back != body) ++silent;
    } else {
      ++failed;
      EXPECT_EQ(put.kind(), ErrorKind::kCorruption) << put.ToString();
      EXPECT_TRUE(!back.ok() || *back == body) << key << ": a failed Put left other bytes under its key";
    }
  }
  std::printf("[ flips    ] 24 PUTs through 30%% flips: %d stored intact, %d failed, %d silent\n", ok, failed, silent);
  EXPECT_EQ(silent, 0);
  EXPECT_GE(ok, 18);  // three tries each: a Put fails only if all three were flipped
  // Every PUT flipped: each Put fails, naming what happened, and leaves nothing.
  flipper.SetMode("flip-put");
  const std::vector<uint8_t> body = RandomBytes(5000, 9);
  Status put = store->Put("flip/always", body, PutMode::kCreateIfAbsent);
  EXPECT_EQ(put.kind(), ErrorKind::kCorruption) << put.ToString();
  EXPECT_NE(put.message().find("other bytes"), std::string::npos) << put.ToString();
  EXPECT_EQ(direct->Get("flip/always").status().kind(), ErrorKind::kNotFound);
}

TEST_F(S3StoreTest, DescribeNamesBucketPrefixAndEndpoint) {
  auto store = Direct();
  ASSERT_TRUE(store);
  EXPECT_EQ(store->Describe(), "s3://wfs-test/" + prefix_ + " (endpoint " + server_->endpoint() + ")");
}

// Opening makes no request: these need no server.
TEST(S3StoreOpenTest, RejectsBadUrlsAndOptions) {
  S3Options o;
  o.env = EmptyEnv();
  o.credentials = AwsCredentials{"id", "secret", "", "test"};
  EXPECT_EQ(OpenS3Store("http://x/y", o, nullptr).status().kind(), ErrorKind::kInvalidArgument);
  EXPECT_EQ(OpenS3Store("s3://", o, nullptr).status().kind(), ErrorKind::kInvalidArgument);
  EXPECT_EQ(OpenS3Store("s3://bad bucket/p", o, nullptr).status().kind(), ErrorKind::kInvalidArgument);
  EXPECT_EQ(OpenS3Store("s3://b/../p", o, nullptr).status().kind(), ErrorKind::kInvalidArgument);
  EXPECT_EQ(OpenS3Store("s3://b/p?x=1", o, nullptr).status().kind(), ErrorKind::kInvalidArgument);
  S3Options small = o;
  small.part_size = 1 << 20;
  EXPECT_EQ(OpenS3Store("s3://b/p", small, nullptr).status().kind(), ErrorKind::kInvalidArgument);
  S3Options userinfo = o;
  userinfo.endpoint = "http://user:hunter2@127.0.0.1:9000";
  auto bad = OpenS3Store("s3://b/p", userinfo, nullptr);
  EXPECT_EQ(bad.status().kind(), ErrorKind::kInvalidArgument);
  EXPECT_EQ(bad.status().message().find("hunter2"), std::string::npos);
  userinfo.endpoint = "user:hunter2@127.0.0.1:9000";  // no scheme either
  bad = OpenS3Store("s3://b/p", userinfo, nullptr);
  EXPECT_EQ(bad.status().kind(), ErrorKind::kInvalidArgument);
  EXPECT_EQ(bad.status().message().find("hunter2"), std::string::npos);
  S3Options ftp = o;
  ftp.endpoint = "ftp://host";
  EXPECT_EQ(OpenS3Store("s3://b/p", ftp, nullptr).status().kind(), ErrorKind::kInvalidArgument);
}

TEST(S3StoreOpenTest, EndpointAndRegionComeFromTheEnvironment) {
  std::map<std::string, std::string> env = {{"AWS_REGION", "eu-west-3"}};
  S3Options o;
  o.no_sign_request = true;  // (no request is made)
  o.env = [&env](std::string_view n) -> std::optional<std::string> {
    auto it = env.find(std::string(n));
    return it == env.end() ? std::nullopt : std::optional<std::string>(it->second);
  };
  auto aws = OpenS3Store("s3://bucket/runs/", o, nullptr);
  ASSERT_TRUE(aws.ok()) << aws.status().ToString();
  EXPECT_EQ((*aws)->Describe(), "s3://bucket/runs (endpoint https://s3.eu-west-3.amazonaws.com)");
  env["AWS_ENDPOINT_URL"] = "http://minio.local:9000/";
  auto custom = OpenS3Store("s3://bucket", o, nullptr);
  ASSERT_TRUE(custom.ok()) << custom.status().ToString();
  EXPECT_EQ((*custom)->Describe(), "s3://bucket (endpoint http://minio.local:9000)");
  env["AWS_ENDPOINT_URL_S3"] = "https://s3.example.com";
  EXPECT_EQ((*OpenS3Store("s3://bucket", o, nullptr))->Describe(),
            "s3://bucket (endpoint https://s3.example.com)");
}

TEST(S3XmlTest, ListObjectsV2WithEntitiesAndNamespaces) {
  auto r = s3::ParseListObjectsV2(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<ListBucketResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">"
      "<Name>b</Name><Prefix>p/</Prefix><KeyCount>2</KeyCount><MaxKeys>2</MaxKeys>"
      "<IsTruncated>true</IsTruncated>"
      "<Contents><Key>p/a&amp;b&#x40;c&#61;</Key><ETag>&quot;abc&quot;</ETag><Size>12</Size></Contents>"
      "<!-- a comment -->"
      "<Contents><Key><![CDATA[p/<raw>]]></Key><Size>0</Size></Contents>"
      "<NextContinuationToken>1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=</NextContinuationToken>"
      "</ListBucketResult>");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->contents.size(), 2u);
  EXPECT_EQ(r->contents[0].key, "p/a&b@c=");
  EXPECT_EQ(r->contents[0].size, 12u);
  EXPECT_EQ(r->contents[1].key, "p/<raw>");
  EXPECT_TRUE(r->truncated);
  EXPECT_EQ(r->next_continuation_token, "1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=");
}

TEST(S3XmlTest, MalformedDocumentsAreCorruption) {
  for (const char* bad : {"", "not xml", "<ListBucketResult>", "<ListBucketResult></Other>",
                          "<ListBucketResult><Contents><Key>k</Key><Size>-1</Size></Contents></ListBucketResult>",
                          "<ListBucketResult><Contents><Key>k</Key><Size>99999999999999999999</Size></Contents></ListBucketResult>",
                          "<ListBucketResult><Contents><Size>1</Size></Contents></ListBucketResult>",
                          "<!DOCTYPE x [<!ENTITY a \"b\">]><ListBucketResult/>",
                          "<Error><Code>NoSuchBucket</Code></Error>"}) {
    auto r = s3::ParseListObjectsV2(bad);
    EXPECT_FALSE(r.ok()) << bad;
    if (!r.ok()) {
      EXPECT_EQ(r.status().kind(), ErrorKind::kCorruption) << bad;
    }
  }
  std::string deep;
  for (int i = 0; i < 1000; ++i) deep += "<a>";
  EXPECT_FALSE(s3::ParseXml(deep).ok());
}

TEST(S3XmlTest, ErrorDocuments) {
  auto e = s3::ParseError(
      "<?xml version=\"1.0\"?><Error><Code>AuthorizationHeaderMalformed</Code>"
      "<Message>the region &apos;us-east-1&apos; is wrong; expecting &apos;eu-west-1&apos;</Message>"
      "<Region>eu-west-1</Region><RequestId>x</RequestId></Error>");
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->code, "AuthorizationHeaderMalformed");
  EXPECT_EQ(e->message, "the region 'us-east-1' is wrong; expecting 'eu-west-1'");
  EXPECT_EQ(e->region, "eu-west-1");
  EXPECT_FALSE(s3::ParseError("").has_value());
  EXPECT_FALSE(s3::ParseError("<html>502 Bad Gateway</html>").has_value());
  EXPECT_FALSE(s3::ParseError("<Error><Message>no code</Message></Error>").has_value());
}

}  // namespace
}  // namespace weightfs

// WebDavStore and HttpClient against a real nginx (dav + dav-ext), directly and through
// tests/testing/fault_proxy.py injecting 503s, stalls and resets.
#include "hub/store/webdav_store.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "hub/engine/bucket.h"
#include "hub/engine/gc.h"
#include "hub/store/http_client.h"
#include "tests/testing/store_conformance.h"
#include "tests/testing/test_servers.h"

namespace weightfs {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using test::ConformanceBytes;
using test::ConformanceRandomBytes;

// Retry settings small enough that fault tests stay fast.
HttpOptions FastOptions() {
  HttpOptions o;
  o.connect_timeout = 2000ms;
  o.stall_timeout = 5000ms;
  o.max_attempts = 8;
  o.backoff_base = 10ms;
  o.backoff_max = 200ms;
  o.total_timeout = 30'000ms;
  return o;
}

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::unique_ptr<Store> OpenOrDie(const std::string& url, std::shared_ptr<HttpClient> http) {
  auto s = OpenWebDavStore(url, std::move(http));
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? std::move(s).value() : nullptr;
}

// Files (not directories) under `dir`, recursively.
size_t CountFiles(const fs::path& dir) {
  size_t n = 0;
  std::error_code ec;
  if (!fs::exists(dir, ec)) return 0;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (it->is_regular_file()) ++n;
  }
  return n;
}

class WebDavStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(nginx_.Start());
    http_ = std::make_shared<HttpClient>(FastOptions());
    store_ = OpenOrDie(nginx_.url() + "/bucket", http_);
    ASSERT_NE(store_, nullptr);
  }
  fs::path BucketDir() const { return fs::path(nginx_.root()) / "bucket"; }

  test::NginxServer nginx_;
  std::shared_ptr<HttpClient> http_;
  std::unique_ptr<Store> store_;
};

TEST_F(WebDavStoreTest, MeetsTheStoreContract) {
  test::RunStoreConformance(*store_, "conformance");
  EXPECT_EQ(CountFiles(BucketDir() / ".weightfs-tmp"), 0u) << "temporaries left behind";
  EXPECT_GT(http_->stats().requests.load(), 100u);
  EXPECT_GT(http_->stats().bytes_sent.load(), 3u << 20);
  EXPECT_GT(http_->stats().bytes_received.load(), 3u << 20);
  EXPECT_EQ(http_->stats().retries.load(), 0u);
}

// A write killed between its PUT to .weightfs-tmp/ and its MOVE leaves the temporary behind:
// ListTemporaries reports it with its size and age (getlastmodified), List never does, and gc
// removes it once it is old enough.
TEST_F(WebDavStoreTest, LeftoverTemporariesAreListedWithTheirAgeAndGcRemovesOldOnes) {
  ASSERT_TRUE(Bucket::Init(*store_).ok());
  auto listed = store_->ListTemporaries();
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  EXPECT_TRUE(listed->empty());  // Init's own temporary was moved into place
  const fs::path tmp = BucketDir() / ".weightfs-tmp";
  fs::create_directories(tmp);
  { std::ofstream(tmp / "123-0-77", std::ios::binary) << std::string(5000, 'p'); }
  { std::ofstream(tmp / "124-1-78", std::ios::binary) << "young"; }
  const time_t old = ::time(nullptr) - 3 * 3600;
  const timespec times[2] = {{old, 0}, {old, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, (tmp / "123-0-77").c_str(), times, 0), 0);

  listed = store_->ListTemporaries();
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  ASSERT_EQ(listed->size(), 2u);
  EXPECT_EQ((*listed)[0].key, ".weightfs-tmp/123-0-77");
  EXPECT_EQ((*listed)[0].size, 5000u);
  EXPECT_EQ((*listed)[0].modified_ms, static_cast<int64_t>(old) * 1000);
  EXPECT_GT((*listed)[1].modified_ms, (static_cast<int64_t>(::time(nullptr)) - 600) * 1000);
  auto page = store_->List("");
  ASSERT_TRUE(page.ok());
  for (const ObjectInfo& o : page->objects) EXPECT_EQ(o.key.find(".weightfs-tmp"), std::string::npos) << o.key;

  std::shared_ptr<Store> shared(store_.get(), [](Store*) {});
  auto bucket = Bucket::Open(shared);
  ASSERT_TRUE(bucket.ok()) << bucket.status().ToString();
  auto dry = CollectGarbage(**bucket, {.dry_run = true});
  ASSERT_TRUE(dry.ok()) << dry.status().ToString();
  EXPECT_EQ(dry->deleted_temporaries, 1u);
  EXPECT_TRUE(fs::exists(tmp / "123-0-77"));
  auto r = CollectGarbage(**bucket, {});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->temporaries, 2u);
  EXPECT_EQ(r->deleted_temporaries, 1u);
  EXPECT_EQ(r->deleted_temporary_bytes, 5000u);
  EXPECT_EQ(r->recent_temporaries, 1u);
  EXPECT_FALSE(fs::exists(tmp / "123-0-77"));
  EXPECT_TRUE(fs::exists(tmp / "124-1-78"));
}

TEST_F(WebDavStoreTest, KeysAreFilesAtTheirOwnPathsWithSpecialCharacters) {
  const std::string key = "models/org/m@v=1+x/versions/step-1_a.json";
  ASSERT_TRUE(store_->Put(key, ConformanceBytes("manifest")).ok());
  EXPECT_TRUE(fs::is_regular_file(BucketDir() / key));
  EXPECT_EQ(test::ReadFileOrEmpty((BucketDir() / key).string()), "manifest");
  auto page = store_->List("models/org/m@v=1+x/");
  ASSERT_TRUE(page.ok()) << page.status().ToString();
  ASSERT_EQ(page->objects.size(), 1u);
  EXPECT_EQ(page->objects[0].key, key);
  EXPECT_EQ(page->objects[0].size, 8u);
  auto got = store_->Get(key, ByteRange{1, 3});
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, ConformanceBytes("ani"));
  EXPECT_EQ(store_->Describe(), nginx_.url() + "/bucket");
}

TEST_F(WebDavStoreTest, LargeObjectRoundTripsAndRangesIntoIt) {
  const std::vector<uint8_t> data = ConformanceRandomBytes(64u << 20, 7);
  const auto start = Clock::now();
  ASSERT_TRUE(store_->Put("packs/big", data).ok());
  auto info = store_->Head("packs/big");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->size, data.size());
  auto got = store_->Get("packs/big");
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(*got == data);
  const uint64_t off = data.size() - (1u << 20) - 5;
  auto tail = store_->Get("packs/big", ByteRange{off, 2u << 20});
  ASSERT_TRUE(tail.ok());
  ASSERT_EQ(tail->size(), (1u << 20) + 5);
  EXPECT_TRUE(std::equal(tail->begin(), tail->end(), data.begin() + static_cast<ptrdiff_t>(off)));
  EXPECT_GE(http_->stats().bytes_sent.load(), data.size());
  EXPECT_GE(http_->stats().bytes_received.load(), data.size() + (1u << 20) + 5);
  RecordProperty("seconds", std::to_string(SecondsSince(start)));
}

TEST_F(WebDavStoreTest, CreateIfAbsentHasExactlyOneWinnerAndLeavesNoTemporaries) {
  for (int round = 0; round < 3; ++round) {
    const std::string key = "models/m/versions/v" + std::to_string(round) + ".json";
    constexpr int kThreads = 8;
    std::atomic<int> wins{0}, conflicts{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        const Status s = store_->Put(key, ConformanceBytes("writer " + std::to_string(t)), PutMode::kCreateIfAbsent);
        if (s.ok()) ++wins;
        else if (s.kind() == ErrorKind::kConflict) ++conflicts;
        else ADD_FAILURE() << s.ToString();
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(wins.load(), 1);
    EXPECT_EQ(conflicts.load(), kThreads - 1);
  }
  EXPECT_EQ(CountFiles(BucketDir() / ".weightfs-tmp"), 0u);
  const Status s = store_->Put("models/m/versions/v0.json", ConformanceBytes("late"), PutMode::kCreateIfAbsent);
  EXPECT_EQ(s.kind(), ErrorKind::kConflict);
  EXPECT_NE(s.message().find("models/m/versions/v0.json"), std::string::npos) << s.message();
}

TEST_F(WebDavStoreTest, ErrorsHaveKindsAndNameTheKey) {
  auto g = store_->Get("packs/nope");
  EXPECT_EQ(g.status().kind(), ErrorKind::kNotFound);
  EXPECT_NE(g.status().message().find("packs/nope"), std::string::npos) << g.status().message();
  EXPECT_NE(g.status().message().find(nginx_.url()), std::string::npos) << g.status().message();
  EXPECT_EQ(store_->Head("packs/nope").status().kind(), ErrorKind::kNotFound);
  EXPECT_EQ(store_->Delete("packs/nope").kind(), ErrorKind::kNotFound);
  ASSERT_TRUE(store_->Put("packs/dir/obj", ConformanceBytes("x")).ok());
  // A collection is not an object, and deleting it by mistake does not delete the tree.
  EXPECT_EQ(store_->Get("packs/dir").status().kind(), ErrorKind::kNotFound);
  EXPECT_EQ(store_->Head("packs/dir").status().kind(), ErrorKind::kNotFound);
  EXPECT_FALSE(store_->Delete("packs/dir").ok());
  EXPECT_TRUE(store_->Get("packs/dir/obj").ok());
  EXPECT_EQ(store_->Get("packs/dir/obj", ByteRange{2, 1}).status().kind(), ErrorKind::kInvalidArgument);
  EXPECT_EQ(store_->Put("../escape", ConformanceBytes("x")).kind(), ErrorKind::kInvalidArgument);
  EXPECT_FALSE(fs::exists(fs::path(nginx_.root()) / "escape"));
}

TEST_F(WebDavStoreTest, CredentialsInTheUrlNeverShowInMessages) {
  auto s = OpenOrDie("http://alice:s3cr%21t@127.0.0.1:" + std::to_string(nginx_.port()) + "/bucket/", http_);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->Describe(), nginx_.url() + "/bucket");
  ASSERT_TRUE(s->Put("a/b", ConformanceBytes("ok")).ok());  // nginx ignores the credentials
  const Status missing = s->Get("a/missing").status();
  EXPECT_EQ(missing.kind(), ErrorKind::kNotFound);
  EXPECT_EQ(missing.message().find("s3cr"), std::string::npos) << missing.message();
  EXPECT_EQ(missing.message().find("alice"), std::string::npos) << missing.message();
  auto bad = OpenWebDavStore("ftp://alice:s3cret@host/x", nullptr);
  EXPECT_EQ(bad.status().kind(), ErrorKind::kInvalidArgument);
  EXPECT_EQ(bad.status().message().find("s3cret"), std::string::npos) << bad.status().message();
  for (const char* u : {"http://", "http:///x", "http://h/a?b=c", "http://h/../x", "nginx:80/x", "http://h o/x"}) {
    EXPECT_EQ(OpenWebDavStore(u, nullptr).status().kind(), ErrorKind::kInvalidArgument) << u;
  }
}

TEST_F(WebDavStoreTest, ConnectionsAreReused) {
  ASSERT_TRUE(store_->Put("k", ConformanceBytes("v")).ok());
  for (int i = 0; i < 30; ++i) ASSERT_TRUE(store_->Head("k").ok());
  std::set<std::string> connections;
  int heads = 0;
  // nginx logs a request after answering it: the last line can lag the client (seen under load).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  do {
    connections.clear();
    heads = 0;
    std::istringstream log(nginx_.AccessLog());
    std::string line;
    while (std::getline(log, line)) {
      std::istringstream fields(line);
      std::string conn, nreq, method;
      fields >> conn >> nreq >> method;
      if (method == "HEAD") {
        connections.insert(conn);
        ++heads;
      }
    }
    if (heads < 30) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  } while (heads < 30 && std::chrono::steady_clock::now() < deadline);
  EXPECT_EQ(heads, 30);
  EXPECT_EQ(connections.size(), 1u) << nginx_.AccessLog();
}

TEST_F(WebDavStoreTest, ListsLargeTreesPageByPage) {
  std::vector<std::string> want;
  for (int d = 0; d < 6; ++d) {
    for (int f = 0; f < 7; ++f) {
      const std::string key = "packs/" + std::to_string(d) + "/" + std::to_string(f * 13);
      ASSERT_TRUE(store_->Put(key, ConformanceBytes(key)).ok());
      want.push_back(key);
    }
  }
  std::sort(want.begin(), want.end());
  int pages = 0;
  const auto keys = test::ConformanceKeys(test::ConformanceListAll(*store_, "packs/", 5, &pages));
  EXPECT_EQ(keys, want);
  EXPECT_EQ(pages, 9);
}

TEST(WebDavStoreNginxTest, WorksWithoutCreateFullPutPath) {
  test::NginxServer nginx(test::NginxServer::Options{.create_full_put_path = false});
  ASSERT_TRUE(nginx.Start());
  auto http = std::make_shared<HttpClient>(FastOptions());
  auto store = OpenOrDie(nginx.url() + "/deep/bucket", http);
  ASSERT_NE(store, nullptr);
  Status s = store->Put("models/a/b/versions/v1.json", ConformanceBytes("x"), PutMode::kCreateIfAbsent);
  ASSERT_TRUE(s.ok()) << s.ToString();
  s = store->Put("models/a/c/versions/v1.json", ConformanceBytes("y"));
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(*store->Get("models/a/b/versions/v1.json"), ConformanceBytes("x"));
  EXPECT_EQ(test::ConformanceKeys(store->List("models/")->objects),
            (std::vector<std::string>{"models/a/b/versions/v1.json", "models/a/c/versions/v1.json"}));
}

// ---- through the fault proxy ---------------------------------------------------------------

TEST(WebDavFaultTest, EveryOperationSucceedsDespite503sStallsAndResets) {
  test::NginxServer nginx;
  ASSERT_TRUE(nginx.Start());
  test::FaultProxy proxy;
  test::FaultProxy::Options po;
  po.error_rate = 0.2;
  po.stall_rate = 0.005;
  po.stall_seconds = 3;
  po.reset_rate = 0.03;
  po.seed = 64;  // its draws 9 and 149 are stalls (and none other of the first 600): two, for sure
  ASSERT_TRUE(proxy.Start(nginx.url(), po));
  HttpOptions o = FastOptions();
  o.max_attempts = 12;
  // A stalled attempt is cut and retried after this; generous enough for the 3 MiB object
  // under ASan on a busy machine.
  o.request_timeout = 1000ms;
  auto http = std::make_shared<HttpClient>(o);
  auto store = OpenOrDie(proxy.url() + "/bucket", http);
  ASSERT_NE(store, nullptr);
  const auto start = Clock::now();
  test::RunStoreConformance(*store, "faulty");
  const auto stats = proxy.Stats();
  RecordProperty("seconds", std::to_string(SecondsSince(start)));
  EXPECT_GT(stats.at("errors"), 0u);
  EXPECT_GT(stats.at("stalls"), 0u);
  EXPECT_GE(http->stats().retries.load(), stats.at("errors"));
  EXPECT_GT(http->stats().requests.load(), 150u);
}

TEST(WebDavFaultTest, DownServerFailsWithinTheTotalTimeout) {
  test::NginxServer nginx;
  ASSERT_TRUE(nginx.Start());
  test::FaultProxy proxy;
  ASSERT_TRUE(proxy.Start(nginx.url()));
  HttpOptions o = FastOptions();
  o.max_attempts = 1000;
  o.total_timeout = 1500ms;
  auto http = std::make_shared<HttpClient>(o);
  auto store = OpenOrDie(proxy.url() + "/bucket", http);
  ASSERT_TRUE(store->Put("k", ConformanceBytes("v")).ok());
  proxy.SetMode("down");
  auto start = Clock::now();
  auto got = store->Get("k");
  double took = SecondsSince(start);
  EXPECT_EQ(got.status().kind(), ErrorKind::kIOError) << got.status().ToString();
  EXPECT_NE(got.status().message().find("503"), std::string::npos) << got.status().message();
  EXPECT_LT(took, 3.0);
  EXPECT_GT(took, 0.5);
  EXPECT_GT(http->stats().retries.load(), 3u);
  proxy.SetMode("normal");
  EXPECT_TRUE(store->Get("k").ok());  // and recovers with the server

  // Nothing listening at all: connection refused, retried, then IOError in time.
  auto closed = OpenOrDie("http://127.0.0.1:" + std::to_string(test::FreeLoopbackPort()) + "/bucket", http);
  start = Clock::now();
  const Status s = closed->Put("k", ConformanceBytes("v"));
  took = SecondsSince(start);
  EXPECT_EQ(s.kind(), ErrorKind::kIOError) << s.ToString();
  EXPECT_LT(took, 3.0);
}

TEST(WebDavFaultTest, StalledServerTimesOut) {
  test::NginxServer nginx;
  ASSERT_TRUE(nginx.Start());
  test::FaultProxy proxy;
  test::FaultProxy::Options po;
  po.stall_seconds = 60;
  ASSERT_TRUE(proxy.Start(nginx.url(), po));
  HttpOptions o = FastOptions();
  o.stall_timeout = 1000ms;
  o.max_attempts = 2;
  o.total_timeout = 10'000ms;
  auto http = std::make_shared<HttpClient>(o);
  auto store = OpenOrDie(proxy.url() + "/bucket", http);
  ASSERT_TRUE(store->Put("obj", ConformanceRandomBytes(1 << 20, 3)).ok());

  // Silent before answering: both attempts are cut.
  proxy.SetMode("stall-before");
  auto start = Clock::now();
  auto got = store->Get("obj");
  double took = SecondsSince(start);
  EXPECT_EQ(got.status().kind(), ErrorKind::kTimeout) << got.status().ToString();
  EXPECT_LT(took, 6.0);
  EXPECT_GE(took, 1.0);
  EXPECT_EQ(http->stats().retries.load(), 1u);

  // Silent after half of the body (one attempt: the retry path is covered above).
  proxy.SetMode("stall-body");
  o.max_attempts = 1;
  http = std::make_shared<HttpClient>(o);
  store = OpenOrDie(proxy.url() + "/bucket", http);
  start = Clock::now();
  got = store->Get("obj");
  took = SecondsSince(start);
  EXPECT_EQ(got.status().kind(), ErrorKind::kTimeout) << got.status().ToString();
  EXPECT_LT(took, 4.0);
  EXPECT_GE(took, 1.0);
  EXPECT_GE(http->stats().bytes_received.load(), 512u << 10);
}

// Proxies in "down" or "reset" mode never forward, so these need no server behind them.
constexpr const char* kNowhere = "http://127.0.0.1:1";

TEST(HttpClientTest, RetryAfterIsHonouredUpToBackoffMax) {
  test::FaultProxy proxy;
  test::FaultProxy::Options po;
  po.retry_after_s = 1;
  ASSERT_TRUE(proxy.Start(kNowhere, po));
  proxy.SetMode("down");
  HttpOptions o = FastOptions();
  o.max_attempts = 2;
  o.backoff_base = 1ms;
  o.backoff_max = 5000ms;
  HttpClient http(o);
  auto start = Clock::now();
  auto r = http.Send(HttpRequest{.method = "GET", .url = proxy.url() + "/x"});
  EXPECT_EQ(r.status().kind(), ErrorKind::kIOError);
  EXPECT_GE(SecondsSince(start), 0.9);  // waited the second it was told to
  // With backoff_max below Retry-After, the cap wins.
  o.backoff_max = 50ms;
  HttpClient capped(o);
  start = Clock::now();
  r = capped.Send(HttpRequest{.method = "GET", .url = proxy.url() + "/x"});
  EXPECT_EQ(r.status().kind(), ErrorKind::kIOError);
  EXPECT_LT(SecondsSince(start), 0.8);
  EXPECT_EQ(capped.stats().requests.load(), 2u);
  EXPECT_EQ(capped.stats().retries.load(), 1u);
}

TEST(HttpClientTest, NonIdempotentRequestsAreRetriedOnlyWhenNothingWasSent) {
  test::FaultProxy proxy;
  ASSERT_TRUE(proxy.Start(kNowhere));
  proxy.SetMode("down");
  HttpOptions o = FastOptions();
  o.max_attempts = 4;
  HttpClient http(o);
  const std::string body = "payload";
  HttpRequest post{.method = "POST",
                   .url = proxy.url() + "/x",
                   .body = std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(body.data()), body.size()),
                   .idempotent = false};
  auto r = http.Send(post);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->status, 503);  // answered, so returned as is
  EXPECT_EQ(http.stats().requests.load(), 1u);
  EXPECT_EQ(http.stats().retries.load(), 0u);
  EXPECT_EQ(http.stats().bytes_sent.load(), body.size());

  post.url = "http://127.0.0.1:" + std::to_string(test::FreeLoopbackPort()) + "/x";
  r = http.Send(post);
  EXPECT_EQ(r.status().kind(), ErrorKind::kIOError);
  EXPECT_EQ(http.stats().requests.load(), 1u + 4u);  // refused connections are safe to retry

  // Resets after the request was sent are retried for idempotent requests only.
  proxy.SetMode("reset");
  HttpClient fresh(o);
  r = fresh.Send(HttpRequest{.method = "PUT", .url = proxy.url() + "/y", .idempotent = false});
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(fresh.stats().requests.load(), 1u);
  r = fresh.Send(HttpRequest{.method = "PUT", .url = proxy.url() + "/y"});
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(fresh.stats().requests.load(), 1u + 4u);
}

// A server that does not answer (here: refused) is marked unreachable after a request's last
// attempt; from then on each request tries once, until one gets an answer (any status), which
// clears the mark: a bucket that is down costs every operation one attempt, not the retry budget.
TEST(HttpClientTest, AServerThatDoesNotAnswerGetsOneAttemptPerRequestUntilItDoes) {
  HttpOptions o = FastOptions();
  o.max_attempts = 4;
  HttpClient http(o);
  const std::string refused = "http://127.0.0.1:" + std::to_string(test::FreeLoopbackPort()) + "/x";
  EXPECT_FALSE(http.Send(HttpRequest{.method = "GET", .url = refused}).ok());
  EXPECT_EQ(http.stats().requests.load(), 4u);
  EXPECT_TRUE(http.unreachable());
  EXPECT_FALSE(http.Send(HttpRequest{.method = "GET", .url = refused}).ok());
  EXPECT_EQ(http.stats().requests.load(), 5u);  // one attempt
  // An answer, even a 503, clears the mark; the next request has its retries again.
  test::FaultProxy proxy;
  ASSERT_TRUE(proxy.Start(kNowhere));
  proxy.SetMode("down");
  EXPECT_FALSE(http.Send(HttpRequest{.method = "GET", .url = proxy.url() + "/y"}).ok());
  EXPECT_EQ(http.stats().requests.load(), 6u);
  EXPECT_FALSE(http.unreachable());
  EXPECT_FALSE(http.Send(HttpRequest{.method = "GET", .url = proxy.url() + "/y"}).ok());
  EXPECT_EQ(http.stats().requests.load(), 10u);
  // An operation's deadline bounds a request's retries and backoff in all.
  HttpOptions slow = o;
  slow.max_attempts = 100;
  slow.backoff_base = 200ms;
  slow.backoff_max = 1000ms;
  HttpClient bounded(slow);
  const auto t0 = std::chrono::steady_clock::now();
  {
    OperationDeadline deadline(t0 + 1500ms, "--metadata-timeout 1.5 s");
    auto r = bounded.Send(HttpRequest{.method = "GET", .url = proxy.url() + "/z"});
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("--metadata-timeout 1.5 s"), std::string::npos) << r.status().ToString();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2500ms);
  EXPECT_EQ(OperationDeadline::Current(), nullptr);
}

// Issue 26, item 3: a bit flipped on the way up. A WebDAV server checks no digest, so every
// upload is read back and compared before it is moved under its name: each Put either stores
// exactly its bytes or fails saying so, and never leaves other bytes under its key. Through a
// proxy flipping one bit in 30% of PUT bodies, then in all of them.
TEST_F(WebDavStoreTest, BitsFlippedOnTheWayUpAreNeverStoredSilently) {
  test::FaultProxy flipper;
  test::FaultProxy::Options fo;
  fo.seed = 5;
  fo.extra_args = {"--flip-put-rate", "0.3"};
  ASSERT_TRUE(flipper.Start(nginx_.url(), fo));
  auto store = OpenOrDie(flipper.url() + "/bucket", http_);
  int ok = 0, failed = 0, silent = 0;
  for (int i = 0; i < 30; ++i) {
    std::vector<uint8_t> body(1000 + 7919u * i);
    for (size_t k = 0; k < body.size(); ++k) body[k] = static_cast<uint8_t>(k * 31 + i);
    const std::string key = "flip/" + std::to_string(i);
    Status put = store->Put(key, body, i % 2 ? PutMode::kCreateIfAbsent : PutMode::kOverwrite);
    auto back = store_->Get(key);
    if (put.ok()) {
      ++ok;
      if (!back.ok() || *back != body) ++silent;
    } else {
      ++failed;
      EXPECT_EQ(put.kind(), ErrorKind::kCorruption) << put.ToString();
      EXPECT_EQ(back.status().kind(), ErrorKind::kNotFound) << key;
    }
  }
  std::printf("[ flips    ] 30 PUTs through 30%% flips: %d stored intact, %d failed, %d silent\n", ok, failed, silent);
  EXPECT_EQ(silent, 0);
  EXPECT_GE(ok, 24);
  flipper.SetMode("flip-put");
  Status put = store->Put("flip/always", std::vector<uint8_t>(5000, 7), PutMode::kCreateIfAbsent);
  EXPECT_EQ(put.kind(), ErrorKind::kCorruption) << put.ToString();
  EXPECT_EQ(store_->Get("flip/always").status().kind(), ErrorKind::kNotFound);
}

TEST(HttpClientTest, MessagesNeverShowQueryStringsOrSecrets) {
  HttpOptions o = FastOptions();
  o.max_attempts = 2;
  HttpClient http(o);
  const std::string port = std::to_string(test::FreeLoopbackPort());
  HttpRequest req{.method = "GET",
                  .url = "http://bob:pa55word@127.0.0.1:" + port + "/obj?X-Amz-Signature=topsecret",
                  .headers = {{"Authorization", "Bearer hunter2"}, {"x-amz-security-token", "tok3n"}},
                  .sensitive_headers = {"x-amz-security-token"}};
  auto r = http.Send(req);
  ASSERT_FALSE(r.ok());
  const std::string m = r.status().message();
  EXPECT_NE(m.find("127.0.0.1:" + port + "/obj"), std::string::npos) << m;
  for (const char* secret : {"topsecret", "hunter2", "tok3n", "pa55word", "X-Amz"}) {
    EXPECT_EQ(m.find(secret), std::string::npos) << secret << " in: " << m;
  }
}

TEST(HttpClientTest, SendsHeadersBodiesAndCustomMethods) {
  test::NginxServer nginx;
  ASSERT_TRUE(nginx.Start());
  HttpClient http(FastOptions());
  const std::string body = "0123456789";
  const std::span<const uint8_t> bytes(reinterpret_cast<const uint8_t*>(body.data()), body.size());
  auto put = http.Send(HttpRequest{.method = "PUT", .url = nginx.url() + "/d/f", .body = bytes});
  ASSERT_TRUE(put.ok()) << put.status().ToString();
  EXPECT_EQ(put->status, 201);
  auto range = http.Send(HttpRequest{.method = "GET", .url = nginx.url() + "/d/f", .headers = {{"Range", "bytes=2-4"}}});
  ASSERT_TRUE(range.ok());
  EXPECT_EQ(range->status, 206);
  EXPECT_EQ(std::string(range->body.begin(), range->body.end()), "234");
  EXPECT_EQ(range->Header("content-range"), "bytes 2-4/10");
  EXPECT_EQ(range->Header("Content-Range"), "bytes 2-4/10");
  auto head = http.Send(HttpRequest{.method = "HEAD", .url = nginx.url() + "/d/f"});
  ASSERT_TRUE(head.ok());
  EXPECT_EQ(head->Header("content-length"), "10");
  EXPECT_TRUE(head->body.empty());
  auto mkcol = http.Send(HttpRequest{.method = "MKCOL", .url = nginx.url() + "/e/"});
  ASSERT_TRUE(mkcol.ok());
  EXPECT_EQ(mkcol->status, 201);
  auto redirect = http.Send(HttpRequest{.method = "GET", .url = nginx.url() + "/e"});
  ASSERT_TRUE(redirect.ok());
  EXPECT_EQ(redirect->status, 301);  // not followed unless asked
  auto limited = http.Send(HttpRequest{.method = "GET", .url = nginx.url() + "/d/f", .max_response_bytes = 4});
  EXPECT_EQ(limited.status().kind(), ErrorKind::kResourceExhausted);
  // sign() runs before every attempt and may add headers.
  int signs = 0;
  auto signed_req = http.Send(HttpRequest{.method = "GET",
                                          .url = nginx.url() + "/d/f",
                                          .sign = [&](HttpRequest& r) {
                                            ++signs;
                                            r.headers.emplace_back("Range", "bytes=0-0");
                                          }});
  ASSERT_TRUE(signed_req.ok());
  EXPECT_EQ(signs, 1);
  EXPECT_EQ(std::string(signed_req->body.begin(), signed_req->body.end()), "0");
}

TEST(HttpClientTest, StatusErrorsAndUrlEncoding) {
  EXPECT_EQ(HttpStatusError(404, "GET k", "").kind(), ErrorKind::kNotFound);
  EXPECT_EQ(HttpStatusError(401, "GET k", "").kind(), ErrorKind::kAuth);
  EXPECT_EQ(HttpStatusError(403, "GET k", "").kind(), ErrorKind::kAuth);
  EXPECT_EQ(HttpStatusError(409, "GET k", "").kind(), ErrorKind::kConflict);
  EXPECT_EQ(HttpStatusError(412, "GET k", "").kind(), ErrorKind::kConflict);
  EXPECT_EQ(HttpStatusError(408, "GET k", "").kind(), ErrorKind::kTimeout);
  EXPECT_EQ(HttpStatusError(504, "GET k", "").kind(), ErrorKind::kTimeout);
  EXPECT_EQ(HttpStatusError(500, "GET k", "").kind(), ErrorKind::kIOError);
  EXPECT_EQ(HttpStatusError(400, "GET k", "").kind(), ErrorKind::kIOError);
  const Status s3 = HttpStatusError(
      403, "PUT s3://b/k",
      "<?xml version=\"1.0\"?><Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>");
  EXPECT_EQ(s3.message(), "PUT s3://b/k: HTTP 403: AccessDenied: Access Denied");
  const Status html = HttpStatusError(404, "GET x", "<html><head><title>404 Not Found</title></head><body>..</body></html>");
  EXPECT_EQ(html.message(), "GET x: HTTP 404: 404 Not Found");
  EXPECT_LT(HttpStatusError(500, "GET x", std::string(10000, 'a')).message().size(), 300u);
  EXPECT_EQ(UrlEncode("a/b c@d=e+f~g-h.i_j%", true), "a/b%20c%40d%3De%2Bf~g-h.i_j%25");
  EXPECT_EQ(UrlEncode("a/b", false), "a%2Fb");
  EXPECT_EQ(UrlEncode("\xff", false), "%FF");
}

TEST(DavMultistatusTest, ReadsWhatServersSend) {
  // Apache mod_dav style: lp1 prefixes, absolute hrefs, a 404 propstat for missing props.
  const std::string apache = R"(<?xml version="1.0" encoding="utf-8"?>
<D:multistatus xmlns:D="DAV:" xmlns:ns0="DAV:">
<D:response xmlns:lp1="DAV:">
<D:href>http://example.com/dav/b/</D:href>
<D:propstat><D:prop><lp1:resourcetype><D:collection/></lp1:resourcetype></D:prop>
<D:status>HTTP/1.1 200 OK</D:status></D:propstat>
<D:propstat><D:prop><lp1:getcontentlength/></D:prop><D:status>HTTP/1.1 404 Not Found</D:status></D:propstat>
</D:response>
<D:response xmlns:lp1="DAV:">
<D:href>http://example.com/dav/b/a%40b%3D1?x=&amp;y</D:href>
<D:propstat><D:prop><lp1:resourcetype/><lp1:getcontentlength>1234</lp1:getcontentlength></D:prop>
<D:status>HTTP/1.1 200 OK</D:status></D:propstat>
</D:response>
</D:multistatus>)";
  auto a = ParseDavMultistatus(apache);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_EQ(a->size(), 2u);
  EXPECT_EQ((*a)[0].href, "http://example.com/dav/b/");
  EXPECT_TRUE((*a)[0].collection);
  EXPECT_FALSE((*a)[0].length.has_value());
  EXPECT_EQ((*a)[1].href, "http://example.com/dav/b/a%40b%3D1?x=&y");
  EXPECT_FALSE((*a)[1].collection);
  EXPECT_EQ((*a)[1].length, 1234u);

  // Default namespace, CDATA, comments, a response-level 404 (dropped).
  const std::string plain = R"(<multistatus xmlns="DAV:"><!-- hi -->
<response><href><![CDATA[/x/a&b]]></href><propstat><prop><resourcetype/>
<getcontentlength> 7 </getcontentlength></prop><status>HTTP/1.1 200 OK</status></propstat></response>
<response><href>/x/gone</href><status>HTTP/1.1 404 Not Found</status></response>
<response><href>/x/c</href><propstat><prop><resourcetype><collection/></resourcetype></prop></propstat></response>
</multistatus>)";
  auto p = ParseDavMultistatus(plain);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  ASSERT_EQ(p->size(), 2u);
  EXPECT_EQ((*p)[0].href, "/x/a&b");
  EXPECT_EQ((*p)[0].length, 7u);
  EXPECT_EQ((*p)[1].href, "/x/c");
  EXPECT_TRUE((*p)[1].collection);

  for (const std::string& bad : std::vector<std::string>{"<a><b></a>", "<a", "<multistatus><response>", "<!-- x",
                                                         "<![CDATA[ x", std::string(100, '<') + "x", "</a>"}) {
    EXPECT_EQ(ParseDavMultistatus(bad).status().kind(), ErrorKind::kCorruption) << bad;
  }
  std::string deep;
  for (int i = 0; i < 100; ++i) deep += "<a>";
  EXPECT_EQ(ParseDavMultistatus(deep).status().kind(), ErrorKind::kCorruption);
  // Arbitrary bytes never crash it.
  std::mt19937 rng(1);
  const std::string alphabet = "<>/!?[]-=\"' :abDhrefcolectin&;#x0\n";
  for (int i = 0; i < 2000; ++i) {
    std::string junk(rng() % 200, ' ');
    for (char& c : junk) c = alphabet[rng() % alphabet.size()];
    (void)ParseDavMultistatus(junk);
  }
}

}  // namespace
}  // namespace weightfs

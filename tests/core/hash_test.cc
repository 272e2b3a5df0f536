#include "core/hash.h"
#include "tests/testing/bytes.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace weightfs {
namespace {

using test::AsBytes;

// FIPS 180-2 / NIST test vectors.
TEST(HashTest, Sha256OfStandardVectors) {
  EXPECT_EQ(Sha256Hex(AsBytes("")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256Hex(AsBytes("abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Sha256Hex(AsBytes("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  const std::string million_a(1'000'000, 'a');
  EXPECT_EQ(Sha256Hex(AsBytes(million_a)),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(HashTest, Sha256IncrementalEqualsOneShot) {
  std::mt19937_64 rng(1);
  std::vector<uint8_t> bytes(100'003);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
  const std::string want = Sha256Hex(bytes);
  for (size_t piece : {size_t{1}, size_t{63}, size_t{64}, size_t{65}, size_t{4096}, size_t{99'999}}) {
    SCOPED_TRACE("pieces of " + std::to_string(piece));
    Sha256 sha;
    for (size_t at = 0; at < bytes.size(); at += piece) {
      sha.Update(std::span<const uint8_t>(bytes).subspan(at, std::min(piece, bytes.size() - at)));
    }
    EXPECT_EQ(sha.FinishHex(), want);
  }
  // Empty updates change nothing.
  Sha256 sha;
  sha.Update({});
  sha.Update(bytes);
  sha.Update({});
  EXPECT_EQ(sha.FinishHex(), want);
}

TEST(HashTest, Hash128HexRoundTrip) {
  const Hash128 h{0x0123456789abcdefull, 0xfedcba9876543210ull};
  EXPECT_EQ(h.ToHex(), "0123456789abcdeffedcba9876543210");
  Expected<Hash128> back = Hash128::FromHex(h.ToHex());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, h);

  EXPECT_EQ(Hash128{}.ToHex(), std::string(32, '0'));
  const Hash128 ones{~0ull, ~0ull};
  EXPECT_EQ(ones.ToHex(), std::string(32, 'f'));
  EXPECT_EQ(*Hash128::FromHex(ones.ToHex()), ones);

  std::vector<uint8_t> bytes = {1, 2, 3};
  const Hash128 chunk = HashChunk(bytes);
  EXPECT_EQ(*Hash128::FromHex(chunk.ToHex()), chunk);
}

TEST(HashTest, Hash128FromHexRejectsBadInput) {
  const std::string good = "0123456789abcdeffedcba9876543210";
  for (std::string_view bad : {std::string_view(""), std::string_view("0123"),
                               std::string_view(good).substr(0, 31),
                               std::string_view("0123456789abcdeffedcba98765432100"),
                               std::string_view("0123456789abcdeffedcba987654321g"),
                               std::string_view("0123456789ABCDEFFEDCBA9876543210"),
                               std::string_view(" 123456789abcdeffedcba9876543210"),
                               std::string_view("0x23456789abcdeffedcba9876543210")}) {
    SCOPED_TRACE("\"" + std::string(bad) + "\"");
    Expected<Hash128> h = Hash128::FromHex(bad);
    ASSERT_FALSE(h.ok());
    EXPECT_EQ(h.status().kind(), ErrorKind::kCorruption);
  }
  std::string with_nul = good;
  with_nul[7] = '\0';
  EXPECT_FALSE(Hash128::FromHex(with_nul).ok());
}

TEST(HashTest, ChunkHashesSeparateContent) {
  std::vector<uint8_t> a(4096, 0);
  std::vector<uint8_t> b = a;
  b[4095] = 1;
  EXPECT_NE(HashChunk(a), HashChunk(b));
  EXPECT_NE(Hash64(a), Hash64(b));
  EXPECT_EQ(HashChunk(a), HashChunk(std::vector<uint8_t>(4096, 0)));
  EXPECT_NE(HashChunk(std::span<const uint8_t>(a).first(0)), HashChunk(std::span<const uint8_t>(a).first(1)));
}

// The hashes are the format's (chunk identity, payload self-checks): whatever implementation
// computes them (libxxhash's run-time dispatch to AVX2/AVX-512 here), they are the reference
// XXH3's, for every length class of its algorithm and for unaligned starts.
TEST(HashTest, ChunkHashesAreTheReferenceXxh3) {
  std::mt19937_64 rng(3);
  std::vector<uint8_t> bytes((4 << 20) + 64);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  for (size_t size : {0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1024, 4095, 65537, (4 << 20) + 3}) {
    for (size_t start : {0, 1, 7}) {
      SCOPED_TRACE("size " + std::to_string(size) + " at " + std::to_string(start));
      const std::span<const uint8_t> s(bytes.data() + start, size);
      const XXH128_hash_t ref = XXH3_128bits(s.data(), s.size());
      EXPECT_EQ(HashChunk(s), (Hash128{ref.high64, ref.low64}));
      EXPECT_EQ(Hash64(s), XXH3_64bits(s.data(), s.size()));
    }
  }
}

}  // namespace
}  // namespace weightfs

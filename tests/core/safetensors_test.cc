#include "core/safetensors.h"
#include "tests/testing/safetensors_builder.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

namespace weightfs {
namespace {

// The first 8 + N bytes of a file whose header JSON is `json` (N = json.size(), no padding).
std::vector<uint8_t> Prefix(std::string_view json) { return test::SafetensorsBuilder().RawHeader(json).Header(); }

std::vector<uint8_t> LengthOnly(uint64_t n) { return test::SafetensorsLengthPrefix(n); }

// Parses a file made of Prefix(json) followed by `data_size` data bytes (never materialized:
// the parser only needs the prefix and the file size).
Expected<SafetensorsHeader> ParseJson(std::string_view json, uint64_t data_size) {
  std::vector<uint8_t> prefix = Prefix(json);
  return ParseSafetensorsHeader(prefix, prefix.size() + data_size);
}

// Parses what BuildSafetensorsHeader produced, with a data section of exactly the tensors.
Expected<SafetensorsHeader> ParseBuilt(const std::vector<uint8_t>& prefix,
                                       const std::vector<TensorInfo>& tensors) {
  uint64_t data_size = tensors.empty() ? 0 : tensors.back().end;
  return ParseSafetensorsHeader(prefix, prefix.size() + data_size);
}

using test::TensorSpec;

void ExpectSameTensors(const std::vector<TensorInfo>& got, const std::vector<TensorInfo>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    SCOPED_TRACE("tensor #" + std::to_string(i) + " " + want[i].name);
    EXPECT_EQ(got[i].name, want[i].name);
    EXPECT_EQ(got[i].dtype, want[i].dtype);
    EXPECT_EQ(got[i].shape, want[i].shape);
    EXPECT_EQ(got[i].begin, want[i].begin);
    EXPECT_EQ(got[i].end, want[i].end);
  }
}

// The order the reader returns: by begin, zero-size tensors first at a shared begin, then name.
void SortLikeReader(std::vector<TensorInfo>& tensors) {
  std::sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
}

void ExpectCorruption(const Expected<SafetensorsHeader>& result, std::string_view phrase) {
  ASSERT_FALSE(result.ok()) << "expected a Corruption containing \"" << phrase << "\"";
  EXPECT_EQ(result.status().kind(), ErrorKind::kCorruption) << result.status().ToString();
  EXPECT_NE(result.status().message().find(phrase), std::string::npos)
      << "message \"" << result.status().message() << "\" lacks \"" << phrase << "\"";
}

// Checks what every accepted header promises its users.
void ExpectInvariants(const SafetensorsHeader& h, uint64_t file_size) {
  EXPECT_GT(h.header_size, 0u);
  EXPECT_LE(h.header_size, kMaxSafetensorsHeaderBytes);
  EXPECT_EQ(h.data_offset, 8 + h.header_size);
  EXPECT_EQ(h.file_size, file_size);
  ASSERT_LE(h.data_offset, file_size);
  uint64_t cursor = 0;
  for (const TensorInfo& t : h.tensors) {
    EXPECT_FALSE(t.name.empty());
    EXPECT_NE(t.dtype, DType::kOpaque);
    EXPECT_EQ(t.begin, cursor) << t.name;
    EXPECT_LE(t.begin, t.end) << t.name;
    cursor = t.end;
  }
  EXPECT_EQ(cursor, file_size - h.data_offset);
}

// ---------------------------------------------------------------------------------------------
// Round trips.

TEST(SafetensorsRoundTrip, EveryDTypeOnItsOwn) {
  for (int i = 1; i < kDTypeCount; ++i) {
    const DType dt = static_cast<DType>(i);
    SCOPED_TRACE(std::string(DTypeName(dt)));
    std::vector<TensorInfo> tensors = {TensorSpec("w", dt, {2, 3})};
    const std::vector<uint8_t> prefix = BuildSafetensorsHeader(tensors, {});
    EXPECT_EQ(tensors[0].begin, 0u);
    EXPECT_EQ(tensors[0].end, 6 * DTypeSize(dt));
    auto parsed = ParseBuilt(prefix, tensors);
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    ExpectSameTensors(parsed->tensors, tensors);
    EXPECT_TRUE(parsed->metadata.empty());
    EXPECT_EQ(parsed->data_offset, prefix.size());
  }
}

TEST(SafetensorsRoundTrip, AllDTypesInOneFileKeepFileOrder) {
  std::vector<TensorInfo> tensors;
  // Names deliberately not in alphabetical order: the file order is the order given to Build.
  for (int i = kDTypeCount - 1; i >= 1; --i) {
    const DType dt = static_cast<DType>(i);
    tensors.push_back(TensorSpec("t" + std::to_string(i), dt, {static_cast<uint64_t>(i), 5}));
  }
  const std::vector<uint8_t> prefix = BuildSafetensorsHeader(tensors, {{"format", "pt"}});
  auto parsed = ParseBuilt(prefix, tensors);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  ExpectSameTensors(parsed->tensors, tensors);
  ExpectInvariants(*parsed, prefix.size() + tensors.back().end);
}

TEST(SafetensorsRoundTrip, ScalarsHaveEmptyShapeAndOneElement) {
  std::vector<TensorInfo> tensors = {TensorSpec("step", DType::kI64, {}),
                                     TensorSpec("lr", DType::kF32, {}),
                                     TensorSpec("flag", DType::kBool, {})};
  const std::vector<uint8_t> prefix = BuildSafetensorsHeader(tensors, {});
  EXPECT_EQ(tensors[2].end, 8u + 4u + 1u);
  auto parsed = ParseBuilt(prefix, tensors);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  ExpectSameTensors(parsed->tensors, tensors);
  EXPECT_TRUE(parsed->tensors[0].shape.empty());
}

TEST(SafetensorsRoundTrip, ZeroSizeTensorsAnywhere) {
  std::vector<TensorInfo> tensors = {
      TensorSpec("empty_first", DType::kF32, {0}),       TensorSpec("a", DType::kF16, {4}),
      TensorSpec("z2", DType::kBF16, {3, 0, 7}),         TensorSpec("z1", DType::kU8, {0}),
      TensorSpec("b", DType::kI32, {2}),                 TensorSpec("empty_last", DType::kF64, {0, 0}),
  };
  const std::vector<uint8_t> prefix = BuildSafetensorsHeader(tensors, {});
  auto parsed = ParseBuilt(prefix, tensors);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  // z2 and z1 share [8, 8): the reader orders them by name.
  std::vector<TensorInfo> want = tensors;
  SortLikeReader(want);
  EXPECT_EQ(want[2].name, "z1");
  EXPECT_EQ(want[3].name, "z2");
  ExpectSameTensors(parsed->tensors, want);
  ExpectInvariants(*parsed, prefix.size() + 16);
}

TEST(SafetensorsRoundTrip, OnlyZeroSizeTensorsAndEmptyDataSection) {
  std::vector<TensorInfo> tensors = {TensorSpec("b", DType::kF32, {0}), TensorSpec("a", DType::kI8, {0})};
  const std::vector<uint8_t> prefix = BuildSafetensorsHeader(tensors, {});
  auto parsed = ParseSafetensorsHeader(prefix, prefix.size());
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  ASSERT_EQ(parsed->tensors.size(), 2u);
  EXPECT_EQ(parsed->tensors[0].name, "a");
  EXPECT_EQ(parsed->tensors[1].name, "b");
}

TEST(SafetensorsRoundTrip, NoTensors) {
  std::vector<TensorInfo> tensors;
  const std::vector<uint8_t> prefix = BuildSafetensorsHeader(tensors, {{"k", "v"}});
  auto parsed = ParseSafetensorsHeader(prefix, prefix.size());
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_TRUE(parsed->tensors.empty());
  EXPECT_EQ(parsed->metadata.at("k"), "v");
}

TEST(SafetensorsRoundTrip, MetadataKeptVerbatim) {
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {"", "empty key"},
      {"json", R"({"nested": [1, 2], "quote": "\""})"},
      {"unicode", "h\xC3\xA9llo \xE2\x9C\x93"},
      {"control", std::string("a\0b\n\t", 5)},
  };
  std::vector<TensorInfo> tensors = {TensorSpec("x", DType::kU16, {3})};
  const std::vector<uint8_t> prefix = BuildSafetensorsHeader(tensors, metadata);
  auto parsed = ParseBuilt(prefix, tensors);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->metadata, metadata);
  ExpectSameTensors(parsed->tensors, tensors);
}

TEST(SafetensorsRoundTrip, UnusualTensorNames) {
  std::vector<TensorInfo> tensors = {
      TensorSpec("model.layers.0.self_attn.q_proj.weight", DType::kBF16, {4, 4}),
      TensorSpec("with \"quotes\" and \\ backslash", DType::kF32, {1}),
      TensorSpec("caf\xC3\xA9/\xF0\x9F\x98\x80", DType::kU8, {3}),
      TensorSpec(std::string(1000, 'n'), DType::kI16, {2}),
  };
  const std::vector<uint8_t> prefix = BuildSafetensorsHeader(tensors, {});
  auto parsed = ParseBuilt(prefix, tensors);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  ExpectSameTensors(parsed->tensors, tensors);
}

TEST(SafetensorsBuild, PadsWithSpacesToEightBytesAndWritesCompactJson) {
  for (size_t len = 1; len <= 16; ++len) {
    std::vector<TensorInfo> tensors = {TensorSpec(std::string(len, 'x'), DType::kF32, {len})};
    const std::vector<uint8_t> prefix = BuildSafetensorsHeader(tensors, {});
    ASSERT_EQ(prefix.size() % 8, 0u);
    auto n = SafetensorsPrefixLength(prefix);
    ASSERT_TRUE(n.ok());
    EXPECT_EQ(*n, prefix.size());
    const std::string json(prefix.begin() + 8, prefix.end());
    EXPECT_EQ(json.front(), '{');
    const size_t close = json.rfind('}');
    EXPECT_EQ(json.find_first_not_of(' ', close + 1), std::string::npos);
    EXPECT_LT(json.size() - close - 1, 8u);
    EXPECT_EQ(json.find('\n'), std::string::npos);
  }
}

TEST(SafetensorsBuild, MetadataComesFirstAndOmittedWhenEmpty) {
  std::vector<TensorInfo> tensors = {TensorSpec("a", DType::kF32, {1})};
  std::vector<uint8_t> prefix = BuildSafetensorsHeader(tensors, {{"format", "pt"}});
  std::string json(prefix.begin() + 8, prefix.end());
  EXPECT_EQ(json.rfind(R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[1],)"
                       R"("data_offsets":[0,4]}})",
                       0),
            0u)
      << json;
  prefix = BuildSafetensorsHeader(tensors, {});
  json.assign(prefix.begin() + 8, prefix.end());
  EXPECT_EQ(json.find("__metadata__"), std::string::npos);
}

TEST(SafetensorsBuild, RewritesOffsetsContiguouslyInGivenOrder) {
  std::vector<TensorInfo> tensors = {TensorSpec("b", DType::kF32, {2}), TensorSpec("a", DType::kU8, {3})};
  tensors[0].begin = 100;
  tensors[0].end = 7;
  tensors[1].begin = 5;
  tensors[1].end = 5;
  (void)BuildSafetensorsHeader(tensors, {});
  EXPECT_EQ(tensors[0].begin, 0u);
  EXPECT_EQ(tensors[0].end, 8u);
  EXPECT_EQ(tensors[1].begin, 8u);
  EXPECT_EQ(tensors[1].end, 11u);
}

// ---------------------------------------------------------------------------------------------
// Accepted inputs written by hand.

TEST(SafetensorsParse, AcceptsReferenceStyleHeaderWithTrailingSpaces) {
  const std::string json =
      R"({"__metadata__":{"format":"pt"},"weight":{"dtype":"F32","shape":[2,2],)"
      R"("data_offsets":[0,16]},"bias":{"dtype":"F32","shape":[2],"data_offsets":[16,24]}})"
      "      ";
  auto parsed = ParseJson(json, 24);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->header_size, json.size());
  EXPECT_EQ(parsed->data_offset, 8 + json.size());
  EXPECT_EQ(parsed->file_size, 8 + json.size() + 24);
  ASSERT_EQ(parsed->tensors.size(), 2u);
  EXPECT_EQ(parsed->tensors[0].name, "weight");  // sorted by offset, not by name
  EXPECT_EQ(parsed->tensors[1].name, "bias");
  EXPECT_EQ(parsed->tensors[1].shape, std::vector<uint64_t>{2});
  EXPECT_EQ(parsed->metadata.at("format"), "pt");
}

TEST(SafetensorsParse, AcceptsEmptyObjectWithEmptyDataSection) {
  auto parsed = ParseJson("{}", 0);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_TRUE(parsed->tensors.empty());
}

TEST(SafetensorsParse, IgnoresPrefixBytesAfterTheHeader) {
  std::vector<uint8_t> file = Prefix(R"({"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}})");
  file.insert(file.end(), {'x', 'y', 'z'});
  auto parsed = ParseSafetensorsHeader(file, file.size());
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->tensors[0].end, 3u);
}

TEST(SafetensorsParse, AcceptsHugeTensorsWithoutOverflow) {
  // 1 TiB of U8: large but representable.
  auto parsed = ParseJson(
      R"({"big":{"dtype":"U8","shape":[1048576,1048576],"data_offsets":[0,1099511627776]}})",
      1ull << 40);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->tensors[0].size(), 1ull << 40);
}

TEST(SafetensorsParse, ZeroSizeTensorsAtTheEndOfTheDataSection) {
  auto parsed = ParseJson(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                          R"("z":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)"
                          R"("y":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})",
                          4);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  ASSERT_EQ(parsed->tensors.size(), 3u);
  EXPECT_EQ(parsed->tensors[0].name, "a");
  EXPECT_EQ(parsed->tensors[1].name, "y");
  EXPECT_EQ(parsed->tensors[2].name, "z");
}

TEST(SafetensorsParse, ZeroSizeTensorBeforeANonEmptyOneAtTheSameOffset) {
  // "a" sorts before "z" by name, yet the zero-size "z" must come first to tile.
  auto parsed = ParseJson(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                          R"("z":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}})",
                          4);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->tensors[0].name, "z");
  EXPECT_EQ(parsed->tensors[1].name, "a");
}

// ---------------------------------------------------------------------------------------------
// The 8-byte length.

TEST(SafetensorsPrefixLength, ReturnsEightPlusN) {
  auto n = SafetensorsPrefixLength(LengthOnly(1234));
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 1242u);
  n = SafetensorsPrefixLength(LengthOnly(kMaxSafetensorsHeaderBytes));
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 8 + kMaxSafetensorsHeaderBytes);
}

TEST(SafetensorsPrefixLength, RejectsBadLengths) {
  struct Case {
    std::vector<uint8_t> prefix;
    std::string phrase;
  };
  const Case cases[] = {
      {{}, "truncated prefix"},
      {{1, 0, 0, 0, 0, 0, 0}, "truncated prefix"},
      {LengthOnly(0), "header length is 0"},
      {LengthOnly(kMaxSafetensorsHeaderBytes + 1), "exceeds the limit"},
      {LengthOnly(1ull << 63), "exceeds the limit"},
      {LengthOnly(~0ull), "exceeds the limit"},
  };
  for (const Case& c : cases) {
    auto n = SafetensorsPrefixLength(c.prefix);
    ASSERT_FALSE(n.ok()) << c.phrase;
    EXPECT_EQ(n.status().kind(), ErrorKind::kCorruption);
    EXPECT_NE(n.status().message().find(c.phrase), std::string::npos) << n.status().message();
  }
}

TEST(SafetensorsParse, RejectsZeroLength) {
  std::vector<uint8_t> file = LengthOnly(0);
  file.push_back('{');
  ExpectCorruption(ParseSafetensorsHeader(file, file.size()), "header length is 0");
}

TEST(SafetensorsParse, RejectsHugeLength) {
  std::vector<uint8_t> file = LengthOnly(1ull << 63);
  file.insert(file.end(), {'{', '}'});
  ExpectCorruption(ParseSafetensorsHeader(file, ~0ull), "exceeds the limit");
}

TEST(SafetensorsParse, RejectsLengthBeyondFileSize) {
  std::vector<uint8_t> file = Prefix("{}");
  ExpectCorruption(ParseSafetensorsHeader(file, file.size() - 1), "file size is only");
  // The length field claims more than the whole (short) file.
  file = LengthOnly(100);
  file.insert(file.end(), {'{', '}'});
  ExpectCorruption(ParseSafetensorsHeader(file, file.size()), "file size is only");
}

TEST(SafetensorsParse, RejectsTruncatedPrefix) {
  std::vector<uint8_t> file = Prefix("{}     ");
  ExpectCorruption(ParseSafetensorsHeader(std::span(file).first(5), 1000), "truncated prefix");
  ExpectCorruption(ParseSafetensorsHeader(std::span(file).first(file.size() - 1), 1000),
                   "truncated prefix");
}

// ---------------------------------------------------------------------------------------------
// A corpus of malformed headers, each rejected with Corruption and a message naming the rule.

struct BadHeader {
  const char* test_name;
  std::string json;
  uint64_t data_size;
  std::string phrase;
};

void PrintTo(const BadHeader& c, std::ostream* os) { *os << c.test_name; }

class SafetensorsRejects : public ::testing::TestWithParam<BadHeader> {};

TEST_P(SafetensorsRejects, WithCorruptionNamingTheRule) {
  const BadHeader& c = GetParam();
  ExpectCorruption(ParseJson(c.json, c.data_size), c.phrase);
}

// A valid entry for tensor `name` with the given parts spliced in.
std::string Entry(const std::string& dtype, const std::string& shape,
                  const std::string& offsets) {
  return R"({"dtype":)" + dtype + R"(,"shape":)" + shape + R"(,"data_offsets":)" + offsets + "}";
}

// {"a": <a>, "b": <b>}
std::string TwoTensors(const std::string& a, const std::string& b) {
  return R"({"a":)" + a + R"(,"b":)" + b + "}";
}

const BadHeader kBadHeaders[] = {
    // Not JSON, or not the right JSON.
    {"NotJson", "this is not json", 0, "must start with '{'"},
    {"UnterminatedObject", R"({"a":)", 0, "not valid JSON"},
    {"BareBrace", "{", 0, "not valid JSON"},
    {"GarbageInsideObject", "{xyz}", 0, "not valid JSON"},
    {"TrailingGarbage", "{} x", 0, "not valid JSON"},
    {"TrailingNul", std::string("{}\0", 3), 0, "NUL byte at header byte 2"},
    {"NulThenGarbage", std::string("{}\0garbage", 10), 0, "NUL byte"},
    {"NulInsideString", std::string("{\"a\0\":1}", 8), 0, "NUL byte"},
    {"TwoObjects", "{}{}", 0, "not valid JSON"},
    {"JsonArray", "[1,2]", 0, "must start with '{'"},
    {"JsonString", R"("abc")", 0, "must start with '{'"},
    {"LeadingSpace", " {}", 0, "must start with '{'"},
    {"Utf8Bom", "\xEF\xBB\xBF{}", 0, "must start with '{'"},
    {"InvalidUtf8InName", "{\"a\xFF\":" + Entry(R"("U8")", "[1]", "[0,1]") + "}", 1,
     "ill-formed UTF-8"},
    {"OverlongUtf8", "{\"a\xC0\xAF\":" + Entry(R"("U8")", "[1]", "[0,1]") + "}", 1,
     "ill-formed UTF-8"},
    {"Utf16Surrogate", "{\"a\xED\xA0\x80\":" + Entry(R"("U8")", "[1]", "[0,1]") + "}", 1,
     "ill-formed UTF-8"},
    {"LoneSurrogateEscape", R"({"a\uD800":)" + Entry(R"("U8")", "[1]", "[0,1]") + "}", 1,
     "not valid JSON"},
    {"Comment", "{/* c */}", 0, "not valid JSON"},
    {"TooDeep", R"({"a":{"dtype":"U8","shape":[[1]],"data_offsets":[0,1]}})", 1, "nests deeper"},
    {"VeryDeep", "{\"a\":" + std::string(10000, '[') + std::string(10000, ']') + "}", 0,
     "nests deeper"},
    {"DepthCountsOnlyOutsideStrings", R"({"[[[[":1})", 0, "entry must be an object"},

    // __metadata__.
    {"MetadataNotObject", R"({"__metadata__":["a"]})", 0, "__metadata__ must be an object"},
    {"MetadataNull", R"({"__metadata__":null})", 0, "__metadata__ must be an object"},
    {"MetadataNumberValue", R"({"__metadata__":{"k":1}})", 0, "must have a string value"},
    {"MetadataNullValue", R"({"__metadata__":{"k":null}})", 0, "must have a string value"},
    {"MetadataObjectValue", R"({"__metadata__":{"k":{}}})", 0, "must have a string value"},

    // Tensor entries.
    {"EmptyName", R"({"":)" + Entry(R"("U8")", "[1]", "[0,1]") + "}", 1, "empty name"},
    {"EntryNumber", R"({"w":1})", 0, "tensor 'w': entry must be an object"},
    {"EntryArray", R"({"w":["F32",[1],[0,4]]})", 4, "tensor 'w': entry must be an object"},
    {"EntryNull", R"({"w":null})", 0, "tensor 'w': entry must be an object"},
    {"MissingDtype", R"({"w":{"shape":[1],"data_offsets":[0,4]}})", 4, "missing field 'dtype'"},
    {"MissingShape", R"({"w":{"dtype":"F32","data_offsets":[0,4]}})", 4, "missing field 'shape'"},
    {"MissingOffsets", R"({"w":{"dtype":"F32","shape":[1]}})", 4, "missing field 'data_offsets'"},
    {"EmptyEntry", R"({"w":{}})", 0, "missing field"},
    {"ExtraField", R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}})", 4,
     "unexpected field 'x'"},
    {"MisspelledField", R"({"w":{"dtype":"F32","shape":[1],"data_offset":[0,4]}})", 4,
     "unexpected field 'data_offset'"},

    // dtype.
    {"UnknownDtype", R"({"w":)" + Entry(R"("F17")", "[1]", "[0,4]") + "}", 4,
     "tensor 'w': unknown dtype 'F17'"},
    {"LowercaseDtype", R"({"w":)" + Entry(R"("f32")", "[1]", "[0,4]") + "}", 4, "unknown dtype"},
    {"OpaqueDtype", R"({"w":)" + Entry(R"("OPAQUE")", "[1]", "[0,1]") + "}", 1, "unknown dtype"},
    {"EmptyDtype", R"({"w":)" + Entry(R"("")", "[1]", "[0,1]") + "}", 1, "unknown dtype"},
    {"NumericDtype", R"({"w":)" + Entry("4", "[1]", "[0,4]") + "}", 4, "dtype must be a string"},
    // A non-negative integer is a "number" (it once read "signed integer 4", and u64 max
    // "negative integer -1").
    {"NumericDtypeSaysNumber", R"({"w":)" + Entry("4", "[1]", "[0,4]") + "}", 4,
     "tensor 'w': dtype must be a string, not number"},
    {"EntryMaxU64SaysNumber", R"({"w":18446744073709551615})", 0,
     "tensor 'w': entry must be an object with dtype, shape and data_offsets, not number"},

    // shape.
    {"ShapeNegative", R"({"w":)" + Entry(R"("F32")", "[-1]", "[0,4]") + "}", 4,
     "shape[0] must be a non-negative integer, not negative integer -1"},
    {"ShapeNegativeZero", R"({"w":)" + Entry(R"("F32")", "[-0]", "[0,0]") + "}", 0, "shape[0]"},
    {"ShapeFloat", R"({"w":)" + Entry(R"("F32")", "[1,1.5]", "[0,4]") + "}", 4,
     "shape[1] must be a non-negative integer"},
    {"ShapeFloatIntegral", R"({"w":)" + Entry(R"("F32")", "[1.0]", "[0,4]") + "}", 4,
     "shape[0] must be a non-negative integer"},
    {"ShapeExponent", R"({"w":)" + Entry(R"("F32")", "[1e0]", "[0,4]") + "}", 4, "shape[0]"},
    {"ShapeString", R"({"w":)" + Entry(R"("F32")", R"(["1"])", "[0,4]") + "}", 4,
     "shape[0] must be a non-negative integer, not string"},
    {"ShapeNull", R"({"w":)" + Entry(R"("F32")", "[null]", "[0,4]") + "}", 4, "not null"},
    {"ShapeNotArray", R"({"w":)" + Entry(R"("F32")", "4", "[0,4]") + "}", 4,
     "shape must be an array"},
    {"ShapeAbove64Bits", R"({"w":)" + Entry(R"("U8")", "[18446744073709551616]", "[0,1]") + "}",
     1, "shape[0]"},
    {"ShapeProductOverflows", R"({"w":)" + Entry(R"("U8")", "[4294967296,4294967296]", "[0,0]") +
                                  "}",
     0, "overflows 64 bits"},
    {"ShapeTimesDtypeOverflows",
     R"({"w":)" + Entry(R"("F64")", "[2305843009213693952]", "[0,0]") + "}", 0,
     "overflows 64 bits"},
    {"ShapeOverflowsDespiteZeroDim",
     R"({"w":)" + Entry(R"("U8")", "[0,4294967296,4294967296]", "[0,0]") + "}", 0,
     "overflows 64 bits"},

    // data_offsets.
    {"OffsetsOneEntry", R"({"w":)" + Entry(R"("U8")", "[0]", "[0]") + "}", 0,
     "data_offsets has 1 entries; expected 2"},
    {"OffsetsThreeEntries", R"({"w":)" + Entry(R"("U8")", "[1]", "[0,1,1]") + "}", 1,
     "data_offsets has 3 entries"},
    {"OffsetsEmpty", R"({"w":)" + Entry(R"("U8")", "[0]", "[]") + "}", 0,
     "data_offsets has 0 entries"},
    {"OffsetsNotArray", R"({"w":)" + Entry(R"("U8")", "[1]", R"("0,1")") + "}", 1,
     "data_offsets must be an array"},
    {"OffsetsObject", R"({"w":)" + Entry(R"("U8")", "[1]", R"({"begin":0,"end":1})") + "}", 1,
     "data_offsets must be an array"},
    {"OffsetsReversed", R"({"w":)" + Entry(R"("U8")", "[4]", "[8,4]") + "}", 8,
     "data_offsets [8, 4) are reversed"},
    {"OffsetsNegative", R"({"w":)" + Entry(R"("U8")", "[1]", "[-1,0]") + "}", 1,
     "data_offsets[0] must be a non-negative integer"},
    {"OffsetsFloat", R"({"w":)" + Entry(R"("U8")", "[1]", "[0,1.0]") + "}", 1,
     "data_offsets[1] must be a non-negative integer"},
    {"OffsetsAbove64Bits", R"({"w":)" + Entry(R"("U8")", "[1]", "[0,18446744073709551616]") + "}",
     1, "data_offsets[1]"},
    {"OffsetsOutOfBounds", R"({"w":)" + Entry(R"("U8")", "[16]", "[0,16]") + "}", 8,
     "run past the end of the data section (8 bytes)"},
    {"OffsetsMaxU64",
     R"({"w":)" + Entry(R"("U8")", "[1]", "[18446744073709551614,18446744073709551615]") + "}", 1,
     "run past the end"},
    {"ZeroSizeOutOfBounds", R"({"w":)" + Entry(R"("U8")", "[0]", "[9,9]") + "}", 8,
     "run past the end"},

    // Size.
    {"SizeMismatchTooLong", R"({"w":)" + Entry(R"("F32")", "[2]", "[0,4]") + "}", 4,
     "tensor 'w': size mismatch: shape [2] of F32 is 8 bytes but data_offsets [0, 4) span 4"},
    {"SizeMismatchTooShort", R"({"w":)" + Entry(R"("BF16")", "[2,2]", "[0,16]") + "}", 16,
     "size mismatch"},
    {"SizeMismatchScalar", R"({"w":)" + Entry(R"("F64")", "[]", "[0,4]") + "}", 4,
     "size mismatch"},
    {"SizeMismatchZeroDim", R"({"w":)" + Entry(R"("U8")", "[0,4]", "[0,4]") + "}", 4,
     "size mismatch"},

    // Tiling.
    {"Overlap",
     TwoTensors(Entry(R"("U8")", "[8]", "[0,8]"), Entry(R"("U8")", "[8]", "[4,12]")), 12,
     "tensor 'b': data_offsets [4, 12) overlap tensor 'a' at [0, 8)"},
    {"SameRange", TwoTensors(Entry(R"("U8")", "[8]", "[0,8]"), Entry(R"("U8")", "[8]", "[0,8]")),
     8, "overlap"},
    {"ZeroSizeInsideAnother",
     TwoTensors(Entry(R"("U8")", "[8]", "[0,8]"), Entry(R"("U8")", "[0]", "[4,4]")), 8,
     "tensor 'b': data_offsets [4, 4) overlap tensor 'a'"},
    {"GapBetween",
     TwoTensors(Entry(R"("U8")", "[4]", "[0,4]"), Entry(R"("U8")", "[4]", "[8,12]")), 12,
     "tensor 'b': data_offsets [8, 12) leave a gap: data section bytes [4, 8) after tensor 'a'"},
    {"GapAtStart", R"({"a":)" + Entry(R"("U8")", "[4]", "[4,8]") + "}", 8,
     "data section bytes [0, 4) after its start"},
    {"GapAfterZeroSize",
     TwoTensors(Entry(R"("U8")", "[0]", "[0,0]"), Entry(R"("U8")", "[4]", "[2,6]")), 6,
     "data section bytes [0, 2) after tensor 'a'"},
    {"DataEndsBeforeFileEnd", R"({"w":)" + Entry(R"("U8")", "[4]", "[0,4]") + "}", 8,
     "tensors end at data section byte 4 but the data section has 8 bytes"},
    {"NoTensorsButData", "{}", 1, "must end exactly at the end of the file"},
    {"OnlyMetadataButData", R"({"__metadata__":{}})", 3, "end of the file"},

    // Duplicate keys, which nlohmann::json would otherwise merge silently.
    {"DuplicateTensor",
     R"({"w":)" + Entry(R"("U8")", "[4]", "[0,4]") + R"(,"w":)" +
         Entry(R"("U8")", "[4]", "[4,8]") + "}",
     8, "duplicate key 'w' at the top level"},
    {"DuplicateField", R"({"w":{"dtype":"F32","dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 4,
     "tensor 'w': duplicate key 'dtype'"},
    {"DuplicateMetadataBlock", R"({"__metadata__":{},"__metadata__":{}})", 0,
     "duplicate key '__metadata__' at the top level"},
    {"DuplicateMetadataKey", R"({"__metadata__":{"k":"a","k":"b"}})", 0,
     "duplicate key 'k' in __metadata__"},
};

INSTANTIATE_TEST_SUITE_P(Malformed, SafetensorsRejects, ::testing::ValuesIn(kBadHeaders),
                         [](const ::testing::TestParamInfo<BadHeader>& info) {
                           return std::string(info.param.test_name);
                         });

TEST(SafetensorsParse, MessagesTruncateHugeNames) {
  const std::string name(10000, 'q');
  auto parsed = ParseJson("{\"" + name + "\":1}", 0);
  ASSERT_FALSE(parsed.ok());
  EXPECT_LT(parsed.status().message().size(), 300u) << parsed.status().message();
  EXPECT_NE(parsed.status().message().find("qqq..."), std::string::npos);
}

// Which of several damaged entries is reported does not depend on the order of the file: the
// one whose name sorts first (after a syntax error anywhere, and a repeated key anywhere).
TEST(SafetensorsParse, ReportsTheSameErrorWhateverTheEntryOrder) {
  const std::string a = R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})";
  const std::string b_bad = R"("b":{"dtype":"F17","shape":[1],"data_offsets":[4,8]})";
  const std::string c_bad = R"("c":{"dtype":"F32","shape":[1]})";
  for (const std::string& json : {"{" + a + "," + b_bad + "," + c_bad + "}",
                                  "{" + c_bad + "," + b_bad + "," + a + "}"}) {
    SCOPED_TRACE(json);
    ExpectCorruption(ParseJson(json, 8), "tensor 'b': unknown dtype 'F17'");
  }
  // A repeated key after a damaged entry still wins.
  ExpectCorruption(ParseJson("{" + c_bad + "," + a + "," + a + "}", 8), "duplicate key 'a' at the top level");
  // And a syntax error after both.
  ExpectCorruption(ParseJson("{" + c_bad + "," + a + "," + a + ",}", 8), "header is not valid JSON");
}

// Mixture-of-experts checkpoints hold tens of thousands of tensors in one file; reading and
// writing a header must stay linear in them (a DOM callback once made it quadratic: 32k
// tensors took 49 s). No time limit here (parser_bench measures), but a quadratic reader or
// writer would take minutes.
std::vector<TensorInfo> ManyTensors(size_t n) {
  std::vector<TensorInfo> tensors;
  tensors.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    tensors.push_back(TensorSpec("layers." + std::to_string(i / 256) + ".experts." + std::to_string(i % 256),
                             DType::kBF16, {1 + i % 3}));
  }
  return tensors;
}

TEST(SafetensorsParse, HeaderWithManyTensorsParses) {
  constexpr size_t kTensors = 100'000;
  std::vector<TensorInfo> tensors = ManyTensors(kTensors);
  const std::vector<uint8_t> prefix = BuildSafetensorsHeader(tensors, {{"format", "pt"}});
  Expected<SafetensorsHeader> parsed = ParseBuilt(prefix, tensors);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  SortLikeReader(tensors);
  ExpectSameTensors(parsed->tensors, tensors);
  EXPECT_EQ(parsed->metadata.at("format"), "pt");
}

TEST(SafetensorsParse, RepeatedKeyAmongManyTensorsIsFound) {
  constexpr size_t kTensors = 50'000;
  std::vector<TensorInfo> tensors = ManyTensors(kTensors);
  const std::vector<uint8_t> prefix = BuildSafetensorsHeader(tensors, {});
  std::string json(prefix.begin() + 8, prefix.end());
  while (json.back() == ' ') json.pop_back();
  // The first tensor again, at the end: a repeated top-level key.
  const std::string first = json.substr(1, json.find('}') + 1 - 1);
  const uint64_t data = tensors.back().end;
  ExpectCorruption(ParseJson(json.substr(0, json.size() - 1) + "," + first + "}", data),
                   "duplicate key 'layers.0.experts.0' at the top level");
  // A field repeated in the last entry.
  std::string repeated = json;
  repeated.insert(repeated.rfind("\"dtype\""), R"("dtype":"BF16",)");
  ExpectCorruption(ParseJson(repeated, data), "tensor 'layers.195.experts.79': duplicate key 'dtype' in its entry");
}

// ---------------------------------------------------------------------------------------------
// Robustness: random damage to a valid header must yield OK-with-invariants or an error.

TEST(SafetensorsParse, SurvivesRandomMutations) {
  std::vector<TensorInfo> tensors = {
      TensorSpec("model.embed", DType::kBF16, {8, 4}), TensorSpec("z", DType::kF32, {0}),
      TensorSpec("scale", DType::kF32, {}),            TensorSpec("ids", DType::kI64, {3}),
      TensorSpec("mask", DType::kBool, {5}),
  };
  const std::vector<uint8_t> valid = BuildSafetensorsHeader(tensors, {{"format", "pt"}});
  const uint64_t data_size = tensors.back().end;
  const uint64_t valid_file_size = valid.size() + data_size;
  ASSERT_TRUE(ParseSafetensorsHeader(valid, valid_file_size).ok());

  // Bytes that steer mutations towards interesting structure.
  static constexpr char kInteresting[] = "{}[]\",:0123456789-.e \\\x00\xff";
  const std::string_view interesting(kInteresting, sizeof(kInteresting) - 1);
  std::mt19937_64 rng(20240601);
  auto uniform = [&rng](uint64_t n) {
    return std::uniform_int_distribution<uint64_t>(0, n - 1)(rng);
  };
  int accepted = 0;
  for (int iter = 0; iter < 10000; ++iter) {
    std::vector<uint8_t> bytes = valid;
    uint64_t file_size = valid_file_size;
    const int flips = 1 + static_cast<int>(uniform(4));
    for (int f = 0; f < flips; ++f) {
      const size_t pos = uniform(bytes.size());
      switch (uniform(4)) {
        case 0: bytes[pos] ^= static_cast<uint8_t>(1u << uniform(8)); break;
        case 1: bytes[pos] = static_cast<uint8_t>(uniform(256)); break;
        case 2: bytes[pos] = static_cast<uint8_t>(interesting[uniform(interesting.size())]); break;
        default: bytes.erase(bytes.begin() + static_cast<std::ptrdiff_t>(pos)); break;
      }
    }
    switch (uniform(6)) {
      case 0: bytes.resize(uniform(bytes.size() + 1)); break;        // truncate the prefix
      case 1: file_size = uniform(valid_file_size * 2 + 1); break;   // lie about the file size
      case 2: file_size = bytes.size() + data_size; break;           // consistent with deletions
      default: break;
    }
    auto parsed = ParseSafetensorsHeader(bytes, file_size);
    if (parsed.ok()) {
      ++accepted;
      ExpectInvariants(*parsed, file_size);
    } else {
      EXPECT_EQ(parsed.status().kind(), ErrorKind::kCorruption) << parsed.status().ToString();
    }
    if (::testing::Test::HasFailure()) {
      FAIL() << "iteration " << iter;
    }
  }
  // Flipping a padding space or a digit of the metadata keeps the header valid sometimes.
  EXPECT_GT(accepted, 0);
}

// ---------------------------------------------------------------------------------------------
// CheckSafetensors: what push and commit refuse.

// A valid file of one BF16 tensor of 4 elements.
std::vector<uint8_t> ValidFile() {
  std::vector<TensorInfo> tensors = {{"w", DType::kBF16, {4}, 0, 0}};
  std::vector<uint8_t> file = BuildSafetensorsHeader(tensors, {});
  file.resize(file.size() + 8, 0x3f);
  return file;
}

Status Check(std::string_view path, const std::vector<uint8_t>& file) {
  return CheckSafetensors(path, file, file.size()).status();
}

TEST(CheckSafetensors, AValidFileAndOpaqueBytesPass) {
  EXPECT_TRUE(Check("model.safetensors", ValidFile()).ok());
  EXPECT_TRUE(Check("weights.bin", ValidFile()).ok());  // a safetensors file by another name
  // The header comes back for the chunk plan (one parse); opaque bytes have none.
  const std::vector<uint8_t> valid = ValidFile();
  Expected<std::optional<SafetensorsHeader>> parsed = CheckSafetensors("weights.bin", valid, valid.size());
  ASSERT_TRUE(parsed.ok() && parsed->has_value());
  EXPECT_EQ((*parsed)->tensors.size(), 1u);
  const std::vector<uint8_t> text = {'{', '"', 'a', '"', ':', '1', '}'};
  EXPECT_TRUE(Check("config.json", text).ok());
  EXPECT_TRUE(Check("notes.txt", {}).ok());
  std::vector<uint8_t> noise(4096);
  std::mt19937 rng(7);
  for (uint8_t& b : noise) b = static_cast<uint8_t>(rng());
  EXPECT_TRUE(Check("optimizer.pt", noise).ok());
  EXPECT_FALSE(CheckSafetensors("optimizer.pt", noise, noise.size())->has_value());
}

TEST(CheckSafetensors, ATruncatedFileIsRefusedByItsNameOrItsHeader) {
  std::vector<uint8_t> file = ValidFile();
  file.resize(file.size() - 3);  // the data section cut short
  Status named = Check("model-00001-of-00002.safetensors", file);
  ASSERT_FALSE(named.ok());
  EXPECT_EQ(named.kind(), ErrorKind::kInvalidArgument);
  EXPECT_NE(named.message().find("model-00001-of-00002.safetensors is not a valid safetensors file (by its name): "),
            std::string::npos)
      << named.message();
  Status unnamed = Check("shard.bin", file);
  ASSERT_FALSE(unnamed.ok());
  EXPECT_NE(unnamed.message().find("(by its first bytes)"), std::string::npos) << unnamed.message();
  // Cut inside the header: said so by name only (the first bytes no longer fit the file).
  file.resize(20);
  Status header_cut = Check("model.safetensors", file);
  ASSERT_FALSE(header_cut.ok());
  EXPECT_NE(header_cut.message().find("truncated?"), std::string::npos) << header_cut.message();
  EXPECT_TRUE(Check("shard.bin", file).ok());
  EXPECT_FALSE(Check("model.safetensors", std::vector<uint8_t>{1, 2, 3}).ok());
  EXPECT_FALSE(Check("model.safetensors", {}).ok());
}

TEST(CheckSafetensors, AHeaderThatDoesNotParseOrLiesIsRefused) {
  auto with_json = [](std::string_view json, size_t data) {
    std::vector<uint8_t> file = Prefix(json);
    file.resize(file.size() + data, 0);
    return file;
  };
  Status garbage = Check("model.safetensors", with_json("{\"w\": {\"dtype\": ", 8));
  ASSERT_FALSE(garbage.ok());
  EXPECT_NE(garbage.message().find("its header: "), std::string::npos) << garbage.message();
  // Offsets past the end of the file.
  EXPECT_FALSE(
      Check("model.safetensors", with_json(R"({"w":{"dtype":"BF16","shape":[4],"data_offsets":[0,64]}})", 8)).ok());
  // Two tensors over the same bytes.
  Status overlap = Check("model.safetensors", with_json(R"({"a":{"dtype":"BF16","shape":[4],"data_offsets":[0,8]},)"
                                                          R"("b":{"dtype":"BF16","shape":[4],"data_offsets":[0,8]}})",
                                                          8));
  EXPECT_FALSE(overlap.ok());
  // Shape and offsets that disagree.
  EXPECT_FALSE(
      Check("x.safetensors", with_json(R"({"w":{"dtype":"BF16","shape":[3],"data_offsets":[0,8]}})", 8)).ok());
}

}  // namespace
}  // namespace weightfs

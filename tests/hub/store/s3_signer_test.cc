// SigV4 against the vectors AWS publishes: the SigV4 test suite (get-vanilla,
// get-vanilla-query-order-key, get-header-value-trim) and the four worked examples of the S3 API
// reference ("Signature Calculations for the Authorization Header": GET Object with Range, PUT
// Object, GET Bucket Lifecycle, GET Bucket (List Objects)).
#include "hub/store/s3_signer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <string>

#include "core/hash.h"

namespace weightfs {
namespace {

using std::chrono::system_clock;

constexpr const char* kEmptySha256 =
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

AwsCredentials SuiteCredentials() {
  return AwsCredentials{"AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "", "test"};
}
AwsCredentials S3DocCredentials() {
  return AwsCredentials{"AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "", "test"};
}

// 2013-05-24T00:00:00Z, the time of the S3 documentation's examples.
system_clock::time_point S3DocTime() { return system_clock::from_time_t(1369353600); }

std::string HeaderOf(const HttpRequest& r, std::string_view name) {
  for (const auto& [k, v] : r.headers) {
    if (k.size() == name.size() &&
        std::equal(k.begin(), k.end(), name.begin(), [](char a, char b) {
          return std::tolower(static_cast<unsigned char>(a)) == std::tolower(static_cast<unsigned char>(b));
        })) {
      return v;
    }
  }
  return "";
}

TEST(S3SignerTest, SuiteGetVanilla) {
  SigV4Params p;
  p.method = "GET";
  p.host = "example.amazonaws.com";
  p.path = "/";
  p.headers = {{"X-Amz-Date", "20150830T123600Z"}};
  p.payload_sha256 = kEmptySha256;
  p.amz_date = "20150830T123600Z";
  p.region = "us-east-1";
  p.service = "service";
  const SigV4Signature s = ComputeSigV4(p, SuiteCredentials());
  EXPECT_EQ(s.canonical_request,
            "GET\n/\n\nhost:example.amazonaws.com\nx-amz-date:20150830T123600Z\n\n"
            "host;x-amz-date\n" + std::string(kEmptySha256));
  EXPECT_EQ(s.string_to_sign,
            "AWS4-HMAC-SHA256\n20150830T123600Z\n20150830/us-east-1/service/aws4_request\n"
            "bb579772317eb040ac9ed261061d46c1f17a8133879d6129b6e1c25292927e63");
  EXPECT_EQ(s.authorization,
            "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, "
            "SignedHeaders=host;x-amz-date, "
            "Signature=5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31");
}

TEST(S3SignerTest, SuiteQueryParametersAreSortedByName) {
  SigV4Params p;
  p.method = "GET";
  p.host = "example.amazonaws.com";
  p.path = "/";
  p.query = "Param2=value2&Param1=value1";
  p.headers = {{"X-Amz-Date", "20150830T123600Z"}};
  p.payload_sha256 = kEmptySha256;
  p.amz_date = "20150830T123600Z";
  p.region = "us-east-1";
  p.service = "service";
  const SigV4Signature s = ComputeSigV4(p, SuiteCredentials());
  EXPECT_NE(s.canonical_request.find("\nParam1=value1&Param2=value2\n"), std::string::npos);
  EXPECT_EQ(s.signature, "b97d918cfa904a5beff61c982a1b6f458b799221646efd99d3219ec94cdf2500");
}

TEST(S3SignerTest, SuiteHeaderValuesAreTrimmedAndRepeatedNamesJoined) {
  SigV4Params p;
  p.method = "GET";
  p.host = "example.amazonaws.com";
  p.headers = {{"My-Header1", " value1"},
               {"My-Header2", " \"a   b   c\""},
               {"my-header3", "x"},
               {"My-Header3", "y"},
               {"X-Amz-Date", "20150830T123600Z"}};
  p.payload_sha256 = kEmptySha256;
  p.amz_date = "20150830T123600Z";
  p.region = "us-east-1";
  p.service = "service";
  const SigV4Signature s = ComputeSigV4(p, SuiteCredentials());
  EXPECT_EQ(s.canonical_request,
            "GET\n/\n\nhost:example.amazonaws.com\nmy-header1:value1\nmy-header2:\"a b c\"\n"
            "my-header3:x,y\nx-amz-date:20150830T123600Z\n\n"
            "host;my-header1;my-header2;my-header3;x-amz-date\n" + std::string(kEmptySha256));
}

// The S3 examples go through SigV4Signer::Sign, the path the store uses: URL parsing, the
// x-amz-* headers it adds and the Authorization header it writes.
TEST(S3SignerTest, S3DocGetObjectWithRange) {
  SigV4Signer signer(S3DocCredentials(), "us-east-1");
  HttpRequest r;
  r.method = "GET";
  r.url = "https://examplebucket.s3.amazonaws.com/test.txt";
  r.headers = {{"Range", "bytes=0-9"}};
  signer.Sign(r, kEmptySha256, S3DocTime());
  EXPECT_EQ(HeaderOf(r, "x-amz-date"), "20130524T000000Z");
  EXPECT_EQ(HeaderOf(r, "x-amz-content-sha256"), kEmptySha256);
  EXPECT_EQ(HeaderOf(r, "authorization"),
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
            "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
            "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41");
}

TEST(S3SignerTest, S3DocPutObjectWithEncodedKey) {
  const std::string body = "Welcome to Amazon S3.";
  const std::string body_sha = Sha256Hex(
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(body.data()), body.size()));
  ASSERT_EQ(body_sha, "44ce7dd67c959e0d3524ffac1771dfbba87d2b6b4b4e99e42034a8b803f8b072");
  SigV4Signer signer(S3DocCredentials(), "us-east-1");
  HttpRequest r;
  r.method = "PUT";
  r.url = "https://examplebucket.s3.amazonaws.com/" + AwsUriEncode("test$file.text", true);
  EXPECT_EQ(r.url, "https://examplebucket.s3.amazonaws.com/test%24file.text");
  r.headers = {{"Date", "Fri, 24 May 2013 00:00:00 GMT"},
               {"x-amz-storage-class", "REDUCED_REDUNDANCY"}};
  signer.Sign(r, body_sha, S3DocTime());
  EXPECT_EQ(HeaderOf(r, "authorization"),
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
            "SignedHeaders=date;host;x-amz-content-sha256;x-amz-date;x-amz-storage-class, "
            "Signature=98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd");
}

TEST(S3SignerTest, S3DocGetBucketLifecycleValuelessParameter) {
  SigV4Signer signer(S3DocCredentials(), "us-east-1");
  HttpRequest r;
  r.url = "https://examplebucket.s3.amazonaws.com/?lifecycle";
  signer.Sign(r, kEmptySha256, S3DocTime());
  EXPECT_NE(HeaderOf(r, "authorization")
                .find("Signature=fea454ca298b7da1c68078a5d1bdbfbbe0d65c699e0f91ac7a200a0136783543"),
            std::string::npos)
      << HeaderOf(r, "authorization");
}

TEST(S3SignerTest, S3DocListObjectsQuery) {
  SigV4Signer signer(S3DocCredentials(), "us-east-1");
  HttpRequest r;
  r.url = "https://examplebucket.s3.amazonaws.com/?max-keys=2&prefix=J";
  signer.Sign(r, kEmptySha256, S3DocTime());
  EXPECT_NE(HeaderOf(r, "authorization")
                .find("Signature=34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7"),
            std::string::npos)
      << HeaderOf(r, "authorization");
}

TEST(S3SignerTest, ResigningReplacesEarlierSignatureHeadersAndAddsSessionToken) {
  AwsCredentials c = S3DocCredentials();
  c.session_token = "token-value";
  SigV4Signer signer(c, "us-east-1");
  HttpRequest r;
  r.url = "https://examplebucket.s3.amazonaws.com/test.txt";
  signer.Sign(r, kEmptySha256, S3DocTime());
  const std::string first = HeaderOf(r, "authorization");
  signer.Sign(r, kEmptySha256, S3DocTime() + std::chrono::seconds(5));
  const std::string second = HeaderOf(r, "authorization");
  EXPECT_NE(first, second);
  EXPECT_EQ(HeaderOf(r, "x-amz-date"), "20130524T000005Z");
  EXPECT_EQ(HeaderOf(r, "x-amz-security-token"), "token-value");
  EXPECT_NE(second.find("SignedHeaders=host;x-amz-content-sha256;x-amz-date;x-amz-security-token,"),
            std::string::npos)
      << second;
  int auth_headers = 0, tokens = 0;
  for (const auto& [k, v] : r.headers) {
    auth_headers += k == "Authorization";
    tokens += k == "x-amz-security-token";
  }
  EXPECT_EQ(auth_headers, 1);
  EXPECT_EQ(tokens, 1);
  ASSERT_EQ(r.sensitive_headers.size(), 1u);
  EXPECT_EQ(r.sensitive_headers[0], "x-amz-security-token");
  // The secret never appears in what the request carries.
  for (const auto& [k, v] : r.headers) EXPECT_EQ(v.find(c.secret_access_key), std::string::npos);
}

TEST(S3SignerTest, HostHeaderFollowsCurlPortRules) {
  EXPECT_EQ(SplitUrl("http://127.0.0.1:4568/bucket/key?x=1").host, "127.0.0.1:4568");
  EXPECT_EQ(SplitUrl("http://127.0.0.1:4568/bucket/key?x=1").path, "/bucket/key");
  EXPECT_EQ(SplitUrl("http://127.0.0.1:4568/bucket/key?x=1").query, "x=1");
  EXPECT_EQ(SplitUrl("http://Host.Example:80/a").host, "host.example");
  EXPECT_EQ(SplitUrl("https://host.example:443").host, "host.example");
  EXPECT_EQ(SplitUrl("https://host.example:443").path, "");
  EXPECT_EQ(SplitUrl("https://host.example:8443/").host, "host.example:8443");
  EXPECT_EQ(SplitUrl("http://[::1]:9000/b").host, "[::1]:9000");
  EXPECT_EQ(SplitUrl("http://[::1]/b").host, "[::1]");
}

TEST(S3SignerTest, UriEncodingIsStrictRfc3986) {
  EXPECT_EQ(AwsUriEncode("a-b_c.d~e/f g+h@i=j", true), "a-b_c.d~e/f%20g%2Bh%40i%3Dj");
  EXPECT_EQ(AwsUriEncode("a/b", false), "a%2Fb");
  EXPECT_EQ(AwsUriEncode("\xc3\xa9", false), "%C3%A9");
}

TEST(S3SignerTest, EncodedQueryValuesAreCanonicalisedOnce) {
  // "prefix=a/b c" sent as a%2Fb%20c and as a/b%20c must sign the same.
  SigV4Params p;
  p.method = "GET";
  p.host = "h";
  p.payload_sha256 = kEmptySha256;
  p.amz_date = "20150830T123600Z";
  p.region = "us-east-1";
  p.service = "s3";
  p.query = "prefix=a%2Fb%20c&list-type=2";
  const std::string a = ComputeSigV4(p, SuiteCredentials()).canonical_request;
  p.query = "list-type=2&prefix=a/b%20c";
  const std::string b = ComputeSigV4(p, SuiteCredentials()).canonical_request;
  EXPECT_EQ(a, b);
  EXPECT_NE(a.find("\nlist-type=2&prefix=a%2Fb%20c\n"), std::string::npos) << a;
}

}  // namespace
}  // namespace weightfs

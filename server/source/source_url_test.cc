#include "server/source/source_url.h"

#include <gtest/gtest.h>

namespace weightd {
namespace {

TEST(SourceUrl, ParsesAndNormalises) {
  auto u = ParseSourceUrl("S3://Models/llama/model.safetensors");
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(u->scheme, SourceScheme::kS3);
  EXPECT_EQ(u->host, "models");
  EXPECT_EQ(u->path, "llama/model.safetensors");
  EXPECT_EQ(u->normalized, "s3://models/llama/model.safetensors");
  EXPECT_FALSE(u->is_directory());

  auto h = ParseSourceUrl("HTTPS://Hub.Example.COM:443/a%20b/x.safetensors");
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->host, "hub.example.com");
  EXPECT_EQ(h->port, 0);
  EXPECT_EQ(h->path, "a b/x.safetensors");
  EXPECT_EQ(h->normalized, "https://hub.example.com/a%20b/x.safetensors");

  auto p = ParseSourceUrl("http://127.0.0.1:8080/m/");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->port, 8080);
  EXPECT_TRUE(p->is_directory());
  EXPECT_EQ(p->normalized, "http://127.0.0.1:8080/m/");
  // Unreserved characters escaped needlessly come out plain.
  EXPECT_EQ(ParseSourceUrl("s3://models/%6Dodel.safetensors")->normalized,
            "s3://models/model.safetensors");
}

TEST(SourceUrl, RefusesHostileForms) {
  const char* hostile[] = {
      "s3://user:secret@models/x.safetensors",       // userinfo
      "https://user@hub.example/x.safetensors",      // userinfo
      "https://hub.example/a/../b/x.safetensors",    // ..
      "https://hub.example/a/%2e%2e/x.safetensors",  // encoded ..
      "https://hub.example/a/./x.safetensors",       // .
      "https://hub.example/a%2Fb.safetensors",       // encoded slash
      "https://hub.example/a%2fb.safetensors",
      "https://hub.example/a%5Cb.safetensors",       // encoded backslash
      "https://hub.example/a%252Fb.safetensors",     // double encoding
      "https://hub.example/a%00.safetensors",        // NUL
      "https://hub.example/a%zz.safetensors",        // malformed escape
      "https://hub.example/a%2",                     // truncated escape
      "https://hub.example/a\\b.safetensors",        // backslash
      "https://hub.example/a//b.safetensors",        // empty segment
      "https://hub.example/x.safetensors?x=1",       // query
      "https://hub.example/x.safetensors#frag",      // fragment
      "file:///etc/passwd",                          // other schemes
      "ftp://hub.example/x",
      "gopher://hub.example/x",
      "https://hüb.example/x",             // IDN, not in xn-- form
      "https://hub example/x",                       // space
      "https://hub.example:0/x",                     // port 0
      "https://hub.example:99999/x",                 // port range
      "https://hub.example:80a/x",
      "s3://models:9000/x",                          // port on s3
      "s3://Mo_dels/x",                              // not a bucket name
      "s3://ab/x",                                   // too short a bucket
      "https://hub%2eexample/x",                     // escape in the host
      "https:///x",                                  // no host
      "/models/x.safetensors",                       // a path
  };
  for (const char* url : hostile) {
    auto u = ParseSourceUrl(url);
    EXPECT_TRUE(absl::IsInvalidArgument(u.status())) << url << " -> "
                                                      << (u.ok() ? u->normalized : "error");
  }
}

TEST(SourceUrl, AllowListMatchesWholeSegments) {
  auto list = SourceAllowList::Create({"s3://models", "https://hub.example/org/"});
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_TRUE(list->Check("s3://models/x.safetensors").ok());
  EXPECT_TRUE(list->Check("S3://MODELS/a/b/").ok());
  EXPECT_TRUE(list->Check("https://HUB.example:443/org/m/model.safetensors.index.json").ok());
  const char* outside[] = {
      "s3://models-evil/x.safetensors",
      "s3://other/x.safetensors",
      "https://hub.example/org2/x.safetensors",
      "https://hub.example/x.safetensors",
      "https://hub.example.evil/org/x.safetensors",
      "https://hub.example:8443/org/x.safetensors",
      "http://hub.example/org/x.safetensors",  // http only when a prefix says http://
      "https://hub.example/org/../secret/x",
      "https://hub.example/org/%2E%2E/secret/x",
      "https://me:pw@hub.example/org/x",
  };
  for (const char* url : outside) {
    absl::Status s = list->Check(url).status();
    EXPECT_TRUE(absl::IsPermissionDenied(s)) << url << ": " << s;
    EXPECT_NE(s.message().find("is outside the model sources [s3://models/, "
                               "https://hub.example/org/]"),
              std::string::npos)
        << s;
  }
  // Userinfo is never echoed.
  absl::Status s = list->Check("https://me:pw@hub.example/org/x").status();
  EXPECT_EQ(s.message().find("pw"), std::string::npos) << s;

  auto none = SourceAllowList::Create({});
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(absl::IsPermissionDenied(none->Check("s3://models/x").status()));
  EXPECT_TRUE(absl::IsInvalidArgument(SourceAllowList::Create({"ftp://x/"}).status()));
}

TEST(SourceUrl, HttpOnlyWhereAPrefixSaysSo) {
  auto list = SourceAllowList::Create({"http://127.0.0.1:8080/m/"});
  ASSERT_TRUE(list.ok());
  EXPECT_TRUE(list->Check("http://127.0.0.1:8080/m/x.safetensors").ok());
  EXPECT_TRUE(absl::IsPermissionDenied(
      list->Check("https://127.0.0.1:8080/m/x.safetensors").status()));
  EXPECT_TRUE(absl::IsPermissionDenied(list->Check("http://127.0.0.1:8081/m/x").status()));
}

TEST(SourceUrl, ResolvesNamesBesideAFileOrInADirectory) {
  auto index = ParseSourceUrl("https://hub.example/org/m/model.safetensors.index.json");
  ASSERT_TRUE(index.ok());
  auto shard = ResolveSourceName(*index, "model-00001-of-00002.safetensors");
  ASSERT_TRUE(shard.ok()) << shard.status();
  EXPECT_EQ(shard->normalized, "https://hub.example/org/m/model-00001-of-00002.safetensors");
  auto dir = ParseSourceUrl("s3://models/m/");
  auto in = ResolveSourceName(*dir, "sub/a b.safetensors");
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(in->normalized, "s3://models/m/sub/a%20b.safetensors");
  for (const char* bad : {"../x.safetensors", "/etc/passwd", "https://evil/x", "a/../../x",
                          "a%2F..", "x?y", "x#y", "a\\b", "", "./x", "a//b", "d/"}) {
    EXPECT_TRUE(absl::IsInvalidArgument(ResolveSourceName(*index, bad).status())) << bad;
  }
}

TEST(SourceUrl, LooksLikeUrl) {
  EXPECT_TRUE(LooksLikeUrl("s3://b/k"));
  EXPECT_TRUE(LooksLikeUrl("HTTPS://h/"));
  EXPECT_TRUE(LooksLikeUrl("file:///x"));
  EXPECT_FALSE(LooksLikeUrl("/models/a://b"));
  EXPECT_FALSE(LooksLikeUrl("models/x.safetensors"));
  EXPECT_FALSE(LooksLikeUrl("://x"));
}

TEST(SourceUrl, UrlForMessageHidesUserinfo) {
  EXPECT_EQ(UrlForMessage("https://u:secret@h/x"), "\"https://***@h/x\"");
  EXPECT_EQ(UrlForMessage("s3://b/k@v"), "\"s3://b/k@v\"");
}

}  // namespace
}  // namespace weightd

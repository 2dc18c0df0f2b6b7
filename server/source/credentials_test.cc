#include "server/source/credentials.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <memory>

#include "absl/strings/str_cat.h"

namespace weightd {
namespace {

using Vars = std::map<std::string, std::string>;

EnvLookup EnvOf(Vars vars) {
  auto held = std::make_shared<const Vars>(std::move(vars));
  return [held](const char* name) -> const char* {
    auto it = held->find(name);
    return it == held->end() ? nullptr : it->second.c_str();
  };
}

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/weightd_creds_XXXXXX";
    path_ = mkdtemp(tmpl);
  }
  ~TempDir() { (void)system(absl::StrCat("rm -rf ", path_).c_str()); }
  std::string Write(const std::string& name, const std::string& text) const {
    std::string p = absl::StrCat(path_, "/", name);
    std::ofstream(p) << text;
    return p;
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(S3Credentials, EnvironmentFirst) {
  TempDir dir;
  std::string file = dir.Write("credentials", "[default]\naws_access_key_id = FILEKEY\n"
                                              "aws_secret_access_key = FILESECRET\n");
  EnvLookup env = EnvOf(Vars{{"AWS_ACCESS_KEY_ID", "ENVKEY"},
           {"AWS_SECRET_ACCESS_KEY", "ENVSECRET"},
           {"AWS_SESSION_TOKEN", "TOKEN"},
           {"AWS_SHARED_CREDENTIALS_FILE", file}});
  auto c = FindS3Credentials(env);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(c->has_value());
  EXPECT_EQ((*c)->access_key_id, "ENVKEY");
  EXPECT_EQ((*c)->secret_access_key, "ENVSECRET");
  EXPECT_EQ((*c)->session_token, "TOKEN");
  EXPECT_EQ((*c)->origin, "S3 credentials from environment (AWS_ACCESS_KEY_ID)");
}

TEST(S3Credentials, SharedFileAndProfile) {
  TempDir dir;
  std::string file = dir.Write("credentials",
                               "# comment\n[default]\naws_access_key_id=DKEY\n"
                               "aws_secret_access_key=DSECRET\n\n[ci]\n"
                               "AWS_ACCESS_KEY_ID = CIKEY\naws_secret_access_key = CISECRET\n"
                               "aws_session_token = CITOKEN\n");
  auto d = FindS3Credentials(EnvOf(Vars{{"AWS_SHARED_CREDENTIALS_FILE", file}}));
  ASSERT_TRUE(d.ok() && d->has_value()) << d.status();
  EXPECT_EQ((*d)->access_key_id, "DKEY");
  EXPECT_EQ((*d)->origin, absl::StrCat("S3 credentials from ", file, " [default]"));
  auto ci = FindS3Credentials(
      EnvOf(Vars{{"AWS_SHARED_CREDENTIALS_FILE", file}, {"AWS_PROFILE", "ci"}}));
  ASSERT_TRUE(ci.ok() && ci->has_value()) << ci.status();
  EXPECT_EQ((*ci)->access_key_id, "CIKEY");
  EXPECT_EQ((*ci)->secret_access_key, "CISECRET");
  EXPECT_EQ((*ci)->session_token, "CITOKEN");
  // The home directory's file by default.
  std::string home = dir.path();
  ASSERT_EQ(system(absl::StrCat("mkdir -p ", home, "/.aws && cp ", file, " ", home,
                                "/.aws/credentials").c_str()), 0);
  auto h = FindS3Credentials(EnvOf(Vars{{"HOME", home}}));
  ASSERT_TRUE(h.ok() && h->has_value()) << h.status();
  EXPECT_EQ((*h)->access_key_id, "DKEY");
}

TEST(S3Credentials, NoneIsUnsigned) {
  TempDir dir;
  auto none = FindS3Credentials(EnvOf(Vars{{"HOME", dir.path()}}));
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->has_value());
  std::string file = dir.Write("credentials", "[other]\naws_access_key_id=K\n"
                                              "aws_secret_access_key=S\n");
  auto missing_profile = FindS3Credentials(EnvOf(Vars{{"AWS_SHARED_CREDENTIALS_FILE", file}}));
  ASSERT_TRUE(missing_profile.ok());
  EXPECT_FALSE(missing_profile->has_value());
}

TEST(S3Credentials, HalfAPairIsRefusedWithoutTheValue) {
  auto env = FindS3Credentials(EnvOf(Vars{{"AWS_ACCESS_KEY_ID", "LONELYKEY"}}));
  EXPECT_TRUE(absl::IsInvalidArgument(env.status())) << env.status();
  EXPECT_EQ(env.status().message().find("LONELYKEY"), std::string::npos);
  TempDir dir;
  std::string file = dir.Write("credentials", "[default]\naws_access_key_id=FILEKEY\n");
  auto f = FindS3Credentials(EnvOf(Vars{{"AWS_SHARED_CREDENTIALS_FILE", file}}));
  EXPECT_TRUE(absl::IsInvalidArgument(f.status())) << f.status();
  EXPECT_EQ(f.status().message().find("FILEKEY"), std::string::npos);
}

TEST(BearerToken, ReadsTrimmedAndRefusesJunk) {
  TempDir dir;
  auto t = ReadBearerToken(dir.Write("token", "  abc.def-123\n"));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*t, "abc.def-123");
  auto spaced = ReadBearerToken(dir.Write("bad", "abc def\n"));
  EXPECT_TRUE(absl::IsInvalidArgument(spaced.status()));
  EXPECT_EQ(spaced.status().message().find("abc"), std::string::npos);
  EXPECT_TRUE(absl::IsInvalidArgument(ReadBearerToken(dir.Write("empty", "\n")).status()));
  EXPECT_TRUE(absl::IsNotFound(ReadBearerToken(dir.path() + "/none").status()));
}

}  // namespace
}  // namespace weightd

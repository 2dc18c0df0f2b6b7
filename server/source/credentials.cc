#include "server/source/credentials.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/fd.h"
#include "common/status_macros.h"

namespace weightd {
namespace {

constexpr size_t kMaxCredentialsFileBytes = 1 << 20;
constexpr size_t kMaxTokenBytes = 16 << 10;

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, size_t cap) {
  return ReadFileToString(path, cap);
}

std::string Env(const EnvLookup& env, const char* name) {
  const char* v = env(name);
  return v == nullptr ? "" : std::string(v);
}

}  // namespace

absl::StatusOr<std::optional<S3Credentials>> FindS3Credentials(const EnvLookup& env) {
  S3Credentials c;
  c.access_key_id = Env(env, "AWS_ACCESS_KEY_ID");
  c.secret_access_key = Env(env, "AWS_SECRET_ACCESS_KEY");
  if (!c.access_key_id.empty() || !c.secret_access_key.empty()) {
    if (c.access_key_id.empty() || c.secret_access_key.empty()) {
      return absl::InvalidArgumentError(
          "the environment sets only one of AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY");
    }
    c.session_token = Env(env, "AWS_SESSION_TOKEN");
    c.origin = "S3 credentials from environment (AWS_ACCESS_KEY_ID)";
    return c;
  }
  std::string path = Env(env, "AWS_SHARED_CREDENTIALS_FILE");
  if (path.empty()) {
    std::string home = Env(env, "HOME");
    if (home.empty()) return std::nullopt;
    path = absl::StrCat(home, "/.aws/credentials");
  }
  std::string profile = Env(env, "AWS_PROFILE");
  if (profile.empty()) profile = "default";
  absl::StatusOr<std::string> text = ReadSmallFile(path, kMaxCredentialsFileBytes);
  if (!text.ok()) {
    if (absl::IsNotFound(text.status())) return std::nullopt;
    return absl::InvalidArgumentError(
        absl::StrCat("S3 credentials file ", path, " cannot be read: ", text.status().message()));
  }
  // The INI format of the AWS CLI: [profile] sections, key = value lines,
  // '#' and ';' comments.
  bool in_profile = false;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#' || line[0] == ';') continue;
    if (line.front() == '[') {
      absl::string_view name = line.substr(1, line.find(']') == absl::string_view::npos
                                                  ? absl::string_view::npos
                                                  : line.find(']') - 1);
      in_profile = absl::StripAsciiWhitespace(name) == profile;
      continue;
    }
    if (!in_profile) continue;
    size_t eq = line.find('=');
    if (eq == absl::string_view::npos) continue;
    std::string key = absl::AsciiStrToLower(absl::StripAsciiWhitespace(line.substr(0, eq)));
    std::string value(absl::StripAsciiWhitespace(line.substr(eq + 1)));
    if (key == "aws_access_key_id") c.access_key_id = value;
    if (key == "aws_secret_access_key") c.secret_access_key = value;
    if (key == "aws_session_token") c.session_token = value;
  }
  if (c.access_key_id.empty() && c.secret_access_key.empty()) return std::nullopt;
  c.origin = absl::StrCat("S3 credentials from ", path, " [", profile, "]");
  if (c.access_key_id.empty() || c.secret_access_key.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        c.origin, " has only one of aws_access_key_id and aws_secret_access_key"));
  }
  return c;
}

absl::StatusOr<std::string> ReadBearerToken(const std::string& path) {
  absl::StatusOr<std::string> text = ReadSmallFile(path, kMaxTokenBytes + 64);
  if (!text.ok()) return text.status();
  std::string token(absl::StripAsciiWhitespace(*text));
  if (token.empty() || token.size() > kMaxTokenBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("bearer token file ", path, " is empty or longer than ", kMaxTokenBytes,
                     " bytes"));
  }
  for (unsigned char ch : token) {
    if (ch <= 0x20 || ch >= 0x7f) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bearer token in ", path, " holds a space, control or non-ASCII byte"));
    }
  }
  return token;
}

}  // namespace weightd

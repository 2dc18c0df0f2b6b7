// Where a source request's credentials come from: S3 keys from the
// daemon's environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
// AWS_SESSION_TOKEN) or else the shared credentials file
// (AWS_SHARED_CREDENTIALS_FILE, default ~/.aws/credentials; profile
// AWS_PROFILE or "default"); a bearer token for https sources from a file.
// Read again for every load, so rotated keys and tokens are picked up.
// Secrets are never logged or put in a message: `origin` says where they
// came from, for the messages of 401/403 answers. Thread-safe (pure
// functions over the environment and files).
#ifndef WEIGHTD_SERVER_SOURCE_CREDENTIALS_H_
#define WEIGHTD_SERVER_SOURCE_CREDENTIALS_H_

#include <functional>
#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace weightd {

// getenv(3) in the daemon; a table in tests. Returns null when unset.
using EnvLookup = std::function<const char*(const char*)>;

struct S3Credentials {
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;  // empty: none
  // e.g. "S3 credentials from environment (AWS_ACCESS_KEY_ID)" or "S3
  // credentials from /root/.aws/credentials [default]". Names, never values.
  std::string origin;
};

// The S3 credentials to sign with, or nullopt (requests go unsigned) when
// neither the environment nor the file has any. INVALID_ARGUMENT for an
// access key without its secret (in either place), or a file that exists
// but cannot be read, naming the place, never the value.
absl::StatusOr<std::optional<S3Credentials>> FindS3Credentials(const EnvLookup& env);

// The token in `path` (surrounding whitespace trimmed). INVALID_ARGUMENT
// for an empty token, one over 16 KiB, or one with a control character or
// space; the errno's status for a file that cannot be read. Messages name
// the path, never the token.
absl::StatusOr<std::string> ReadBearerToken(const std::string& path);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_SOURCE_CREDENTIALS_H_

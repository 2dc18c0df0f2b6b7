// Remote checkpoint sources: URLs (s3://bucket/key, https://host/path,
// http:// where an allow-list prefix names it), parsed into one normal form
// and confined to the daemon's --model-source prefixes before any request is
// made (no SSRF through the daemon). Pure functions and a const allow-list;
// thread-safe.
#ifndef WEIGHTD_SERVER_SOURCE_SOURCE_URL_H_
#define WEIGHTD_SERVER_SOURCE_SOURCE_URL_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace weightd {

enum class SourceScheme { kS3, kHttps, kHttp };

// A parsed, normalised URL.
struct SourceUrl {
  SourceScheme scheme = SourceScheme::kHttps;
  // Lowercase; the bucket for s3://. An IPv6 literal keeps its brackets.
  std::string host;
  int port = 0;  // 0: the scheme's default (never 443 for https, 80 for http)
  // The object's key or the path, percent-decoded, without the leading '/'
  // ("" for the bucket or host itself). Ends with '/' for a directory
  // (prefix).
  std::string path;
  // scheme://host[:port]/path with the path percent-encoded canonically
  // (RFC 3986 unreserved characters and '/' as they are, every other byte
  // %XX): the form the allow-list, the journal and the checkpoint key use.
  std::string normalized;

  bool is_directory() const { return path.empty() || path.back() == '/'; }
};

// True for a string of the form scheme://... (a scheme of letters, digits,
// '+', '-', '.'): a URL, never a file path (those start with '/').
bool LooksLikeUrl(absl::string_view s);

// Parses and normalises `url`: scheme s3, https or http (case-insensitive);
// the host lowercased, ASCII only (an IDN host in its xn-- form); a port
// for http(s) only; the path's %XX decoded once. INVALID_ARGUMENT (the
// reason, never the URL: the caller names it) for anything else: userinfo
// ("user@host"), a query or fragment, a backslash, a control, space or
// non-ASCII byte, "." or ".." or empty path segments, an encoded '/', '\',
// '%' or control byte, a malformed %-escape, an s3 bucket that is not a
// bucket name.
absl::StatusOr<SourceUrl> ParseSourceUrl(absl::string_view url);

// `decoded` percent-encoded canonically; with `keep_slash` false '/' is
// encoded too (a query value).
std::string PercentEncode(absl::string_view decoded, bool keep_slash = true);

// `url` for a message: its userinfo (anything between "://" and an '@'
// before the path) replaced by "***", quoted and capped (QuoteForMessage).
std::string UrlForMessage(absl::string_view url);

// The URL of `name` (a relative name from an index or a listing) in the
// directory of `base` (base itself when it is a directory). The name is
// one or more plain segments: INVALID_ARGUMENT for an absolute name, a
// scheme, "." or "..", a query, a backslash, '%' or a control byte.
absl::StatusOr<SourceUrl> ResolveSourceName(const SourceUrl& base, absl::string_view name);

// The --model-source prefixes. A prefix is a URL in normal form; one that
// does not end with '/' covers itself and what lies beneath it as a
// directory ("s3://models" covers s3://models/x, never s3://models-evil/x).
class SourceAllowList {
 public:
  // INVALID_ARGUMENT naming a prefix that does not parse.
  static absl::StatusOr<SourceAllowList> Create(const std::vector<std::string>& prefixes);
  SourceAllowList() = default;

  // `url` parsed and normalised when a prefix covers it, else
  // PERMISSION_DENIED `url "U" is outside the model sources [P, ...]` (with
  // the parse error's reason when it does not parse).
  absl::StatusOr<SourceUrl> Check(absl::string_view url) const;
  bool Covers(const SourceUrl& url) const;
  const std::vector<std::string>& prefixes() const { return prefixes_; }

 private:
  absl::Status Outside(absl::string_view url, absl::string_view why) const;

  // Constant after construction: normalised prefixes.
  std::vector<std::string> prefixes_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_SOURCE_SOURCE_URL_H_

#include "server/source/source_url.h"

#include <cctype>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/untrusted_text.h"

namespace weightd {
namespace {

constexpr size_t kMaxUrlBytes = 4096;

bool Unreserved(unsigned char c) {
  return std::isalnum(c) || c == '-' || c == '.' || c == '_' || c == '~';
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// The path's %XX decoded once; the bytes an escape may not produce refused.
absl::StatusOr<std::string> DecodePath(absl::string_view raw) {
  std::string out;
  out.reserve(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) {
    unsigned char c = static_cast<unsigned char>(raw[i]);
    if (c != '%') {
      out.push_back(static_cast<char>(c));
      continue;
    }
    int hi = i + 1 < raw.size() ? HexValue(raw[i + 1]) : -1;
    int lo = i + 2 < raw.size() ? HexValue(raw[i + 2]) : -1;
    if (hi < 0 || lo < 0) return absl::InvalidArgumentError("a malformed %-escape in the path");
    unsigned char d = static_cast<unsigned char>(hi * 16 + lo);
    if (d == '/' || d == '\\' || d == '%' || d < 0x20 || d == 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat("an encoded '/', '\\', '%' or control byte (%", absl::AsciiStrToUpper(
                                                                           raw.substr(i + 1, 2)),
                       ") in the path"));
    }
    out.push_back(static_cast<char>(d));
    i += 2;
  }
  return out;
}

// Every segment of a decoded path plain: no "", "." or "..", except that the
// path may end with '/' (a directory).
absl::Status CheckSegments(absl::string_view path) {
  if (path.empty()) return absl::OkStatus();
  absl::string_view body = path;
  if (absl::EndsWith(body, "/")) body.remove_suffix(1);
  for (absl::string_view seg : absl::StrSplit(body, '/')) {
    if (seg.empty()) return absl::InvalidArgumentError("an empty path segment (\"//\")");
    if (seg == "." || seg == "..") {
      return absl::InvalidArgumentError("a \".\" or \"..\" path segment");
    }
  }
  return absl::OkStatus();
}

bool ValidBucket(absl::string_view b) {
  if (b.size() < 3 || b.size() > 63) return false;
  for (char c : b) {
    if (!(std::islower(static_cast<unsigned char>(c)) || std::isdigit(static_cast<unsigned char>(c)) ||
          c == '-' || c == '.')) {
      return false;
    }
  }
  return std::isalnum(static_cast<unsigned char>(b.front())) &&
         std::isalnum(static_cast<unsigned char>(b.back())) && !absl::StrContains(b, "..");
}

bool ValidHostName(absl::string_view h) {
  if (h.empty() || h.size() > 253) return false;
  if (h.front() == '[') {  // an IPv6 literal
    if (h.size() < 3 || h.back() != ']') return false;
    for (char c : h.substr(1, h.size() - 2)) {
      if (!(std::isxdigit(static_cast<unsigned char>(c)) || c == ':' || c == '.')) return false;
    }
    return true;
  }
  for (absl::string_view label : absl::StrSplit(h, '.')) {
    if (label.empty() || label.size() > 63) return false;
    for (char c : label) {
      if (!(std::islower(static_cast<unsigned char>(c)) ||
            std::isdigit(static_cast<unsigned char>(c)) || c == '-')) {
        return false;
      }
    }
  }
  return true;
}

}  // namespace

bool LooksLikeUrl(absl::string_view s) {
  size_t colon = s.find("://");
  if (colon == absl::string_view::npos || colon == 0) return false;
  if (!std::isalpha(static_cast<unsigned char>(s[0]))) return false;
  for (char c : s.substr(0, colon)) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '+' || c == '-' || c == '.')) {
      return false;
    }
  }
  return true;
}

std::string PercentEncode(absl::string_view decoded, bool keep_slash) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(decoded.size());
  for (unsigned char c : decoded) {
    if (Unreserved(c) || (keep_slash && c == '/')) {
      out.push_back(static_cast<char>(c));
    } else {
      out.push_back('%');
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  return out;
}

std::string UrlForMessage(absl::string_view url) {
  std::string shown(url);
  size_t start = shown.find("://");
  if (start != std::string::npos) {
    start += 3;
    size_t end = shown.find_first_of("/?#", start);
    size_t at = shown.rfind('@', end == std::string::npos ? std::string::npos : end);
    if (at != std::string::npos && at >= start && (end == std::string::npos || at < end)) {
      shown.replace(start, at - start, "***");
    }
  }
  return QuoteForMessage(shown);
}

absl::StatusOr<SourceUrl> ParseSourceUrl(absl::string_view url) {
  if (url.size() > kMaxUrlBytes) {
    return absl::InvalidArgumentError(absl::StrCat("longer than ", kMaxUrlBytes, " bytes"));
  }
  for (unsigned char c : url) {
    if (c <= 0x20 || c >= 0x7f) {
      return absl::InvalidArgumentError(
          "a space, control or non-ASCII byte (give an IDN host in its xn-- form, other "
          "bytes %-encoded)");
    }
    if (c == '\\') return absl::InvalidArgumentError("a backslash");
    if (c == '?' || c == '#') return absl::InvalidArgumentError("a query or fragment");
  }
  size_t sep = url.find("://");
  if (sep == absl::string_view::npos || !LooksLikeUrl(url)) {
    return absl::InvalidArgumentError("not a URL (scheme://...)");
  }
  SourceUrl out;
  const std::string scheme = absl::AsciiStrToLower(url.substr(0, sep));
  if (scheme == "s3") {
    out.scheme = SourceScheme::kS3;
  } else if (scheme == "https") {
    out.scheme = SourceScheme::kHttps;
  } else if (scheme == "http") {
    out.scheme = SourceScheme::kHttp;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("scheme ", QuoteForMessage(scheme, 16), " (s3, https or http only)"));
  }
  absl::string_view rest = url.substr(sep + 3);
  size_t slash = rest.find('/');
  absl::string_view authority = rest.substr(0, slash);
  absl::string_view raw_path = slash == absl::string_view::npos ? "" : rest.substr(slash + 1);
  if (absl::StrContains(authority, '@')) {
    return absl::InvalidArgumentError("userinfo (user@host): credentials come from the daemon");
  }
  if (absl::StrContains(authority, '%')) {
    return absl::InvalidArgumentError("a %-escape in the host");
  }
  std::string host(authority);
  size_t colon = host.rfind(':');
  if (colon != std::string::npos && host.find(']', colon) == std::string::npos) {
    std::string port_text = host.substr(colon + 1);
    host.resize(colon);
    int port = 0;
    if (port_text.empty() || port_text.size() > 5 || !absl::SimpleAtoi(port_text, &port) ||
        port < 1 || port > 65535 ||
        port_text.find_first_not_of("0123456789") != std::string::npos) {
      return absl::InvalidArgumentError("a malformed port");
    }
    if (out.scheme == SourceScheme::kS3) {
      return absl::InvalidArgumentError("a port in an s3:// URL (the endpoint is --s3-endpoint)");
    }
    const bool default_port = (out.scheme == SourceScheme::kHttps && port == 443) ||
                              (out.scheme == SourceScheme::kHttp && port == 80);
    out.port = default_port ? 0 : port;
  }
  absl::AsciiStrToLower(&host);
  if (out.scheme == SourceScheme::kS3 ? !ValidBucket(host) : !ValidHostName(host)) {
    return absl::InvalidArgumentError(out.scheme == SourceScheme::kS3
                                          ? "not an S3 bucket name"
                                          : "not a host name (ASCII letters, digits, '-', '.')");
  }
  out.host = std::move(host);
  auto decoded = DecodePath(raw_path);
  if (!decoded.ok()) return decoded.status();
  if (absl::Status s = CheckSegments(*decoded); !s.ok()) return s;
  out.path = std::move(*decoded);
  out.normalized = absl::StrCat(scheme, "://", out.host,
                                out.port != 0 ? absl::StrCat(":", out.port) : "", "/",
                                PercentEncode(out.path));
  return out;
}

absl::StatusOr<SourceUrl> ResolveSourceName(const SourceUrl& base, absl::string_view name) {
  if (name.empty() || name.front() == '/' || LooksLikeUrl(name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("name ", QuoteForMessage(name), " is not relative"));
  }
  for (unsigned char c : name) {
    if (c < 0x20 || c == 0x7f || c == '\\' || c == '%' || c == '?' || c == '#') {
      return absl::InvalidArgumentError(absl::StrCat(
          "name ", QuoteForMessage(name), " holds a control byte, '\\', '%', '?' or '#'"));
    }
  }
  if (absl::Status s = CheckSegments(name); !s.ok() || absl::EndsWith(name, "/")) {
    return absl::InvalidArgumentError(
        absl::StrCat("name ", QuoteForMessage(name), " is not a plain relative name"));
  }
  std::string dir = base.path;
  if (!base.is_directory()) {
    size_t slash = dir.rfind('/');
    dir = slash == std::string::npos ? "" : dir.substr(0, slash + 1);
  }
  std::string joined = absl::StrCat(base.normalized.substr(0, base.normalized.size() -
                                                                  PercentEncode(base.path).size()),
                                    PercentEncode(dir + std::string(name)));
  return ParseSourceUrl(joined);
}

absl::StatusOr<SourceAllowList> SourceAllowList::Create(const std::vector<std::string>& prefixes) {
  SourceAllowList list;
  for (const std::string& p : prefixes) {
    auto parsed = ParseSourceUrl(p);
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--model-source ", UrlForMessage(p), ": ",
                                                     parsed.status().message()));
    }
    list.prefixes_.push_back(parsed->normalized);
  }
  return list;
}

bool SourceAllowList::Covers(const SourceUrl& url) const {
  for (const std::string& p : prefixes_) {
    if (absl::EndsWith(p, "/")) {
      if (absl::StartsWith(url.normalized, p)) return true;
    } else if (url.normalized == p || absl::StartsWith(url.normalized, p + "/")) {
      return true;
    }
  }
  return false;
}

absl::Status SourceAllowList::Outside(absl::string_view url, absl::string_view why) const {
  return absl::PermissionDeniedError(absl::StrCat("url ", UrlForMessage(url),
                                                  " is outside the model sources [",
                                                  absl::StrJoin(prefixes_, ", "), "]",
                                                  why.empty() ? "" : ": ", why));
}

absl::StatusOr<SourceUrl> SourceAllowList::Check(absl::string_view url) const {
  auto parsed = ParseSourceUrl(url);
  if (!parsed.ok()) return Outside(url, parsed.status().message());
  if (!Covers(*parsed)) return Outside(url, "");
  return parsed;
}

}  // namespace weightd

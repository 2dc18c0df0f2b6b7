#include "server/source/source_client.h"

#include <curl/curl.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"

namespace weightd {
namespace {

// SHA-256 of the empty payload: every request here has no body.
constexpr char kEmptyPayloadSha256[] =
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
constexpr size_t kMaxErrorBody = 64 << 10;
constexpr size_t kMaxListBody = 32 << 20;
constexpr int kMaxListPages = 10000;
// A request slower than this for stall_timeout is abandoned.
constexpr long kStallBytesPerSecond = 1024;

struct SlistFree {
  void operator()(curl_slist* l) const { curl_slist_free_all(l); }
};
using Slist = std::unique_ptr<curl_slist, SlistFree>;

void Append(Slist& list, const std::string& line) {
  curl_slist* next = curl_slist_append(list.get(), line.c_str());
  if (next != nullptr) {
    (void)list.release();
    list.reset(next);
  }
}

const char* DefaultGetenv(const char* name) { return std::getenv(name); }

std::string XmlUnescape(absl::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '&') {
      out.push_back(s[i]);
      continue;
    }
    static const std::pair<const char*, char> kEntities[] = {
        {"&amp;", '&'}, {"&lt;", '<'}, {"&gt;", '>'}, {"&quot;", '"'}, {"&apos;", '\''}};
    bool done = false;
    for (const auto& [name, ch] : kEntities) {
      if (s.substr(i, std::strlen(name)) == name) {
        out.push_back(ch);
        i += std::strlen(name) - 1;
        done = true;
        break;
      }
    }
    if (!done) out.push_back('&');
  }
  return out;
}

// The text of the first <tag>...</tag> in `xml` at or after `from`, and
// where it ends; nullopt when there is none.
std::optional<std::pair<absl::string_view, size_t>> XmlElement(absl::string_view xml,
                                                               absl::string_view tag,
                                                               size_t from = 0) {
  std::string open = absl::StrCat("<", tag, ">");
  std::string close = absl::StrCat("</", tag, ">");
  size_t a = xml.find(open, from);
  if (a == absl::string_view::npos) return std::nullopt;
  a += open.size();
  size_t b = xml.find(close, a);
  if (b == absl::string_view::npos) return std::nullopt;
  return std::make_pair(xml.substr(a, b - a), b + close.size());
}

// An S3 error body's <Code>, letters only (it goes into a message).
std::string S3ErrorCode(absl::string_view body) {
  auto code = XmlElement(body, "Code");
  if (!code.has_value()) return "";
  std::string out;
  for (char c : code->first.substr(0, 64)) {
    if (absl::ascii_isalnum(static_cast<unsigned char>(c))) out.push_back(c);
  }
  return out;
}

}  // namespace

struct SourceClient::Share {
  CURLSH* sh = nullptr;
  absl::Mutex mu[CURL_LOCK_DATA_LAST];

  ~Share() {
    if (sh != nullptr) curl_share_cleanup(sh);
  }
  static void Lock(CURL*, curl_lock_data data, curl_lock_access, void* self)
      ABSL_NO_THREAD_SAFETY_ANALYSIS {
    static_cast<Share*>(self)->mu[data].Lock();
  }
  static void Unlock(CURL*, curl_lock_data data, void* self) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    static_cast<Share*>(self)->mu[data].Unlock();
  }
};

// One operation (HEAD, a range, a listing page) and what its last attempt
// got back.
struct SourceClient::Request {
  enum class Kind { kHead, kRange, kGet };
  Kind kind = Kind::kHead;
  bool s3 = false;
  bool https_auth = false;  // an http(s) source: the bearer token goes along
  std::string target;       // the URL requested
  std::string what;         // the source URL for messages (quoted)
  // kRange: where the bytes go.
  const ObjectInfo* pinned = nullptr;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint8_t* dest = nullptr;
  uint64_t got = 0;  // over every attempt
  // kGet: the body.
  std::string body;
  // The attempt's results.
  CURL* handle = nullptr;
  long code = 0;
  std::string etag, last_modified, content_range, content_length;
  std::string error_body;
  std::string bad_range;  // why the body was refused before a byte of it was kept
  bool checked = false;   // the response's range checked
  bool overflow = false;
  std::string credentials;  // which, for messages
  const std::atomic<bool>* cancelled = nullptr;  // the daemon is stopping
  const Cancellation* load_cancel = nullptr;     // the load it is for ended
  std::atomic<uint64_t>* bytes = nullptr;
  char curl_error[CURL_ERROR_SIZE] = {0};

  void ResetAttempt() {
    code = 0;
    etag.clear();
    last_modified.clear();
    content_range.clear();
    content_length.clear();
    error_body.clear();
    bad_range.clear();
    checked = false;
    overflow = false;
    curl_error[0] = 0;
    if (kind == Kind::kGet) body.clear();
  }

  static size_t OnHeader(char* data, size_t size, size_t n, void* self) {
    auto* r = static_cast<Request*>(self);
    absl::string_view line(data, size * n);
    if (absl::StartsWith(line, "HTTP/")) {  // a new response (after a 100, say)
      r->etag.clear();
      r->last_modified.clear();
      r->content_range.clear();
      r->content_length.clear();
      return size * n;
    }
    size_t colon = line.find(':');
    if (colon == absl::string_view::npos) return size * n;
    std::string name = absl::AsciiStrToLower(line.substr(0, colon));
    std::string value(absl::StripAsciiWhitespace(line.substr(colon + 1)));
    if (name == "etag") r->etag = value;
    if (name == "last-modified") r->last_modified = value;
    if (name == "content-range") r->content_range = value;
    if (name == "content-length") r->content_length = value;
    return size * n;
  }

  // The range of a 206 (or the whole object of a 200) is exactly the one
  // asked for; "" when it is, else why not.
  std::string CheckRange(long status) const {
    const uint64_t first = offset + got;
    const uint64_t last = offset + length - 1;
    if (status == 200) {
      if (first == 0 && length == pinned->size) return "";
      return "the server ignored the Range header (200 for a part of the object)";
    }
    absl::string_view cr = content_range;
    uint64_t a = 0, b = 0, total = 0;
    if (!absl::ConsumePrefix(&cr, "bytes ")) return "a 206 without a Content-Range: bytes";
    size_t dash = cr.find('-'), slash = cr.find('/');
    if (dash == absl::string_view::npos || slash == absl::string_view::npos || slash < dash ||
        !absl::SimpleAtoi(cr.substr(0, dash), &a) ||
        !absl::SimpleAtoi(cr.substr(dash + 1, slash - dash - 1), &b) ||
        !absl::SimpleAtoi(cr.substr(slash + 1), &total)) {
      return absl::StrCat("a malformed Content-Range \"", content_range.substr(0, 80), "\"");
    }
    if (total != pinned->size) {
      return absl::StrCat("changed:", total);
    }
    if (a != first || b != last) {
      return absl::StrCat("Content-Range bytes ", a, "-", b, " for a request of bytes ", first,
                          "-", last);
    }
    return "";
  }

  static size_t OnBody(char* data, size_t size, size_t n, void* self) {
    auto* r = static_cast<Request*>(self);
    const size_t len = size * n;
    long status = 0;
    curl_easy_getinfo(r->handle, CURLINFO_RESPONSE_CODE, &status);
    const bool ok = status >= 200 && status < 300;
    if (r->kind == Kind::kRange && (status == 200 || status == 206)) {
      if (!r->checked) {
        r->bad_range = r->CheckRange(status);
        if (!r->bad_range.empty()) return 0;
        r->checked = true;
      }
      if (len > r->length - r->got) {
        r->overflow = true;  // never past the range: the caller's memory ends there
        return 0;
      }
      std::memcpy(r->dest + r->got, data, len);
      r->got += len;
      r->bytes->fetch_add(len, std::memory_order_relaxed);
      return len;
    }
    if (ok && r->kind == Kind::kGet) {
      if (r->body.size() + len > kMaxListBody) {
        r->overflow = true;
        return 0;
      }
      r->body.append(data, len);
      r->bytes->fetch_add(len, std::memory_order_relaxed);
      return len;
    }
    if (r->error_body.size() < kMaxErrorBody) {
      r->error_body.append(data, std::min(len, kMaxErrorBody - r->error_body.size()));
    }
    return len;
  }

  static int OnProgress(void* self, curl_off_t, curl_off_t, curl_off_t, curl_off_t) {
    return static_cast<Request*>(self)->Cancelled() ? 1 : 0;
  }
  bool Cancelled() const {
    return cancelled->load(std::memory_order_relaxed) ||
           (load_cancel != nullptr && load_cancel->cancelled());
  }
  // CANCELLED saying who ended it, or OK.
  absl::Status CancelStatus() const {
    if (cancelled->load()) return absl::CancelledError("the daemon is stopping");
    return CancelledStatus(load_cancel);
  }
};

namespace {

// What one attempt came to: its status, and whether another attempt may
// help.
struct Outcome {
  absl::Status status;
  bool retry = false;
};

}  // namespace

SourceClient::SourceClient(SourceClientOptions options) : options_(std::move(options)) {}

SourceClient::~SourceClient() {
  absl::MutexLock lock(&pool_mu_);
  for (void* h : idle_) curl_easy_cleanup(static_cast<CURL*>(h));
  idle_.clear();
}

absl::StatusOr<std::unique_ptr<SourceClient>> SourceClient::Create(SourceClientOptions options) {
  if (!options.env) options.env = DefaultGetenv;
  std::unique_ptr<SourceClient> client(new SourceClient(std::move(options)));
  WD_RETURN_IF_ERROR(client->Init());
  return client;
}

absl::Status SourceClient::Init() {
  static std::once_flag once;
  static CURLcode global = CURLE_OK;
  std::call_once(once, [] { global = curl_global_init(CURL_GLOBAL_DEFAULT); });
  if (global != CURLE_OK) {
    return absl::InternalError(absl::StrCat("curl_global_init: ", curl_easy_strerror(global)));
  }
  region_ = options_.s3_region;
  if (region_.empty() && options_.env("AWS_REGION") != nullptr) region_ = options_.env("AWS_REGION");
  if (region_.empty() && options_.env("AWS_DEFAULT_REGION") != nullptr) {
    region_ = options_.env("AWS_DEFAULT_REGION");
  }
  if (region_.empty()) region_ = "us-east-1";
  for (char c : region_) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-') {
      return absl::InvalidArgumentError(absl::StrCat("--s3-region \"", region_.substr(0, 64),
                                                     "\" is not a region name"));
    }
  }
  std::string endpoint = options_.s3_endpoint;
  path_style_ = options_.s3_path_style.value_or(!endpoint.empty());
  if (endpoint.empty()) endpoint = absl::StrCat("https://s3.", region_, ".amazonaws.com");
  while (absl::EndsWith(endpoint, "/")) endpoint.pop_back();
  size_t sep = endpoint.find("://");
  endpoint_scheme_ = sep == std::string::npos ? "" : absl::AsciiStrToLower(endpoint.substr(0, sep));
  endpoint_host_ = sep == std::string::npos ? "" : endpoint.substr(sep + 3);
  if ((endpoint_scheme_ != "http" && endpoint_scheme_ != "https") || endpoint_host_.empty() ||
      endpoint_host_.find_first_of("/@?#\\ ") != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--s3-endpoint \"", options_.s3_endpoint.substr(0, 200),
        "\" is not http(s)://host[:port]"));
  }
  share_ = std::make_unique<Share>();
  share_->sh = curl_share_init();
  if (share_->sh == nullptr) return absl::InternalError("curl_share_init failed");
  curl_share_setopt(share_->sh, CURLSHOPT_LOCKFUNC, &Share::Lock);
  curl_share_setopt(share_->sh, CURLSHOPT_UNLOCKFUNC, &Share::Unlock);
  curl_share_setopt(share_->sh, CURLSHOPT_USERDATA, share_.get());
  curl_share_setopt(share_->sh, CURLSHOPT_SHARE, CURL_LOCK_DATA_DNS);
  curl_share_setopt(share_->sh, CURLSHOPT_SHARE, CURL_LOCK_DATA_SSL_SESSION);
  return absl::OkStatus();
}

SourceCounters SourceClient::counters() const {
  return SourceCounters{.bytes = bytes_.load(),
                        .requests = requests_.load(),
                        .retries = retries_.load(),
                        .failures = failures_.load()};
}

std::string SourceClient::BucketUrl(const std::string& bucket) const {
  return path_style_ ? absl::StrCat(endpoint_scheme_, "://", endpoint_host_, "/", bucket)
                     : absl::StrCat(endpoint_scheme_, "://", bucket, ".", endpoint_host_);
}

std::string SourceClient::ObjectUrl(const SourceUrl& url) const {
  if (url.scheme != SourceScheme::kS3) return url.normalized;
  return absl::StrCat(BucketUrl(url.host), "/", PercentEncode(url.path));
}

void* SourceClient::TakeHandle() const {
  {
    absl::MutexLock lock(&pool_mu_);
    if (!idle_.empty()) {
      void* h = idle_.back();
      idle_.pop_back();
      return h;
    }
  }
  return curl_easy_init();
}

void SourceClient::GiveHandle(void* handle) const {
  if (handle == nullptr) return;
  absl::MutexLock lock(&pool_mu_);
  idle_.push_back(handle);
}

absl::Status SourceClient::Sleep(const Request& req, absl::Duration d) const {
  const absl::Time until = absl::Now() + d;
  while (absl::Now() < until && !req.Cancelled()) {
    absl::SleepFor(std::min(absl::Milliseconds(20), until - absl::Now()));
  }
  return req.CancelStatus();
}

absl::Status SourceClient::RunOnce(Request& req, void* handle, bool* retry) const {
  *retry = false;
  CURL* h = static_cast<CURL*>(handle);
  if (h == nullptr) return absl::ResourceExhaustedError("curl_easy_init failed");
  curl_easy_reset(h);
  req.handle = h;
  req.ResetAttempt();
  Slist headers;
  std::string userpwd_user, userpwd_secret, sigv4;
  if (req.s3) {
    auto creds = FindS3Credentials(options_.env);
    if (!creds.ok()) return creds.status();
    if (creds->has_value()) {
      const S3Credentials& c = **creds;
      req.credentials = c.origin;
      sigv4 = absl::StrCat("aws:amz:", region_, ":s3");
      curl_easy_setopt(h, CURLOPT_AWS_SIGV4, sigv4.c_str());
      curl_easy_setopt(h, CURLOPT_USERNAME, c.access_key_id.c_str());
      curl_easy_setopt(h, CURLOPT_PASSWORD, c.secret_access_key.c_str());
      Append(headers, absl::StrCat("x-amz-content-sha256: ", kEmptyPayloadSha256));
      if (!c.session_token.empty()) {
        Append(headers, absl::StrCat("x-amz-security-token: ", c.session_token));
      }
    } else {
      req.credentials = "no S3 credentials (an unsigned request)";
    }
  } else if (req.https_auth && !options_.bearer_token_file.empty()) {
    auto token = ReadBearerToken(options_.bearer_token_file);
    if (!token.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("--https-bearer-token-file: ", token.status().message()));
    }
    Append(headers, absl::StrCat("Authorization: Bearer ", *token));
    req.credentials = absl::StrCat("the bearer token from ", options_.bearer_token_file);
  } else {
    req.credentials = "no credentials";
  }
  std::string range;
  if (req.kind == Request::Kind::kRange) {
    range = absl::StrCat(req.offset + req.got, "-", req.offset + req.length - 1);
    curl_easy_setopt(h, CURLOPT_RANGE, range.c_str());
    const std::string& etag = req.pinned->etag;
    if (!etag.empty() && !absl::StartsWith(etag, "W/")) {
      Append(headers, absl::StrCat("If-Match: ", etag));
    }
  }
  curl_easy_setopt(h, CURLOPT_URL, req.target.c_str());
  curl_easy_setopt(h, CURLOPT_SHARE, share_->sh);
  curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(h, CURLOPT_FOLLOWLOCATION, 0L);
  curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(h, CURLOPT_HTTP_VERSION, static_cast<long>(CURL_HTTP_VERSION_2TLS));
  curl_easy_setopt(h, CURLOPT_ACCEPT_ENCODING, nullptr);  // bytes as stored, never decoded
  const long stall = std::max<long>(1, absl::ToInt64Seconds(options_.stall_timeout));
  curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT, stall);
  curl_easy_setopt(h, CURLOPT_LOW_SPEED_LIMIT, kStallBytesPerSecond);
  curl_easy_setopt(h, CURLOPT_LOW_SPEED_TIME, stall);
  if (!options_.ca_file.empty()) {
    // The file's CAs and the system's directory of them.
    curl_easy_setopt(h, CURLOPT_CAINFO, options_.ca_file.c_str());
    curl_easy_setopt(h, CURLOPT_CAPATH, "/etc/ssl/certs");
  }
  curl_easy_setopt(h, CURLOPT_ERRORBUFFER, req.curl_error);
  curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, &Request::OnHeader);
  curl_easy_setopt(h, CURLOPT_HEADERDATA, &req);
  curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, &Request::OnBody);
  curl_easy_setopt(h, CURLOPT_WRITEDATA, &req);
  curl_easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
  curl_easy_setopt(h, CURLOPT_XFERINFOFUNCTION, &Request::OnProgress);
  curl_easy_setopt(h, CURLOPT_XFERINFODATA, &req);
  if (req.kind == Request::Kind::kHead) curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
  curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers.get());
  requests_.fetch_add(1, std::memory_order_relaxed);
  const CURLcode rc = curl_easy_perform(h);
  curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &req.code);
  curl_easy_setopt(h, CURLOPT_HTTPHEADER, nullptr);
  curl_easy_setopt(h, CURLOPT_ERRORBUFFER, nullptr);
  const std::string& what = req.what;
  if (req.Cancelled()) return req.CancelStatus();
  if (!req.bad_range.empty()) {
    if (absl::StartsWith(req.bad_range, "changed:")) {
      return absl::AbortedError(absl::StrCat("object ", what, " changed while loading (size ",
                                             req.pinned->size, " -> ", req.bad_range.substr(8),
                                             ")"));
    }
    return absl::DataLossError(absl::StrCat(what, ": ", req.bad_range));
  }
  if (req.overflow) {
    return absl::DataLossError(
        req.kind == Request::Kind::kRange
            ? absl::StrCat(what, ": the server sent more than the ", req.length - req.got,
                           " bytes asked for (bytes ", range, ")")
            : absl::StrCat(what, ": the listing is larger than ", kMaxListBody, " bytes"));
  }
  const std::string curl_says = req.curl_error[0] != 0 ? req.curl_error : curl_easy_strerror(rc);
  if (rc != CURLE_OK) {
    switch (rc) {
      case CURLE_OPERATION_TIMEDOUT:
        *retry = true;
        return absl::DeadlineExceededError(absl::StrCat(
            what, ": stalled (less than ", kStallBytesPerSecond, " bytes/s for ", stall,
            " s, --source-timeout-seconds): ", curl_says));
      case CURLE_PARTIAL_FILE:
        *retry = true;
        return absl::DataLossError(absl::StrCat(what, ": short body: ", curl_says));
      case CURLE_COULDNT_CONNECT:
      case CURLE_COULDNT_RESOLVE_HOST:
      case CURLE_RECV_ERROR:
      case CURLE_SEND_ERROR:
      case CURLE_GOT_NOTHING:
      case CURLE_HTTP2:
      case CURLE_HTTP2_STREAM:
      case CURLE_SSL_CONNECT_ERROR:
        *retry = true;
        return absl::UnavailableError(absl::StrCat(what, ": ", curl_says));
      default:
        return absl::UnavailableError(absl::StrCat(what, ": ", curl_says));
    }
  }
  const long code = req.code;
  if (code >= 200 && code < 300) {
    if (req.kind == Request::Kind::kRange && req.got != req.length) {
      *retry = true;
      return absl::DataLossError(absl::StrCat(what, ": short body (", req.got, " of ", req.length,
                                              " bytes)"));
    }
    return absl::OkStatus();
  }
  std::string s3_code = req.s3 ? S3ErrorCode(req.error_body) : "";
  std::string detail = absl::StrCat("HTTP ", code, s3_code.empty() ? "" : " ", s3_code);
  if (code == 404) return absl::NotFoundError(absl::StrCat(what, " not found (", detail, ")"));
  if (code == 401 || code == 403) {
    return absl::PermissionDeniedError(
        absl::StrCat(what, ": ", detail, " with ", req.credentials));
  }
  if (code == 412 || code == 416) {
    return absl::AbortedError(absl::StrCat("object ", what, " changed while loading (", detail,
                                           ")"));
  }
  if (code == 408 || code == 429 || code >= 500) {
    *retry = true;
    return absl::UnavailableError(absl::StrCat(what, ": ", detail));
  }
  if (code >= 300 && code < 400) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", detail, " (a redirect; redirects are not followed)"));
  }
  return absl::InvalidArgumentError(absl::StrCat(what, ": ", detail));
}

absl::Status SourceClient::Run(Request& req) const {
  req.cancelled = &cancelled_;
  req.bytes = &bytes_;
  thread_local std::mt19937_64 rng{std::random_device{}()};
  for (int attempt = 0;; ++attempt) {
    bool retry = false;
    void* h = TakeHandle();
    absl::Status s = RunOnce(req, h, &retry);
    GiveHandle(h);
    if (s.ok()) return s;
    if (!retry || attempt >= options_.retries) {
      // An answer (no such object: a directory's index probe) is no
      // failure, and neither is the load's end.
      if (!absl::IsNotFound(s) && !absl::IsCancelled(s)) {
        failures_.fetch_add(1, std::memory_order_relaxed);
      }
      if (attempt == 0) return s;
      return absl::Status(s.code(), absl::StrCat(s.message(), " (after ", attempt + 1,
                                                 " attempts)"));
    }
    retries_.fetch_add(1, std::memory_order_relaxed);
    // Full jitter: uniform in [0, min(cap, base * 2^attempt)).
    const absl::Duration ceiling =
        std::min(options_.backoff_cap, options_.backoff_base * (1ull << std::min(attempt, 20)));
    std::uniform_real_distribution<double> share(0.0, 1.0);
    if (absl::Status slept = Sleep(req, ceiling * share(rng)); !slept.ok()) return slept;
  }
}

absl::StatusOr<ObjectInfo> SourceClient::Head(const SourceUrl& url) const {
  Request req;
  req.kind = Request::Kind::kHead;
  req.s3 = url.scheme == SourceScheme::kS3;
  req.https_auth = !req.s3;
  req.target = ObjectUrl(url);
  req.what = UrlForMessage(url.normalized);
  WD_RETURN_IF_ERROR(Run(req));
  ObjectInfo info;
  if (!absl::SimpleAtoi(req.content_length, &info.size)) {
    return absl::DataLossError(
        absl::StrCat(req.what, ": the HEAD answer has no Content-Length"));
  }
  info.etag = req.etag.substr(0, 256);
  info.last_modified = req.last_modified.substr(0, 64);
  return info;
}

absl::Status SourceClient::ReadRange(const SourceUrl& url, const ObjectInfo& pinned,
                                     uint64_t offset, uint64_t length, void* dest,
                                     const Cancellation* cancel) const {
  if (length == 0) return absl::OkStatus();
  if (offset > pinned.size || length > pinned.size - offset) {
    return absl::OutOfRangeError(absl::StrCat(UrlForMessage(url.normalized), ": bytes ", offset,
                                              "+", length, " past its end at ", pinned.size));
  }
  Request req;
  req.kind = Request::Kind::kRange;
  req.s3 = url.scheme == SourceScheme::kS3;
  req.https_auth = !req.s3;
  req.target = ObjectUrl(url);
  req.what = UrlForMessage(url.normalized);
  req.pinned = &pinned;
  req.offset = offset;
  req.length = length;
  req.dest = static_cast<uint8_t*>(dest);
  req.load_cancel = cancel;
  absl::Status s = Run(req);
  if (absl::IsAborted(s)) {
    // Name the version it changed to, where the object still answers.
    absl::StatusOr<ObjectInfo> now = Head(url);
    std::string to = now.ok() ? (now->etag.empty() ? std::string("(none)") : now->etag)
                              : std::string("(gone)");
    return absl::AbortedError(absl::StrCat("object ", req.what,
                                           " changed while loading (ETag ",
                                           pinned.etag.empty() ? "(none)" : pinned.etag, " -> ",
                                           to, "; ", s.message(), ")"));
  }
  return s;
}

absl::StatusOr<std::vector<std::string>> SourceClient::List(const SourceUrl& dir,
                                                            absl::string_view suffix) const {
  if (dir.scheme != SourceScheme::kS3) {
    return absl::InvalidArgumentError(absl::StrCat(
        UrlForMessage(dir.normalized),
        " is an http(s) directory, which cannot be listed: name its "
        "model.safetensors.index.json or a .safetensors file"));
  }
  std::vector<std::string> names;
  std::string token;
  for (int page = 0; page < kMaxListPages; ++page) {
    Request req;
    req.kind = Request::Kind::kGet;
    req.s3 = true;
    req.what = UrlForMessage(dir.normalized);
    // The query's parameters sorted by name and encoded as SigV4 wants
    // them (curl signs the query as given).
    std::string query;
    if (!token.empty()) {
      absl::StrAppend(&query, "continuation-token=", PercentEncode(token, false), "&");
    }
    absl::StrAppend(&query, "delimiter=%2F&list-type=2&prefix=", PercentEncode(dir.path, false));
    req.target = absl::StrCat(BucketUrl(dir.host), path_style_ ? "" : "/", "?", query);
    WD_RETURN_IF_ERROR(Run(req));
    absl::string_view xml = req.body;
    size_t at = 0;
    while (auto contents = XmlElement(xml, "Contents", at)) {
      at = contents->second;
      auto key = XmlElement(contents->first, "Key");
      if (!key.has_value()) continue;
      std::string k = XmlUnescape(key->first);
      if (!absl::StartsWith(k, dir.path)) continue;
      std::string name = k.substr(dir.path.size());
      if (name.empty() || absl::StrContains(name, '/') || !absl::EndsWith(name, suffix)) continue;
      names.push_back(std::move(name));
    }
    auto truncated = XmlElement(xml, "IsTruncated");
    auto next = XmlElement(xml, "NextContinuationToken");
    if (!truncated.has_value() || truncated->first != "true" || !next.has_value() ||
        next->first.empty()) {
      std::sort(names.begin(), names.end());
      names.erase(std::unique(names.begin(), names.end()), names.end());
      return names;
    }
    token = XmlUnescape(next->first);
  }
  return absl::ResourceExhaustedError(absl::StrCat(UrlForMessage(dir.normalized), ": more than ",
                                                   kMaxListPages, " pages of objects"));
}

}  // namespace weightd

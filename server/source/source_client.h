// The HTTP side of remote sources, over libcurl (the only file that
// includes curl.h is source_client.cc): HEAD an object, read a byte range
// of it straight into caller memory, list an S3 prefix. S3 requests are
// signed with SigV4 (CURLOPT_AWS_SIGV4) from the credentials the daemon
// finds (credentials.h); https requests carry the bearer token file's token
// when one is configured. Redirects are never followed.
//
// Thread-safe: every method may be called from many threads at once. Each
// request takes an easy handle from a pool (its connections stay open for
// the next request: one handle per stream, kept alive), and all of them
// share one DNS and TLS session cache.
#ifndef WEIGHTD_SERVER_SOURCE_SOURCE_CLIENT_H_
#define WEIGHTD_SERVER_SOURCE_SOURCE_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/cancel.h"
#include "server/source/credentials.h"
#include "server/source/source_url.h"

namespace weightd {

struct SourceClientOptions {
  // --s3-endpoint: scheme://host[:port] of the S3 API ("" =
  // https://s3.REGION.amazonaws.com).
  std::string s3_endpoint;
  // --s3-region ("" = AWS_REGION, AWS_DEFAULT_REGION, else us-east-1).
  std::string s3_region;
  // --s3-path-style (unset = on when s3_endpoint is given): endpoint/bucket/key
  // instead of bucket.endpoint/key.
  std::optional<bool> s3_path_style;
  // --source-retries: attempts after the first, for 5xx, 408, 429, resets,
  // short bodies and stalls; backoff with full jitter from backoff_base,
  // doubling, capped at backoff_cap.
  int retries = 5;
  absl::Duration backoff_base = absl::Milliseconds(100);
  absl::Duration backoff_cap = absl::Seconds(5);
  // --source-timeout-seconds: a request that moves less than 1 KiB/s for
  // this long (no byte, or a drip) is abandoned and retried; the same bound
  // for connecting.
  absl::Duration stall_timeout = absl::Seconds(30);
  // --source-ca-file: extra CA certificates for https (with the system's).
  std::string ca_file;
  // --https-bearer-token-file: "Authorization: Bearer" for https sources,
  // read again for every request ("" = none).
  std::string bearer_token_file;
  // The environment credentials and the region come from (null: getenv).
  EnvLookup env;
};

// What an object is: its size and version. `etag` as the server sent it
// (quotes included); empty when the server sends none.
struct ObjectInfo {
  uint64_t size = 0;
  std::string etag;
  std::string last_modified;  // the header, when there is no ETag
};

// Totals since start (Stats, metrics): bytes received into ranges and
// listings, requests sent, retries (attempts after a failed one) and
// failures (operations that failed after their retries).
struct SourceCounters {
  uint64_t bytes = 0;
  uint64_t requests = 0;
  uint64_t retries = 0;
  uint64_t failures = 0;
};

class SourceClient {
 public:
  // INVALID_ARGUMENT for an endpoint that is not scheme://host[:port]; the
  // error of curl's global initialisation.
  static absl::StatusOr<std::unique_ptr<SourceClient>> Create(SourceClientOptions options);
  ~SourceClient();
  SourceClient(const SourceClient&) = delete;
  SourceClient& operator=(const SourceClient&) = delete;

  // The object's size and version (HEAD). NOT_FOUND when there is none;
  // PERMISSION_DENIED on 401/403 naming the credentials used; UNAVAILABLE
  // once retries are spent (the last error named); DEADLINE_EXCEEDED when
  // the last attempt stalled.
  absl::StatusOr<ObjectInfo> Head(const SourceUrl& url) const;

  // Reads bytes [offset, offset + length) of the object pinned at `pinned`
  // into dest, with one ranged GET (If-Match: its ETag); after a failure
  // only the missing tail is asked for again. On success all of
  // dest[0, length) is written, and nothing outside it ever is: a body
  // longer than the range is DATA_LOSS. ABORTED "object U changed while
  // loading (ETag A -> B)" on 412 or a Content-Range of another size;
  // DATA_LOSS for a Content-Range other than the range asked for, or a body
  // still short when retries are spent; otherwise as Head. `cancel` (null:
  // none) ends the request in flight, and the retries, with its status.
  absl::Status ReadRange(const SourceUrl& url, const ObjectInfo& pinned, uint64_t offset,
                         uint64_t length, void* dest,
                         const Cancellation* cancel = nullptr) const;

  // The names directly under S3 prefix `dir` (a directory URL) that end
  // with `suffix`, sorted (ListObjectsV2, every page). INVALID_ARGUMENT for
  // an http(s) directory: a server directory cannot be listed.
  absl::StatusOr<std::vector<std::string>> List(const SourceUrl& dir,
                                                absl::string_view suffix) const;

  // From now on every request in flight and later fails CANCELLED (the
  // daemon stops).
  void Cancel() { cancelled_.store(true); }

  SourceCounters counters() const;

  struct Request;  // one attempt's setup and results (source_client.cc)
  struct Share;    // the curl share handle and its locks

 private:
  explicit SourceClient(SourceClientOptions options);
  absl::Status Init();
  // The request URL of an object or a listing.
  std::string ObjectUrl(const SourceUrl& url) const;
  std::string BucketUrl(const std::string& bucket) const;
  // Runs `req` with the retries; fills its results.
  absl::Status Run(Request& req) const;
  // One attempt; *retry: another attempt may help.
  absl::Status RunOnce(Request& req, void* handle, bool* retry) const;
  void* TakeHandle() const;
  void GiveHandle(void* handle) const;
  std::string Region() const;
  // Sleeps `d`, or less when `req` is cancelled (then its CANCELLED).
  absl::Status Sleep(const Request& req, absl::Duration d) const;

  // Constant after Create.
  const SourceClientOptions options_;
  std::string endpoint_scheme_;  // "https"
  std::string endpoint_host_;    // "s3.us-east-1.amazonaws.com" or "127.0.0.1:9000"
  std::string region_;
  bool path_style_ = false;
  std::unique_ptr<Share> share_;

  std::atomic<bool> cancelled_{false};
  mutable std::atomic<uint64_t> bytes_{0};
  mutable std::atomic<uint64_t> requests_{0};
  mutable std::atomic<uint64_t> retries_{0};
  mutable std::atomic<uint64_t> failures_{0};

  mutable absl::Mutex pool_mu_;
  mutable std::vector<void*> idle_ ABSL_GUARDED_BY(pool_mu_);  // CURL*
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_SOURCE_SOURCE_CLIENT_H_

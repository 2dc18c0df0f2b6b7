// SourceClient over real TCP against a scripted HTTP/1.1 server in this
// test (a test tool: one thread, one connection at a time, each request
// answered by the script): ranges land exactly in place, a failure resumes
// only the missing tail, and each fault gets the contract's code.
#include "server/source/source_client.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <deque>
#include <map>
#include <functional>
#include <thread>

#include <gtest/gtest.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"

namespace weightd {
namespace {

struct HttpRequest {
  std::string method, target;
  std::map<std::string, std::string> headers;  // lowercase names
};

// What to do with one request: the raw bytes to send, then close the
// connection (always: one request per connection keeps the script simple),
// after `delay` if any.
struct Reply {
  std::string bytes;
  absl::Duration hold = absl::ZeroDuration();  // keep the socket open this long first
};
using Script = std::function<Reply(const HttpRequest&)>;

class ScriptedServer {
 public:
  explicit ScriptedServer(Script script) : script_(std::move(script)) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    socklen_t len = sizeof(a);
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    ::listen(fd_, 16);
    thread_ = std::thread([this] { Serve(); });
  }
  ~ScriptedServer() {
    stop_ = true;
    ::shutdown(fd_, SHUT_RDWR);
    ::close(fd_);
    thread_.join();
  }
  std::string url(const std::string& path) const {
    return absl::StrCat("http://127.0.0.1:", port_, "/", path);
  }
  std::vector<HttpRequest> requests() const {
    absl::MutexLock lock(&mu_);
    return requests_;
  }

 private:
  void Serve() {
    while (!stop_) {
      int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) return;
      std::string in;
      char buf[4096];
      while (!absl::StrContains(in, "\r\n\r\n")) {
        ssize_t n = ::read(c, buf, sizeof(buf));
        if (n <= 0) break;
        in.append(buf, n);
      }
      HttpRequest req;
      std::vector<std::string> lines = absl::StrSplit(in.substr(0, in.find("\r\n\r\n")), "\r\n");
      if (!lines.empty()) {
        std::vector<std::string> first = absl::StrSplit(lines[0], ' ');
        if (first.size() >= 2) {
          req.method = first[0];
          req.target = first[1];
        }
        for (size_t i = 1; i < lines.size(); ++i) {
          size_t colon = lines[i].find(':');
          if (colon == std::string::npos) continue;
          req.headers[absl::AsciiStrToLower(lines[i].substr(0, colon))] =
              std::string(absl::StripAsciiWhitespace(lines[i].substr(colon + 1)));
        }
      }
      {
        absl::MutexLock lock(&mu_);
        requests_.push_back(req);
      }
      Reply r = script_(req);
      size_t off = 0;
      while (off < r.bytes.size()) {
        ssize_t n = ::send(c, r.bytes.data() + off, r.bytes.size() - off, MSG_NOSIGNAL);
        if (n <= 0) break;
        off += n;
      }
      const absl::Time until = absl::Now() + r.hold;
      while (!stop_ && absl::Now() < until) absl::SleepFor(absl::Milliseconds(10));
      ::close(c);
    }
  }

  Script script_;
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  mutable absl::Mutex mu_;
  std::vector<HttpRequest> requests_ ABSL_GUARDED_BY(mu_);
};

constexpr char kEtag[] = "\"v1\"";

std::string Object(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + 7) & 0xff);
  return s;
}

// "a-b" of a Range header ("bytes=a-b").
std::pair<uint64_t, uint64_t> RangeOf(const HttpRequest& r) {
  std::string v = r.headers.count("range") ? r.headers.at("range") : "";
  absl::string_view s = v;
  absl::ConsumePrefix(&s, "bytes=");
  std::pair<std::string, std::string> ab = absl::StrSplit(s, '-');
  uint64_t a = 0, b = 0;
  (void)absl::SimpleAtoi(ab.first, &a);
  (void)absl::SimpleAtoi(ab.second, &b);
  return {a, b};
}

std::string Partial(const std::string& obj, uint64_t a, uint64_t b, const std::string& etag,
                    size_t send = std::string::npos, std::string content_range = "") {
  std::string body = obj.substr(a, b - a + 1);
  if (content_range.empty()) content_range = absl::StrCat("bytes ", a, "-", b, "/", obj.size());
  std::string head = absl::StrCat("HTTP/1.1 206 Partial Content\r\nContent-Length: ", body.size(),
                                  "\r\nContent-Range: ", content_range, "\r\nETag: ", etag,
                                  "\r\nConnection: close\r\n\r\n");
  return head + body.substr(0, send);
}

std::string Head(const std::string& obj, const std::string& etag) {
  return absl::StrCat("HTTP/1.1 200 OK\r\nContent-Length: ", obj.size(), "\r\nETag: ", etag,
                      "\r\nConnection: close\r\n\r\n");
}

std::string Status(int code, const std::string& body = "") {
  return absl::StrCat("HTTP/1.1 ", code, " X\r\nContent-Length: ", body.size(),
                      "\r\nConnection: close\r\n\r\n", body);
}

std::unique_ptr<SourceClient> Client(int retries, int stall_seconds = 5) {
  SourceClientOptions o;
  o.retries = retries;
  o.backoff_base = absl::Milliseconds(1);
  o.backoff_cap = absl::Milliseconds(5);
  o.stall_timeout = absl::Seconds(stall_seconds);
  o.env = [](const char*) -> const char* { return nullptr; };
  auto c = SourceClient::Create(std::move(o));
  EXPECT_TRUE(c.ok()) << c.status();
  return std::move(*c);
}

SourceUrl Url(const ScriptedServer& s, const std::string& path) {
  auto u = ParseSourceUrl(s.url(path));
  EXPECT_TRUE(u.ok()) << u.status();
  return *u;
}

TEST(SourceClient, HeadAndRangeLandExactlyInPlace) {
  const std::string obj = Object(100000);
  ScriptedServer server([&](const HttpRequest& r) {
    if (r.method == "HEAD") return Reply{Head(obj, kEtag)};
    auto [a, b] = RangeOf(r);
    return Reply{Partial(obj, a, b, kEtag)};
  });
  auto client = Client(0);
  SourceUrl url = Url(server, "m/x.safetensors");
  auto info = client->Head(url);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->size, obj.size());
  EXPECT_EQ(info->etag, kEtag);
  std::string dest(5000 + 2, '#');  // one guard byte each side
  ASSERT_TRUE(client->ReadRange(url, *info, 1234, 5000, dest.data() + 1).ok());
  EXPECT_EQ(dest.substr(1, 5000), obj.substr(1234, 5000));
  EXPECT_EQ(dest.front(), '#');
  EXPECT_EQ(dest.back(), '#');
  std::vector<HttpRequest> reqs = server.requests();
  ASSERT_EQ(reqs.size(), 2u);
  EXPECT_EQ(reqs[1].headers["range"], "bytes=1234-6233");
  EXPECT_EQ(reqs[1].headers["if-match"], kEtag);
  EXPECT_EQ(reqs[1].headers.count("authorization"), 0u);
  SourceCounters c = client->counters();
  EXPECT_EQ(c.requests, 2u);
  EXPECT_EQ(c.bytes, 5000u);
  EXPECT_EQ(c.retries, 0u);
}

TEST(SourceClient, AResetResumesOnlyTheMissingTail) {
  const std::string obj = Object(100000);
  std::atomic<int> n{0};
  ScriptedServer server([&](const HttpRequest& r) {
    auto [a, b] = RangeOf(r);
    // The first answer stops after 3000 bytes (the connection closes).
    return Reply{Partial(obj, a, b, kEtag, n++ == 0 ? 3000 : std::string::npos)};
  });
  auto client = Client(3);
  SourceUrl url = Url(server, "x");
  ObjectInfo pinned{obj.size(), kEtag, ""};
  std::string dest(10000, '\0');
  absl::Status s = client->ReadRange(url, pinned, 500, 10000, dest.data());
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(dest, obj.substr(500, 10000));
  std::vector<HttpRequest> reqs = server.requests();
  ASSERT_EQ(reqs.size(), 2u);
  EXPECT_EQ(reqs[0].headers["range"], "bytes=500-10499");
  EXPECT_EQ(reqs[1].headers["range"], "bytes=3500-10499");  // only what was missing
  EXPECT_EQ(client->counters().retries, 1u);
  EXPECT_EQ(client->counters().bytes, 10000u);
}

TEST(SourceClient, FiveHundredsAreRetriedThenUnavailable) {
  const std::string obj = Object(1000);
  std::atomic<int> n{0};
  ScriptedServer server([&](const HttpRequest& r) {
    if (n++ < 2) return Reply{Status(503)};
    auto [a, b] = RangeOf(r);
    return Reply{Partial(obj, a, b, kEtag)};
  });
  SourceUrl url = Url(server, "x");
  ObjectInfo pinned{obj.size(), kEtag, ""};
  std::string dest(100, '\0');
  auto client = Client(2);
  ASSERT_TRUE(client->ReadRange(url, pinned, 0, 100, dest.data()).ok());
  EXPECT_EQ(client->counters().retries, 2u);
  n = 0;
  auto strict = Client(1);
  absl::Status s = strict->ReadRange(url, pinned, 0, 100, dest.data());
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "HTTP 503")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "after 2 attempts")) << s;
  EXPECT_EQ(strict->counters().failures, 1u);
}

TEST(SourceClient, ABodyLongerThanTheRangeNeverWritesPastIt) {
  const std::string obj = Object(1000);
  ScriptedServer server([&](const HttpRequest& r) {
    auto [a, b] = RangeOf(r);
    // Claims the right range but sends 64 bytes more.
    std::string body = obj.substr(a, b - a + 1 + 64);
    return Reply{absl::StrCat("HTTP/1.1 206 P\r\nContent-Length: ", body.size(),
                              "\r\nContent-Range: bytes ", a, "-", b, "/", obj.size(),
                              "\r\nConnection: close\r\n\r\n", body)};
  });
  auto client = Client(2);
  std::string dest(100 + 64, '#');
  absl::Status s = client->ReadRange(Url(server, "x"), ObjectInfo{obj.size(), kEtag, ""}, 10,
                                     100, dest.data());
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_EQ(dest.substr(100), std::string(64, '#'));
  EXPECT_EQ(server.requests().size(), 1u);  // not retried
}

TEST(SourceClient, AWrongContentRangeIsDataLoss) {
  const std::string obj = Object(1000);
  ScriptedServer server([&](const HttpRequest& r) {
    auto [a, b] = RangeOf(r);
    return Reply{Partial(obj, a, b, kEtag, std::string::npos,
                         absl::StrCat("bytes ", a + 1, "-", b + 1, "/", obj.size()))};
  });
  auto client = Client(2);
  std::string dest(100, '#');
  absl::Status s = client->ReadRange(Url(server, "x"), ObjectInfo{obj.size(), kEtag, ""}, 10,
                                     100, dest.data());
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "Content-Range")) << s;
  EXPECT_EQ(dest, std::string(100, '#'));  // refused before a byte was kept
}

TEST(SourceClient, AReplacedObjectIsAbortedNamingBothVersions) {
  const std::string obj = Object(1000);
  ScriptedServer server([&](const HttpRequest& r) {
    if (r.method == "HEAD") return Reply{Head(obj, "\"v2\"")};
    if (r.headers.count("if-match") && r.headers.at("if-match") != "\"v2\"") {
      return Reply{Status(412)};
    }
    auto [a, b] = RangeOf(r);
    return Reply{Partial(obj, a, b, "\"v2\"")};
  });
  auto client = Client(3);
  std::string dest(100, '\0');
  absl::Status s = client->ReadRange(Url(server, "x"), ObjectInfo{obj.size(), kEtag, ""}, 0, 100,
                                     dest.data());
  EXPECT_TRUE(absl::IsAborted(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "changed while loading (ETag \"v1\" -> \"v2\""))
      << s;
}

TEST(SourceClient, ForbiddenNamesTheCredentialsNeverTheSecret) {
  ScriptedServer server([&](const HttpRequest& r) {
    return Reply{Status(403, "<Error><Code>AccessDenied</Code></Error>")};
  });
  auto client = Client(3);
  auto info = client->Head(Url(server, "x"));
  EXPECT_TRUE(absl::IsPermissionDenied(info.status())) << info.status();
  EXPECT_TRUE(absl::StrContains(info.status().message(), "no credentials")) << info.status();
  EXPECT_EQ(server.requests().size(), 1u);
}

TEST(SourceClient, NotFound) {
  ScriptedServer server([&](const HttpRequest&) { return Reply{Status(404)}; });
  auto client = Client(3);
  EXPECT_TRUE(absl::IsNotFound(client->Head(Url(server, "x")).status()));
  EXPECT_EQ(server.requests().size(), 1u);
}

TEST(SourceClient, AStalledRangeIsDeadlineExceeded) {
  const std::string obj = Object(1000);
  ScriptedServer server([&](const HttpRequest& r) {
    auto [a, b] = RangeOf(r);
    // Headers and 10 bytes, then nothing while the socket stays open.
    return Reply{Partial(obj, a, b, kEtag, 10), absl::Seconds(4)};
  });
  auto client = Client(0, /*stall_seconds=*/1);
  std::string dest(100, '\0');
  absl::Status s = client->ReadRange(Url(server, "x"), ObjectInfo{obj.size(), kEtag, ""}, 0, 100,
                                     dest.data());
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
}

TEST(SourceClient, CancelStopsARequestInFlight) {
  const std::string obj = Object(1000);
  ScriptedServer server([&](const HttpRequest& r) {
    auto [a, b] = RangeOf(r);
    return Reply{Partial(obj, a, b, kEtag, 10), absl::Seconds(4)};
  });
  auto client = Client(5, /*stall_seconds=*/30);
  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(300));
    client->Cancel();
  });
  std::string dest(100, '\0');
  absl::Status s = client->ReadRange(Url(server, "x"), ObjectInfo{obj.size(), kEtag, ""}, 0, 100,
                                     dest.data());
  canceller.join();
  EXPECT_TRUE(absl::IsCancelled(s)) << s;
  EXPECT_EQ(server.requests().size(), 1u);
}

TEST(SourceClient, ALoadsCancellationEndsItsRequestAndNoOther) {
  const std::string obj = Object(1000);
  ScriptedServer server([&](const HttpRequest& r) {
    auto [a, b] = RangeOf(r);
    return Reply{Partial(obj, a, b, kEtag, 10), absl::Seconds(4)};
  });
  auto client = Client(5, /*stall_seconds=*/30);
  Cancellation load;
  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(300));
    load.Cancel("the model was unloaded while loading");
  });
  std::string dest(100, '\0');
  const absl::Time start = absl::Now();
  absl::Status s = client->ReadRange(Url(server, "x"), ObjectInfo{obj.size(), kEtag, ""}, 0, 100,
                                     dest.data(), &load);
  canceller.join();
  EXPECT_TRUE(absl::IsCancelled(s)) << s;
  EXPECT_EQ(s.message(), "cancelled: the model was unloaded while loading");
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));  // not the server's 4 s
  EXPECT_EQ(server.requests().size(), 1u);           // and not retried
  EXPECT_EQ(client->counters().failures, 0u);        // an end, not a failure
  // The client serves other loads on.
  ScriptedServer whole([&](const HttpRequest& r) {
    auto [a, b] = RangeOf(r);
    return Reply{Partial(obj, a, b, kEtag), absl::ZeroDuration()};
  });
  EXPECT_TRUE(client->ReadRange(Url(whole, "x"), ObjectInfo{obj.size(), kEtag, ""}, 0, 100,
                                dest.data()).ok());
  EXPECT_EQ(dest, obj.substr(0, 100));
}

}  // namespace
}  // namespace weightd

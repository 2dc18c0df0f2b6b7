#include "server/daemon/handover.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "server/base/log.h"
#include "common/status_macros.h"
#include "common/unix_socket.h"
#include "nlohmann/json.hpp"
#include "server/auth/peer_identity.h"

namespace weightd {
namespace {

enum class Kind : uint8_t {
  kBegin = 1,
  kManifestPart = 2,
  kFds = 3,
  kManifestEnd = 4,
  kReady = 5,
  kGo = 6,
  kStarted = 7,
  kRefused = 8,
  kDone = 9,
};

constexpr char kMagic[4] = {'W', 'D', 'H', '1'};
constexpr size_t kHeaderBytes = 12;
constexpr size_t kPartBytes = 64 << 10;
constexpr uint64_t kMaxPayloadBytes = 1 << 20;       // one message
constexpr uint64_t kMaxManifestBytes = 1ull << 30;   // all its parts
constexpr size_t kMaxFds = 1 << 20;

const char* KindName(Kind k) {
  switch (k) {
    case Kind::kBegin: return "BEGIN";
    case Kind::kManifestPart: return "MANIFEST";
    case Kind::kFds: return "FDS";
    case Kind::kManifestEnd: return "MANIFEST_END";
    case Kind::kReady: return "READY";
    case Kind::kGo: return "GO";
    case Kind::kStarted: return "STARTED";
    case Kind::kRefused: return "REFUSED";
    case Kind::kDone: return "DONE";
  }
  return "?";
}

absl::Status Send(int fd, Kind kind, absl::string_view payload, absl::Span<const int> fds = {}) {
  char header[kHeaderBytes] = {};
  std::memcpy(header, kMagic, 4);
  header[4] = static_cast<char>(kind);
  const uint32_t len = static_cast<uint32_t>(payload.size());
  for (int i = 0; i < 4; ++i) header[8 + i] = static_cast<char>((len >> (8 * i)) & 0xff);
  WD_RETURN_IF_ERROR(SendWithFds(fd, absl::string_view(header, kHeaderBytes), fds));
  if (!payload.empty()) WD_RETURN_IF_ERROR(SendAll(fd, payload.data(), payload.size()));
  return absl::OkStatus();
}

struct Message {
  Kind kind;
  std::string payload;
};

// Waits up to `timeout` for the next message (its fds appended to `fds`).
// The peer closing is UNAVAILABLE, silence DEADLINE_EXCEEDED, a malformed
// header INVALID_ARGUMENT.
absl::StatusOr<Message> Recv(int fd, absl::Duration timeout, std::vector<UniqueFd>* fds) {
  pollfd p{fd, POLLIN, 0};
  const int ms = static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(timeout), INT32_MAX));
  int n;
  do {
    n = ::poll(&p, 1, ms);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return ErrnoStatus(errno, "poll on the hand-over socket");
  if (n == 0) {
    return absl::DeadlineExceededError(
        absl::StrCat("no message on the hand-over socket for ", absl::FormatDuration(timeout)));
  }
  char header[kHeaderBytes];
  std::vector<UniqueFd> got;
  WD_RETURN_IF_ERROR(RecvWithFds(fd, header, kHeaderBytes, &got));
  for (UniqueFd& f : got) fds->push_back(std::move(f));
  if (std::memcmp(header, kMagic, 4) != 0) {
    return absl::InvalidArgumentError("hand-over message without the WDH1 magic");
  }
  uint32_t len = 0;
  for (int i = 0; i < 4; ++i) len |= static_cast<uint32_t>(static_cast<uint8_t>(header[8 + i])) << (8 * i);
  if (len > kMaxPayloadBytes) {
    return absl::InvalidArgumentError(absl::StrCat("hand-over message of ", len, " bytes"));
  }
  Message m{static_cast<Kind>(header[4]), std::string(len, '\0')};
  if (len > 0) WD_RETURN_IF_ERROR(RecvAll(fd, m.payload.data(), len));
  return m;
}

// The next message, which must be of kind `want`.
absl::StatusOr<Message> Expect(int fd, Kind want, absl::Duration timeout,
                               std::vector<UniqueFd>* fds) {
  WD_ASSIGN_OR_RETURN(Message m, Recv(fd, timeout, fds));
  if (m.kind == Kind::kRefused && want != Kind::kRefused) {
    return absl::FailedPreconditionError(absl::StrCat("the running daemon refused: ", m.payload));
  }
  if (m.kind != want) {
    return absl::InvalidArgumentError(absl::StrCat("expected ", KindName(want), ", got ",
                                                   KindName(m.kind), " (kind ",
                                                   static_cast<int>(m.kind), ")"));
  }
  return m;
}

void SetTimeouts(int fd, absl::Duration d) {
  timeval tv = absl::ToTimeval(d);
  (void)::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  (void)::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

// Hex text to bytes; false for anything but an even number of hex digits.
bool FromHex(const std::string& hex, std::string* out) {
  if (hex.size() % 2 != 0) return false;
  for (char c : hex) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) return false;
  }
  *out = absl::HexStringToBytes(hex);
  return true;
}

std::optional<PageKind> ParsePageKind(const std::string& name) {
  for (PageKind k : {PageKind::kSmall, PageKind::kTransparentHuge, PageKind::kHugetlb}) {
    if (name == PageKindName(k)) return k;
  }
  return std::nullopt;
}

}  // namespace

std::string HostName() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "";
  return buf;
}

HandoverOffer MakeHandoverOffer(const std::string& state_dir, int grpc_listen_fd,
                                int data_listen_fd, int handover_listen_fd,
                                const ResidentCheckpoints& resident,
                                uint64_t segment_target_bytes,
                                const std::vector<HandoverModel>& models) {
  HandoverOffer offer;
  nlohmann::json m;
  m["version"] = 1;
  m["state_dir"] = state_dir;
  m["host"] = HostName();
  nlohmann::json served = nlohmann::json::array();
  for (const HandoverModel& model : models) {
    served.push_back({model.name, model.generation, model.content});
  }
  m["models"] = std::move(served);
  m["pid"] = static_cast<int64_t>(::getpid());
  offer.fds = {grpc_listen_fd, data_listen_fd, handover_listen_fd};
  m["grpc_listen_fd"] = 0;
  m["data_listen_fd"] = 1;
  m["handover_listen_fd"] = 2;
  auto snapshot = std::make_shared<
      std::vector<std::pair<std::string, std::shared_ptr<const Checkpoint>>>>(
      resident.Snapshot());
  nlohmann::json checkpoints = nlohmann::json::array();
  for (const auto& [key, checkpoint] : *snapshot) {
    // One whose tensors share other holders' bytes is not laid out by file
    // (ShareHeldTensors): the successor reads its files again.
    if (checkpoint->bytes_held_elsewhere() > 0) continue;
    nlohmann::json c;
    c["files_key"] = absl::BytesToHexString(key);
    c["path"] = checkpoint->path();
    c["segment_target_bytes"] = segment_target_bytes;
    nlohmann::json segments = nlohmann::json::array();
    for (const SegmentPtr& seg : checkpoint->host_segments()) {
      segments.push_back({{"fd", offer.fds.size()}, {"pages", PageKindName(seg->pages())}});
      offer.fds.push_back(seg->fd());
    }
    c["segments"] = std::move(segments);
    // Each tensor's digest and place (segment, offset, length): the
    // successor lays the files out itself and adopts only the same places.
    std::map<const Buffer*, size_t> segment_index;
    for (size_t i = 0; i < checkpoint->host_segments().size(); ++i) {
      segment_index[checkpoint->host_segments()[i].get()] = i;
    }
    nlohmann::json tensors = nlohmann::json::array();
    for (const StoredTensor& t : checkpoint->tensors()) {
      auto seg = segment_index.find(t.buffer.get());
      tensors.push_back({t.name, t.digest.Hex(),
                         seg == segment_index.end() ? -1 : static_cast<int64_t>(seg->second),
                         t.offset, t.length});
    }
    c["tensors"] = std::move(tensors);
    checkpoints.push_back(std::move(c));
  }
  m["checkpoints"] = std::move(checkpoints);
  m["fds"] = offer.fds.size();
  offer.manifest = m.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  offer.keep_alive = snapshot;
  return offer;
}

absl::StatusOr<HandoverReceived> ParseHandoverManifest(const std::string& manifest,
                                                       std::vector<UniqueFd> fds) {
  auto bad = [](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("hand-over manifest: ", what));
  };
  nlohmann::json m = nlohmann::json::parse(manifest, nullptr, /*allow_exceptions=*/false);
  if (!m.is_object()) return bad("not a JSON object");
  try {
    if (m.value("version", 0) != 1) return bad("unknown version");
    HandoverReceived r;
    r.pid = m.at("pid").get<int64_t>();
    r.state_dir = m.at("state_dir").get<std::string>();
    r.host = m.at("host").get<std::string>();
    for (const nlohmann::json& model : m.at("models")) {
      r.models.push_back({model.at(0).get<std::string>(), model.at(1).get<uint64_t>(),
                          model.at(2).get<std::string>()});
    }
    std::sort(r.models.begin(), r.models.end(),
              [](const HandoverModel& a, const HandoverModel& b) { return a.name < b.name; });
    if (m.at("fds").get<uint64_t>() != fds.size()) {
      return bad(absl::StrCat("names ", m.at("fds").get<uint64_t>(), " fds, ", fds.size(),
                              " arrived"));
    }
    std::vector<bool> used(fds.size(), false);
    auto take = [&](uint64_t i) -> absl::StatusOr<UniqueFd> {
      if (i >= fds.size() || used[i]) return bad(absl::StrCat("fd index ", i, " is not usable"));
      used[i] = true;
      return std::move(fds[i]);
    };
    WD_ASSIGN_OR_RETURN(r.grpc_listen_fd, take(m.at("grpc_listen_fd").get<uint64_t>()));
    WD_ASSIGN_OR_RETURN(r.data_listen_fd, take(m.at("data_listen_fd").get<uint64_t>()));
    WD_ASSIGN_OR_RETURN(r.handover_listen_fd,
                        take(m.at("handover_listen_fd").get<uint64_t>()));
    for (const nlohmann::json& c : m.at("checkpoints")) {
      DonatedCheckpoint d;
      std::string key;
      if (!FromHex(c.at("files_key").get<std::string>(), &key)) {
        return bad("a files_key is not hex");
      }
      d.files_key = std::move(key);
      d.segment_target_bytes = c.at("segment_target_bytes").get<uint64_t>();
      for (const nlohmann::json& s : c.at("segments")) {
        WD_ASSIGN_OR_RETURN(UniqueFd fd, take(s.at("fd").get<uint64_t>()));
        std::optional<PageKind> pages = ParsePageKind(s.at("pages").get<std::string>());
        if (!pages.has_value()) return bad("unknown page kind");
        struct stat st;
        if (::fstat(fd.get(), &st) == 0) r.segment_bytes += static_cast<uint64_t>(st.st_size);
        d.segment_fds.push_back(std::move(fd));
        d.segment_pages.push_back(*pages);
      }
      for (const nlohmann::json& t : c.at("tensors")) {
        std::string bytes;
        if (!FromHex(t.at(1).get<std::string>(), &bytes) || bytes.size() != 16) {
          return bad(absl::StrCat("the digest of \"", t.at(0).get<std::string>(),
                                  "\" is not 16 hex bytes"));
        }
        Digest digest;
        std::memcpy(digest.bytes.data(), bytes.data(), 16);
        const std::string name = t.at(0).get<std::string>();
        d.digests[name] = digest;
        d.places[name] = {t.at(2).get<int64_t>(), t.at(3).get<uint64_t>(),
                          t.at(4).get<uint64_t>()};
      }
      r.checkpoints.push_back(std::move(d));
    }
    return r;
  } catch (const nlohmann::json::exception& e) {
    return bad(e.what());
  }
}

// ------------------------------------------------------------- the server

absl::StatusOr<std::unique_ptr<HandoverServer>> HandoverServer::Start(
    const HandoverSocket& where, Hooks hooks, Timeouts timeouts, int adopt_fd) {
  UniqueFd listen_fd;
  if (adopt_fd >= 0) {
    listen_fd.Reset(adopt_fd);
  } else if (where.dir != nullptr) {
    WD_ASSIGN_OR_RETURN(listen_fd, where.dir->ListenUnix(where.name, 0600));
  } else {
    WD_ASSIGN_OR_RETURN(listen_fd, ListenUnix(where.name, 0600));
  }
  // Non-blocking: the predecessor holds the same socket until it exits.
  const int fl = ::fcntl(listen_fd.get(), F_GETFL);
  if (fl < 0 || ::fcntl(listen_fd.get(), F_SETFL, fl | O_NONBLOCK) != 0) {
    return ErrnoStatus(errno, "making the hand-over socket non-blocking");
  }
  UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) return ErrnoStatus(errno, "eventfd");
  auto server = std::unique_ptr<HandoverServer>(new HandoverServer(
      where, std::move(listen_fd), std::move(wake), std::move(hooks), timeouts));
  server->thread_ = std::thread([s = server.get()] { s->Run(); });
  return server;
}

HandoverServer::HandoverServer(HandoverSocket where, UniqueFd listen_fd, UniqueFd wake_fd,
                               Hooks hooks, Timeouts timeouts)
    : where_(std::move(where)),
      listen_fd_(std::move(listen_fd)),
      wake_fd_(std::move(wake_fd)),
      hooks_(std::move(hooks)),
      timeouts_(timeouts) {}

HandoverServer::~HandoverServer() { Stop(); }

void HandoverServer::Stop() {
  if (stopped_.exchange(true)) return;
  uint64_t one = 1;
  (void)!::write(wake_fd_.get(), &one, sizeof(one));
  // A conversation in progress ends now (its successor fails; this daemon
  // is going away anyway).
  if (int fd = conn_fd_.load(); fd >= 0) (void)::shutdown(fd, SHUT_RDWR);
  if (thread_.joinable()) thread_.join();
  listen_fd_.Reset();
  if (!handed_over_.load()) {
    if (where_.dir != nullptr) {
      (void)where_.dir->Remove(where_.name);
    } else {
      ::unlink(where_.name.c_str());
    }
  }
}

void HandoverServer::Run() {
  while (!stopped_.load() && !handed_over_.load()) {
    pollfd pfds[2] = {{wake_fd_.get(), POLLIN, 0}, {listen_fd_.get(), POLLIN, 0}};
    int n = ::poll(pfds, 2, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      WD_LOG(ERROR) << "hand-over socket poll: " << std::strerror(errno);
      return;
    }
    if (pfds[0].revents) return;
    UniqueFd conn(::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!conn.valid()) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) ::usleep(10000);
      continue;
    }
    auto peer = ReadPeerIdentity(conn.get());
    if (!peer.ok() || peer->uid != ::geteuid()) {
      LogEvent(LogLevel::kWarning, "handover_refused",
               {{"peer", peer.ok() ? peer->Describe() : peer.status().ToString()},
                {"reason", "only the daemon's own uid may take over"}});
      (void)Send(conn.get(), Kind::kRefused, "only the daemon's own uid may take over");
      continue;
    }
    conn_fd_.store(conn.get());
    if (stopped_.load()) (void)::shutdown(conn.get(), SHUT_RDWR);
    const bool done = Serve(conn.get());
    conn_fd_.store(-1);
    if (done) handed_over_.store(true);
  }
}

bool HandoverServer::Serve(int fd) {
  SetTimeouts(fd, timeouts_.message);
  std::vector<UniqueFd> unexpected;
  auto begin = Expect(fd, Kind::kBegin, timeouts_.message, &unexpected);
  if (!begin.ok()) {
    LogEvent(LogLevel::kWarning, "handover_failed",
             {{"stage", "BEGIN"}, {"error", begin.status().ToString()}});
    return false;
  }
  int64_t pid = 0;
  std::string host;
  {
    nlohmann::json j = nlohmann::json::parse(begin->payload, nullptr, false);
    if (j.is_object() && j.contains("pid") && j["pid"].is_number_integer()) pid = j["pid"];
    if (j.is_object() && j.contains("host") && j["host"].is_string()) host = j["host"];
  }
  LogEvent(LogLevel::kInfo, "handover_begin",
           {{"successor_pid", absl::StrCat(pid)}, {"successor_host", host}});
  const absl::Time start = absl::Now();
  auto offer = hooks_.begin(pid, host);
  if (!offer.ok()) {
    (void)Send(fd, Kind::kRefused, offer.status().ToString());
    hooks_.resume(offer.status());
    LogEvent(LogLevel::kWarning, "handover_refused",
             {{"successor_pid", absl::StrCat(pid)}, {"error", offer.status().ToString()}});
    return false;
  }
  bool go_sent = false;
  auto fail = [&](absl::string_view stage, const absl::Status& why) {
    if (go_sent && stopped_.load()) {
      // This daemon is stopping and the successor may be serving already:
      // the sockets (and their files) are its.
      abandoned_.store(true);
      LogEvent(LogLevel::kWarning, "handover_abandoned",
               {{"successor_pid", absl::StrCat(pid)}, {"stage", std::string(stage)},
                {"reason", "stopped after GO; the socket files are left to the successor"}});
      return false;
    }
    hooks_.resume(why);
    LogEvent(LogLevel::kWarning, "handover_failed",
             {{"successor_pid", absl::StrCat(pid)},
              {"stage", std::string(stage)},
              {"error", why.ToString()},
              {"action", "serving on"}});
    return false;
  };
  // The manifest in parts, then the fds in batches.
  absl::Status sent;
  for (size_t off = 0; sent.ok() && off < offer->manifest.size(); off += kPartBytes) {
    sent = Send(fd, Kind::kManifestPart, absl::string_view(offer->manifest).substr(off, kPartBytes));
  }
  for (size_t off = 0; sent.ok() && off < offer->fds.size(); off += kMaxFdsPerMessage) {
    const size_t n = std::min(kMaxFdsPerMessage, offer->fds.size() - off);
    sent = Send(fd, Kind::kFds, "", absl::MakeConstSpan(offer->fds).subspan(off, n));
  }
  if (sent.ok()) sent = Send(fd, Kind::kManifestEnd, "");
  offer->keep_alive.reset();
  if (!sent.ok()) return fail("MANIFEST", sent);
  auto ready = Expect(fd, Kind::kReady, timeouts_.restore, &unexpected);
  if (!ready.ok()) return fail("READY", ready.status());
  const uint64_t next_lease_id = hooks_.pause();
  nlohmann::json go = {{"next_lease_id", next_lease_id}};
  go_sent = true;
  if (absl::Status s = Send(fd, Kind::kGo, go.dump()); !s.ok()) return fail("GO", s);
  auto started = Expect(fd, Kind::kStarted, timeouts_.message, &unexpected);
  if (!started.ok()) return fail("STARTED", started.status());
  // DONE: from here the successor is on its own (it commits its journal).
  if (absl::Status s = Send(fd, Kind::kDone, ""); !s.ok()) return fail("DONE", s);
  LogEvent(LogLevel::kInfo, "handed_over",
           {{"successor_pid", absl::StrCat(pid)},
            {"seconds", absl::StrCat(absl::ToDoubleSeconds(absl::Now() - start))}});
  hooks_.handed_over();
  return true;
}

// ------------------------------------------------------------- the client

absl::StatusOr<std::unique_ptr<HandoverClient>> HandoverClient::Begin(
    const HandoverSocket& where, absl::Duration timeout) {
  const std::string path = where.Describe();
  UniqueFd fd;
  if (where.dir != nullptr) {
    auto connected = where.dir->ConnectUnix(where.name);
    if (absl::IsNotFound(connected.status())) {
      return absl::NotFoundError(absl::StrCat("no daemon to take over at ", path, ": ",
                                              connected.status().message()));
    }
    if (!connected.ok()) return connected.status();
    fd = std::move(*connected);
  } else {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (path.size() >= sizeof(addr.sun_path)) {
      return absl::InvalidArgumentError(absl::StrCat("hand-over socket path too long: ", path));
    }
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    fd.Reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd.valid()) return ErrnoStatus(errno, "socket");
    if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
      const int err = errno;
      if (err == ENOENT || err == ECONNREFUSED) {
        return absl::NotFoundError(
            absl::StrCat("no daemon to take over at ", path, ": ", std::strerror(err)));
      }
      return absl::UnavailableError(absl::StrCat("connect ", path, ": ", std::strerror(err)));
    }
  }
  // Sockets and memory are taken only from a daemon of this uid (or root):
  // whoever could bind the path must not hand this daemon its own.
  auto peer = ReadPeerIdentity(fd.get());
  if (!peer.ok()) return Annotate(peer.status(), absl::StrCat("hand-over socket ", path));
  if (peer->uid != ::geteuid() && peer->uid != 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        "the process listening on the hand-over socket ", path, " runs as uid ", peer->uid,
        " (pid ", peer->pid, "), not as this daemon's uid ", ::geteuid(),
        " or root: it may not hand over sockets or memory; nothing was taken. Remove the "
        "socket or stop that process, or start without --take-over"));
  }
  SetTimeouts(fd.get(), timeout);
  nlohmann::json begin = {{"pid", static_cast<int64_t>(::getpid())}, {"host", HostName()}};
  WD_RETURN_IF_ERROR(Send(fd.get(), Kind::kBegin, begin.dump()));
  std::string manifest;
  std::vector<UniqueFd> fds;
  while (true) {
    // The predecessor waits for its changes in flight first.
    WD_ASSIGN_OR_RETURN(Message m, Recv(fd.get(), timeout, &fds));
    if (fds.size() > kMaxFds) return absl::InvalidArgumentError("too many fds handed over");
    if (m.kind == Kind::kRefused) {
      return absl::FailedPreconditionError(
          absl::StrCat("the running daemon refused the hand-over: ", m.payload));
    }
    if (m.kind == Kind::kManifestEnd) break;
    if (m.kind == Kind::kManifestPart) {
      if (manifest.size() + m.payload.size() > kMaxManifestBytes) {
        return absl::InvalidArgumentError("hand-over manifest too large");
      }
      manifest += m.payload;
      continue;
    }
    if (m.kind == Kind::kFds) continue;
    return absl::InvalidArgumentError(
        absl::StrCat("unexpected ", KindName(m.kind), " during the manifest"));
  }
  auto client = std::unique_ptr<HandoverClient>(new HandoverClient(std::move(fd)));
  WD_ASSIGN_OR_RETURN(client->received_, ParseHandoverManifest(manifest, std::move(fds)));
  return client;
}

absl::StatusOr<uint64_t> HandoverClient::Ready(absl::Duration timeout) {
  WD_RETURN_IF_ERROR(Send(fd_.get(), Kind::kReady, ""));
  std::vector<UniqueFd> unexpected;
  WD_ASSIGN_OR_RETURN(Message go, Expect(fd_.get(), Kind::kGo, timeout, &unexpected));
  nlohmann::json j = nlohmann::json::parse(go.payload, nullptr, false);
  if (!j.is_object() || !j.contains("next_lease_id") || !j["next_lease_id"].is_number_unsigned()) {
    return absl::InvalidArgumentError("GO without next_lease_id");
  }
  return j["next_lease_id"].get<uint64_t>();
}

absl::Status HandoverClient::Started(absl::Duration timeout) {
  WD_RETURN_IF_ERROR(Send(fd_.get(), Kind::kStarted, ""));
  std::vector<UniqueFd> unexpected;
  return Expect(fd_.get(), Kind::kDone, timeout, &unexpected).status();
}

}  // namespace weightd

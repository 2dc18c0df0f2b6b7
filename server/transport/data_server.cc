// DataServer's life and polling loop: Start and Stop, accepting, closing,
// reading requests and dispatching them to their handlers (attach_request.cc,
// push_request.cc, export_request.cc, stage_request.cc), answering the
// pushes the push threads finished.
#include "server/transport/data_server.h"

#include <errno.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/base/log.h"
#include "common/status_macros.h"
#include "common/unix_socket.h"
#include "server/push/host_push_writer.h"

namespace weightd {
namespace {

// Back-off after a failed accept() (EMFILE, ENFILE, ENOBUFS, ...): the listen
// socket stays readable, so polling it again at once would spin.
constexpr absl::Duration kAcceptBackoffMin = absl::Milliseconds(10);
constexpr absl::Duration kAcceptBackoffMax = absl::Seconds(1);

// The default total cap: half the open-file limit (the rest is for segments,
// gRPC and the checkpoints), at most kMaxDefaultConnections (every poll()
// round walks all connections).
constexpr size_t kMaxDefaultConnections = 65536;

size_t DefaultMaxConnections() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY) {
    return kMaxDefaultConnections;
  }
  return std::clamp<size_t>(static_cast<size_t>(lim.rlim_cur / 2), 1, kMaxDefaultConnections);
}

// The default cap on exported buffers: a quarter of the open-file limit
// (each keeps an fd), at most 4096.
constexpr size_t kMaxDefaultExportBuffers = 4096;

size_t DefaultMaxExportBuffers() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY) {
    return kMaxDefaultExportBuffers;
  }
  return std::clamp<size_t>(static_cast<size_t>(lim.rlim_cur / 4), 4, kMaxDefaultExportBuffers);
}

ExportCache::Options ExportCacheOptions(size_t max_buffers) {
  if (max_buffers == 0) max_buffers = DefaultMaxExportBuffers();
  return ExportCache::Options{.max_buffers = max_buffers,
                              .max_buffers_per_holder = std::max<size_t>(1, max_buffers / 4)};
}

// The host writer first: every server has one.
std::vector<std::shared_ptr<const PushWriter>> WritersOf(
    HostMemoryManager* host_memory, const std::vector<std::shared_ptr<const PushWriter>>& more) {
  std::vector<std::shared_ptr<const PushWriter>> writers = {
      std::make_shared<HostPushWriter>(host_memory)};
  writers.insert(writers.end(), more.begin(), more.end());
  return writers;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataServer>> DataServer::Start(Options options,
                                                              LeaseTable* leases) {
  if (options.push_threads < 1) options.push_threads = 1;
  if (options.max_connections == 0) options.max_connections = DefaultMaxConnections();
  if (options.max_connections_per_uid == 0) {
    options.max_connections_per_uid = std::max<size_t>(1, options.max_connections / 2);
  }
  UniqueFd listen_fd;
  if (options.adopt_listen_fd >= 0) {
    listen_fd.Reset(options.adopt_listen_fd);
    options.adopt_listen_fd = -1;
  } else {
    WD_ASSIGN_OR_RETURN(listen_fd, ListenUnixWithMode(options.path, options.mode));
  }
  UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) return ErrnoStatus(errno, "eventfd");
  UniqueFd done(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!done.valid()) return ErrnoStatus(errno, "eventfd");
  auto server = std::unique_ptr<DataServer>(new DataServer(
      std::move(options), leases, std::move(listen_fd), std::move(wake), std::move(done)));
  // Memory short: cached exports nobody holds go, as other caches' entries
  // do (rebuilt on demand).
  server->reclaimer_ = server->host_memory_->AddReclaimer(
      MemoryAccount::kRankCache,
      [s = server.get()](uint64_t bytes) { return s->exports_.Reclaim("host", bytes); });
  try {
    server->thread_ = std::thread([s = server.get()] {
      s->Run();
      s->pause_.Exited();
    });
  } catch (const std::system_error& e) {
    ::unlink(server->options_.path.c_str());
    server->stopping_ = true;  // nothing to stop
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot start the data socket's thread: ", e.what()));
  }
  return server;
}

DataServer::DataServer(Options options, LeaseTable* leases, UniqueFd listen_fd, UniqueFd wake_fd,
                       UniqueFd done_fd)
    : options_(std::move(options)),
      leases_(leases),
      own_memory_(options_.host_memory != nullptr
                      ? nullptr
                      : std::make_unique<HostMemoryManager>(HostMemoryManager::Options{})),
      host_memory_(options_.host_memory != nullptr ? options_.host_memory : own_memory_.get()),
      writers_(WritersOf(host_memory_, options_.push_writers)),
      listen_fd_(std::move(listen_fd)),
      wake_fd_(std::move(wake_fd)),
      done_fd_(std::move(done_fd)),
      pause_(wake_fd_.get()),
      exports_(ExportCacheOptions(options_.max_export_buffers)),
      limits_({.max_connections = options_.max_connections,
               .max_connections_per_uid = options_.max_connections_per_uid,
               .max_pushes_per_uid = options_.max_pushes_per_uid}),
      accept_backoff_(kAcceptBackoffMin) {}

DataServer::~DataServer() { Stop(); }

void DataServer::Stop() {
  if (stopping_.exchange(true)) {
    if (thread_.joinable()) thread_.join();
    push_pool_.reset();
    {
      absl::MutexLock lock(&closer_mu_);
      closer_.reset();
    }
    if (uint64_t id = reclaimer_.exchange(0); id != 0) host_memory_->RemoveReclaimer(id);
    return;
  }
  uint64_t one = 1;
  (void)!::write(wake_fd_.get(), &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
  // Run() waited for the pushes in flight (they see stopping_ between
  // copies and end UNAVAILABLE) before closing their connections.
  push_pool_.reset();
  std::unique_ptr<ThreadPool> closer;
  {
    absl::MutexLock lock(&closer_mu_);
    closer = std::move(closer_);
  }
  closer.reset();  // runs what is queued
  if (uint64_t id = reclaimer_.exchange(0); id != 0) host_memory_->RemoveReclaimer(id);
  if (!keep_file_.load()) ::unlink(options_.path.c_str());
}

void DataServer::Discard(std::vector<UniqueFd> fds) {
  if (fds.empty()) return;
  absl::MutexLock lock(&closer_mu_);
  if (closer_ == nullptr && !stopping_.load()) {
    try {
      closer_ = std::make_unique<ThreadPool>(1);
    } catch (const std::system_error&) {
      // At the thread limit: closed here after all.
    }
  }
  if (closer_ == nullptr) return;  // `fds` closes them
  auto owned = std::make_shared<std::vector<UniqueFd>>(std::move(fds));
  closer_->Schedule([owned] { owned->clear(); });
}

void DataServer::Finish(PushDone done) {
  {
    absl::MutexLock lock(&done_mu_);
    done_.push_back(std::move(done));
  }
  uint64_t one = 1;
  (void)!::write(done_fd_.get(), &one, sizeof(one));
}

void DataServer::Close(Connections::iterator it) {
  size_t ended = leases_->ReleaseConnection(it->second.id());
  if (ended > 0) {
    LogEvent(LogLevel::kDebug, "lease_end",
             {{"connection", absl::StrCat(it->second.id())},
              {"leases", absl::StrCat(ended)},
              {"reason", "data connection closed"}});
  }
  if (it->second.counted()) limits_.Leave(it->second.peer().uid);
  conns_.erase(it);
  open_.fetch_sub(1);
}

void DataServer::Refuse(UniqueFd fd, const PeerIdentity& peer, const absl::Status& why) {
  Connection c(std::move(fd), /*id=*/0, peer, /*counted=*/false, absl::OkStatus());
  c.QueueReply(why);
  (void)c.Flush();
  ++refused_since_log_;
  absl::Time now = absl::Now();
  if (now - refusal_logged_ >= absl::Seconds(1)) {
    LogEvent(LogLevel::kWarning, "data_connection_refused",
             {{"peer", peer.Describe()},
              {"error", std::string(why.message())},
              {"refused", absl::StrCat(refused_since_log_)}});
    refusal_logged_ = now;
    refused_since_log_ = 0;
  }
}

void DataServer::AcceptAll() {
  while (true) {
    int fd = ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      int err = errno;
      if (err == EINTR || err == ECONNABORTED) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) return;
      // Out of fds or memory: leave the listen socket alone for a while
      // (its backlog waits) instead of polling it again at once.
      if (accept_backoff_ == kAcceptBackoffMin) {
        LogEvent(LogLevel::kWarning, "data_accept_failed",
                 {{"error", std::strerror(err)}, {"connections", absl::StrCat(conns_.size())}});
      }
      accept_resume_ = absl::Now() + accept_backoff_;
      accept_backoff_ = std::min(accept_backoff_ * 2, kAcceptBackoffMax);
      return;
    }
    accept_backoff_ = kAcceptBackoffMin;
    Admit(UniqueFd(fd));
  }
}

void DataServer::Admit(UniqueFd fd) {
  PeerIdentity peer;
  absl::Status admitted;
  bool counted = false;
  if (absl::StatusOr<PeerIdentity> read = ReadPeerIdentity(fd.get()); !read.ok()) {
    admitted = read.status();
  } else {
    peer = *std::move(read);
    if (absl::Status capped = limits_.Admit(peer.uid, conns_.size()); !capped.ok()) {
      Refuse(std::move(fd), peer, capped);
      return;
    }
    counted = true;
    if (options_.authorize) admitted = options_.authorize(peer);
  }
  if (!admitted.ok()) {
    LogEvent(LogLevel::kWarning, "data_peer_refused",
             {{"peer", peer.Describe()}, {"error", admitted.ToString()}});
  }
  const int raw = fd.get();
  conns_.emplace(raw, Connection(std::move(fd), next_id_++, std::move(peer), counted,
                                 std::move(admitted)));
  open_.fetch_add(1);
}

bool DataServer::Serve(Connection& c) {
  switch (c.Receive()) {
    case Connection::Part::kClosed:
      return false;
    case Connection::Part::kNothing:
      return true;
    case Connection::Part::kCudaTarget:
      OnPushHeader(c);
      return true;
    case Connection::Part::kOffsets:
      StartPush(c);
      return true;
    case Connection::Part::kHeader:
      Dispatch(c);
      return true;
  }
  return true;
}

void DataServer::Dispatch(Connection& c) {
  const char* magic = c.request().magic;
  const bool push = std::memcmp(magic, kPushMagic, 4) == 0;
  const bool cuda_push = std::memcmp(magic, kCudaPushMagic, 4) == 0;
  if (push && c.admitted().ok()) {
    OnPushHeader(c);
    return;
  }
  if (cuda_push && c.admitted().ok()) {
    c.ExpectCudaTarget();  // then OnPushHeader
    return;
  }
  // Only a push carries fds.
  Discard(c.TakeFds());
  const bool stage = std::memcmp(magic, kStageMagic, 4) == 0;
  if (!stage && !push && !cuda_push && std::memcmp(magic, kAttachMagic, 4) != 0) {
    c.QueueReply(absl::InvalidArgumentError("bad attach request magic"));
    c.CloseAfterReply();
    return;
  }
  if (!c.admitted().ok()) {
    c.QueueReply(c.admitted());
    c.CloseAfterReply();
    return;
  }
  if (stage) {
    ServeStage(c);
  } else {
    ServeAttach(c);
  }
}

void DataServer::AnswerPushes() {
  uint64_t count;
  (void)!::read(done_fd_.get(), &count, sizeof(count));
  std::vector<PushDone> done;
  {
    absl::MutexLock lock(&done_mu_);
    done.swap(done_);
  }
  for (PushDone& d : done) {
    limits_.EndPush(d.uid);
    auto it = conns_.find(d.fd);
    if (it == conns_.end() || it->second.id() != d.connection) continue;
    Connection& c = it->second;
    c.set_pushing(false);
    if (d.status.ok() && d.exported.valid()) {
      AnswerExport(c, d);
    } else {
      c.QueueReply(d.status);
    }
    absl::Status sent = c.Flush();
    if (!sent.ok()) Close(it);
  }
}

bool DataServer::ServeReady(Connection& c) {
  if (!c.replying() && !Serve(c)) return false;
  absl::Status sent = c.Flush();
  if (!sent.ok()) {
    WD_LOG(WARNING) << "data connection " << c.id() << ": " << sent;
    return false;
  }
  return !c.finished();
}

bool DataServer::PollOnce(std::vector<pollfd>& pfds) {
  const absl::Time now = absl::Now();
  const bool accepting = pause_.AcceptAllowed() && now >= accept_resume_;
  pfds.clear();
  pfds.push_back({wake_fd_.get(), POLLIN, 0});
  // A negative fd is ignored by poll(): the listen socket while backing off.
  pfds.push_back({accepting ? listen_fd_.get() : -1, POLLIN, 0});
  pfds.push_back({done_fd_.get(), POLLIN, 0});
  for (auto& [fd, c] : conns_) {
    // A connection whose push is running is answered when it ends; until
    // then it is not polled (a peer that hung up would wake poll at once).
    if (c.pushing()) continue;
    pfds.push_back({fd, static_cast<short>(c.replying() ? POLLOUT : POLLIN), 0});
  }
  int timeout_ms = -1;
  if (now < accept_resume_) {
    timeout_ms = static_cast<int>(absl::ToInt64Milliseconds(accept_resume_ - now)) + 1;
  }
  int n = ::poll(pfds.data(), pfds.size(), timeout_ms);
  if (n < 0) {
    if (errno == EINTR) return true;
    WD_LOG(ERROR) << "data socket poll: " << std::strerror(errno);
    return false;
  }
  if (pfds[0].revents) {
    // Stop(), or a pause or resume: seen at the top of the loop.
    uint64_t count;
    (void)!::read(wake_fd_.get(), &count, sizeof(count));
    return true;
  }
  if (pfds[1].revents & POLLIN) AcceptAll();
  if (pfds[2].revents & POLLIN) AnswerPushes();
  for (size_t i = 3; i < pfds.size(); ++i) {
    if (pfds[i].revents == 0) continue;
    auto it = conns_.find(pfds[i].fd);
    if (it == conns_.end() || it->second.pushing()) continue;
    if (!ServeReady(it->second)) Close(it);
  }
  return true;
}

void DataServer::Run() {
  std::vector<pollfd> pfds;
  while (!stopping_.load()) {
    if (!PollOnce(pfds)) break;
  }
  Drain();
}

void DataServer::Drain() {
  // Pushes in flight end soon (they see stopping_ between copies): wait
  // for them, answer what can be answered, then close — so no client sees
  // its connection end while the daemon still writes its memory.
  auto pushing = [&] {
    for (auto& [fd, c] : conns_) {
      if (c.pushing()) return true;
    }
    return false;
  };
  while (pushing()) {
    pollfd done{done_fd_.get(), POLLIN, 0};
    if (::poll(&done, 1, 100) > 0) AnswerPushes();
  }
  while (!conns_.empty()) Close(conns_.begin());
}

}  // namespace weightd

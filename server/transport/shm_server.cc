#include "server/transport/shm_server.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <sys/resource.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <system_error>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "common/log.h"
#include "absl/strings/str_cat.h"
#include "common/data_protocol.h"
#include "common/status_macros.h"
#include "server/gpu/cuda_push.h"
#include "server/memory/huge_pages.h"
#include "server/transport/host_push.h"

namespace weightd {
namespace {

// Back-off after a failed accept() (EMFILE, ENFILE, ENOBUFS, ...): the listen
// socket stays readable, so polling it again at once would spin.
constexpr absl::Duration kAcceptBackoffMin = absl::Milliseconds(10);
constexpr absl::Duration kAcceptBackoffMax = absl::Seconds(1);

// One message of a reply not yet (fully) sent: its fds ride on its first byte.
struct Outgoing {
  std::string bytes;
  std::vector<int> fds;
  size_t sent = 0;
};

// The most fds one request may carry: a push carries one; more arrive only
// from a client that errs, and are refused (the excess is closed by the
// kernel: MSG_CTRUNC).
constexpr size_t kMaxFdsPerRequest = 4;

struct Connection {
  UniqueFd fd;
  uint64_t id = 0;
  AttachRequest request{};
  size_t received = 0;
  // A push's offsets, read after its header; the fds that came with the
  // request so far (and whether the kernel dropped some: too many).
  std::vector<uint64_t> offsets;
  size_t offsets_received = 0;  // bytes
  bool reading_offsets = false;
  // A CUDA push's target, read after its header (before its offsets).
  CudaPushTarget cuda_target{};
  size_t target_received = 0;
  bool reading_target = false;
  bool cuda_push = false;
  std::shared_ptr<const LeaseContents> push_lease;
  std::vector<UniqueFd> fds_in;
  bool fds_truncated = false;
  bool pushing = false;  // on a push thread: read nothing, poll nothing
  PeerIdentity peer;
  bool counted = false;   // counted against peer.uid's cap
  absl::Status admitted;  // not OK: every request gets this answer
  // The reply being sent. Requests are read only while it is empty, so a
  // client that does not read its replies holds one reply, no more.
  std::deque<Outgoing> out;
  std::vector<BufferPtr> pinned;  // keeps the fds in `out` open
  std::vector<UniqueFd> owned;    // as pinned, fds of the daemon's own (staging)
  // The exported buffers this connection took: held while it is open.
  std::vector<ExportHold> exports;
  bool close_after_reply = false;
};

// The fds of a lease's buffers, in order, each held in `pinned` until its
// reply is sent. The data socket carries host memory (the client maps each
// memfd); a buffer of another kind is refused, never copied behind the
// client's back.
absl::Status SharedFds(const LeaseContents& lease, std::vector<int>* fds,
                       std::vector<BufferPtr>* pinned) {
  std::vector<int> out;
  for (size_t i = 0; i < lease.buffers.size(); ++i) {
    const BufferPtr& buffer = lease.buffers[i];
    if (buffer->kind() != MemoryKind::kHost) {
      return absl::UnimplementedError(absl::StrCat(
          "segment ", i, " is in ", MemoryKindName(buffer->kind()),
          " memory; the data socket attaches host memory only"));
    }
    absl::StatusOr<int> fd = buffer->ShareableFd();
    if (!fd.ok()) return fd.status();
    out.push_back(*fd);
  }
  *fds = std::move(out);
  pinned->insert(pinned->end(), lease.buffers.begin(), lease.buffers.end());
  return absl::OkStatus();
}

// Queues the reply to one request: the header and message carry the first
// batch of fds, each further batch rides on one byte of its own.
void QueueReply(Connection* c, const absl::Status& status, absl::Span<const int> fds,
                absl::string_view payload = {}) {
  // An OK reply's message is its payload (an export's ExportInfo).
  std::string msg(status.ok() ? payload : status.message().substr(0, kMaxReplyMessage));
  AttachReply reply;
  std::memcpy(reply.magic, kReplyMagic, 4);
  reply.code = static_cast<int32_t>(status.code());
  reply.num_fds = static_cast<uint32_t>(fds.size());
  reply.message_len = static_cast<uint32_t>(msg.size());
  Outgoing first;
  first.bytes.assign(reinterpret_cast<const char*>(&reply), sizeof(reply));
  first.bytes += msg;
  size_t n = std::min(fds.size(), kMaxFdsPerMessage);
  first.fds.assign(fds.begin(), fds.begin() + n);
  c->out.push_back(std::move(first));
  for (size_t done = n; done < fds.size(); done += kMaxFdsPerMessage) {
    Outgoing more;
    more.bytes = "F";
    size_t k = std::min(kMaxFdsPerMessage, fds.size() - done);
    more.fds.assign(fds.begin() + done, fds.begin() + done + k);
    c->out.push_back(std::move(more));
  }
}

// Receives what the socket has of `size` bytes into `buf` without blocking.
// Fds are taken only with a request's first byte (`first`), where a push's
// rides: any sent with later bytes are discarded by the kernel (no control
// buffer: MSG_CTRUNC), so a client trickling bytes with fds cannot pile up
// the daemon's fds. Returns the bytes received; 0 with `*closed` when the
// peer closed (or the connection broke), 0 otherwise when nothing is there
// yet.
size_t TryRecv(Connection* c, void* buf, size_t size, bool first, bool* closed) {
  *closed = false;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerRequest)];
  iovec iov{buf, size};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (first) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
  }
  ssize_t got = ::recvmsg(c->fd.get(), &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
  for (cmsghdr* h = CMSG_FIRSTHDR(&msg); got >= 0 && h != nullptr; h = CMSG_NXTHDR(&msg, h)) {
    if (h->cmsg_level != SOL_SOCKET || h->cmsg_type != SCM_RIGHTS) continue;
    size_t n = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const auto* fds = reinterpret_cast<const int*>(CMSG_DATA(h));
    for (size_t i = 0; i < n; ++i) {
      int fd;
      std::memcpy(&fd, fds + i, sizeof(fd));
      c->fds_in.emplace_back(fd);
    }
  }
  if (got > 0 && (msg.msg_flags & MSG_CTRUNC)) c->fds_truncated = true;
  if (got <= 0) {
    *closed = true;
    return 0;
  }
  return static_cast<size_t>(got);
}

// Sends what the socket takes of the queued reply. OK with `out` empty: all
// sent; OK with `out` not empty: the socket is full (poll for POLLOUT).
absl::Status Flush(Connection* c) {
  while (!c->out.empty()) {
    Outgoing& o = c->out.front();
    absl::string_view rest(o.bytes.data() + o.sent, o.bytes.size() - o.sent);
    absl::Span<const int> fds;
    if (o.sent == 0) fds = o.fds;
    WD_ASSIGN_OR_RETURN(size_t n, TrySendWithFds(c->fd.get(), rest, fds));
    if (n == 0) return absl::OkStatus();
    o.sent += n;
    if (o.sent == o.bytes.size()) c->out.pop_front();
  }
  c->pinned.clear();
  c->owned.clear();
  return absl::OkStatus();
}

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

}  // namespace

absl::StatusOr<std::unique_ptr<ShmDataServer>> ShmDataServer::Start(Options options,
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
  auto server = std::unique_ptr<ShmDataServer>(new ShmDataServer(
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

ShmDataServer::ShmDataServer(Options options, LeaseTable* leases, UniqueFd listen_fd,
                             UniqueFd wake_fd, UniqueFd done_fd)
    : options_(std::move(options)),
      leases_(leases),
      own_memory_(options_.host_memory != nullptr
                      ? nullptr
                      : std::make_unique<HostMemoryManager>(HostMemoryManager::Options{})),
      host_memory_(options_.host_memory != nullptr ? options_.host_memory : own_memory_.get()),
      listen_fd_(std::move(listen_fd)),
      wake_fd_(std::move(wake_fd)),
      done_fd_(std::move(done_fd)),
      pause_(wake_fd_.get()),
      exports_(ExportCacheOptions(options_.max_export_buffers)) {}

ShmDataServer::~ShmDataServer() { Stop(); }

void ShmDataServer::Stop() {
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

void ShmDataServer::Discard(std::vector<UniqueFd> fds) {
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

void ShmDataServer::Push(int conn_fd, uint64_t connection, uid_t uid,
                         std::shared_ptr<const LeaseContents> lease,
                         std::vector<uint64_t> offsets, int dest,
                         std::optional<CudaPushTarget> cuda) {
  absl::Time start = absl::Now();
  uint64_t bytes = 0;
  absl::Status status = [&]() -> absl::Status {
    WD_ASSIGN_OR_RETURN(PushLayout layout, LayoutForPush(*lease, offsets));
    for (uint64_t len : layout.lengths) bytes += len;
    if (cuda.has_value()) return PushToCuda(*lease, layout, *cuda, dest, Gpus(), &stopping_);
    return PushToHost(*lease, layout, dest, &stopping_);
  }();
  if (dest >= 0) {
    std::vector<UniqueFd> done;
    done.emplace_back(dest);
    Discard(std::move(done));
  }
  if (status.ok() && options_.on_push) options_.on_push(bytes);
  if (LogEnabled(LogLevel::kDebug) || !status.ok()) {
    LogEvent(status.ok() ? LogLevel::kDebug : LogLevel::kWarning, "push",
             {{"connection", absl::StrCat(connection)},
              {"memory", cuda.has_value() ? "cuda" : "host"},
              {"model", lease->model},
              {"generation", absl::StrCat(lease->generation)},
              {"bytes", absl::StrCat(bytes)},
              {"ms", absl::StrCat(absl::ToDoubleMilliseconds(absl::Now() - start))},
              {"status", status.ok() ? std::string("OK") : status.ToString()}});
  }
  Finish(PushDone{conn_fd, connection, uid, std::move(status)});
}

const GpuInventory& ShmDataServer::Gpus() const {
  static const GpuInventory kNone{.unavailable = "no GPU inventory was given"};
  return options_.gpus != nullptr ? *options_.gpus : kNone;
}

void ShmDataServer::Finish(PushDone done) {
  {
    absl::MutexLock lock(&done_mu_);
    done_.push_back(std::move(done));
  }
  uint64_t one = 1;
  (void)!::write(done_fd_.get(), &one, sizeof(one));
}

uint64_t ShmDataServer::ExportBudget(const GpuDevice* gpu) const {
  if (options_.export_budget != 0) return options_.export_budget;
  if (gpu != nullptr) {
    // A quarter of the GPU: the rest is its clients' (a GPU's memory has no
    // reclaimer here; unheld buffers go only for another export).
    constexpr uint64_t kUnknownGpuMemory = uint64_t{4} << 30;
    return std::max<uint64_t>(1, (gpu->memory_bytes != 0 ? gpu->memory_bytes
                                                         : kUnknownGpuMemory) / 4);
  }
  // Half the host budget: the other half is for what exports are made of.
  const uint64_t limit = host_memory_->account()->limit();
  if (limit != 0) return std::max<uint64_t>(1, limit / 2);
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return uint64_t{1} << 30;
  return std::max<uint64_t>(1, static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) / 4);
}

absl::StatusOr<std::unique_ptr<ExportedBuffer>> ShmDataServer::FillHostExport(
    const LeaseContents& lease, const PushLayout& layout, uint64_t size) {
  // Charged to the host budget (the reclaimers run first when it is short:
  // unheld exports among them), faulted in now (no page is allocated later
  // by a write), filled while no client has its fd, then sealed.
  WD_ASSIGN_OR_RETURN(std::unique_ptr<Segment> segment,
                      host_memory_->Allocate(size, {.purpose = "export", .prefault = true}));
  WD_RETURN_IF_ERROR(
      CopyLeaseToHost(lease, layout, segment->mutable_data(), segment->size(), &stopping_));
  WD_RETURN_IF_ERROR(segment->Seal(/*populate=*/false));
  auto out = std::make_unique<ExportedBuffer>();
  out->size = segment->size();
  out->segment = std::move(segment);
  return out;
}

void ShmDataServer::Export(int conn_fd, uint64_t connection, uid_t uid,
                           std::shared_ptr<const LeaseContents> lease, CudaPushTarget target) {
  absl::Time start = absl::Now();
  bool filled = false;
  std::string device = "host";
  ExportInfo info{};
  absl::StatusOr<ExportHold> got = [&]() -> absl::StatusOr<ExportHold> {
    WD_ASSIGN_OR_RETURN(PushLayout layout, LayoutForPush(*lease, {}));
    info.layout_size = layout.size;
    bool host = true;
    for (uint8_t b : target.gpu_uuid) host &= b == 0;
    ExportCache::Fill fill;
    uint64_t size = 0;
    uint64_t budget = 0;
    if (host) {
      const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
      size = std::max<uint64_t>(1, (layout.size + page - 1) / page) * page;
      // Budgeted as the pages it will get (a huge segment is whole 2 MiB).
      const MemoryAccount& account = *host_memory_->account();
      const std::vector<PageKind> kinds =
          PageKindsToTry(account.huge_pages(), account.shmem_thp(), size);
      if (!kinds.empty() && kinds.front() != PageKind::kSmall) size = RoundUpToHugePage(size);
      budget = ExportBudget(nullptr);
      fill = [&, size] { return FillHostExport(*lease, layout, size); };
    } else {
      WD_ASSIGN_OR_RETURN(GpuDevice gpu, CheckCudaExport(target, layout, Gpus()));
      device = gpu.uuid;
      // The allocation is rounded up to the device's granularity (2 MiB on
      // every current GPU) by the plugin; budgeted as that.
      constexpr uint64_t kGranule = uint64_t{2} << 20;
      size = std::max<uint64_t>(1, (layout.size + kGranule - 1) / kGranule) * kGranule;
      budget = ExportBudget(&gpu);
      fill = [&, gpu]() -> absl::StatusOr<std::unique_ptr<ExportedBuffer>> {
        WD_ASSIGN_OR_RETURN(CudaExport made, ExportToCuda(*lease, layout, gpu, &stopping_));
        auto out = std::make_unique<ExportedBuffer>();
        out->fd = std::move(made.fd);
        out->size = made.size;
        out->release = std::move(made.release);
        return out;
      };
    }
    const uint64_t share = options_.max_export_bytes_per_uid != 0
                               ? options_.max_export_bytes_per_uid
                               : std::max<uint64_t>(1, budget / 2);
    return exports_.Get(ExportRequest{.table = lease->tensors,
                                      .device = device,
                                      .size = size,
                                      .holder = uid,
                                      .device_bytes = budget,
                                      .holder_bytes = share},
                        fill, &filled);
  }();
  absl::Status status = got.status();
  ExportHold exported;
  if (got.ok()) {
    exported = *std::move(got);
    info.size = exported.buffer().size;
  }
  LogEvent(status.ok() ? LogLevel::kInfo : LogLevel::kWarning, "export",
           {{"connection", absl::StrCat(connection)},
            {"memory", device},
            {"model", lease->model},
            {"generation", absl::StrCat(lease->generation)},
            {"bytes", absl::StrCat(info.size)},
            {"filled", filled ? "yes" : "no (cached)"},
            {"device_bytes", absl::StrCat(exports_.bytes(device))},
            {"uid", absl::StrCat(uid)},
            {"uid_bytes", absl::StrCat(exports_.held_bytes(device, uid))},
            {"ms", absl::StrCat(absl::ToDoubleMilliseconds(absl::Now() - start))},
            {"status", status.ok() ? std::string("OK") : status.ToString()}});
  Finish(PushDone{conn_fd, connection, uid, std::move(status), std::move(exported), info});
}

void ShmDataServer::Run() {
  std::map<int, Connection> conns;  // by fd
  absl::flat_hash_map<uid_t, size_t> per_uid;
  absl::flat_hash_map<uid_t, size_t> pushes_by_uid;  // queued or running
  uint64_t next_id = 1;
  absl::Time accept_resume = absl::InfinitePast();
  absl::Duration accept_backoff = kAcceptBackoffMin;
  absl::Time refusal_logged = absl::InfinitePast();
  uint64_t refused_since_log = 0;
  auto close_conn = [&](std::map<int, Connection>::iterator it) {
    size_t ended = leases_->ReleaseConnection(it->second.id);
    if (ended > 0) {
      LogEvent(LogLevel::kDebug, "lease_end",
               {{"connection", absl::StrCat(it->second.id)},
                {"leases", absl::StrCat(ended)},
                {"reason", "data connection closed"}});
    }
    if (it->second.counted) {
      auto u = per_uid.find(it->second.peer.uid);
      if (--u->second == 0) per_uid.erase(u);
    }
    conns.erase(it);
    open_.fetch_sub(1);
  };
  // A connection past a cap: answered at once (its socket buffer is empty,
  // so the reply fits) and closed; a client reads the reply when it reads.
  auto refuse = [&](UniqueFd fd, const PeerIdentity& peer, const absl::Status& why) {
    Connection c;
    c.fd = std::move(fd);
    QueueReply(&c, why, {});
    (void)Flush(&c);
    ++refused_since_log;
    absl::Time now = absl::Now();
    if (now - refusal_logged >= absl::Seconds(1)) {
      LogEvent(LogLevel::kWarning, "data_connection_refused",
               {{"peer", peer.Describe()},
                {"error", std::string(why.message())},
                {"refused", absl::StrCat(refused_since_log)}});
      refusal_logged = now;
      refused_since_log = 0;
    }
  };
  auto accept_all = [&] {
    while (true) {
      int fd = ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        int err = errno;
        if (err == EINTR || err == ECONNABORTED) continue;
        if (err == EAGAIN || err == EWOULDBLOCK) return;
        // Out of fds or memory: leave the listen socket alone for a while
        // (its backlog waits) instead of polling it again at once.
        if (accept_backoff == kAcceptBackoffMin) {
          LogEvent(LogLevel::kWarning, "data_accept_failed",
                   {{"error", std::strerror(err)},
                    {"connections", absl::StrCat(conns.size())}});
        }
        accept_resume = absl::Now() + accept_backoff;
        accept_backoff = std::min(accept_backoff * 2, kAcceptBackoffMax);
        return;
      }
      accept_backoff = kAcceptBackoffMin;
      UniqueFd owned(fd);
      Connection c;
      auto peer = ReadPeerIdentity(fd);
      if (!peer.ok()) {
        c.admitted = peer.status();
      } else {
        c.peer = std::move(*peer);
        if (conns.size() >= options_.max_connections) {
          refuse(std::move(owned), c.peer,
                 absl::ResourceExhaustedError(absl::StrCat(
                     "the data socket has ", conns.size(),
                     " connections open, its limit (--max-data-connections); a lease's "
                     "connection closes when its lease is released")));
          continue;
        }
        size_t& mine = per_uid[c.peer.uid];
        if (mine >= options_.max_connections_per_uid) {
          refuse(std::move(owned), c.peer,
                 absl::ResourceExhaustedError(absl::StrCat(
                     "uid ", c.peer.uid, " has ", options_.max_connections_per_uid,
                     " data connections open, its limit (--max-data-connections-per-uid); a "
                     "lease's connection closes when its lease is released")));
          continue;
        }
        ++mine;
        c.counted = true;
        if (options_.authorize) c.admitted = options_.authorize(c.peer);
      }
      if (!c.admitted.ok()) {
        LogEvent(LogLevel::kWarning, "data_peer_refused",
                 {{"peer", c.peer.Describe()}, {"error", c.admitted.ToString()}});
      }
      c.id = next_id++;
      c.fd = std::move(owned);
      conns.emplace(fd, std::move(c));
      open_.fetch_add(1);
    }
  };
  // Hands a push whose request is complete to a push thread, or answers
  // why not.
  auto start_push = [&](Connection& c) {
    std::shared_ptr<const LeaseContents> lease = std::move(c.push_lease);
    std::vector<uint64_t> offsets = std::move(c.offsets);
    c.offsets.clear();
    c.offsets_received = 0;
    c.reading_offsets = false;
    std::vector<UniqueFd> fds = std::move(c.fds_in);
    c.fds_in.clear();
    if (fds.size() > 1) c.fds_truncated = true;  // one at most is ever wanted
    std::optional<CudaPushTarget> cuda;
    if (c.cuda_push) cuda = c.cuda_target;
    c.cuda_push = false;
    if (cuda.has_value() && cuda->handle_kind == kCudaDaemonExport &&
        (!fds.empty() || !offsets.empty() || cuda->size != 0 || c.fds_truncated)) {
      QueueReply(&c,
                 absl::InvalidArgumentError(
                     "an export carries no fd, no offsets (the default layout) and size 0: the "
                     "daemon owns its buffer"),
                 {});
      c.fds_truncated = false;
      Discard(std::move(fds));
      return;
    }
    // A host push carries its memfd; a CUDA push its VMM fd, or none with a
    // legacy handle (PushToCuda says which it wanted).
    const bool fd_ok = cuda.has_value() ? fds.size() <= 1 : fds.size() == 1;
    if (c.fds_truncated || !fd_ok) {
      QueueReply(&c,
                 absl::InvalidArgumentError(absl::StrCat(
                     cuda.has_value() ? "a CUDA push carries at most one fd (its VMM allocation's)"
                                      : "a push carries exactly one fd (its destination memfd)",
                     "; this one carried ",
                     c.fds_truncated ? "more" : absl::StrCat(fds.size()))),
                 {});
      c.fds_truncated = false;
      Discard(std::move(fds));
      return;
    }
    size_t& mine = pushes_by_uid[c.peer.uid];
    if (options_.max_pushes_per_uid != 0 && mine >= options_.max_pushes_per_uid) {
      QueueReply(&c,
                 absl::ResourceExhaustedError(absl::StrCat(
                     "uid ", c.peer.uid, " has ", mine,
                     " pushes queued or running, its limit (--max-pushes-per-uid)")),
                 {});
      Discard(std::move(fds));
      return;
    }
    if (push_pool_ == nullptr) {
      try {
        push_pool_ = std::make_unique<ThreadPool>(options_.push_threads);
      } catch (const std::system_error& e) {
        QueueReply(&c,
                   absl::ResourceExhaustedError(absl::StrCat(
                       "cannot start the push threads (", e.what(),
                       "): the daemon is at its thread limit (pids cgroup, TasksMax, "
                       "RLIMIT_NPROC)")),
                   {});
        Discard(std::move(fds));
        return;
      }
    }
    c.pushing = true;
    ++mine;
    int dest = fds.empty() ? -1 : fds[0].release();
    if (cuda.has_value() && cuda->handle_kind == kCudaDaemonExport) {
      push_pool_->Schedule([this, fd = c.fd.get(), id = c.id, uid = c.peer.uid,
                            lease = std::move(lease), target = *cuda]() mutable {
        Export(fd, id, uid, std::move(lease), target);
      });
      return;
    }
    push_pool_->Schedule([this, fd = c.fd.get(), id = c.id, uid = c.peer.uid,
                          lease = std::move(lease), offsets = std::move(offsets), dest,
                          cuda]() mutable {
      Push(fd, id, uid, std::move(lease), std::move(offsets), dest, cuda);
    });
  };
  // The header of a push arrived: checks it and its lease; reads its
  // offsets next, or starts it.
  auto push_header = [&](Connection& c) {
    PushRequest req;
    std::memcpy(&req, &c.request, sizeof(req));
    absl::Status status;
    if (options_.authorize_attach) status = options_.authorize_attach(c.peer, req.lease_id);
    std::shared_ptr<const LeaseContents> lease;
    if (status.ok()) {
      absl::string_view token(reinterpret_cast<const char*>(req.token), 16);
      auto contents = leases_->Attach(req.lease_id, token, c.id, /*for_push=*/true);
      status = contents.status();
      if (contents.ok()) lease = *std::move(contents);
    }
    const size_t tensors = lease == nullptr || lease->tensors == nullptr ? 0
                                                                          : lease->tensors->size();
    if (status.ok() && req.num_offsets != 0 && req.num_offsets != tensors) {
      status = absl::InvalidArgumentError(absl::StrCat(
          "the push names ", req.num_offsets, " offsets but lease ", req.lease_id, " has ",
          tensors, " tensors (0 offsets = the default layout)"));
    }
    if (!status.ok()) {
      if (absl::IsPermissionDenied(status)) {
        LogEvent(LogLevel::kWarning, "attach_refused",
                 {{"peer", c.peer.Describe()},
                  {"lease", absl::StrCat(req.lease_id)},
                  {"error", std::string(status.message())}});
      }
      Discard(std::move(c.fds_in));
      c.fds_in.clear();
      c.fds_truncated = false;
      QueueReply(&c, status, {});
      // Offsets may follow that nobody reads: the stream is lost.
      if (req.num_offsets != 0) c.close_after_reply = true;
      return;
    }
    c.push_lease = std::move(lease);
    if (req.num_offsets == 0) {
      start_push(c);
      return;
    }
    c.offsets.assign(req.num_offsets, 0);
    c.offsets_received = 0;
    c.reading_offsets = true;
  };
  // Reads (part of) one request and queues its reply. False: close it.
  auto serve = [&](Connection& c) -> bool {
    bool closed = false;
    if (c.reading_target) {
      auto* buf = reinterpret_cast<uint8_t*>(&c.cuda_target);
      size_t got = TryRecv(&c, buf + c.target_received, sizeof(CudaPushTarget) - c.target_received,
                           /*first=*/false, &closed);
      if (closed) return false;
      c.target_received += got;
      if (c.target_received == sizeof(CudaPushTarget)) {
        c.reading_target = false;
        c.target_received = 0;
        c.cuda_push = true;
        push_header(c);
      }
      return true;
    }
    if (c.reading_offsets) {
      auto* buf = reinterpret_cast<uint8_t*>(c.offsets.data());
      const size_t want = c.offsets.size() * sizeof(uint64_t);
      size_t got = TryRecv(&c, buf + c.offsets_received, want - c.offsets_received,
                           /*first=*/false, &closed);
      if (closed) return false;
      c.offsets_received += got;
      if (c.offsets_received == want) start_push(c);
      return true;
    }
    auto* buf = reinterpret_cast<uint8_t*>(&c.request);
    size_t got = TryRecv(&c, buf + c.received, sizeof(AttachRequest) - c.received,
                         /*first=*/c.received == 0, &closed);
    if (closed) return false;
    c.received += got;
    if (c.received < sizeof(AttachRequest)) return true;
    c.received = 0;
    if (std::memcmp(c.request.magic, kPushMagic, 4) == 0 && c.admitted.ok()) {
      c.cuda_push = false;
      push_header(c);
      return true;
    }
    if (std::memcmp(c.request.magic, kCudaPushMagic, 4) == 0 && c.admitted.ok()) {
      c.reading_target = true;  // then push_header
      c.target_received = 0;
      return true;
    }
    // Only a push carries fds.
    Discard(std::move(c.fds_in));
    c.fds_in.clear();
    c.fds_truncated = false;
    const bool stage = std::memcmp(c.request.magic, kStageMagic, 4) == 0;
    if (!stage && std::memcmp(c.request.magic, kAttachMagic, 4) != 0 &&
        std::memcmp(c.request.magic, kPushMagic, 4) != 0 &&
        std::memcmp(c.request.magic, kCudaPushMagic, 4) != 0) {
      QueueReply(&c, absl::InvalidArgumentError("bad attach request magic"), {});
      c.close_after_reply = true;
      return true;
    }
    if (!c.admitted.ok()) {
      QueueReply(&c, c.admitted, {});
      c.close_after_reply = true;
      return true;
    }
    if (stage) {
      // StageRequest: same layout as AttachRequest (session in lease_id).
      absl::StatusOr<UniqueFd> fd = absl::UnimplementedError(
          "this daemon hands out no publish staging memory");
      if (options_.stage) {
        fd = options_.stage(c.peer, c.request.lease_id,
                            absl::string_view(reinterpret_cast<const char*>(c.request.token), 16));
      }
      if (!fd.ok()) {
        LogEvent(LogLevel::kWarning, "stage_refused",
                 {{"peer", c.peer.Describe()},
                  {"session", absl::StrCat(c.request.lease_id)},
                  {"error", std::string(fd.status().message())}});
        QueueReply(&c, fd.status(), {});
        return true;
      }
      const int raw = fd->get();
      c.owned.push_back(std::move(*fd));
      QueueReply(&c, absl::OkStatus(), {&raw, 1});
      return true;
    }
    absl::Status status;
    if (options_.authorize_attach) status = options_.authorize_attach(c.peer, c.request.lease_id);
    std::vector<int> fds;
    if (status.ok()) {
      absl::string_view token(reinterpret_cast<const char*>(c.request.token), 16);
      auto contents = leases_->Attach(c.request.lease_id, token, c.id);
      status = contents.status();
      if (contents.ok()) status = SharedFds(**contents, &fds, &c.pinned);
    }
    if (!status.ok() && absl::IsPermissionDenied(status)) {
      LogEvent(LogLevel::kWarning, "attach_refused",
               {{"peer", c.peer.Describe()},
                {"lease", absl::StrCat(c.request.lease_id)},
                {"error", std::string(status.message())}});
    }
    QueueReply(&c, status, fds);
    return true;
  };
  // Answers the pushes the push threads finished.
  auto answer_pushes = [&] {
    uint64_t count;
    (void)!::read(done_fd_.get(), &count, sizeof(count));
    std::vector<PushDone> done;
    {
      absl::MutexLock lock(&done_mu_);
      done.swap(done_);
    }
    for (PushDone& d : done) {
      auto counted = pushes_by_uid.find(d.uid);
      if (counted != pushes_by_uid.end() && --counted->second == 0) pushes_by_uid.erase(counted);
      auto it = conns.find(d.fd);
      if (it == conns.end() || it->second.id != d.connection) continue;
      Connection& c = it->second;
      c.pushing = false;
      if (d.status.ok() && d.exported.valid()) {
        // The client's own fd of the buffer; the connection holds the buffer.
        UniqueFd fd(::fcntl(d.exported.buffer().export_fd(), F_DUPFD_CLOEXEC, 0));
        if (!fd.valid()) {
          QueueReply(&c, absl::ResourceExhaustedError(absl::StrCat(
                             "duplicating the export's fd: ", std::strerror(errno))),
                     {});
        } else {
          const int raw = fd.get();
          c.owned.push_back(std::move(fd));
          c.exports.push_back(std::move(d.exported));
          QueueReply(&c, absl::OkStatus(), {&raw, 1},
                     absl::string_view(reinterpret_cast<const char*>(&d.info), sizeof(d.info)));
        }
      } else {
        QueueReply(&c, d.status, {});
      }
      absl::Status sent = Flush(&c);
      if (!sent.ok()) close_conn(it);
    }
  };
  std::vector<pollfd> pfds;
  while (!stopping_.load()) {
    const absl::Time now = absl::Now();
    const bool accepting = pause_.AcceptAllowed() && now >= accept_resume;
    pfds.clear();
    pfds.push_back({wake_fd_.get(), POLLIN, 0});
    // A negative fd is ignored by poll(): the listen socket while backing off.
    pfds.push_back({accepting ? listen_fd_.get() : -1, POLLIN, 0});
    pfds.push_back({done_fd_.get(), POLLIN, 0});
    for (auto& [fd, c] : conns) {
      // A connection whose push is running is answered when it ends; until
      // then it is not polled (a peer that hung up would wake poll at once).
      if (c.pushing) continue;
      pfds.push_back({fd, static_cast<short>(c.out.empty() ? POLLIN : POLLOUT), 0});
    }
    int timeout_ms = -1;
    if (now < accept_resume) {
      timeout_ms = static_cast<int>(absl::ToInt64Milliseconds(accept_resume - now)) + 1;
    }
    int n = ::poll(pfds.data(), pfds.size(), timeout_ms);
    if (n < 0) {
      if (errno == EINTR) continue;
      WD_LOG(ERROR) << "data socket poll: " << std::strerror(errno);
      break;
    }
    if (pfds[0].revents) {
      // Stop(), or a pause or resume: seen at the top of the loop.
      uint64_t count;
      (void)!::read(wake_fd_.get(), &count, sizeof(count));
      continue;
    }
    if (pfds[1].revents & POLLIN) accept_all();
    if (pfds[2].revents & POLLIN) answer_pushes();
    for (size_t i = 3; i < pfds.size(); ++i) {
      if (pfds[i].revents == 0) continue;
      auto it = conns.find(pfds[i].fd);
      if (it == conns.end()) continue;
      Connection& c = it->second;
      if (c.pushing) continue;
      if (c.out.empty() && !serve(c)) {
        close_conn(it);
        continue;
      }
      absl::Status sent = Flush(&c);
      if (!sent.ok()) {
        WD_LOG(WARNING) << "data connection " << c.id << ": " << sent;
        close_conn(it);
        continue;
      }
      if (c.out.empty() && c.close_after_reply) close_conn(it);
    }
  }
  // Pushes in flight end soon (they see stopping_ between copies): wait
  // for them, answer what can be answered, then close — so no client sees
  // its connection end while the daemon still writes its memory.
  auto pushing = [&] {
    for (auto& [fd, c] : conns) {
      if (c.pushing) return true;
    }
    return false;
  };
  while (pushing()) {
    pollfd done{done_fd_.get(), POLLIN, 0};
    if (::poll(&done, 1, 100) > 0) answer_pushes();
  }
  while (!conns.empty()) close_conn(conns.begin());
}

}  // namespace weightd

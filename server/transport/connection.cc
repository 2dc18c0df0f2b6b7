#include "server/transport/connection.h"

#include <errno.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/unix_socket.h"

namespace weightd {

Connection::Connection(UniqueFd fd, uint64_t id, PeerIdentity peer, bool counted,
                       absl::Status admitted)
    : fd_(std::move(fd)),
      id_(id),
      peer_(std::move(peer)),
      counted_(counted),
      admitted_(std::move(admitted)) {}

Connection::Part Connection::Receive() {
  if (reading_target_) {
    const Part part = ReceiveInto(&cuda_target_, sizeof(CudaPushTarget), &target_received_,
                                  /*fds=*/false, Part::kCudaTarget);
    if (part == Part::kCudaTarget) {
      reading_target_ = false;
      target_received_ = 0;
      cuda_push_ = true;
    }
    return part;
  }
  if (reading_offsets_) {
    return ReceiveInto(offsets_.data(), offsets_.size() * sizeof(uint64_t), &offsets_received_,
                       /*fds=*/false, Part::kOffsets);
  }
  const Part part = ReceiveInto(&request_, sizeof(AttachRequest), &received_,
                                /*fds=*/received_ == 0, Part::kHeader);
  if (part == Part::kHeader) received_ = 0;
  return part;
}

Connection::Part Connection::ReceiveInto(void* part, size_t size, size_t* received, bool fds,
                                         Part done) {
  bool closed = false;
  const size_t got =
      TryRecv(static_cast<uint8_t*>(part) + *received, size - *received, fds, &closed);
  if (closed) return Part::kClosed;
  *received += got;
  return *received == size ? done : Part::kNothing;
}

// Fds are taken only with a request's first byte (`first`), where a push's
// rides: any sent with later bytes are discarded by the kernel (no control
// buffer: MSG_CTRUNC), so a client trickling bytes with fds cannot pile up
// the daemon's fds. 0 without `*closed` when nothing is there yet.
size_t Connection::TryRecv(void* buf, size_t size, bool first, bool* closed) {
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
  ssize_t got = ::recvmsg(fd_.get(), &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
  for (cmsghdr* h = CMSG_FIRSTHDR(&msg); got >= 0 && h != nullptr; h = CMSG_NXTHDR(&msg, h)) {
    if (h->cmsg_level != SOL_SOCKET || h->cmsg_type != SCM_RIGHTS) continue;
    size_t n = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const auto* fds = reinterpret_cast<const int*>(CMSG_DATA(h));
    for (size_t i = 0; i < n; ++i) {
      int fd;
      std::memcpy(&fd, fds + i, sizeof(fd));
      fds_in_.emplace_back(fd);
    }
  }
  if (got > 0 && (msg.msg_flags & MSG_CTRUNC)) fds_truncated_ = true;
  if (got <= 0) {
    *closed = true;
    return 0;
  }
  return static_cast<size_t>(got);
}

void Connection::ExpectCudaTarget() {
  reading_target_ = true;
  target_received_ = 0;
}

void Connection::ExpectOffsets(uint32_t count) {
  offsets_.assign(count, 0);
  offsets_received_ = 0;
  reading_offsets_ = true;
}

std::vector<UniqueFd> Connection::TakeFds(bool* truncated) {
  std::vector<UniqueFd> fds = std::move(fds_in_);
  fds_in_.clear();
  if (truncated != nullptr) *truncated = fds_truncated_;
  fds_truncated_ = false;
  return fds;
}

void Connection::HoldPushLease(std::shared_ptr<const LeaseContents> lease) {
  push_lease_ = std::move(lease);
}

PendingPush Connection::TakePush() {
  PendingPush push;
  push.lease = std::move(push_lease_);
  push_lease_.reset();
  push.offsets = std::move(offsets_);
  offsets_.clear();
  offsets_received_ = 0;
  reading_offsets_ = false;
  push.fds = TakeFds(&push.fds_truncated);
  if (push.fds.size() > 1) push.fds_truncated = true;  // one at most is ever wanted
  if (cuda_push_) push.cuda = cuda_target_;
  cuda_push_ = false;
  return push;
}

void Connection::QueueReply(const absl::Status& status, absl::Span<const int> fds,
                            absl::string_view payload) {
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
  out_.push_back(std::move(first));
  for (size_t done = n; done < fds.size(); done += kMaxFdsPerMessage) {
    Outgoing more;
    more.bytes = "F";
    size_t k = std::min(kMaxFdsPerMessage, fds.size() - done);
    more.fds.assign(fds.begin() + done, fds.begin() + done + k);
    out_.push_back(std::move(more));
  }
}

void Connection::Pin(absl::Span<const BufferPtr> buffers) {
  pinned_.insert(pinned_.end(), buffers.begin(), buffers.end());
}

void Connection::KeepUntilSent(UniqueFd fd) { owned_.push_back(std::move(fd)); }

absl::Status Connection::Flush() {
  while (!out_.empty()) {
    Outgoing& o = out_.front();
    absl::string_view rest(o.bytes.data() + o.sent, o.bytes.size() - o.sent);
    absl::Span<const int> fds;
    if (o.sent == 0) fds = o.fds;
    WD_ASSIGN_OR_RETURN(size_t n, TrySendWithFds(fd_.get(), rest, fds));
    if (n == 0) return absl::OkStatus();
    o.sent += n;
    if (o.sent == o.bytes.size()) out_.pop_front();
  }
  pinned_.clear();
  owned_.clear();
  return absl::OkStatus();
}

absl::Status ConnectionLimits::Admit(uid_t uid, size_t open) {
  if (open >= options_.max_connections) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the data socket has ", open,
                     " connections open, its limit (--max-data-connections); a lease's "
                     "connection closes when its lease is released"));
  }
  size_t& mine = connections_[uid];
  if (mine >= options_.max_connections_per_uid) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "uid ", uid, " has ", options_.max_connections_per_uid,
        " data connections open, its limit (--max-data-connections-per-uid); a "
        "lease's connection closes when its lease is released"));
  }
  ++mine;
  return absl::OkStatus();
}

void ConnectionLimits::Leave(uid_t uid) {
  auto it = connections_.find(uid);
  if (it != connections_.end() && --it->second == 0) connections_.erase(it);
}

absl::Status ConnectionLimits::StartPush(uid_t uid) {
  size_t& mine = pushes_[uid];
  if (options_.max_pushes_per_uid != 0 && mine >= options_.max_pushes_per_uid) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "uid ", uid, " has ", mine,
        " pushes queued or running, its limit (--max-pushes-per-uid)"));
  }
  ++mine;
  return absl::OkStatus();
}

void ConnectionLimits::EndPush(uid_t uid) {
  auto it = pushes_.find(uid);
  if (it != pushes_.end() && --it->second == 0) pushes_.erase(it);
}

}  // namespace weightd

#include "client/data_socket.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/data_protocol.h"
#include "common/file_opener.h"
#include "common/push_layout.h"
#include "common/status_macros.h"
#include "common/unix_socket.h"

namespace weightd {
namespace {

template <typename T>
std::string Bytes(const T& frame) {
  return std::string(reinterpret_cast<const char*>(&frame), sizeof(frame));
}

// A memfd of `size` bytes whose pages are allocated now (the client's), its
// size sealed: the daemon takes only a destination whose size cannot
// change under its writes.
absl::StatusOr<UniqueFd> AllocatePushDestination(uint64_t size) {
  UniqueFd fd(::memfd_create("weightd-push", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return ErrnoStatus(errno, "memfd_create");
  if (size > 0) {
    if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) {
      return ErrnoStatus(errno, "sizing the push destination");
    }
    int err = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(size));
    if (err != 0) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "allocating ", size, " bytes for the push destination: ", std::strerror(err)));
    }
  }
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    return ErrnoStatus(errno, "sealing the push destination's size");
  }
  return fd;
}

}  // namespace

absl::StatusOr<std::string> EncodeLeaseRequest(const char (&magic)[4], uint64_t lease_id,
                                               absl::string_view token) {
  // AttachRequest and PushRequest share their layout; num_offsets 0 is the
  // default layout, and an attach's reserved word is 0 too.
  PushRequest req{};
  std::memcpy(req.magic, magic, 4);
  req.num_offsets = 0;
  req.lease_id = lease_id;
  if (token.size() != sizeof(req.token)) {
    return absl::InternalError("daemon sent a lease token of the wrong size");
  }
  std::memcpy(req.token, token.data(), sizeof(req.token));
  return Bytes(req);
}

absl::StatusOr<std::string> EncodeStageRequest(uint64_t session, absl::string_view token) {
  StageRequest req{};
  std::memcpy(req.magic, kStageMagic, 4);
  req.session = session;
  if (token.size() != sizeof(req.token)) {
    return absl::InternalError("daemon sent a publish token of the wrong size");
  }
  std::memcpy(req.token, token.data(), sizeof(req.token));
  return Bytes(req);
}

std::string EncodeCudaPushTarget(const uint8_t (&gpu_uuid)[16], uint64_t size,
                                 uint32_t handle_kind) {
  CudaPushTarget target{};
  static_assert(sizeof(target.gpu_uuid) == sizeof(gpu_uuid));
  std::memcpy(target.gpu_uuid, gpu_uuid, sizeof(target.gpu_uuid));
  target.size = size;
  target.handle_kind = handle_kind;
  return Bytes(target);
}

absl::Status Exchange(int conn, absl::string_view request, absl::Span<const int> send_fds,
                      uint32_t* num_fds, std::vector<UniqueFd>* fds) {
  absl::Status sent = send_fds.empty() ? SendAll(conn, request.data(), request.size())
                                       : SendWithFds(conn, request, send_fds);
  AttachReply reply{};
  absl::Status got = RecvWithFds(conn, &reply, sizeof(reply), fds);
  if (!got.ok() && !sent.ok()) return sent;
  WD_RETURN_IF_ERROR_CTX(got, "reading the data socket reply");
  if (std::memcmp(reply.magic, kReplyMagic, 4) != 0) {
    return absl::InternalError("bad reply magic on the data socket");
  }
  if (reply.message_len > kMaxReplyMessage) {
    return absl::InternalError("oversized reply message on the data socket");
  }
  std::string msg(reply.message_len, '\0');
  if (!msg.empty()) WD_RETURN_IF_ERROR(RecvWithFds(conn, msg.data(), msg.size(), fds));
  if (reply.code != 0) return absl::Status(static_cast<absl::StatusCode>(reply.code), msg);
  *num_fds = reply.num_fds;
  return absl::OkStatus();
}

std::string DataSocketFor(const std::string& socket_path, const std::string& data_socket,
                          const std::string& data_socket_name) {
  if (socket_path.empty() || data_socket_name.empty()) return data_socket;
  std::string dir = socket_path;
  if (char* real = ::realpath(socket_path.c_str(), nullptr); real != nullptr) {
    dir = real;
    std::free(real);
  }
  return JoinPath(Dirname(dir), data_socket_name);
}

absl::Status AttachLease(const std::string& path, const v1::FetchResponse& resp, UniqueFd* conn,
                         std::vector<UniqueFd>* fds) {
  WD_ASSIGN_OR_RETURN(*conn, ConnectUnix(path));
  WD_ASSIGN_OR_RETURN(std::string req,
                      EncodeLeaseRequest(kAttachMagic, resp.lease_id(), resp.token()));
  uint32_t num_fds = 0;
  WD_RETURN_IF_ERROR(Exchange(conn->get(), req, {}, &num_fds, fds));
  while (fds->size() < num_fds) {
    char byte;
    WD_RETURN_IF_ERROR(RecvWithFds(conn->get(), &byte, 1, fds));
  }
  if (fds->size() != static_cast<size_t>(resp.segment_sizes_size())) {
    return absl::InternalError(absl::StrCat("daemon passed ", fds->size(), " fds for ",
                                            resp.segment_sizes_size(), " segments"));
  }
  return absl::OkStatus();
}

absl::Status PushIntoNewMemfd(const v1::FetchResponse& resp, UniqueFd* memfd, MappedRegion* map,
                              std::vector<uint64_t>* offsets) {
  std::vector<uint64_t> lengths;
  for (const v1::ShardTensor& t : resp.tensors()) lengths.push_back(t.length());
  WD_ASSIGN_OR_RETURN(PushLayout layout, DefaultPushLayout(lengths));
  WD_ASSIGN_OR_RETURN(UniqueFd fd, AllocatePushDestination(layout.size));
  WD_ASSIGN_OR_RETURN(UniqueFd conn, ConnectUnix(resp.data_socket()));
  WD_ASSIGN_OR_RETURN(std::string req,
                      EncodeLeaseRequest(kPushMagic, resp.lease_id(), resp.token()));
  const int dest = fd.get();
  uint32_t num_fds = 0;
  std::vector<UniqueFd> stray;  // a push's reply carries none
  WD_RETURN_IF_ERROR(Exchange(conn.get(), req, {&dest, 1}, &num_fds, &stray));
  WD_ASSIGN_OR_RETURN(*map, MappedRegion::Map(fd.get(), layout.size,
                                              MappedRegion::Mode::kReadWrite));
  *memfd = std::move(fd);
  *offsets = std::move(layout.offsets);
  return absl::OkStatus();
}

absl::StatusOr<UniqueFd> TakeStaging(const std::string& path, const v1::PublishSession& session) {
  if (path.empty()) {
    return absl::FailedPreconditionError(
        "the daemon named no data socket; publish with the grpc transport");
  }
  WD_ASSIGN_OR_RETURN(UniqueFd conn, ConnectUnix(path));
  WD_ASSIGN_OR_RETURN(std::string req,
                      EncodeStageRequest(session.session(),
                                         absl::HexStringToBytes(session.token())));
  uint32_t num_fds = 0;
  std::vector<UniqueFd> fds;
  WD_RETURN_IF_ERROR(Exchange(conn.get(), req, {}, &num_fds, &fds));
  if (num_fds != 1 || fds.size() != 1) {
    return absl::InternalError(
        absl::StrCat("daemon passed ", fds.size(), " fds for a staging memfd"));
  }
  return std::move(fds[0]);
}

}  // namespace weightd

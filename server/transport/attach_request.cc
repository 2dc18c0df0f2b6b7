// WDA1 (common/data_protocol.h AttachRequest): the fds of a lease's
// segments, for the client to map; the lease is tied to the connection from
// then on.
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/base/log.h"
#include "server/transport/data_server.h"

namespace weightd {
namespace {

// The fds of a lease's buffers, in order. The data socket carries host
// memory (the client maps each memfd); a buffer of another kind is refused,
// never copied behind the client's back.
absl::Status SharedFds(const LeaseContents& lease, std::vector<int>* fds) {
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
  return absl::OkStatus();
}

}  // namespace

void DataServer::LogAttachRefused(const PeerIdentity& peer, uint64_t lease_id,
                                  const absl::Status& status) {
  if (!absl::IsPermissionDenied(status)) return;
  LogEvent(LogLevel::kWarning, "attach_refused",
           {{"peer", peer.Describe()},
            {"lease", absl::StrCat(lease_id)},
            {"error", std::string(status.message())}});
}

void DataServer::ServeAttach(Connection& c) {
  const AttachRequest& req = c.request();
  absl::Status status;
  if (options_.authorize_attach) status = options_.authorize_attach(c.peer(), req.lease_id);
  std::vector<int> fds;
  if (status.ok()) {
    absl::string_view token(reinterpret_cast<const char*>(req.token), 16);
    auto contents = leases_->Attach(req.lease_id, token, c.id());
    status = contents.status();
    if (contents.ok()) {
      status = SharedFds(**contents, &fds);
      // Each fd stays open until the reply carrying it is sent.
      if (status.ok()) c.Pin((*contents)->buffers);
    }
  }
  LogAttachRefused(c.peer(), req.lease_id, status);
  c.QueueReply(status, fds);
}

}  // namespace weightd

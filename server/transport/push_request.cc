// WDP1 and WDC1 (common/data_protocol.h PushRequest, CudaPushTarget): the
// lease written into the client's own memory — its memfd, or its GPU
// allocation — by whichever PushWriter serves the target
// (server/push/push_writer.h), on a push thread. An export (WDC1 with handle
// kind kCudaDaemonExport) shares the request's reading and goes on in
// export_request.cc.
#include <cstring>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/base/log.h"
#include "common/status_macros.h"
#include "server/push/push_plan.h"
#include "server/transport/data_server.h"

namespace weightd {

void DataServer::OnPushHeader(Connection& c) {
  PushRequest req;
  std::memcpy(&req, &c.request(), sizeof(req));
  absl::Status status;
  if (options_.authorize_attach) status = options_.authorize_attach(c.peer(), req.lease_id);
  std::shared_ptr<const LeaseContents> lease;
  if (status.ok()) {
    absl::string_view token(reinterpret_cast<const char*>(req.token), 16);
    auto contents = leases_->Attach(req.lease_id, token, c.id(), /*for_push=*/true);
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
    LogAttachRefused(c.peer(), req.lease_id, status);
    Discard(c.TakePush().fds);
    c.QueueReply(status);
    // Offsets may follow that nobody reads: the stream is lost.
    if (req.num_offsets != 0) c.CloseAfterReply();
    return;
  }
  c.HoldPushLease(std::move(lease));
  if (req.num_offsets == 0) {
    StartPush(c);
    return;
  }
  c.ExpectOffsets(req.num_offsets);
}

void DataServer::StartPush(Connection& c) {
  PendingPush push = c.TakePush();
  if (push.cuda.has_value() && push.cuda->handle_kind == kCudaDaemonExport) {
    StartExport(c, std::move(push));
    return;
  }
  // A host push carries its memfd; a CUDA push its VMM fd, or none with a
  // legacy handle (its writer says which it wanted).
  const bool cuda = push.cuda.has_value();
  const bool fd_ok = cuda ? push.fds.size() <= 1 : push.fds.size() == 1;
  if (push.fds_truncated || !fd_ok) {
    c.QueueReply(absl::InvalidArgumentError(absl::StrCat(
        cuda ? "a CUDA push carries at most one fd (its VMM allocation's)"
             : "a push carries exactly one fd (its destination memfd)",
        "; this one carried ",
        push.fds_truncated ? "more" : absl::StrCat(push.fds.size()))));
    Discard(std::move(push.fds));
    return;
  }
  QueuePush(c, std::move(push), &DataServer::RunPush);
}

void DataServer::QueuePush(Connection& c, PendingPush push, void (DataServer::*run)(PushTask)) {
  if (absl::Status limited = limits_.StartPush(c.peer().uid); !limited.ok()) {
    c.QueueReply(limited);
    Discard(std::move(push.fds));
    return;
  }
  if (push_pool_ == nullptr) {
    try {
      push_pool_ = std::make_unique<ThreadPool>(options_.push_threads);
    } catch (const std::system_error& e) {
      limits_.EndPush(c.peer().uid);
      c.QueueReply(absl::ResourceExhaustedError(
          absl::StrCat("cannot start the push threads (", e.what(),
                       "): the daemon is at its thread limit (pids cgroup, TasksMax, "
                       "RLIMIT_NPROC)")));
      Discard(std::move(push.fds));
      return;
    }
  }
  c.set_pushing(true);
  PushTask task{.conn_fd = c.fd(),
                .connection = c.id(),
                .uid = c.peer().uid,
                .lease = std::move(push.lease),
                .offsets = std::move(push.offsets),
                .cuda = push.cuda,
                .dest = push.fds.empty() ? -1 : push.fds[0].release()};
  push_pool_->Schedule(
      [this, run, task = std::move(task)]() mutable { (this->*run)(std::move(task)); });
}

void DataServer::RunPush(PushTask task) {
  absl::Time start = absl::Now();
  uint64_t bytes = 0;
  absl::Status status = [&]() -> absl::Status {
    WD_ASSIGN_OR_RETURN(PushLayout layout, LayoutForPush(*task.lease, task.offsets));
    for (uint64_t len : layout.lengths) bytes += len;
    return writers_.Push(*task.lease, layout, PushTarget{.cuda = task.cuda, .fd = task.dest},
                         &stopping_);
  }();
  if (task.dest >= 0) {
    std::vector<UniqueFd> done;
    done.emplace_back(task.dest);
    Discard(std::move(done));
  }
  if (status.ok() && options_.on_push) options_.on_push(bytes);
  if (LogEnabled(LogLevel::kDebug) || !status.ok()) {
    LogEvent(status.ok() ? LogLevel::kDebug : LogLevel::kWarning, "push",
             {{"connection", absl::StrCat(task.connection)},
              {"memory", task.cuda.has_value() ? "cuda" : "host"},
              {"model", task.lease->model},
              {"generation", absl::StrCat(task.lease->generation)},
              {"bytes", absl::StrCat(bytes)},
              {"ms", absl::StrCat(absl::ToDoubleMilliseconds(absl::Now() - start))},
              {"status", status.ok() ? std::string("OK") : status.ToString()}});
  }
  Finish(PushDone{task.conn_fd, task.connection, task.uid, std::move(status)});
}

}  // namespace weightd

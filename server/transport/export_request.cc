// WDC1 with handle kind kCudaDaemonExport (common/data_protocol.h): a buffer
// the daemon owns, filled with the lease at the default layout by the
// PushWriter of the device the request names (server/push/push_writer.h),
// shared by every export of the same fetch table to the same device
// (server/push/export_cache.h) and held while the connection that took it
// is open.
#include <fcntl.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/base/log.h"
#include "common/status_macros.h"
#include "server/push/push_plan.h"
#include "server/transport/data_server.h"

namespace weightd {

void DataServer::StartExport(Connection& c, PendingPush push) {
  if (!push.fds.empty() || !push.offsets.empty() || push.cuda->size != 0 ||
      push.fds_truncated) {
    c.QueueReply(absl::InvalidArgumentError(
        "an export carries no fd, no offsets (the default layout) and size 0: the daemon owns "
        "its buffer"));
    Discard(std::move(push.fds));
    return;
  }
  QueuePush(c, std::move(push), &DataServer::RunExport);
}

void DataServer::RunExport(PushTask task) {
  absl::Time start = absl::Now();
  bool filled = false;
  std::string device = "host";
  ExportInfo info{};
  absl::StatusOr<ExportHold> got = [&]() -> absl::StatusOr<ExportHold> {
    WD_ASSIGN_OR_RETURN(PushLayout layout, LayoutForPush(*task.lease, {}));
    info.layout_size = layout.size;
    WD_ASSIGN_OR_RETURN(ExportPlan plan,
                        writers_.PlanExport(task.lease, layout, *task.cuda, &stopping_));
    device = plan.device;
    const uint64_t budget =
        options_.export_budget != 0 ? options_.export_budget : plan.default_budget;
    const uint64_t share = options_.max_export_bytes_per_uid != 0
                               ? options_.max_export_bytes_per_uid
                               : std::max<uint64_t>(1, budget / 2);
    return exports_.Get(ExportRequest{.table = task.lease->tensors,
                                      .device = device,
                                      .size = plan.size,
                                      .holder = task.uid,
                                      .device_bytes = budget,
                                      .holder_bytes = share},
                        plan.fill, &filled);
  }();
  absl::Status status = got.status();
  ExportHold exported;
  if (got.ok()) {
    exported = *std::move(got);
    info.size = exported.buffer().size;
  }
  LogEvent(status.ok() ? LogLevel::kInfo : LogLevel::kWarning, "export",
           {{"connection", absl::StrCat(task.connection)},
            {"memory", device},
            {"model", task.lease->model},
            {"generation", absl::StrCat(task.lease->generation)},
            {"bytes", absl::StrCat(info.size)},
            {"filled", filled ? "yes" : "no (cached)"},
            {"device_bytes", absl::StrCat(exports_.bytes(device))},
            {"uid", absl::StrCat(task.uid)},
            {"uid_bytes", absl::StrCat(exports_.held_bytes(device, task.uid))},
            {"ms", absl::StrCat(absl::ToDoubleMilliseconds(absl::Now() - start))},
            {"status", status.ok() ? std::string("OK") : status.ToString()}});
  Finish(PushDone{task.conn_fd, task.connection, task.uid, std::move(status),
                  std::move(exported), info});
}

void DataServer::AnswerExport(Connection& c, PushDone& done) {
  // The client's own fd of the buffer; the connection holds the buffer.
  UniqueFd fd(::fcntl(done.exported.buffer().export_fd(), F_DUPFD_CLOEXEC, 0));
  if (!fd.valid()) {
    c.QueueReply(absl::ResourceExhaustedError(
        absl::StrCat("duplicating the export's fd: ", std::strerror(errno))));
    return;
  }
  const int raw = fd.get();
  c.KeepUntilSent(std::move(fd));
  c.HoldExport(std::move(done.exported));
  c.QueueReply(absl::OkStatus(), {&raw, 1},
               absl::string_view(reinterpret_cast<const char*>(&done.info), sizeof(done.info)));
}

}  // namespace weightd

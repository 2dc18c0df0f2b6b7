// WDS1 (common/data_protocol.h StageRequest): a publish session's staging
// memfd, writable, for the publisher to write its tensors in place. What
// the session hands out and who may ask is Options::stage's business.
#include "absl/strings/str_cat.h"
#include "server/base/log.h"
#include "server/transport/data_server.h"

namespace weightd {

void DataServer::ServeStage(Connection& c) {
  // StageRequest: same layout as AttachRequest (session in lease_id).
  const AttachRequest& req = c.request();
  absl::StatusOr<UniqueFd> fd =
      absl::UnimplementedError("this daemon hands out no publish staging memory");
  if (options_.stage) {
    fd = options_.stage(c.peer(), req.lease_id,
                        absl::string_view(reinterpret_cast<const char*>(req.token), 16));
  }
  if (!fd.ok()) {
    LogEvent(LogLevel::kWarning, "stage_refused",
             {{"peer", c.peer().Describe()},
              {"session", absl::StrCat(req.lease_id)},
              {"error", std::string(fd.status().message())}});
    c.QueueReply(fd.status());
    return;
  }
  const int raw = fd->get();
  c.KeepUntilSent(*std::move(fd));
  c.QueueReply(absl::OkStatus(), {&raw, 1});
}

}  // namespace weightd

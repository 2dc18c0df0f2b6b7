#include "server/push/push_writer.h"

#include <utility>

namespace weightd {

absl::Status PushWriters::Push(const LeaseContents& lease, const PushLayout& layout,
                               const PushTarget& target, const std::atomic<bool>* cancel) const {
  for (const std::shared_ptr<const PushWriter>& writer : writers_) {
    if (std::optional<absl::Status> done = writer->Push(lease, layout, target, cancel)) {
      return *std::move(done);
    }
  }
  return absl::UnimplementedError(target.cuda.has_value()
                                      ? "this data socket pushes into no GPU memory"
                                      : "this data socket pushes into no host memory");
}

absl::StatusOr<ExportPlan> PushWriters::PlanExport(std::shared_ptr<const LeaseContents> lease,
                                                   const PushLayout& layout,
                                                   const CudaPushTarget& target,
                                                   const std::atomic<bool>* cancel) const {
  for (const std::shared_ptr<const PushWriter>& writer : writers_) {
    if (std::optional<absl::StatusOr<ExportPlan>> plan =
            writer->PlanExport(lease, layout, target, cancel)) {
      return *std::move(plan);
    }
  }
  return absl::UnimplementedError("this data socket exports no buffer to that device");
}

}  // namespace weightd

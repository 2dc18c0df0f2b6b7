#include "server/push/host_push_writer.h"

#include <unistd.h>

#include <algorithm>
#include <vector>

#include "common/status_macros.h"
#include "server/memory/huge_pages.h"
#include "server/memory/segment.h"
#include "server/push/host_push.h"

namespace weightd {
namespace {

bool IsHostTwin(const CudaPushTarget& target) {
  for (uint8_t b : target.gpu_uuid) {
    if (b != 0) return false;
  }
  return true;
}

}  // namespace

std::optional<absl::Status> HostPushWriter::Push(const LeaseContents& lease,
                                                 const PushLayout& layout,
                                                 const PushTarget& target,
                                                 const std::atomic<bool>* cancel) const {
  if (target.cuda.has_value()) return std::nullopt;
  return PushToHost(lease, layout, target.fd, cancel);
}

std::optional<absl::StatusOr<ExportPlan>> HostPushWriter::PlanExport(
    std::shared_ptr<const LeaseContents> lease, const PushLayout& layout,
    const CudaPushTarget& target, const std::atomic<bool>* cancel) const {
  if (!IsHostTwin(target)) return std::nullopt;
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  uint64_t size = std::max<uint64_t>(1, (layout.size + page - 1) / page) * page;
  // Budgeted as the pages it will get (a huge segment is whole 2 MiB).
  const MemoryAccount& account = *host_memory_->account();
  const std::vector<PageKind> kinds =
      PageKindsToTry(account.huge_pages(), account.shmem_thp(), size);
  if (!kinds.empty() && kinds.front() != PageKind::kSmall) size = RoundUpToHugePage(size);
  ExportPlan plan{.device = "host", .size = size, .default_budget = DefaultBudget()};
  plan.fill = [this, lease = std::move(lease), layout, size, cancel] {
    return FillHostExport(*lease, layout, size, cancel);
  };
  return plan;
}

uint64_t HostPushWriter::DefaultBudget() const {
  // Half the host budget: the other half is for what exports are made of.
  const uint64_t limit = host_memory_->account()->limit();
  if (limit != 0) return std::max<uint64_t>(1, limit / 2);
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return uint64_t{1} << 30;
  return std::max<uint64_t>(1, static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) / 4);
}

absl::StatusOr<std::unique_ptr<ExportedBuffer>> HostPushWriter::FillHostExport(
    const LeaseContents& lease, const PushLayout& layout, uint64_t size,
    const std::atomic<bool>* cancel) const {
  // Charged to the host budget (the reclaimers run first when it is short:
  // unheld exports among them), faulted in now (no page is allocated later
  // by a write), filled while no client has its fd, then sealed.
  WD_ASSIGN_OR_RETURN(std::unique_ptr<Segment> segment,
                      host_memory_->Allocate(size, {.purpose = "export", .prefault = true}));
  WD_RETURN_IF_ERROR(
      CopyLeaseToHost(lease, layout, segment->mutable_data(), segment->size(), cancel));
  WD_RETURN_IF_ERROR(segment->Seal(/*populate=*/false));
  auto out = std::make_unique<ExportedBuffer>();
  out->size = segment->size();
  out->segment = std::move(segment);
  return out;
}

}  // namespace weightd

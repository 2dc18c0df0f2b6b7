// The PushWriter for host memory (push_writer.h): a host push into the
// memfd a client passed (host_push.h PushToHost), and the host twin of an
// export — a buffer the daemon fills in its own host memory, an export
// whose gpu_uuid is all zero. Every data server has one: host memory is
// always there (the CPU implementation beside the optional CUDA one, as
// Arrow's CPU memory manager beside arrow_cuda).
//
// Immutable after construction; thread-safe.
#ifndef WEIGHTD_SERVER_PUSH_HOST_PUSH_WRITER_H_
#define WEIGHTD_SERVER_PUSH_HOST_PUSH_WRITER_H_

#include <atomic>
#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "server/memory/host_memory.h"
#include "server/push/export_cache.h"
#include "server/push/push_writer.h"

namespace weightd {

class HostPushWriter final : public PushWriter {
 public:
  // The host twin's buffers are segments of `host_memory`, charged to its
  // budget (it must outlive the writer and the buffers).
  explicit HostPushWriter(HostMemoryManager* host_memory) : host_memory_(host_memory) {}

  // A host push (no CUDA target): PushToHost into target.fd. A CUDA push is
  // not this writer's.
  std::optional<absl::Status> Push(const LeaseContents& lease, const PushLayout& layout,
                                   const PushTarget& target,
                                   const std::atomic<bool>* cancel) const override;

  // The host twin (an all-zero gpu_uuid): `size` the layout rounded up to
  // the pages it will get (whole huge pages where the account uses them),
  // budget half the host memory budget (a quarter of the machine's memory
  // when that is unlimited), filled as the host push fills a memfd into a
  // prefaulted segment that is then sealed. Another device is not this
  // writer's.
  std::optional<absl::StatusOr<ExportPlan>> PlanExport(
      std::shared_ptr<const LeaseContents> lease, const PushLayout& layout,
      const CudaPushTarget& target, const std::atomic<bool>* cancel) const override;

 private:
  // The default export budget of host memory.
  uint64_t DefaultBudget() const;
  // A segment of host_memory_ of `size` bytes with the lease copied in at
  // `layout`, sealed.
  absl::StatusOr<std::unique_ptr<ExportedBuffer>> FillHostExport(const LeaseContents& lease,
                                                                 const PushLayout& layout,
                                                                 uint64_t size,
                                                                 const std::atomic<bool>* cancel)
      const;

  // Constant after construction.
  HostMemoryManager* const host_memory_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_PUSH_HOST_PUSH_WRITER_H_

// Writers of pushes, one per kind of destination memory: the host writer
// (host_push_writer.h: a client's memfd, and the host twin of an export)
// and the CUDA writer (server/gpu/cuda_push_writer.h: a client's VMM
// allocation or legacy IPC handle, and GPU exports). The data socket
// (server/transport/) holds a PushWriters and asks each writer in turn
// whether it serves a request's target; a writer that does not answers
// std::nullopt, "not me", and the next one is asked — the double dispatch
// of Arrow's MemoryManager::CopyBufferFrom/CopyBufferTo, whose default
// answer is null. So the transport names no GPU type, and a data server
// given no CUDA writer answers a CUDA request UNIMPLEMENTED.
#ifndef WEIGHTD_SERVER_PUSH_PUSH_WRITER_H_
#define WEIGHTD_SERVER_PUSH_PUSH_WRITER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/data_protocol.h"
#include "common/push_layout.h"
#include "server/lease/lease_table.h"
#include "server/push/export_cache.h"

namespace weightd {

// Where a push request writes (common/data_protocol.h).
struct PushTarget {
  // A CUDA push (kCudaPushMagic): the CudaPushTarget that followed its
  // header. Unset: a host push (kPushMagic).
  std::optional<CudaPushTarget> cuda;
  // The fd the request carried, borrowed: the host push's memfd, a VMM
  // allocation's fd; -1: none (a legacy IPC handle).
  int fd = -1;
};

// An export (kCudaDaemonExport) a writer can fill, as ExportCache::Get
// takes it.
struct ExportPlan {
  std::string device;  // "host", or the GPU's UUID: the cache's key
  // Bytes the buffer will take: the layout's size rounded up as its memory
  // is allocated (pages, huge pages, the GPU's granularity).
  uint64_t size = 0;
  // The device's export budget where the daemon sets none
  // (--device-memory-bytes 0).
  uint64_t default_budget = 0;
  // Makes and fills the buffer (what the plan was made for: it holds the
  // lease and the layout).
  ExportCache::Fill fill;
};

// Writes leases into destinations of one kind of memory. Implementations
// are immutable after construction and thread-safe: pushes run on several
// push threads at once.
class PushWriter {
 public:
  virtual ~PushWriter() = default;

  // Writes `lease` at `layout` into `target`, or std::nullopt when the
  // target is not of this writer's memory. The status is the push's (each
  // writer's header says its codes); `cancel` becoming true ends it
  // UNAVAILABLE between copies.
  virtual std::optional<absl::Status> Push(const LeaseContents& lease, const PushLayout& layout,
                                           const PushTarget& target,
                                           const std::atomic<bool>* cancel) const = 0;

  // The export of `lease` at `layout` to the device `target` names
  // (handle_kind kCudaDaemonExport; an all-zero gpu_uuid: the host twin),
  // or std::nullopt when that device is not this writer's. The plan's fill
  // checks `cancel` as a push does; `cancel` must outlive it.
  virtual std::optional<absl::StatusOr<ExportPlan>> PlanExport(
      std::shared_ptr<const LeaseContents> lease, const PushLayout& layout,
      const CudaPushTarget& target, const std::atomic<bool>* cancel) const = 0;
};

// The writers a data server asks, in order. Immutable; thread-safe.
class PushWriters {
 public:
  explicit PushWriters(std::vector<std::shared_ptr<const PushWriter>> writers)
      : writers_(std::move(writers)) {}

  // The first writer's answer that is not "not me"; UNIMPLEMENTED when no
  // writer serves the target.
  absl::Status Push(const LeaseContents& lease, const PushLayout& layout,
                    const PushTarget& target, const std::atomic<bool>* cancel) const;
  absl::StatusOr<ExportPlan> PlanExport(std::shared_ptr<const LeaseContents> lease,
                                        const PushLayout& layout, const CudaPushTarget& target,
                                        const std::atomic<bool>* cancel) const;

 private:
  // Constant after construction.
  const std::vector<std::shared_ptr<const PushWriter>> writers_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_PUSH_PUSH_WRITER_H_

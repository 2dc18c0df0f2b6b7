// Push into a client's GPU memory (docs/DESIGN.md §9.3; common/data_protocol.h
// CudaPushTarget): the client allocated it (a CUDA VMM allocation exported
// as a POSIX fd, or a legacy cudaIpcMemHandle_t) on a GPU it names by
// UUID; the daemon maps it, copies each tensor of the lease to its offset
// on its own streams (the PushJob push_plan.h plans, run by the CUDA
// plugin: cuda_plugin.h), synchronizes, unmaps, and only then answers. The
// CUDA twin of host_push.h; CudaPushWriter (below) is what the data socket
// sees of it (server/push/push_writer.h). The free functions and the
// writer are thread-safe.
#ifndef WEIGHTD_SERVER_GPU_CUDA_PUSH_WRITER_H_
#define WEIGHTD_SERVER_GPU_CUDA_PUSH_WRITER_H_

#include <atomic>
#include <functional>
#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "common/data_protocol.h"
#include "common/fd.h"
#include "common/push_layout.h"
#include "server/gpu/gpu_devices.h"
#include "server/lease/lease_table.h"
#include "server/push/push_writer.h"

namespace weightd {

// Everything about a CUDA push that needs no CUDA call: the handle kind
// (and an fd with a VMM handle, none with a legacy one: INVALID_ARGUMENT),
// the layout within the allocation's size (INVALID_ARGUMENT), the GPU among
// the daemon's (none at all: FAILED_PRECONDITION with the reason; another
// UUID: NOT_FOUND naming the daemon's). Returns the GPU.
absl::StatusOr<GpuDevice> CheckCudaTarget(const CudaPushTarget& target, bool has_fd,
                                          const PushLayout& layout, const GpuInventory& gpus);

// CheckCudaTarget, then the copies (host buffers only: UNIMPLEMENTED for
// another kind; the job is planned here, after the plugin is loaded). `fd`: the VMM allocation's fd, or -1 (legacy; the caller
// closes it). Errors: the allocation cannot be imported or mapped
// (INVALID_ARGUMENT with CUDA's words: a stale fd, another process's GPU,
// a size that is not the allocation's); CUDA failing otherwise
// (UNAVAILABLE); `cancel` (UNAVAILABLE, checked between copies, with the
// copies already queued synchronized before returning). A sticky CUDA
// error marks the GPU unavailable (gpu_health.h), and from then on pushes
// to it are refused with FAILED_PRECONDITION naming it and that error. A
// build without CUDA: UNIMPLEMENTED.
absl::Status PushToCuda(const LeaseContents& lease, const PushLayout& layout,
                        const CudaPushTarget& target, int fd, const GpuInventory& gpus,
                        const std::atomic<bool>* cancel);

// A buffer the daemon filled on a GPU and exports (kCudaDaemonExport): a
// CUDA VMM allocation, `fd` its POSIX fd, `release` frees it (the
// allocation lives on in processes that imported it).
struct CudaExport {
  UniqueFd fd;
  uint64_t size = 0;
  std::function<void()> release;
};

// Everything about a CUDA export that needs no CUDA call: the GPU among the
// daemon's (as CheckCudaTarget). Returns the GPU.
absl::StatusOr<GpuDevice> CheckCudaExport(const CudaPushTarget& target, const PushLayout& layout,
                                          const GpuInventory& gpus);

// Allocates device memory on `gpu` (cuMemCreate, POSIX-fd shareable,
// rounded to its granularity), pushes the lease into it at `layout` as
// PushToCuda does (casts and merges on the GPU), synchronizes and exports
// it. UNAVAILABLE with CUDA's words; FAILED_PRECONDITION for a GPU a
// sticky error took out (as PushToCuda); UNIMPLEMENTED without CUDA.
// `release` logs a failed cuMemRelease ("cuda_release_failed").
absl::StatusOr<CudaExport> ExportToCuda(const LeaseContents& lease, const PushLayout& layout,
                                        const GpuDevice& gpu, const std::atomic<bool>* cancel);

// The PushWriter for GPU memory: CUDA pushes (PushToCuda) and exports to a
// GPU (CheckCudaExport, then ExportToCuda). A host push and the host twin
// of an export (an all-zero gpu_uuid) are not this writer's. Immutable
// after construction; thread-safe.
class CudaPushWriter final : public PushWriter {
 public:
  // The GPUs a push or export may name (must outlive the writer); null:
  // none ("no GPU inventory was given").
  explicit CudaPushWriter(const GpuInventory* gpus) : gpus_(gpus) {}

  std::optional<absl::Status> Push(const LeaseContents& lease, const PushLayout& layout,
                                   const PushTarget& target,
                                   const std::atomic<bool>* cancel) const override;

  // The buffer is budgeted as the plugin will allocate it (the layout
  // rounded up to 2 MiB, every current GPU's granularity); the default
  // budget is a quarter of the GPU's memory (the rest is its clients').
  std::optional<absl::StatusOr<ExportPlan>> PlanExport(
      std::shared_ptr<const LeaseContents> lease, const PushLayout& layout,
      const CudaPushTarget& target, const std::atomic<bool>* cancel) const override;

 private:
  const GpuInventory& Gpus() const;

  // Constant after construction.
  const GpuInventory* const gpus_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_GPU_CUDA_PUSH_WRITER_H_

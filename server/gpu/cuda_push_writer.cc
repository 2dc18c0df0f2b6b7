// CheckCudaTarget and CudaPushWriter (every build), and the daemon's side of
// the plugin's push and export: the PushJob is planned here.
#include "server/gpu/cuda_push_writer.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/base/log.h"
#include "common/status_macros.h"
#include "server/gpu/cuda_plugin.h"
#include "server/gpu/gpu_health.h"
#include "server/memory/buffer.h"
#include "server/push/push_plan.h"

namespace weightd {

namespace {

#ifdef WEIGHTD_HAVE_CUDA
// How the daemon plans a CUDA push for the plugin: pieces of at most 64
// MiB on two streams, casts through 32 MiB of scratch per stream (the
// plugin sizes its memory pool for these: cuda_push_cuda.cc).
constexpr PushPlanOptions kCudaPushPlan{.max_copy_bytes = uint64_t{64} << 20,
                                        .streams = 2,
                                        .max_cast_bytes = uint64_t{32} << 20};

// What the plugin can copy from, checked before any CUDA call: host buffers
// only (UNIMPLEMENTED); then the job (tensors inside their buffers, casts
// and merges that can be: INTERNAL).
absl::StatusOr<PushJob> JobForDevice(const LeaseContents& lease, const PushLayout& layout,
                                     absl::string_view what) {
  const size_t n = lease.tensors == nullptr ? 0 : lease.tensors->size();
  if (layout.offsets.size() != n) return absl::InternalError("push layout does not match the lease");
  for (size_t i = 0; i < lease.buffers.size(); ++i) {
    if (lease.buffers[i]->kind() != MemoryKind::kHost) {
      return absl::UnimplementedError(absl::StrCat("segment ", i,
                                                   " is not in host memory; a CUDA ", what,
                                                   " copies from host memory only (for now)"));
    }
  }
  return MakePushJob(lease, layout, kCudaPushPlan);
}
#endif  // WEIGHTD_HAVE_CUDA

bool IsHostTwin(const CudaPushTarget& target) {
  for (uint8_t b : target.gpu_uuid) {
    if (b != 0) return false;
  }
  return true;
}

absl::StatusOr<GpuDevice> FindGpu(const uint8_t (&uuid_bytes)[16], const GpuInventory& gpus) {
  const std::string uuid = FormatGpuUuid(uuid_bytes);
  if (gpus.devices.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the daemon has no GPU to push to ", uuid, ": ", gpus.unavailable));
  }
  std::vector<std::string> ours;
  for (const GpuDevice& g : gpus.devices) {
    if (g.uuid == uuid) return g;
    ours.push_back(g.uuid);
  }
  return absl::NotFoundError(absl::StrCat("GPU ", uuid, " is not one of the daemon's (",
                                          absl::StrJoin(ours, ", "),
                                          "): is the client on another node, or in a container "
                                          "that sees other GPUs?"));
}

}  // namespace

absl::StatusOr<GpuDevice> CheckCudaExport(const CudaPushTarget& target, const PushLayout& layout,
                                          const GpuInventory& gpus) {
  if (target.handle_kind != kCudaDaemonExport) {
    return absl::InternalError("not an export");
  }
  (void)layout;
  return FindGpu(target.gpu_uuid, gpus);
}

absl::StatusOr<CudaExport> ExportToCuda(const LeaseContents& lease, const PushLayout& layout,
                                        const GpuDevice& gpu, const std::atomic<bool>* cancel) {
#ifdef WEIGHTD_HAVE_CUDA
  WD_RETURN_IF_ERROR(GpuHealth::Process().CheckUsable(gpu));
  absl::StatusOr<const CudaPluginApi*> api = LoadCudaPlugin();
  if (!api.ok()) return api.status();
  WD_ASSIGN_OR_RETURN(PushJob job, JobForDevice(lease, layout, "export"));
  CudaExport out;
  int fd = -1;
  void* handle = nullptr;
  uint64_t size = 0;
  int sticky = 0;
  absl::Status filled = (*api)->export_fill(job, gpu, cancel, &fd, &size, &handle, &sticky);
  if (!filled.ok()) {
    GpuHealth::Process().NoteStickyError(gpu, sticky, filled, "export");
    return filled;
  }
  out.fd = UniqueFd(fd);
  out.size = size;
  out.release = [release = (*api)->export_release, handle, gpu = gpu.uuid, size] {
    if (absl::Status s = release(handle); !s.ok()) {
      LogEvent(LogLevel::kWarning, "cuda_release_failed",
               {{"gpu", gpu},
                {"what", absl::StrCat("an export of ", size, " bytes")},
                {"error", s.ToString()}});
    }
  };
  return out;
#else
  (void)lease;
  (void)layout;
  (void)gpu;
  (void)cancel;
  return absl::UnimplementedError(
      "this weightd was built without CUDA; a CUDA export needs a CUDA build (WEIGHTD_CUDA)");
#endif
}

absl::StatusOr<GpuDevice> CheckCudaTarget(const CudaPushTarget& target, bool has_fd,
                                          const PushLayout& layout, const GpuInventory& gpus) {
  if (target.handle_kind == kCudaVmmPosixFd) {
    if (!has_fd) {
      return absl::InvalidArgumentError(
          "a CUDA push of a VMM allocation carries its exported fd (exactly one)");
    }
  } else if (target.handle_kind == kCudaLegacyIpc) {
    if (has_fd) {
      return absl::InvalidArgumentError(
          "a CUDA push of a legacy IPC handle carries no fd (the handle is in the request)");
    }
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown CUDA handle kind ", target.handle_kind,
        " (1: VMM POSIX fd, 2: legacy IPC, 3: an export of the daemon's)"));
  }
  if (target.size == 0) {
    return absl::InvalidArgumentError("the push names a GPU allocation of 0 bytes");
  }
  if (layout.size > target.size) {
    return absl::InvalidArgumentError(absl::StrCat("the push's layout needs ", layout.size,
                                                   " bytes; the GPU allocation has ",
                                                   target.size));
  }
  return FindGpu(target.gpu_uuid, gpus);
}

absl::Status PushToCuda(const LeaseContents& lease, const PushLayout& layout,
                        const CudaPushTarget& target, int fd, const GpuInventory& gpus,
                        const std::atomic<bool>* cancel) {
#ifdef WEIGHTD_HAVE_CUDA
  absl::StatusOr<GpuDevice> gpu = CheckCudaTarget(target, fd >= 0, layout, gpus);
  if (!gpu.ok()) return gpu.status();
  WD_RETURN_IF_ERROR(GpuHealth::Process().CheckUsable(*gpu));
  absl::StatusOr<const CudaPluginApi*> api = LoadCudaPlugin();
  if (!api.ok()) return api.status();
  WD_ASSIGN_OR_RETURN(PushJob job, JobForDevice(lease, layout, "push"));
  int sticky = 0;
  absl::Status pushed = (*api)->push(job, target, fd, *gpu, cancel, &sticky);
  if (!pushed.ok()) GpuHealth::Process().NoteStickyError(*gpu, sticky, pushed, "push");
  return pushed;
#else
  return absl::UnimplementedError(
      "this weightd was built without CUDA; a CUDA push needs a CUDA build (WEIGHTD_CUDA)");
#endif
}

const GpuInventory& CudaPushWriter::Gpus() const {
  static const GpuInventory kNone{.unavailable = "no GPU inventory was given"};
  return gpus_ != nullptr ? *gpus_ : kNone;
}

std::optional<absl::Status> CudaPushWriter::Push(const LeaseContents& lease,
                                                 const PushLayout& layout,
                                                 const PushTarget& target,
                                                 const std::atomic<bool>* cancel) const {
  if (!target.cuda.has_value() || target.cuda->handle_kind == kCudaDaemonExport) {
    return std::nullopt;
  }
  return PushToCuda(lease, layout, *target.cuda, target.fd, Gpus(), cancel);
}

std::optional<absl::StatusOr<ExportPlan>> CudaPushWriter::PlanExport(
    std::shared_ptr<const LeaseContents> lease, const PushLayout& layout,
    const CudaPushTarget& target, const std::atomic<bool>* cancel) const {
  if (IsHostTwin(target)) return std::nullopt;
  absl::StatusOr<GpuDevice> gpu = CheckCudaExport(target, layout, Gpus());
  if (!gpu.ok()) return absl::StatusOr<ExportPlan>(gpu.status());
  // The allocation is rounded up to the device's granularity (2 MiB on
  // every current GPU) by the plugin; budgeted as that.
  constexpr uint64_t kGranule = uint64_t{2} << 20;
  // A quarter of the GPU: the rest is its clients' (a GPU's memory has no
  // reclaimer here; unheld buffers go only for another export).
  constexpr uint64_t kUnknownGpuMemory = uint64_t{4} << 30;
  ExportPlan plan{
      .device = gpu->uuid,
      .size = std::max<uint64_t>(1, (layout.size + kGranule - 1) / kGranule) * kGranule,
      .default_budget = std::max<uint64_t>(
          1, (gpu->memory_bytes != 0 ? gpu->memory_bytes : kUnknownGpuMemory) / 4)};
  plan.fill = [lease = std::move(lease), layout, gpu = *std::move(gpu),
               cancel]() -> absl::StatusOr<std::unique_ptr<ExportedBuffer>> {
    WD_ASSIGN_OR_RETURN(CudaExport made, ExportToCuda(*lease, layout, gpu, cancel));
    auto out = std::make_unique<ExportedBuffer>();
    out->fd = std::move(made.fd);
    out->size = made.size;
    out->release = std::move(made.release);
    return out;
  };
  return plan;
}

}  // namespace weightd

// CheckCudaTarget (every build) and, without CUDA, PushToCuda.
#include "server/gpu/cuda_push.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "server/gpu/cuda_plugin.h"
#include "server/gpu/gpu_health.h"

namespace weightd {

namespace {

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
  CudaExport out;
  int fd = -1;
  void* handle = nullptr;
  uint64_t size = 0;
  int sticky = 0;
  absl::Status filled =
      (*api)->export_fill(lease, layout, gpu, cancel, &fd, &size, &handle, &sticky);
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
  int sticky = 0;
  absl::Status pushed = (*api)->push(lease, layout, target, fd, *gpu, cancel, &sticky);
  if (!pushed.ok()) GpuHealth::Process().NoteStickyError(*gpu, sticky, pushed, "push");
  return pushed;
#else
  return absl::UnimplementedError(
      "this weightd was built without CUDA; a CUDA push needs a CUDA build (WEIGHTD_CUDA)");
#endif
}

}  // namespace weightd

#include "server/gpu/gpu_health.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/base/log.h"
#include "server/gpu/cuda_errors.h"

namespace weightd {

GpuHealth& GpuHealth::Process() {
  static GpuHealth* const health = new GpuHealth();  // never destroyed: used until exit
  return *health;
}

absl::Status GpuHealth::CheckUsable(const GpuDevice& gpu) const {
  std::string why = Unavailable(gpu.uuid);
  if (why.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "GPU ", gpu.uuid, " (", gpu.name, ") is unavailable: ", why,
      "; the daemon serves host memory and its other GPUs; restart it (--take-over keeps "
      "serving meanwhile) to use this GPU again"));
}

void GpuHealth::NoteStickyError(const GpuDevice& gpu, int code, const absl::Status& error,
                                absl::string_view during) {
  if (!IsStickyCudaError(code)) return;
  std::string why = absl::StrCat("a sticky CUDA error (", code, ") during a ", during, " at ",
                                 absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::Now(),
                                                  absl::UTCTimeZone()),
                                 " left its context unusable: ", error.message());
  {
    absl::MutexLock lock(&mu_);
    if (!unavailable_.try_emplace(gpu.uuid, why).second) return;  // the first error stays
  }
  LogEvent(LogLevel::kError, "gpu_unavailable",
           {{"gpu", gpu.uuid},
            {"name", gpu.name},
            {"ordinal", absl::StrCat(gpu.ordinal)},
            {"code", absl::StrCat(code)},
            {"during", std::string(during)},
            {"error", std::string(error.message())},
            {"action", "CUDA pushes and exports to this GPU are refused; host memory and the "
                       "other GPUs keep serving; restart the daemon to use it again"}});
}

std::string GpuHealth::Unavailable(absl::string_view uuid) const {
  absl::MutexLock lock(&mu_);
  auto it = unavailable_.find(uuid);
  return it == unavailable_.end() ? std::string() : it->second;
}

}  // namespace weightd

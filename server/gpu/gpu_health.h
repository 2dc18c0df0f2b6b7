// Which of the daemon's GPUs a sticky CUDA error took out (cuda_errors.h).
// After such an error the GPU's context in this process is dead for good:
// every later CUDA call on it fails with the same error, and what the
// context holds (a push's imported client allocation, exports, scratch)
// cannot be released until the process exits. The daemon marks that GPU
// unavailable and keeps serving host memory and its other GPUs: CUDA
// pushes and exports to it are refused with FAILED_PRECONDITION naming it
// and its first error; stats (GpuDevice.unavailable), `weightctl gpus` and
// `weightctl health` say why. Only a restart gives it a new context (a
// --take-over hand-over keeps serving meanwhile).
//
// One per process (Process()): CUDA contexts are per process. Thread-safe.
#ifndef WEIGHTD_SERVER_GPU_GPU_HEALTH_H_
#define WEIGHTD_SERVER_GPU_GPU_HEALTH_H_

#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/gpu/gpu_devices.h"

namespace weightd {

class GpuHealth {
 public:
  GpuHealth() = default;
  GpuHealth(const GpuHealth&) = delete;
  GpuHealth& operator=(const GpuHealth&) = delete;

  // The daemon's.
  static GpuHealth& Process();

  // OK while `gpu` is usable; else FAILED_PRECONDITION naming it and the
  // first sticky error.
  absl::Status CheckUsable(const GpuDevice& gpu) const ABSL_LOCKS_EXCLUDED(mu_);

  // A call on `gpu` (`during`: "push", "export", ...) failed with `error`,
  // the sticky CUDA error `code`: marks the GPU unavailable (the first error
  // is kept) and logs a "gpu_unavailable" event the first time. A `code`
  // that is not sticky (IsStickyCudaError) changes nothing.
  void NoteStickyError(const GpuDevice& gpu, int code, const absl::Status& error,
                       absl::string_view during) ABSL_LOCKS_EXCLUDED(mu_);

  // "" while the GPU `uuid` is usable, else why not.
  std::string Unavailable(absl::string_view uuid) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::string> unavailable_ ABSL_GUARDED_BY(mu_);
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_GPU_GPU_HEALTH_H_

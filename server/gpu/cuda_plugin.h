// The CUDA half of a CUDA-enabled daemon lives in a plugin,
// libweightd_cuda_plugin.so, that the daemon dlopen()s at start-up, never
// in the executable: the CUDA runtime (linked statically into the plugin)
// has thread-local storage that, linked into the executable, would be
// carved out of every thread's stack (static TLS) — civetweb's 100 KiB
// metrics threads then overflowed. In a dlopen()ed object it is allocated
// on first use instead. The plugin is also what keeps one binary serving
// the CPU path where there is no CUDA at all.
//
// The plugin is looked for at $WEIGHTD_CUDA_PLUGIN, beside the executable,
// then in ../lib/weightd/ from it.
#ifndef WEIGHTD_SERVER_GPU_CUDA_PLUGIN_H_
#define WEIGHTD_SERVER_GPU_CUDA_PLUGIN_H_

#include <atomic>
#include <cstdint>

#include "absl/status/statusor.h"
#include "common/data_protocol.h"
#include "common/push_layout.h"
#include "server/gpu/gpu_devices.h"
#include "server/lease/lease_table.h"

namespace weightd {

// Bumped whenever these signatures or the types they take change (the
// plugin and the daemon are built together; this catches a stale file).
inline constexpr uint32_t kCudaPluginAbi = 4;

struct CudaPluginApi {
  uint32_t abi = 0;
  GpuInventory (*discover)() = nullptr;
  // The copies of a checked CUDA push onto `gpu` (cuda_push.h).
  absl::Status (*push)(const LeaseContents& lease, const PushLayout& layout,
                       const CudaPushTarget& target, int fd, const GpuDevice& gpu,
                       const std::atomic<bool>* cancel) = nullptr;
  // Registers read-only host memory with CUDA (cudaHostRegister, portable,
  // read-only: a sealed segment's mapping), so copies from it run at pinned
  // speed; UNAVAILABLE with CUDA's words when it cannot. `unpin` undoes it
  // and must run before the memory is unmapped.
  absl::Status (*pin)(const void* data, size_t size) = nullptr;
  void (*unpin)(const void* data) = nullptr;
  // A daemon-owned export (cuda_push.h ExportToCuda): fills a new VMM
  // allocation on `gpu` with the lease at `layout`, sets *fd (its exported
  // POSIX fd, the caller's), *size and *handle (for export_release, which
  // frees the daemon's reference).
  absl::Status (*export_fill)(const LeaseContents& lease, const PushLayout& layout,
                              const GpuDevice& gpu, const std::atomic<bool>* cancel, int* fd,
                              uint64_t* size, void** handle) = nullptr;
  void (*export_release)(void* handle) = nullptr;
};

// The plugin's API, loaded once (later calls return the first answer).
// FAILED_PRECONDITION saying where it was looked for and why it failed.
absl::StatusOr<const CudaPluginApi*> LoadCudaPlugin();

}  // namespace weightd

extern "C" const weightd::CudaPluginApi* weightd_cuda_plugin_api();

#endif  // WEIGHTD_SERVER_GPU_CUDA_PLUGIN_H_

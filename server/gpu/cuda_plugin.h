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
// then in ../lib/weightd/ from it. The tests' fake plugin
// (fake_cuda_plugin.cc: GPUs of chosen kinds, no CUDA) is loaded the same
// way, so that a real daemon runs its GPU paths without a GPU.
//
// What crosses the seam is this header's types only: a push or an export is
// a PushJob (server/push/push_job.h: host pointers, lengths, offsets, casts
// and merges, planned by the daemon), never a lease or a layout, so the
// plugin compiles nothing of the daemon's but its own sources
// (server/gpu/plugin/) and the kernels (server/kernels/cuda/).
#ifndef WEIGHTD_SERVER_GPU_CUDA_PLUGIN_H_
#define WEIGHTD_SERVER_GPU_CUDA_PLUGIN_H_

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/data_protocol.h"
#include "server/base/log.h"
#include "server/gpu/gpu_devices.h"
#include "server/push/push_job.h"

namespace weightd {

// Bumped whenever these signatures or the types they take change (the
// plugin and the daemon are built together; this catches a stale file).
inline constexpr uint32_t kCudaPluginAbi = 6;

// Where the plugin's events go: the daemon's LogEvent (server/base/log.h), so
// that they are written in its --log-format (the plugin's own copy of the
// logger is never configured).
using CudaPluginEventSink = void (*)(LogLevel level, absl::string_view event,
                                     const std::vector<std::pair<std::string, std::string>>& fields);

// Every call below runs with the device it names made current on the
// calling thread (cudaSetDevice). `sticky_error`, where a call takes one,
// is set to the CUDA error code when the call failed with a sticky error
// (cuda_errors.h: the context of that GPU is unusable for good), else left
// 0; the daemon then marks that GPU unavailable (gpu_health.h).
struct CudaPluginApi {
  uint32_t abi = 0;
  // Called once, first, by LoadCudaPlugin.
  void (*set_event_sink)(CudaPluginEventSink sink) = nullptr;
  GpuInventory (*discover)() = nullptr;
  // The copies of a checked CUDA push onto `gpu` (cuda_push_writer.h):
  // `job` into the client's allocation `target` names (`fd` its VMM fd, or
  // -1 for a legacy handle). Everything it set up (the imported allocation,
  // its mapping, streams, scratch) is released before it returns, each
  // release checked (a failure is logged as a "cuda_release_failed" event).
  absl::Status (*push)(const PushJob& job, const CudaPushTarget& target, int fd,
                       const GpuDevice& gpu, const std::atomic<bool>* cancel,
                       int* sticky_error) = nullptr;
  // Registers host memory with CUDA (cudaHostRegister, portable: every
  // GPU's context), with device `ordinal` current, so that copies from it
  // run at pinned speed. `read_only`: cudaHostRegisterReadOnly, for a
  // read-only mapping (needs cudaDevAttrHostRegisterReadOnlySupported);
  // else the mapping must be writable (the driver pins it for writing).
  // UNAVAILABLE with CUDA's words when it cannot. `unpin` undoes it (the
  // same `ordinal`), and must run before the memory is unmapped.
  absl::Status (*pin)(const void* data, size_t size, bool read_only, int ordinal) = nullptr;
  absl::Status (*unpin)(const void* data, int ordinal) = nullptr;
  // A daemon-owned export (cuda_push_writer.h ExportToCuda): fills a new
  // VMM allocation on `gpu` (job.size bytes, rounded up to its granularity)
  // with `job`, sets *fd (its exported POSIX fd, the caller's), *size and
  // *handle (for export_release, which frees the daemon's reference, with
  // the export's device current, and says whether cuMemRelease succeeded).
  absl::Status (*export_fill)(const PushJob& job, const GpuDevice& gpu,
                              const std::atomic<bool>* cancel, int* fd, uint64_t* size,
                              void** handle, int* sticky_error) = nullptr;
  absl::Status (*export_release)(void* handle) = nullptr;
};

// The plugin's API, loaded once (later calls return the first answer).
// FAILED_PRECONDITION saying where it was looked for and why it failed.
absl::StatusOr<const CudaPluginApi*> LoadCudaPlugin();

}  // namespace weightd

extern "C" const weightd::CudaPluginApi* weightd_cuda_plugin_api();

#endif  // WEIGHTD_SERVER_GPU_CUDA_PLUGIN_H_

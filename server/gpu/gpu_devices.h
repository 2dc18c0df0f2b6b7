// Which GPUs this daemon can use, found once at start-up, or why none: the
// wire names GPUs by UUID (a client's device index means nothing to the
// daemon), and `weightctl gpus` / `stats` report this. A CUDA build asks
// its CUDA plugin (cuda_plugin.h), which asks the CUDA runtime; the
// driver, libcuda.so.1, is looked for at run time, so a node without one
// just has no GPUs. A build without CUDA says so.
#ifndef WEIGHTD_SERVER_GPU_GPU_DEVICES_H_
#define WEIGHTD_SERVER_GPU_GPU_DEVICES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/types/span.h"

namespace weightd {

struct GpuDevice {
  int ordinal = 0;           // this process's CUDA device index
  std::string uuid;          // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi
  std::string name;          // "NVIDIA H200"
  std::string pci_bus_id;    // "0000:19:00.0"
  uint64_t memory_bytes = 0;
  int compute_major = 0, compute_minor = 0;
  // Reads pageable host memory coherently (GH200/GB200/GB10): a rank can use
  // its shm mapping from the GPU without a copy.
  bool pageable_memory_access = false;
  // cudaHostRegister, and its read-only flag (pinning a read-only mapping).
  bool host_register = false;
  bool host_register_read_only = false;
};

struct GpuInventory {
  bool cuda_built = false;  // this binary has the CUDA path
  std::vector<GpuDevice> devices;
  // Why there are none ("" when some were found): no CUDA in this build, no
  // driver, the driver's error, no device.
  std::string unavailable;
};

// Asks CUDA (or answers for a build without it). Never fails: problems end
// up in `unavailable`. Takes ~0.1-1 s on a node with GPUs (driver start).
GpuInventory DiscoverGpus();

// The 16 UUID bytes as nvidia-smi prints them.
inline std::string FormatGpuUuid(absl::Span<const uint8_t> b) {
  if (b.size() != 16) return "GPU-?";
  return absl::StrFormat(
      "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
      b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

}  // namespace weightd

#endif  // WEIGHTD_SERVER_GPU_GPU_DEVICES_H_

#include "server/gpu/gpu_devices.h"

#include "absl/strings/str_format.h"

namespace weightd {

std::string FormatGpuUuid(absl::Span<const uint8_t> b) {
  if (b.size() != 16) return "GPU-?";
  return absl::StrFormat(
      "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
      b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

#ifndef WEIGHTD_HAVE_CUDA
GpuInventory DiscoverGpus() {
  GpuInventory inv;
  inv.unavailable = "this weightd was built without CUDA (WEIGHTD_CUDA=OFF or no nvcc)";
  return inv;
}
#endif

}  // namespace weightd

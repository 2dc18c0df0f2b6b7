// The CUDA plugin's GPU discovery (gpu_devices.h, cuda_plugin.h).
#include <dlfcn.h>

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/gpu/gpu_devices.h"

namespace weightd {

GpuInventory DiscoverGpusWithCuda() {
  GpuInventory inv;
  inv.cuda_built = true;
  // The runtime would say only "driver version is insufficient" without a
  // driver: look for it first, to say what is missing.
  void* driver = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (driver == nullptr) {
    const char* why = ::dlerror();
    inv.unavailable = absl::StrCat("no CUDA driver: libcuda.so.1 cannot be loaded (",
                                   why != nullptr ? why : "not found", ")");
    return inv;
  }
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    inv.unavailable = absl::StrCat("CUDA: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err));
    (void)cudaGetLastError();
    return inv;
  }
  if (count == 0) {
    inv.unavailable = "CUDA found no device";
    return inv;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    err = cudaGetDeviceProperties(&prop, i);
    if (err != cudaSuccess) {
      inv.unavailable = absl::StrCat("CUDA device ", i, ": ", cudaGetErrorString(err));
      continue;
    }
    GpuDevice d;
    d.ordinal = i;
    d.uuid = FormatGpuUuid(absl::Span<const uint8_t>(
        reinterpret_cast<const uint8_t*>(prop.uuid.bytes), sizeof(prop.uuid.bytes)));
    d.name = prop.name;
    char bus[64] = {};
    if (cudaDeviceGetPCIBusId(bus, sizeof(bus), i) == cudaSuccess) {
      d.pci_bus_id = bus;
    } else {
      (void)cudaGetLastError();
      d.pci_bus_id = absl::StrFormat("%08x:%02x:%02x.0", prop.pciDomainID, prop.pciBusID,
                                     prop.pciDeviceID);
    }
    d.memory_bytes = prop.totalGlobalMem;
    d.compute_major = prop.major;
    d.compute_minor = prop.minor;
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrPageableMemoryAccess, i) == cudaSuccess) {
      d.pageable_memory_access = v != 0;
    }
    if (cudaDeviceGetAttribute(&v, cudaDevAttrHostRegisterSupported, i) == cudaSuccess) {
      d.host_register = v != 0;
    }
    if (cudaDeviceGetAttribute(&v, cudaDevAttrHostRegisterReadOnlySupported, i) == cudaSuccess) {
      d.host_register_read_only = v != 0;
    }
    inv.devices.push_back(std::move(d));
  }
  if (!inv.devices.empty()) inv.unavailable.clear();
  return inv;
}

}  // namespace weightd

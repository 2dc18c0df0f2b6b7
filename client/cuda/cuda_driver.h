// The CUDA driver as the C++ client uses it (kCuda fetches, cuda_push.cc):
// libcuda.so.1 found at run time with dlopen (never linked: a client built
// with CUDA runs where there is none), its entry points through
// cuGetProcAddress. Built only with WEIGHTD_CLIENT_CUDA. Thread-safe: the
// driver is resolved once, on first use, and immutable after.
#ifndef WEIGHTD_CLIENT_CUDA_CUDA_DRIVER_H_
#define WEIGHTD_CLIENT_CUDA_CUDA_DRIVER_H_

#include <cuda.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace weightd {

struct CudaDriver {
  decltype(&::cuInit) init = nullptr;
  decltype(&::cuDeviceGet) device_get = nullptr;
  decltype(&::cuDeviceGetUuid) device_uuid = nullptr;
  decltype(&::cuDevicePrimaryCtxRetain) ctx_retain = nullptr;
  decltype(&::cuDevicePrimaryCtxRelease) ctx_release = nullptr;
  decltype(&::cuCtxSetCurrent) ctx_set = nullptr;
  decltype(&::cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&::cuMemCreate) create = nullptr;
  decltype(&::cuMemExportToShareableHandle) export_handle = nullptr;
  decltype(&::cuMemAddressReserve) reserve = nullptr;
  decltype(&::cuMemAddressFree) free_address = nullptr;
  decltype(&::cuMemMap) map = nullptr;
  decltype(&::cuMemUnmap) unmap = nullptr;
  decltype(&::cuMemSetAccess) set_access = nullptr;
  decltype(&::cuMemRelease) release = nullptr;
  decltype(&::cuMemcpyDtoH) copy_to_host = nullptr;
  decltype(&::cuGetErrorString) error_string = nullptr;
  // OK when every entry point was found and cuInit worked; else
  // FAILED_PRECONDITION saying why (no driver, too old, did not start).
  absl::Status status;
};

// This process's driver, loaded on the first call.
const CudaDriver& Cuda();

// OK for CUDA_SUCCESS; else UNAVAILABLE "<what>: <driver's text> (<code>)".
absl::Status CudaCall(const CudaDriver& d, CUresult r, absl::string_view what);

}  // namespace weightd

#endif  // WEIGHTD_CLIENT_CUDA_CUDA_DRIVER_H_

#include "client/cuda/cuda_driver.h"

#include <dlfcn.h>

#include <type_traits>

#include "absl/strings/str_cat.h"

namespace weightd {
namespace {

// Every entry point of `d` from the driver's cuGetProcAddress; the first
// one missing sets d->status.
void ResolveEntryPoints(decltype(&::cuGetProcAddress) get_proc, CudaDriver* d) {
  auto resolve = [&](const char* name, auto* fn) {
    void* p = nullptr;
    CUdriverProcAddressQueryResult found{};
    if (get_proc(name, &p, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &found) != CUDA_SUCCESS ||
        p == nullptr) {
      if (d->status.ok()) {
        d->status = absl::FailedPreconditionError(absl::StrCat("the CUDA driver has no ", name));
      }
      return;
    }
    *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(p);
  };
  resolve("cuInit", &d->init);
  resolve("cuDeviceGet", &d->device_get);
  resolve("cuDeviceGetUuid", &d->device_uuid);
  resolve("cuDevicePrimaryCtxRetain", &d->ctx_retain);
  resolve("cuDevicePrimaryCtxRelease", &d->ctx_release);
  resolve("cuCtxSetCurrent", &d->ctx_set);
  resolve("cuMemGetAllocationGranularity", &d->granularity);
  resolve("cuMemCreate", &d->create);
  resolve("cuMemExportToShareableHandle", &d->export_handle);
  resolve("cuMemAddressReserve", &d->reserve);
  resolve("cuMemAddressFree", &d->free_address);
  resolve("cuMemMap", &d->map);
  resolve("cuMemUnmap", &d->unmap);
  resolve("cuMemSetAccess", &d->set_access);
  resolve("cuMemRelease", &d->release);
  resolve("cuMemcpyDtoH", &d->copy_to_host);
  resolve("cuGetErrorString", &d->error_string);
}

CudaDriver LoadDriver() {
  CudaDriver d;
  void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = ::dlerror();
    d.status = absl::FailedPreconditionError(
        absl::StrCat("no CUDA driver in this process: libcuda.so.1 cannot be loaded (",
                     why != nullptr ? why : "not found", ")"));
    return d;
  }
  auto get_proc =
      reinterpret_cast<decltype(&::cuGetProcAddress)>(::dlsym(lib, "cuGetProcAddress_v2"));
  if (get_proc == nullptr) {
    d.status = absl::FailedPreconditionError("the CUDA driver is too old (no cuGetProcAddress_v2)");
    return d;
  }
  ResolveEntryPoints(get_proc, &d);
  if (d.status.ok() && d.init(0) != CUDA_SUCCESS) {
    d.status = absl::FailedPreconditionError("the CUDA driver did not start (cuInit)");
  }
  return d;
}

}  // namespace

const CudaDriver& Cuda() {
  static const CudaDriver driver = LoadDriver();
  return driver;
}

absl::Status CudaCall(const CudaDriver& d, CUresult r, absl::string_view what) {
  if (r == CUDA_SUCCESS) return absl::OkStatus();
  const char* text = nullptr;
  if (d.error_string != nullptr) d.error_string(r, &text);
  return absl::UnavailableError(absl::StrCat(what, ": ", text != nullptr ? text : "CUDA error",
                                             " (", static_cast<int>(r), ")"));
}

}  // namespace weightd

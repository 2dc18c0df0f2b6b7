// Which CUDA errors are sticky: errors after which the context of the GPU
// they happened on is unusable for good ("This leaves the process in an
// inconsistent state and any further CUDA work will return the same error.
// To continue using CUDA, the process must be terminated and relaunched",
// in the CUDA documentation of each; driver_types.h / cuda.h), and the
// uncorrectable ECC and NVLink errors, after which the device's memory
// cannot be trusted. The runtime's cudaError_t and the driver's CUresult
// share these numbers (the CUDA plugin static_asserts each against both
// headers); plain numbers here, so that the daemon and the tests' fake
// plugin classify without CUDA's headers.
#ifndef WEIGHTD_SERVER_GPU_CUDA_ERRORS_H_
#define WEIGHTD_SERVER_GPU_CUDA_ERRORS_H_

namespace weightd {

enum StickyCudaError : int {
  kCudaEccUncorrectable = 214,
  kCudaNvlinkUncorrectable = 220,
  kCudaContained = 226,
  kCudaIllegalAddress = 700,
  kCudaLaunchTimeout = 702,
  kCudaAssert = 710,
  kCudaHardwareStackError = 714,
  kCudaIllegalInstruction = 715,
  kCudaMisalignedAddress = 716,
  kCudaInvalidAddressSpace = 717,
  kCudaInvalidPc = 718,
  kCudaLaunchFailure = 719,
  kCudaTensorMemoryLeak = 721,
  kCudaMpsClientTerminated = 810,
  kCudaExternalDevice = 911,
};

inline bool IsStickyCudaError(int code) {
  switch (code) {
    case kCudaEccUncorrectable:
    case kCudaNvlinkUncorrectable:
    case kCudaContained:
    case kCudaIllegalAddress:
    case kCudaLaunchTimeout:
    case kCudaAssert:
    case kCudaHardwareStackError:
    case kCudaIllegalInstruction:
    case kCudaMisalignedAddress:
    case kCudaInvalidAddressSpace:
    case kCudaInvalidPc:
    case kCudaLaunchFailure:
    case kCudaTensorMemoryLeak:
    case kCudaMpsClientTerminated:
    case kCudaExternalDevice:
      return true;
    default:
      return false;
  }
}

}  // namespace weightd

#endif  // WEIGHTD_SERVER_GPU_CUDA_ERRORS_H_

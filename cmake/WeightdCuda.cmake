# The CUDA path (server/kernels/cuda/): built when WEIGHTD_CUDA is ON, or AUTO and
# nvcc is found (/usr/local/cuda/bin/nvcc or CMAKE_CUDA_COMPILER). Sanitizer
# builds leave it out (nvcc takes no -fsanitize). The binaries link the CUDA
# runtime statically and never libcuda.so.1 itself: the runtime resolves the
# driver when first called, so a CUDA build starts and serves the CPU path
# on a machine with no GPU and no driver.
set(WEIGHTD_CUDA_ENABLED OFF)
set(WEIGHTD_CUDA_ENABLED_BUILD OFF CACHE INTERNAL "the CUDA path is built (scripts/test.sh reads it)")
if(WEIGHTD_CUDA STREQUAL "OFF" OR (WEIGHTD_SANITIZE AND WEIGHTD_CUDA STREQUAL "AUTO"))
  return()
endif()
if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
  set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
endif()
include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  if(WEIGHTD_CUDA STREQUAL "ON")
    message(FATAL_ERROR "WEIGHTD_CUDA=ON but no CUDA compiler (nvcc) was found")
  endif()
  message(STATUS "weightd: no nvcc, building without the CUDA path")
  return()
endif()
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES 90)  # Hopper (H100, H200); override for others
endif()
set(CMAKE_CUDA_HOST_COMPILER ${CMAKE_CXX_COMPILER})
enable_language(CUDA)
# CMake 3.25 does not know that nvcc 13 speaks C++20 (our targets and
# Abseil's ask for it): tell it the flag.
if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
endif()
set(CMAKE_CUDA_STANDARD 20)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
find_package(CUDAToolkit REQUIRED)
set(WEIGHTD_CUDA_ENABLED ON)
set(WEIGHTD_CUDA_ENABLED_BUILD ON CACHE INTERNAL "the CUDA path is built (scripts/test.sh reads it)")
message(STATUS "weightd: CUDA path on (nvcc ${CMAKE_CUDA_COMPILER_VERSION}, sm_${CMAKE_CUDA_ARCHITECTURES})")

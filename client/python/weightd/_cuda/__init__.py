"""The client's GPU side (docs/DESIGN.md §9): the CUDA driver through ctypes
(libcuda.py), device memory through the VMM API (vmm.py), read-only
registrations of host pages (registration.py), devices and torch tensors
over device memory (device.py), and the data socket's CUDA requests
(protocol.py).

Nothing here is imported eagerly by the daemon's CPU users: the driver
(libcuda.so.1) is loaded on first use, torch is imported only by the
functions that make tensors.

Callers (and tests, which replace some of them) reach every name through
this package, `_cuda.push_cuda(...)`, never through the submodules.
"""
from .device import (_DeviceArray, format_gpu_uuid, gpu_uuid_bytes, parse_device,
                     parse_gpu_uuid, require_torch_cuda, tensor_from_ptr, view_bytes)
from .libcuda import (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                     CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS,
                     CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED,
                     CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                     CU_MEM_ACCESS_FLAGS_PROT_READ, CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                     CU_MEM_ALLOC_GRANULARITY_MINIMUM, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                     CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                     CU_MEM_LOCATION_TYPE_DEVICE, CU_MEMHOSTREGISTER_DEVICEMAP,
                     CU_MEMHOSTREGISTER_READ_ONLY, CUDA_SUCCESS, LAYOUT, LIBCUDA, _OOM,
                     _PRECONDITION_ERRORS, _PROTOS, CUmemAccessDesc, CUmemAllocationProp,
                     CUmemAllocFlags, CUmemLocation, CUuuid, _code_of, _Driver, _PrimaryContext,
                     _use_driver, driver)
from .protocol import (CUDA_PUSH_MAGIC, HANDLE_DAEMON_EXPORT, HANDLE_LEGACY_IPC,
                       HANDLE_VMM_POSIX_FD, HOST_UUID, cuda_push_request,
                       decode_cuda_push_request, export, push_cuda, send_cuda_push)
from .registration import (ZERO_COPY_PAGEABLE, ZERO_COPY_REGISTERED, HostRegistration,
                           host_register_read_only, pin_ranges, synchronize, zero_copy_path)
from .vmm import VmmAllocation, VmmImport, round_up, vmm_alloc

"""The CUDA driver through ctypes (docs/DESIGN.md §9): cuda.h's constants and the
structs the client passes, the typed entry points of libcuda.so.1 (loaded
and initialized once, on first use: never by the CPU paths), CUresult to a
status code, and the primary context every driver call runs under.

Every driver call runs with the device's primary context pushed (the
context torch's runtime uses), so the calling thread's current context does
not matter. driver() is thread-safe (one load under a lock); a
_PrimaryContext is used by the thread that made it.
"""
import contextlib
import ctypes
import threading

from ..errors import Error

CUDA_SUCCESS = 0
CU_MEM_ALLOCATION_TYPE_PINNED = 0x1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1
CU_MEM_LOCATION_TYPE_DEVICE = 0x1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3
CU_MEM_ACCESS_FLAGS_PROT_READ = 0x1
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0
CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1
CU_MEMHOSTREGISTER_READ_ONLY = 0x08
CU_MEMHOSTREGISTER_DEVICEMAP = 0x02
CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS = 88
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103
CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED = 113

# CUresult -> the client's code: the environment lacks something
# (FAILED_PRECONDITION), out of memory (RESOURCE_EXHAUSTED), else INTERNAL.
# Never UNAVAILABLE: fetch() retries that.
# NOT_INITIALIZED, DEINITIALIZED, STUB_LIBRARY, CALL_REQUIRES_NEWER_DRIVER,
# DEVICE_UNAVAILABLE, NO_DEVICE, INVALID_DEVICE, DEVICE_NOT_LICENSED,
# NOT_PERMITTED, NOT_SUPPORTED, SYSTEM_DRIVER_MISMATCH,
# COMPAT_NOT_SUPPORTED_ON_DEVICE.
_PRECONDITION_ERRORS = {3, 4, 34, 36, 46, 100, 101, 102, 800, 801, 803, 804}
_OOM = 2


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int),  # CUmemLocationType
                ("id", ctypes.c_int)]


class CUmemAllocFlags(ctypes.Structure):  # CUmemAllocationProp::allocFlags
    _fields_ = [("compressionType", ctypes.c_ubyte),
                ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort),
                ("reserved", ctypes.c_ubyte * 4)]


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int),                  # CUmemAllocationType
                ("requestedHandleTypes", ctypes.c_int),  # CUmemAllocationHandleType
                ("location", CUmemLocation),
                ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", CUmemAllocFlags)]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation),
                ("flags", ctypes.c_int)]  # CUmemAccess_flags


class CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


# What the ctypes layouts must be (checked against the C compiler by
# tests/integration/test_cuda_client.py; cuda.h of CUDA 12/13).
LAYOUT = {
    "CUmemLocation": (8, {"type": 0, "id": 4}),
    "CUmemAllocationProp": (32, {"type": 0, "requestedHandleTypes": 4, "location": 8,
                                 "win32HandleMetaData": 16, "allocFlags": 24}),
    "CUmemAccessDesc": (12, {"location": 0, "flags": 8}),
    "CUuuid": (16, {"bytes": 0}),
}

_P = ctypes.POINTER
_u64 = ctypes.c_ulonglong  # CUdeviceptr, CUmemGenericAllocationHandle, flags
# name -> argtypes (every function returns CUresult). Versioned names are
# what cuda.h's #defines resolve to (cuDevicePrimaryCtxRelease ->
# cuDevicePrimaryCtxRelease_v2, ...); the VMM calls have no versions.
_PROTOS = {
    "cuInit": [ctypes.c_uint],
    "cuGetErrorName": [ctypes.c_int, _P(ctypes.c_char_p)],
    "cuGetErrorString": [ctypes.c_int, _P(ctypes.c_char_p)],
    "cuDeviceGet": [_P(ctypes.c_int), ctypes.c_int],
    "cuDeviceGetAttribute": [_P(ctypes.c_int), ctypes.c_int, ctypes.c_int],
    "cuDeviceGetUuid_v2": [_P(CUuuid), ctypes.c_int],
    "cuDevicePrimaryCtxRetain": [_P(ctypes.c_void_p), ctypes.c_int],
    "cuDevicePrimaryCtxRelease_v2": [ctypes.c_int],
    "cuCtxPushCurrent_v2": [ctypes.c_void_p],
    "cuCtxPopCurrent_v2": [_P(ctypes.c_void_p)],
    "cuCtxSynchronize": [],
    "cuMemGetAllocationGranularity": [_P(ctypes.c_size_t), _P(CUmemAllocationProp), ctypes.c_int],
    "cuMemCreate": [_P(_u64), ctypes.c_size_t, _P(CUmemAllocationProp), _u64],
    "cuMemRelease": [_u64],
    "cuMemAddressReserve": [_P(_u64), ctypes.c_size_t, ctypes.c_size_t, _u64, _u64],
    "cuMemAddressFree": [_u64, ctypes.c_size_t],
    "cuMemMap": [_u64, ctypes.c_size_t, ctypes.c_size_t, _u64, _u64],
    "cuMemUnmap": [_u64, ctypes.c_size_t],
    "cuMemSetAccess": [_u64, ctypes.c_size_t, _P(CUmemAccessDesc), ctypes.c_size_t],
    "cuMemExportToShareableHandle": [ctypes.c_void_p, _u64, ctypes.c_int, _u64],
    "cuMemHostRegister_v2": [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint],
    "cuMemHostUnregister": [ctypes.c_void_p],
    "cuMemHostGetDevicePointer_v2": [_P(_u64), ctypes.c_void_p, ctypes.c_uint],
    "cuMemImportFromShareableHandle": [_P(_u64), ctypes.c_void_p, ctypes.c_int],
}

LIBCUDA = "libcuda.so.1"
_driver = None
_driver_lock = threading.Lock()


def _code_of(result):
    if result == _OOM:
        return "RESOURCE_EXHAUSTED"
    if result in _PRECONDITION_ERRORS:
        return "FAILED_PRECONDITION"
    return "INTERNAL"


class _Driver:
    """libcuda.so.1 with typed entry points. call() raises Error on failure."""

    def __init__(self, lib):
        self.lib = lib
        self.fn = {}
        for name, args in _PROTOS.items():
            try:
                f = getattr(lib, name)
            except AttributeError:
                raise Error("FAILED_PRECONDITION", "the CUDA driver has no %s (too old for "
                            "CUDA VMM; weightd needs a CUDA 12+ driver)" % name) from None
            f.argtypes = args
            f.restype = ctypes.c_int
            self.fn[name] = f

    def error_text(self, result):
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        try:
            self.fn["cuGetErrorName"](result, ctypes.byref(name))
            self.fn["cuGetErrorString"](result, ctypes.byref(text))
        except Exception:
            pass
        n = name.value.decode(errors="replace") if name.value else "CUDA error"
        t = text.value.decode(errors="replace") if text.value else ""
        return "%s (%d)%s" % (n, result, ": " + t if t else "")

    def call(self, name, *args, what=None):
        r = self.fn[name](*args)
        if r != CUDA_SUCCESS:
            raise Error(_code_of(r), "%s: %s" % (what or name, self.error_text(r)))

    def attribute(self, attr, device):
        v = ctypes.c_int(0)
        self.call("cuDeviceGetAttribute", ctypes.byref(v), attr, device)
        return v.value


def driver():
    """The CUDA driver, loaded and initialized once. Error
    FAILED_PRECONDITION when there is none (no libcuda.so.1, no GPU)."""
    global _driver
    with _driver_lock:
        if _driver is None:
            try:
                lib = ctypes.CDLL(LIBCUDA)
            except OSError as e:
                raise Error("FAILED_PRECONDITION", "cannot load the CUDA driver %s (%s): a "
                            "fetch into a GPU needs the NVIDIA driver in this process"
                            % (LIBCUDA, e)) from None
            d = _Driver(lib)
            d.call("cuInit", 0, what="initializing the CUDA driver")
            _driver = d
        return _driver


def _use_driver(path):
    """Tests: load `path` in place of libcuda.so.1 from now on."""
    global _driver, LIBCUDA
    with _driver_lock:
        LIBCUDA = path
        _driver = None


class _PrimaryContext:
    """A reference to device `ordinal`'s primary context (the one torch's
    runtime uses); current() pushes it on the calling thread for a block."""

    def __init__(self, d, ordinal):
        self.d = d
        self.ordinal = int(ordinal)
        dev = ctypes.c_int(-1)
        d.call("cuDeviceGet", ctypes.byref(dev), self.ordinal,
               what="CUDA device %d" % self.ordinal)
        self.device = dev.value
        ctx = ctypes.c_void_p()
        d.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), self.device,
               what="retaining the primary context of CUDA device %d" % self.ordinal)
        self.ctx = ctx
        self.held = True

    @contextlib.contextmanager
    def current(self):
        self.d.call("cuCtxPushCurrent_v2", self.ctx)
        try:
            yield
        finally:
            popped = ctypes.c_void_p()
            self.d.fn["cuCtxPopCurrent_v2"](ctypes.byref(popped))

    def release(self):
        if self.held:
            self.held = False
            self.d.fn["cuDevicePrimaryCtxRelease_v2"](self.device)

"""The client's GPU side (DESIGN §6): CUDA push requests, the CUDA driver
through ctypes, and torch tensors over device memory.

Nothing here is imported eagerly by the daemon's CPU users: the driver
(libcuda.so.1) is loaded on first use, torch is imported only by the
functions that make tensors.

CUDA push (common/data_protocol.h): a PushRequest whose magic is "WDC1"
(the same 32 bytes as a host push: magic, u32 num_offsets, u64 lease_id,
16-byte token), then a 96-byte CudaPushTarget {16-byte GPU UUID, u64 size
(the allocation's bytes), u32 handle_kind (1 = VMM POSIX fd), u32 reserved,
64-byte ipc_handle (legacy IPC only, zero otherwise)}, then num_offsets u64
offsets (none for the default layout). The allocation's exported fd rides on
the header (SCM_RIGHTS). The daemon imports and maps the allocation, copies
every tensor in, synchronizes its streams and only then answers an
AttachReply: every byte is in place when the reply arrives.

Device memory (vmm_alloc): cuMemCreate (pinned device memory, exportable as
a POSIX fd) -> cuMemAddressReserve -> cuMemMap -> cuMemSetAccess (read-write
for that device) -> cuMemExportToShareableHandle. Every driver call runs
with the device's primary context pushed (the context torch's runtime uses),
so the calling thread's current context does not matter.

Lifetime: a VmmAllocation frees itself (synchronize the context, unmap, free
the address range, release the handle, close the exported fd) on free() or
when garbage collected. Tensors made by tensor_from_ptr() hold their owner
(the allocation) through the object whose __cuda_array_interface__ torch
consumed: torch keeps that object alive until the tensor's storage dies, so
device memory is never freed under a live tensor or view.
"""
import contextlib
import ctypes
import os
import socket
import struct
import threading

from . import _datasock
from .errors import Error

CUDA_PUSH_MAGIC = b"WDC1"
HANDLE_VMM_POSIX_FD = 1  # kCudaVmmPosixFd
HANDLE_LEGACY_IPC = 2    # kCudaLegacyIpc
HANDLE_DAEMON_EXPORT = 3  # kCudaDaemonExport
HOST_UUID = bytes(16)     # an export's host twin: a sealed memfd
_EXPORT_INFO = struct.Struct("<QQ")  # ExportInfo
_HEADER = struct.Struct("<4sIQ16s")   # PushRequest
_TARGET = struct.Struct("<16sQII64s")  # CudaPushTarget
assert _HEADER.size == 32 and _TARGET.size == 96

# ---------------------------------------------------------------- cuda.h

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


def round_up(size, granularity):
    """`size` rounded up to a multiple of `granularity`, at least one."""
    size, granularity = int(size), int(granularity)
    if granularity <= 0:
        raise Error("INTERNAL", "CUDA reported an allocation granularity of %d" % granularity)
    return max(1, -(-size // granularity)) * granularity


def _allocation_prop(ordinal):
    prop = CUmemAllocationProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = int(ordinal)
    return prop


class VmmAllocation:
    """Device memory from cuMemCreate, mapped read-write in this process and
    exportable as a POSIX fd (see vmm_alloc). .ptr: its device address,
    .size: its bytes (a multiple of the granularity), .fd: the fd exported at
    creation (-1 once close_fd() or free() closed it), .ordinal: the device.
    free() is idempotent and also runs when the object is collected."""

    def _start(self, ordinal):
        """The state free() undoes, empty, and the device's primary context."""
        self.ordinal = int(ordinal)
        self.ptr = 0
        self.size = 0
        self.fd = -1
        self._handle = None
        self._reserved = False
        self._mapped = False
        self._lock = threading.Lock()
        self._freed = False
        self._ctx = None
        self._d = driver()
        self._ctx = _PrimaryContext(self._d, self.ordinal)
        return self._d

    def __init__(self, ordinal, size):
        d = self._start(ordinal)
        try:
            dev = self._ctx.device
            if not d.attribute(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev):
                raise Error("FAILED_PRECONDITION", "CUDA device %d does not support virtual "
                            "memory management (cuMemCreate)" % self.ordinal)
            if not d.attribute(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                               dev):
                raise Error("FAILED_PRECONDITION", "CUDA device %d cannot export memory as a "
                            "POSIX fd" % self.ordinal)
            with self._ctx.current():
                prop = _allocation_prop(self.ordinal)
                minimum, recommended = ctypes.c_size_t(0), ctypes.c_size_t(0)
                d.call("cuMemGetAllocationGranularity", ctypes.byref(minimum),
                       ctypes.byref(prop), CU_MEM_ALLOC_GRANULARITY_MINIMUM)
                d.call("cuMemGetAllocationGranularity", ctypes.byref(recommended),
                       ctypes.byref(prop), CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
                g = minimum.value
                if g <= 0:
                    raise Error("INTERNAL", "CUDA reported an allocation granularity of 0")
                # The daemon checks the size against the minimum granularity;
                # the recommended one is a multiple of it.
                if recommended.value > 0 and recommended.value % g == 0:
                    g = recommended.value
                self.granularity = g
                size = round_up(size, g)
                handle = _u64(0)
                d.call("cuMemCreate", ctypes.byref(handle), size, ctypes.byref(prop), 0,
                       what="allocating %d bytes on CUDA device %d (cuMemCreate)"
                       % (size, self.ordinal))
                self._handle = handle.value
                ptr = _u64(0)
                d.call("cuMemAddressReserve", ctypes.byref(ptr), size, 0, 0, 0,
                       what="reserving %d bytes of address space" % size)
                self.ptr, self.size, self._reserved = ptr.value, size, True
                d.call("cuMemMap", self.ptr, size, 0, self._handle, 0, what="cuMemMap")
                self._mapped = True
                desc = CUmemAccessDesc()
                desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE
                desc.location.id = self.ordinal
                desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                d.call("cuMemSetAccess", self.ptr, size, ctypes.byref(desc), 1,
                       what="cuMemSetAccess")
            self.fd = self.export_fd()
        except BaseException:
            self.free(quiet=True)
            raise

    def export_fd(self):
        """A new POSIX fd for the allocation (the caller closes it). It holds a
        reference to the memory until closed (or until a receiver releases
        what it imported)."""
        if self._freed or self._handle is None:
            raise Error("FAILED_PRECONDITION", "the GPU allocation was freed")
        fd = ctypes.c_int(-1)
        with self._ctx.current():
            self._d.call("cuMemExportToShareableHandle", ctypes.byref(fd), self._handle,
                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0,
                         what="exporting the GPU allocation as a POSIX fd")
        if fd.value < 0:
            raise Error("INTERNAL", "cuMemExportToShareableHandle gave fd %d" % fd.value)
        return fd.value

    def close_fd(self):
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    @property
    def freed(self):
        return self._freed

    def free(self, quiet=False):
        """Waits for the device's queued work (it may still use this memory),
        unmaps, frees the address range, releases the handle and closes the
        exported fd. Idempotent. Raises the first driver error unless
        `quiet`."""
        with self._lock:
            if self._freed:
                return
            self._freed = True
        first = None
        try:
            self.close_fd()
        except OSError as e:
            first = e
        ctx, d = self._ctx, getattr(self, "_d", None)
        if ctx is None or d is None:
            return
        try:
            with ctx.current():
                steps = [("cuCtxSynchronize", ())]
                if self._mapped:
                    steps.append(("cuMemUnmap", (self.ptr, self.size)))
                if self._reserved:
                    steps.append(("cuMemAddressFree", (self.ptr, self.size)))
                if self._handle is not None:
                    steps.append(("cuMemRelease", (self._handle,)))
                self._mapped = self._reserved = False
                self._handle = None
                for name, args in steps:
                    try:
                        d.call(name, *args, what="freeing the GPU allocation (%s)" % name)
                    except Error as e:
                        first = first or e
        except Error as e:  # the context could not be made current
            first = first or e
        finally:
            ctx.release()
        if first is not None and not quiet:
            raise first if isinstance(first, Error) else Error("INTERNAL", str(first))

    def __del__(self):
        try:
            self.free(quiet=True)
        except BaseException:
            pass

    def __repr__(self):
        return "<weightd VmmAllocation cuda:%d ptr=0x%x size=%d%s>" % (
            self.ordinal, self.ptr, self.size, " freed" if self._freed else "")


class VmmImport(VmmAllocation):
    """Device memory another process (the daemon) allocated and exported as
    a POSIX fd, imported and mapped READ-ONLY here at .ptr (.size bytes, on
    device .ordinal): .read_only is True when the driver took the read-only
    access (CU_MEM_ACCESS_FLAGS_PROT_READ: a kernel writing it faults);
    False when it refused it (.read_only_refused says how) and the map is
    read-write: a write then changes the daemon's shared buffer. free() (or
    collection) waits for the device, unmaps and releases this process's
    reference."""

    def __init__(self, ordinal, fd, size):  # noqa: super().__init__ allocates: not called
        self.read_only = None
        self.read_only_refused = ""
        d = self._start(ordinal)
        try:
            with self._ctx.current():
                handle = _u64(0)
                d.call("cuMemImportFromShareableHandle", ctypes.byref(handle),
                       ctypes.c_void_p(int(fd)), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                       what="importing the daemon's exported GPU memory")
                self._handle = handle.value
                ptr = _u64(0)
                d.call("cuMemAddressReserve", ctypes.byref(ptr), int(size), 0, 0, 0,
                       what="reserving %d bytes of address space" % int(size))
                self.ptr, self.size, self._reserved = ptr.value, int(size), True
                d.call("cuMemMap", self.ptr, self.size, 0, self._handle, 0, what="cuMemMap")
                self._mapped = True
                desc = CUmemAccessDesc()
                desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE
                desc.location.id = self.ordinal
                desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READ
                try:
                    d.call("cuMemSetAccess", self.ptr, self.size, ctypes.byref(desc), 1,
                           what="cuMemSetAccess (read-only)")
                    self.read_only = True
                except Error as e:
                    # A driver that grants device memory no read-only
                    # access: read-write (the tensors are still the
                    # daemon's buffer, shared: do not write them).
                    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                    d.call("cuMemSetAccess", self.ptr, self.size, ctypes.byref(desc), 1,
                           what="cuMemSetAccess")
                    self.read_only = False
                    self.read_only_refused = e.message
        except BaseException:
            self.free(quiet=True)
            raise

    def free(self, quiet=False):
        """As VmmAllocation.free, then closes the data connection that held
        the daemon's buffer (export_conn), if any."""
        try:
            super().free(quiet)
        finally:
            conn, self.export_conn = getattr(self, "export_conn", None), None
            if conn is not None:
                conn.close()

    def export_fd(self):
        raise Error("FAILED_PRECONDITION", "an imported export is the daemon's to share")

    def __repr__(self):
        return "<weightd VmmImport cuda:%d ptr=0x%x size=%d%s>" % (
            self.ordinal, self.ptr, self.size, " freed" if self._freed else "")


def export(path, lease_id, token, gpu_uuid, timeout=30.0):
    """Asks the daemon at data socket `path` for its exported buffer of lease
    `lease_id`'s tensors (default layout) on the GPU `gpu_uuid` (HOST_UUID:
    host memory, the host twin). Returns (sock, fd, size, layout_size): the
    open connection (which holds the lease and the buffer: close it to let
    go), the buffer's fd (a VMM POSIX fd, or a memfd sealed against writes;
    the caller's), its bytes and the layout's. Error with the daemon's code
    on refusal."""
    if len(token) != 16:
        raise Error("INTERNAL", "daemon sent a lease token of %d bytes (want 16)" % len(token))
    sock, msg, fds = _datasock.request(
        path, timeout, "export", "an export needs a local one",
        lambda s: send_cuda_push(s, lease_id, token, [], gpu_uuid, 0, None,
                                 handle_kind=HANDLE_DAEMON_EXPORT), raw=True)
    if len(fds) != 1 or len(msg) != _EXPORT_INFO.size:
        for fd in fds:
            os.close(fd)
        sock.close()
        raise Error("INTERNAL", "the daemon answered an export with %d fds and %d bytes"
                    % (len(fds), len(msg)))
    size, layout_size = _EXPORT_INFO.unpack(msg)
    return sock, fds[0], size, layout_size


def vmm_alloc(device_ordinal, size):
    """`size` bytes (rounded up to the allocation granularity, at least one
    granule) of device memory on CUDA device `device_ordinal`, exportable as
    a POSIX fd: a VmmAllocation with .ptr, .size, .fd (exported; pass it to
    the daemon, then close_fd()) and .free()."""
    return VmmAllocation(device_ordinal, size)


class HostRegistration:
    """A host range registered read-only with CUDA (page-locked for DMA)
    until unregister(). `mapped`: also mapped into the device's address
    space (CU_MEMHOSTREGISTER_DEVICEMAP): kernels read it over the bus at
    device_ptr; unregister() then waits for the device first, since a
    kernel may still read it."""

    def __init__(self, ordinal, addr, size, mapped=False):
        d = self._d = driver()
        self.addr, self.size = int(addr), int(size)
        self.mapped = bool(mapped)
        self.device_ptr = 0
        self._ctx = _PrimaryContext(d, ordinal)
        self._done = False
        try:
            if not d.attribute(CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED,
                               self._ctx.device):
                raise Error("FAILED_PRECONDITION", "CUDA device %d cannot register read-only "
                            "host memory (CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED "
                            "is 0)" % int(ordinal))
            flags = CU_MEMHOSTREGISTER_READ_ONLY | (CU_MEMHOSTREGISTER_DEVICEMAP if mapped else 0)
            with self._ctx.current():
                d.call("cuMemHostRegister_v2", ctypes.c_void_p(self.addr), self.size, flags,
                       what="pinning %d bytes of the shard read-only" % self.size)
                if mapped:
                    ptr = _u64(0)
                    try:
                        d.call("cuMemHostGetDevicePointer_v2", ctypes.byref(ptr),
                               ctypes.c_void_p(self.addr), 0,
                               what="the device address of the shard's pages")
                    except BaseException:
                        d.fn["cuMemHostUnregister"](ctypes.c_void_p(self.addr))
                        raise
                    self.device_ptr = ptr.value
        except BaseException:
            self._done = True
            self._ctx.release()
            raise

    def unregister(self):
        if self._done:
            return
        self._done = True
        try:
            with self._ctx.current():
                try:
                    if self.mapped:
                        self._d.call("cuCtxSynchronize", what="waiting for the device's reads")
                finally:
                    self._d.call("cuMemHostUnregister", ctypes.c_void_p(self.addr))
        finally:
            self._ctx.release()

    def __del__(self):
        try:
            self.unregister()
        except BaseException:
            pass


def host_register_read_only(device_ordinal, addr, size, mapped=False):
    """Pins [addr, addr+size) read-only (CU_MEMHOSTREGISTER_READ_ONLY: no
    copy-on-write break, the pages may be a read-only map) for copies to
    `device_ordinal` — and, `mapped`, maps it for the device's kernels
    (.device_ptr). Returns a HostRegistration; Error when CUDA refuses."""
    return HostRegistration(device_ordinal, addr, size, mapped)


def synchronize(device_ordinal):
    """Waits for CUDA device `device_ordinal`'s queued work (its primary
    context: torch's)."""
    d = driver()
    ctx = _PrimaryContext(d, device_ordinal)
    try:
        with ctx.current():
            d.call("cuCtxSynchronize", what="waiting for CUDA device %d" % int(device_ordinal))
    finally:
        ctx.release()


ZERO_COPY_PAGEABLE = "pageable"      # the device reads the host address itself
ZERO_COPY_REGISTERED = "registered"  # a read-only mapped registration of the pages


def zero_copy_path(device_ordinal):
    """How CUDA device `device_ordinal` can read a shard in place without a
    copy: ZERO_COPY_PAGEABLE where it reads pageable host memory coherently
    (CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS: Grace Hopper / Blackwell
    over NVLink-C2C, or HMM), else ZERO_COPY_REGISTERED where it registers
    read-only host memory (CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_
    SUPPORTED: the shard is mapped read-only, its segments sealed against
    writes). Error FAILED_PRECONDITION naming both attributes where neither
    holds: an x86 discrete GPU without HMM (H100/H200 PCIe and SXM hosts).
    There no path avoids a copy: torch takes no unregistered host address,
    a registration without READ_ONLY needs writable pages (the segments are
    sealed against writes, and a private writable map would copy every page
    on registration), and the daemon's own registration is of its mapping,
    in its process."""
    d = driver()
    ctx = _PrimaryContext(d, device_ordinal)
    try:
        pageable = d.attribute(CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS, ctx.device)
        if pageable:
            return ZERO_COPY_PAGEABLE
        read_only = d.attribute(CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED,
                                ctx.device)
    finally:
        ctx.release()
    if read_only:
        return ZERO_COPY_REGISTERED
    raise Error("FAILED_PRECONDITION", "zero-copy on CUDA device %d needs the device to read the "
                "shard's host pages in place, and it cannot: "
                "CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS is 0 (no HMM or ATS: a discrete GPU "
                "on an x86 host) and CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED is 0 "
                "(the read-only pages cannot be registered). Use mode=\"push\" (the default: "
                "one copy, cast on the GPU), \"export\" or \"pull\"" % int(device_ordinal))


def pin_ranges(pieces, segment_sizes, page=4096, merge_gap=2 << 20):
    """Which ranges a pull pins: pieces = [(segment, offset, length)], the
    non-empty ones merged per segment when closer than merge_gap, widened to
    whole pages (at most to the end of the segment's last page, which its
    map covers). Returns sorted [(segment, start, end)]; two ranges never
    share a page."""
    by_seg = {}
    for seg, off, n in pieces:
        if n > 0:
            by_seg.setdefault(int(seg), []).append((int(off), int(off) + int(n)))
    merge_gap = max(int(merge_gap), int(page))
    out = []
    for seg in sorted(by_seg):
        merged = []
        for lo, hi in sorted(by_seg[seg]):
            if merged and lo <= merged[-1][1] + merge_gap:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        mapped = -(-int(segment_sizes[seg]) // page) * page
        for lo, hi in merged:
            out.append((seg, lo // page * page, min(mapped, -(-hi // page) * page)))
    return out


# ---------------------------------------------------------------- devices


def parse_device(device):
    """fetch(device=...): None/"cpu" -> None (host memory); an int N,
    "cuda:N" or torch.device("cuda", N) -> N; "cuda" / torch.device("cuda")
    -> -1 (torch's current device). Error INVALID_ARGUMENT otherwise."""
    if device is None:
        return None
    if isinstance(device, bool):
        raise Error("INVALID_ARGUMENT", "invalid device %r" % (device,))
    if isinstance(device, int):
        if device < 0:
            raise Error("INVALID_ARGUMENT", "invalid device %d (a CUDA device index is >= 0)"
                        % device)
        return device
    if isinstance(device, str):
        text = device.strip().lower()
        kind, _, index = text.partition(":")
        if _ and not index.isdigit():
            raise Error("INVALID_ARGUMENT", "invalid device \"%s\" (expected \"cuda:N\")"
                        % device)
        index = int(index) if _ else None
    elif hasattr(device, "type") and hasattr(device, "index"):  # torch.device
        kind, index = str(device.type), device.index
    else:
        raise Error("INVALID_ARGUMENT", "invalid device %r (expected \"cuda:N\", an int or a "
                    "torch.device)" % (device,))
    if kind == "cpu" and index in (None, 0):
        return None
    if kind != "cuda":
        raise Error("INVALID_ARGUMENT", "invalid device %r: only CUDA devices (or \"cpu\") are "
                    "supported" % (device,))
    return -1 if index is None else int(index)


def require_torch_cuda(index):
    """torch, once it is known to have CUDA device `index` (-1: its current
    device; then resolved). Returns (torch, index). FAILED_PRECONDITION
    without torch or CUDA in this process; INVALID_ARGUMENT for an index
    past the devices it sees."""
    try:
        import torch
    except ImportError:
        raise Error("FAILED_PRECONDITION", "device=cuda:%s needs PyTorch with CUDA: no CUDA "
                    "device in this process (torch is not installed)"
                    % ("" if index < 0 else index)) from None
    if not torch.cuda.is_available():
        raise Error("FAILED_PRECONDITION", "no CUDA device in this process (torch %s, built "
                    "for CUDA %s, torch.cuda.is_available() is False): a fetch into a GPU "
                    "needs one" % (torch.__version__, torch.version.cuda))
    n = torch.cuda.device_count()
    if index < 0:
        index = torch.cuda.current_device()
    if index >= n:
        raise Error("INVALID_ARGUMENT", "device cuda:%d: this process sees %d CUDA device(s)"
                    % (index, n))
    return torch, index


def parse_gpu_uuid(value):
    """16 UUID bytes from "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (with or
    without the GPU-/MIG- prefix, any case), 16 bytes, or a sequence of 16
    ints. Error INVALID_ARGUMENT otherwise."""
    if isinstance(value, (bytes, bytearray)) and len(value) == 16:
        return bytes(value)
    if isinstance(value, (list, tuple)) and len(value) == 16 and \
            all(isinstance(b, int) and 0 <= b < 256 for b in value):
        return bytes(value)
    text = value.decode() if isinstance(value, (bytes, bytearray)) else str(value)
    t = text.strip()
    for prefix in ("GPU-", "MIG-", "gpu-", "mig-"):
        if t.startswith(prefix):
            t = t[len(prefix):]
            break
    parts = t.split("-")
    if [len(p) for p in parts] != [8, 4, 4, 4, 12]:
        raise Error("INVALID_ARGUMENT", "not a GPU UUID: %r" % (text,))
    try:
        return bytes.fromhex("".join(parts))
    except ValueError:
        raise Error("INVALID_ARGUMENT", "not a GPU UUID: %r" % (text,)) from None


def format_gpu_uuid(b):
    """"GPU-xxxxxxxx-..." as nvidia-smi and the daemon print it."""
    h = bytes(b).hex()
    return "GPU-%s-%s-%s-%s-%s" % (h[:8], h[8:12], h[12:16], h[16:20], h[20:])


def gpu_uuid_bytes(device_index):
    """The 16-byte UUID of torch's CUDA device `device_index` (the daemon
    names GPUs by UUID): from torch's device properties, else the driver."""
    import torch
    uuid = getattr(torch.cuda.get_device_properties(device_index), "uuid", None)
    if uuid is not None:
        try:
            return parse_gpu_uuid(str(uuid))
        except Error:
            raw = getattr(uuid, "bytes", None)
            if raw is not None:
                try:
                    return parse_gpu_uuid(bytes(bytearray(raw)))
                except (Error, TypeError, ValueError):
                    pass
    d = driver()
    dev = ctypes.c_int(-1)
    d.call("cuDeviceGet", ctypes.byref(dev), int(device_index))
    out = CUuuid()
    d.call("cuDeviceGetUuid_v2", ctypes.byref(out), dev.value)
    return bytes(out.bytes)


# ---------------------------------------------------------------- tensors


class _DeviceArray:
    """Hands torch a device range through __cuda_array_interface__ (v3) and
    keeps `owner` alive: torch holds this object until the storage made from
    it dies."""

    def __init__(self, ptr, nbytes, owner):
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (int(nbytes),), "typestr": "|u1", "data": (int(ptr), False),
            "version": 3, "strides": None}


def tensor_from_ptr(ptr, nbytes, dtype, shape, device_index, owner):
    """A torch CUDA tensor of `dtype` and `shape` over the `nbytes` bytes at
    device address `ptr` on device `device_index`, without a copy; `owner`
    (e.g. the VmmAllocation) lives as long as the tensor's storage. bf16,
    fp8 and bool have no typestr of their own: the range is handed over as
    uint8 and viewed as `dtype`."""
    import torch
    nbytes = int(nbytes)
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype, device="cuda:%d" % device_index)
    with torch.cuda.device(device_index):
        raw = torch.as_tensor(_DeviceArray(ptr, nbytes, owner),
                              device="cuda:%d" % device_index)
    if raw.data_ptr() != int(ptr) or raw.device.index != device_index or \
            raw.dtype != torch.uint8 or raw.numel() != nbytes:
        raise Error("INTERNAL", "torch did not wrap device memory 0x%x in place (got 0x%x on "
                    "%s)" % (int(ptr), raw.data_ptr(), raw.device))
    return view_bytes(raw, 0, nbytes, dtype, shape)


def view_bytes(raw, offset, length, dtype, shape):
    """[offset, offset+length) of the 1-D uint8 CUDA tensor `raw` as a tensor
    of `dtype` and `shape` (a view: the same memory). length 0: a new empty
    tensor of that shape on the same device."""
    import torch
    if int(length) == 0:
        return torch.empty(shape, dtype=dtype, device=raw.device)
    piece = raw.narrow(0, int(offset), int(length))
    if dtype != torch.uint8:
        piece = piece.view(dtype)
    return piece.view(tuple(shape))


# ---------------------------------------------------------------- protocol


def cuda_push_request(lease_id, token, gpu_uuid, size, offsets=None, num_offsets=None,
                      handle_kind=HANDLE_VMM_POSIX_FD, ipc_handle=b""):
    """The bytes of a CUDA push: (header, rest) — the 32-byte PushRequest
    ("WDC1"; the fd rides on it) and the CudaPushTarget followed by the
    offsets (u64 little-endian). num_offsets: the header's count (default
    len(offsets); 0 = the default layout). Raw: no checks beyond sizes."""
    offsets = [int(o) for o in (offsets or ())]
    count = len(offsets) if num_offsets is None else int(num_offsets)
    token, gpu_uuid, ipc_handle = bytes(token), bytes(gpu_uuid), bytes(ipc_handle)
    if len(token) != 16 or len(gpu_uuid) != 16 or len(ipc_handle) > 64:
        raise Error("INVALID_ARGUMENT", "a CUDA push needs a 16-byte token and GPU UUID and "
                    "at most 64 bytes of IPC handle")
    header = _HEADER.pack(CUDA_PUSH_MAGIC, count, int(lease_id), token)
    target = _TARGET.pack(gpu_uuid, int(size), int(handle_kind), 0, ipc_handle.ljust(64, b"\0"))
    return header, target + (struct.pack("<%dQ" % len(offsets), *offsets) if offsets else b"")


def decode_cuda_push_request(data):
    """The inverse of cuda_push_request (tests): a dict of the fields."""
    magic, count, lease_id, token = _HEADER.unpack_from(data, 0)
    uuid, size, kind, reserved, ipc = _TARGET.unpack_from(data, _HEADER.size)
    rest = data[_HEADER.size + _TARGET.size:]
    if len(rest) % 8:
        raise ValueError("trailing %d bytes" % (len(rest) % 8))
    offsets = list(struct.unpack("<%dQ" % (len(rest) // 8), rest)) if rest else []
    return {"magic": magic, "num_offsets": count, "lease_id": lease_id, "token": token,
            "gpu_uuid": uuid, "size": size, "handle_kind": kind, "reserved": reserved,
            "ipc_handle": ipc, "offsets": offsets}


def send_cuda_push(sock, lease_id, token, fds, gpu_uuid, size, offsets=None, num_offsets=None,
                   handle_kind=HANDLE_VMM_POSIX_FD, ipc_handle=b""):
    """Sends a CUDA push on the connected `sock`: the header with `fds`
    riding on it (one VMM fd; none for a legacy handle), then the target and
    the offsets. Raw: no reply read."""
    header, rest = cuda_push_request(lease_id, token, gpu_uuid, size, offsets, num_offsets,
                                     handle_kind, ipc_handle)
    sent = socket.send_fds(sock, [header], list(fds)) if fds else sock.send(header)
    if sent < len(header):
        sock.sendall(header[sent:])
    sock.sendall(rest)


def push_cuda(path, lease_id, token, fd, gpu_uuid, size, offsets=None, timeout=30.0):
    """Has the daemon copy lease `lease_id`'s tensors into the GPU allocation
    exported as `fd` (a VMM POSIX fd; `size`: the allocation's bytes, on the
    GPU `gpu_uuid`) at `offsets` (None = the default layout), over the data
    socket at `path`. Returns once every byte is in place (the daemon has
    synchronized its copies); the connection is then closed, which ends the
    lease. Errors as _datasock.push (the daemon's code on refusal:
    FAILED_PRECONDITION when it has no GPU, NOT_FOUND for a GPU it does not
    have, INVALID_ARGUMENT for an allocation it cannot import or map).
    `fd` stays open."""
    if offsets is not None:
        offsets = [int(o) for o in offsets] or None
    return _datasock.push_request(
        path, token, timeout, "CUDA push",
        lambda sock: send_cuda_push(sock, lease_id, token, [fd], gpu_uuid, size, offsets))

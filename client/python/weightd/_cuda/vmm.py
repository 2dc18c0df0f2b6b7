"""Device memory through CUDA's VMM API: this process's own allocations
(VmmAllocation, vmm_alloc: a CUDA push's destination) and the daemon's
exports imported here (VmmImport).

Allocation: cuMemCreate (pinned device memory, exportable as a POSIX fd) ->
cuMemAddressReserve -> cuMemMap -> cuMemSetAccess (read-write for that
device) -> cuMemExportToShareableHandle.

Lifetime: a VmmAllocation frees itself (synchronize the context, unmap, free
the address range, release the handle, close the exported fd) on free() or
when garbage collected. Tensors made by tensor_from_ptr() (device.py) hold
their owner (the allocation) through the object whose
__cuda_array_interface__ torch consumed: torch keeps that object alive
until the tensor's storage dies, so device memory is never freed under a
live tensor or view. free() is thread-safe (once, under the object's lock).
"""
import ctypes
import os
import threading

from ..errors import Error
from .libcuda import (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                     CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                     CU_MEM_ACCESS_FLAGS_PROT_READ, CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                     CU_MEM_ALLOC_GRANULARITY_MINIMUM, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                     CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                     CU_MEM_LOCATION_TYPE_DEVICE, CUmemAccessDesc, CUmemAllocationProp,
                     _PrimaryContext, _u64, driver)


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


def vmm_alloc(device_ordinal, size):
    """`size` bytes (rounded up to the allocation granularity, at least one
    granule) of device memory on CUDA device `device_ordinal`, exportable as
    a POSIX fd: a VmmAllocation with .ptr, .size, .fd (exported; pass it to
    the daemon, then close_fd()) and .free()."""
    return VmmAllocation(device_ordinal, size)

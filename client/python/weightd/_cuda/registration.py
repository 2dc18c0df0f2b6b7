"""Host memory as a CUDA device reads it: read-only registrations of the
shard's pages (HostRegistration: pinned for a pull's copies, or mapped for
zero-copy's kernels), which pages a pull pins (pin_ranges), whether and how
a device can read a shard in place (zero_copy_path), and waiting for a
device's queued work (synchronize). A HostRegistration is unregistered
once, by whoever calls unregister() or by collection.
"""
import ctypes

from ..errors import Error
from .libcuda import (CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS,
                     CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED,
                     CU_MEMHOSTREGISTER_DEVICEMAP, CU_MEMHOSTREGISTER_READ_ONLY, _PrimaryContext,
                     _u64, driver)


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

"""Zero-copy (mode "zero-copy" on a device): the lease attached and its
segments mapped read-only (shared); the tensors are CUDA tensors over those
very pages, read by the device in place: at their host address where it
reads pageable memory coherently (Grace Hopper / Blackwell, HMM), else
through a read-only mapped registration of the shard's pages
(cuMemHostRegister DEVICEMAP | READ_ONLY; over PCIe, slow for compute). The
lease ends with release(); the pages and registrations live as long as a
tensor made from them (_ZeroCopyHold)."""
from .. import _cuda, _dtypes
from ..errors import Error
from ..handle import ShardHandle, _address_of
from . import common


class _ZeroCopyHold:
    """What a zero-copy handle's tensors read: the segment maps and the
    mapped registrations of their pages. Each tensor holds it; the last one
    to go unregisters the pages (after the device's queued reads) and then
    drops the maps. Not thread-safe: closed once, by collection."""

    def __init__(self, maps, index):
        self.maps = maps
        self.index = index
        self.regs = []

    def close(self):
        if self.maps is None:
            return
        # Kernels queued on the tensors may still read the pages: wait for
        # them before the registrations and the maps go.
        try:
            _cuda.synchronize(self.index)
        except Error:
            pass
        regs, self.regs = self.regs, []
        for r in regs:
            try:
                r.unregister()
            except Error:
                pass
        self.maps = None

    def __del__(self):
        self.close()


def _device_ranges(hold, metas, sizes, pageable):
    """[(segment, lo, hi, device address of lo)]: the shard's page ranges
    as the device reads them (their host addresses where `pageable`, else
    mapped registrations, which `hold` keeps)."""
    ranges = []
    for seg, lo, hi in _cuda.pin_ranges([(m.segment, m.offset, m.length) for m in metas],
                                        sizes, common.PAGE):
        host = _address_of(hold.maps[seg]) + lo
        if pageable:
            ranges.append((seg, lo, hi, host))
        else:
            reg = _cuda.host_register_read_only(hold.index, host, hi - lo, mapped=True)
            hold.regs.append(reg)
            ranges.append((seg, lo, hi, reg.device_ptr))
    return ranges


def _tensors(hold, metas, sizes, pageable):
    """{name: CUDA tensor} over the shard's pages, and the device ranges
    they lie in."""
    import torch
    index = hold.index
    ranges = _device_ranges(hold, metas, sizes, pageable)
    out = {}
    for m in metas:
        dt = _dtypes.torch_dtype(m.dtype)
        if not m.length:
            out[m.name] = torch.empty(m.shape, dtype=dt, device="cuda:%d" % index)
            continue
        ptr = next(d + (m.offset - lo) for seg, lo, hi, d in ranges
                   if seg == m.segment and lo <= m.offset and m.offset + m.length <= hi)
        out[m.name] = _cuda.tensor_from_ptr(ptr, m.length, dt, m.shape, index, hold)
    return out, [(d, d + (hi - lo)) for _, lo, hi, d in ranges]


def _wrapped(hold, metas, sizes, pageable):
    """_tensors() over the host addresses where the device reads pageable
    memory, falling back to registrations when torch takes none there:
    (tensors, ranges, pageable as used)."""
    try:
        out, ranges = _tensors(hold, metas, sizes, pageable)
        return out, ranges, pageable
    except RuntimeError as e:
        if not pageable:
            raise Error("INTERNAL", "torch took no tensor over the registered shard: "
                        "%s" % e) from None
        # A torch that wraps only device or registered addresses
        # (it asks CUDA where a pointer lives): the registration.
        try:
            out, ranges = _tensors(hold, metas, sizes, False)
        except Error as refused:
            raise Error(refused.code, "torch took no tensor over the host address of "
                        "the shard (%s), and the registration instead failed: %s"
                        % (e, refused.message)) from None
        return out, ranges, False


def collect(client, resp, lease, target):
    index = target.device
    sizes = list(resp.segment_sizes)
    metas = common.metas(resp)
    maps = common.attach_and_map(client, resp, lease, private=False)
    hold = _ZeroCopyHold(maps, index)
    try:
        out, ranges, pageable = _wrapped(hold, metas, sizes,
                                         target.zero_copy_path == _cuda.ZERO_COPY_PAGEABLE)
    except BaseException:
        hold.close()
        raise
    pieces = {m.name: (out[m.name], None) if m.length else None for m in metas}
    h = common.identified(resp, ShardHandle(lease, resp.generation, "shm", metas, pieces,
                                            device="cuda:%d" % index, mode="zero-copy"))
    h.pageable_access = pageable
    h.read_only = True
    h.access = "read-only"  # a PROT_READ map; registered READ_ONLY where not pageable
    h._ranges = sorted(ranges)
    return h

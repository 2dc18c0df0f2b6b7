"""Pull (mode "pull" on a device): the lease attached and its segments
mapped read-only (shared), the shard's pages pinned read-only when asked
(and CUDA allows: cuMemHostRegister READ_ONLY), every tensor copied to the
GPU by torch, synchronized; then the lease ends. The tensors are ordinary
CUDA tensors owned by torch's allocator."""
import warnings

from .. import _cuda, _dtypes
from ..errors import Error
from ..handle import ShardHandle, _address_of
from . import common


def _pin(maps, metas, sizes, index):
    """Read-only registrations of the shard's pages, and "" - or [] and why
    CUDA refused (nothing stays registered then)."""
    regs = []
    try:
        for seg, lo, hi in _cuda.pin_ranges([(m.segment, m.offset, m.length) for m in metas],
                                            sizes, common.PAGE):
            regs.append(_cuda.host_register_read_only(
                index, _address_of(maps[seg]) + lo, hi - lo))
    except Error as e:
        for r in regs:
            r.unregister()
        return [], e.message or e.code
    return regs, ""


def _copies(torch, maps, metas, device):
    """{name: CUDA tensor}: each tensor's bytes copied from the maps to
    `device`, synchronized."""
    out = {}
    with torch.cuda.device(device.index), warnings.catch_warnings():
        # torch warns that the read-only map is not writable: it is
        # only read from.
        warnings.simplefilter("ignore")
        for m in metas:
            dt = _dtypes.torch_dtype(m.dtype)
            if not m.length:
                out[m.name] = torch.empty(m.shape, dtype=dt, device=device)
                continue
            src = torch.frombuffer(maps[m.segment], dtype=torch.uint8, count=m.length,
                                   offset=m.offset)
            dst = torch.empty(m.length, dtype=torch.uint8, device=device)
            dst.copy_(src, non_blocking=True)
            out[m.name] = _cuda.view_bytes(dst, 0, m.length, dt, m.shape)
            del src, dst
        torch.cuda.synchronize(device.index)
    return out


def _unpin(torch, regs, index):
    if regs:
        try:  # no copy may still read the pages when they are unpinned
            torch.cuda.synchronize(index)
        except Exception:
            pass
    for r in regs:
        try:
            r.unregister()
        except Error:
            pass


def collect(client, resp, lease, target):
    import torch
    index = target.device
    sizes = list(resp.segment_sizes)
    metas = common.metas(resp)
    maps = common.attach_and_map(client, resp, lease, private=False)
    device = torch.device("cuda", index)
    regs, pin_error = [], ""
    try:
        if target.pin:
            regs, pin_error = _pin(maps, metas, sizes, index)
        out = _copies(torch, maps, metas, device)
    finally:
        _unpin(torch, regs, index)
    del maps  # unmapped once torch drops the source tensors
    lease.release()  # the bytes are this process's now
    pieces = {m.name: (out[m.name], None) if m.length else None for m in metas}
    h = common.identified(resp, ShardHandle(lease, resp.generation, "shm", metas, pieces,
                                            device=str(device), mode="pull"))
    h.pinned = bool(target.pin) and not pin_error
    h.pin_error = pin_error
    return h

"""What the delivery modes share: the FetchResponse's tensors checked
(metas), the data socket's segments attached and mapped, page population,
push timeouts and the default layout's metadata. Pure functions over their
arguments; the maps they return hold the lease."""
import dataclasses
import mmap
import os

from .. import _datasock, _dtypes
from .._types import tensor_meta
from ..errors import Error
from ..handle import _Segment

_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+
PAGE = mmap.PAGESIZE
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Python 3.12+ names it; Linux value


def metas(resp):
    """The FetchResponse's tensors as TensorMeta, checked."""
    sizes = list(resp.segment_sizes)
    out = []
    for t in resp.tensors:
        meta = tensor_meta(t)
        # A tensor cast on push names its stored bytes, not `length`
        # bytes of its dtype: only a push reads them (the daemon).
        if getattr(t, "cast_on_push", False):
            if meta.segment >= len(sizes) or meta.offset > sizes[meta.segment]:
                raise Error("INTERNAL", "daemon sent tensor \"%s\" outside its segment"
                            % meta.name)
        elif meta.segment >= len(sizes) or meta.offset > sizes[meta.segment] or \
                meta.length > sizes[meta.segment] - meta.offset:
            raise Error("INTERNAL", "daemon sent tensor \"%s\" outside its segment"
                        % meta.name)
        if meta.length != meta.numel * _dtypes.itemsize(meta.dtype):
            raise Error("INTERNAL", "daemon sent tensor \"%s\" of %d bytes for shape %s %s"
                        % (meta.name, meta.length, list(meta.shape), meta.dtype))
        out.append(meta)
    return out


def at_offsets(metas, offsets):
    """`metas` placed in one destination (segment 0) at `offsets`."""
    return [dataclasses.replace(m, segment=0, offset=at) for m, at in zip(metas, offsets)]


def attach_and_map(client, resp, lease, private):
    """Attaches the lease on the data socket (the connection then holds
    it) and maps each of its segments: `private` - copy-on-write, each
    map holding the lease (the export's zero-copy tensors); else shared
    read-only (a pull's source). None for an empty segment."""
    sizes = list(resp.segment_sizes)
    conn, fds = _datasock.attach(_datasock.data_socket_of(client.socket, resp), resp.lease_id,
                                 bytes(resp.token), len(sizes))
    lease.conn = conn
    maps = []
    try:
        for fd, size in zip(fds, sizes):
            if size == 0:
                maps.append(None)
            elif private:
                # MAP_NORESERVE: a private map of a hugetlb segment
                # would otherwise reserve a pool page for each of its
                # pages up front (for plain shmem it only skips the
                # overcommit charge of a map written rarely, if ever).
                seg = _Segment(fd, size, flags=mmap.MAP_PRIVATE | _MAP_NORESERVE,
                               prot=mmap.PROT_READ | mmap.PROT_WRITE)
                seg._lease = lease
                maps.append(seg)
            else:
                maps.append(mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
    except OSError as e:
        raise Error("INTERNAL", "mapping a segment: %s" % e) from None
    finally:
        for fd in fds:  # mmap keeps its own reference
            os.close(fd)
    return maps


def populate(seg, offset, length):
    """Fills the page tables of this shard's bytes now (one madvise instead
    of a fault per page on first read). Best effort: older kernels refuse
    MADV_POPULATE_READ and the pages then fault in on first use."""
    start = offset // PAGE * PAGE
    end = min(len(seg), -(-(offset + length) // PAGE) * PAGE)
    try:
        seg.madvise(_MADV_POPULATE_READ, start, end - start)
    except OSError:
        pass


def push_timeout(timeout, size):
    """How long to wait for a push's reply: the caller's bound, else 30 s
    plus the time to write `size` bytes at a slow 100 MiB/s."""
    if timeout is not None:
        return timeout
    return 30.0 + size / float(100 << 20)


def identified(resp, handle):
    """The handle with the generation's weights_id (FetchResponse)."""
    handle.weights_id = getattr(resp, "weights_id", "")
    return handle

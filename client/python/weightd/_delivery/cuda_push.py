"""CUDA push (mode "push" on a device, docs/DESIGN.md §9.3): the client allocates
device memory with CUDA's VMM API at the default layout, exports it as a
POSIX fd over the data socket, and the daemon copies (casts, merges) the
shard into it and answers once its copies are synchronized. The tensors
are CUDA tensors over that one allocation; refresh() has the daemon rewrite
the changed ones in place."""
import os

from .. import _cuda, _datasock
from ..errors import Error
from ..handle import ShardHandle
from . import common
from .push import PushDest, copy_of


class CudaPushDest(PushDest):
    """A CUDA push handle's destination: the VMM allocation, the uint8 CUDA
    tensor over all of it (every tensor of the handle is a view of it), the
    device index and its UUID."""

    def __init__(self, client, request, timeout, alloc, raw, index, uuid):
        super().__init__(client, request, timeout, -1, None, alloc.size)
        self.alloc = alloc
        self.raw = raw
        self.index = index
        self.uuid = uuid

    def push(self, resp, offsets, timeout):
        if self.alloc is None:
            raise Error("FAILED_PRECONDITION", "the shard handle was released")
        import torch
        # Work this process queued on the tensors finishes before the daemon
        # overwrites them.
        torch.cuda.synchronize(self.index)
        fd = self.alloc.export_fd()
        try:
            _cuda.push_cuda(_datasock.data_socket_of(self.client.socket, resp), resp.lease_id,
                            bytes(resp.token), fd, self.uuid, self.alloc.size, offsets, timeout)
        finally:
            os.close(fd)

    def close(self):
        # The allocation lives on in tensors still using it (they hold it).
        self.alloc = None
        self.raw = None

    def __del__(self):
        pass


def collect(client, resp, lease, target):
    """Allocates the destination on device target.device (VMM, the default
    layout), has the daemon fill it (which ends the lease) and wraps it in
    CUDA tensors."""
    import torch
    index = target.device
    metas = common.metas(resp)
    offsets, size = _datasock.default_layout([m.length for m in metas])
    uuid = _cuda.gpu_uuid_bytes(index)
    alloc = _cuda.vmm_alloc(index, size)
    try:
        try:
            _cuda.push_cuda(_datasock.data_socket_of(client.socket, resp), resp.lease_id,
                            bytes(resp.token), alloc.fd, uuid, alloc.size, None,
                            common.push_timeout(target.timeout, size))
        finally:
            alloc.close_fd()
        lease.done = True  # closing the push's connection ended the lease
        raw = _cuda.tensor_from_ptr(alloc.ptr, alloc.size, torch.uint8, (alloc.size,),
                                    index, alloc)
    except BaseException:
        alloc.free(quiet=True)
        raise
    metas = common.at_offsets(metas, offsets)
    pieces = {m.name: (raw, m.offset) if m.length else None for m in metas}
    dest = CudaPushDest(client, copy_of(target.request), target.timeout, alloc, raw, index,
                        uuid)
    del alloc  # the handle's hold is dest.alloc and raw (which holds it too)
    return common.identified(resp, ShardHandle(lease, resp.generation, "shm", metas, pieces,
                                               push=dest, device="cuda:%d" % index))

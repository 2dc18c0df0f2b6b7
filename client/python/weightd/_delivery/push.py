"""Host push (mode "push", docs/DESIGN.md §9.1, §4.5): the client allocates a memfd at the
default layout, passes it over the data socket, and the daemon writes the
shard into it (which ends the lease); the tensors are views of one shared
writable map of it. PushDest keeps what refresh() needs to have the daemon
rewrite, in the same memory, the tensors a newer generation changed."""
import dataclasses
import fcntl
import mmap
import os
import threading

from .. import _datasock
from ..errors import Error
from ..handle import ShardHandle, _Lease
from ..v1 import weightd_pb2 as pb
from . import common


class PushDest:
    """A push handle's destination and what refresh() needs: the client's
    memfd, its shared writable map (None when the layout is 0 bytes), and
    the client and request to fetch again with. `lock`: one refresh at a
    time; release waits for it (the handle takes it)."""

    def __init__(self, client, request, timeout, fd, mapping, size):
        self.client = client
        self.request = request  # pb.FetchRequest, as first fetched
        self.timeout = timeout
        self.fd = fd
        self.mapping = mapping
        self.size = size
        self.lock = threading.Lock()  # one refresh at a time; release waits for it

    def push(self, resp, offsets, timeout):
        """Has the daemon write lease `resp`'s tensors at `offsets`."""
        _datasock.push(_datasock.data_socket_of(self.client.socket, resp), resp.lease_id,
                       bytes(resp.token), self.fd, offsets, timeout)

    def refresh(self, handle, generation):
        """ShardHandle.refresh (the caller holds `lock`)."""
        return refresh(self, handle, generation)

    def close(self):
        fd, self.fd = self.fd, -1
        self.mapping = None  # the map lives on in tensors still using it
        if fd >= 0:
            os.close(fd)

    def __del__(self):
        try:
            self.close()
        except BaseException:
            pass


def copy_of(request):
    copy = pb.FetchRequest()
    copy.CopyFrom(request)
    return copy


def _memfd(size):
    """A memfd of `size` bytes, allocated whole and sealed against
    shrinking and growing (what the daemon takes as a destination)."""
    fd = os.memfd_create("weightd-push", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        if size:
            try:
                os.ftruncate(fd, size)
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise Error("RESOURCE_EXHAUSTED", "allocating the push's destination of %d "
                            "bytes: %s" % (size, e.strerror or e)) from None
        # The daemon takes only a destination whose size cannot change
        # under its writes.
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    except BaseException:
        os.close(fd)
        raise
    return fd


def collect(client, resp, lease, target):
    """Allocates the destination, has the daemon fill it (which ends the
    lease) and maps it."""
    metas = common.metas(resp)
    offsets, size = _datasock.default_layout([m.length for m in metas])
    fd = _memfd(size)
    try:
        _datasock.push(_datasock.data_socket_of(client.socket, resp), resp.lease_id,
                       bytes(resp.token), fd, None, common.push_timeout(target.timeout, size))
        lease.done = True  # closing the push's connection ended the lease
        mapping = None
        if size:
            try:
                mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                                    prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as e:
                raise Error("INTERNAL", "mapping the push's destination: %s" % e) from None
    except BaseException:
        os.close(fd)
        raise
    metas = common.at_offsets(metas, offsets)
    pieces = {m.name: (mapping, m.offset) if m.length else None for m in metas}
    if target.populate and mapping is not None:
        common.populate(mapping, 0, size)
    dest = PushDest(client, copy_of(target.request), target.timeout, fd, mapping, size)
    return common.identified(resp, ShardHandle(lease, resp.generation, "shm", metas, pieces,
                                               push=dest))


def _offsets_in(handle, metas, generation):
    """Where the handle holds each changed tensor; FAILED_PRECONDITION for
    one it lacks or holds with another dtype or shape."""
    have = {m.name: m for m in handle.tensors}
    offsets = []
    for m in metas:
        old = have.get(m.name)
        if old is None:
            raise Error("FAILED_PRECONDITION", "tensor \"%s\" changed at generation "
                        "%d but this handle does not hold it; fetch again"
                        % (m.name, generation))
        if (old.dtype, old.shape, old.length) != (m.dtype, m.shape, m.length):
            raise Error("FAILED_PRECONDITION", "tensor \"%s\" is %s %s at generation "
                        "%d but %s %s in this handle; fetch again"
                        % (m.name, m.dtype, list(m.shape), generation,
                           old.dtype, list(old.shape)))
        offsets.append(old.offset)
    return offsets


def refresh(dest, handle, generation):
    """Fetches dest's request again (changed_since = the handle's
    generation) and has the daemon write the changed tensors where the
    handle holds them; updates the handle. Retried whole on UNAVAILABLE."""
    client = dest.client
    req = copy_of(dest.request)
    req.generation = int(generation or 0)
    req.changed_since = int(handle.generation)

    def attempt():
        try:
            resp = client._call(client._shards.Fetch, req, timeout=dest.timeout)
        except ValueError as e:  # the client's channel was closed
            raise Error("FAILED_PRECONDITION", "refresh: %s" % e) from None
        lease = _Lease(client._shards, resp.lease_id, bytes(resp.token))
        try:
            metas = common.metas(resp)
            offsets = _offsets_in(handle, metas, resp.generation)
            dest.push(resp, offsets,
                      common.push_timeout(dest.timeout, sum(m.length for m in metas)))
            lease.done = True
            return resp.generation, metas, getattr(resp, "weights_id", "")
        except BaseException:
            lease.release_quietly()
            raise
    gen, metas, weights_id = client._retrying(attempt)
    changed = {m.name: m for m in metas}
    handle.tensors = [
        dataclasses.replace(t, digest=changed[t.name].digest,
                            global_shape=changed[t.name].global_shape,
                            global_offset=changed[t.name].global_offset)
        if t.name in changed else t for t in handle.tensors]
    handle.generation = gen
    handle.weights_id = weights_id
    return [m.name for m in metas]

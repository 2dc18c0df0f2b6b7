"""CUDA export (mode "export" on a device): the daemon's own device buffer
of the shard (filled once, cast and merged on the GPU, and shared by every
process that exports the same fetch to the same GPU), passed as a VMM POSIX
fd, imported and mapped read-only here; CUDA tensors over it at the
default layout. The data connection holds the lease (and the daemon's hold
on the buffer) until release(); the mapping lives as long as a tensor made
from it."""
import os

from .. import _cuda, _datasock
from ..errors import Error
from ..handle import ShardHandle
from . import common


def _import(client, resp, lease, target, layout_size):
    """The daemon's export of lease `resp`, imported (a VmmImport that
    holds the export's connection)."""
    index = target.device
    uuid = _cuda.gpu_uuid_bytes(index)
    sock, fd, size, got_layout = _cuda.export(
        _datasock.data_socket_of(client.socket, resp), resp.lease_id, bytes(resp.token), uuid,
        common.push_timeout(target.timeout, layout_size))
    lease.conn = sock  # until the import holds it
    try:
        if got_layout != layout_size or size < layout_size:
            raise Error("INTERNAL", "the daemon exported %d bytes for a layout of %d; this "
                        "client computes %d" % (size, got_layout, layout_size))
        imported = _cuda.VmmImport(index, fd, size)
    finally:
        os.close(fd)  # the import holds its own reference
    # The connection holds the daemon's buffer (counted against its
    # --device-memory-bytes) as long as this process maps it: the
    # import closes it when the last tensor goes; release() ends the
    # lease (Release) but keeps the connection while tensors live.
    imported.export_conn, lease.conn = sock, None
    lease.conn_elsewhere = True
    return imported


def collect(client, resp, lease, target):
    import torch
    index = target.device
    metas = common.metas(resp)
    offsets, layout_size = _datasock.default_layout([m.length for m in metas])
    imported = _import(client, resp, lease, target, layout_size)
    raw = _cuda.tensor_from_ptr(imported.ptr, imported.size, torch.uint8, (imported.size,),
                                index, imported)
    metas = common.at_offsets(metas, offsets)
    pieces = {m.name: (raw, m.offset) if m.length else None for m in metas}
    h = common.identified(resp, ShardHandle(lease, resp.generation, "shm", metas, pieces,
                                            device="cuda:%d" % index, mode="export"))
    h.read_only = True
    h.access = "read-only" if imported.read_only else "read-write"
    h.access_error = imported.read_only_refused
    h._ranges = [(imported.ptr, imported.ptr + imported.size)]
    return h

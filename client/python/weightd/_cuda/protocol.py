"""The data socket's CUDA requests (common/data_protocol.h): a CUDA push,
and an export of the daemon's own device buffer.

CUDA push: a PushRequest whose magic is "WDC1" (the same 32 bytes as a host
push: magic, u32 num_offsets, u64 lease_id, 16-byte token), then a 96-byte
CudaPushTarget {16-byte GPU UUID, u64 size (the allocation's bytes), u32
handle_kind (1 = VMM POSIX fd), u32 reserved, 64-byte ipc_handle (legacy
IPC only, zero otherwise)}, then num_offsets u64 offsets (none for the
default layout). The allocation's exported fd rides on the header
(SCM_RIGHTS). The daemon imports and maps the allocation, copies every
tensor in, synchronizes its streams and only then answers an AttachReply:
every byte is in place when the reply arrives.

Export: the same request with handle_kind 3 and no fd; the OK reply carries
an ExportInfo {u64 size, u64 layout_size} and the buffer's fd, and the
connection then holds the lease and the buffer. Pure functions over
sockets; nothing here loads the driver.
"""
import os
import socket
import struct

from .. import _datasock
from ..errors import Error

CUDA_PUSH_MAGIC = b"WDC1"
HANDLE_VMM_POSIX_FD = 1  # kCudaVmmPosixFd
HANDLE_LEGACY_IPC = 2    # kCudaLegacyIpc
HANDLE_DAEMON_EXPORT = 3  # kCudaDaemonExport
HOST_UUID = bytes(16)     # an export's host twin: a sealed memfd
_EXPORT_INFO = struct.Struct("<QQ")  # ExportInfo
_HEADER = struct.Struct("<4sIQ16s")   # PushRequest
_TARGET = struct.Struct("<16sQII64s")  # CudaPushTarget
assert _HEADER.size == 32 and _TARGET.size == 96


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

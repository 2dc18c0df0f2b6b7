"""The shm data-socket protocol (common/data_protocol.h, DESIGN §5).

After Fetch the client connects to the daemon's data socket and sends a
32-byte AttachRequest {magic "WDA1", u32 reserved, u64 lease_id, 16-byte
token}. The daemon answers a 16-byte AttachReply {magic "WDR1", i32 code,
u32 num_fds, u32 message_len}, then message_len bytes of error text; on
success one fd per segment arrives with SCM_RIGHTS, the first batch (<= 250)
on the header and every further batch on one byte of its own. The lease
lives as long as the connection stays open. A daemon past its connection caps
answers RESOURCE_EXHAUSTED before any request and closes the connection.
"""
import os
import socket
import struct

from .errors import Error

ATTACH_MAGIC = b"WDA1"
REPLY_MAGIC = b"WDR1"
_ATTACH = struct.Struct("<4sIQ16s")
_REPLY = struct.Struct("<4siII")
MAX_REPLY_MESSAGE = 4096
_MAX_FDS_PER_RECV = 256  # the daemon sends at most 250 per message

assert _ATTACH.size == 32 and _REPLY.size == 16


def _recv(sock, n, fds):
    """Receives exactly n bytes, appending any fds that ride along."""
    buf = bytearray()
    while len(buf) < n:
        data, got, flags, _ = socket.recv_fds(sock, n - len(buf), _MAX_FDS_PER_RECV,
                                               socket.MSG_CMSG_CLOEXEC)
        fds.extend(got)
        if flags & socket.MSG_CTRUNC:
            raise Error("INTERNAL", "fds truncated on the data socket (fd limit reached?)")
        if not data:
            raise Error("UNAVAILABLE", "data socket closed by the daemon after %d of %d bytes"
                        % (len(buf), n))
        buf += data
    return bytes(buf)


def attach(path, lease_id, token, num_segments, timeout=30.0):
    """Attaches lease `lease_id` on the data socket at `path`.

    Returns (connection, fds): the open connection (which keeps the lease)
    and one fd per segment, in segment order. Raises Error; on error every
    received fd is closed.
    """
    if len(token) != 16:
        raise Error("INTERNAL", "daemon sent a lease token of %d bytes (want 16)" % len(token))
    if not path:
        raise Error("FAILED_PRECONDITION", "daemon named no data socket; use transport=\"grpc\"")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    fds = []
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError as e:
            raise Error("UNAVAILABLE", "cannot connect to the data socket %s: %s "
                        "(a remote daemon? use transport=\"grpc\")" % (path, e.strerror or e))
        try:
            sock.sendall(_ATTACH.pack(ATTACH_MAGIC, 0, lease_id, bytes(token)))
        except (BrokenPipeError, ConnectionResetError):
            pass  # a daemon past its connection caps answers and closes first: read why
        magic, code, num_fds, message_len = _REPLY.unpack(_recv(sock, _REPLY.size, fds))
        if magic != REPLY_MAGIC:
            raise Error("INTERNAL", "bad reply magic on the data socket")
        if message_len > MAX_REPLY_MESSAGE:
            raise Error("INTERNAL", "oversized reply message on the data socket")
        msg = _recv(sock, message_len, fds).decode("utf-8", "replace") if message_len else ""
        if code != 0:
            raise Error(code, msg)
        while len(fds) < num_fds:
            _recv(sock, 1, fds)
        if len(fds) != num_segments:
            raise Error("INTERNAL", "daemon passed %d fds for %d segments"
                        % (len(fds), num_segments))
        sock.settimeout(None)
        return sock, fds
    except BaseException as e:
        for fd in fds:
            os.close(fd)
        sock.close()
        if isinstance(e, socket.timeout):
            raise Error("DEADLINE_EXCEEDED", "no reply on the data socket %s" % path) from None
        if isinstance(e, OSError):
            raise Error("UNAVAILABLE", "data socket %s: %s" % (path, e)) from None
        raise

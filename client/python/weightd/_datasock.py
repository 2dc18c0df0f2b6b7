"""The shm data-socket protocol (common/data_protocol.h, docs/DESIGN.md §4.5).

After Fetch the client connects to the daemon's data socket and sends a
32-byte AttachRequest {magic "WDA1", u32 reserved, u64 lease_id, 16-byte
token}. The daemon answers a 16-byte AttachReply {magic "WDR1", i32 code,
u32 num_fds, u32 message_len}, then message_len bytes of error text; on
success one fd per segment arrives with SCM_RIGHTS, the first batch (<= 250)
on the header and every further batch on one byte of its own. The lease
lives as long as the connection stays open. A daemon past its connection caps
answers RESOURCE_EXHAUSTED before any request and closes the connection.

Push (docs/DESIGN.md §4.5): instead of attaching, the client sends a 32-byte
PushRequest {magic "WDP1", u32 num_offsets, u64 lease_id, 16-byte token} with
exactly one fd riding on it (SCM_RIGHTS): a memfd the client allocated
(allocated whole with fallocate, writable, not write-sealed but sealed
against shrinking and growing with F_SEAL_SHRINK | F_SEAL_GROW, at least as
large as the layout), then num_offsets u64 little-endian byte offsets, one
per tensor of the FetchResponse in its order, or none for the default layout
(default_layout). The daemon writes every tensor there and answers the same
AttachReply with no fds once every byte is in place. The lease is attached to
the connection when the header arrives: closing it ends the lease. A push
refused before its offsets are read (unknown lease, wrong token, num_offsets
neither 0 nor the tensor count) with offsets following is answered and the
connection closed; other refusals leave it open for another request.
"""
import os
import socket
import struct

from .errors import Error

ATTACH_MAGIC = b"WDA1"
REPLY_MAGIC = b"WDR1"
PUSH_MAGIC = b"WDP1"
STAGE_MAGIC = b"WDS1"
PUSH_ALIGNMENT = 256  # kPushAlignment (common/push_layout.h)
_MAX_END = 1 << 63
_ATTACH = struct.Struct("<4sIQ16s")
_REPLY = struct.Struct("<4siII")
_PUSH = struct.Struct("<4sIQ16s")
MAX_REPLY_MESSAGE = 4096
_MAX_FDS_PER_RECV = 256  # the daemon sends at most 250 per message

assert _ATTACH.size == 32 and _REPLY.size == 16 and _PUSH.size == 32


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
        code, msg, got = read_reply(sock)
        fds.extend(got)
        if code != 0:
            raise Error(code, msg)
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


def data_socket_of(socket, resp):
    """Where to collect a lease's fds (or a publish's staging memfd): beside
    the Unix socket this client connected to when the daemon's data socket
    lies beside its own (the directory may be mounted at another path here
    than in the daemon's container), else the path the daemon gave. `resp`:
    a FetchResponse or a PublishSession (data_socket, data_socket_name)."""
    if socket is not None and resp.data_socket_name:
        return os.path.join(os.path.dirname(os.path.realpath(socket)), resp.data_socket_name)
    return resp.data_socket


# ---------------------------------------------------------------- push


def default_layout(lengths):
    """The default push layout (common/push_layout.cc DefaultPushLayout):
    tensor i at the next multiple of PUSH_ALIGNMENT after tensor i-1's end,
    the first at 0. Returns (offsets, size), size = the last tensor's end
    (0 for none). Error INVALID_ARGUMENT past 2^63 bytes."""
    offsets = []
    end = 0
    for i, n in enumerate(lengths):
        n = int(n)
        if n < 0:
            raise Error("INVALID_ARGUMENT", "tensor %d of the push has a negative length" % i)
        at = -(-end // PUSH_ALIGNMENT) * PUSH_ALIGNMENT
        if n > _MAX_END or at > _MAX_END - n:
            raise Error("INVALID_ARGUMENT", "tensor %d of the push ends past 2^63 bytes" % i)
        offsets.append(at)
        end = at + n
    return offsets, end


def send_push(sock, lease_id, token, fds, offsets=None, num_offsets=None):
    """Sends a PushRequest on the connected `sock`: the header with `fds`
    riding on it (the protocol wants exactly one; tests pass others), then
    the offsets (u64 little-endian). num_offsets: the header's count
    (default: len(offsets)). Raw: no checks, no reply read."""
    offsets = list(offsets or ())
    count = len(offsets) if num_offsets is None else int(num_offsets)
    header = _PUSH.pack(PUSH_MAGIC, count, lease_id, bytes(token))
    sent = socket.send_fds(sock, [header], list(fds)) if fds else sock.send(header)
    if sent < len(header):
        sock.sendall(header[sent:])
    if offsets:
        sock.sendall(struct.pack("<%dQ" % len(offsets), *offsets))


def read_reply(sock, raw=False):
    """Reads one AttachReply: (code, message, fds). Raw: the caller closes
    any fds (a push reply carries none) and raises on code != 0. `raw`: the
    message as bytes (an export's OK reply carries an ExportInfo)."""
    fds = []
    try:
        magic, code, num_fds, message_len = _REPLY.unpack(_recv(sock, _REPLY.size, fds))
        if magic != REPLY_MAGIC:
            raise Error("INTERNAL", "bad reply magic on the data socket")
        if message_len > MAX_REPLY_MESSAGE:
            raise Error("INTERNAL", "oversized reply message on the data socket")
        msg = _recv(sock, message_len, fds) if message_len else b""
        if not raw or code != 0:
            msg = msg.decode("utf-8", "replace")
        while code == 0 and len(fds) < num_fds:
            _recv(sock, 1, fds)
        return code, msg, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def push(path, lease_id, token, fd, offsets=None, timeout=30.0):
    """Has the daemon write lease `lease_id`'s tensors into the memfd `fd`
    (the client's) at `offsets` (one per tensor of the FetchResponse, in its
    order; None = default_layout), over the data socket at `path`.

    Returns None once every byte is in place; the connection is then closed,
    which ends the lease (the bytes are the client's now). Raises Error with
    the daemon's code on refusal (INVALID_ARGUMENT, FAILED_PRECONDITION,
    ABORTED, NOT_FOUND, PERMISSION_DENIED, ...), UNAVAILABLE when the daemon
    cannot be reached or goes away, DEADLINE_EXCEEDED after `timeout`
    seconds without the reply (None = wait for ever). `fd` stays open.
    """
    if offsets is not None:
        offsets = [int(o) for o in offsets]
        if not offsets:
            offsets = None  # no tensors: the default layout is the same
    return push_request(path, token, timeout, "push",
                        lambda sock: send_push(sock, lease_id, token, [fd], offsets))


def push_request(path, token, timeout, what, send):
    """One push on a fresh connection to the data socket at `path`: `send`
    writes the request on the connected socket, then the reply is read.
    Returns None once the daemon answered OK; raises Error otherwise (the
    daemon's code; UNAVAILABLE, DEADLINE_EXCEEDED for the connection). The
    connection is closed on return, which ends the lease. `what` names the
    push in messages."""
    if len(token) != 16:
        raise Error("INTERNAL", "daemon sent a lease token of %d bytes (want 16)" % len(token))
    if not path:
        raise Error("FAILED_PRECONDITION", "daemon named no data socket; a %s needs a local "
                    "daemon (transport \"shm\")" % what)
    fds = _exchange(path, timeout, what, "a %s needs a local one" % what, send)
    for extra in fds:
        os.close(extra)
    if fds:
        raise Error("INTERNAL", "daemon passed %d fds in reply to a %s" % (len(fds), what))
    return None


def request(path, timeout, what, remote_hint, send, raw=False):
    """One request on a fresh connection to the data socket at `path`:
    `send` writes it on the connected socket, then the reply is read. Returns
    (connection, message, fds) once the daemon answered OK: the connection
    still open, with no timeout (the caller's to close: closing it ends what
    it holds), the reply's message (bytes with `raw`) and fds (the
    caller's). Raises Error otherwise, the connection closed (the daemon's
    code; UNAVAILABLE, DEADLINE_EXCEEDED for the connection; `remote_hint`
    says what to do when the socket cannot be reached)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    answered = False
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError as e:
            raise Error("UNAVAILABLE", "cannot connect to the data socket %s: %s "
                        "(a remote daemon? %s)" % (path, e.strerror or e, remote_hint))
        try:
            send(sock)
        except (BrokenPipeError, ConnectionResetError):
            pass  # a daemon past its connection caps answers and closes first: read why
        code, msg, fds = read_reply(sock, raw)
        if code != 0:
            for extra in fds:
                os.close(extra)
            raise Error(code, msg)
        sock.settimeout(None)
        answered = True
        return sock, msg, fds
    except socket.timeout:
        raise Error("DEADLINE_EXCEEDED", "no reply to the %s on the data socket %s within "
                    "%s s" % (what, path, timeout)) from None
    except Error:
        raise
    except OSError as e:
        raise Error("UNAVAILABLE", "data socket %s: %s" % (path, e)) from None
    finally:
        if not answered:
            sock.close()


def _exchange(path, timeout, what, remote_hint, send):
    """request(), with the connection closed on return (which ends a push's
    lease): the reply's fds (the caller's to close)."""
    sock, _, fds = request(path, timeout, what, remote_hint, send)
    sock.close()
    return fds


# ---------------------------------------------------------------- publish staging


def stage(path, session, token, timeout=30.0):
    """The writable staging memfd of publish session `session` (token: its
    16 raw bytes), from the data socket at `path`. The caller owns (closes)
    the fd. Raises Error with the daemon's code (NOT_FOUND, PERMISSION_DENIED,
    FAILED_PRECONDITION, ...), UNAVAILABLE when the socket cannot be reached,
    DEADLINE_EXCEEDED after `timeout` seconds."""
    if len(token) != 16:
        raise Error("INVALID_ARGUMENT", "a publish token is 16 bytes, not %d" % len(token))
    if not path:
        raise Error("FAILED_PRECONDITION", "daemon named no data socket; publish with "
                    "transport=\"grpc\"")
    fds = _exchange(path, timeout, "staging request", "publish with transport=\"grpc\"",
                    lambda sock: sock.sendall(_ATTACH.pack(STAGE_MAGIC, 0, session,
                                                           bytes(token))))
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise Error("INTERNAL", "daemon passed %d fds for a staging memfd" % len(fds))
    return fds[0]

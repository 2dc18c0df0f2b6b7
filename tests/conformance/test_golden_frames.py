"""The Python client's data-socket encoders (weightd/_datasock.py and
weightd._cuda) make and read exactly the golden frames of
tests/conformance/golden_frames.txt, which golden_frames_test pins to
common/data_protocol.h's structs and the C++ client's encoders: the two
clients and the protocol header speak the same bytes.

Each request is made by the client's own function, on a socket whose other
end is a stand-in daemon that records the bytes and answers with the golden
reply (fds riding along as the daemon passes them)."""
import os
import socket
import sys
import tempfile
import threading

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # noqa: E402,F401  (puts build/python on sys.path)

from weightd import _cuda, _datasock  # noqa: E402
from weightd.errors import Error  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

# The field values of golden_frames.h.
LEASE_ID = 0x0807060504030201
SESSION = 0x1817161514131211
TOKEN = bytes(range(0x10, 0x20))
GPU_UUID = bytes(range(0xa0, 0xb0))
IPC_HANDLE = bytes(range(0xc0, 0x100))


def _golden():
    frames = {}
    with open(os.path.join(HERE, "golden_frames.txt")) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                name, hexbytes = line.split(" ")
                frames[name] = bytes.fromhex(hexbytes)
    return frames


GOLDEN = _golden()


def _recv_exactly(conn, n):
    data, fds = b"", []
    while len(data) < n:
        got, more, _, _ = socket.recv_fds(conn, n - len(data), 8)
        fds += more
        if not got:
            break
        data += got
    return data, fds


class StandInDaemon:
    """One connection on a Unix socket: reads `request_len` bytes (and the
    fds riding on them), answers `reply` with `reply_fds` (new pipe fds)."""

    def __init__(self, request_len, reply, reply_fds=0):
        self.dir = tempfile.mkdtemp()
        self.path = os.path.join(self.dir, "data.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(1)
        self.request, self.fds_in = None, []
        self.thread = threading.Thread(target=self._serve, args=(request_len, reply, reply_fds))
        self.thread.start()

    def _serve(self, request_len, reply, reply_fds):
        conn, _ = self.listener.accept()
        with conn:
            self.request, self.fds_in = _recv_exactly(conn, request_len)
            pipes = [os.pipe() for _ in range(reply_fds)]
            fds = [r for r, _ in pipes]
            if fds:
                socket.send_fds(conn, [reply], fds)
            else:
                conn.sendall(reply)
            for r, w in pipes:
                os.close(r)
                os.close(w)
            conn.recv(1)  # until the client closes

    def join(self):
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()
        self.listener.close()
        for fd in self.fds_in:
            os.close(fd)
        os.unlink(self.path)
        os.rmdir(self.dir)
        return self.request


def _pair():
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


def test_every_golden_frame_is_checked_here():
    assert sorted(GOLDEN) == sorted([
        "attach_request", "push_request", "push_request_offsets", "cuda_push_request",
        "cuda_push_request_ipc", "export_request", "export_request_host", "stage_request",
        "reply_attach", "reply_push", "reply_staging", "reply_export", "reply_error"])


def test_attach_sends_the_golden_request_and_takes_the_golden_reply():
    d = StandInDaemon(32, GOLDEN["reply_attach"], reply_fds=2)
    sock, fds = _datasock.attach(d.path, LEASE_ID, TOKEN, num_segments=2)
    assert len(fds) == 2
    for fd in fds:
        os.close(fd)
    sock.close()
    assert d.join() == GOLDEN["attach_request"]


@pytest.mark.parametrize("offsets,golden", [(None, "push_request"),
                                            ([0, 256, 4096], "push_request_offsets")])
def test_push_sends_the_golden_request(offsets, golden):
    a, b = _pair()
    r, w = os.pipe()
    try:
        _datasock.send_push(a, LEASE_ID, TOKEN, [r], offsets)
        a.shutdown(socket.SHUT_WR)
        data, fds = _recv_exactly(b, len(GOLDEN[golden]) + 1)
        assert data == GOLDEN[golden]
        assert len(fds) == 1  # the destination rides on the header
        os.close(fds[0])
    finally:
        for s in (a, b):
            s.close()
        os.close(r)
        os.close(w)


def test_a_push_takes_the_golden_reply():
    r, w = os.pipe()
    d = StandInDaemon(32, GOLDEN["reply_push"])
    try:
        assert _datasock.push(d.path, LEASE_ID, TOKEN, r) is None
    finally:
        os.close(r)
        os.close(w)
    assert d.join() == GOLDEN["push_request"]


def test_stage_sends_the_golden_request_and_takes_the_staging_fd():
    d = StandInDaemon(32, GOLDEN["reply_staging"], reply_fds=1)
    fd = _datasock.stage(d.path, SESSION, TOKEN)
    os.close(fd)
    assert d.join() == GOLDEN["stage_request"]


def test_cuda_push_requests_are_the_golden_bytes():
    header, rest = _cuda.cuda_push_request(LEASE_ID, TOKEN, GPU_UUID, 0x200000)
    assert header + rest == GOLDEN["cuda_push_request"]
    assert len(header) == 32  # the fd rides on the header alone
    header, rest = _cuda.cuda_push_request(LEASE_ID, TOKEN, GPU_UUID, 0x100000, offsets=[0, 512],
                                           handle_kind=_cuda.HANDLE_LEGACY_IPC,
                                           ipc_handle=IPC_HANDLE)
    assert header + rest == GOLDEN["cuda_push_request_ipc"]


@pytest.mark.parametrize("uuid,golden", [(GPU_UUID, "export_request"),
                                         (_cuda.HOST_UUID, "export_request_host")])
def test_export_sends_the_golden_request_and_reads_the_export_info(uuid, golden):
    d = StandInDaemon(32 + 96, GOLDEN["reply_export"], reply_fds=1)
    sock, fd, size, layout_size = _cuda.export(d.path, LEASE_ID, TOKEN, uuid)
    assert (size, layout_size) == (0x400000, 0x3ff000)
    os.close(fd)
    sock.close()
    assert d.join() == GOLDEN[golden]


def test_the_golden_error_reply_reads_as_its_code_and_message():
    a, b = _pair()
    with a, b:
        b.sendall(GOLDEN["reply_error"])
        assert _datasock.read_reply(a) == (5, "no lease 7", [])
    d = StandInDaemon(32, GOLDEN["reply_error"])
    with pytest.raises(Error) as e:
        _datasock.attach(d.path, LEASE_ID, TOKEN, num_segments=1)
    d.join()
    assert (e.value.code, e.value.message) == ("NOT_FOUND", "no lease 7")

"""What Client.fetch and Client.watch hand out: ShardHandle (the rank's
tensors and what keeps their memory), the daemon lease behind it (_Lease),
the segment maps that hold that lease (_Segment), and WatchStream.

How the tensors came to be (the delivery modes, client.py's module doc)
is _delivery/'s; a ShardHandle only reads `pieces`, whatever made them."""
import mmap
import threading

import grpc
import numpy as np

from . import _cuda, _dtypes
from ._types import generation_event
from .errors import Error, from_grpc
from .v1 import weightd_pb2 as pb

# Release answers that closing a lease's data connection makes moot.
_RELEASE_ENDED_BY_CONN = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE,
                          grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)


class _Lease:
    """A daemon lease. Ends on release(), or when garbage collected (the
    handle and every buffer made from it gone): then the data connection
    closes (shm; the daemon ends the lease) or a Release is sent (grpc).
    Thread-safe: release() ends it once, whoever calls."""

    def __init__(self, shards, lease_id, token):
        self._shards = shards
        self.lease_id = lease_id
        self.token = token
        self.conn = None  # shm data connection
        # An export's connection, held by what imported its buffer (it ends
        # the lease when it closes, which may come first).
        self.conn_elsewhere = False
        self._lock = threading.Lock()
        self.done = False

    def release(self, timeout=10.0):
        with self._lock:
            if self.done:
                return
            self.done = True
            conn, self.conn = self.conn, None
        err = None
        try:
            self._shards.Release(pb.ReleaseRequest(lease_id=self.lease_id, token=self.token),
                                 timeout=timeout)
        except grpc.RpcError as e:
            # The data connection closing ends the lease anyway: with one,
            # a lease the daemon no longer knows, or a daemon that cannot
            # answer now (restarting, handing over to a successor), is not
            # an error.
            if not ((conn is not None or self.conn_elsewhere) and
                    e.code() in _RELEASE_ENDED_BY_CONN):
                err = from_grpc(e, "releasing lease %d" % self.lease_id)
        except ValueError as e:  # the client's channel was closed
            if conn is None:
                err = Error("FAILED_PRECONDITION", "releasing lease %d: %s (the lease ends "
                            "with its TTL)" % (self.lease_id, e))
        finally:
            if conn is not None:
                conn.close()
        if err is not None:
            raise err

    def release_quietly(self):
        """release() of a fetch that failed on its way: errors dropped."""
        try:
            self.release(timeout=1.0)
        except Exception:
            pass

    def __del__(self):
        try:
            if self.done:
                return
            self.done = True
            if self.conn is not None:
                self.conn.close()  # the daemon ends the lease with the connection
                self.conn = None
            else:
                # fire and forget; the lease's idle TTL covers a lost request
                self._shards.Release.future(
                    pb.ReleaseRequest(lease_id=self.lease_id, token=self.token), timeout=5.0)
        except BaseException:
            pass


class _Segment(mmap.mmap):
    """A copy-on-write map of one memfd segment; holds the lease alive."""


def _address_of(buf):
    return np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0]


class ShardHandle:
    """The result of Client.fetch: the rank's local shards under a lease
    (mode "export"), or in the client's own memory (mode "push": no lease
    is held; see refresh()).

    read_only: True when the tensors are memory this process must not write
    (on a GPU, modes "export" and "zero-copy": the daemon's device buffer
    that every process exporting the same fetch shares, or the daemon's
    sealed host pages). PyTorch has no read-only tensor (its CUDA array
    interface import refuses the read-only flag), so torch cannot refuse an
    in-place op on them: clone() a tensor before modifying it. What a write
    does, by `access` (how the device maps the memory): "read-only" (always
    for zero-copy; for export where the driver took
    CU_MEM_ACCESS_FLAGS_PROT_READ) - the kernel faults, CUDA reports an
    illegal address, and that error is sticky: this process's CUDA context
    is lost (every later CUDA call in it fails; only a new process
    recovers); "read-write" (export where the driver refused read-only
    access, access_error says how) - the write lands in the daemon's shared
    buffer: every process that exports the same fetch to that GPU sees it
    until the daemon evicts the buffer. Host-memory handles and pushes/pulls
    into a GPU are writable (read_only False, access None): copy-on-write
    maps, or this process's own memory.

    Not thread-safe (one thread uses a handle), except that release() and
    refresh() of a push handle exclude each other (its destination's lock).
    """

    def __init__(self, lease, generation, transport, tensors, pieces, push=None, device=None,
                 mode=None):
        self._lease = lease
        self.generation = generation
        # Identity of the generation's weights (hex; ModelInfo.weights_id),
        # "" from daemons that do not send it.
        self.weights_id = ""
        self.transport = transport
        self.tensors = tensors  # list of TensorMeta, in the daemon's order
        # name -> (buffer object, byte offset in it) or None (empty); on a
        # device: (the allocation's uint8 tensor, offset) for a push,
        # (the tensor, None) for a pull.
        self._pieces = pieces
        self._push = push  # the destination of a push handle (_delivery.push.PushDest)
        self.mode = mode or ("export" if push is None else "push")
        self.device = device  # None (host memory) or "cuda:N"
        self.pageable_access = None  # zero-copy: read at host addresses (else registered)
        self.pinned = None  # pull: whether the copies ran from pinned memory
        self.pin_error = ""  # pull: why not, when CUDA refused to pin
        # The tensors are memory others share (read_only) and how the device
        # maps it (access): see the class docstring.
        self.read_only = False
        self.access = None
        self.access_error = ""
        self._ranges = None  # device: the ranges the tensors lie in (_segment_ranges)

    @property
    def lease_id(self):
        """The daemon's lease (for a push handle: that of its last push,
        already ended)."""
        return self._lease.lease_id

    @property
    def released(self):
        if self._push is not None or self.mode == "pull":
            return self._pieces is None
        return self._lease.done

    @property
    def names(self):
        return [t.name for t in self.tensors]

    @property
    def nbytes(self):
        return sum(t.length for t in self.tensors)

    def __len__(self):
        return len(self.tensors)

    def __repr__(self):
        return "<weightd.ShardHandle lease=%d generation=%d tensors=%d bytes=%d %s%s%s%s>" % (
            self._lease.lease_id, self.generation, len(self.tensors), self.nbytes,
            self.transport, "" if self.mode == "export" else " " + self.mode,
            " " + self.device if self.device else "", " released" if self.released else "")

    def _check(self):
        if self._pieces is None:
            raise Error("FAILED_PRECONDITION", "the shard handle was released")

    def _tensor(self, torch, meta):
        dt = _dtypes.torch_dtype(meta.dtype)
        n = meta.numel
        if self.device is not None:
            if n == 0:
                return torch.empty(meta.shape, dtype=dt, device=self.device)
            buf, off = self._pieces[meta.name]
            if off is None:  # pull: the tensor itself
                return buf
            return _cuda.view_bytes(buf, off, meta.length, dt, meta.shape)
        if n == 0:
            return torch.empty(meta.shape, dtype=dt)
        buf, off = self._pieces[meta.name]
        if meta.dtype == "BOOL":
            arr = np.frombuffer(buf, dtype=np.bool_, count=n, offset=off)
            return torch.from_numpy(arr).reshape(meta.shape)
        return torch.frombuffer(buf, dtype=dt, count=n, offset=off).reshape(meta.shape)

    def _array(self, meta):
        if self.device is not None:
            raise Error("FAILED_PRECONDITION", "the shard is on %s: use state_dict() (torch "
                        "tensors), not NumPy arrays" % self.device)
        dt = _dtypes.numpy_dtype(meta.dtype)
        n = meta.numel
        if n == 0:
            return np.empty(meta.shape, dtype=dt)
        buf, off = self._pieces[meta.name]
        return np.frombuffer(buf, dtype=dt, count=n, offset=off).reshape(meta.shape)

    def state_dict(self):
        """{name: torch.Tensor} of zero-copy views (NumPy arrays when torch is
        not installed). F8 types are uint8 tensors on torch without float8.
        On a device: CUDA tensors (push: views of the handle's allocation,
        made anew by each call; pull: the same tensors each call)."""
        self._check()
        torch = _dtypes.torch_or_none()
        if torch is None:
            return self.numpy_dict()
        return {t.name: self._tensor(torch, t) for t in self.tensors}

    def numpy_dict(self):
        """{name: numpy.ndarray} of zero-copy views. BF16 is given as uint16
        (the raw bits), F8_E4M3/F8_E5M2 as uint8."""
        self._check()
        return {t.name: self._array(t) for t in self.tensors}

    def __getitem__(self, name):
        self._check()
        for t in self.tensors:
            if t.name == name:
                torch = _dtypes.torch_or_none()
                return self._array(t) if torch is None else self._tensor(torch, t)
        raise KeyError(name)

    def _segment_ranges(self):
        """[(start, end)] addresses of the mapped segments / received buffers
        (on a device: device addresses of the push's allocation, the
        export's import, zero-copy's page ranges as the device reads them -
        host addresses where it reads pageable memory, else its mapped
        registrations -, a pull's tensors)."""
        self._check()
        if self._ranges is not None:  # zero-copy: the maps / registrations; export: the import
            return list(self._ranges)
        if self.device is not None:
            out = set()
            for piece in self._pieces.values():
                if piece is not None:
                    t = piece[0]
                    nbytes = t.numel() * t.element_size()
                    if nbytes:
                        out.add((t.data_ptr(), t.data_ptr() + nbytes))
            return sorted(out)
        seen, out = set(), []
        for piece in self._pieces.values():
            if piece is None or id(piece[0]) in seen:
                continue
            seen.add(id(piece[0]))
            if len(piece[0]):
                a = _address_of(piece[0])
                out.append((a, a + len(piece[0])))
        return sorted(out)

    def release(self):
        """Ends the lease (Release RPC, then closes the data connection) and
        drops the handle's maps. Idempotent. A push handle holds no lease:
        release() drops its map and closes its memfd (tensors kept stay
        valid: they hold the map). On a GPU (push): drops the handle's hold
        on the allocation, which is freed once no tensor or view made from
        it is left (right away when none was kept). Pull: drops the
        handle's tensors (its lease ended with the fetch). Zero-copy: ends
        the lease; tensors kept stay valid (they hold the maps and the
        pages' registrations)."""
        if self._push is not None:
            with self._push.lock:  # not under a refresh's feet
                self._pieces = None
                self._push.close()
            return
        self._pieces = None
        self._lease.release()

    def refresh(self, generation=None):
        """Brings a push handle to `generation` (None/0 = the current one) in
        place: fetches the same request again with changed_since = this
        handle's generation and has the daemon write only the tensors that
        changed, into the same memfd at their offsets. Tensors and arrays
        taken from the handle before see the new bytes (the same memory; a
        reader during the refresh may see a tensor half written). Updates
        `generation` and the changed tensors' metadata (digests); returns
        the names refreshed, in the daemon's order ([] when nothing changed).

        FAILED_PRECONDITION: not a push handle, released, or a changed tensor
        this handle lacks or holds with another dtype/shape (nothing is
        written then). Retried whole on UNAVAILABLE as fetch() is. On any
        other failure after the daemon began writing, the changed tensors
        may hold a mix of both generations and `generation` is unchanged:
        refresh() again rewrites them all.
        """
        if self._push is None:
            raise Error("FAILED_PRECONDITION", "refresh() needs a handle fetched with "
                        "mode=\"push\" (this one is \"%s\")" % self.mode)
        with self._push.lock:
            self._check()
            return self._push.refresh(self, generation)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            self.release()
        except Error:
            if exc_type is None:
                raise  # else keep the body's exception; the lease ends with its connection


class WatchStream:
    """Iterator over GenerationEvent; cancel() (or close()) ends it.
    cancel() may come from another thread; iterate from one."""

    def __init__(self, call):
        self._call = call

    def __iter__(self):
        return self

    def __next__(self):
        try:
            ev = next(self._call)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED and self._call.cancelled():
                raise StopIteration from None
            raise from_grpc(e) from None
        return generation_event(ev)

    def cancel(self):
        self._call.cancel()

    close = cancel

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.cancel()

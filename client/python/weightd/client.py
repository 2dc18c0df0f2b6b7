"""weightd Python client: control plane over gRPC, bytes over shm or gRPC.

    import weightd
    client = weightd.Client(socket="/run/weightd/w.sock")
    with client.fetch("llama", world=8, rank=3, dtype="bf16") as h:
        weightd.load_into_module(model, h)

On the shm transport every tensor is a zero-copy view of a memfd segment
the daemon passed over its data socket, mapped copy-on-write (MAP_PRIVATE):
writing into a tensor (engines post-process weights in place) lands in this
process's private pages; the daemon's sealed segment, other workers and
later fetches never see it. On the grpc transport the bytes are streamed
into private buffers and the tensors are views of those.

Huge pages (the daemon's --huge-pages): segments of 2 MiB hugetlb pages are
mapped the same way, at 2 MiB-aligned addresses (the kernel's PMD mappings,
one page-table entry per 2 MiB), and reserve nothing from the node's pool
(MAP_NORESERVE). Reading them costs nothing extra; the first write into a
tensor there copies its 2 MiB page from the hugetlb pool, and if the pool
is empty at that moment the process gets SIGBUS. Workers that modify
weights in place on such a node clone() them first, or leave room in the
pool.

Lifetime: a ShardHandle holds a lease. release() (or leaving a `with`
block) ends it at once. Otherwise the lease lives as long as the handle or
any tensor/array made from it is alive, and ends when the last one is
garbage collected (or the process dies: the daemon sees the data
connection close). Tensors you keep after release() stay valid (the
mapping still holds the memory), but the daemon no longer accounts for them.

Push (fetch(..., mode="push"), DESIGN §6): the client owns the memory. It
allocates a memfd (fallocate'd, so the pages are its own), passes it to the
daemon over the data socket, and the daemon writes the shard into it; the
tensors are zero-copy views of one writable shared map of that memfd, every
tensor at a multiple of 256 bytes. The daemon keeps no lease once the bytes
are in place. handle.refresh() later has the daemon rewrite, in the same
memory, only the tensors that changed in a newer generation (an adapter
applied): tensors taken from the handle before see the new values.

Into a GPU (fetch(..., device="cuda:N"), DESIGN §6; the daemon must be
local, transport "shm"):
  * mode="push" (the default with a device): the client allocates device
    memory with CUDA's VMM API (cuMemCreate, exported as a POSIX fd), sends
    the fd over the data socket, and the daemon copies the shard into it and
    answers once its copies are synchronized. The daemon copies stored bytes
    and casts (and merges LoRA and dense patches) on the GPU as it writes
    (fetch's cast_on_push / merge_on_push). The tensors are CUDA tensors
    over that one allocation at the default layout's offsets (multiples of
    256 bytes); refresh() has the daemon rewrite the changed ones in place.
    The allocation lives as long as the handle or any tensor or view made
    from it: release() drops the handle's hold, and the memory is freed
    (after the device's queued work) when the last tensor goes.
  * mode="pull": the client maps the shm segments read-only, pins the
    shard's pages read-only (cuMemHostRegister, CU_MEMHOSTREGISTER_READ_ONLY;
    unpinned when CUDA refuses, see handle.pin_error), copies each tensor to
    the GPU with torch, synchronizes and ends the lease at once. The tensors
    are ordinary CUDA tensors owned by torch's allocator.
  * mode="zero-copy": the client maps the shm segments read-only and the
    tensors are CUDA tensors over those very pages, read by the GPU in
    place: at their host address where the device reads pageable memory
    coherently (CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS: Grace Hopper /
    Blackwell over NVLink-C2C, HMM; handle.pageable_access), elsewhere
    through a read-only mapped registration of the shard's pages
    (cuMemHostRegister DEVICEMAP | READ_ONLY: every kernel read crosses
    PCIe, so it is offered for memory-light use, never the default).
    Where the device does neither (CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS
    and CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED both 0: an x86
    discrete GPU such as an H100 without HMM) fetch raises
    FAILED_PRECONDITION naming them, before any lease is taken: no
    zero-copy path exists there (_cuda.zero_copy_path says why).
    release() ends the lease; the pages stay mapped and registered while a
    tensor made from them lives (the last one unregisters them after the
    device's queued work). The tensors are read-only (handle.read_only).
  * mode="export": the daemon's own device buffer of the shard (cuMemCreate,
    filled once — cast and merged on the GPU — and shared by every process
    that exports the same fetch to the same GPU), passed as a VMM POSIX fd,
    imported and mapped read-only here; an engine that restarts maps it
    again without a copy. The data connection holds the lease and the
    daemon's hold on the buffer until release() (the daemon evicts unheld
    buffers past --device-memory-bytes); the mapping lives as long as a
    tensor made from it. The tensors are read-only (handle.read_only;
    handle.access says whether the driver took the read-only mapping).
"""
import concurrent.futures
import dataclasses
import json
import fcntl
import mmap
import os
import re
import threading
import warnings
from dataclasses import dataclass, field
from typing import Tuple

import grpc
import numpy as np

from . import _channel, _cuda, _datasock, _dtypes, _health, _policy
# weightd.client.RETRY_* as before (the policy's, client/policy/client_policy.json).
from ._policy import RETRY_INITIAL_BACKOFF, RETRY_JITTER, RETRY_MAX_BACKOFF, RETRY_MULTIPLIER
from .errors import Error, from_grpc
from .v1 import weightd_pb2 as pb
from .v1 import weightd_pb2_grpc as pb_grpc

# Release answers that closing a lease's data connection makes moot.
_RELEASE_ENDED_BY_CONN = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE,
                          grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)


def _torch_or_none():
    try:
        import torch
        return torch
    except ImportError:
        return None


# ---------------------------------------------------------------- value types


@dataclass(frozen=True)
class TensorInfo:
    """A served tensor of a model (Client.info)."""
    name: str
    dtype: str  # safetensors spelling: "F32", "BF16", "F8_E4M3", ...
    shape: Tuple[int, ...]
    digest: bytes  # 16-byte content identity (XXH3-128) at the current generation
    sources: Tuple[str, ...] = ()  # checkpoint tensors it is made of
    patched_by: Tuple[str, ...] = ()  # adapters of the current stack touching it


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: str
    generation: int
    tensor_count: int
    total_bytes: int
    files: Tuple[str, ...] = ()
    tensors: Tuple[TensorInfo, ...] = ()  # filled by info(), empty in list()
    adapters: Tuple[str, ...] = ()  # current stack, "name:strength"
    report: Tuple[str, ...] = ()  # profile report lines
    readers: Tuple[str, ...] = ()  # who may read it ("uid:N", ...); empty = public
    # The checkpoint's segments by the pages behind them (--huge-pages).
    segment_bytes_4k: int = 0
    segment_bytes_thp: int = 0
    segment_bytes_hugetlb: int = 0
    # Identity of the current generation's weights (hex): a digest over
    # (served name, tensor digest) of every served tensor; the same on every
    # daemon serving the same checkpoint, profile and adapter stack.
    weights_id: str = ""


@dataclass(frozen=True)
class LoadProgress:
    bytes_done: int
    bytes_total: int
    tensors_done: int
    tensors_total: int
    current_file: str
    # Where the bytes done came from: storage, and peers (their addresses).
    bytes_from_storage: int = 0
    bytes_from_peers: int = 0
    peers: Tuple[str, ...] = ()
    done: bool = False  # the last report, sent once the model is loaded


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of a fetched shard: the rank's local piece."""
    name: str
    dtype: str  # served dtype, safetensors spelling
    shape: Tuple[int, ...]  # local shape
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    digest: bytes  # XXH3-128 of the served bytes (b"": cast by a push, fetch(cast_on_push))
    segment: int
    offset: int
    length: int

    @property
    def numel(self):
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class GenerationEvent:
    model: str
    generation: int
    adapters: Tuple[str, ...] = field(default_factory=tuple)
    weights_id: str = ""  # as ModelInfo.weights_id


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: str
    format: str
    tensor_count: int
    bytes: int = 0
    ignored: Tuple[str, ...] = ()
    readers: Tuple[str, ...] = ()  # empty = public


def _opt(msg, name, default=()):
    """A field that older daemons' protos lack."""
    v = getattr(msg, name, default)
    return tuple(v) if not isinstance(v, (int, float, str, bytes)) else v


def _request(cls, **fields):
    """cls(**fields), dropping fields this proto lacks when they are unset."""
    known = cls.DESCRIPTOR.fields_by_name
    for k in [k for k in fields if k not in known]:
        if fields[k]:
            raise Error("UNIMPLEMENTED", "%s has no field %s in this client's proto"
                        % (cls.DESCRIPTOR.name, k))
        del fields[k]
    return cls(**fields)


def _adapter_info(a):
    return AdapterInfo(a.name, a.path, a.format, a.tensor_count, _opt(a, "bytes", 0),
                       _opt(a, "ignored"), _opt(a, "readers"))


def _identified(resp, handle):
    """The handle with the generation's weights_id (FetchResponse)."""
    handle.weights_id = getattr(resp, "weights_id", "")
    return handle


def _model_info(m):
    return ModelInfo(
        name=m.name, path=m.path, generation=m.generation, tensor_count=m.tensor_count,
        total_bytes=m.total_bytes, files=tuple(m.files),
        tensors=tuple(TensorInfo(t.name, _dtypes.name_of_enum(t.dtype), tuple(t.shape),
                                 bytes(t.digest), _opt(t, "sources"), _opt(t, "patched_by"))
                      for t in m.tensors),
        adapters=_opt(m, "adapters"), report=_opt(m, "report"), readers=_opt(m, "readers"),
        segment_bytes_4k=_opt(m, "segment_bytes_4k", 0),
        segment_bytes_thp=_opt(m, "segment_bytes_thp", 0),
        segment_bytes_hugetlb=_opt(m, "segment_bytes_hugetlb", 0),
        weights_id=_opt(m, "weights_id", ""))


def _load_source(source):
    """LoadRequest.source for "auto", "storage" or "peers"."""
    sources = {"auto": pb.LOAD_SOURCE_AUTO, "storage": pb.LOAD_SOURCE_STORAGE,
               "peers": pb.LOAD_SOURCE_PEERS}
    if source not in sources:
        raise Error("INVALID_ARGUMENT", f"source: expected auto, storage or peers, got {source!r}")
    return sources[source]


def _readers(readers):
    """readers= as a list of "uid:N"/"gid:N"/"token:NAME"/"cn:NAME" strings
    (a comma-separated string works too)."""
    if readers is None:
        return []
    if isinstance(readers, str):
        readers = [readers]
    return [str(r) for r in readers]


# ---------------------------------------------------------------- request parsing


def _parse_placement(p):
    if isinstance(p, bool):
        raise Error("INVALID_ARGUMENT", "invalid placement %r" % (p,))
    if isinstance(p, int):
        if p < -1:
            raise Error("INVALID_ARGUMENT", "invalid placement %d (-1 = replicate)" % p)
        return p
    if not isinstance(p, str):
        # torch DTensor placements: Shard(dim) has .dim; Replicate has none.
        if type(p).__name__ == "Replicate":
            return -1
        dim = getattr(p, "dim", None)
        if type(p).__name__ == "Shard" and isinstance(dim, int):
            return dim
        raise Error("INVALID_ARGUMENT", "invalid placement %r" % (p,))
    t = p.strip()
    if t in ("R", "Replicate()"):
        return -1
    m = re.fullmatch(r"S(\d+)|Shard\((\d+)\)", t)
    if not m:
        raise Error("INVALID_ARGUMENT", "invalid placement \"%s\" (expected R, S<dim>, "
                    "Replicate() or Shard(<dim>))" % p)
    return int(m.group(1) or m.group(2))


def _parse_placements(placements):
    if placements is None:
        return None
    if isinstance(placements, str):
        if not placements.strip():
            raise Error("INVALID_ARGUMENT", "empty placement list")
        placements = placements.split(",")
    return [_parse_placement(p) for p in placements]


_TRANSPORTS = {"shm": pb.SHM, "grpc": pb.GRPC}


def _parse_profile(profile):
    """dict -> JSON; str starting with '{' -> JSON text; else a file path."""
    if profile is None:
        return ""
    if isinstance(profile, dict):
        return json.dumps(profile)
    if isinstance(profile, bytes):
        return profile.decode()
    if isinstance(profile, str) and profile.lstrip().startswith("{"):
        return profile
    try:
        with open(os.fspath(profile), "r") as f:
            return f.read()
    except OSError as e:
        raise Error("INVALID_ARGUMENT", "cannot read profile %s: %s" % (profile, e)) from None


# ---------------------------------------------------------------- leases and buffers


class _Lease:
    """A daemon lease. Ends on release(), or when garbage collected (the
    handle and every buffer made from it gone): then the data connection
    closes (shm; the daemon ends the lease) or a Release is sent (grpc)."""

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


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+
_PAGE = mmap.PAGESIZE
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Python 3.12+ names it; Linux value


def _populate(seg, offset, length):
    """Fills the page tables of this shard's bytes now (one madvise instead
    of a fault per page on first read). Best effort: older kernels refuse
    MADV_POPULATE_READ and the pages then fault in on first use."""
    start = offset // _PAGE * _PAGE
    end = min(len(seg), -(-(offset + length) // _PAGE) * _PAGE)
    try:
        seg.madvise(_MADV_POPULATE_READ, start, end - start)
    except OSError:
        pass


def _data_socket_of(socket, resp):
    """Where to collect a lease's fds: beside the Unix socket this client
    connected to when the daemon's data socket lies beside its own (the
    directory may be mounted at another path here than in the daemon's
    container), else the path the daemon gave."""
    if socket is not None and resp.data_socket_name:
        return os.path.join(os.path.dirname(os.path.realpath(socket)), resp.data_socket_name)
    return resp.data_socket


class _Segment(mmap.mmap):
    """A copy-on-write map of one memfd segment; holds the lease alive."""


class _ZeroCopyHold:
    """What a zero-copy handle's tensors read: the segment maps and the
    mapped registrations of their pages. Each tensor holds it; the last one
    to go unregisters the pages (after the device's queued reads) and then
    drops the maps."""

    def __init__(self, maps, index):
        self.maps = maps
        self.index = index
        self.regs = []

    def close(self):
        if self.maps is None:
            return
        # Kernels queued on the tensors may still read the pages: wait for
        # them before the registrations and the maps go.
        try:
            _cuda.synchronize(self.index)
        except Error:
            pass
        regs, self.regs = self.regs, []
        for r in regs:
            try:
                r.unregister()
            except Error:
                pass
        self.maps = None

    def __del__(self):
        self.close()


class _Buffer(bytearray):
    """Bytes streamed over the grpc transport; holds the lease alive."""


def _address_of(buf):
    return np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0]


# ---------------------------------------------------------------- ShardHandle


class _PushDest:
    """A push handle's destination and what refresh() needs: the client's
    memfd, its shared writable map (None when the layout is 0 bytes), and
    the client and request to fetch again with."""

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
        _datasock.push(_data_socket_of(self.client.socket, resp), resp.lease_id,
                       bytes(resp.token), self.fd, offsets, timeout)

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


class _CudaPushDest(_PushDest):
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
            _cuda.push_cuda(_data_socket_of(self.client.socket, resp), resp.lease_id,
                            bytes(resp.token), fd, self.uuid, self.alloc.size, offsets, timeout)
        finally:
            os.close(fd)

    def close(self):
        # The allocation lives on in tensors still using it (they hold it).
        self.alloc = None
        self.raw = None

    def __del__(self):
        pass


def _push_timeout(timeout, size):
    """How long to wait for a push's reply: the caller's bound, else 30 s
    plus the time to write `size` bytes at a slow 100 MiB/s."""
    if timeout is not None:
        return timeout
    return 30.0 + size / float(100 << 20)


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
        self._push = push  # _PushDest of a push handle
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
        torch = _torch_or_none()
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
                torch = _torch_or_none()
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
            return self._push.client._refresh_push(self, generation)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            self.release()
        except Error:
            if exc_type is None:
                raise  # else keep the body's exception; the lease ends with its connection


# ---------------------------------------------------------------- watch


class WatchStream:
    """Iterator over GenerationEvent; cancel() (or close()) ends it."""

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
        return GenerationEvent(ev.model, ev.generation, tuple(ev.adapters),
                               _opt(ev, "weights_id", ""))

    def cancel(self):
        self._call.cancel()

    close = cancel

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.cancel()


# ---------------------------------------------------------------- Client


# ---------------------------------------------------------------- publish

_PUBLISH_CHUNK = 4 << 20
_DECLARED_RUNS = 65536  # runs per in-place declaration message (~1.3 MiB)
# In-place publish: the trainer's copy into the staging memfd, in runs of at
# most this many bytes, on at most this many threads (WEIGHTD_STAGING_THREADS).
_STAGING_RUN = 16 << 20
_STAGING_THREADS = max(1, int(os.environ.get("WEIGHTD_STAGING_THREADS", "4") or 4))


@dataclass
class PublishSession:
    """An open publish session (Client.begin_publish). Picklable: rank 0 of
    a sharded trainer opens it and broadcasts it to the others, each of
    which calls Client.publish_sharded(session, ...)."""
    model: str
    session: int
    token: str
    base_generation: int
    bytes: int
    deadline_unix_ms: int
    tensors: list  # [(name, dtype name, shape tuple)] in session order
    per_part: list = field(default_factory=list)  # sharded part by part by the profile
    # Zero-copy staging (transport "shm"): each tensor's offset in the
    # session's staging memfd, its size, and the data socket handing it out.
    offsets: list = field(default_factory=list)
    staging_bytes: int = 0
    data_socket: str = ""
    data_socket_name: str = ""


@dataclass
class PublishResult:
    model: str
    generation: int  # the new one (the current one when nothing changed)
    weights_id: str
    tensors: int
    changed: int  # tensors whose bytes differ from the current ones
    bytes: int
    bytes_stored: int  # new memory the daemon holds for the changed ones
    adapters: list  # the stack, merged again on the new weights
    # Changed bytes some loaded model already held, shared instead of stored
    # again, and those models.
    bytes_shared: int = 0
    shared_with: list = field(default_factory=list)


def _publish_result(r):
    return PublishResult(r.model, r.generation, r.weights_id, r.tensors, r.changed, r.bytes,
                         r.bytes_stored, list(r.adapters), r.bytes_shared, list(r.shared_with))


def _publish_source(name, value, dtypes=None, on_device=False):
    """(dtype name, shape, flat uint8 array of the row-major bytes) of a
    torch tensor or NumPy array; dtypes[name] overrides the dtype (e.g. a
    uint16 array holding BF16 bits). on_device: a torch tensor's bytes stay
    a flat uint8 torch tensor where it lives (a GPU tensor is copied once,
    straight into the staging memfd)."""
    torch = _torch_or_none()
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach().contiguous()
        if not on_device:
            t = t.cpu()
        dname = _dtypes.parse_request_dtype(t.dtype)
        shape = tuple(t.shape)
        if on_device:
            raw = t.reshape(-1).view(torch.uint8) if t.numel() else np.zeros(0, np.uint8)
        else:
            raw = (t.reshape(-1).view(torch.uint8).numpy() if t.numel()
                   else np.zeros(0, np.uint8))
    else:
        a = np.asarray(value)
        if a.ndim:
            a = np.ascontiguousarray(a)
        dname = _dtypes.parse_request_dtype(a.dtype)
        shape = tuple(a.shape)
        raw = a.reshape(-1).view(np.uint8)
    if dtypes and name in dtypes:
        dname = _dtypes.parse_request_dtype(dtypes[name])
    n = 1
    for d in shape:
        n *= d
    if _nbytes(raw) != n * _dtypes.itemsize(dname):
        raise Error("INVALID_ARGUMENT", "tensor \"%s\": %d bytes for %s %s" % (
            name, _nbytes(raw), dname, list(shape)))
    return dname, shape, raw


def _nbytes(raw):
    return int(raw.size if isinstance(raw, np.ndarray) else raw.numel())


def _chunk_of(n, parts, index):
    """torch.chunk's piece `index` of `n` rows in `parts` pieces: (start, length)."""
    size = -(-n // parts) if parts > 0 else 0
    start = min(index * size, n)
    return start, min(size, n - start)


def _local_box(shape, mesh, coord, placements):
    """The (offset, shape) of this rank's local shard (DESIGN §2), and
    whether this rank writes it: of the ranks that hold the same piece (they
    differ only on mesh dims that replicate it), the one at coordinate 0."""
    offset = [0] * len(shape)
    size = list(shape)
    writes = True
    for m, p in enumerate(placements):
        if p < 0 or not shape:
            writes = writes and coord[m] == 0
            continue
        if p >= len(shape):
            raise Error("INVALID_ARGUMENT", "Shard(%d) of a tensor with %d dims" % (p, len(shape)))
        start, length = _chunk_of(size[p], mesh[m], coord[m])
        offset[p] += start
        size[p] = length
    return offset, size, writes


def _box_runs(shape, offset, size, itemsize):
    """(global byte offset, length) of each contiguous run of the box, in
    the box's row-major order."""
    nd = len(shape)
    if nd == 0:
        return [(0, itemsize)]
    if any(s == 0 for s in size):
        return []
    strides = [itemsize] * nd
    for d in range(nd - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    # Dims q.. form one run: q is the innermost dim the box does not cover whole.
    q = nd - 1
    while q > 0 and size[q] == shape[q] and offset[q] == 0:
        q -= 1
    run = size[q] * strides[q]
    outer = [range(offset[d], offset[d] + size[d]) for d in range(q)]
    runs = []
    for idx in (np.ndindex(*[len(r) for r in outer]) if q > 0 else [()]):
        at = offset[q] * strides[q]
        for d in range(q):
            at += (offset[d] + idx[d]) * strides[d]
        runs.append((at, run))
    return runs


class Client:
    """A connection to a weightd daemon.

    Client(socket="/path/w.sock")  - the daemon's gRPC Unix socket (default:
                                     $WEIGHTD_SOCKET)
    Client(target="host:port")     - gRPC over TCP (use transport="grpc")

    TCP security (the daemon's --tls-cert / --tls-client-ca /
    --auth-token-file): tls_ca= (PEM bytes, text or file path; turns TLS on),
    tls=True (TLS with the system roots), tls_cert= / tls_key= (client
    certificate), tls_server_name= (name to verify instead of the target's
    host), token= (bearer token; default $WEIGHTD_TOKEN).

    Restarts: read-only calls (health, list, info, stats,
    list_adapters) and fetch retry on UNAVAILABLE (daemon down, draining or
    restarting on the same sockets; also the CANCELLED a draining daemon
    answers) with exponential backoff (50 ms, x2, at
    most 2 s, +-20% jitter) until retry_deadline seconds have passed
    (default 30; 0 = fail at once). A fetch is retried whole: Fetch, then a
    fresh data-socket connection (or Read streams), so it reconnects to a
    restarted daemon. load/unload/adapters/apply/release and watch are not
    retried. timeout= bounds each attempt, retry_deadline all of them.
    """

    def __init__(self, socket=None, target=None, *, timeout=None, options=(), tls=False,
                 tls_ca=None, tls_cert=None, tls_key=None, tls_server_name=None, token=None,
                 retry_deadline=30.0):
        if socket is not None and target is not None:
            raise Error("INVALID_ARGUMENT", "give socket= or target=, not both")
        if socket is None and target is None:
            socket = os.environ.get("WEIGHTD_SOCKET")
        # The Unix socket's path, where shm clients also find the data socket.
        self.socket = os.fspath(socket) if socket is not None else None
        if socket is not None:
            self.target = "unix:" + os.fspath(socket)
        elif target is not None:
            self.target = target
        else:
            raise Error("INVALID_ARGUMENT", "give a socket=PATH or a target=\"HOST:PORT\"")
        self.timeout = timeout  # default deadline for unary calls (None = none)
        self.retry_deadline = float(retry_deadline or 0)  # seconds; 0 = no retries
        if token is None:
            token = os.environ.get("WEIGHTD_TOKEN") or None
        self._channel = _channel.open_channel(
            self.target, _channel.channel_options(self.retry_deadline, options),
            unix_socket=socket is not None, tls=tls, tls_ca=tls_ca, tls_cert=tls_cert,
            tls_key=tls_key, tls_server_name=tls_server_name, token=token)
        self._models = pb_grpc.ModelsStub(self._channel)
        self._shards = pb_grpc.ShardsStub(self._channel)
        self._adapters = pb_grpc.AdaptersStub(self._channel)
        self._health = _health.check_method(self._channel)

    # -- plumbing

    def _call(self, method, request, timeout=None):
        try:
            return method(request, timeout=timeout if timeout is not None else self.timeout)
        except grpc.RpcError as e:
            raise from_grpc(e) from None

    def _retrying(self, attempt):
        """attempt(), again on Error UNAVAILABLE (or CANCELLED) with backoff
        until retry_deadline has passed; then UNAVAILABLE with the last
        error's message."""
        return _channel.retrying(self.retry_deadline, attempt)

    def _read_call(self, method, request, timeout=None):
        return self._retrying(lambda: self._call(method, request, timeout))

    def close(self):
        """Closes the channel. Leases of live handles end with their data
        connections (shm) or their TTL (grpc)."""
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- health and models

    def health(self, timeout=5.0):
        """True when the daemon reports SERVING; raises Error otherwise
        (UNAVAILABLE with the reported status, or the RPC's error)."""
        def attempt():
            status = self._call(self._health, None, timeout=timeout)
            if status != _health.SERVING:
                raise Error("UNAVAILABLE", "daemon reports %s" % _health.status_name(status))
            return True
        return self._retrying(attempt)

    def load(self, name, path, profile=None, progress=None, timeout=None, readers=None,
             source="auto"):
        """Loads checkpoint `path` as model `name` and returns its ModelInfo.
        profile: a dict, JSON text, or a path to a JSON file (DESIGN §4).
        progress: optional callable receiving LoadProgress updates (the
        last one with done=True, saying where the bytes came from).
        readers: makes the model private ("uid:N", "gid:N", "token:NAME",
        "cn:NAME"); None = public.
        source: "auto" (peers holding the same files, else storage),
        "storage", or "peers" (UNAVAILABLE when no peer holds them)."""
        src = _load_source(source)
        req = _request(pb.LoadRequest, name=name, path=os.fspath(path),
                       profile_json=_parse_profile(profile), readers=_readers(readers),
                       source=src)
        info = None
        try:
            for msg in self._models.Load(req, timeout=timeout):
                if msg.done:
                    info = _model_info(msg.model)
                if progress is not None:
                    progress(LoadProgress(msg.bytes_done, msg.bytes_total, msg.tensors_done,
                                          msg.tensors_total, msg.current_file,
                                          msg.bytes_from_storage, msg.bytes_from_peers,
                                          tuple(msg.peers), msg.done))
        except grpc.RpcError as e:
            raise from_grpc(e) from None
        if info is None:
            raise Error("INTERNAL", "load stream ended without a result")
        return info

    def unload(self, name):
        self._call(self._models.Unload, pb.UnloadRequest(name=name))

    def list(self):
        """[ModelInfo] of the loaded models (without per-tensor entries)."""
        resp = self._read_call(self._models.List, pb.ListModelsRequest())
        return [_model_info(m) for m in resp.models]

    def info(self, name):
        """ModelInfo of `name`, with its tensors."""
        return _model_info(self._read_call(self._models.Get, pb.GetModelRequest(name=name)))

    def peers(self):
        """The fleet's other daemons this one knows (--peers) as it last
        polled them: a list of dicts (address, reachable, error, last_seen
        (unix seconds or None), models: [{name, generation, weights_id}])."""
        resp = self._read_call(self._models.Peers, pb.PeersRequest())
        return [{"address": p.address, "reachable": p.reachable, "error": p.error,
                 "last_seen": p.last_seen_unix_ms / 1000.0 if p.last_seen_unix_ms else None,
                 "models": [{"name": m.name, "generation": m.generation,
                             "weights_id": m.weights_id} for m in p.models]}
                for p in resp.peers]

    def stats(self):
        """The daemon's counters as a dict (models, segments, bytes_resident,
        materializations, ..., leases_open, bytes_served, fetches)."""
        resp = self._read_call(self._models.Stats, pb.StatsRequest())
        out = {f.name: getattr(resp, f.name) for f in resp.DESCRIPTOR.fields}
        out["peer_transfers"] = {t.peer: {"bytes": t.bytes, "failures": t.failures}
                                 for t in resp.peer_transfers}
        return out

    # -- adapters

    def load_adapter(self, name, path, format="auto", strict=False, readers=None,
                     source="auto"):
        """Loads a LoRA / dense patch (format auto|peft|kohya|dense).
        readers: a tenant-private adapter (see load()). source: as load()'s
        (with --peers the daemon may take the file's bytes from a peer)."""
        src = _load_source(source)
        r = self._call(self._adapters.Load, _request(
            pb.LoadAdapterRequest, name=name, path=os.fspath(path), format=format,
            strict=strict, readers=_readers(readers), source=src))
        return _adapter_info(r)

    def unload_adapter(self, name):
        self._call(self._adapters.Unload, pb.UnloadAdapterRequest(name=name))

    def list_adapters(self):
        r = self._read_call(self._adapters.List, pb.ListAdaptersRequest())
        return [_adapter_info(a) for a in r.adapters]

    def apply(self, model, adapters=(), expect_generation=0):
        """Sets model's adapter stack: [name | (name, strength)]; returns the
        new generation."""
        refs = []
        for a in adapters:
            name, strength = (a, 1.0) if isinstance(a, str) else a
            refs.append(pb.AdapterRef(name=name, strength=float(strength)))
        r = self._call(self._adapters.Apply, pb.ApplyRequest(
            model=model, adapters=refs, expect_generation=expect_generation))
        return r.generation

    # -- publish

    def begin_publish(self, model, tensors, expect_generation=0, timeout=600, dtypes=None):
        """Opens a session to publish new base weights for `model` (admins).
        tensors: {name: torch tensor | NumPy array | (dtype, shape)} of the
        served tensors to replace, in the dtype and (global) shape the model
        stores them in. Returns a PublishSession; nothing is visible until
        every byte has arrived. timeout: seconds until the session is
        aborted if incomplete."""
        specs = []
        for name, value in tensors.items():
            if isinstance(value, tuple) and len(value) == 2:
                dname = _dtypes.parse_request_dtype(value[0])
                shape = tuple(int(d) for d in value[1])
            else:
                dname, shape, _ = _publish_source(name, value, dtypes)
            specs.append((name, dname, shape))
        req = pb.BeginPublishRequest(
            model=model, expect_generation=int(expect_generation),
            timeout_seconds=int(timeout),
            tensors=[pb.PublishTensor(name=n, dtype=_dtypes.enum_of_name(d), shape=list(sh))
                     for n, d, sh in specs])
        r = self._call(self._models.BeginPublish, req)
        return PublishSession(model, r.session, r.token, r.base_generation, r.bytes,
                              r.deadline_unix_ms, specs, list(r.per_part), list(r.offsets),
                              r.staging_bytes, r.data_socket, r.data_socket_name)

    def _publish_transport(self, transport):
        """"shm" (write in place into the staging memfd: a daemon on this
        node) or "grpc" (stream); "auto"/None: shm when this client reached
        the daemon over a Unix socket."""
        if transport in (None, "auto"):
            return "shm" if self.socket is not None else "grpc"
        if transport not in ("shm", "grpc"):
            raise Error("INVALID_ARGUMENT", "publish transport %r: use \"auto\", \"shm\" "
                        "or \"grpc\"" % (transport,))
        return transport

    def _write_in_place(self, session, pieces, progress=None):
        """Writes pieces [(tensor index, [(global byte offset, length)], flat
        uint8 NumPy array or torch tensor)] straight into the session's
        staging memfd (taken on the data socket), unmaps it, then declares
        the runs written (PublishChunk.in_place); the PublishWriteResponse."""
        if not session.offsets and session.tensors:
            raise Error("FAILED_PRECONDITION", "the daemon offers no staging memfd for publish "
                        "session %d; publish with transport=\"grpc\"" % session.session)
        path = _data_socket_of(self.socket, session)
        fd = _datasock.stage(path, session.session, bytes.fromhex(session.token))
        try:
            # Page tables filled in one call: faulting 4 KiB at a time into
            # the daemon's (resident) pages costs ~30x the copy itself.
            mm = mmap.mmap(fd, session.staging_bytes,
                           mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise Error("INTERNAL", "mapping the staging memfd of publish session %d: %s"
                        % (session.session, e)) from None
        finally:
            os.close(fd)
        dest = dest_t = None
        try:
            # The copies, in runs of at most _STAGING_RUN bytes, spread over up
            # to _STAGING_THREADS threads (NumPy and torch copies release the
            # GIL): one core's copy is what bounds an in-place publish.
            copies = []
            for index, spans, raw in pieces:
                if isinstance(raw, np.ndarray):
                    if dest is None:
                        dest = np.frombuffer(mm, dtype=np.uint8)
                elif dest_t is None:
                    dest_t = _torch_or_none().frombuffer(mm, dtype=_torch_or_none().uint8)
                base = session.offsets[index]
                at = 0
                for offset, length in spans:
                    for part in range(0, length, _STAGING_RUN):
                        n = min(_STAGING_RUN, length - part)
                        copies.append((raw, base + offset + part, at + part, n))
                    at += length

            def copy(job):
                raw, lo, at, n = job
                if isinstance(raw, np.ndarray):
                    dest[lo:lo + n] = raw[at:at + n]
                else:
                    dest_t[lo:lo + n].copy_(raw[at:at + n])
                return n
            threads = min(_STAGING_THREADS, os.cpu_count() or 1, len(copies))
            done = 0
            with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
                # (On one thread, this thread's: no hand-off.)
                for n in (pool.map if threads > 1 else map)(copy, copies):
                    done += n
                    if progress is not None:
                        progress(done, session.bytes)
        finally:
            # Unmapped before anything is declared: the commit refuses a
            # staging memfd that any process still maps.
            dest = dest_t = None
            mm.close()

        def declarations():
            first = True
            runs = []

            def message():
                nonlocal first
                msg = pb.PublishChunk(runs=runs, in_place=True)
                if first:
                    msg.session, msg.token, first = session.session, session.token, False
                return msg
            for index, spans, _ in pieces:
                for offset, length in spans:
                    runs.append(pb.PublishRun(tensor=index, offset=offset, length=length))
                    if len(runs) >= _DECLARED_RUNS:
                        yield message()
                        runs = []
            if runs or first:
                yield message()
        try:
            return self._models.PublishWrite(declarations())
        except grpc.RpcError as e:
            raise from_grpc(e) from None

    def _send_publish(self, session, pieces, transport, progress=None):
        if transport == "shm":
            return self._write_in_place(session, pieces, progress)
        return self._write_publish(session, pieces, progress)

    def _write_publish(self, session, pieces, progress=None):
        """Streams pieces [(tensor index, [(global byte offset, length)],
        flat uint8 array)] in chunks of <= 4 MiB; the PublishWriteResponse."""
        def chunks():
            first = True
            runs, data, size, sent = [], [], 0, 0

            def message():
                nonlocal first
                msg = pb.PublishChunk(runs=runs, data=data[0] if len(data) == 1 else b"".join(data))
                if first:
                    msg.session, msg.token, first = session.session, session.token, False
                return msg
            for index, spans, raw in pieces:
                at = 0
                for offset, length in spans:
                    done = 0
                    while done < length:
                        n = min(length - done, _PUBLISH_CHUNK - size)
                        runs.append(pb.PublishRun(tensor=index, offset=offset + done, length=n))
                        data.append(raw[at + done:at + done + n].tobytes())
                        size += n
                        done += n
                        if size >= _PUBLISH_CHUNK:
                            yield message()
                            sent += size
                            if progress is not None:
                                progress(sent, session.bytes)
                            runs, data, size = [], [], 0
                    at += length
            if runs or first:
                yield message()
                sent += size
                if progress is not None:
                    progress(sent, session.bytes)
        try:
            return self._models.PublishWrite(chunks())
        except grpc.RpcError as e:
            raise from_grpc(e) from None

    def commit_publish(self, session, wait=0):
        """The session's PublishResult, waiting up to `wait` seconds for its
        last byte; Error FAILED_PRECONDITION naming the first missing tensor
        and bytes when it is still incomplete."""
        r = self._call(self._models.CommitPublish, pb.CommitPublishRequest(
            session=session.session, token=session.token, wait_seconds=int(wait)),
            timeout=None if not wait else wait + 30)
        return _publish_result(r)

    def abort_publish(self, session):
        """Ends the session: nothing of it is published, its memory is freed."""
        self._call(self._models.AbortPublish, pb.AbortPublishRequest(
            session=session.session, token=session.token))

    def publish(self, model, state_dict, expect_generation=0, timeout=600, progress=None,
                dtypes=None, transport="auto"):
        """Publishes new base weights: every entry of state_dict ({served
        name: torch tensor | NumPy array}, dtype and shape as the model
        stores it) replaces the model's bytes; the rest keep theirs. The
        generation appears atomically once every byte has arrived; tensors
        whose bytes equal the current ones keep their digests; the adapter
        stack is merged again on the new weights. Returns a PublishResult.
        On any error the session is aborted and nothing is published.
        progress(bytes_sent, bytes_total) is called per chunk (per tensor
        with transport "shm").
        transport: "shm" - the tensors are copied once, straight into the
        daemon's staging memory (a daemon on this node; GPU tensors too);
        "grpc" - streamed in chunks of 4 MiB; "auto" - shm when this client
        reached the daemon over a Unix socket."""
        transport = self._publish_transport(transport)
        sources = {n: _publish_source(n, v, dtypes, on_device=transport == "shm")
                   for n, v in state_dict.items()}
        session = self.begin_publish(model, {n: (d, sh) for n, (d, sh, _) in sources.items()},
                                     expect_generation=expect_generation, timeout=timeout)
        try:
            pieces = [(i, [(0, _nbytes(raw))], raw) for i, (_, (_, _, raw)) in
                      enumerate(sources.items())]
            resp = self._send_publish(session, pieces, transport, progress)
            if resp.HasField("result"):
                return _publish_result(resp.result)
            return self.commit_publish(session)
        except BaseException:
            try:
                self.abort_publish(session)
            except Error:
                pass
            raise

    def publish_sharded(self, session, local_state_dict, world=None, rank=None, *, mesh=None,
                        coord=None, placements=None, wait=0, progress=None, dtypes=None,
                        transport="auto"):
        """One rank's part of a sharded publish: local_state_dict holds this
        rank's local shards ({served name: tensor}) of the session's tensors,
        laid out as fetch would serve them (torch.chunk per placement;
        placements as for fetch, or {name: placements}; default Shard(0) on
        the last mesh dim). Of the ranks holding the same piece (replicated
        mesh dims) only the one at coordinate 0 sends it. Returns the
        PublishResult when this rank's bytes completed the session, or after
        waiting up to `wait` seconds for the others; else None.
        transport: as for publish ("shm": each rank writes its pieces in
        place into the shared staging memory)."""
        transport = self._publish_transport(transport)
        if mesh is None:
            mesh = (1 if world is None else int(world),)
            coord = (0 if rank is None else int(rank),)
        mesh, coord = tuple(int(m) for m in mesh), tuple(int(c) for c in coord or ())
        if len(coord) != len(mesh) or any(not 0 <= c < m for c, m in zip(coord, mesh)):
            raise Error("INVALID_ARGUMENT", "coord %s does not lie in mesh %s" % (coord, mesh))
        index = {name: i for i, (name, _, _) in enumerate(session.tensors)}
        pieces = []
        for name, value in local_state_dict.items():
            if name not in index:
                raise Error("INVALID_ARGUMENT", "tensor \"%s\" is not in publish session %d"
                            % (name, session.session))
            i = index[name]
            _, dname, shape = session.tensors[i]
            if isinstance(placements, dict):
                pl = placements.get(name)
            else:
                pl = placements
            pl = _parse_placements(pl) if pl is not None else (
                [-1] * (len(mesh) - 1) + [0])
            if len(pl) != len(mesh):
                raise Error("INVALID_ARGUMENT", "%d placements for a mesh of %d dims"
                            % (len(pl), len(mesh)))
            if name in session.per_part and any(p >= 0 for p in pl):
                raise Error("INVALID_ARGUMENT", "tensor \"%s\" is sharded part by part by the "
                            "model's profile; publish it with replicated placements (whole) "
                            "from one rank" % name)
            offset, size, writes = _local_box(shape, mesh, coord, pl)
            ldtype, lshape, raw = _publish_source(name, value, dtypes,
                                                  on_device=transport == "shm")
            if ldtype != dname or list(lshape) != list(size if shape else []):
                raise Error("INVALID_ARGUMENT", "tensor \"%s\": the local shard is %s %s; this "
                            "rank's piece of %s %s is %s" % (name, ldtype, list(lshape), dname,
                                                            list(shape), list(size)))
            if writes:
                pieces.append((i, _box_runs(shape, offset, size, _dtypes.itemsize(dname)), raw))
        if pieces:  # a rank holding only copies others send writes nothing
            resp = self._send_publish(session, pieces, transport, progress)
            if resp.HasField("result"):
                return _publish_result(resp.result)
        if wait:
            return self.commit_publish(session, wait=wait)
        return None

    # -- shards

    def watch(self, model, after=0, include_current=False, timeout=None):
        """Iterator over GenerationEvent for `model`, one per new generation
        (those > `after`; 0 = > the current one; include_current first
        reports the current generation). Raises Error (e.g. code
        "UNIMPLEMENTED") when the daemon refuses. cancel() ends it."""
        req = _request(pb.WatchRequest, model=model, after=int(after),
                       include_current=bool(include_current))
        return WatchStream(self._shards.Watch(req, timeout=timeout))

    def fetch(self, model, world=None, rank=None, *, mesh=None, coord=None, placements=None,
              dtype=None, generation=0, changed_since=0, names=None, transport="shm",
              populate=False, timeout=None, mode=None, device=None, pin=True,
              cast_on_push=True, merge_on_push=None):
        """Fetches this rank's local shards of `model` and returns a ShardHandle.

        world/rank: a 1-D mesh (default 1/0); or mesh=(A, B, ...) with
        coord=(i, j, ...). placements: one per mesh dim, "R,S0" or
        ["R", "S0"] (or ints: -1 replicate, d = Shard(d)); None = profile /
        defaults. dtype: None/"keep", "f32", "f16", "bf16", "f8_e4m3", ...
        generation: 0 = current. changed_since: only tensors whose digest
        differs from that generation. names: only these tensors.
        transport: "shm" (zero-copy, same node) or "grpc" (streamed).
        populate: shm only — fill this process's page tables for the shard
        now (MADV_POPULATE_READ), so a worker that reads everything at once
        takes no page faults; the daemon's pages then count in its RSS
        (RssShmem), still shared, never copied.
        mode: None/"export" - the daemon's memory, under a lease (above);
        "push" (transport "shm" only) - the client allocates a memfd (the
        default layout: every tensor at a multiple of 256 bytes), the daemon
        writes the shard into it and the lease ends at once; the tensors are
        writable views of one shared map of it (TensorMeta.offset = the
        tensor's offset in it, segment 0), and refresh() updates them in
        place. timeout= also bounds the wait for the push's reply (default
        30 s plus 1 s per 100 MiB).
        device: None (host memory, as above) or a CUDA device ("cuda:N",
        "cuda" = torch's current one, an int, a torch.device): the tensors
        are CUDA tensors on it (module doc, "Into a GPU"); transport "shm"
        only. mode with a device: "push" (the default) - the daemon copies
        into a VMM allocation of this process; "pull" - this process copies
        from the shm mapping, pinned read-only first when `pin` (and CUDA
        allows: handle.pinned / handle.pin_error say); "zero-copy" - no
        copy: CUDA tensors over the shm mapping itself, read by the device
        in place (module doc); "export" - the daemon's own read-only device
        buffer of the shard, imported (module doc). FAILED_PRECONDITION when
        this process has no CUDA (torch without it, no driver), and for
        "zero-copy" on a device that cannot read host pages in place (both
        attributes named), before any lease. "zero-copy" and "export"
        tensors must not be written (ShardHandle.read_only).
        cast_on_push: with mode "push" (host or GPU), a tensor that needs only
        a cast of its stored bytes is cast by the daemon as it writes it (on
        the GPU for a GPU push: the stored bytes cross PCIe, not the wider
        cast ones) instead of into a cast copy it keeps; such tensors carry
        no digest (TensorMeta.digest == b""). False: every tensor is
        materialized first, as for the other modes.
        merge_on_push: with cast_on_push, a tensor whose extra work is LoRA or
        dense patches (not DoRA) on whole rows is merged by the daemon as it
        writes it too (element by element: on the GPU for a GPU push; on the
        CPU for a host push, slower than the daemon's vectorized merge).
        None (the default): on for a GPU push, off for a host push.
        """
        if mesh is not None or coord is not None:
            if world is not None or rank is not None:
                raise Error("INVALID_ARGUMENT", "give either world/rank or mesh/coord, not both")
            if mesh is None or coord is None:
                raise Error("INVALID_ARGUMENT", "mesh and coord go together")
            if isinstance(mesh, str):
                mesh = [int(x) for x in mesh.lower().split("x")]
            if isinstance(coord, str):
                coord = [int(x) for x in coord.split(",")]
            mesh_shape, mesh_coord = [int(x) for x in mesh], [int(x) for x in coord]
        else:
            mesh_shape = [1 if world is None else int(world)]
            mesh_coord = [0 if rank is None else int(rank)]
        pl = _parse_placements(placements)
        if pl is not None and len(pl) != len(mesh_shape):
            raise Error("INVALID_ARGUMENT", "placements %r have %d entries but the mesh has %d "
                        "dims" % (placements, len(pl), len(mesh_shape)))
        if transport not in _TRANSPORTS:
            raise Error("INVALID_ARGUMENT", "transport: expected shm or grpc, got %r"
                        % (transport,))
        dev = _cuda.parse_device(device)
        if dev is not None:
            if mode is None:
                mode = "push"
            if mode not in ("push", "pull", "zero-copy", "export"):
                raise Error("INVALID_ARGUMENT", "mode: expected push, pull, zero-copy or export, "
                            "got %r" % (mode,))
            if transport != "shm":
                raise Error("INVALID_ARGUMENT", "a fetch into a GPU (mode \"%s\") needs "
                            "transport \"shm\" (a local daemon), not %r" % (mode, transport))
        elif mode in ("pull", "zero-copy"):
            raise Error("INVALID_ARGUMENT", "mode \"%s\" is for a GPU: give device=\"cuda:N\""
                        % mode)
        if mode not in (None, "export", "push", "pull", "zero-copy"):
            raise Error("INVALID_ARGUMENT", "mode: expected export, push, pull or zero-copy, got %r"
                        % (mode,))
        if mode == "push" and transport != "shm":
            raise Error("INVALID_ARGUMENT", "mode \"push\" needs transport \"shm\" (the daemon "
                        "writes into a memfd passed over its data socket), not %r" % (transport,))
        dt = _dtypes.parse_request_dtype(dtype)
        req = pb.FetchRequest(
            model=model, generation=int(generation), mesh_shape=mesh_shape, coord=mesh_coord,
            dtype=_dtypes.enum_of_name(dt) if dt else pb.DTYPE_UNSPECIFIED,
            names=list(names or ()), transport=_TRANSPORTS[transport],
            changed_since=int(changed_since),
            defer_casts=((mode == "push" or (mode == "export" and dev is not None)) and
                         bool(cast_on_push)))
        if req.defer_casts:
            req.defer_merges = bool(dev is not None if merge_on_push is None else merge_on_push)
        if pl is not None:
            req.placements.extend(pb.Placement(shard_dim=d) for d in pl)
        zero_copy = None
        if dev is not None:
            # Before any lease: this process must have the GPU (and, for
            # zero-copy, a way for it to read host pages in place).
            _, dev = _cuda.require_torch_cuda(dev)
            if mode == "zero-copy":
                zero_copy = _cuda.zero_copy_path(dev)

        # Retried whole on UNAVAILABLE: a Fetch the daemon never handled
        # granted no lease, and one granted by a daemon that then went away
        # (data socket refused or closed, Read stream cut) died with it.
        # Each attempt connects to the data socket afresh.
        def attempt():
            resp = self._call(self._shards.Fetch, req, timeout=timeout)
            lease = _Lease(self._shards, resp.lease_id, bytes(resp.token))
            try:
                if dev is not None and mode == "push":
                    return self._collect_cuda_push(resp, lease, req, timeout, dev)
                if dev is not None and mode == "zero-copy":
                    return self._collect_zero_copy(resp, lease, timeout, dev, zero_copy)
                if dev is not None and mode == "export":
                    return self._collect_cuda_export(resp, lease, timeout, dev)
                if dev is not None:
                    return self._collect_pull(resp, lease, timeout, dev, pin)
                if mode == "push":
                    return self._collect_push(resp, lease, req, timeout, populate)
                return self._collect(resp, lease, transport, timeout, populate)
            except BaseException:
                try:
                    lease.release(timeout=1.0)
                except Exception:
                    pass
                raise
        return self._retrying(attempt)

    @staticmethod
    def _metas(resp):
        """The FetchResponse's tensors as TensorMeta, checked."""
        sizes = list(resp.segment_sizes)
        metas = []
        for t in resp.tensors:
            meta = TensorMeta(
                name=t.name, dtype=_dtypes.name_of_enum(t.dtype), shape=tuple(t.shape),
                global_shape=tuple(t.global_shape), global_offset=tuple(t.global_offset),
                digest=bytes(t.digest), segment=t.segment, offset=t.offset, length=t.length)
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
            metas.append(meta)
        return metas

    @staticmethod
    def _attach_and_map(data_socket, resp, lease, private):
        """Attaches the lease on the data socket (the connection then holds
        it) and maps each of its segments: `private` - copy-on-write, each
        map holding the lease (the export's zero-copy tensors); else shared
        read-only (a pull's source). None for an empty segment."""
        sizes = list(resp.segment_sizes)
        conn, fds = _datasock.attach(data_socket, resp.lease_id, bytes(resp.token), len(sizes))
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

    def _collect(self, resp, lease, transport, timeout, populate=False):
        sizes = list(resp.segment_sizes)
        metas = self._metas(resp)
        pieces = {}
        if transport == "shm":
            maps = self._attach_and_map(_data_socket_of(self.socket, resp), resp, lease,
                                        private=True)
            for m in metas:
                pieces[m.name] = (maps[m.segment], m.offset) if m.length else None
                if m.length and populate:
                    _populate(maps[m.segment], m.offset, m.length)
        else:
            for seg_index in range(len(sizes)):
                ranges = sorted((m.offset, m.offset + m.length) for m in metas
                                if m.segment == seg_index and m.length)
                merged = []
                for lo, hi in ranges:
                    if merged and lo <= merged[-1][1] + _policy.READ_MERGE_GAP:
                        merged[-1][1] = max(merged[-1][1], hi)
                    else:
                        merged.append([lo, hi])
                bufs = [(lo, hi, self._read(lease, seg_index, lo, hi - lo, timeout))
                        for lo, hi in merged]
                for m in metas:
                    if m.segment != seg_index or not m.length:
                        continue
                    for lo, hi, buf in bufs:
                        if lo <= m.offset and m.offset + m.length <= hi:
                            pieces[m.name] = (buf, m.offset - lo)
                            break
            for m in metas:
                pieces.setdefault(m.name, None)
        return _identified(resp, ShardHandle(lease, resp.generation, transport, metas, pieces))

    def _collect_push(self, resp, lease, req, timeout, populate=False):
        """mode="push": allocates the destination, has the daemon fill it
        (which ends the lease) and maps it."""
        metas = self._metas(resp)
        offsets, size = _datasock.default_layout([m.length for m in metas])
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
            _datasock.push(_data_socket_of(self.socket, resp), resp.lease_id,
                           bytes(resp.token), fd, None, _push_timeout(timeout, size))
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
        metas = [dataclasses.replace(m, segment=0, offset=at) for m, at in zip(metas, offsets)]
        pieces = {m.name: (mapping, m.offset) if m.length else None for m in metas}
        if populate and mapping is not None:
            _populate(mapping, 0, size)
        copy = pb.FetchRequest()
        copy.CopyFrom(req)
        dest = _PushDest(self, copy, timeout, fd, mapping, size)
        return _identified(resp, ShardHandle(lease, resp.generation, "shm", metas, pieces,
                                             push=dest))

    def _collect_cuda_push(self, resp, lease, req, timeout, index):
        """mode="push" into CUDA device `index`: allocates the destination
        (VMM, the default layout), has the daemon fill it (which ends the
        lease) and wraps it in CUDA tensors."""
        import torch
        metas = self._metas(resp)
        offsets, size = _datasock.default_layout([m.length for m in metas])
        uuid = _cuda.gpu_uuid_bytes(index)
        alloc = _cuda.vmm_alloc(index, size)
        try:
            try:
                _cuda.push_cuda(_data_socket_of(self.socket, resp), resp.lease_id,
                                bytes(resp.token), alloc.fd, uuid, alloc.size, None,
                                _push_timeout(timeout, size))
            finally:
                alloc.close_fd()
            lease.done = True  # closing the push's connection ended the lease
            raw = _cuda.tensor_from_ptr(alloc.ptr, alloc.size, torch.uint8, (alloc.size,),
                                        index, alloc)
        except BaseException:
            alloc.free(quiet=True)
            raise
        metas = [dataclasses.replace(m, segment=0, offset=at) for m, at in zip(metas, offsets)]
        pieces = {m.name: (raw, m.offset) if m.length else None for m in metas}
        copy = pb.FetchRequest()
        copy.CopyFrom(req)
        dest = _CudaPushDest(self, copy, timeout, alloc, raw, index, uuid)
        del alloc  # the handle's hold is dest.alloc and raw (which holds it too)
        return _identified(resp, ShardHandle(lease, resp.generation, "shm", metas, pieces,
                                             push=dest, device="cuda:%d" % index))

    def _collect_cuda_export(self, resp, lease, timeout, index):
        """mode="export" on CUDA device `index`: the daemon's own device
        buffer of this shard (filled once, shared by every process that
        exports the same fetch to the same GPU), imported and mapped
        read-only here; CUDA tensors over it at the default layout. The data
        connection holds the lease (and the daemon's hold on the buffer)
        until release(); the mapping lives as long as a tensor made from
        it."""
        import torch
        metas = self._metas(resp)
        offsets, layout_size = _datasock.default_layout([m.length for m in metas])
        uuid = _cuda.gpu_uuid_bytes(index)
        sock, fd, size, got_layout = _cuda.export(
            _data_socket_of(self.socket, resp), resp.lease_id, bytes(resp.token), uuid,
            _push_timeout(timeout, layout_size))
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
        raw = _cuda.tensor_from_ptr(imported.ptr, imported.size, torch.uint8, (imported.size,),
                                    index, imported)
        metas = [dataclasses.replace(m, segment=0, offset=at) for m, at in zip(metas, offsets)]
        pieces = {m.name: (raw, m.offset) if m.length else None for m in metas}
        h = _identified(resp, ShardHandle(lease, resp.generation, "shm", metas, pieces,
                                          device="cuda:%d" % index, mode="export"))
        h.read_only = True
        h.access = "read-only" if imported.read_only else "read-write"
        h.access_error = imported.read_only_refused
        h._ranges = [(imported.ptr, imported.ptr + imported.size)]
        return h

    def _collect_zero_copy(self, resp, lease, timeout, index, path):
        """mode="zero-copy" on CUDA device `index`: attaches the lease and
        maps its segments read-only (shared); the tensors are CUDA tensors
        over those pages, read by the device in place (`path`, from
        _cuda.zero_copy_path): at their host address where it reads pageable
        memory coherently (Grace Hopper / Blackwell, HMM), else through a
        read-only mapped registration of the shard's pages
        (cuMemHostRegister DEVICEMAP | READ_ONLY; over PCIe, slow for
        compute). The lease ends with release(); the pages and
        registrations live as long as a tensor made from them."""
        import torch
        sizes = list(resp.segment_sizes)
        metas = self._metas(resp)
        maps = self._attach_and_map(_data_socket_of(self.socket, resp), resp, lease,
                                    private=False)
        hold = _ZeroCopyHold(maps, index)

        def tensors(pageable):
            ranges = []  # (segment, lo, hi, device address of lo)
            for seg, lo, hi in _cuda.pin_ranges(
                    [(m.segment, m.offset, m.length) for m in metas], sizes, _PAGE):
                host = _address_of(maps[seg]) + lo
                if pageable:
                    ranges.append((seg, lo, hi, host))
                else:
                    reg = _cuda.host_register_read_only(index, host, hi - lo, mapped=True)
                    hold.regs.append(reg)
                    ranges.append((seg, lo, hi, reg.device_ptr))
            out = {}
            for m in metas:
                dt = _dtypes.torch_dtype(m.dtype)
                if not m.length:
                    out[m.name] = torch.empty(m.shape, dtype=dt, device="cuda:%d" % index)
                    continue
                ptr = next(d + (m.offset - lo) for seg, lo, hi, d in ranges
                           if seg == m.segment and lo <= m.offset and m.offset + m.length <= hi)
                out[m.name] = _cuda.tensor_from_ptr(ptr, m.length, dt, m.shape, index, hold)
            return out, [(d, d + (hi - lo)) for _, lo, hi, d in ranges]

        try:
            pageable = path == _cuda.ZERO_COPY_PAGEABLE
            try:
                out, ranges = tensors(pageable)
            except RuntimeError as e:
                if not pageable:
                    raise Error("INTERNAL", "torch took no tensor over the registered shard: "
                                "%s" % e) from None
                # A torch that wraps only device or registered addresses
                # (it asks CUDA where a pointer lives): the registration.
                pageable = False
                try:
                    out, ranges = tensors(False)
                except Error as refused:
                    raise Error(refused.code, "torch took no tensor over the host address of "
                                "the shard (%s), and the registration instead failed: %s"
                                % (e, refused.message)) from None
        except BaseException:
            hold.close()
            raise
        pieces = {m.name: (out[m.name], None) if m.length else None for m in metas}
        h = _identified(resp, ShardHandle(lease, resp.generation, "shm", metas, pieces,
                                          device="cuda:%d" % index, mode="zero-copy"))
        h.pageable_access = pageable
        h.read_only = True
        h.access = "read-only"  # a PROT_READ map; registered READ_ONLY where not pageable
        h._ranges = sorted(ranges)
        return h

    def _collect_pull(self, resp, lease, timeout, index, pin):
        """mode="pull" into CUDA device `index`: attaches the lease, maps its
        segments read-only (shared), pins the shard's pages read-only when
        `pin` (and CUDA allows), copies every tensor to the GPU, synchronizes
        and ends the lease."""
        import torch
        sizes = list(resp.segment_sizes)
        metas = self._metas(resp)
        maps = self._attach_and_map(_data_socket_of(self.socket, resp), resp, lease,
                                    private=False)
        device = torch.device("cuda", index)
        regs, pin_error, out = [], "", {}
        try:
            if pin:
                try:
                    for seg, lo, hi in _cuda.pin_ranges(
                            [(m.segment, m.offset, m.length) for m in metas], sizes, _PAGE):
                        regs.append(_cuda.host_register_read_only(
                            index, _address_of(maps[seg]) + lo, hi - lo))
                except Error as e:
                    pin_error = e.message or e.code
                    for r in regs:
                        r.unregister()
                    regs = []
            with torch.cuda.device(index), warnings.catch_warnings():
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
                torch.cuda.synchronize(index)
        finally:
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
        del maps  # unmapped once torch drops the source tensors
        lease.release()  # the bytes are this process's now
        pieces = {m.name: (out[m.name], None) if m.length else None for m in metas}
        h = _identified(resp, ShardHandle(lease, resp.generation, "shm", metas, pieces,
                                          device=str(device), mode="pull"))
        h.pinned = bool(pin) and not pin_error
        h.pin_error = pin_error
        return h

    def _refresh_push(self, handle, generation):
        """ShardHandle.refresh of a push handle (its lock held)."""
        dest = handle._push
        req = pb.FetchRequest()
        req.CopyFrom(dest.request)
        req.generation = int(generation or 0)
        req.changed_since = int(handle.generation)
        have = {m.name: m for m in handle.tensors}

        def attempt():
            try:
                resp = self._call(self._shards.Fetch, req, timeout=dest.timeout)
            except ValueError as e:  # the client's channel was closed
                raise Error("FAILED_PRECONDITION", "refresh: %s" % e) from None
            lease = _Lease(self._shards, resp.lease_id, bytes(resp.token))
            try:
                metas = self._metas(resp)
                offsets = []
                for m in metas:
                    old = have.get(m.name)
                    if old is None:
                        raise Error("FAILED_PRECONDITION", "tensor \"%s\" changed at generation "
                                    "%d but this handle does not hold it; fetch again"
                                    % (m.name, resp.generation))
                    if (old.dtype, old.shape, old.length) != (m.dtype, m.shape, m.length):
                        raise Error("FAILED_PRECONDITION", "tensor \"%s\" is %s %s at generation "
                                    "%d but %s %s in this handle; fetch again"
                                    % (m.name, m.dtype, list(m.shape), resp.generation,
                                       old.dtype, list(old.shape)))
                    offsets.append(old.offset)
                dest.push(resp, offsets,
                          _push_timeout(dest.timeout, sum(m.length for m in metas)))
                lease.done = True
                return resp.generation, metas, getattr(resp, "weights_id", "")
            except BaseException:
                try:
                    lease.release(timeout=1.0)
                except Exception:
                    pass
                raise
        gen, metas, weights_id = self._retrying(attempt)
        changed = {m.name: m for m in metas}
        handle.tensors = [
            dataclasses.replace(t, digest=changed[t.name].digest,
                                global_shape=changed[t.name].global_shape,
                                global_offset=changed[t.name].global_offset)
            if t.name in changed else t for t in handle.tensors]
        handle.generation = gen
        handle.weights_id = weights_id
        return [m.name for m in metas]

    def _read(self, lease, segment, offset, length, timeout):
        buf = _Buffer(length)
        buf._lease = lease
        view = memoryview(buf)
        got = 0
        call = self._shards.Read(pb.ReadRequest(lease_id=lease.lease_id, token=lease.token,
                                                segment=segment, offset=offset, length=length),
                                 timeout=timeout)
        try:
            for chunk in call:
                n = len(chunk.data)
                if chunk.offset != got or n > length - got:
                    call.cancel()
                    raise Error("INTERNAL", "daemon sent an out-of-order or oversized chunk")
                view[got:got + n] = chunk.data
                got += n
        except grpc.RpcError as e:
            raise from_grpc(e, "reading segment %d" % segment) from None
        finally:
            view.release()
        if got != length:
            raise Error("DATA_LOSS", "segment %d: got %d of %d bytes" % (segment, got, length))
        return buf

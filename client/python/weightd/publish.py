"""Publishing new base weights (Client.begin_publish / publish /
publish_sharded / commit_publish / abort_publish): the session values
(PublishSession, PublishResult), a tensor's bytes as a flat source, the
shard box math of a sharded publish (torch.chunk's rule, docs/DESIGN.md §2.1), and the
two ways the bytes travel: in place into the session's staging memfd (a
daemon on this node) or streamed in PublishChunk messages.

Functions over a Client (its socket and Models stub); no state of their
own. A PublishSession is a plain value: picklable, shared across ranks."""
import concurrent.futures
import mmap
import os
from dataclasses import dataclass, field

import grpc
import numpy as np

from . import _datasock, _dtypes, _requests, _shard
from .errors import Error, from_grpc
from .v1 import weightd_pb2 as pb

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


def result_of(r):
    return PublishResult(r.model, r.generation, r.weights_id, r.tensors, r.changed, r.bytes,
                         r.bytes_stored, list(r.adapters), r.bytes_shared, list(r.shared_with))


def _flat_torch(torch, value, on_device):
    t = value.detach().contiguous()
    if not on_device:
        t = t.cpu()
    dname = _dtypes.parse_request_dtype(t.dtype)
    if on_device:
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else np.zeros(0, np.uint8)
    else:
        raw = (t.reshape(-1).view(torch.uint8).numpy() if t.numel()
               else np.zeros(0, np.uint8))
    return dname, tuple(t.shape), raw


def source(name, value, dtypes=None, on_device=False):
    """(dtype name, shape, flat uint8 array of the row-major bytes) of a
    torch tensor or NumPy array; dtypes[name] overrides the dtype (e.g. a
    uint16 array holding BF16 bits). on_device: a torch tensor's bytes stay
    a flat uint8 torch tensor where it lives (a GPU tensor is copied once,
    straight into the staging memfd)."""
    torch = _dtypes.torch_or_none()
    if torch is not None and isinstance(value, torch.Tensor):
        dname, shape, raw = _flat_torch(torch, value, on_device)
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
    if nbytes(raw) != n * _dtypes.itemsize(dname):
        raise Error("INVALID_ARGUMENT", "tensor \"%s\": %d bytes for %s %s" % (
            name, nbytes(raw), dname, list(shape)))
    return dname, shape, raw


def nbytes(raw):
    return int(raw.size if isinstance(raw, np.ndarray) else raw.numel())


# ---------------------------------------------------------------- session


def begin(client, model, tensors, expect_generation=0, timeout=600, dtypes=None):
    """Client.begin_publish."""
    specs = []
    for name, value in tensors.items():
        if isinstance(value, tuple) and len(value) == 2:
            dname = _dtypes.parse_request_dtype(value[0])
            shape = tuple(int(d) for d in value[1])
        else:
            dname, shape, _ = source(name, value, dtypes)
        specs.append((name, dname, shape))
    req = pb.BeginPublishRequest(
        model=model, expect_generation=int(expect_generation),
        timeout_seconds=int(timeout),
        tensors=[pb.PublishTensor(name=n, dtype=_dtypes.enum_of_name(d), shape=list(sh))
                 for n, d, sh in specs])
    r = client._call(client._models.BeginPublish, req)
    return PublishSession(model, r.session, r.token, r.base_generation, r.bytes,
                          r.deadline_unix_ms, specs, list(r.per_part), list(r.offsets),
                          r.staging_bytes, r.data_socket, r.data_socket_name)


def commit(client, session, wait=0):
    """Client.commit_publish."""
    r = client._call(client._models.CommitPublish, pb.CommitPublishRequest(
        session=session.session, token=session.token, wait_seconds=int(wait)),
        timeout=None if not wait else wait + 30)
    return result_of(r)


def abort(client, session):
    """Client.abort_publish."""
    client._call(client._models.AbortPublish, pb.AbortPublishRequest(
        session=session.session, token=session.token))


def transport_of(client, transport):
    """"shm" (write in place into the staging memfd: a daemon on this
    node) or "grpc" (stream); "auto"/None: shm when this client reached
    the daemon over a Unix socket."""
    if transport in (None, "auto"):
        return "shm" if client.socket is not None else "grpc"
    if transport not in ("shm", "grpc"):
        raise Error("INVALID_ARGUMENT", "publish transport %r: use \"auto\", \"shm\" "
                    "or \"grpc\"" % (transport,))
    return transport


def send(client, session, pieces, transport, progress=None):
    """Writes pieces [(tensor index, [(global byte offset, length)], flat
    uint8 array)] the way `transport` says; the PublishWriteResponse."""
    if transport == "shm":
        return write_in_place(client, session, pieces, progress)
    return write_stream(client._models, session, pieces, progress)


def publish(client, model, state_dict, expect_generation=0, timeout=600, progress=None,
            dtypes=None, transport="auto"):
    """Client.publish."""
    transport = transport_of(client, transport)
    sources = {n: source(n, v, dtypes, on_device=transport == "shm")
               for n, v in state_dict.items()}
    session = begin(client, model, {n: (d, sh) for n, (d, sh, _) in sources.items()},
                    expect_generation=expect_generation, timeout=timeout)
    try:
        pieces = [(i, [(0, nbytes(raw))], raw) for i, (_, (_, _, raw)) in
                  enumerate(sources.items())]
        resp = send(client, session, pieces, transport, progress)
        if resp.HasField("result"):
            return result_of(resp.result)
        return commit(client, session)
    except BaseException:
        try:
            abort(client, session)
        except Error:
            pass
        raise


def _placements_of(session, name, placements, mesh):
    """The placements `name` is sharded by (placements as for fetch, or
    {name: placements}; default Shard(0) on the last mesh dim), checked."""
    pl = placements.get(name) if isinstance(placements, dict) else placements
    pl = _requests.parse_placements(pl) if pl is not None else [-1] * (len(mesh) - 1) + [0]
    if len(pl) != len(mesh):
        raise Error("INVALID_ARGUMENT", "%d placements for a mesh of %d dims"
                    % (len(pl), len(mesh)))
    if name in session.per_part and any(p >= 0 for p in pl):
        raise Error("INVALID_ARGUMENT", "tensor \"%s\" is sharded part by part by the "
                    "model's profile; publish it with replicated placements (whole) "
                    "from one rank" % name)
    return pl


def _rank_pieces(session, local_state_dict, mesh, coord, placements, dtypes, on_device):
    """The pieces this rank writes: of its local shards, those it holds at
    coordinate 0 of the mesh dims that replicate them."""
    index = {name: i for i, (name, _, _) in enumerate(session.tensors)}
    pieces = []
    for name, value in local_state_dict.items():
        if name not in index:
            raise Error("INVALID_ARGUMENT", "tensor \"%s\" is not in publish session %d"
                        % (name, session.session))
        i = index[name]
        _, dname, shape = session.tensors[i]
        pl = _placements_of(session, name, placements, mesh)
        offset, size, writes = _shard.local_box(shape, mesh, coord, pl)
        ldtype, lshape, raw = source(name, value, dtypes, on_device=on_device)
        if ldtype != dname or list(lshape) != list(size if shape else []):
            raise Error("INVALID_ARGUMENT", "tensor \"%s\": the local shard is %s %s; this "
                        "rank's piece of %s %s is %s" % (name, ldtype, list(lshape), dname,
                                                        list(shape), list(size)))
        if writes:
            pieces.append((i, _shard.box_runs(shape, offset, size, _dtypes.itemsize(dname)), raw))
    return pieces


def publish_sharded(client, session, local_state_dict, world=None, rank=None, *, mesh=None,
                    coord=None, placements=None, wait=0, progress=None, dtypes=None,
                    transport="auto"):
    """Client.publish_sharded."""
    transport = transport_of(client, transport)
    if mesh is None:
        mesh = (1 if world is None else int(world),)
        coord = (0 if rank is None else int(rank),)
    mesh, coord = tuple(int(m) for m in mesh), tuple(int(c) for c in coord or ())
    if len(coord) != len(mesh) or any(not 0 <= c < m for c, m in zip(coord, mesh)):
        raise Error("INVALID_ARGUMENT", "coord %s does not lie in mesh %s" % (coord, mesh))
    pieces = _rank_pieces(session, local_state_dict, mesh, coord, placements, dtypes,
                          on_device=transport == "shm")
    if pieces:  # a rank holding only copies others send writes nothing
        resp = send(client, session, pieces, transport, progress)
        if resp.HasField("result"):
            return result_of(resp.result)
    if wait:
        return commit(client, session, wait=wait)
    return None


# ---------------------------------------------------------------- the bytes


def _map_staging(client, session):
    """The session's staging memfd (taken on the data socket), mapped
    shared and writable."""
    path = _datasock.data_socket_of(client.socket, session)
    fd = _datasock.stage(path, session.session, bytes.fromhex(session.token))
    try:
        # Page tables filled in one call: faulting 4 KiB at a time into
        # the daemon's (resident) pages costs ~30x the copy itself.
        return mmap.mmap(fd, session.staging_bytes,
                         mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                         mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        raise Error("INTERNAL", "mapping the staging memfd of publish session %d: %s"
                    % (session.session, e)) from None
    finally:
        os.close(fd)


def _copy_into(mm, session, pieces, progress):
    """Copies pieces into the staging map `mm` at the session's offsets.
    Drops every view of `mm` before it returns or raises (so it can be
    unmapped)."""
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
                torch = _dtypes.torch_or_none()
                dest_t = torch.frombuffer(mm, dtype=torch.uint8)
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
        dest = dest_t = None


def _declarations(session, pieces):
    """PublishChunk messages declaring the runs written in place (at most
    _DECLARED_RUNS each; the first names the session)."""
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


def write_in_place(client, session, pieces, progress=None):
    """Writes pieces [(tensor index, [(global byte offset, length)], flat
    uint8 NumPy array or torch tensor)] straight into the session's
    staging memfd (taken on the data socket), unmaps it, then declares
    the runs written (PublishChunk.in_place); the PublishWriteResponse."""
    if not session.offsets and session.tensors:
        raise Error("FAILED_PRECONDITION", "the daemon offers no staging memfd for publish "
                    "session %d; publish with transport=\"grpc\"" % session.session)
    mm = _map_staging(client, session)
    try:
        _copy_into(mm, session, pieces, progress)
    finally:
        # Unmapped before anything is declared: the commit refuses a
        # staging memfd that any process still maps.
        mm.close()
    try:
        return client._models.PublishWrite(_declarations(session, pieces))
    except grpc.RpcError as e:
        raise from_grpc(e) from None


def _chunks(session, pieces, progress):
    """PublishChunk messages carrying the pieces' bytes, <= _PUBLISH_CHUNK
    each (the first names the session)."""
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


def write_stream(models, session, pieces, progress=None):
    """Streams pieces [(tensor index, [(global byte offset, length)], flat
    uint8 array)] in chunks of <= 4 MiB over Models.PublishWrite (`models`:
    the stub); the PublishWriteResponse."""
    try:
        return models.PublishWrite(_chunks(session, pieces, progress))
    except grpc.RpcError as e:
        raise from_grpc(e) from None

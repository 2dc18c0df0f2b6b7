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

Push (fetch(..., mode="push"), docs/DESIGN.md §4.5, §9.1): the client owns the memory. It
allocates a memfd (fallocate'd, so the pages are its own), passes it to the
daemon over the data socket, and the daemon writes the shard into it; the
tensors are zero-copy views of one writable shared map of that memfd, every
tensor at a multiple of 256 bytes. The daemon keeps no lease once the bytes
are in place. handle.refresh() later has the daemon rewrite, in the same
memory, only the tensors that changed in a newer generation (an adapter
applied): tensors taken from the handle before see the new values.

Into a GPU (fetch(..., device="cuda:N"), docs/DESIGN.md §9; the daemon must be
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
import os

import grpc

from . import _channel, _delivery, _dtypes, _health, _requests, _types, publish as _publish
from ._policy import RETRY_INITIAL_BACKOFF, RETRY_JITTER, RETRY_MAX_BACKOFF, RETRY_MULTIPLIER
from ._types import (AdapterInfo, GenerationEvent, LoadProgress, ModelInfo, TensorInfo,
                     TensorMeta)
from .errors import Error, from_grpc
from .handle import ShardHandle, WatchStream, _Lease
from .publish import PublishResult, PublishSession
from .v1 import weightd_pb2 as pb
from .v1 import weightd_pb2_grpc as pb_grpc

# weightd.client also offers, as before, the value types, the handle and publish
# classes and RETRY_* (now _policy.py's); the bench uses weightd.client.pb, ._dtypes.


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

    Thread-safe: one gRPC channel and no other mutable state.
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
        """attempt(), retried per the policy until retry_deadline (_channel.retrying)."""
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
        profile: a dict, JSON text, or a path to a JSON file (docs/DESIGN.md §3).
        progress: optional callable receiving LoadProgress updates (the
        last one with done=True, saying where the bytes came from).
        readers: makes the model private ("uid:N", "gid:N", "token:NAME",
        "cn:NAME"); None = public.
        source: "auto" (peers holding the same files, else storage),
        "storage", or "peers" (UNAVAILABLE when no peer holds them)."""
        src = _requests.load_source(source)
        req = _requests.request(pb.LoadRequest, name=name, path=os.fspath(path),
                                profile_json=_requests.parse_profile(profile),
                                readers=_requests.readers(readers), source=src)
        info = None
        try:
            for msg in self._models.Load(req, timeout=timeout):
                if msg.done:
                    info = _types.model_info(msg.model)
                if progress is not None:
                    progress(_types.load_progress(msg))
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
        return [_types.model_info(m) for m in resp.models]

    def info(self, name):
        """ModelInfo of `name`, with its tensors."""
        resp = self._read_call(self._models.Get, pb.GetModelRequest(name=name))
        return _types.model_info(resp)

    def peers(self):
        """The fleet's other daemons this one knows (--peers) as it last
        polled them: a list of dicts (address, reachable, error, last_seen
        (unix seconds or None), models: [{name, generation, weights_id}])."""
        resp = self._read_call(self._models.Peers, pb.PeersRequest())
        return [_types.peer_info(p) for p in resp.peers]

    def stats(self):
        """The daemon's counters as a dict (models, segments, bytes_resident,
        materializations, ..., leases_open, bytes_served, fetches)."""
        return _types.stats(self._read_call(self._models.Stats, pb.StatsRequest()))

    # -- adapters

    def load_adapter(self, name, path, format="auto", strict=False, readers=None,
                     source="auto"):
        """Loads a LoRA / dense patch (format auto|peft|kohya|dense).
        readers: a tenant-private adapter (see load()). source: as load()'s
        (with --peers the daemon may take the file's bytes from a peer)."""
        src = _requests.load_source(source)
        r = self._call(self._adapters.Load, _requests.request(
            pb.LoadAdapterRequest, name=name, path=os.fspath(path), format=format,
            strict=strict, readers=_requests.readers(readers), source=src))
        return _types.adapter_info(r)

    def unload_adapter(self, name):
        self._call(self._adapters.Unload, pb.UnloadAdapterRequest(name=name))

    def list_adapters(self):
        r = self._read_call(self._adapters.List, pb.ListAdaptersRequest())
        return [_types.adapter_info(a) for a in r.adapters]

    def apply(self, model, adapters=(), expect_generation=0):
        """Sets model's adapter stack: [name | (name, strength)]; returns the
        new generation."""
        r = self._call(self._adapters.Apply, pb.ApplyRequest(
            model=model, adapters=_requests.adapter_refs(adapters),
            expect_generation=expect_generation))
        return r.generation

    # -- publish (publish.py)

    def begin_publish(self, model, tensors, expect_generation=0, timeout=600, dtypes=None):
        """Opens a session to publish new base weights for `model` (admins).
        tensors: {name: torch tensor | NumPy array | (dtype, shape)} of the
        served tensors to replace, in the dtype and (global) shape the model
        stores them in. Returns a PublishSession; nothing is visible until
        every byte has arrived. timeout: seconds until the session is
        aborted if incomplete."""
        return _publish.begin(self, model, tensors, expect_generation, timeout, dtypes)

    def commit_publish(self, session, wait=0):
        """The session's PublishResult, waiting up to `wait` seconds for its
        last byte; Error FAILED_PRECONDITION naming the first missing tensor
        and bytes when it is still incomplete."""
        return _publish.commit(self, session, wait)

    def abort_publish(self, session):
        """Ends the session: nothing of it is published, its memory is freed."""
        _publish.abort(self, session)

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
        return _publish.publish(self, model, state_dict, expect_generation, timeout, progress,
                                dtypes, transport)

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
        return _publish.publish_sharded(
            self, session, local_state_dict, world, rank, mesh=mesh, coord=coord,
            placements=placements, wait=wait, progress=progress, dtypes=dtypes,
            transport=transport)

    def _write_publish(self, session, pieces, progress=None):
        """publish.write_stream over this client (tests send raw pieces)."""
        return _publish.write_stream(self._models, session, pieces, progress)

    # -- shards

    def watch(self, model, after=0, include_current=False, timeout=None):
        """Iterator over GenerationEvent for `model`, one per new generation
        (those > `after`; 0 = > the current one; include_current first
        reports the current generation). Raises Error (e.g. code
        "UNIMPLEMENTED") when the daemon refuses. cancel() ends it."""
        req = _requests.request(pb.WatchRequest, model=model, after=int(after),
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
        mesh_shape, mesh_coord = _requests.mesh_of(world, rank, mesh, coord)
        pl = _requests.placements_of(placements, len(mesh_shape))
        mode, dev = _requests.fetch_target(transport, device, mode)
        req = _requests.fetch_request(model, mesh_shape, mesh_coord, pl, dtype, generation,
                                      changed_since, names, transport, mode, dev, cast_on_push,
                                      merge_on_push)
        # Before any lease: this process must have the GPU (and, for
        # zero-copy, a way for it to read host pages in place).
        target = _delivery.target(req, mode, transport, dev, timeout, populate, pin)

        # Retried whole on UNAVAILABLE: a Fetch the daemon never handled
        # granted no lease, and one granted by a daemon that then went away
        # (data socket refused or closed, Read stream cut) died with it.
        # Each attempt connects to the data socket afresh.
        def attempt():
            resp = self._call(self._shards.Fetch, req, timeout=timeout)
            lease = _Lease(self._shards, resp.lease_id, bytes(resp.token))
            try:
                return _delivery.collect(self, resp, lease, target)
            except BaseException:
                lease.release_quietly()
                raise
        return self._retrying(attempt)

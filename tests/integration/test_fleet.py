"""Fleets (issue [cluster]): a checkpoint read from storage once per fleet.
One daemon loads from storage; the others, with --source auto, read only
the headers and a few samples from storage and stream the tensor bytes from
the peers that hold the same files, spread over every holder. Each daemon's
storage reads are measured from outside (read_bytes in /proc/PID/io, the
files' page cache dropped before each load) and checked against its own
counters; the bytes served equal the files' (digests, and PyTorch reading
the files). Faults: a holder SIGKILLed mid-transfer, a peer that flips a
bit (a small proxy in this test), a peer whose file has the same name, size
and header but other bytes, a peer that accepts and never answers, one that
stalls mid-range; --source peers when nobody holds the files. A real lying
peer (a Python gRPC server on the generated stubs) that tells the truth at
the samples it is shown is caught by storage's bytes at places it is never
told; one that answers FindCheckpoint with 128 MiB does not take the
loader's memory. Every daemon here is a fleet member of the others
(--fleet-members token:fleet, --peer-token-file).
"""
import contextlib
import os
import re
import signal
import socket
import subprocess
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
import torch

from harness import Daemon, free_port, scrape_metrics
import peer_protocol as pp
import st_io

import weightd  # noqa: E402  (harness puts the build's package on the path)
from weightd.v1 import weightd_pb2 as pb

CHUNK = 1 << 20  # --read-chunk-bytes: many ranges, so every holder gets some
# The fleet's identity: holders list it in --fleet-members (by its name in
# their --auth-token-file), loaders present it (--peer-token-file).
FLEET_TOKEN = "fleet-0123456789abcdef-token"
FLEET_AUTH = [("authorization", "Bearer " + FLEET_TOKEN)]


def _fleet_args(tmp_path, listens=True):
    """The flags of a fleet member: it presents the fleet's token to its
    peers and, if it serves --listen, admits it there (the peer RPCs for it
    alone)."""
    tokens = tmp_path / "fleet.tokens"
    if not tokens.exists():
        tokens.write_text("fleet %s\n" % FLEET_TOKEN)
    serve = ["--auth-token-file", str(tokens), "--fleet-members", "token:fleet"]
    return (serve if listens else []) + ["--peer-token-file", str(tokens)]


def _write_checkpoint(root, seed, mib=48):
    """A two-shard checkpoint with an index, about `mib` MiB; returns its
    directory and {name: tensor}."""
    g = torch.Generator().manual_seed(seed)
    d = root / "model"
    d.mkdir(parents=True)
    tensors, weight_map = {}, {}
    per_shard = mib // 2
    for s in range(2):
        shard = {}
        for i in range(per_shard // 2):  # 2 MiB tensors
            name = "layers.%d.%d.weight" % (s, i)
            shard[name] = torch.randn(1024, 512, generator=g)
        shard["layers.%d.norm" % s] = torch.randn(333, generator=g).to(torch.bfloat16)
        fname = "model-%05d-of-00002.safetensors" % (s + 1)
        st_io.save(shard, str(d / fname))
        tensors.update(shard)
        weight_map.update({k: fname for k in shard})
    import json
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return d, tensors


def _drop_cache(directory):
    os.sync()
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _kernel_counts_reads(path):
    """read_bytes in /proc/PID/io counts reads from a block device; on
    tmpfs or an overlay it says nothing (the daemons' counters still do)."""
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True,
                        text=True).stdout.strip()
    return fs not in ("tmpfs", "ramfs", "overlayfs", "overlay")


def _read_bytes(pid):
    with open("/proc/%d/io" % pid) as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise AssertionError("no read_bytes in /proc/%d/io" % pid)


def _load(d, name, path, source="auto", **kw):
    """Loads through the Python client; returns (ModelInfo, the last
    progress report, the daemon's storage read_bytes during the load)."""
    reports = []
    before = _read_bytes(d.proc.pid)
    with weightd.Client(socket=d.socket) as c:
        info = c.load(name, str(path), source=source, progress=reports.append, **kw)
    return info, reports[-1], _read_bytes(d.proc.pid) - before


def _check_bytes(d, name, tensors):
    """The served bytes are the files' (as PyTorch reads them)."""
    with weightd.Client(socket=d.socket) as c, c.fetch(name, world=1, rank=0) as h:
        got = h.state_dict()
        assert set(got) == set(tensors)
        for k, t in tensors.items():
            assert torch.equal(got[k], t), k
        return h.weights_id


def _daemons(tmp_path, models, n, peers_of, extra=()):
    addrs = ["127.0.0.1:%d" % free_port() for _ in range(n)]
    out = []
    for i, addr in enumerate(addrs):
        peers = peers_of(i, addrs)
        args = ["--listen", addr, "--advertise", addr, "--peer-poll-seconds", "1",
                "--read-chunk-bytes", str(CHUNK)] + _fleet_args(tmp_path) + list(extra)
        if peers:
            args += ["--peers", ",".join(peers)]
        out.append(Daemon(model_root=str(models), workdir=str(tmp_path / ("d%d" % i)),
                          extra_args=args))
    return addrs, out


def _all_others(i, addrs):
    return [a for j, a in enumerate(addrs) if j != i]


def _holder(tmp_path, root, name):
    """A daemon serving gRPC on a loopback port (what its peers dial):
    (Daemon, its address)."""
    addr = "127.0.0.1:%d" % free_port()
    return Daemon(model_root=str(root), workdir=str(tmp_path / name),
                  extra_args=["--listen", addr] + _fleet_args(tmp_path)), addr


def _loader(tmp_path, root, peers, *extra):
    """Daemon "c", whose peers are the addresses `peers`."""
    return Daemon(model_root=str(root), workdir=str(tmp_path / "c"),
                  extra_args=["--peers", ",".join(peers), *_fleet_args(tmp_path, listens=False),
                              *extra])


@contextlib.contextmanager
def _running(*daemons):
    """Starts the daemons in order; stops every one started, the last first."""
    started = []
    try:
        for d in daemons:
            d.start()
            started.append(d)
        yield
    finally:
        for d in reversed(started):
            d.stop()


@pytest.fixture
def checkpoint(tmp_path):
    models = tmp_path / "models"
    path, tensors = _write_checkpoint(models, seed=5)
    return models, path, tensors


def test_storage_is_read_once_per_fleet(tmp_path, checkpoint):
    models, path, tensors = checkpoint
    size = sum(os.path.getsize(path / f) for f in os.listdir(path))
    metrics_ports = [free_port() for _ in range(4)]
    addrs, ds = _daemons(tmp_path, models, 4, _all_others)
    for d, port in zip(ds, metrics_ports):
        d.extra_args += ["--metrics-listen", "127.0.0.1:%d" % port]
    with _running(*ds):
        a, b, c, d4 = ds
        # a: storage (nobody holds it yet; auto would say so and read).
        _drop_cache(path)
        info, last, read = _load(a, "m", path)
        assert last.done and last.bytes_from_peers == 0 and last.peers == ()
        kernel = _kernel_counts_reads(path)
        assert read >= 0.9 * size or not kernel, (read, size)
        with weightd.Client(socket=a.socket) as cl:
            assert cl.stats()["load_bytes_storage"] >= 0.99 * size - (1 << 20)
        want = _check_bytes(a, "m", tensors)
        assert info.weights_id == want
        # b, c, d: from peers; storage gives headers and samples only.
        holders = [addrs[0]]
        for i, node in [(1, b), (2, c), (3, d4)]:
            _drop_cache(path)
            info, last, read = _load(node, "m", path)
            assert last.done and last.bytes_from_peers == last.bytes_total > 0, last
            assert last.bytes_from_storage == 0
            assert set(last.peers) <= set(holders), (last.peers, holders)
            assert len(last.peer_transports) == len(last.peers), last
            assert set(last.peer_transports) == {"grpc"}, last
            assert read < size / 6, "daemon %d read %d bytes from storage" % (i, read)
            with weightd.Client(socket=node.socket) as cl:
                s = cl.stats()
            assert s["load_bytes_peers"] == last.bytes_from_peers
            # Its own storage counter (the samples) agrees with the kernel's
            # (which also saw the headers and readahead).
            assert s["load_bytes_storage"] < size / 6
            if kernel:
                assert s["load_bytes_storage"] <= read + (1 << 20), (s["load_bytes_storage"], read)
            assert sum(t["bytes"] for t in s["peer_transfers"].values()) == last.bytes_from_peers
            assert info.weights_id == want
            assert _check_bytes(node, "m", tensors) == want
            holders.append(addrs[i])
        # With several holders the ranges are spread over them.
        with weightd.Client(socket=d4.socket) as cl:
            spread = cl.stats()["peer_transfers"]
        assert set(spread) == set(addrs[:3]) and all(t["bytes"] > 0 for t in spread.values())
        # The holders counted what they sent; the metric says where bytes came from.
        sent = 0
        for node in ds:
            with weightd.Client(socket=node.socket) as cl:
                sent += cl.stats()["bytes_sent_to_peers"]
        assert sent >= 3 * (size - (1 << 20))
        assert "load_sources" in d4.log()
        # So do weightctl stats and the metrics.
        out = d4.ctl_ok("stats").stdout
        assert "load_bytes_peers: %d" % last.bytes_from_peers in out
        for a_ in addrs[:3]:
            assert "peer_transfer: %s\tbytes=%d\tfailures=0" % (a_, spread[a_]["bytes"]) in out
        metrics = scrape_metrics(metrics_ports[3])
        assert metrics['weightd_load_source_bytes_total{source="peers"}'] == \
            last.bytes_from_peers, metrics
        for a_ in addrs[:3]:
            assert metrics['weightd_peer_received_bytes_total{peer="%s"}' % a_] == \
                spread[a_]["bytes"]
            assert metrics['weightd_peer_failures_total{peer="%s"}' % a_] == 0
        # weightctl says where the bytes came from (a load of files already
        # resident shares them: d unloads first); storage on request.
        d4.ctl_ok("unload", "m")
        out = d4.ctl_ok("load", "m", str(path), "--source", "peers").stdout
        assert "from peers " in out
        # ... and what carried them (these daemons have no UCX: gRPC).
        used = re.search(r"^peer transports: (.*)$", out, re.M)
        assert used and all(p.endswith("=grpc") for p in used.group(1).split()), out
        _drop_cache(path)
        before = _read_bytes(b.proc.pid)
        b.ctl_ok("load", "fresh", str(path / "model-00001-of-00002.safetensors"),
                 "--source", "storage")
        assert _read_bytes(b.proc.pid) - before >= 0.4 * size or not kernel


def test_source_peers_without_a_holder_is_unavailable(tmp_path, checkpoint):
    models, path, _ = checkpoint
    addrs, (a, b) = _daemons(tmp_path, models, 2, _all_others)
    with _running(a, b):
        r = a.ctl("load", "m", str(path), "--source", "peers")
        assert r.returncode != 0 and r.error_code == "UNAVAILABLE", r.stderr
        assert "no peer holds the files" in r.error_message
        with weightd.Client(socket=a.socket) as c:
            assert c.stats()["bytes_resident"] == 0 and c.list() == []
    with Daemon(model_root=str(models)) as alone:
        r = alone.ctl("load", "m", str(path), "--source", "peers")
        assert r.error_code == "FAILED_PRECONDITION" and "no peers" in r.error_message
        r = alone.ctl("adapter", "load", "a", str(path), "--source", "peers")
        assert r.error_code == "FAILED_PRECONDITION" and "no peers" in r.error_message
        r = alone.ctl("load", "m", str(path), "--source", "nearby")
        assert r.returncode != 0 and "auto, storage or peers" in r.stderr


def test_holder_killed_mid_transfer(tmp_path, checkpoint):
    """c loads from a and b; a is SIGKILLed as the third of its ranges is
    asked for (by a proxy in front of it, so the kill lands mid-transfer on
    a machine of any speed): c finishes from b, with the right bytes."""
    models, path, tensors = checkpoint
    a, a_addr = _holder(tmp_path, models, "a")
    b, b_addr = _holder(tmp_path, models, "b")
    with _running(a, b), _Proxy(a_addr, "kill", victim=a.proc) as proxy:
        c = _loader(tmp_path, models, [proxy.address, b_addr],
                    "--read-chunk-bytes", str(CHUNK), "--peer-streams", "1")
        with _running(c):
            a.ctl_ok("load", "m", str(path))
            b.ctl_ok("load", "m", str(path))
            info, last, _ = _load(c, "m", path)
            assert a.proc.poll() is not None, "a was not killed: the proxy got under 3 ranges"
            with weightd.Client(socket=c.socket) as cl:
                s = cl.stats()
            assert s["peer_transfers"][proxy.address]["failures"] >= 1, s["peer_transfers"]
            assert s["peer_transfers"][proxy.address]["bytes"] >= 2 * CHUNK  # before the kill
            assert s["peer_transfers"][b_addr]["bytes"] > 0
            assert last.bytes_from_storage == 0 and b_addr in last.peers
            assert "peer_read_failed" in c.log()
            _check_bytes(c, "m", tensors)


class _Proxy(pp.HolderProxy):
    """A peer in front of a real daemon (peer_protocol.HolderProxy) that
    forwards ReadCheckpoint with a bit flipped ("flip"), never answering it
    ("stall"), or SIGKILLing the daemon (`victim`, a Popen) as the third
    range is asked for and forwarding what that leaves ("kill")."""

    def __init__(self, upstream, mode, victim=None):
        self.mode = mode
        self.victim = victim
        self.reads = 0
        self.lock = threading.Lock()
        self.stop_stalling = threading.Event()
        super().__init__(upstream, FLEET_AUTH, workers=8)

    def handlers(self):
        return {"ReadCheckpoint": self.grpc.unary_stream_rpc_method_handler(
            self._read, request_deserializer=pb.ReadCheckpointRequest.FromString,
            response_serializer=pb.ReadChunk.SerializeToString)}

    def _read(self, req, ctx):
        if self.mode == "stall":
            self.stop_stalling.wait(120)
            return
        with self.lock:
            self.reads += 1
            if self.mode == "kill" and self.reads == 3:
                self.victim.send_signal(signal.SIGKILL)
                self.victim.wait()
        try:
            for chunk in self.stub.ReadCheckpoint(req, metadata=FLEET_AUTH):
                if chunk.data and self.mode == "flip":
                    data = bytearray(chunk.data)
                    data[len(data) // 2] ^= 0x10
                    chunk = pb.ReadChunk(offset=chunk.offset, data=bytes(data))
                yield chunk
        except grpc.RpcError as e:
            ctx.abort(e.code(), e.details())

    def close(self):
        self.stop_stalling.set()
        super().close()


@pytest.mark.parametrize("mode", ["flip", "stall"])
def test_a_lying_or_stalling_peer_is_dropped(tmp_path, checkpoint, mode):
    models, path, tensors = checkpoint
    a, a_addr = _holder(tmp_path, models, "a")
    metrics_port = free_port()
    with _running(a), _Proxy(a_addr, mode) as proxy:
        c = _loader(tmp_path, models, [proxy.address], "--read-chunk-bytes", str(CHUNK),
                    "--peer-poll-seconds", "1", "--metrics-listen", "127.0.0.1:%d" % metrics_port)
        with _running(c):
            a.ctl_ok("load", "m", str(path))
            start = time.monotonic()
            info, last, _ = _load(c, "m", path)
            took = time.monotonic() - start
            _check_bytes(c, "m", tensors)
            log = c.log()
            if mode == "flip":
                assert "peer_data_loss" in log and "DATA_LOSS" in log, log[-3000:]
            else:
                # The range's deadline: 2 x 3 s + 1 MiB at 32 MiB/s.
                assert "peer_read_failed" in log and "DEADLINE_EXCEEDED" in log, log[-3000:]
                assert took < 30, took
            assert last.bytes_from_storage >= 0.9 * sum(
                t.numel() * t.element_size() for t in tensors.values())
            with weightd.Client(socket=c.socket) as cl:
                stats = cl.stats()
            assert stats["peer_transfers"][proxy.address]["failures"] >= 1
            # Only the bytes the load kept count as the peer's; what it sent
            # and the load threw away is counted apart.
            assert stats["load_bytes_peers"] == last.bytes_from_peers, (stats, last)
            assert stats["peer_transfers"][proxy.address]["bytes"] == last.bytes_from_peers
            discarded = scrape_metrics(metrics_port)["weightd_peer_discarded_bytes_total"]
            if mode == "flip":
                assert discarded >= CHUNK, discarded
            # --source peers: the only holder fails, so the load fails and
            # leaves nothing behind (m unloaded first: files resident are shared).
            c.ctl_ok("unload", "m")
            r = c.ctl("load", "m2", str(path), "--source", "peers")
            assert r.returncode != 0 and r.error_code in ("UNAVAILABLE", "DATA_LOSS"), r.stderr
            with weightd.Client(socket=c.socket) as cl:
                assert cl.list() == []


def test_a_peer_with_other_bytes_under_the_same_header_is_not_used(tmp_path, checkpoint):
    """e holds a copy with the same names, sizes and headers and other
    bytes: its bytes at c's samples are not c's, so it offers no copy (the
    same NOT_FOUND as holding nothing) and c reads storage."""
    models, path, tensors = checkpoint
    other_root = tmp_path / "other"
    _, other = _write_checkpoint(other_root, seed=6)
    for f in os.listdir(path):
        assert os.path.getsize(path / f) == os.path.getsize(other_root / "model" / f)
    e, e_addr = _holder(tmp_path, other_root, "e")
    c = _loader(tmp_path, models, [e_addr])
    with _running(e, c):
        e.ctl_ok("load", "m", str(other_root / "model"))
        info, last, _ = _load(c, "m", path)
        assert last.bytes_from_peers == 0
        assert 'reason="no peer holds the files"' in c.log()
        _check_bytes(c, "m", tensors)
        c.ctl_ok("unload", "m")
        r = c.ctl("load", "m2", str(path), "--source", "peers")
        assert r.error_code == "UNAVAILABLE" and "no peer holds" in r.error_message, r.stderr


def test_a_peer_that_never_answers_does_not_hang_the_load(tmp_path, checkpoint):
    models, path, tensors = checkpoint
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)  # accepts (the kernel does), never answers
    addr = "127.0.0.1:%d" % hung.getsockname()[1]
    c = _loader(tmp_path, models, [addr])
    with hung, _running(c):
        start = time.monotonic()
        _load(c, "m", path)
        assert time.monotonic() - start < 20
        _check_bytes(c, "m", tensors)
        c.ctl_ok("unload", "m")
        start = time.monotonic()
        r = c.ctl("load", "m2", str(path), "--source", "peers")
        assert r.error_code == "UNAVAILABLE"
        assert time.monotonic() - start < 20


def test_a_holder_whose_file_changed_since_does_not_offer_it(tmp_path, checkpoint):
    """A file rewritten in place on shared storage with the same names,
    sizes and header (one small tensor changed: the samples would likely
    miss it): the holder's copy is stale, so it no longer offers it, and
    the new bytes come from storage."""
    models, path, tensors = checkpoint
    a, a_addr = _holder(tmp_path, models, "a")
    c = _loader(tmp_path, models, [a_addr])
    with _running(a, c):
        a.ctl_ok("load", "m", str(path))
        shard = path / "model-00002-of-00002.safetensors"
        raw = st_io.load_raw(str(shard))
        changed = dict(tensors)
        changed["layers.1.norm"] = -tensors["layers.1.norm"]
        st_io.save({k: changed[k] for k in raw}, str(shard))
        info, last, _ = _load(c, "m", path)
        assert last.bytes_from_peers == 0, last
        _check_bytes(c, "m", changed)


def test_adapters_replicate_like_checkpoints(tmp_path, checkpoint):
    """b takes a PEFT adapter's file from a (--source peers; a keeps the
    file's bytes resident for its peers); applied on both, the generations
    have the same weights_id and bytes."""
    models, path, tensors = checkpoint
    g = torch.Generator().manual_seed(9)
    ad = models / "adapter"
    ad.mkdir()
    factors = {}
    for m in ("layers.0.0", "layers.1.0"):
        factors["base_model.model.%s.lora_A.weight" % m] = torch.randn(256, 512, generator=g)
        factors["base_model.model.%s.lora_B.weight" % m] = torch.randn(1024, 256, generator=g)
    import json
    (ad / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 256, "lora_alpha": 16, "target_modules": ["0"]}))
    st_io.save(factors, str(ad / "adapter_model.safetensors"))
    data = sum(t.numel() * 4 for t in factors.values())
    addrs, (a, b) = _daemons(tmp_path, models, 2, _all_others)
    with _running(a, b):
        r = b.ctl("adapter", "load", "lora", str(ad), "--source", "peers")
        assert r.error_code == "UNAVAILABLE" and "no peer holds the files" in r.error_message
        for d in (a, b):
            d.ctl_ok("load", "m", str(path))
        a.ctl_ok("adapter", "load", "lora", str(ad), "--source", "storage")
        with weightd.Client(socket=b.socket) as cb:
            before = cb.stats()
            cb.load_adapter("lora", str(ad), source="peers")
            after = cb.stats()
        assert after["load_bytes_peers"] - before["load_bytes_peers"] == data
        assert after["load_bytes_storage"] - before["load_bytes_storage"] < data / 2
        ids, got = [], []
        for d in (a, b):
            with weightd.Client(socket=d.socket) as c:
                c.apply("m", ["lora"])
                with c.fetch("m", world=1, rank=0, names=["layers.0.0.weight"]) as h:
                    ids.append(h.weights_id)
                    got.append(h.state_dict()["layers.0.0.weight"].clone())
        assert ids[0] == ids[1] and ids[0]
        assert torch.equal(got[0], got[1])
        assert not torch.equal(got[0], tensors["layers.0.0.weight"]), "the patch applied"
        # A daemon without peers reads the adapter through its fd: the same.
        with Daemon(model_root=str(models), workdir=str(tmp_path / "plain")) as plain, \
                weightd.Client(socket=plain.socket) as c:
            c.load("m", str(path))
            c.load_adapter("lora", str(ad))
            c.apply("m", ["lora"])
            with c.fetch("m", world=1, rank=0, names=["layers.0.0.weight"]) as h:
                assert h.weights_id == ids[0]
                assert torch.equal(h.state_dict()["layers.0.0.weight"], got[0])


def test_a_holder_of_sibling_checkpoints_offers_the_one_asked_for(tmp_path, checkpoint):
    """Two training steps saved with the same names, sizes and headers
    share a checkpoint key. a holds both (step 2 loaded last); c loading
    either gets its bytes from a: a answers with the copy whose samples
    match c's storage."""
    models, step1, tensors1 = checkpoint
    step2, tensors2 = _write_checkpoint(models / "step2", seed=7)
    a, a_addr = _holder(tmp_path, models, "a")
    c = _loader(tmp_path, models, [a_addr])
    with _running(a, c):
        a.ctl_ok("load", "s1", str(step1))
        a.ctl_ok("load", "s2", str(step2))
        for name, path, tensors in (("m1", step1, tensors1), ("m2", step2, tensors2)):
            info, last, _ = _load(c, name, path, source="peers")
            assert last.bytes_from_peers == last.bytes_total > 0, last
            _check_bytes(c, name, tensors)


def test_a_checkpoint_sharing_tensors_is_not_offered_to_peers(tmp_path):
    """A holder's checkpoint whose tensors share another model's bytes
    (per-tensor dedupe at load, test_shared_checkpoints.py) is not laid out
    by file, so the holder does not offer its files' ranges: a peer loads
    them from storage (or is told no peer holds them) and gets the files'
    bytes, while the holder's other checkpoint still comes from it."""
    models = tmp_path / "models"
    models.mkdir()
    g = torch.Generator().manual_seed(3)
    base = {"w%d" % i: torch.randn(256, 1024, generator=g).to(torch.bfloat16) for i in range(8)}
    ft = dict(base, w7=torch.randn(256, 1024, generator=g).to(torch.bfloat16))
    st_io.save(base, str(models / "base.safetensors"))
    st_io.save(ft, str(models / "ft.safetensors"))
    a, a_addr = _holder(tmp_path, models, "a")
    c = _loader(tmp_path, models, [a_addr])
    with _running(a, c):
        a.ctl_ok("load", "base", str(models / "base.safetensors"))
        a.ctl_ok("load", "ft", str(models / "ft.safetensors"))
        assert "load_tensors_shared" in a.log(), a.log()
        r = c.ctl("load", "ft", str(models / "ft.safetensors"), "--source", "peers")
        assert r.returncode != 0 and r.error_code == "UNAVAILABLE", r.stderr
        _, last, _ = _load(c, "ft", models / "ft.safetensors")
        assert last.bytes_from_peers == 0, last
        _check_bytes(c, "ft", ft)
        _, last, _ = _load(c, "base", models / "base.safetensors", source="peers")
        assert last.bytes_from_peers > 0, last
        _check_bytes(c, "base", base)


def _one_file_checkpoint(root, seed=21):
    """One 16 MiB file: 15 tensors of 1 MiB, a BF16 norm of 666 bytes, two
    small ones; returns its path and {name: tensor}."""
    g = torch.Generator().manual_seed(seed)
    tensors = {"w%02d" % i: torch.randn(512, 512, generator=g) for i in range(15)}
    tensors["norm"] = torch.randn(333, generator=g).to(torch.bfloat16)
    tensors["bias"] = torch.randn(7, generator=g)
    tensors["scale"] = torch.randn(3, generator=g)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "one.safetensors"
    st_io.save(tensors, str(path))
    return path, tensors


class _LyingPeer(pp.HolderProxy):
    """A peer that lies (docs/DESIGN.md §8.4): a real holder's control plane
    (peer_protocol.HolderProxy), so what it says about the question's
    samples is true. Then it sends other bytes and reports their digests:
    everywhere the samples are not ("outside"), or in the smallest tensor
    no sample touches ("one_tensor"). `lied` counts the bytes it changed."""

    def __init__(self, upstream, path, mode):
        self.file = pp.StFile(str(path))
        self.mode = mode
        self.lie = None
        self.lied = 0
        super().__init__(upstream, FLEET_AUTH, workers=8)

    def handlers(self):
        return {"ReadCheckpoint": self.grpc.unary_stream_rpc_method_handler(
            self._read, request_deserializer=pb.ReadCheckpointRequest.FromString,
            response_serializer=pb.ReadChunk.SerializeToString)}

    def on_find(self, req, resp):
        data = np.frombuffer(self.file.data, dtype=np.uint8).copy()
        sampled = np.zeros(len(data), dtype=bool)
        for r in req.samples:
            sampled[r.offset:r.offset + r.length] = True
        if self.mode == "outside":
            lie = ~sampled
        else:
            lie = np.zeros(len(data), dtype=bool)
            untouched = [(e - b, b, e) for _, b, e in self.file.tensors
                         if e > b and not sampled[b:e].any()]
            _, b, e = min(untouched)
            lie[b:e] = True
        data[lie] ^= 0x5A
        self.lied = int(lie.sum())
        self.lie = data.tobytes()
        resp.tensor_digests[0] = self.file.tensor_digests(self.lie)
        return resp

    def _read(self, req, ctx):
        r = req.range
        for at in range(0, r.length, 1 << 20):
            n = min(1 << 20, r.length - at)
            yield pb.ReadChunk(offset=at, data=self.lie[r.offset + at:r.offset + at + n])


def test_a_peer_lying_where_the_samples_are_not_is_caught_by_storage(tmp_path):
    """The default (--peer-verify samples): the peer answers the samples it
    is shown truthfully and sends other bytes everywhere else, with their
    digests. The loader compares what it sent with storage's bytes at
    places it was never told, so the lie is caught, the peer dropped, and
    the files' bytes served; nothing it sent counts as kept."""
    models = tmp_path / "models"
    path, tensors = _one_file_checkpoint(models)
    a, a_addr = _holder(tmp_path, models, "a")
    with _running(a):
        a.ctl_ok("load", "m", str(path))
        with _LyingPeer(a_addr, path, "outside") as liar:
            c = _loader(tmp_path, models, [liar.address], "--read-chunk-bytes", str(CHUNK))
            with _running(c):
                info, last, _ = _load(c, "m", path)
                assert liar.lied > len(liar.file.data) // 2, liar.lied
                _check_bytes(c, "m", tensors)
                assert "peer_data_loss" in c.log() and "compared with storage" in c.log()
                assert last.bytes_from_peers == 0, last
                with weightd.Client(socket=c.socket) as cl:
                    s = cl.stats()
                assert s["load_bytes_peers"] == 0
                assert s["peer_transfers"][liar.address]["failures"] >= 1
                # verify says what it checks: the bytes against the digests
                # made when they were loaded, not storage.
                out = c.ctl_ok("verify", "m").stdout
                assert "recorded at load" in out and "storage" in out, out


def test_peer_verify_all_refuses_a_lie_in_one_small_tensor(tmp_path):
    """A lie in the smallest tensor no sample touches (a few bytes): 8
    secret pieces per file find it only by chance; --peer-verify all
    compares every byte the peer sent with storage's and refuses it, load
    after load."""
    models = tmp_path / "models"
    path, tensors = _one_file_checkpoint(models)
    a, a_addr = _holder(tmp_path, models, "a")
    with _running(a):
        a.ctl_ok("load", "m", str(path))
        with _LyingPeer(a_addr, path, "one_tensor") as liar:
            c = _loader(tmp_path, models, [liar.address], "--read-chunk-bytes", str(CHUNK),
                        "--peer-verify", "all")
            with _running(c):
                for i in range(3):
                    info, last, _ = _load(c, "m%d" % i, path)
                    assert 0 < liar.lied < 4096, liar.lied
                    _check_bytes(c, "m%d" % i, tensors)
                    c.ctl_ok("unload", "m%d" % i)  # the next load reads again
                assert c.log().count("peer_data_loss") >= 3
                # --source peers: the only holder lies, so nothing is loaded.
                r = c.ctl("load", "p", str(path), "--source", "peers")
                assert r.returncode != 0 and r.error_code in ("UNAVAILABLE", "DATA_LOSS"), r.stderr


def _vm(pid, key):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(key)


def test_an_oversized_answer_is_refused_without_taking_the_loaders_memory(tmp_path):
    """A peer answering FindCheckpoint for a one-tensor file with 128 MiB of
    digests (and, separately, with 1 MiB: more than the file's one tensor
    needs): the loader refuses both answers within its peer receive budget
    (32 MiB + --peer-streams x (--read-chunk-bytes + 8 MiB): 68 MiB with
    four streams of 1 MiB ranges), says why in its log, and loads from
    storage."""
    models = tmp_path / "models"
    models.mkdir()
    st_io.save({"w": torch.arange(1024, dtype=torch.float32)}, str(models / "m.safetensors"))
    size = {"n": 128 << 20}
    cache = {}

    def find(req, ctx):
        # Serialized once per size (the peer's cost, not the loader's).
        if size["n"] not in cache:
            cache[size["n"]] = pb.FindCheckpointResponse(
                copy=b"\0" * 16, tensor_digests=[b"\1" * size["n"]]).SerializeToString()
        return cache[size["n"]] + pb.FindCheckpointResponse(
            sample_digests=list(req.sample_digests)).SerializeToString()

    server = grpc.server(futures.ThreadPoolExecutor(4),
                         options=[("grpc.max_send_message_length", -1)])
    handlers = {
        "List": grpc.unary_unary_rpc_method_handler(
            lambda req, ctx: pb.ListModelsResponse(),
            request_deserializer=pb.ListModelsRequest.FromString,
            response_serializer=pb.ListModelsResponse.SerializeToString),
        "FindCheckpoint": grpc.unary_unary_rpc_method_handler(
            find, request_deserializer=pb.FindCheckpointRequest.FromString,
            response_serializer=lambda raw: raw),
    }
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("weightd.v1.Models", handlers)])
    addr = "127.0.0.1:%d" % server.add_insecure_port("127.0.0.1:0")
    server.start()
    find(pb.FindCheckpointRequest(), None)  # built before the loader asks
    try:
        c = _loader(tmp_path, models, [addr], "--host-memory-bytes", str(64 << 20),
                    "--read-chunk-bytes", str(1 << 20), "--peer-streams", "4")
        with _running(c):
            before = _vm(c.proc.pid, "VmHWM")
            _load(c, "m", models / "m.safetensors")
            peak = _vm(c.proc.pid, "VmHWM")
            # The answer was refused within the receive budget (68 MiB),
            # not read whole and parsed (over 300 MiB before).
            assert peak - before < 128 << 20, (before, peak)
            log = c.log()
            assert "peer_find_failed" in log and "RESOURCE_EXHAUSTED" in log, log[-2000:]
            assert "a true answer takes at most" in log
            _check_bytes(c, "m", {"w": torch.arange(1024, dtype=torch.float32)})
            # An answer that fits the budget but not the question.
            size["n"] = 1 << 20
            find(pb.FindCheckpointRequest(), None)
            c.ctl_ok("unload", "m")
            _load(c, "m", models / "m.safetensors")
            assert "bytes of digests for file 0, which has 1 tensors" in c.log()
            _check_bytes(c, "m", {"w": torch.arange(1024, dtype=torch.float32)})
    finally:
        server.stop(0)




def test_ranges_in_flight_fit_the_peer_receive_budget(tmp_path):
    """A holder and a loader on two nodes (tests/netsim.py: their own
    network namespaces and link), ranges of 64 MiB (--read-chunk-bytes,
    64 MiB tensors), four at once (--peer-streams 4): the loader's peer
    receive budget has room for every range in flight whole. gRPC buffers
    what the reader has not taken yet and, past the budget, cancels a
    stream "Buffers full": the budget sized for 8 MiB a stream (64 MiB here)
    dropped the holder and the loads failed UNAVAILABLE (and, between two
    nodes, about half the 1 GiB loads at the default 16 MiB ranges)."""
    import netsim
    netsim.require()
    models = tmp_path / "models"
    models.mkdir()
    g = torch.Generator().manual_seed(17)
    tensors = {"w.%d" % i: torch.randn(4096, 4096, generator=g) for i in range(4)}
    path = models / "m.safetensors"
    st_io.save(tensors, str(path))
    with netsim.Net(nodes=2, storage=False) as net:
        addr = "%s:%d" % (net.nodes[0].addr, free_port())
        a = Daemon(model_root=str(models), workdir=str(tmp_path / "a"), prefix=net.nodes[0].prefix,
                   extra_args=["--listen", addr, "--allow-insecure-token"] + _fleet_args(tmp_path))
        c = Daemon(model_root=str(models), workdir=str(tmp_path / "c"), prefix=net.nodes[1].prefix,
                   extra_args=["--peers", addr, *_fleet_args(tmp_path, listens=False),
                               "--read-chunk-bytes", str(64 << 20), "--peer-streams", "4",
                               "--huge-pages", "off"])
        with _running(a, c):
            a.ctl_ok("load", "m", str(path))
            for _ in range(4):
                _, last, _ = _load(c, "m", path, source="peers")
                assert last.bytes_from_storage == 0 and list(last.peers) == [addr], last
                c.ctl_ok("unload", "m")
            assert "Buffers full" not in c.log()
            _load(c, "m", path, source="peers")
            _check_bytes(c, "m", tensors)

"""The daemon's GPU side on a machine without a GPU: a real daemon loads the
tests' fake CUDA plugin (server/gpu/fake_cuda_plugin.cc, through
WEIGHTD_CUDA_PLUGIN like the real one) that stands in for GPUs of chosen
kinds, and these tests drive it as clients do.

* Pinning (server/gpu/host_pinner.h) on an x86 H100 (read-only host
  registration unsupported): checkpoint and published segments are
  registered through the daemon's own mapping, kept writable through the
  seal; stats pinned_bytes and the "pinned" event (method=writable) say so;
  every way a client could write to a pinned segment is still refused
  (writable map, write, ftruncate, hole punch, a reopened fd, mprotect) and
  the bytes stay the checkpoint's; what was published in place by a client
  (sealed exclusively) cannot be pinned there and the event counts it;
  unregistration comes before the memory is unmapped.
* On a GH200 (both supported): the read-only registration of the read-only
  mapping, and nothing else; with an H100 beside it, the writable one.
* Sticky CUDA errors (server/gpu/gpu_health.h): an illegal address during a
  push marks that GPU unavailable (stats, `weightctl gpus`, `weightctl
  health`), later pushes and exports to it are refused FAILED_PRECONDITION
  naming it and the first error, while the other GPU, shm fetches and host
  pushes keep working.
"""
import ctypes
import fcntl
import json
import mmap
import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import BUILD, Daemon  # noqa: E402
import st_io  # noqa: E402

import weightd  # noqa: E402  (build/python, put on sys.path by harness)
from weightd import _cuda, _datasock  # noqa: E402
from weightd.v1 import weightd_pb2 as pb  # noqa: E402

FAKE_PLUGIN = os.path.join(BUILD, "tests", "libweightd_fake_cuda_plugin.so")
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
F_SEAL_FUTURE_WRITE = 0x0010
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _uuid(i):
    return "GPU-fa4e0000-0000-0000-0000-0000000000%02x" % i


def _uuid_bytes(i):
    return bytes([0xFA, 0x4E] + [0] * 13 + [i])


@pytest.fixture(scope="module", autouse=True)
def _need_fake_plugin():
    if not os.path.exists(FAKE_PLUGIN):
        pytest.skip("no %s (a build without CUDA has no plugin seam)" % FAKE_PLUGIN)


def _checkpoint():
    g = torch.Generator().manual_seed(5)
    # Two files in segments of at most 2 MiB: the first (2.25 MB) gets its own.
    return ({"a.w": torch.randn(1100, 512, generator=g), "a.b": torch.randn(77, generator=g)},
            {"b.w": torch.randn(400, 256, generator=g).to(torch.bfloat16),
             "b.ids": torch.arange(1000, dtype=torch.int64)})


class FakeGpuDaemon:
    """A daemon whose CUDA plugin is the fake one, with GPUs of `kinds`."""

    def __init__(self, tmp_path, kinds, extra_args=()):
        self.ctl_dir = str(tmp_path / "fakecuda")
        os.makedirs(self.ctl_dir)
        self.d = Daemon(workdir=str(tmp_path / "d"),
                        extra_args=["--log-format", "json", "--checkpoint-segment-bytes",
                                    str(2 << 20)] + list(extra_args))
        env = {"WEIGHTD_CUDA_PLUGIN": FAKE_PLUGIN, "WEIGHTD_FAKE_GPUS": kinds,
               "WEIGHTD_FAKE_CUDA_DIR": self.ctl_dir}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            self.d.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v
        self.client = weightd.Client(socket=self.d.socket, retry_deadline=0)
        first, second = _checkpoint()
        st_io.save(first, os.path.join(self.d.model_root, "m-1.safetensors"))
        st_io.save(second, os.path.join(self.d.model_root, "m-2.safetensors"))
        self.reference = dict(first, **second)

    def close(self):
        self.client.close()
        self.d.stop()

    def load(self, name="m"):
        self.d.ctl_ok("load", name, self.d.model_root)

    def events(self, name):
        out = []
        for line in self.d.log().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event") == name:
                out.append(e)
        return out

    def calls(self, kind=None):
        try:
            with open(os.path.join(self.ctl_dir, "calls.log")) as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return []
        return [l for l in lines if kind is None or l.split(" ", 1)[0] == kind]

    def stats(self):
        return self.client.stats()

    def daemon_map_perms(self, purpose):
        """The permissions of the daemon's mappings of its weightd:<purpose>
        memfds, as /proc/<pid>/maps shows them."""
        perms = set()
        with open("/proc/%d/maps" % self.d.proc.pid) as f:
            for line in f:
                if "/memfd:weightd:%s " % purpose in line + " ":
                    perms.add(line.split()[1])
        return perms


@pytest.fixture
def h100(tmp_path):
    d = FakeGpuDaemon(tmp_path, "h100")
    yield d
    d.close()


def _fields(line):
    return dict(kv.split("=", 1) for kv in line.split(" ")[1:] if "=" in kv)


def _segments(client, model="m"):
    """An unsharded shm fetch: the checkpoint's own segments (fds) and the
    response."""
    resp = client._shards.Fetch(pb.FetchRequest(model=model, transport=pb.SHM), timeout=30)
    sock, fds = _datasock.attach(resp.data_socket, resp.lease_id, bytes(resp.token),
                                 len(resp.segment_sizes))
    return resp, sock, fds


def _assert_no_client_can_write(fd, size):
    """Every way a holder of the segment's fd could change its bytes fails."""
    with pytest.raises(OSError):
        mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    with pytest.raises(OSError):
        os.pwrite(fd, b"x", 0)
    for to in (size // 2, size + 4096):
        with pytest.raises(OSError):
            os.ftruncate(fd, to)
    assert _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096) != 0
    rw = os.open("/proc/self/fd/%d" % fd, os.O_RDWR)
    try:
        with pytest.raises(OSError):
            os.pwrite(rw, b"x", 0)
    finally:
        os.close(rw)
    # A read-only shared mapping cannot be made writable.
    addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    try:
        assert _libc.mprotect(addr, size, mmap.PROT_READ | mmap.PROT_WRITE) != 0
    finally:
        _libc.munmap(addr, size)


def _assert_bytes_are_the_checkpoints(d, resp, fds):
    for t in resp.tensors:
        got = os.pread(fds[t.segment], t.length, t.offset)
        assert got == st_io.tensor_bytes(d.reference[t.name]), t.name


def test_x86_h100_pins_through_the_writable_mapping_and_no_client_can_write(h100):
    d = h100
    assert d.d.ctl_ok("gpus").stdout.count("gpu:\t") == 1
    assert "host-register-read-only" not in d.d.ctl_ok("gpus").stdout
    d.load()
    resp, sock, fds = _segments(d.client)
    try:
        total = sum(resp.segment_sizes)
        assert len(fds) >= 2, resp.segment_sizes
        # Pinned: every checkpoint segment, through the daemon's mapping
        # that the seal kept writable, without the read-only flag.
        assert d.stats()["pinned_bytes"] == total
        [ev] = [e for e in d.events("pinned") if e["what"] == "checkpoint"]
        assert ev["method"] == "writable" and ev["model"] == "m", ev
        assert int(ev["bytes"]) == total and int(ev["segments"]) == len(fds), ev
        assert ev["not_pinnable"] == "0" and ev["error"] == "", ev
        pins = [_fields(l) for l in d.calls("pin")]
        assert len(pins) == len(fds), d.calls()
        assert all(l.endswith(" ok") for l in d.calls("pin")), d.calls()
        for p in pins:
            assert p["read_only"] == "0" and p["device"] == "0" and p["perms"] == "rw-s", p
        assert sum(int(p["size"]) for p in pins) == total
        assert d.daemon_map_perms("checkpoint") == {"rw-s"}
        # No client can change a pinned segment, by any route.
        for fd, size in zip(fds, resp.segment_sizes):
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            want = (F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK |
                    fcntl.F_SEAL_GROW)
            assert seals & want == want, hex(seals)
            _assert_no_client_can_write(fd, size)
        _assert_bytes_are_the_checkpoints(d, resp, fds)
    finally:
        sock.close()
        for fd in fds:
            os.close(fd)
    # The fetches and pushes clients make read the checkpoint's bytes.
    with d.client.fetch("m") as h:
        for name, ref in d.reference.items():
            assert torch.equal(h[name], ref), name
    assert d.client.health() is True and d.d.alive()


def test_published_segments_are_pinned_and_unpinned_before_they_are_unmapped(h100):
    d = h100
    d.load()
    before = d.stats()["pinned_bytes"]
    new = {"a.w": torch.full((1100, 512), 0.25), "a.b": torch.full((77,), -1.5)}
    # Sent over gRPC: the daemon wrote the staging segment itself, sealed
    # keeping its mapping: pinned like the checkpoint's.
    d.client.publish("m", new, transport="grpc")
    [ev] = [e for e in d.events("pinned") if e["what"] == "publish"]
    assert ev["method"] == "writable" and int(ev["segments"]) == 1, ev
    assert ev["not_pinnable"] == "0", ev
    assert d.stats()["pinned_bytes"] == before + int(ev["bytes"]) > before
    # Written in place by the client (shm): sealed exclusively, no writable
    # mapping to register where read-only registration is unsupported; the
    # event counts it, and it is served all the same.
    newer = {"a.w": torch.full((1100, 512), 0.5), "a.b": torch.full((77,), 2.5)}
    d.client.publish("m", newer, transport="shm")
    evs = [e for e in d.events("pinned") if e["what"] == "publish"]
    assert len(evs) == 2 and evs[1]["not_pinnable"] == "1" and evs[1]["segments"] == "0", evs
    assert "hand-over" in evs[1]["note"], evs[1]
    with d.client.fetch("m") as h:
        assert torch.equal(h["a.w"], newer["a.w"]) and torch.equal(h["a.b"], newer["a.b"])
        assert torch.equal(h["b.w"], d.reference["b.w"])
    # Unloaded: every registration is undone, each while still mapped.
    d.d.ctl_ok("unload", "m")
    deadline = time.time() + 20
    while d.stats()["pinned_bytes"] != 0 and time.time() < deadline:
        time.sleep(0.05)
    assert d.stats()["pinned_bytes"] == 0
    pinned = {_fields(l)["addr"] for l in d.calls("pin") if l.endswith(" ok")}
    unpins = [_fields(l) for l in d.calls("unpin")]
    assert {u["addr"] for u in unpins} == pinned, d.calls()
    for u in unpins:
        assert u["perms"] == "rw-s", u  # still mapped (and the mapping as registered)
    assert all(l.endswith(" ok") for l in d.calls("unpin")), d.calls("unpin")
    assert not d.events("unpin_failed")


def test_gh200_pins_read_only_and_keeps_the_mapping_read_only(tmp_path):
    d = FakeGpuDaemon(tmp_path, "gh200")
    try:
        assert "host-register-read-only" in d.d.ctl_ok("gpus").stdout
        d.load()
        resp, sock, fds = _segments(d.client)
        try:
            assert d.stats()["pinned_bytes"] == sum(resp.segment_sizes)
            for fd, size in zip(fds, resp.segment_sizes):
                _assert_no_client_can_write(fd, size)
            _assert_bytes_are_the_checkpoints(d, resp, fds)
        finally:
            sock.close()
            for fd in fds:
                os.close(fd)
        [ev] = d.events("pinned")
        assert ev["method"] == "read_only", ev
        for p in map(_fields, d.calls("pin")):
            assert p["read_only"] == "1" and p["perms"] == "r--s", p
        assert d.daemon_map_perms("checkpoint") == {"r--s"}
        # In-place published bytes pin too: the read-only mapping suffices.
        d.client.publish("m", {"a.b": torch.full((77,), 3.0)}, transport="shm")
        ev = [e for e in d.events("pinned") if e["what"] == "publish"][-1]
        assert ev["segments"] == "1" and ev["not_pinnable"] == "0", ev
    finally:
        d.close()


def test_an_h100_beside_a_gh200_means_writable_registration(tmp_path):
    d = FakeGpuDaemon(tmp_path, "gh200,h100")
    try:
        d.load()
        [ev] = d.events("pinned")
        assert ev["method"] == "writable" and ev["not_pinnable"] == "0", ev
        assert d.stats()["pinned_bytes"] == int(ev["bytes"]) > 0, ev
        pins = [_fields(l) for l in d.calls("pin") if l.endswith(" ok")]
        assert len(pins) == int(ev["segments"]) >= 2, d.calls()
        for p in pins:
            assert p["read_only"] == "0" and p["device"] == "0" and p["perms"] == "rw-s", p
    finally:
        d.close()


def test_pin_host_memory_off_pins_nothing_and_keeps_mappings_read_only(tmp_path):
    d = FakeGpuDaemon(tmp_path, "h100", extra_args=["--pin-host-memory", "off"])
    try:
        d.load()
        assert d.stats()["pinned_bytes"] == 0
        assert not d.calls("pin") and not d.events("pinned")
        assert d.daemon_map_perms("checkpoint") == {"r--s"}
    finally:
        d.close()


# ---------------------------------------------------------------- sticky errors


def _memfd(size):
    fd = os.memfd_create("stand-in", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def _cuda_push(d, gpu):
    """A raw CUDA push of all of "m" to fake GPU `gpu` (a memfd standing in
    for the VMM allocation): the bytes at the default layout, or Error."""
    resp = d.client._shards.Fetch(pb.FetchRequest(model="m", transport=pb.SHM), timeout=30)
    offsets, size = _datasock.default_layout([t.length for t in resp.tensors])
    alloc = (size + (2 << 20) - 1) // (2 << 20) * (2 << 20)
    fd = _memfd(alloc)
    try:
        _cuda.push_cuda(resp.data_socket, resp.lease_id, bytes(resp.token), fd, _uuid_bytes(gpu),
                        alloc, None, timeout=30)
        for t, at in zip(resp.tensors, offsets):
            assert os.pread(fd, t.length, at) == st_io.tensor_bytes(d.reference[t.name]), t.name
    finally:
        os.close(fd)


def _export(d, gpu):
    resp = d.client._shards.Fetch(pb.FetchRequest(
        model="m", transport=pb.SHM, defer_casts=True, defer_merges=True), timeout=30)
    sock, fd, size, layout = _cuda.export(resp.data_socket, resp.lease_id, bytes(resp.token),
                                          _uuid_bytes(gpu))
    os.close(fd)
    sock.close()


def test_a_sticky_error_takes_out_that_gpu_and_everything_else_serves(tmp_path):
    d = FakeGpuDaemon(tmp_path, "h100,h100")
    try:
        d.load()
        _cuda_push(d, 0)
        _cuda_push(d, 1)
        assert all(g.unavailable == "" for g in d.stats()["gpus"])
        # A kernel on GPU 0 goes wrong mid-push: cudaErrorIllegalAddress.
        open(os.path.join(d.ctl_dir, "sticky-" + _uuid(0)), "w").close()
        with pytest.raises(weightd.Error) as e:
            _cuda_push(d, 0)
        assert e.value.code == "UNAVAILABLE" and "cudaErrorIllegalAddress" in e.value.message, \
            e.value
        # What the push held is released all the same.
        assert d.calls("release")[-1] == "release gpu=%s what=imported-allocation" % _uuid(0)
        [ev] = d.events("gpu_unavailable")
        assert ev["gpu"] == _uuid(0) and ev["code"] == "700" and ev["level"] == "error", ev
        gpus = {g.uuid: g for g in d.stats()["gpus"]}
        assert "cudaErrorIllegalAddress" in gpus[_uuid(0)].unavailable
        assert "during a push" in gpus[_uuid(0)].unavailable
        assert gpus[_uuid(1)].unavailable == ""
        lines = d.d.ctl_ok("gpus").stdout.splitlines()
        assert "\tunavailable: " in [l for l in lines if _uuid(0) in l][0], lines
        assert "unavailable" not in [l for l in lines if _uuid(1) in l][0], lines
        health = d.d.ctl_ok("health").stdout.splitlines()
        assert health[0] == "SERVING", health
        assert health[1].startswith("gpu %s unavailable: " % _uuid(0)), health
        assert len(health) == 2, health
        # Later pushes and exports to GPU 0 are refused before any CUDA call,
        # naming the GPU and the first error.
        pushes_before = len(d.calls("push"))
        for attempt in (lambda: _cuda_push(d, 0), lambda: _export(d, 0)):
            with pytest.raises(weightd.Error) as e:
                attempt()
            assert e.value.code == "FAILED_PRECONDITION", e.value
            assert _uuid(0) in e.value.message and "cudaErrorIllegalAddress" in e.value.message, \
                e.value
        assert len(d.calls("push")) == pushes_before
        # GPU 1, shm fetches and host pushes serve on.
        _cuda_push(d, 1)
        _export(d, 1)
        with d.client.fetch("m") as h:
            for name, ref in d.reference.items():
                assert torch.equal(h[name], ref), name
        with d.client.fetch("m", mode="push") as h:
            for name, ref in d.reference.items():
                assert torch.equal(h[name], ref), name
        assert d.client.health() is True and d.d.alive()
    finally:
        d.close()

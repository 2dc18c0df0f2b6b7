"""Push into client-owned memory (docs/DESIGN.md §9.1, §4.5, common/data_protocol.h
PushRequest, common/push_layout.h) against a real daemon, with PyTorch as the
reference.

* Parity: fetch(mode="push") gives, for several worlds and dtypes (bf16->f32,
  f32->bf16, f16; an empty tensor, a 0-dim one, ints, bools, NaN/Inf), exactly
  the bytes of the shm fetch and of torch.chunk(t.to(dtype), W, 0)[r]; the
  tensors are writable views of ONE shared map of the client's memfd, each
  at its default-layout offset (multiples of 256); the daemon keeps no lease.
* In-place refresh: after `apply` of a PEFT LoRA, handle.refresh() has the
  daemon rewrite only the changed tensors in the same memfd: sentinel bytes
  in the unchanged tensors and in the padding survive, the changed tensors
  equal a fresh shm fetch of the new generation (and the fp32 PyTorch merge),
  tensors taken from state_dict() before see the new values; a mismatched
  handle is refused with nothing written.
* Every good destination is a memfd made with MFD_ALLOW_SEALING, sized,
  fallocated and sealed against shrinking and growing (F_SEAL_SHRINK |
  F_SEAL_GROW), as the protocol
  asks; fetch(mode="push") seals its own.
* Bad destinations, each with exactly one defect and its precise code on raw
  data-socket connections, the connection left open for a good push after it
  (except a refusal before the offsets are read, with offsets following: a
  wrong offsets count, token or lease closes it, and the close ends a lease
  the header attached), and the daemon serving after each: too small,
  overlapping / misaligned offsets, no fd, two fds, a regular file, a tmpfs
  file, a pipe, a read-only fd, write-sealed memfds, holes, wrong token,
  unknown lease; and a memfd not sealed against shrinking (unsealed, or made
  without MFD_ALLOW_SEALING so it cannot be): FAILED_PRECONDITION naming
  F_SEAL_SHRINK, its bytes untouched.
* A 256 MiB push into a sealed memfd: the client's ftruncate to a smaller
  size fails with EPERM while the push runs, the push answers OK, and the
  memfd keeps its size, its allocation and the shm fetch's bytes. A write
  seal added mid-push: OK or ABORTED, never a crash. A client SIGKILLed
  mid-push of that model: the daemon serves on and leases_open returns to
  what it was.
* fetch(mode="push") and refresh() ride out a daemon restart (retried whole
  on UNAVAILABLE).
"""
import dataclasses
import errno
import fcntl
import mmap
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import grpc
import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import BUILD, Daemon  # noqa: E402
from harness import leases_open as _leases, wait_leases as _wait_leases  # noqa: E402
from reference import assert_matches_torch as _assert_matches_torch  # noqa: E402
from reference import cast_shard_ref  # noqa: E402
import st_io  # noqa: E402

import weightd  # noqa: E402  (build/python, put on sys.path by harness)
from weightd import _datasock  # noqa: E402
from weightd.v1 import weightd_pb2 as pb  # noqa: E402

PYTHON = "/usr/bin/python3"
ALIGN = 256
OK, INVALID_ARGUMENT, NOT_FOUND, PERMISSION_DENIED = 0, 3, 5, 7
FAILED_PRECONDITION, ABORTED = 9, 10
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
_TORCH = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}

# LoRA model (Llama-shaped, BF16) and a PEFT adapter on q/v of both layers.
H, KV, INTER, R, ALPHA = 64, 32, 96, 8, 16
SHAPES = {"self_attn.q_proj": (H, H), "self_attn.k_proj": (KV, H), "self_attn.v_proj": (KV, H),
          "self_attn.o_proj": (H, H), "mlp.up_proj": (INTER, H), "mlp.down_proj": (H, INTER)}
TARGETS = ["model.layers.%d.%s" % (i, m) for i in range(2)
           for m in ("self_attn.q_proj", "self_attn.v_proj")]

# The large model of the race tests: one F32 tensor of 256 MiB, every
# element non-zero (the first is 1.0), so the first bytes the daemon writes
# show in the destination.
BIG_SHAPE = (16384, 4096)
BIG_BYTES = BIG_SHAPE[0] * BIG_SHAPE[1] * 4


# ---------------------------------------------------------------- fixtures


def _small_checkpoint():
    g = torch.Generator().manual_seed(606)
    return {
        "emb.weight": torch.randn(37, 19, generator=g),               # F32, uneven shards
        "half.weight": torch.randn(10, 6, generator=g).to(torch.bfloat16),
        "f16.weight": torch.randn(9, 5, generator=g).to(torch.float16),
        "dbl": torch.randn(7, 3, generator=g, dtype=torch.float64),
        "tiny.bias": torch.randn(3, generator=g),                     # fewer rows than ranks
        "scalar": torch.tensor(0.625),                                # 0-dim: replicated
        "empty": torch.zeros(0, 4),                                   # zero-size everywhere
        "ids": torch.arange(13, dtype=torch.int64),
        "mask": torch.tensor([True, False, True, True, False]),
        "special": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40,
                                 65520.0, 3.4e38, 1.0 + 2 ** -11]),
        "bf_special": torch.tensor([float("nan"), -float("inf"), -0.0, 3.0e38, 1e-39,
                                    1.0 + 2 ** -8]).to(torch.bfloat16),
    }


def _lora_checkpoint(g):
    ck = {"model.embed_tokens.weight": torch.randn(128, H, generator=g)}
    for i in range(2):
        for m, shape in SHAPES.items():
            ck["model.layers.%d.%s.weight" % (i, m)] = torch.randn(*shape, generator=g) * 0.05
        ck["model.layers.%d.input_layernorm.weight" % i] = 1 + 0.1 * torch.randn(H, generator=g)
    ck["model.norm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    return {k: v.to(torch.bfloat16) for k, v in ck.items()}


@pytest.fixture(scope="module")
def daemon():
    d = Daemon()
    d.start()
    try:
        d.small = _small_checkpoint()
        path = os.path.join(d.model_root, "small.safetensors")
        st_io.save(d.small, path)
        d.ctl_ok("load", "small", path)

        g = torch.Generator().manual_seed(7331)
        d.lora = _lora_checkpoint(g)
        path = os.path.join(d.model_root, "lora.safetensors")
        st_io.save(d.lora, path)
        d.ctl_ok("load", "lora", path)
        ad = os.path.join(d.model_root, "adapter_a")
        os.makedirs(ad)
        tensors, d.factors = {}, {}
        for m in TARGETS:
            out, inn = SHAPES[m.split(".", 3)[3]]
            a = torch.randn(R, inn, generator=g) * 0.2
            b = torch.randn(out, R, generator=g) * 0.2
            tensors["base_model.model.%s.lora_A.weight" % m] = a
            tensors["base_model.model.%s.lora_B.weight" % m] = b
            d.factors[m + ".weight"] = (a, b)
        with open(os.path.join(ad, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": R, "lora_alpha": ALPHA,
                       "target_modules": ["q_proj", "v_proj"]}, f)
        st_io.save(tensors, os.path.join(ad, "adapter_model.safetensors"))
        d.ctl_ok("adapter", "load", "a", ad)
        d.big_loaded = False
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def client(daemon):
    c = weightd.Client(socket=daemon.socket)
    yield c
    c.close()


@pytest.fixture(scope="module")
def big(daemon):
    """Loads model "big" (256 MiB of F32) once, for the tests that need it."""
    path = os.path.join(daemon.model_root, "big.safetensors")
    data = np.arange(1, BIG_SHAPE[0] * BIG_SHAPE[1] + 1, dtype=np.float32)
    header = json.dumps({"big": {"dtype": "F32", "shape": list(BIG_SHAPE),
                                 "data_offsets": [0, BIG_BYTES]}}).encode()
    header += b" " * ((8 - len(header) % 8) % 8)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        f.write(memoryview(data).cast("B"))
    del data
    daemon.ctl_ok("load", "big", path)
    os.unlink(path)
    return "big"


# ---------------------------------------------------------------- helpers

def _base_leases(client):
    """The leases open when a test starts: those the tests before it ended
    are gone by then (the daemon ends a lease when it sees its connection
    close, a moment after the client closed it)."""
    return _wait_leases(client, 0, timeout=5.0)


def _serves(d, client):
    """The daemon is alive and a normal (shm) fetch succeeds."""
    assert d.alive(), "weightd died:\n" + d.log()[-4000:]
    with client.fetch("small", world=2, rank=0) as h:
        assert float(h["scalar"]) == 0.625
        assert h["ids"].tolist() == list(range(7))
    assert client.health() is True


def _grant(client, model="small", world=1, rank=0, dtype=None, defer_casts=False):
    """A raw Fetch (a lease, no attach): (response, lengths)."""
    from weightd import _dtypes
    dt = _dtypes.parse_request_dtype(dtype)
    resp = client._shards.Fetch(pb.FetchRequest(
        model=model, mesh_shape=[world], coord=[rank], transport=pb.SHM,
        dtype=_dtypes.enum_of_name(dt) if dt else pb.DTYPE_UNSPECIFIED,
        defer_casts=defer_casts), timeout=60)
    return resp, [t.length for t in resp.tensors]


def _release(client, resp):
    """Ends a lease a test may have left (NOT_FOUND when already ended)."""
    try:
        client._shards.Release(pb.ReleaseRequest(lease_id=resp.lease_id, token=resp.token),
                               timeout=10)
    except Exception:
        pass


def _memfd(size, allocate=True, seal_shrink=True, allow_sealing=True, name="test-push"):
    """A push destination of `size` bytes as the protocol wants it: made with
    MFD_ALLOW_SEALING, sized, fallocated whole and sealed against shrinking
    and growing (F_SEAL_SHRINK | F_SEAL_GROW). Each keyword drops one of
    those steps, for the tests of bad destinations."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if allow_sealing else 0))
    if size:
        os.ftruncate(fd, size)
        if allocate:
            os.posix_fallocate(fd, 0, size)
    if seal_shrink:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SIZE_SEALS)
    return fd


# The daemon takes a destination only once its size is sealed.
_SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def _seals(fd):
    return fcntl.fcntl(fd, fcntl.F_GET_SEALS)


def _connect(resp, timeout=30.0):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    sock.connect(resp.data_socket)
    return sock


def _ask(sock, resp, fds, offsets=None, num_offsets=None, token=None, lease_id=None):
    """One PushRequest on `sock`; the reply's (code, message). A daemon that
    refuses on the header may answer and close before the offsets are sent:
    the reply is read all the same."""
    try:
        _datasock.send_push(sock, resp.lease_id if lease_id is None else lease_id,
                            bytes(resp.token) if token is None else token, fds, offsets,
                            num_offsets)
    except (BrokenPipeError, ConnectionResetError):
        pass
    code, msg, extra = _datasock.read_reply(sock)
    for fd in extra:
        os.close(fd)
    assert not extra, "the daemon passed fds in reply to a push"
    return code, msg


def _closed_by_peer(sock, timeout=10.0):
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


# ---------------------------------------------------------------- layout


def test_default_layout_mirrors_push_layout_cc():
    assert _datasock.default_layout([]) == ([], 0)
    assert _datasock.default_layout([0]) == ([0], 0)
    assert _datasock.default_layout([1, 0, 300, 256, 0]) == ([0, 256, 256, 768, 1024], 1024)
    assert _datasock.default_layout([100, 0]) == ([0, 256], 256)
    with pytest.raises(weightd.Error) as e:
        _datasock.default_layout([1 << 63, 1])
    assert e.value.code == "INVALID_ARGUMENT"


def test_mode_arguments(client):
    with pytest.raises(weightd.Error) as e:
        client.fetch("small", mode="bogus")
    assert e.value.code == "INVALID_ARGUMENT"
    with pytest.raises(weightd.Error) as e:
        client.fetch("small", mode="push", transport="grpc")
    assert e.value.code == "INVALID_ARGUMENT"
    with client.fetch("small", mode="export") as h:
        assert h.mode == "export"
        with pytest.raises(weightd.Error) as e:
            h.refresh()
        assert e.value.code == "FAILED_PRECONDITION"
    with pytest.raises(weightd.Error) as e:
        client.fetch("no-such-model", mode="push")
    assert e.value.code == "NOT_FOUND"


# ---------------------------------------------------------------- parity

PARITY_CASES = [(1, None), (2, "f32"), (3, "bf16"), (4, "f16"), (5, None)]


@pytest.mark.parametrize("world,dtype", PARITY_CASES)
def test_push_parity(daemon, client, world, dtype):
    base = _base_leases(client)
    for rank in range(world):
        what = "world %d rank %d dtype %s" % (world, rank, dtype)
        with client.fetch("small", world=world, rank=rank, dtype=dtype) as shm:
            want_sd = shm.state_dict()
            want_raw = {k: (v.dtype, tuple(v.shape), st_io.tensor_bytes(v))
                        for k, v in want_sd.items()}
            want_meta = {m.name: m for m in shm.tensors}
        h = client.fetch("small", world=world, rank=rank, dtype=dtype, mode="push",
                         populate=(rank == 0))
        try:
            assert h.mode == "push" and h.transport == "shm" and not h.released, what
            assert h.generation == 1
            sd = h.state_dict()
            # equal to the shm fetch, bit for bit, and to PyTorch
            got_raw = {k: (v.dtype, tuple(v.shape), st_io.tensor_bytes(v)) for k, v in sd.items()}
            assert got_raw == want_raw, what
            ref = {k: cast_shard_ref(t, world, rank, _TORCH[dtype] if dtype else None)
                   for k, t in daemon.small.items()}
            _assert_matches_torch(sd, ref, what)
            for m in h.tensors:
                w = want_meta[m.name]
                assert (m.dtype, m.shape, m.global_shape, m.global_offset, m.length) == \
                    (w.dtype, w.shape, w.global_shape, w.global_offset, w.length), \
                    "%s: %s" % (what, m.name)
                # cast by the push (cast_on_push, the default): no digest,
                # and only where the stored dtype is not the one served
                stored = _DT_NAME[daemon.small[m.name].dtype]
                assert m.digest == (b"" if stored != m.dtype else w.digest), \
                    "%s: %s" % (what, m.name)
            assert sd["empty"].shape == (0, 4) and sd["scalar"].shape == ()

            # one memfd, one shared map, every tensor at its default-layout offset
            offsets, size = _datasock.default_layout([m.length for m in h.tensors])
            assert [m.offset for m in h.tensors] == offsets, what
            assert all(m.offset % ALIGN == 0 and m.segment == 0 for m in h.tensors)
            fd = h._push.fd
            assert os.readlink("/proc/self/fd/%d" % fd).startswith("/memfd:weightd-push")
            assert os.fstat(fd).st_size >= size
            # sealed against shrinking (the daemon takes nothing else), not against writes
            seals = _seals(fd)
            assert seals & _SIZE_SEALS == _SIZE_SEALS, what
            assert not seals & (fcntl.F_SEAL_WRITE | F_SEAL_FUTURE_WRITE), what
            ranges = h._segment_ranges()
            assert len(ranges) == 1, ranges
            lo, hi = ranges[0]
            assert hi - lo >= size
            for m in h.tensors:
                t = sd[m.name]
                if t.numel():
                    assert t.data_ptr() == lo + m.offset, "%s: %s" % (what, m.name)
                    assert t.data_ptr() % ALIGN == 0
            # writable, and writes land in the memfd (a shared map), not in the daemon
            m = next(x for x in h.tensors if x.name == "ids")
            arr = h.numpy_dict()["ids"]
            assert arr.flags.writeable
            arr[:] = -7
            assert os.pread(fd, m.length, m.offset) == np.full(arr.shape, -7, np.int64).tobytes()
            with client.fetch("small", world=world, rank=rank, dtype=dtype) as again:
                assert st_io.tensor_bytes(again["ids"]) == want_raw["ids"][2]
            # the daemon holds no lease for a push handle
            assert _wait_leases(client, base) == base, what
        finally:
            h.release()
        assert h.released
        with pytest.raises(weightd.Error) as e:
            h.state_dict()
        assert e.value.code == "FAILED_PRECONDITION"
        with pytest.raises(weightd.Error) as e:
            h.refresh()
        assert e.value.code == "FAILED_PRECONDITION"
    assert _wait_leases(client, base) == base


_DT_NAME = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
            torch.float64: "F64", torch.int64: "I64", torch.bool: "BOOL"}


def test_casts_deferred_to_the_push(daemon, client):
    """fetch(cast_on_push=True), the push default: a tensor that needs only a
    cast is leased as its stored bytes and cast while the daemon writes it
    (the host twin of the cast on the GPU); nothing is materialized, the
    bytes equal the materialized ones, and the lease is for a push only."""
    for world, rank, dtype in ((1, 0, "f32"), (3, 1, "bf16"), (2, 1, "f16")):
        what = "world %d rank %d dtype %s" % (world, rank, dtype)
        with client.fetch("small", world=world, rank=rank, dtype=dtype, mode="push",
                          cast_on_push=False) as h:
            want = {k: st_io.tensor_bytes(v) for k, v in h.state_dict().items()}
            want_meta = {m.name: m for m in h.tensors}
        before = client.stats()["materialization_bytes"]
        with client.fetch("small", world=world, rank=rank, dtype=dtype, mode="push") as h:
            got = {k: st_io.tensor_bytes(v) for k, v in h.state_dict().items()}
            metas = {m.name: m for m in h.tensors}
        assert got == want, what
        cast = {n for n, m in metas.items() if m.digest == b""}
        assert cast == {n for n, t in daemon.small.items()
                        if t.is_floating_point() and _DT_NAME[t.dtype] != metas[n].dtype}, what
        assert all(metas[n].digest == want_meta[n].digest for n in metas if n not in cast)
        # every tensor was a view or cast by the push: nothing computed
        assert client.stats()["materialization_bytes"] == before, what

    # The raw lease: the served lengths, cast_on_push set, and neither the
    # data socket nor Read hands out what it holds.
    resp, lengths = _grant(client, dtype="f32", defer_casts=True)
    try:
        by_name = {t.name: t for t in resp.tensors}
        assert by_name["half.weight"].cast_on_push and by_name["half.weight"].digest == b""
        assert by_name["half.weight"].length == 10 * 6 * 4
        assert not by_name["emb.weight"].cast_on_push and len(by_name["emb.weight"].digest) == 16
        with pytest.raises(weightd.Error) as e:
            conn, fds = _datasock.attach(resp.data_socket, resp.lease_id, bytes(resp.token),
                                         len(resp.segment_sizes))
        assert e.value.code == "FAILED_PRECONDITION" and "defer_casts" in e.value.message
        with pytest.raises(grpc.RpcError) as e:
            list(client._shards.Read(pb.ReadRequest(lease_id=resp.lease_id, token=resp.token,
                                                    segment=0, offset=0, length=16),
                                     timeout=10))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "defer_casts" in e.value.details()
        # it still pushes, at the served lengths
        offsets, size = _datasock.default_layout(lengths)
        fd = _memfd(size)
        try:
            with _connect(resp) as sock:
                assert _ask(sock, resp, [fd]) == (0, "")
            data = os.pread(fd, size, 0)
        finally:
            os.close(fd)
        ref = cast_shard_ref(daemon.small["half.weight"], 1, 0, torch.float32)
        i = [t.name for t in resp.tensors].index("half.weight")
        assert data[offsets[i]:offsets[i] + lengths[i]] == st_io.tensor_bytes(ref)
    finally:
        _release(client, resp)
    # Over the grpc transport nothing could take such a lease.
    with pytest.raises(grpc.RpcError) as e:
        client._shards.Fetch(pb.FetchRequest(model="small", transport=pb.GRPC, defer_casts=True),
                             timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "defer_casts" in e.value.details()
    _serves(daemon, client)


def test_merges_deferred_to_the_push(daemon, client):
    """fetch(merge_on_push=True) into host memory: the LoRA-patched tensors
    are merged element by element as the daemon writes them (the GPU's
    merge, run by its host twin), nothing is materialized, and the bytes
    are the merge docs/DESIGN.md §2.5 defines (vs PyTorch; the materialized ones
    agree within fp32 accumulation)."""
    client.apply("lora", [])
    try:
        client.apply("lora", [("a", 0.5)])
        targeted = sorted(t + ".weight" for t in TARGETS)
        for world, rank, dtype in ((1, 0, "f32"), (2, 1, None), (3, 2, "f16")):
            what = "world %d rank %d dtype %s" % (world, rank, dtype)
            with client.fetch("lora", world=world, rank=rank, dtype=dtype) as shm:
                want = {k: v.clone() for k, v in shm.state_dict().items()}
            before = client.stats()["materialization_bytes"]
            with client.fetch("lora", world=world, rank=rank, dtype=dtype, mode="push",
                              merge_on_push=True) as h:
                got = {k: v.clone() for k, v in h.state_dict().items()}
                digests = {m.name: m.digest for m in h.tensors}
            assert client.stats()["materialization_bytes"] == before, what
            assert all(digests[n] == b"" for n in targeted), what
            for name, t in got.items():
                assert t.dtype == want[name].dtype and t.shape == want[name].shape, name
                if name not in targeted:
                    assert torch.equal(t, want[name]), "%s: %s" % (what, name)
                    continue
                ref = cast_shard_ref(_merged_ref(daemon, name, 0.5), world, rank,
                                     _TORCH[dtype] if dtype else torch.bfloat16)
                atol = 1e-6 * float(ref.float().abs().max())
                if t.dtype == torch.float32:
                    assert torch.allclose(t, ref, rtol=1e-5, atol=atol), "%s: %s" % (what, name)
                else:  # one rounding from fp32: at most 1 ulp off a reference in another order
                    d = (t.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
                    assert int(d.max()) <= 1, "%s: %s" % (what, name)
                    assert float((d > 0).float().mean()) <= 0.01, "%s: %s" % (what, name)
    finally:
        client.apply("lora", [])
    _serves(daemon, client)


def test_weightctl_push_casts_as_it_writes(daemon, tmp_path):
    """weightctl fetch --transport push casts on push (the C++ client's
    default): the file equals the shm fetch's, and --verify (which needs
    every digest) still works by having the daemon materialize."""
    for world, rank, dtype in ((1, 0, "f32"), (3, 2, "bf16")):
        common = ["fetch", "small", "--world", world, "--rank", rank, "--dtype", dtype]
        daemon.ctl_ok(*common, "--out", tmp_path / "shm.st")
        daemon.ctl_ok(*common, "--transport", "push", "--out", tmp_path / "push.st")
        daemon.ctl_ok(*common, "--transport", "push", "--verify", "--out", tmp_path / "v.st")
        want = (tmp_path / "shm.st").read_bytes()
        assert (tmp_path / "push.st").read_bytes() == want, (world, rank, dtype)
        assert (tmp_path / "v.st").read_bytes() == want, (world, rank, dtype)


def test_push_tensors_outlive_release(client):
    h = client.fetch("small", world=2, rank=1, dtype="f32", mode="push")
    kept = h.state_dict()["emb.weight"]
    want = kept.clone()
    h.release()
    h.release()  # idempotent
    assert h._push.fd == -1 and h._push.mapping is None  # closed; the map lives on in `kept`
    assert torch.equal(kept, want)
    kept.add_(1)
    assert torch.equal(kept, want + 1)


# ---------------------------------------------------------------- refresh


def _merged_ref(d, name, strength):
    w = d.lora[name].float()
    if name in d.factors:
        a, b = d.factors[name]
        s = torch.tensor(np.float32(float(np.float32(strength)) * (ALPHA / R)))
        w = w + (b @ a) * s
    return w


def _fill(mapping, start, end, byte):
    if end > start:
        mapping[start:end] = bytes([byte]) * (end - start)


@pytest.mark.parametrize("world,rank,dtype", [(1, 0, None), (2, 1, "f32")])
def test_refresh_in_place_after_apply(daemon, client, world, rank, dtype):
    base = _base_leases(client)
    client.apply("lora", [])
    g0 = client.info("lora").generation
    h = client.fetch("lora", world=world, rank=rank, dtype=dtype, mode="push")
    try:
        assert h.generation == g0
        sd = h.state_dict()  # taken before the refresh: must see the new values
        first = {k: v.clone() for k, v in sd.items()}
        targeted = sorted(t + ".weight" for t in TARGETS)
        assert set(targeted) <= set(h.names)
        mapping = h._push.mapping
        # Sentinels: 0xA5 over every tensor the apply does not change, 0x5A
        # over the padding between tensors, 0xFF over the changed ones (the
        # daemon must rewrite them whole).
        metas = sorted(h.tensors, key=lambda m: m.offset)
        end = 0
        for m in metas:
            _fill(mapping, end, m.offset, 0x5A)
            if m.length:
                _fill(mapping, m.offset, m.offset + m.length,
                      0xFF if m.name in targeted else 0xA5)
                end = m.offset + m.length
        _fill(mapping, end, len(mapping), 0x5A)
        snapshot = bytes(mapping)

        g1 = client.apply("lora", [("a", 0.5)])
        assert g1 > g0
        names = h.refresh()
        assert h.generation == g1
        assert sorted(names) == targeted
        with client.fetch("lora", world=world, rank=rank, dtype=dtype, changed_since=g0) as ch:
            assert sorted(ch.names) == targeted  # what the daemon says changed

        now = bytes(mapping)
        changed = {m.name for m in h.tensors if m.name in names}
        end = 0
        for m in metas:  # untouched: padding and unchanged tensors keep their sentinels
            assert now[end:m.offset] == snapshot[end:m.offset], "padding before %s" % m.name
            span = slice(m.offset, m.offset + m.length)
            if m.name not in changed:
                assert now[span] == snapshot[span], "unchanged tensor %s was written" % m.name
            if m.length:
                end = m.offset + m.length
        assert now[end:] == snapshot[end:]

        with client.fetch("lora", world=world, rank=rank, dtype=dtype) as fresh:
            assert fresh.generation == g1
            fsd = fresh.state_dict()
            fmeta = {m.name: m for m in fresh.tensors}
            new_sd = h.state_dict()
            for name in names:
                want = st_io.tensor_bytes(fsd[name])
                assert st_io.tensor_bytes(new_sd[name]) == want, name
                assert st_io.tensor_bytes(sd[name]) == want, "%s: old view sees old bytes" % name
                assert not torch.equal(sd[name], first[name]), name
            for m in h.tensors:  # metas follow the generation
                # (the checkpoint is BF16: an unpatched tensor served in
                # another dtype is cast by the push and has no digest)
                cast = m.dtype != "BF16" and m.name not in names
                assert m.digest == (b"" if cast else fmeta[m.name].digest), m.name
        # the merge itself, against PyTorch's fp32 reference
        for name in names:
            ref = cast_shard_ref(_merged_ref(daemon, name, 0.5), world, rank)
            got = sd[name].float()
            atol = 1e-6 * float(ref.abs().max())
            if sd[name].dtype == torch.float32:
                assert torch.allclose(got, ref, rtol=1e-5, atol=atol), name
            else:
                assert torch.allclose(got, ref.to(sd[name].dtype).float(), rtol=1e-2,
                                      atol=1e-2 * float(ref.abs().max())), name

        # nothing changed: nothing written
        assert h.refresh() == []
        assert h.generation == g1 and bytes(mapping) == now
        assert _wait_leases(client, base) == base

        # a generation that never was: NOT_FOUND, nothing written
        with pytest.raises(weightd.Error) as e:
            h.refresh(generation=g1 + 1000)
        assert e.value.code == "NOT_FOUND"
        assert h.generation == g1 and bytes(mapping) == now

        # back to the base (named explicitly): the same tensors, the base's bytes
        g2 = client.apply("lora", [])
        assert sorted(h.refresh(generation=g2)) == targeted and h.generation == g2
        for name in targeted:
            assert torch.equal(sd[name], first[name]), name
        assert _wait_leases(client, base) == base
    finally:
        h.release()
    _serves(daemon, client)


def test_refresh_refuses_a_mismatched_handle(daemon, client):
    base = _base_leases(client)
    client.apply("lora", [])
    h = client.fetch("lora", mode="push")
    try:
        g0 = h.generation
        target = TARGETS[0] + ".weight"
        idx = h.names.index(target)
        m = h.tensors[idx]
        _fill(h._push.mapping, m.offset, m.offset + m.length, 0xEE)
        snapshot = bytes(h._push.mapping)
        original = list(h.tensors)
        h.tensors[idx] = dataclasses.replace(m, shape=tuple(reversed(m.shape)) + (1,))
        client.apply("lora", ["a"])
        with pytest.raises(weightd.Error) as e:
            h.refresh()
        assert e.value.code == "FAILED_PRECONDITION" and target in e.value.message
        assert h.generation == g0
        assert bytes(h._push.mapping) == snapshot, "a refused refresh wrote into the destination"
        assert _wait_leases(client, base) == base, "the refused refresh's lease stayed"
        h.tensors = original
        assert target in h.refresh()
        assert bytes(h._push.mapping) != snapshot
    finally:
        h.release()
        client.apply("lora", [])
    _serves(daemon, client)


# ---------------------------------------------------------------- bad destinations


def _case(kind, resp, lengths, workdir, keep):
    """(fds, offsets, expected code) of a bad push; fds to close go to keep."""
    offsets, size = _datasock.default_layout(lengths)
    nonempty = [i for i, n in enumerate(lengths) if n]

    def memfd(n, **kw):
        fd = _memfd(n, **kw)
        keep.append(fd)
        return fd

    if kind == "too_small":
        return [memfd(size - 1)], None, INVALID_ARGUMENT
    if kind == "too_small_explicit":
        far = list(offsets)
        far[nonempty[-1]] = -(-(size + 8192) // 4096) * 4096
        return [memfd(size)], far, INVALID_ARGUMENT
    if kind == "overlap":
        bad = list(offsets)
        bad[nonempty[1]] = offsets[nonempty[0]]
        return [memfd(size)], bad, INVALID_ARGUMENT
    if kind == "overlap_partial":
        bad = list(offsets)
        i = max(nonempty, key=lambda k: lengths[k])
        j = next(k for k in nonempty if k != i)
        assert lengths[i] > ALIGN  # tensor j starts inside tensor i
        bad[j] = offsets[i] + ALIGN
        return [memfd(size + ALIGN * 64)], bad, INVALID_ARGUMENT
    if kind == "misaligned":
        bad = list(offsets)
        bad[nonempty[-1]] += 8
        return [memfd(size + 4096)], bad, INVALID_ARGUMENT
    if kind == "no_fd":
        return [], None, INVALID_ARGUMENT
    if kind == "two_fds":
        return [memfd(size), memfd(size)], None, INVALID_ARGUMENT
    if kind == "regular_file":
        f = tempfile.TemporaryFile(dir=workdir)
        fd = os.dup(f.fileno())
        f.close()
        keep.append(fd)
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
        return [fd], None, INVALID_ARGUMENT
    if kind == "tmpfs_file":
        fd = os.open("/dev/shm", os.O_TMPFILE | os.O_RDWR, 0o600)
        keep.append(fd)
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
        return [fd], None, INVALID_ARGUMENT
    if kind == "pipe":
        r, w = os.pipe()
        keep.extend([r, w])
        return [w], None, INVALID_ARGUMENT
    if kind == "read_only":
        fd = memfd(size)
        ro = os.open("/proc/self/fd/%d" % fd, os.O_RDONLY | os.O_CLOEXEC)
        keep.append(ro)
        return [ro], None, FAILED_PRECONDITION
    if kind in ("sealed_write", "sealed_future_write"):
        fd = memfd(size)  # sealed against shrinking too: the write seal is its one defect
        seal = fcntl.F_SEAL_WRITE if kind == "sealed_write" else F_SEAL_FUTURE_WRITE
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seal)
        return [fd], None, FAILED_PRECONDITION
    if kind == "hole":
        return [memfd(size, allocate=False)], None, FAILED_PRECONDITION
    if kind == "partial_hole":
        # The last tensor placed on pages of its own, left unallocated.
        far = list(offsets)
        at = -(-(size + 8192) // 4096) * 4096
        far[nonempty[-1]] = at
        fd = memfd(at + lengths[nonempty[-1]], allocate=False)
        os.posix_fallocate(fd, 0, size)
        return [fd], far, FAILED_PRECONDITION
    raise AssertionError(kind)


BAD_KINDS = ["too_small", "too_small_explicit", "overlap", "overlap_partial", "misaligned",
             "no_fd", "two_fds", "regular_file", "tmpfs_file", "pipe", "read_only",
             "sealed_write", "sealed_future_write", "hole", "partial_hole"]

# A word of the daemon's message for each kind: the refusal names the one
# defect the case has (and not, say, a missing seal).
BAD_HINTS = {"too_small": "layout needs", "too_small_explicit": "layout needs",
             "overlap": "overlap", "overlap_partial": "overlap", "misaligned": "multiple of",
             "no_fd": "exactly one fd", "two_fds": "exactly one fd",
             "regular_file": "not a memfd", "tmpfs_file": "not a memfd", "pipe": "a pipe",
             "read_only": "read-only", "sealed_write": "sealed against writes",
             "sealed_future_write": "sealed against writes", "hole": "allocated",
             "partial_hole": "allocated"}


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_destination(daemon, client, kind):
    if kind == "tmpfs_file" and not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    base = _base_leases(client)
    resp, lengths = _grant(client, world=2, rank=0)
    keep = []
    sock = _connect(resp)
    try:
        fds, offsets, want = _case(kind, resp, lengths, daemon.workdir, keep)
        code, msg = _ask(sock, resp, fds, offsets)
        assert code == want, "%s: expected %s, got %s: %s" % (
            kind, weightd.errors.code_name(want), weightd.errors.code_name(code), msg)
        assert msg, "%s: a refusal without a message" % kind
        assert BAD_HINTS[kind] in msg and "F_SEAL_SHRINK" not in msg, \
            "%s: refused for another defect: %s" % (kind, msg)
        # The connection stays open: a good push of the same lease follows on it.
        _, size = _datasock.default_layout(lengths)
        good = _memfd(size)
        keep.append(good)
        code, msg = _ask(sock, resp, [good])
        assert code == OK, "%s: the good push after the refusal: %s %s" % (
            kind, weightd.errors.code_name(code), msg)
        with client.fetch("small", world=2, rank=0) as shm:
            for m in shm.tensors:
                if m.length:
                    at = _datasock.default_layout(lengths)[0][shm.names.index(m.name)]
                    assert os.pread(good, m.length, at) == \
                        st_io.tensor_bytes(shm[m.name]), m.name
    finally:
        sock.close()
        for fd in keep:
            os.close(fd)
        _release(client, resp)
    assert _wait_leases(client, base) == base
    _serves(daemon, client)


@pytest.mark.parametrize("allow_sealing", [True, False], ids=["unsealed", "unsealable"])
def test_destination_not_sealed_against_shrinking(daemon, client, allow_sealing):
    """A memfd that is otherwise a good destination (sized, fallocated,
    writable) but not sealed against shrinking: made with MFD_ALLOW_SEALING
    and left unsealed, or made without it (born F_SEAL_SEAL: it can never be
    sealed). Refused FAILED_PRECONDITION naming F_SEAL_SHRINK, with the
    default layout and with explicit offsets, nothing written; the
    connection stays open for a good push of the same lease after it; the
    close ends the lease; the daemon serves on."""
    base = _base_leases(client)
    resp, lengths = _grant(client, world=2, rank=0)
    offsets, size = _datasock.default_layout(lengths)
    fd = _memfd(size, seal_shrink=False, allow_sealing=allow_sealing)
    keep = [fd]
    sentinel = b"\xa5" * size
    os.pwrite(fd, sentinel, 0)
    blocks = os.fstat(fd).st_blocks
    sock = _connect(resp)
    try:
        seals = _seals(fd)
        assert not seals & fcntl.F_SEAL_SHRINK
        if not allow_sealing:
            assert seals & fcntl.F_SEAL_SEAL
            with pytest.raises(PermissionError):
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        for offs in (None, offsets):
            code, msg = _ask(sock, resp, [fd], offs)
            assert code == FAILED_PRECONDITION, "%s offsets: got %s: %s" % (
                "explicit" if offs else "default", weightd.errors.code_name(code), msg)
            assert "F_SEAL_SHRINK" in msg, msg
            st = os.fstat(fd)
            assert (st.st_size, st.st_blocks) == (size, blocks)
            assert os.pread(fd, size, 0) == sentinel, "a refused push wrote"
        assert _leases(client) == base + 1  # attached to this connection, not ended
        # The same connection takes a good push of the same lease: the same
        # memfd once sealed, or (when it cannot be) a new one.
        if allow_sealing:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SIZE_SEALS)
            good = fd
        else:
            good = _memfd(size)
            keep.append(good)
        code, msg = _ask(sock, resp, [good])
        assert code == OK, (weightd.errors.code_name(code), msg)
        with client.fetch("small", world=2, rank=0) as shm:
            for i, m in enumerate(shm.tensors):
                assert shm.names[i] == m.name
                if m.length:
                    assert os.pread(good, m.length, offsets[i]) == \
                        st_io.tensor_bytes(shm[m.name]), m.name
        sock.close()
        assert _wait_leases(client, base) == base, "closing the connection left the lease"
    finally:
        sock.close()
        for x in keep:
            os.close(x)
        _release(client, resp)
    _serves(daemon, client)


def test_bad_destination_through_push(daemon, client):
    """_datasock.push raises the daemon's code, closes its connection, and
    succeeds into the same memfd once it is allocated (a new lease: the
    first one was attached to the closed connection)."""
    base = _base_leases(client)
    grants = []
    resp, lengths = _grant(client)
    grants.append(resp)
    _, size = _datasock.default_layout(lengths)
    fd = _memfd(size, allocate=False)
    try:
        with pytest.raises(weightd.Error) as e:
            _datasock.push(resp.data_socket, resp.lease_id, bytes(resp.token), fd)
        assert e.value.code == "FAILED_PRECONDITION" and e.value.message
        with pytest.raises(weightd.Error) as e:
            _datasock.push(resp.data_socket, resp.lease_id, bytes(resp.token)[::-1], fd)
        assert e.value.code in ("PERMISSION_DENIED", "NOT_FOUND")
        os.posix_fallocate(fd, 0, size)
        resp, _ = _grant(client)
        grants.append(resp)
        os.lseek(fd, 1234, os.SEEK_SET)  # the client's file offset: the daemon leaves it be
        assert _datasock.push(resp.data_socket, resp.lease_id, bytes(resp.token), fd) is None
        assert os.lseek(fd, 0, os.SEEK_CUR) == 1234
        assert os.pread(fd, 64, 0) != bytes(64)
    finally:
        os.close(fd)
        for r in grants:
            _release(client, r)
    assert _wait_leases(client, base) == base
    _serves(daemon, client)


def test_push_of_nothing(daemon, client):
    """A 0-byte layout (only empty tensors): no map, empty tensors, and
    refresh() has nothing to write."""
    base = _base_leases(client)
    with client.fetch("small", names=["empty"], mode="push") as h:
        assert h.names == ["empty"] and h._push.mapping is None and h._push.size == 0
        assert h["empty"].shape == (0, 4)
        assert h.state_dict()["empty"].dtype == torch.float32
        assert h._segment_ranges() == []
        assert h.refresh() == []
    with client.fetch("small", world=5, rank=4, names=["tiny.bias", "empty"], mode="push") as h:
        assert [tuple(t.shape) for t in h.state_dict().values()] == [(0,), (0, 4)] or \
            sorted(tuple(t.shape) for t in h.state_dict().values()) == [(0,), (0, 4)]
    assert _wait_leases(client, base) == base


def test_concurrent_pushes(daemon, client):
    import concurrent.futures
    with client.fetch("small", world=3, rank=2, dtype="bf16") as shm:
        want = {k: st_io.tensor_bytes(v) for k, v in shm.state_dict().items()}

    def one(_):
        with client.fetch("small", world=3, rank=2, dtype="bf16", mode="push") as h:
            return {k: st_io.tensor_bytes(v) for k, v in h.state_dict().items()}
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        for got in pool.map(one, range(24)):
            assert got == want
    _serves(daemon, client)


@pytest.mark.parametrize("delta", [-1, +1])
def test_wrong_offsets_count_closes_the_connection(daemon, client, delta):
    base = _base_leases(client)
    resp, lengths = _grant(client, world=3, rank=1)
    offsets, size = _datasock.default_layout(lengths)
    fd = _memfd(size + 4096)
    sock = _connect(resp)
    try:
        if delta < 0:
            bad = offsets[:-1]
        else:
            bad = offsets + [-(-(size + 1) // ALIGN) * ALIGN]
        code, msg = _ask(sock, resp, [fd], bad)
        assert code == INVALID_ARGUMENT, (code, msg)
        assert _closed_by_peer(sock), "the daemon kept the connection open"
        assert os.pread(fd, 64, 0) == bytes(64), "a refused push wrote"
        # The header attached the lease to the connection; its close ended it.
        assert _wait_leases(client, base) == base, "the closed connection's lease stayed"
        with pytest.raises(Exception) as e:
            client._shards.Release(pb.ReleaseRequest(lease_id=resp.lease_id, token=resp.token),
                                   timeout=10)
        assert "NOT_FOUND" in str(e.value), e.value
    finally:
        sock.close()
        os.close(fd)
        _release(client, resp)
    assert _wait_leases(client, base) == base
    _serves(daemon, client)


@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("kind,want", [("token", PERMISSION_DENIED), ("lease", NOT_FOUND)])
def test_wrong_token_or_lease(daemon, client, kind, want, explicit):
    base = _base_leases(client)
    resp, lengths = _grant(client)
    offsets, size = _datasock.default_layout(lengths)
    fd = _memfd(size)
    sock = _connect(resp)
    try:
        offsets = offsets if explicit else None
        if kind == "token":
            token = bytes(b ^ 0x55 for b in bytes(resp.token))
            code, msg = _ask(sock, resp, [fd], offsets, token=token)
        else:
            code, msg = _ask(sock, resp, [fd], offsets, lease_id=resp.lease_id + 1000003)
        assert code == want, (code, msg)
        assert os.pread(fd, 64, 0) == bytes(64), "a refused push wrote"
        if explicit:
            # The daemon refuses on the header, before it reads the offsets
            # that follow, and closes the connection (the stream is lost).
            assert _closed_by_peer(sock), "the daemon kept the connection open"
            sock.close()
            sock = _connect(resp)
        # The lease (never attached: the header did not name it rightly) lives
        # on, and a good push of it follows (on the same connection when it
        # stayed open).
        assert _leases(client) == base + 1
        code, msg = _ask(sock, resp, [fd], offsets)
        assert code == OK, (code, msg)
    finally:
        sock.close()
        os.close(fd)
        _release(client, resp)
    assert _wait_leases(client, base) == base
    _serves(daemon, client)


# ---------------------------------------------------------------- races (256 MiB)


def _wait_first_write(fd, sock, timeout=20.0):
    """Polls until the daemon's first bytes show at offset 0 of `fd` (it
    passed its checks and is writing) or its reply is ready; True when
    written first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.pread(fd, 4, 0) != b"\0\0\0\0":
            return True
        r, _, _ = select.select([sock], [], [], 0)
        if r:
            return False
    raise AssertionError("the daemon wrote nothing within %gs" % timeout)


def test_write_sealed_mid_push(daemon, client, big):
    """The client seals its (shrink-sealed) destination against writes
    mid-push: OK (the push won the race) or ABORTED, never a crash; the
    daemon serves and pushes whole after it."""
    base = _base_leases(client)
    resp, lengths = _grant(client, big)
    _, size = _datasock.default_layout(lengths)
    assert size == BIG_BYTES
    fd = _memfd(size)
    sock = _connect(resp, timeout=60)
    try:
        _datasock.send_push(sock, resp.lease_id, bytes(resp.token), [fd])
        mid = _wait_first_write(fd, sock)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        code, msg, extra = _datasock.read_reply(sock)
        assert not extra
        assert code in (OK, ABORTED), "sealed mid-push (%s): got %s: %s" % (
            mid, weightd.errors.code_name(code), msg)
        assert os.fstat(fd).st_size == size
        print("write-sealed mid-push=%s -> %s %s" % (mid, weightd.errors.code_name(code), msg))
    finally:
        sock.close()
        os.close(fd)
        _release(client, resp)
    assert daemon.alive(), "weightd died:\n" + daemon.log()[-4000:]
    assert _wait_leases(client, base) == base
    _serves(daemon, client)
    with client.fetch(big, mode="push") as h:  # and pushes whole again
        t = h["big"]
        assert float(t[0, 0]) == 1.0 and float(t[-1, -1]) == float(BIG_SHAPE[0] * BIG_SHAPE[1])
    assert _wait_leases(client, base) == base


def test_sealed_destination_cannot_shrink_mid_push(daemon, client, big):
    """The race a shrink-mid-push once won (the daemon's pwrite grew the
    shrunk memfd back with pages charged to the daemon) is closed by the
    seal: while the 256 MiB push runs, every ftruncate of the client's to a
    smaller size fails with EPERM (it may wait behind the daemon's current
    write), the push answers OK, and the memfd keeps its size, its
    allocation (the daemon allocated nothing) and the bytes of a shm fetch.
    Up to 3 pushes, until a truncate is seen to fail with the push's last
    bytes still unwritten (so truly mid-push)."""
    base = _base_leases(client)
    zero = bytes(4)
    during = []  # per push: truncates refused before the tail was written
    for attempt in range(3):
        resp, lengths = _grant(client, big)
        _, size = _datasock.default_layout(lengths)
        assert size == BIG_BYTES
        fd = _memfd(size)
        blocks = os.fstat(fd).st_blocks
        assert blocks * 512 >= size
        sock = _connect(resp, timeout=60)
        try:
            _datasock.send_push(sock, resp.lease_id, bytes(resp.token), [fd])
            _wait_first_write(fd, sock)
            refused = mid = 0
            deadline = time.time() + 60
            while True:
                assert time.time() < deadline, "no reply to the push within 60 s"
                to = (4096, 0, size - 4096)[refused % 3]
                with pytest.raises(OSError) as e:
                    os.ftruncate(fd, to)
                assert e.value.errno == errno.EPERM, e.value
                refused += 1
                if os.pread(fd, 4, size - 4) == zero:
                    mid += 1
                if select.select([sock], [], [], 0)[0]:
                    break
            during.append((mid, refused))
            code, msg, extra = _datasock.read_reply(sock)
            assert not extra
            assert code == OK, "attempt %d: %s: %s" % (
                attempt, weightd.errors.code_name(code), msg)
            st = os.fstat(fd)
            assert st.st_size == size, "the sealed destination changed size to %d" % st.st_size
            assert st.st_blocks == blocks, "the push changed the destination's allocation"
            assert _seals(fd) & fcntl.F_SEAL_SHRINK
        finally:
            sock.close()
            _release(client, resp)
        try:
            with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as mp:
                got = np.frombuffer(mp, dtype=np.uint32)
                with client.fetch(big) as shm:
                    want = shm.numpy_dict()["big"].reshape(-1).view(np.uint32)
                    same = want.size == got.size and bool(np.array_equal(got, want))
                    del want
                del got
        finally:
            os.close(fd)
        assert same, "attempt %d: the pushed bytes differ from a shm fetch" % attempt
        if mid:
            break
    print("truncates refused (mid-push, in all) per push: %s" % during)
    assert any(m for m, _ in during), "no truncate landed mid-push in %d pushes" % len(during)
    assert _wait_leases(client, base) == base
    _serves(daemon, client)


_KILLED = textwrap.dedent("""
    import fcntl, os, socket, sys
    import weightd
    from weightd import _datasock
    from weightd.v1 import weightd_pb2 as pb
    c = weightd.Client(socket=sys.argv[1])
    resp = c._shards.Fetch(pb.FetchRequest(model=sys.argv[2], mesh_shape=[1], coord=[0],
                                           transport=pb.SHM))
    lengths = [t.length for t in resp.tensors]
    _, size = _datasock.default_layout(lengths)
    fd = os.memfd_create("killed-push", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    os.posix_fallocate(fd, 0, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(resp.data_socket)
    _datasock.send_push(sock, resp.lease_id, bytes(resp.token), [fd])
    print("pushing %d" % fd, flush=True)
    sock.recv(16)
    print("replied", flush=True)
    sys.stdin.read()
""")


def test_client_killed_mid_push(daemon, client, big):
    base = _base_leases(client)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(BUILD, "python"),
                                         env.get("PYTHONPATH", "")])
    child = subprocess.Popen([PYTHON, "-c", _KILLED, daemon.socket, big],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    spy = -1
    try:
        line = child.stdout.readline()
        assert line.startswith("pushing "), child.stderr.read() if child.poll() is not None \
            else line
        # A handle of our own on the child's memfd, to see the daemon write.
        spy = os.open("/proc/%d/fd/%d" % (child.pid, int(line.split()[1])), os.O_RDONLY)
        deadline = time.time() + 20
        while os.pread(spy, 4, 0) == b"\0\0\0\0" and time.time() < deadline:
            pass
        assert os.pread(spy, 4, 0) != b"\0\0\0\0", "the daemon never wrote the child's memfd"
        mid = os.pread(spy, 4, BIG_BYTES - 4) == b"\0\0\0\0"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        print("killed mid-push: %s" % mid)
    finally:
        if child.poll() is None:
            child.kill()
        child.communicate()
        if spy >= 0:
            os.close(spy)
    assert daemon.alive(), "weightd died:\n" + daemon.log()[-4000:]
    assert _wait_leases(client, base) == base, "the killed client's lease stayed"
    _serves(daemon, client)
    with client.fetch(big, world=2, rank=1, mode="push") as h:
        assert float(h["big"][-1, -1]) == float(BIG_SHAPE[0] * BIG_SHAPE[1])
    assert _wait_leases(client, base) == base


# ---------------------------------------------------------------- retry


def test_push_and_refresh_retry_across_a_restart(tmp_path):
    """fetch(mode="push") and refresh() issued while the daemon is down
    (SIGTERM) succeed once a new daemon is up on the same sockets."""
    root = str(tmp_path / "models")
    os.makedirs(root)
    g = torch.Generator().manual_seed(9)
    tensors = {"w": torch.randn(40, 24, generator=g), "b": torch.randn(24, generator=g)}
    path = os.path.join(root, "m.safetensors")
    st_io.save(tensors, path)
    workdir = str(tmp_path / "d")
    args = ["--preload", "m=" + path]
    d = Daemon(model_root=root, workdir=workdir, extra_args=args).start()
    client = weightd.Client(socket=d.socket)
    started = []

    def restart(delay=0.5):
        def run():
            time.sleep(delay)
            started.append(Daemon(model_root=root, workdir=workdir, extra_args=args).start())
        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t
    try:
        h = client.fetch("m", world=2, rank=1, mode="push")
        assert d.stop() == 0, d.log()
        t = restart()
        assert h.refresh() == []  # waits out the restart; nothing changed in generation 1
        t.join(60)
        assert h.generation == 1 and torch.equal(h["w"], tensors["w"][20:])
        h.release()
        assert started[0].stop() == 0
        t = restart()
        with client.fetch("m", world=2, rank=1, mode="push") as h:
            assert torch.equal(h["w"], tensors["w"][20:]) and torch.equal(h["b"], tensors["b"][12:])
        t.join(60)
        assert _wait_leases(client, 0) == 0
    finally:
        client.close()
        for x in [d] + started:
            x.stop()

"""The Python client package `weightd` against a real daemon: parity with
weightctl and PyTorch, zero copy and copy-on-write isolation on shm, the
meta-module loader, errors, and lease lifetime (release, context manager,
garbage collection, SIGKILL)."""
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import BUILD, Daemon  # noqa: E402
from harness import leases_open as _leases, wait_leases as _wait_leases  # noqa: E402
from reference import assert_matches_torch as _assert_matches_torch  # noqa: E402
import st_io  # noqa: E402

import weightd  # noqa: E402  (build/python, put on sys.path by harness)

PYTHON = sys.executable
_TORCH = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
BIG_ROWS, BIG_COLS = 4096, 4096  # 64 MiB of F32


def _small_checkpoint():
    g = torch.Generator().manual_seed(11)
    return {
        "emb.weight": torch.randn(37, 19, generator=g),              # 37 rows: uneven shards
        "half.weight": torch.randn(10, 6, generator=g).to(torch.bfloat16),
        "f16.weight": torch.randn(9, 5, generator=g).to(torch.float16),
        "dbl": torch.randn(7, 3, generator=g, dtype=torch.float64),
        "tiny.bias": torch.randn(3, generator=g),                    # fewer rows than ranks
        "scalar": torch.tensor(0.625),                               # 0-dim: replicated
        "empty": torch.zeros(0, 4),                                  # zero-size everywhere
        "ids": torch.arange(13, dtype=torch.int64),
        "mask": torch.tensor([True, False, True, True, False]),
        "special": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40,
                                 65520.0, 3.4e38, 1.0 + 2 ** -11]),
    }


class Net(nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.fc1 = nn.Linear(8, 16, device=device)
        self.norm = nn.LayerNorm(16, device=device)
        self.fc2 = nn.Linear(16, 4, device=device)
        self.register_buffer("scale", torch.empty(4, device=device))
        self.register_buffer("scratch", torch.zeros(2, device=device), persistent=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x)))) * self.scale


def _net_checkpoint():
    torch.manual_seed(3)
    ref = Net()
    with torch.no_grad():
        ref.scale.copy_(torch.tensor([1.0, -2.0, 0.5, 3.0]))
        ref.norm.weight.uniform_(0.5, 1.5)
        ref.norm.bias.uniform_(-0.1, 0.1)
    return ref, {k: v.clone() for k, v in ref.state_dict().items()}


@pytest.fixture(scope="module")
def daemon():
    # 4 KiB segments: the RSS figures below (VmRSS, RssShmem) do not count
    # hugetlb pages; test_huge_pages has the huge-page twins of these tests.
    d = Daemon(extra_args=["--huge-pages", "off"])
    d.start()
    try:
        d.small = _small_checkpoint()
        path = os.path.join(d.model_root, "small.safetensors")
        st_io.save(d.small, path)
        d.ctl_ok("load", "small", path)

        d.net_ref, net_sd = _net_checkpoint()
        path = os.path.join(d.model_root, "net.safetensors")
        st_io.save(net_sd, path)
        d.ctl_ok("load", "net", path)

        big = torch.arange(BIG_ROWS * BIG_COLS, dtype=torch.float32).reshape(BIG_ROWS, BIG_COLS)
        path = os.path.join(d.model_root, "big.safetensors")
        st_io.save({"big": big}, path)
        del big
        d.ctl_ok("load", "big", path)
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def client(daemon):
    c = weightd.Client(socket=daemon.socket)
    yield c
    c.close()


# ---------------------------------------------------------------- helpers


def _ref_piece(t, mesh, coord, placements, dtype):
    """PyTorch reference: Shard(d) = t[r*c : min(n, (r+1)*c)] in mesh-dim order."""
    if t.dim() > 0:
        for m, i, p in zip(mesh, coord, placements):
            if p < 0:
                continue
            n = t.shape[p]
            c = -(-n // m)
            idx = [slice(None)] * t.dim()
            idx[p] = slice(min(n, i * c), min(n, (i + 1) * c))
            t = t[tuple(idx)]
    if dtype is not None and t.is_floating_point():
        t = t.to(_TORCH[dtype])
    return t


def _raw(sd):
    return {k: (st_io._TO_ST[v.dtype], list(v.shape), st_io.tensor_bytes(v))
            for k, v in sd.items()}


def _ctl_fetch(d, model, args):
    out = os.path.join(d.workdir, "ctl-%d.safetensors" % os.getpid())
    d.ctl_ok("fetch", model, *args, "--out", out)
    got = st_io.load_raw(out)
    os.unlink(out)
    return {k: (v[0], list(v[1]), v[2]) for k, v in got.items()}


def _rss_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _inside(ptr, nbytes, ranges):
    return any(lo <= ptr and ptr + nbytes <= hi for lo, hi in ranges)


def _child_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(BUILD, "python"),
                                         env.get("PYTHONPATH", "")])
    return env


# ---------------------------------------------------------------- parity

WORLD_CASES = [(1, None), (2, "f32"), (3, "f16"), (4, "bf16"), (5, None)]


@pytest.mark.parametrize("transport", ["shm", "grpc"])
@pytest.mark.parametrize("world,dtype", WORLD_CASES)
def test_parity_world(daemon, client, transport, world, dtype):
    for rank in range(world):
        args = ["--world", world, "--rank", rank, "--transport", transport,
                "--dtype", dtype or "keep"]
        want_ctl = _ctl_fetch(daemon, "small", args)
        with client.fetch("small", world=world, rank=rank, dtype=dtype,
                          transport=transport) as h:
            sd = h.state_dict()
            assert h.generation == 1
            got = _raw(sd)
            assert got == want_ctl, "rank %d differs from weightctl" % rank
            ref = {k: _ref_piece(t, [world], [rank], [0], dtype) for k, t in daemon.small.items()}
            _assert_matches_torch(sd, ref, "rank %d" % rank)
            metas = {m.name: m for m in h.tensors}
            for name, t in daemon.small.items():
                m = metas[name]
                assert m.global_shape == tuple(t.shape)
                assert m.shape == tuple(sd[name].shape)
                assert len(m.digest) == 16
                if t.dim():
                    c = -(-t.shape[0] // world)
                    assert m.global_offset[0] == min(t.shape[0], rank * c) or m.shape[0] == 0


@pytest.mark.parametrize("transport", ["shm", "grpc"])
@pytest.mark.parametrize("placements,pl", [(None, [-1, 0]), ("S0,S0", [0, 0]),
                                           (["R", "R"], [-1, -1]), ("S0,R", [0, -1])])
def test_parity_mesh_2x2(daemon, client, transport, placements, pl):
    for i in range(2):
        for j in range(2):
            args = ["--mesh", "2x2", "--coord", "%d,%d" % (i, j), "--transport", transport,
                    "--dtype", "bf16"]
            if placements is not None:
                args += ["--placements", placements if isinstance(placements, str)
                         else ",".join(placements)]
            want_ctl = _ctl_fetch(daemon, "small", args)
            with client.fetch("small", mesh=(2, 2), coord=(i, j), placements=placements,
                              dtype="bf16", transport=transport) as h:
                sd = h.state_dict()
                assert _raw(sd) == want_ctl, "coord %d,%d differs from weightctl" % (i, j)
                ref = {k: _ref_piece(t, [2, 2], [i, j], pl, "bf16")
                       for k, t in daemon.small.items()}
                _assert_matches_torch(sd, ref, "coord %d,%d" % (i, j))


def test_fp8_and_numpy_views(daemon, client):
    """F8 comes as uint8 (torch 1.13); NumPy mode gives BF16 as uint16 bits."""
    want = _ctl_fetch(daemon, "small", ["--world", 2, "--rank", 1, "--dtype", "f8_e4m3"])
    with client.fetch("small", world=2, rank=1, dtype="f8_e4m3") as h:
        sd = h.state_dict()
        f8 = getattr(torch, "float8_e4m3fn", torch.uint8)
        assert sd["emb.weight"].dtype == f8
        assert set(sd) == set(want)
        for k, v in sd.items():
            assert want[k][1] == list(v.shape), k
            assert st_io.tensor_bytes(v) == want[k][2], k
    with client.fetch("small", world=3, rank=0) as h:
        nd, sd = h.numpy_dict(), h.state_dict()
        assert nd["half.weight"].dtype == np.uint16
        assert np.array_equal(nd["half.weight"], sd["half.weight"].view(torch.int16).numpy()
                              .view(np.uint16))
        assert nd["mask"].dtype == np.bool_ and nd["scalar"].shape == ()
        assert nd["empty"].shape == (0, 4)
        for k in nd:
            if k != "half.weight":
                assert np.array_equal(nd[k], sd[k].numpy(), equal_nan=nd[k].dtype.kind == "f")


def test_names_filter_and_metadata(client):
    with client.fetch("small", world=2, rank=0, names=["ids", "scalar"]) as h:
        assert sorted(h.names) == ["ids", "scalar"]
        sd = h.state_dict()
        assert sd["scalar"].shape == () and float(sd["scalar"]) == 0.625
        assert sd["ids"].tolist() == list(range(7))
        meta = {m.name: m for m in h.tensors}
        assert meta["ids"].dtype == "I64" and meta["ids"].global_shape == (13,)
        assert meta["ids"].global_offset == (0,)


# ---------------------------------------------------------------- zero copy


@pytest.mark.parametrize("dtype", [None, "f16"])
def test_zero_copy_pointers(client, dtype):
    with client.fetch("small", world=2, rank=1, dtype=dtype) as h:
        ranges = h._segment_ranges()
        assert ranges
        for name, t in h.state_dict().items():
            if t.numel() == 0:
                continue
            nbytes = t.numel() * t.element_size()
            assert _inside(t.data_ptr(), nbytes, ranges), name
        for name, a in h.numpy_dict().items():
            if a.size:
                assert _inside(a.__array_interface__["data"][0], a.nbytes, ranges), name


def test_zero_copy_rss(client):
    shard = BIG_ROWS * BIG_COLS * 4
    before = _rss_kib()
    h = client.fetch("big")
    sd = h.state_dict()
    t = sd["big"]
    grown = _rss_kib() - before
    assert t.shape == (BIG_ROWS, BIG_COLS)
    assert _inside(t.data_ptr(), shard, h._segment_ranges())
    assert grown * 1024 < shard // 8, "RSS grew by %d KiB fetching a %d MiB shard" % (
        grown, shard >> 20)
    # Touching every page makes them resident: the measurement is meaningful.
    assert float(t[-1, -1]) == BIG_ROWS * BIG_COLS - 1
    assert float(t.sum(dtype=torch.float64)) == (BIG_ROWS * BIG_COLS - 1) * BIG_ROWS * BIG_COLS / 2
    assert (_rss_kib() - before) * 1024 > shard // 2
    del t, sd
    h.release()


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError("no " + field)


def test_populate_maps_shared_pages_without_copying(client):
    shard = BIG_ROWS * BIG_COLS * 4
    anon, shmem = _status_kib("RssAnon"), _status_kib("RssShmem")
    with client.fetch("big", populate=True) as h:
        t = h.state_dict()["big"]
        # The page tables are filled: the daemon's pages count as shared
        # memory in this process, and nothing was copied into private memory.
        assert (_status_kib("RssShmem") - shmem) * 1024 >= shard * 9 // 10
        assert (_status_kib("RssAnon") - anon) * 1024 < shard // 8
        assert _inside(t.data_ptr(), shard, h._segment_ranges())
        assert float(t[-1, -1]) == BIG_ROWS * BIG_COLS - 1
        del t


# ---------------------------------------------------------------- copy on write


@pytest.mark.parametrize("dtype", [None, "f16"])  # a view of the base segment; a packed cast
def test_cow_two_handles(client, dtype):
    h1 = client.fetch("small", world=2, rank=0, dtype=dtype)
    h2 = client.fetch("small", world=2, rank=0, dtype=dtype)
    t1, t2 = h1.state_dict()["emb.weight"], h2.state_dict()["emb.weight"]
    orig = t2.clone()
    t1.add_(1)
    h1.numpy_dict()["ids"][:] = -5
    assert torch.equal(t1, orig + 1)
    assert torch.equal(t2, orig)
    assert torch.equal(h2.state_dict()["ids"], torch.arange(7))
    with client.fetch("small", world=2, rank=0, dtype=dtype) as h3:
        assert torch.equal(h3.state_dict()["emb.weight"], orig)
        assert torch.equal(h3.state_dict()["ids"], torch.arange(7))
    h1.release()
    h2.release()


_WRITER = textwrap.dedent("""
    import sys, torch, weightd
    c = weightd.Client(socket=sys.argv[1])
    h = c.fetch("small", world=2, rank=0, dtype=(sys.argv[2] if sys.argv[2] != "keep" else None))
    t = h.state_dict()["emb.weight"]
    t.add_(1000)
    print("wrote %r" % float(t.double().sum()), flush=True)
    sys.stdin.read()   # keep the mapping until the parent is done
""")


@pytest.mark.parametrize("dtype", ["keep", "f16"])
def test_cow_two_processes(daemon, client, dtype):
    with client.fetch("small", world=2, rank=0, dtype=None if dtype == "keep" else dtype) as h:
        mine = h.state_dict()["emb.weight"]
        orig = mine.clone()
        child = subprocess.Popen([PYTHON, "-c", _WRITER, daemon.socket, dtype],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=_child_env())
        try:
            line = child.stdout.readline()
            assert line.startswith("wrote "), child.stderr.read() if child.poll() else line
            child_sum = float(line.split()[1])
            assert abs(child_sum - float((orig.double() + 1000).sum())) < 1e-2 * orig.numel()
            assert torch.equal(mine, orig), "the other process's write leaked into ours"
            with client.fetch("small", world=2, rank=0,
                              dtype=None if dtype == "keep" else dtype) as h2:
                assert torch.equal(h2.state_dict()["emb.weight"], orig)
        finally:
            _, err = child.communicate(timeout=20)  # closes stdin: the child exits
        assert child.returncode == 0, err


# ---------------------------------------------------------------- meta-module loading


def test_load_into_meta_module(daemon, client):
    ref = daemon.net_ref
    with client.fetch("net") as h:
        model = Net(device="meta")
        res = weightd.load_into_module(model, h)
        assert list(res.missing_keys) == [] and list(res.unexpected_keys) == []
        ranges = h._segment_ranges()
        for name, p in model.named_parameters():
            assert isinstance(p, nn.Parameter) and p.requires_grad and not p.is_meta, name
            assert _inside(p.data_ptr(), p.numel() * p.element_size(), ranges), name
        assert not model.scale.is_meta
        assert _inside(model.scale.data_ptr(), 16, ranges)
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert torch.equal(model(x), ref(x))
        # gradients flow through the assigned parameters
        model(x).sum().backward()
        assert model.fc1.weight.grad is not None


def test_load_into_module_key_mismatch(client):
    names = [k for k in Net().state_dict() if k != "fc2.bias"]
    with client.fetch("net", names=names) as h:
        sd = dict(h.state_dict())
        sd["extra.thing"] = torch.zeros(1)
        plain = Net()
        want = plain.load_state_dict(sd, strict=False)
        got = weightd.load_into_module(Net(device="meta"), sd, strict=False)
        assert list(got.missing_keys) == list(want.missing_keys) == ["fc2.bias"]
        assert list(got.unexpected_keys) == list(want.unexpected_keys) == ["extra.thing"]
        with pytest.raises(RuntimeError) as ours:
            weightd.load_into_module(Net(device="meta"), sd, strict=True)
        with pytest.raises(RuntimeError) as theirs:
            Net().load_state_dict(sd, strict=True)
        assert str(ours.value) == str(theirs.value)
        assert 'Missing key(s) in state_dict: "fc2.bias"' in str(ours.value)
        assert 'Unexpected key(s) in state_dict: "extra.thing"' in str(ours.value)
        bad = dict(h.state_dict())
        bad["fc1.bias"] = torch.zeros(3)
        with pytest.raises(RuntimeError, match="size mismatch for fc1.bias"):
            weightd.load_into_module(Net(device="meta"), bad, strict=False)


# ---------------------------------------------------------------- control plane and errors


def test_control_plane(daemon, client):
    assert client.health() is True
    names = [m.name for m in client.list()]
    assert {"small", "net", "big"} <= set(names)
    info = client.info("small")
    assert info.generation == 1 and info.tensor_count == len(daemon.small)
    assert {t.name: t.shape for t in info.tensors} == {k: tuple(v.shape)
                                                      for k, v in daemon.small.items()}
    path = os.path.join(daemon.model_root, "small.safetensors")
    updates = []
    m = client.load("again", path, progress=updates.append)
    assert m.name == "again" and m.tensor_count == len(daemon.small)
    assert "again" in [x.name for x in client.list()]
    client.unload("again")
    assert "again" not in [x.name for x in client.list()]
    s = client.stats()
    assert s["models"] >= 3 and "bytes_served" in s


def test_errors(daemon, client):
    with pytest.raises(weightd.Error) as e:
        client.fetch("no-such-model")
    assert e.value.code == "NOT_FOUND" and "no-such-model" in e.value.message
    for kw in [dict(world=2, rank=2), dict(world=2, rank=-1), dict(mesh=(2, 2), coord=(0, 2))]:
        with pytest.raises(weightd.Error) as e:
            client.fetch("small", **kw)
        assert e.value.code == "INVALID_ARGUMENT", kw
    with pytest.raises(weightd.Error) as e:
        client.fetch("small", transport="grpc", world=3, rank=7)
    assert e.value.code == "INVALID_ARGUMENT"
    with pytest.raises(weightd.Error) as e:
        client.fetch("small", dtype="f12")
    assert e.value.code == "INVALID_ARGUMENT"
    with pytest.raises(weightd.Error) as e:
        client.fetch("small", placements="Q")
    assert e.value.code == "INVALID_ARGUMENT"
    for call in (lambda: client.info("nope"), lambda: client.unload("nope")):
        with pytest.raises(weightd.Error) as e:
            call()
        assert e.value.code == "NOT_FOUND"
    with pytest.raises(weightd.Error) as e:
        client.load("x", "/etc/passwd")
    assert e.value.code == "PERMISSION_DENIED"
    # Watch: the daemon answers UNIMPLEMENTED today; once implemented, no new
    # generation arrives within the deadline.
    with pytest.raises(weightd.Error) as e:
        with client.watch("small", timeout=2) as w:
            next(iter(w))
    assert e.value.code in ("UNIMPLEMENTED", "DEADLINE_EXCEEDED")
    assert client.health() is True
    assert _leases(client) == 0


# ---------------------------------------------------------------- leases


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_release_and_context_manager(client, transport):
    base = _leases(client)
    h = client.fetch("small", world=2, rank=1, transport=transport)
    assert _leases(client) == base + 1
    kept = h.state_dict()["emb.weight"]
    want = kept.clone()
    h.release()
    assert _leases(client) == base
    assert h.released
    h.release()  # idempotent
    with pytest.raises(weightd.Error) as e:
        h.state_dict()
    assert e.value.code == "FAILED_PRECONDITION"
    assert torch.equal(kept, want)  # tensors kept past release stay readable

    with client.fetch("small", transport=transport) as h:
        assert _leases(client) == base + 1
    assert _leases(client) == base
    with pytest.raises(KeyError):
        with client.fetch("small", transport=transport) as h:
            h["no such tensor"]
    assert _leases(client) == base


def test_lease_follows_tensors_on_gc(client):
    base = _leases(client)
    sd = client.fetch("small").state_dict()  # handle dropped at once
    assert _leases(client) == base + 1, "tensors alive: lease must stay"
    assert float(sd["scalar"]) == 0.625
    del sd
    assert _wait_leases(client, base, timeout=5.0) == base


_HOLDER = textwrap.dedent("""
    import sys, time, weightd
    h = weightd.Client(socket=sys.argv[1]).fetch("small", world=2, rank=1)
    h.state_dict()
    print("ready", flush=True)
    time.sleep(120)
""")


def test_sigkill_releases_lease(daemon, client):
    base = _leases(client)
    child = subprocess.Popen([PYTHON, "-c", _HOLDER, daemon.socket], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=_child_env())
    try:
        line = child.stdout.readline()
        assert line.strip() == "ready", child.stderr.read() if child.poll() is not None else line
        assert _leases(client) == base + 1
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        assert _wait_leases(client, base, timeout=3.0) == base, "lease survived SIGKILL"
    finally:
        if child.poll() is None:
            child.kill()
        child.communicate()
    assert client.health() is True


NO_TORCH = r"""
import sys
class _Block:
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is hidden for this test")
sys.meta_path.insert(0, _Block())
sys.path.insert(0, sys.argv[1])
import numpy as np
import weightd
c = weightd.Client(socket=sys.argv[2])
with c.fetch("small", world=2, rank=1) as h:
    sd = h.state_dict()
    assert all(isinstance(v, np.ndarray) for v in sd.values()), {k: type(v) for k, v in sd.items()}
    print(sorted((k, list(v.shape)) for k, v in sd.items()))
"""


def test_numpy_only_when_torch_is_absent(daemon, client):
    r = subprocess.run(["/usr/bin/python3", "-c", NO_TORCH, os.path.join(BUILD, "python"),
                        daemon.socket], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    with client.fetch("small", world=2, rank=1) as h:
        want = sorted((k, list(v.shape)) for k, v in h.numpy_dict().items())
    assert r.stdout.strip() == str(want)

"""Huge-page segments (--huge-pages, docs/memory.md) against a real
daemon and the host's real 2 MiB hugetlb pool, PyTorch as the reference.

Needs free pages in the pool: scripts/test.sh reserves them when asked
(WEIGHTD_TEST_HUGEPAGES=N; .ci/run asks for 256) and gives them back after
the run; without them every test here skips, saying so. CTest runs this
module alone (RUN_SERIAL): the free-page counts it asserts are the host's.

- auto: checkpoint segments and packed materializations on hugetlb pages;
  shm (export), push and grpc fetches from the Python client and weightctl
  (the C++ client) equal PyTorch's cast-and-shard, LoRA and dense patches
  equal the PyTorch merge; the client maps them 2 MiB-aligned with 2 MiB
  kernel pages (PMD mappings), populate= fills its page tables, writes stay
  private (copy on write).
- require with a pool too small (the test holds the rest of it): the load
  fails RESOURCE_EXHAUSTED naming the shortfall, nothing half-loaded (the
  pool's free pages are back), the daemon serves on.
- auto with a pool that runs out in the middle of a load: the rest falls
  back to 4 KiB pages, counted and logged, and the bytes are the same.
- unload and release: the pool's free pages, the daemon's fds and its
  resident bytes back to their baseline.
"""
import json
import mmap
import os
import sys
import time

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import Daemon, wait_leases  # noqa: E402
from reference import assert_matches_torch, cast_shard_ref  # noqa: E402
import st_io  # noqa: E402
import test_lora_parity as lora  # noqa: E402  (its adapter writers, reference and comparison)

import weightd  # noqa: E402

HUGE = 2 << 20
POOL = "/sys/kernel/mm/hugepages/hugepages-2048kB"
NEED_PAGES = 96   # this module's peak, with room to spare
_TORCH = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _pool():
    """(free less reserved, total) pages of the host's 2 MiB pool; (0, 0) without one."""
    try:
        with open(os.path.join(POOL, "free_hugepages")) as f:
            free = int(f.read())
        with open(os.path.join(POOL, "resv_hugepages")) as f:
            resv = int(f.read())
        with open(os.path.join(POOL, "nr_hugepages")) as f:
            total = int(f.read())
    except OSError:
        return 0, 0
    return free - resv, total


_free0, _total0 = _pool()
pytestmark = pytest.mark.skipif(
    _free0 < NEED_PAGES,
    reason="needs %d free 2 MiB hugetlb pages, the host has %d of %d (scripts/test.sh "
           "reserves a pool with WEIGHTD_TEST_HUGEPAGES=N)" % (NEED_PAGES, _free0, _total0))


def _wait_pool(want, timeout=10.0):
    """The pool's free pages once they are `want` (a released map is
    unmapped a moment after the daemon sees the lease end)."""
    deadline = time.time() + timeout
    while time.time() < deadline and _pool()[0] != want:
        time.sleep(0.05)
    return _pool()[0]


class PoolHold:
    """Takes all but `leave` of the pool's free pages for this process (a
    shared hugetlb memfd map reserves its pages when mapped)."""

    def __init__(self, leave):
        free, _ = _pool()
        self.pages = free - leave
        assert self.pages > 0, "pool has %d free pages, cannot leave %d" % (free, leave)
        self.fd = os.memfd_create("weightd-test-hold", os.MFD_HUGETLB)
        os.ftruncate(self.fd, self.pages * HUGE)
        self.map = mmap.mmap(self.fd, self.pages * HUGE, flags=mmap.MAP_SHARED)
        assert _pool()[0] == leave, "pool: %d free after holding %d" % (_pool()[0], self.pages)

    def close(self):
        self.map.close()
        os.close(self.fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _stats(d):
    with weightd.Client(socket=d.socket) as c:
        return c.stats()


def _fds(d):
    """Memory fds (memfds, hugetlb ones included) the daemon holds open. Sockets, epoll and
    eventfds come and go with gRPC's threads and connections and are not counted."""
    n, base = 0, "/proc/%d/fd" % d.proc.pid
    for fd in os.listdir(base):
        try:
            n += "memfd:" in os.readlink(os.path.join(base, fd))
        except FileNotFoundError:
            pass
    return n


def _smaps_entry(addr):
    """(KernelPageSize kB, header line) of the mapping of this process holding `addr`."""
    with open("/proc/self/smaps") as f:
        entry = None
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                entry = line.strip() if lo <= addr < hi else None
            elif entry is not None and head[0] == "KernelPageSize:":
                return int(head[1]), entry
    raise AssertionError("no mapping holds %#x" % addr)


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError("no " + field)


# ------------------------------------------------------------------ models


def _core_checkpoint():
    g = torch.Generator().manual_seed(19)
    return {
        "w1": torch.randn(1024, 2048, generator=g),                           # 8 MiB F32
        "w2": torch.randn(2048, 1024, generator=g).to(torch.bfloat16),        # 4 MiB BF16
        "emb": (torch.randn(1001, 1027, generator=g) * 300).to(torch.float16),  # odd rows
        "bias": torch.randn(37, generator=g),
        "ids": torch.arange(1 << 19, dtype=torch.int64),                      # 4 MiB I64
        "special": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40,
                                 65520.0, 3.4e38, 1.0 + 2 ** -11]),
    }


UP, DOWN = "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"


def _lora_base():
    g = torch.Generator().manual_seed(7)
    return {UP + ".weight": torch.randn(2048, 1024, generator=g) * 0.05,
            DOWN + ".weight": torch.randn(1024, 2048, generator=g) * 0.05,
            "model.norm.weight": 1 + torch.randn(1024, generator=g) * 0.1}


def _lora_adapters(root):
    """A PEFT LoRA on up_proj (r 8, alpha 16) and a FastVideo dense .diff on
    down_proj, with the ops the reference (test_lora_parity.reference) applies."""
    g = torch.Generator().manual_seed(8)
    a = (torch.randn(8, 1024, generator=g) * 0.2).to(torch.bfloat16)
    b = (torch.randn(2048, 8, generator=g) * 0.2).to(torch.bfloat16)
    peft = lora.Adapter("up", None)
    peft.ops.append(("lora", UP + ".weight", a.float(), b.float(), 16 / 8, False))
    peft.path = lora._peft_dir(root, "up", {"r": 8, "lora_alpha": 16, "target_modules": ["up_proj"]},
                               {"base_model.model.%s.lora_A.weight" % UP: a,
                                "base_model.model.%s.lora_B.weight" % UP: b})
    diff = torch.randn(1024, 2048, generator=g) * 0.01
    dense = lora.Adapter("dn", os.path.join(root, "dn.safetensors"), "dense")
    dense.ops.append(("add", DOWN + ".weight", diff))
    st_io.save({DOWN + ".diff": diff}, dense.path)
    return [peft, dense]


@pytest.fixture(scope="module")
def daemon():
    d = Daemon(extra_args=["--huge-pages", "auto"])
    d.start()
    try:
        d.core = _core_checkpoint()
        path = os.path.join(d.model_root, "core.safetensors")
        st_io.save(d.core, path)
        d.free_before_load = _pool()[0]
        d.ctl_ok("load", "core", path)
        d.free_after_load = _pool()[0]
        d.lora_base = {"lora16": {k: v.to(torch.bfloat16) for k, v in _lora_base().items()},
                       "lora32": _lora_base()}
        for name, ck in d.lora_base.items():
            st_io.save(ck, os.path.join(d.model_root, name + ".safetensors"))
            d.ctl_ok("load", name, os.path.join(d.model_root, name + ".safetensors"))
        root = os.path.join(d.model_root, "adapters")
        os.makedirs(root)
        d.adapters = {}
        for ad in _lora_adapters(root):
            args = ["adapter", "load", ad.name, ad.path]
            if ad.fmt != "auto":
                args += ["--format", ad.fmt]
            d.ctl_ok(*args)
            d.adapters[ad.name] = ad
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def client(daemon):
    c = weightd.Client(socket=daemon.socket)
    yield c
    c.close()


# ------------------------------------------------------------------ auto


def test_auto_puts_checkpoint_on_hugetlb(daemon, client):
    info = client.info("core")
    stored = sum(len(st_io.tensor_bytes(t)) for t in daemon.core.values())
    # One segment of the file's data section, rounded up to 2 MiB pages.
    assert info.segment_bytes_hugetlb >= stored and info.segment_bytes_hugetlb % HUGE == 0, info
    assert info.segment_bytes_4k == 0 and info.segment_bytes_thp == 0, info
    assert daemon.free_before_load - daemon.free_after_load == info.segment_bytes_hugetlb // HUGE
    s = client.stats()
    assert s["huge_pages"] == "auto"
    assert s["segment_bytes_hugetlb"] >= info.segment_bytes_hugetlb
    assert s["hugetlb_pages_total"] == _pool()[1] and s["hugetlb_pages_free"] == _pool()[0]
    assert s["huge_page_fallbacks"] == 0
    r = daemon.ctl_ok("info", "core")
    assert "segment_bytes: 4k=0 thp=0 hugetlb=%d" % info.segment_bytes_hugetlb in r.stdout
    r = daemon.ctl_ok("stats")
    assert "segment_bytes_hugetlb: %d" % s["segment_bytes_hugetlb"] in r.stdout, r.stdout
    assert "huge_pages: auto" in r.stdout
    # The start-up line says what the host offered.
    assert "host_pages" in daemon.log()


CASES = [(1, 0, None), (2, 1, None), (2, 0, "bf16"), (4, 3, "f16"), (4, 1, "f32"), (2, 1, "f16")]


@pytest.mark.parametrize("transport,mode", [("shm", None), ("shm", "push"), ("grpc", None)])
@pytest.mark.parametrize("world,rank,dtype", CASES)
def test_python_fetch_matches_torch(daemon, client, transport, mode, world, rank, dtype):
    with client.fetch("core", world=world, rank=rank, dtype=dtype, transport=transport,
                      mode=mode) as h:
        got = h.state_dict()
        ref = {k: cast_shard_ref(t, world, rank, _TORCH.get(dtype)) for k, t in daemon.core.items()}
        assert_matches_torch(got, ref, "core %s/%s %d/%d %s" % (transport, mode, world, rank, dtype))
        del got


def test_materializations_on_hugetlb(daemon, client):
    before = client.stats()
    # A cast the cache has not seen yet: w1 as bf16 over 1 rank packs 4 MiB.
    with client.fetch("core", dtype="bf16", names=["w1"]) as h:
        assert_matches_torch(h.state_dict(), {"w1": daemon.core["w1"].to(torch.bfloat16)}, "w1 bf16")
    after = client.stats()
    assert after["materialization_bytes"] > before["materialization_bytes"]
    assert after["segment_bytes_hugetlb"] - before["segment_bytes_hugetlb"] >= 4 << 20
    assert after["huge_page_fallbacks"] == 0


@pytest.mark.parametrize("world,rank,dtype", [(1, 0, "keep"), (2, 1, "bf16"), (4, 2, "f32")])
@pytest.mark.parametrize("transport", ["shm", "push", "grpc"])
def test_weightctl_fetch_matches_torch(daemon, world, rank, dtype, transport):
    out = os.path.join(daemon.workdir, "ctl-%s-%d-%d-%s.safetensors" % (transport, world, rank, dtype))
    daemon.ctl_ok("fetch", "core", "--world", world, "--rank", rank, "--dtype", dtype,
                  "--transport", transport, "--verify", "--out", out)
    got = st_io.load(out)
    os.unlink(out)
    ref = {k: cast_shard_ref(t, world, rank, _TORCH.get(dtype)) for k, t in daemon.core.items()}
    assert_matches_torch(got, ref, "weightctl %s %d/%d %s" % (transport, world, rank, dtype))


def test_client_maps_pmd_aligned_and_populates(daemon, client):
    hugetlb_kib = _status_kib("HugetlbPages")
    with client.fetch("core", populate=True) as h:
        ranges = h._segment_ranges()
        assert ranges
        for lo, hi in ranges:
            assert lo % HUGE == 0, "segment mapped at %#x, not 2 MiB-aligned" % lo
            kib, head = _smaps_entry(lo)
            assert kib == 2048, "KernelPageSize %d kB for %s" % (kib, head)
            assert "memfd:weightd:checkpoint" in head, head
        t = h.state_dict()["w1"]
        # populate= filled this process's page tables with the daemon's pages
        grown = (_status_kib("HugetlbPages") - hugetlb_kib) * 1024
        assert grown >= t.numel() * 4, "HugetlbPages grew by %d bytes" % grown
        assert torch.equal(t, daemon.core["w1"])
        del t


def test_copy_on_write_stays_private(daemon, client):
    with client.fetch("core", names=["w1"]) as h:
        t = h.state_dict()["w1"]
        free = _pool()[0]
        t[0, 0] = 12345.0   # copies the 2 MiB page, privately
        assert float(t[0, 0]) == 12345.0
        assert _pool()[0] == free - 1, "the private copy comes from the pool"
        del t
    with client.fetch("core", names=["w1"]) as h:
        assert torch.equal(h.state_dict()["w1"], daemon.core["w1"])


def _lora_raw(daemon, model, world, rank, dtype, transport):
    out = os.path.join(daemon.workdir, "lora-%s-%d-%d-%s-%s.safetensors" % (model, world, rank,
                                                                             dtype, transport))
    daemon.ctl_ok("fetch", model, "--world", world, "--rank", rank, "--dtype", dtype,
                  "--transport", transport, "--out", out)
    got = st_io.load_raw(out)
    os.unlink(out)
    return got


@pytest.mark.parametrize("stack", [[("up", 1.0)], [("up", 0.5), ("dn", 1.0)]],
                         ids=["lora", "lora_and_dense"])
def test_lora_merge_on_hugetlb_matches_torch(daemon, client, stack):
    resolved = [(daemon.adapters[n], s) for n, s in stack]
    failures, ulps = [], {}
    for model, base in daemon.lora_base.items():
        before = client.stats()["segment_bytes_hugetlb"]
        daemon.ctl_ok("apply", model, *["%s:%r" % (n, s) for n, s in stack])
        merged, kinds = lora.reference(base, resolved)
        for world, rank, dtype in ((1, 0, "keep"), (2, 1, "bf16"), (2, 0, "f32")):
            if model == "lora32" and dtype == "f32":
                dtype = "f16"
            for transport in ("shm", "push"):
                got = _lora_raw(daemon, model, world, rank, dtype, transport)
                assert sorted(got) == sorted(base), sorted(got)
                for name, raw in got.items():
                    src = merged.get(name, base[name])
                    out_dt = lora._REQ[dtype] if dtype != "keep" else base[name].dtype
                    piece = lora._piece(src, world, rank, 0)
                    key = (model, dtype, name)
                    counts = ulps.setdefault(key, [0, 0]) if out_dt != torch.float32 else None
                    try:
                        lora._compare("%s %s %d/%d %s %s" % (model, name, world, rank, dtype,
                                                            transport),
                                      raw, piece.to(out_dt), kinds.get(name) != "lowrank",
                                      counts, piece.float().contiguous(),
                                      1e-6 * float(src.abs().max()))
                    except AssertionError as ex:
                        failures.append(str(ex))
        # The merged tensors (8 and 4 MiB) were packed into hugetlb segments.
        assert client.stats()["segment_bytes_hugetlb"] > before, model
    assert not failures, "\n".join(failures[:20])
    for key, (bad, total) in ulps.items():
        assert bad <= lora.ULP_FRACTION * total, "%s: %d of %d elements off by 1 ulp" % (
            key, bad, total)
    for model in daemon.lora_base:
        daemon.ctl_ok("apply", model)   # back to the base


# ------------------------------------------------------------------ the pool runs short


def _multi_file_checkpoint(root, name, files=3):
    """`files` safetensors files of ~3 MiB each (2 hugetlb pages per
    segment with --checkpoint-segment-bytes 2 MiB) and their index."""
    g = torch.Generator().manual_seed(23)
    d = os.path.join(root, name)
    os.makedirs(d)
    tensors, weight_map = {}, {}
    for i in range(files):
        part = {"layer%d.weight" % i: torch.randn(768, 1024, generator=g),
                "layer%d.bias" % i: torch.randn(1024, generator=g).to(torch.bfloat16)}
        fname = "model-%05d-of-%05d.safetensors" % (i + 1, files)
        st_io.save(part, os.path.join(d, fname))
        tensors.update(part)
        weight_map.update({k: fname for k in part})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return d, tensors


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("multi"))
    return (root,) + _multi_file_checkpoint(root, "m3")


def test_require_fails_whole_load_naming_the_shortfall(multi):
    root, path, tensors = multi
    with Daemon(model_root=root, extra_args=["--huge-pages", "require",
                                             "--checkpoint-segment-bytes", str(HUGE)]) as d:
        base_fds, base_bytes = _fds(d), _stats(d)["bytes_resident"]
        with PoolHold(leave=3):
            r = d.ctl("load", "m3", path)
            assert r.returncode != 0 and r.error_code == "RESOURCE_EXHAUSTED", r.stderr
            msg = r.error_message
            assert "--huge-pages=require" in msg and "needs 2 2 MiB huge pages" in msg, msg
            assert "free of" in msg and "vm.nr_hugepages" in msg, msg
            # Nothing half-loaded: the first segment's pages are back.
            assert _wait_pool(3) == 3
            s = _stats(d)
            assert s["models"] == 0 and s["segment_bytes_hugetlb"] == 0, s
            assert s["bytes_resident"] == base_bytes and _fds(d) == base_fds
            assert d.ctl("list").returncode == 0 and d.alive()
        # With the pool back the same load succeeds, every segment on hugetlb.
        d.ctl_ok("load", "m3", path)
        with weightd.Client(socket=d.socket) as c:
            info = c.info("m3")
            assert info.segment_bytes_hugetlb == 3 * 2 * HUGE and info.segment_bytes_4k == 0, info
            with c.fetch("m3", world=2, rank=1, dtype="bf16") as h:
                ref = {k: cast_shard_ref(t, 2, 1, torch.bfloat16) for k, t in tensors.items()}
                assert_matches_torch(h.state_dict(), ref, "m3 on require")


def test_auto_pool_exhausted_mid_load_falls_back(multi):
    root, path, tensors = multi
    with Daemon(model_root=root, extra_args=["--huge-pages", "auto",
                                             "--checkpoint-segment-bytes", str(HUGE)]) as d:
        with PoolHold(leave=3):
            d.ctl_ok("load", "m3", path)
            with weightd.Client(socket=d.socket) as c:
                info = c.info("m3")
                # The first segment took 2 of the 3 pages, the others 4 KiB.
                assert info.segment_bytes_hugetlb == 2 * HUGE, info
                assert info.segment_bytes_4k >= 2 * 3 << 20, info
                s = c.stats()
                assert s["huge_page_fallbacks"] >= 2, s
                assert _pool()[0] == 1
                for world, rank, dtype in ((1, 0, None), (2, 1, "bf16"), (4, 3, "f16")):
                    with c.fetch("m3", world=world, rank=rank, dtype=dtype) as h:
                        ref = {k: cast_shard_ref(t, world, rank, _TORCH.get(dtype))
                               for k, t in tensors.items()}
                        assert_matches_torch(h.state_dict(), ref, "m3 mixed %d/%d" % (world, rank))
        log = d.log()
        assert log.count("huge_pages_fallback") == 1, "logged once"


def test_release_and_unload_return_pool_fds_and_memory(multi):
    root, path, tensors = multi
    with Daemon(model_root=root, extra_args=["--huge-pages", "auto"]) as d:
        free0, fds0 = _pool()[0], _fds(d)
        bytes0 = _stats(d)["bytes_resident"]
        with weightd.Client(socket=d.socket) as c:
            c.load("m3", path)
            handles = [c.fetch("m3", world=2, rank=r, dtype="f16") for r in range(2)]
            sds = [h.state_dict() for h in handles]
            assert _pool()[0] < free0
            assert _fds(d) > fds0  # the checkpoint's and the casts' memfds are counted
            c.unload("m3")
            # Leases keep the pages until released.
            assert float(sds[1]["layer2.weight"][-1, -1]) == float(
                tensors["layer2.weight"].to(torch.float16)[-1, -1])
            del sds
            for h in handles:
                h.release()
            assert wait_leases(c, 0) == 0
            assert _wait_pool(free0) == free0
            s = c.stats()
            assert s["segment_bytes_hugetlb"] == 0 and s["bytes_resident"] == bytes0, s
        deadline = time.time() + 10
        while time.time() < deadline and _fds(d) != fds0:
            time.sleep(0.05)
        assert _fds(d) == fds0


# ------------------------------------------------------------------ publish staging (issue 38 H1)


def _punch(fd, offset, length):
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    if libc.fallocate(fd, 3, offset, length) != 0:   # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
        raise OSError(ctypes.get_errno(), "fallocate(PUNCH_HOLE)")


def test_publisher_punching_hugetlb_staging_and_draining_the_pool_kills_nothing(tmp_path):
    """Issue 38 H1: a publisher takes its session's hugetlb staging memfd,
    punches a 2 MiB page out of it and takes every free page of the pool.
    The daemon's streamed copy into that page, and the commit's digest of a
    page punched after it was written in place, used to die on SIGBUS. Now
    that session fails FAILED_PRECONDITION naming the page, its pages go
    back to the pool, and the daemon serves and publishes on."""
    from weightd import _datasock
    g = torch.Generator().manual_seed(38)
    base = {"big": torch.randn(1024, 1024, generator=g), "small": torch.randn(8, 8, generator=g)}
    path = str(tmp_path / "p.safetensors")
    st_io.save(base, path)
    with Daemon(model_root=str(tmp_path), extra_args=["--huge-pages", "auto",
                                                      "--publish-staging-ahead", "off"]) as d, \
            weightd.Client(socket=d.socket) as c:
        c.load("p", path)
        free0 = _pool()[0]
        resident = c.stats()["bytes_resident"]
        new = {"big": torch.randn(1024, 1024, generator=g), "small": torch.randn(8, 8, generator=g)}
        raw = {n: t.reshape(-1).view(torch.uint8).numpy() for n, t in new.items()}

        # Streamed copies into a punched page with the pool drained.
        s = c.begin_publish("p", new)
        assert s.staging_bytes % HUGE == 0 and _pool()[0] == free0 - s.staging_bytes // HUGE
        fd = _datasock.stage(d.data_socket, s.session, bytes.fromhex(s.token))
        _punch(fd, 0, HUGE)
        with PoolHold(leave=0):
            with pytest.raises(weightd.Error) as e:
                c._write_publish(s, [(0, [(0, raw["big"].size)], raw["big"])])
            assert d.alive(), d.log()[-2000:]
        os.close(fd)
        assert e.value.code == "FAILED_PRECONDITION", e.value
        assert "staging page at offset 0 could not be faulted in" in e.value.message, e.value
        assert "huge-page pool is exhausted" in e.value.message

        # Written in place, a page punched after, the pool drained, declared:
        # the commit finds the page gone before it reads it.
        s = c.begin_publish("p", new)
        fd = _datasock.stage(d.data_socket, s.session, bytes.fromhex(s.token))
        mm = mmap.mmap(fd, s.staging_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        for i, n in enumerate(new):
            mm[s.offsets[i]:s.offsets[i] + raw[n].size] = raw[n].tobytes()
        mm.close()
        _punch(fd, HUGE, HUGE)
        os.close(fd)
        from weightd.v1 import weightd_pb2 as pb
        declare = pb.PublishChunk(session=s.session, token=s.token, in_place=True, runs=[
            pb.PublishRun(tensor=i, offset=0, length=raw[n].size) for i, n in enumerate(new)])
        with PoolHold(leave=0):
            with pytest.raises(weightd.Error) as e:
                try:
                    c._models.PublishWrite(iter([declare]))
                except Exception as err:  # grpc.RpcError
                    raise weightd.errors.from_grpc(err) from None
            assert d.alive(), d.log()[-2000:]
        assert e.value.code == "FAILED_PRECONDITION", e.value
        assert "a writer punched %d bytes of pages out of its staging memfd" % HUGE in e.value.message

        # Neither published anything; their pages are back in the pool.
        assert c.info("p").generation == 1
        assert c.stats()["publish_sessions"] == 0
        assert c.stats()["bytes_resident"] == resident
        assert _wait_pool(free0) == free0
        # The next publish and fetch work, on hugetlb staging again.
        r = c.publish("p", new, transport="shm")
        assert r.generation == 2 and r.changed == 2, r
        with c.fetch("p") as h:
            got = h.state_dict()
            assert all(torch.equal(got[n], new[n]) for n in new)

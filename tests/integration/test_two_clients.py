"""Two client processes fetching different ranks of the same model at the same
time, many rounds, over shm (view and cast) and grpc; every result equals the
PyTorch reference, no lease is left open afterwards and the daemon stays healthy."""
import os
import subprocess
import sys
import threading

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import Daemon, WEIGHTCTL  # noqa: E402
import st_io  # noqa: E402

MODEL = "two"
WORLD = 2
ROUNDS = 20
# (transport, --dtype): zero-copy view, packed casts over shm, a cast over grpc
VARIANTS = [("shm", "keep"), ("shm", "bf16"), ("shm", "f16"), ("grpc", "bf16")]
_TORCH = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
_ST = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64"}


def _ref_bytes(t, rank, req):
    n = t.shape[0] if t.dim() else 0
    if t.dim():
        c = -(-n // WORLD)
        t = t[min(n, rank * c):min(n, (rank + 1) * c)]
    if req != "keep" and t.is_floating_point():
        t = t.to(_TORCH[req])
    return _ST[t.dtype], list(t.shape), st_io.tensor_bytes(t)


@pytest.fixture(scope="module")
def daemon():
    d = Daemon()
    d.start()
    try:
        g = torch.Generator().manual_seed(7)
        ck = {
            "big.weight": torch.randn(1023, 257, generator=g),           # ~1 MiB F32
            "big.half": torch.randn(515, 300, generator=g).to(torch.bfloat16),
            "small.bias": torch.randn(3, generator=g),                 # rank 1 gets 1 row
            "norm.scale": torch.tensor(1.5),
            "ids": torch.arange(11, dtype=torch.int64),
        }
        path = os.path.join(d.model_root, "two.safetensors")
        st_io.save(ck, path)
        d.ctl_ok("load", MODEL, path)
        d.ck = ck
        yield d
    finally:
        d.stop()


def _client(d, rank, errors, barrier):
    """One client: ROUNDS rounds over VARIANTS, each a separate weightctl process."""
    try:
        barrier.wait(timeout=30)
        for rnd in range(ROUNDS):
            for tr, req in VARIANTS:
                out = os.path.join(d.workdir, "r%d.safetensors" % rank)
                p = subprocess.run([WEIGHTCTL, "--socket", d.socket, "fetch", MODEL, "--world",
                                    str(WORLD), "--rank", str(rank), "--dtype", req,
                                    "--transport", tr, "--out", out],
                                   capture_output=True, text=True, timeout=60)
                if p.returncode != 0:
                    errors.append("rank %d round %d %s/%s: exit %d: %s" % (
                        rank, rnd, tr, req, p.returncode, p.stderr.strip()))
                    return
                got = st_io.load_raw(out)
                if set(got) != set(d.ck):
                    errors.append("rank %d round %d %s/%s: names %s" % (rank, rnd, tr, req,
                                                                       sorted(got)))
                    return
                for name, t in d.ck.items():
                    want = _ref_bytes(t, rank, req)
                    if tuple(got[name]) != (want[0], want[1], want[2]):
                        errors.append("rank %d round %d %s/%s: %s differs (%s %s vs %s %s)" % (
                            rank, rnd, tr, req, name, got[name][0], got[name][1], want[0],
                            want[1]))
                        return
    except Exception as e:  # noqa: BLE001 - reported by the main thread
        errors.append("rank %d: %r" % (rank, e))


def test_two_clients_concurrent(daemon):
    errors = []
    barrier = threading.Barrier(WORLD)
    threads = [threading.Thread(target=_client, args=(daemon, r, errors, barrier))
               for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "clients hung"
    assert not errors, "\n".join(errors)
    assert daemon.alive(), daemon.log()[-4000:]
    assert daemon.ctl("health").returncode == 0
    stats = daemon.ctl_ok("stats").stdout
    kv = {k.strip(): v.strip() for k, v in (l.split(":", 1) for l in stats.splitlines() if ":" in l)}
    assert int(kv["leases_open"]) == 0, stats
    assert int(kv["fetches"]) >= WORLD * ROUNDS * len(VARIANTS), stats


def test_lockstep_pairs(daemon):
    """Both ranks' processes started together in each round (Popen before either waits)."""
    for rnd in range(ROUNDS):
        for tr, req in VARIANTS:
            procs = []
            for rank in range(WORLD):
                out = os.path.join(daemon.workdir, "p%d.safetensors" % rank)
                procs.append((rank, out, subprocess.Popen(
                    [WEIGHTCTL, "--socket", daemon.socket, "fetch", MODEL, "--world", str(WORLD),
                     "--rank", str(rank), "--dtype", req, "--transport", tr, "--out", out],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
            for rank, out, p in procs:
                _, err = p.communicate(timeout=60)
                assert p.returncode == 0, "round %d rank %d %s/%s: %s" % (rnd, rank, tr, req, err)
                got = st_io.load_raw(out)
                assert set(got) == set(daemon.ck)
                for name, t in daemon.ck.items():
                    assert tuple(got[name]) == _ref_bytes(t, rank, req), \
                        "round %d rank %d %s/%s: %s differs" % (rnd, rank, tr, req, name)
    assert daemon.ctl("health").returncode == 0
    stats = daemon.ctl_ok("stats").stdout
    kv = {k.strip(): v.strip() for k, v in (l.split(":", 1) for l in stats.splitlines() if ":" in l)}
    assert int(kv["leases_open"]) == 0, stats

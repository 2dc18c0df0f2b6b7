"""One conformance suite for both clients: the C++ client (through weightctl)
and the Python package fetch the same requests on both transports and must
hand out the same tensors — names, dtypes, local shapes and bytes — and, on
the grpc transport, read only the tensors' ranges, never whole segments (a
view-backed tensor lives in a segment that may hold its whole checkpoint)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import Daemon  # noqa: E402
import st_io  # noqa: E402

import weightd  # noqa: E402  (build/python, put on sys.path by harness)

BIG = 4 << 20   # floats: a 16 MiB tensor beside the small ones


def _checkpoint():
    g = torch.Generator().manual_seed(5)
    return {
        "big.weight": torch.randn(BIG // 1024, 1024, generator=g),
        "emb.weight": torch.randn(37, 19, generator=g),
        "half.weight": torch.randn(10, 6, generator=g).to(torch.bfloat16),
        "tiny.bias": torch.randn(3, generator=g),
        "scalar": torch.tensor(0.625),
        "empty": torch.zeros(0, 4),
        "ids": torch.arange(13, dtype=torch.int64),
    }


@pytest.fixture(scope="module")
def daemon():
    d = Daemon()
    st_io.save(_checkpoint(), os.path.join(d.model_root, "m.safetensors"))
    d.start()
    d.ctl_ok("load", "m", os.path.join(d.model_root, "m.safetensors"))
    yield d
    d.stop()


def _cpp_fetch(d, tmp_path, transport, world, rank, dtype, names, placements):
    out = str(tmp_path / ("cpp-%s.safetensors" % transport))
    args = ["fetch", "m", "--world", world, "--rank", rank, "--transport", transport,
            "--out", out]
    if dtype:
        args += ["--dtype", dtype]
    if names:
        args += ["--names", ",".join(names)]
    if placements:
        args += ["--placements", placements]
    d.ctl_ok(*args)
    return st_io.load_raw(out)


def _py_fetch(d, transport, world, rank, dtype, names, placements):
    with weightd.Client(socket=d.socket) as c:
        with c.fetch("m", world=world, rank=rank, dtype=dtype, transport=transport,
                     names=names or None, placements=placements) as h:
            out = {}
            for t in h.tensors:
                arr = h.numpy_dict()[t.name]
                out[t.name] = (t.dtype, list(t.shape), arr.tobytes())
            return out


REQUESTS = [
    dict(world=1, rank=0, dtype=None, names=[], placements=None),
    dict(world=3, rank=1, dtype="bf16", names=[], placements=None),
    dict(world=4, rank=3, dtype="f16", names=["emb.weight", "tiny.bias", "empty"],
         placements=None),
    dict(world=2, rank=1, dtype=None, names=["emb.weight", "half.weight", "scalar"],
         placements="S1"),
]


@pytest.mark.parametrize("transport", ["shm", "grpc"])
@pytest.mark.parametrize("req", range(len(REQUESTS)))
def test_both_clients_hand_out_the_same_tensors(daemon, tmp_path, transport, req):
    q = REQUESTS[req]
    cpp = _cpp_fetch(daemon, tmp_path, transport, **q)
    py = _py_fetch(daemon, transport, **q)
    assert set(cpp) == set(py), (sorted(cpp), sorted(py))
    for name in cpp:
        assert cpp[name][0] == py[name][0], name
        assert list(cpp[name][1]) == list(py[name][1]), name
        assert cpp[name][2] == py[name][2], name


def _bytes_read(d):
    with weightd.Client(socket=d.socket) as c:
        return c.stats()["bytes_read"]


@pytest.mark.parametrize("client", ["cpp", "python"])
def test_grpc_transport_reads_only_the_tensor_ranges(daemon, tmp_path, client):
    """emb.weight (37x19 f32, 2812 bytes) is a view into the checkpoint's
    segment, which also holds the 16 MiB big.weight."""
    q = dict(world=1, rank=0, dtype=None, names=["emb.weight", "tiny.bias"], placements=None)
    before = _bytes_read(daemon)
    if client == "cpp":
        got = _cpp_fetch(daemon, tmp_path, "grpc", **q)
    else:
        got = _py_fetch(daemon, "grpc", **q)
    read = _bytes_read(daemon) - before
    want = _checkpoint()
    assert got["emb.weight"][2] == st_io.tensor_bytes(want["emb.weight"])
    assert got["tiny.bias"][2] == st_io.tensor_bytes(want["tiny.bias"])
    # The two ranges (and what lies between them, under the 64 KiB merge
    # gap), never the 16 MiB segment.
    assert 37 * 19 * 4 + 3 * 4 <= read <= (1 << 17), read

"""The Python client package's own units, without a daemon: the channel
options and retry constants its policy module gives (the module and its
generator are checked against client/policy/client_policy.json with both
clients in tests/conformance/test_client_policy.py), the
shard box math a sharded publish writes by
(PyTorch's torch.chunk as the reference), the health response decoder,
imports that stay lazy (no torch, no CUDA driver on `import weightd`), and
the package's size rules (no module over 420 lines, no function over 80)."""
import ast
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import BUILD, REPO  # noqa: E402

import weightd  # noqa: E402  (build/python, put on sys.path by harness)
from weightd import _channel, _health, _policy, _shard  # noqa: E402

PACKAGE = os.path.join(REPO, "client", "python", "weightd")


# ---------------------------------------------------------------- policy


def test_client_still_offers_the_retry_constants():
    # weightd.client has always offered them; the generated module itself is
    # checked against the JSON in tests/conformance/test_client_policy.py.
    assert weightd.client.RETRY_INITIAL_BACKOFF == _policy.RETRY_INITIAL_BACKOFF
    assert weightd.client.RETRY_JITTER == _policy.RETRY_JITTER


def test_channel_options_come_from_the_policy():
    opts = dict(_channel.channel_options(30.0, [("grpc.primary_user_agent", "x")]))
    assert opts["grpc.max_receive_message_length"] == _policy.MAX_MESSAGE
    assert opts["grpc.enable_retries"] == 1
    assert opts["grpc.service_config"] == _policy.SERVICE_CONFIG
    assert opts["grpc.initial_reconnect_backoff_ms"] == int(_policy.RETRY_INITIAL_BACKOFF * 1000)
    assert opts["grpc.max_reconnect_backoff_ms"] == int(_policy.RETRY_MAX_BACKOFF * 1000)
    assert opts["grpc.primary_user_agent"] == "x"
    off = dict(_channel.channel_options(0))
    assert off["grpc.enable_retries"] == 0 and "grpc.service_config" not in off


# ---------------------------------------------------------------- shard boxes


def _torch_piece(t, mesh, coord, placements):
    """The rank's local shard by torch.chunk, as fetch serves it."""
    for m, p in enumerate(placements):
        if p >= 0 and t.dim():
            pieces = torch.chunk(t, mesh[m], dim=p)
            t = pieces[coord[m]] if coord[m] < len(pieces) else t.narrow(p, t.shape[p], 0)
    return t


@pytest.mark.parametrize("shape,mesh,placements", [
    ((37, 19), (4,), (0,)),
    ((37, 19), (3,), (1,)),
    ((10, 6, 5), (2, 3), (0, 2)),
    ((10, 6, 5), (2, 3), (-1, 1)),
    ((3,), (8,), (0,)),             # more ranks than rows: empty tails
    ((0, 4), (2,), (0,)),
    ((), (2, 2), (0, -1)),          # a scalar is replicated whatever the placements
    ((7, 9), (2, 2), (1, 1)),       # one dim sharded twice
])
def test_box_math_matches_torch_chunk(shape, mesh, placements):
    numel = 1
    for d in shape:
        numel *= d
    t = torch.arange(numel, dtype=torch.int32).reshape(shape)
    whole = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    writers = {}
    for coord in [tuple(int(c) for c in idx) for idx in np.ndindex(*mesh)]:
        offset, size, writes = _shard.local_box(list(shape), mesh, coord, placements)
        want = _torch_piece(t, mesh, coord, placements)
        assert list(size) == list(want.shape), (coord, size, want.shape)
        got = b"".join(whole[at:at + n] for at, n in _shard.box_runs(list(shape), offset, size, 4))
        assert got == want.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), coord
        if writes and want.numel():
            key = (tuple(offset), tuple(size))
            assert key not in writers, "two ranks write the same piece"
            writers[key] = coord
    # Every element is written by exactly one rank.
    covered = sum(len(b"".join(whole[at:at + n] for at, n in _shard.box_runs(
        list(shape), list(o), list(s), 4))) for o, s in writers)
    assert covered == len(whole)


def test_local_box_refuses_a_dim_the_tensor_lacks():
    with pytest.raises(weightd.Error) as e:
        _shard.local_box([4, 4], (2,), (0,), (2,))
    assert e.value.code == "INVALID_ARGUMENT" and "Shard(2)" in e.value.message


# ---------------------------------------------------------------- health


def _varint(v):
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


@pytest.mark.parametrize("status", [0, 1, 2, 3, 300])
def test_health_decoder_reads_status_among_unknown_fields(status):
    unknown = (_varint(2 << 3 | 0) + _varint(1 << 40) +          # varint
               _varint(3 << 3 | 1) + b"\x01" * 8 +               # fixed64
               _varint(4 << 3 | 2) + _varint(3) + b"abc" +       # length-delimited
               _varint(5 << 3 | 5) + b"\x02" * 4)                # fixed32
    body = unknown + (_varint(1 << 3 | 0) + _varint(status) if status else b"")
    assert _health._decode_health_response(body) == status
    assert _health._decode_health_response(b"") == 0


@pytest.mark.parametrize("body", [b"\x08", b"\x08\x80", b"\x0b", b"\x80"])
def test_health_decoder_refuses_truncated_or_bad_input(body):
    with pytest.raises(ValueError):
        _health._decode_health_response(body)


# ---------------------------------------------------------------- imports and sizes


def test_import_loads_neither_torch_nor_the_cuda_driver():
    code = ("import sys, weightd, weightd.client, weightd._cuda, weightd._delivery\n"
            "from weightd._cuda import libcuda\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "assert libcuda._driver is None, 'CUDA driver loaded'\n"
            "assert weightd._cuda.export and weightd._datasock.push and weightd._dtypes\n")
    env = dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr


def _sources():
    for root, _, files in os.walk(PACKAGE):
        for f in sorted(files):
            if f.endswith(".py"):
                yield os.path.join(root, f)


def test_modules_and_functions_stay_small():
    """House rule (issue 40): no module over 420 lines, no function over 80
    (nested functions count inside theirs)."""
    too_big = []
    for path in _sources():
        with open(path) as f:
            text = f.read()
        rel = os.path.relpath(path, PACKAGE)
        if text.count("\n") > 420:
            too_big.append("%s: %d lines" % (rel, text.count("\n")))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if node.end_lineno - start + 1 > 80:
                    too_big.append("%s:%d %s: %d lines" % (rel, node.lineno, node.name,
                                                          node.end_lineno - start + 1))
    assert not too_big, too_big

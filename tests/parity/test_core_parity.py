"""Core PyTorch parity: sharding (DTensor Shard/Replicate = torch.chunk rule),
dtype casts (tensor.to(dtype), bit for bit) and FP8 (c10 conversion), through
the real weightd + weightctl, over every transport: shm (the daemon's
segments), grpc (streamed) and push (the daemon writes into the client's
own memfd: the host twin of the CUDA push).

One daemon and one checkpoint for the whole module; fetches run a few at a
time in parallel to keep the runtime short.
"""
import concurrent.futures
import itertools
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import Daemon  # noqa: E402
import st_io  # noqa: E402
from reference import (FP8_FN as _FP8_FN, _same_bits, chunk_range, fp8_bytes,  # noqa: E402
                       fp8e4m3fn_from_fp32_value, fp8e5m2_from_fp32_value, shard_ref)

MODEL = "core"
WORLDS = (1, 2, 3, 4, 7)
CAST_DTYPES = ("keep", "f32", "f16", "bf16")
FP8_DTYPES = ("f8_e4m3", "f8_e5m2")
TRANSPORTS = ("shm", "grpc", "push")
PARALLEL = 8

_REQ_TORCH = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
_REQ_ST = {"f32": "F32", "f16": "F16", "bf16": "BF16", "f8_e4m3": "F8_E4M3", "f8_e5m2": "F8_E5M2"}
_FLOAT_TORCH = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "BOOL": 1,
             "F8_E4M3": 1, "F8_E5M2": 1}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def test_fp8_reference_port_sanity():
    """Spot values of the c10 algorithms (documented e4m3fn / e5m2 encodings)."""
    e4, e5 = fp8e4m3fn_from_fp32_value, fp8e5m2_from_fp32_value
    assert e4(1.0) == 0x38 and e4(-2.0) == 0xC0 and e4(448.0) == 0x7E
    assert e4(464.0) == 0x7E          # tie -> even (448)
    assert e4(float("inf")) == 0x7F and e4(float("nan")) & 0x7F == 0x7F
    assert e4(2.0 ** -9) == 0x01 and e4(2.0 ** -10) == 0x00 and e4(3 * 2.0 ** -10) == 0x02
    assert e4(-0.0) == 0x80
    assert e5(1.0) == 0x3C and e5(57344.0) == 0x7B and e5(65536.0) == 0x7C
    assert e5(61440.0) == 0x7C        # tie -> even (inf)
    assert e5(-float("inf")) == 0xFC and e5(float("nan")) == 0x7F
    assert e5(2.0 ** -16) == 0x01 and e5(2.0 ** -17) == 0x00 and e5(3 * 2.0 ** -17) == 0x02


# --------------------------------------------------------------------------
# Checkpoint
# --------------------------------------------------------------------------
SHAPES = {"w73": [7, 3], "v5": [5], "empty04": [0, 4], "scalar": [], "c382": [3, 8, 2],
          "d104": [10, 4], "e15": [1, 5]}
STORE = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64}

_SPECIAL_VALUES = [
    0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"),
    3.4028234663852886e38, -3.4028234663852886e38, 2.0 ** -126, 1.0, -1.0, 0.1, 1.0 / 3, -2.5,
    70000.0, -70000.0, -65520.0, 65520.0, 65504.0, 65519.0, 65536.0, 1e10, -1e30,
    # F16 rounding ties (ulp at 1 is 2^-10; at 2048 it is 2)
    1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, -(1 + 2.0 ** -11), 2049.0, 2051.0, 1 + 2.0 ** -11 + 2.0 ** -20,
    # BF16 rounding ties (ulp at 1 is 2^-7)
    1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 3 * 2.0 ** -8), 1 + 2.0 ** -8 + 2.0 ** -20, 257.0, 259.0,
    # F16 subnormals and underflow
    2.0 ** -24, 3 * 2.0 ** -25, 2.0 ** -25, 2.0 ** -26, 5 * 2.0 ** -26, -2.0 ** -24, -3 * 2.0 ** -25,
    2.0 ** -14, 2.0 ** -14 - 2.0 ** -24, 1e-8, -1e-8, 1e-30,
    # F32 subnormals
    1e-40, 1e-45, -1e-40, 2.0 ** -149, 2.0 ** -127,
    # FP8 boundaries (e4m3fn: max 448, NaN from 464+; e5m2: max 57344, inf from 61440)
    448.0, 464.0, 470.0, 480.0, 500.0, -448.0, 57344.0, 61440.0, 60000.0, -61439.0,
    2.0 ** -6, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -14, 2.0 ** -16, 2.0 ** -17,
    3 * 2.0 ** -17, 0.3, 17.5, 18.5, -240.0,
]
# Extra F64-only values: double rounding through F32 (1 + 2^-11 + 2^-40 -> F16 1.0),
# F32 overflow / underflow, F32 ties.
_F64_EXTRA = [
    1 + 2.0 ** -11 + 2.0 ** -40, -(1 + 2.0 ** -11 + 2.0 ** -40), 1 + 2.0 ** -8 + 2.0 ** -40,
    2049 + 2.0 ** -30, 1 + 2.0 ** -24, 1 + 2.0 ** -24 + 2.0 ** -50, 1e300, -1e300, 1e-310,
    5e-324, -5e-324, 3.4028235677973366e38, 3.4028234e38, 464 + 2.0 ** -30, 61440 - 2.0 ** -30,
    2.0 ** -25 + 2.0 ** -60, 0.1,
]
_F16_EXTRA_BITS = [0x0000, 0x8000, 0x0001, 0x8001, 0x0003, 0x03FF, 0x0400, 0x7BFF, 0xFBFF,
                   0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE00, 0x3C00, 0x3C01, 0x3C04, 0x3C0C,
                   0x3C0D, 0x5FBF, 0x5FC0, 0x1400]
_BF16_EXTRA_BITS = [0x0000, 0x8000, 0x0001, 0x807F, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC0,
                    0xFFC0, 0x7F81, 0x3380, 0x3340, 0x33C0, 0x3320, 0x4780, 0x477F, 0x477F,
                    0x4770, 0x43E8, 0x43F0, 0x3F81]


def _special(store):
    f32 = torch.tensor(_SPECIAL_VALUES, dtype=torch.float64).to(torch.float32)
    snan = torch.tensor(np.array([0x7FA00001, 0xFF800001], dtype=np.uint32).view(np.float32))
    f32 = torch.cat([f32, snan])
    if store == "f32":
        return f32
    if store == "f64":
        return torch.cat([torch.tensor(_SPECIAL_VALUES + _F64_EXTRA, dtype=torch.float64),
                          snan.to(torch.float64)])
    bits = _F16_EXTRA_BITS if store == "f16" else _BF16_EXTRA_BITS
    extra = torch.tensor(np.array(bits, dtype=np.uint16).view(np.int16)).view(STORE[store])
    return torch.cat([f32.to(STORE[store]), extra])


def build_checkpoint():
    g = torch.Generator().manual_seed(20240607)
    ck = {}
    for sname, sdt in STORE.items():
        for tname, shape in SHAPES.items():
            t = torch.randn(shape, generator=g, dtype=torch.float64)
            if tname == "d104":   # wide dynamic range: overflow/underflow in the narrow types
                t = t * torch.exp2(torch.randint(-30, 20, shape, generator=g).to(torch.float64))
            ck["%s.%s" % (sname, tname)] = t.to(sdt)
        ck["%s.special" % sname] = _special(sname)
    ck["i64.idx"] = torch.tensor([[0, -1], [2 ** 62, -2 ** 63], [7, 8], [9, 10], [11, 12], [13, 14]],
                                 dtype=torch.int64)
    ck["bool.mask"] = torch.tensor([True, False, True, True, False, False, True, False, True])
    return ck


# --------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------
def expected(t, stored_st, req):
    """(dtype_str, shape, bytes) the daemon must write for tensor piece t."""
    if t.dtype not in _FLOAT_TORCH or req == "keep":
        return stored_st, list(t.shape), st_io.tensor_bytes(t)
    if req in _FP8_FN:
        return _REQ_ST[req], list(t.shape), fp8_bytes(t, req)
    return _REQ_ST[req], list(t.shape), st_io.tensor_bytes(t.to(_REQ_TORCH[req]))


def _nan_mask(dt, data):
    n = len(data) // _ITEMSIZE[dt]
    if dt == "F64":
        return np.isnan(np.frombuffer(data, dtype=np.float64, count=n))
    if dt == "F32":
        return np.isnan(np.frombuffer(data, dtype=np.float32, count=n))
    if dt == "F16":
        return np.isnan(np.frombuffer(data, dtype=np.float16, count=n))
    if dt == "BF16":
        return (np.frombuffer(data, dtype=np.uint16, count=n) & 0x7FFF) > 0x7F80
    if dt == "F8_E4M3":
        return (np.frombuffer(data, dtype=np.uint8, count=n) & 0x7F) == 0x7F
    if dt == "F8_E5M2":
        return (np.frombuffer(data, dtype=np.uint8, count=n) & 0x7F) > 0x7C
    return np.zeros(n, dtype=bool)


def compare(name, got, exp, src=None):
    """Assert got == exp (both (dtype_str, shape, bytes)); NaN positions only by NaN-ness."""
    gdt, gshape, gdata = got
    edt, eshape, edata = exp
    assert gdt == edt, "%s: dtype %s, expected %s" % (name, gdt, edt)
    assert list(gshape) == list(eshape), "%s: shape %s, expected %s" % (name, gshape, eshape)
    assert len(gdata) == len(edata), "%s: %d bytes, expected %d" % (name, len(gdata), len(edata))
    if gdata == edata:
        return
    gn, en = _nan_mask(gdt, gdata), _nan_mask(edt, edata)
    u = _UINT[_ITEMSIZE[gdt]]
    gi = np.frombuffer(gdata, dtype=u)
    ei = np.frombuffer(edata, dtype=u)
    bad = np.nonzero((gn != en) | (~en & (gi != ei)))[0]
    if len(bad):
        srcv = ""
        if src is not None and src.dtype in _FLOAT_TORCH:
            flat = src.detach().reshape(-1).to(torch.float64)
            srcv = " source values %s" % [flat[i].item() for i in bad[:6]]
        raise AssertionError("%s (%s): %d element(s) differ at %s: got %s expected %s%s" % (
            name, gdt, len(bad), bad[:6].tolist(), [hex(int(gi[i])) for i in bad[:6]],
            [hex(int(ei[i])) for i in bad[:6]], srcv))


# --------------------------------------------------------------------------
# Fixture and fetch helpers
# --------------------------------------------------------------------------
class Env:
    def __init__(self, d, ck, stored):
        self.d = d
        self.ck = ck
        self.stored = stored   # name -> stored dtype string
        self.outdir = os.path.join(d.workdir, "out")
        os.makedirs(self.outdir, exist_ok=True)
        self._n = itertools.count()

    def out(self):
        return os.path.join(self.outdir, "o%06d.safetensors" % next(self._n))

    def fetch_many(self, arglists):
        """Run `weightctl fetch MODEL *args --out F` for each arglist, PARALLEL at a time.
        Returns [(args, CtlResult, out_path)] in input order."""
        jobs = [(list(map(str, a)), self.out()) for a in arglists]

        def run(job):
            args, out = job
            return args, self.d.ctl("fetch", MODEL, *args, "--out", out), out

        with concurrent.futures.ThreadPoolExecutor(PARALLEL) as ex:
            return list(ex.map(run, jobs))


@pytest.fixture(scope="module")
def env():
    d = Daemon()
    d.start()
    try:
        ck = build_checkpoint()
        path = os.path.join(d.model_root, "core.safetensors")
        st_io.save(ck, path)
        stored = {k: v[0] for k, v in st_io.load_raw(path).items()}
        d.ctl_ok("load", MODEL, path)
        yield Env(d, ck, stored)
        assert d.alive(), "weightd died during the parity suite: " + d.log()[-4000:]
    finally:
        d.stop()


def check_fetch(env, args, res, out, mesh, coord, placements, req, names=None):
    assert res.returncode == 0, "fetch %s failed (%d): %s" % (" ".join(args), res.returncode,
                                                              res.stderr)
    got = st_io.load_raw(out)
    want_names = set(names) if names is not None else set(env.ck)
    assert set(got) == want_names, "fetch %s: names differ: extra %s missing %s" % (
        " ".join(args), sorted(set(got) - want_names), sorted(want_names - set(got)))
    for name in sorted(want_names):
        t = env.ck[name]
        piece = shard_ref(t, mesh, coord, placements)
        assert piece is not None
        compare("%s [%s]" % (name, " ".join(args)), got[name],
                expected(piece, env.stored[name], req), src=piece)


def _read(path):
    with open(path, "rb") as f:
        return f.read()


# --------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------
def test_reference_self_checks():
    # docs/DESIGN.md §2.1 examples of the chunk rule
    assert [chunk_range(10, 4, r)[1] - chunk_range(10, 4, r)[0] for r in range(4)] == [3, 3, 3, 1]
    assert [chunk_range(5, 4, r)[1] - chunk_range(5, 4, r)[0] for r in range(4)] == [2, 2, 1, 0]
    assert [chunk_range(0, 4, r)[1] - chunk_range(0, 4, r)[0] for r in range(4)] == [0, 0, 0, 0]
    # torch rounds F64 to F32 before F16/BF16 (the docs/DESIGN.md §2.3 example)
    x = torch.tensor([1 + 2.0 ** -11 + 2.0 ** -40], dtype=torch.float64)
    assert x.to(torch.float16).item() == 1.0
    assert torch.tensor([2049 + 2.0 ** -30], dtype=torch.float64).to(torch.float16).item() == 2048.0


def test_checkpoint_listed(env):
    r = env.d.ctl_ok("info", MODEL)
    lines = [l for l in r.stdout.splitlines() if l.startswith("tensor:")]
    assert len(lines) == len(env.ck)
    for l in lines:
        head, dt, shape = l.split("\t")[:3]
        name = head[len("tensor:"):].strip()
        assert dt == env.stored[name]
        assert shape == "[" + ",".join(str(s) for s in env.ck[name].shape) + "]"


@pytest.mark.parametrize("req", CAST_DTYPES + FP8_DTYPES)
def test_world_shards(env, req):
    """--world W --rank R for every W in WORLDS and every rank, every transport;
    the files of all transports identical."""
    cases = [(w, r, tr) for w in WORLDS for r in range(w) for tr in TRANSPORTS]
    results = env.fetch_many([["--world", w, "--rank", r, "--dtype", req, "--transport", tr]
                              for w, r, tr in cases])
    by_case = {}
    for (w, r, tr), (args, res, out) in zip(cases, results):
        check_fetch(env, args, res, out, [w], [r], ["S0"], req)
        by_case[(w, r, tr)] = out
    for w in WORLDS:
        for r in range(w):
            for tr in TRANSPORTS[1:]:
                assert _read(by_case[(w, r, "shm")]) == _read(by_case[(w, r, tr)]), \
                    "world %d rank %d dtype %s: shm and %s files differ" % (w, r, req, tr)


MESHES = {"2x2": [2, 2], "2x3": [2, 3]}
# (label, --placements value or None for the default, restrict to ndim >= 2)
PLACEMENTS = [("default", None, False), ("S0,S1", "S0,S1", True), ("S0,S0", "S0,S0", False),
              ("R,R", "R,R", False), ("S1,R", "S1,R", True)]


@pytest.mark.parametrize("mesh", sorted(MESHES))
@pytest.mark.parametrize("plabel,pval,nd2", PLACEMENTS, ids=[p[0] for p in PLACEMENTS])
def test_mesh_shards(env, mesh, plabel, pval, nd2):
    shape = MESHES[mesh]
    placements = pval.split(",") if pval else ["R", "S0"]
    names = None
    if nd2:   # Shard(1) needs ndim >= 2; 0-dim tensors are always replicated (kept in the list)
        names = sorted(n for n, t in env.ck.items() if t.dim() >= 2 or t.dim() == 0)
    cases = []
    for coord in itertools.product(*[range(m) for m in shape]):
        for req in ("keep", "f16", "bf16"):
            for tr in TRANSPORTS:
                args = ["--mesh", mesh, "--coord", ",".join(map(str, coord)), "--dtype", req,
                        "--transport", tr]
                if pval:
                    args += ["--placements", pval]
                if names:
                    args += ["--names", ",".join(names)]
                cases.append((list(coord), req, tr, args))
    results = env.fetch_many([c[3] for c in cases])
    files = {}
    for (coord, req, tr, _), (args, res, out) in zip(cases, results):
        check_fetch(env, args, res, out, shape, coord, placements, req, names=names)
        files.setdefault((tuple(coord), req), []).append(_read(out))
    for key, blobs in files.items():
        for tr, blob in zip(TRANSPORTS[1:], blobs[1:]):
            assert blobs[0] == blob, "mesh %s %s %s: shm and %s files differ" % (
                mesh, plabel, key, tr)


def test_mesh_hsdp_replicas_identical(env):
    """Default HSDP (R,S0): coords (0,j) and (1,j) get the same bytes."""
    cases = [["--mesh", "2x3", "--coord", "%d,%d" % (i, j), "--dtype", "bf16"]
             for j in range(3) for i in range(2)]
    res = env.fetch_many(cases)
    for k in range(0, len(res), 2):
        assert res[k][1].returncode == 0 and res[k + 1][1].returncode == 0
        assert _read(res[k][2]) == _read(res[k + 1][2])


def test_shard_dim_out_of_range_is_invalid_argument(env):
    for pval in ("S0,S1", "S1,R", "R,S2"):
        r = env.d.ctl("fetch", MODEL, "--mesh", "2x2", "--coord", "0,1", "--placements", pval,
                      "--out", env.out())
        assert r.returncode != 0, "placements %s on 1-D tensors should fail" % pval
        assert r.error_code == "INVALID_ARGUMENT", r.stderr
    # a 3-D tensor accepts S2
    name = "f32.c382"
    r = env.d.ctl("fetch", MODEL, "--mesh", "2x2", "--coord", "1,1", "--placements", "R,S2",
                  "--names", name, "--out", env.out())
    assert r.returncode == 0, r.stderr
    assert env.d.ctl("health").returncode == 0


def test_bad_flags_are_invalid_argument(env):
    for args in (["--dtype", "f7"], ["--mesh", "2y2", "--coord", "0,0"],
                 ["--mesh", "2x2", "--coord", "0,0", "--placements", "R,Q1"],
                 ["--mesh", "2x2", "--coord", "0,0", "--placements", "S0"],
                 ["--transport", "carrier-pigeon"]):
        r = env.d.ctl("fetch", MODEL, *args, "--out", env.out())
        assert r.returncode != 0 and r.error_code == "INVALID_ARGUMENT", (args, r.stderr)
    assert env.d.ctl("health").returncode == 0


def test_fetch_twice_identical(env):
    """Same request twice (view path and packed/cached path) -> identical files."""
    reqs = []
    for w, r in ((1, 0), (3, 1), (4, 3), (7, 6)):
        for req in ("keep", "bf16", "f16", "f8_e4m3"):
            reqs.append(["--world", w, "--rank", r, "--dtype", req])
    first = env.fetch_many(reqs)
    second = env.fetch_many(reqs)
    for (args, r1, o1), (_, r2, o2) in zip(first, second):
        assert r1.returncode == 0 and r2.returncode == 0, (r1.stderr, r2.stderr)
        assert _read(o1) == _read(o2), "fetch %s twice gave different bytes" % " ".join(args)


def test_no_leases_left_and_healthy(env):
    assert env.d.ctl("health").returncode == 0
    stats = env.d.ctl_ok("stats").stdout
    kv = dict(l.split(":", 1) for l in stats.splitlines() if ":" in l)
    assert int(kv["leases_open"]) == 0, stats

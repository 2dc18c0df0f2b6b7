"""The C++ client's DLPack views (weightd::ToDLPack) taken by PyTorch's own
DLPack importer (torch.utils.dlpack.from_dlpack) in one process: the bytes,
dtypes (F32/F64/F16/BF16/ints/bool) and shapes equal an shm fetch of the
Python client, a view keeps its shard set (and lease) alive after the
program dropped its own hold, and the lease ends when the last view goes.

The C++ side is tests/integration/dlpack_probe.cc (build/tests/
libweightd_dlpack_probe.so); it runs in a subprocess that imports torch
and no gRPC of its own (the daemon's Python client runs here).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import BUILD, SANITIZE, Daemon  # noqa: E402
from harness import wait_leases as _wait_leases  # noqa: E402
import st_io  # noqa: E402

import weightd  # noqa: E402  (build/python, put on sys.path by harness)

PROBE = os.path.join(BUILD, "tests", "libweightd_dlpack_probe.so")

CHILD = r"""
import ctypes, gc, json, sys, torch
from torch.utils.dlpack import from_dlpack
lib = ctypes.CDLL(sys.argv[1])
lib.weightd_probe_fetch.restype = ctypes.c_void_p
lib.weightd_probe_fetch.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int,
                                    ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int]
lib.weightd_probe_count.argtypes = [ctypes.c_void_p]
lib.weightd_probe_name.restype = ctypes.c_char_p
lib.weightd_probe_name.argtypes = [ctypes.c_void_p, ctypes.c_int]
lib.weightd_probe_dlpack.restype = ctypes.c_void_p
lib.weightd_probe_dlpack.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
lib.weightd_probe_free.argtypes = [ctypes.c_void_p]
lib.weightd_probe_leases.restype = ctypes.c_long
lib.weightd_probe_leases.argtypes = [ctypes.c_char_p]
new_capsule = ctypes.pythonapi.PyCapsule_New
new_capsule.restype = ctypes.py_object
new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
sock, model, world, rank, dtype, transport = sys.argv[2:8]
err = ctypes.create_string_buffer(4096)
probe = lib.weightd_probe_fetch(sock.encode(), model.encode(), int(world), int(rank),
                                dtype.encode(), transport.encode(), err, 4096)
if not probe:
    print(json.dumps({"error": err.value.decode()})); sys.exit(0)
out, kept, refused, consumer_refused = {}, [], {}, {}
for i in range(lib.weightd_probe_count(probe)):
    name = lib.weightd_probe_name(probe, i).decode()
    p = lib.weightd_probe_dlpack(probe, i, err, 4096)
    if not p:
        refused[name] = err.value.decode(); continue
    capsule = new_capsule(p, b"dltensor", None)
    try:
        t = from_dlpack(capsule)
    except RuntimeError as e:  # a torch without the DLPack code (kDLBool: torch < 2)
        consumer_refused[name] = str(e)
        deleter = ctypes.cast(p + 56, ctypes.POINTER(ctypes.c_void_p)).contents.value
        ctypes.CFUNCTYPE(None, ctypes.c_void_p)(deleter)(p)  # the capsule was not consumed
        continue
    kept.append((name, t))
lib.weightd_probe_free(probe)  # the views still hold the set: read them after
held = lib.weightd_probe_leases(sock.encode())
for name, t in kept:
    out[name] = {"dtype": str(t.dtype), "shape": list(t.shape), "device": str(t.device),
                 "hex": t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes().hex()
                 if t.numel() else ""}
t = None
kept.clear()
gc.collect()
print(json.dumps({"tensors": out, "refused": refused, "consumer_refused": consumer_refused,
                  "leases_while_held": held,
                  "leases_after": lib.weightd_probe_leases(sock.encode())}))
"""


def _checkpoint():
    g = torch.Generator().manual_seed(17)
    return {"w": torch.randn(37, 19, generator=g),
            "h": torch.randn(10, 6, generator=g).to(torch.bfloat16),
            "f": torch.randn(9, 5, generator=g).to(torch.float16),
            "d": torch.randn(7, 3, generator=g, dtype=torch.float64),
            "scalar": torch.tensor(0.5), "empty": torch.zeros(0, 4),
            "ids": torch.arange(13, dtype=torch.int64),
            "i32": torch.arange(-5, 6, dtype=torch.int32),
            "u8": torch.arange(0, 250, 7, dtype=torch.uint8),
            "mask": torch.tensor([True, False, True, True, False])}


@pytest.fixture(scope="module")
def daemon():
    if not os.path.exists(PROBE):
        pytest.skip("no %s (built with the tests)" % PROBE)
    if "thread" in SANITIZE:
        # The probe links the TSan runtime, which cannot be dlopened into a
        # process it did not start with ("cannot allocate memory in static
        # TLS block"); the client code it runs is covered by the C++ tests.
        pytest.skip("a TSan-built library cannot be loaded into Python")
    d = Daemon()
    d.start()
    try:
        path = os.path.join(d.model_root, "m.safetensors")
        st_io.save(_checkpoint(), path)
        d.ctl_ok("load", "m", path)
        yield d
    finally:
        d.stop()


@pytest.mark.parametrize("world,rank,dtype,transport", [
    (1, 0, "keep", "shm"), (3, 1, "keep", "shm"), (2, 1, "f32", "shm"), (2, 0, "bf16", "push"),
    (4, 3, "f16", "push")])
def test_cpp_dlpack_views_in_torch(daemon, world, rank, dtype, transport):
    c = weightd.Client(socket=daemon.socket)
    try:
        base = _wait_leases(c, 0, timeout=5.0)
        r = subprocess.run([sys.executable, "-c", CHILD, PROBE, daemon.socket, "m", str(world),
                            str(rank), dtype, transport],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        got = json.loads(r.stdout.strip().splitlines()[-1])
        assert "error" not in got, got
        assert got["refused"] == {}, got["refused"]
        # DLPack's bool code (kDLBool, 6) is taken from torch 2.0 on; the
        # torch here may be older: then it alone is refused, by torch.
        skipped = got["consumer_refused"]
        if int(torch.__version__.split(".")[0]) >= 2:
            assert skipped == {}, skipped
        else:
            assert set(skipped) <= {"mask"} and all("code 6" in m for m in skipped.values()), \
                skipped
        with c.fetch("m", world=world, rank=rank, dtype=None if dtype == "keep" else dtype) as ref:
            want = {k: v for k, v in ref.state_dict().items() if k not in skipped}
            assert sorted(got["tensors"]) == sorted(want)
            for name, t in want.items():
                g = got["tensors"][name]
                assert g["dtype"] == str(t.dtype) and g["shape"] == list(t.shape), (name, g)
                assert g["device"] == "cpu", (name, g)
                assert bytes.fromhex(g["hex"]) == st_io.tensor_bytes(t), name
        # After the program dropped its hold, the views held the set (and
        # its lease, shm); the lease ended when the last view went.
        if transport == "shm":
            assert got["leases_while_held"] == base + 1, got
        assert got["leases_after"] == base, got
        assert _wait_leases(c, base) == base
    finally:
        c.close()

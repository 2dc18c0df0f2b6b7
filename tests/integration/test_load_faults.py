"""A checkpoint truncated or rewritten while the daemon loads it: that load
fails with DATA_LOSS naming the file, nothing of it stays resident, and a
model loaded before keeps serving bit-identical bytes."""
import os
import struct
import subprocess
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import Daemon, WEIGHTCTL  # noqa: E402
import st_io  # noqa: E402  (harness puts tests/parity on sys.path)


def _stats(d):
    out = d.ctl_ok("stats").stdout
    return {k.strip(): v.strip() for k, v in
            (line.split(":", 1) for line in out.splitlines() if ":" in line)}


def _write_big(path, mib):
    """A one-tensor F32 checkpoint of `mib` MiB whose data is a sparse hole
    (reads as zeros) with a non-zero first and last page."""
    n = mib * (1 << 20) // 4
    header = ('{"big": {"dtype": "F32", "shape": [%d], "data_offsets": [0, %d]}}'
              % (n, n * 4)).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.write(b"\x01" * 4096)
        f.truncate(8 + len(header) + n * 4)
        f.seek(-4096, os.SEEK_END)
        f.write(b"\x02" * 4096)
    return 8 + len(header)


@pytest.fixture(scope="module")
def d():
    daemon = Daemon()
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()


def _fetch(d, name, out):
    d.ctl_ok("fetch", name, "--world", "2", "--rank", "1", "--dtype", "bf16", "--out", out)
    with open(out, "rb") as f:
        return f.read()


def _fault_during_load(d, path, fault):
    """Starts `weightctl load`, applies `fault` once the daemon has started
    reading (bytes_resident grew), returns the load's result. Grows the file
    and tries again when the load finished before the fault could land."""
    for mib in (768, 1536, 3072):
        _write_big(path, mib)
        before = int(_stats(d)["bytes_resident"])
        proc = subprocess.Popen([WEIGHTCTL, "--socket", d.socket, "load", "big", path],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 30
        while time.time() < deadline and proc.poll() is None:
            if int(_stats(d)["bytes_resident"]) > before:
                break
            time.sleep(0.002)
        fault(path)
        out, err = proc.communicate(timeout=120)
        if proc.returncode == 0:
            # The load beat the fault (its final check came first): try a
            # bigger file. A daemon that never notices changes fails below.
            d.ctl_ok("unload", "big")
            continue
        return err
    pytest.fail("every load finished before the fault landed")


def _truncate(path):
    os.truncate(path, os.path.getsize(path) // 2)


def _rewrite_in_place(path):
    with open(path, "r+b") as f:
        f.seek(-4096, os.SEEK_END)
        f.write(b"\x03" * 4096)
        f.flush()
        os.fsync(f.fileno())
    st = os.stat(path)
    # Some filesystems keep a coarse mtime: make the change visible for sure.
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


@pytest.mark.parametrize("fault", [_truncate, _rewrite_in_place], ids=["truncated", "rewritten"])
def test_file_changed_during_load(d, fault):
    good = os.path.join(d.model_root, "good.safetensors")
    if not os.path.exists(good):
        g = torch.Generator().manual_seed(3)
        st_io.save({"w": torch.randn(33, 20, generator=g), "b": torch.randn(7, generator=g)}, good)
        d.ctl_ok("load", "good", good)
    out_dir = os.path.join(d.workdir, "out")
    os.makedirs(out_dir, exist_ok=True)
    before_bytes = _fetch(d, "good", os.path.join(out_dir, "before.safetensors"))
    baseline = int(_stats(d)["bytes_resident"])

    path = os.path.join(d.model_root, "big.safetensors")
    err = _fault_during_load(d, path, fault)
    os.unlink(path)
    error_lines = [l for l in err.splitlines() if l.startswith("error: ")]
    assert len(error_lines) == 1, err
    code, msg = error_lines[0][len("error: "):].split(":", 1)
    assert code.strip() == "DATA_LOSS", err
    assert "big.safetensors" in msg, err

    assert d.alive()
    listed = [l.split("\t", 1)[0] for l in d.ctl_ok("list").stdout.splitlines() if l.strip()]
    assert "big" not in listed
    assert int(_stats(d)["bytes_resident"]) == baseline, "the failed load left bytes resident"
    assert _fetch(d, "good", os.path.join(out_dir, "after.safetensors")) == before_bytes

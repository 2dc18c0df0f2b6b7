"""The daemon says which GPUs it found, by UUID, or why none (`weightctl
gpus`, stats): a CUDA build starts and serves on a node without a GPU or a
driver (no hard link to libcuda.so.1) and names what is missing; on a GPU
node it lists exactly the GPUs PyTorch sees, by the same UUIDs."""
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import BUILD, WEIGHTD, Daemon  # noqa: E402


def _cuda_built():
    with open(os.path.join(BUILD, "CMakeCache.txt")) as f:
        for line in f:
            if line.startswith("WEIGHTD_CUDA_ENABLED_BUILD:"):
                return line.strip().endswith("=ON")
    return False


def _torch_gpus():
    """UUIDs PyTorch sees ("GPU-..."), or [] without CUDA."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return ["GPU-" + str(torch.cuda.get_device_properties(i).uuid)
            for i in range(torch.cuda.device_count())]


@pytest.fixture(scope="module")
def daemon():
    d = Daemon()
    d.start()
    yield d
    d.stop()


def test_the_binary_does_not_link_the_driver():
    out = subprocess.run(["ldd", WEIGHTD], capture_output=True, text=True).stdout
    assert "libcuda" not in out, out


def test_gpus_lists_what_cuda_sees_or_says_why_none(daemon):
    r = daemon.ctl_ok("gpus")
    lines = r.stdout.splitlines()
    stats = dict(l.split(": ", 1) for l in daemon.ctl_ok("stats").stdout.splitlines())
    want = _torch_gpus() if _cuda_built() else []
    if not want:
        assert len(lines) == 1 and lines[0].startswith("no GPU: "), r.stdout
        reason = lines[0][len("no GPU: "):]
        if not _cuda_built():
            assert "built without CUDA" in reason, reason
        elif not os.path.exists("/dev/nvidiactl"):
            assert "libcuda.so.1" in reason or "CUDA" in reason, reason
        assert reason.strip(), "no reason given"
        assert stats["gpus"] == "0"
    else:
        got = [l.split("\t")[1] for l in lines if l.startswith("gpu:")]
        assert sorted(got) == sorted(want), (got, want)
        assert stats["gpus"] == str(len(want))
    # and it serves
    assert daemon.ctl("health").returncode == 0


def test_a_missing_cuda_plugin_is_named_and_the_daemon_serves(tmp_path):
    """A CUDA build keeps its CUDA half in libweightd_cuda_plugin.so beside
    the executable (server/gpu/cuda_plugin.h); without it the daemon still
    serves and says why it has no GPU."""
    if not _cuda_built():
        pytest.skip("a CPU-only build has no CUDA plugin")
    assert os.path.exists(os.path.join(os.path.dirname(WEIGHTD), "libweightd_cuda_plugin.so"))
    d = Daemon(workdir=str(tmp_path / "d"))
    os.environ["WEIGHTD_CUDA_PLUGIN"] = str(tmp_path / "nowhere.so")
    try:
        d.start()
    finally:
        del os.environ["WEIGHTD_CUDA_PLUGIN"]
    try:
        out = d.ctl_ok("gpus").stdout
        assert out.startswith("no GPU: the CUDA plugin cannot be loaded: "), out
        assert "nowhere.so" in out, out
        assert d.ctl("health").returncode == 0
    finally:
        d.stop()


def test_pin_host_memory_without_a_gpu_loads_and_says_why_nothing_is_pinned(tmp_path):
    """--pin-host-memory on: where there is no GPU the load still succeeds,
    nothing is pinned (stats pinned_bytes 0) and the log says why; a bad
    value stops the daemon at start-up."""
    if _torch_gpus():
        pytest.skip("this machine has a GPU: tests/gpu/gpu_checks.py checks pinning there")
    import st_io
    import torch
    root = tmp_path / "models"
    root.mkdir()
    st_io.save({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, str(root / "m.safetensors"))
    d = Daemon(model_root=str(root), workdir=str(tmp_path / "d"),
               extra_args=["--pin-host-memory", "on"])
    d.start()
    try:
        d.ctl_ok("load", "m", str(root / "m.safetensors"))
        stats = dict(l.split(": ", 1) for l in d.ctl_ok("stats").stdout.splitlines())
        assert stats["pinned_bytes"] == "0"
        d.ctl_ok("fetch", "m", "--transport", "push", "--out", str(tmp_path / "o.st"))
    finally:
        d.stop()
    log = open(tmp_path / "d" / "weightd.log").read()
    assert "pin_skipped" in log and "model=m" in log, log[-2000:]
    bad = subprocess.run([WEIGHTD, "--socket", str(tmp_path / "x.sock"), "--model-root",
                          str(root), "--pin-host-memory", "maybe"], capture_output=True,
                         text=True, timeout=30)
    assert bad.returncode != 0 and "--pin-host-memory" in bad.stderr, bad.stderr


def test_weightctl_cuda_without_a_gpu_says_why_and_leaves_no_lease(daemon, tmp_path):
    """`weightctl fetch --transport cuda` needs the CUDA driver in the client:
    without it, FAILED_PRECONDITION naming what is missing (a CPU-only build:
    UNIMPLEMENTED), the fetch's lease released; --device without cuda is
    INVALID_ARGUMENT."""
    if _torch_gpus():
        pytest.skip("this machine has a GPU: tests/gpu/run_on_device.sh checks the CUDA fetch")
    import st_io
    import torch
    st_io.save({"w": torch.ones(4, 4)}, os.path.join(daemon.model_root, "cw.safetensors"))
    daemon.ctl_ok("load", "cw", os.path.join(daemon.model_root, "cw.safetensors"))
    r = daemon.ctl("fetch", "cw", "--transport", "cuda", "--device", "0",
                   "--out", str(tmp_path / "o.st"))
    assert r.returncode != 0
    if _cuda_built():
        assert r.error_code == "FAILED_PRECONDITION", r.stderr
        assert "libcuda.so.1" in r.stderr or "CUDA driver" in r.stderr, r.stderr
    else:
        assert r.error_code == "UNIMPLEMENTED", r.stderr
    assert not os.path.exists(tmp_path / "o.st")
    stats = dict(l.split(": ", 1) for l in daemon.ctl_ok("stats").stdout.splitlines())
    assert stats["leases_open"] == "0"
    bad = daemon.ctl("fetch", "cw", "--device", "1", "--out", str(tmp_path / "o.st"))
    assert bad.error_code == "INVALID_ARGUMENT", bad.stderr

"""Daemon lifecycle: preload, health, SIGTERM shutdown (exit 0, sockets
unlinked), flag errors in the `error: CODE: message` form."""
import os
import subprocess

import torch

import harness
import st_io


def _write_model(root):
    path = os.path.join(root, "m.safetensors")
    st_io.save({"w": torch.arange(12, dtype=torch.float32).reshape(4, 3)}, path)
    return path


def test_preload_serves_and_sigterm_exits_cleanly(tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    path = _write_model(str(root))
    d = harness.Daemon(model_root=str(root), workdir=str(tmp_path),
                       extra_args=["--preload", "pre=" + path])
    d.start()
    assert "pre\t" in d.ctl_ok("list").stdout
    out = tmp_path / "r1.safetensors"
    d.ctl_ok("fetch", "pre", "--world", "2", "--rank", "1", "--out", out)
    assert torch.equal(st_io.load(str(out))["w"], torch.arange(6, 12, dtype=torch.float32).reshape(2, 3))
    assert os.path.exists(d.socket) and os.path.exists(d.data_socket)
    rc = d.stop()
    assert rc == 0, d.log()
    assert not os.path.exists(d.socket)
    assert not os.path.exists(d.data_socket)
    assert "shutdown" in d.log() and "stopped" in d.log()


def test_health_fails_when_no_daemon(tmp_path):
    r = subprocess.run([harness.WEIGHTCTL, "--socket", str(tmp_path / "none.sock"), "health"],
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert r.stderr.startswith("error: UNAVAILABLE: ")


def _daemon_flags_error(tmp_path, *args):
    r = subprocess.run([harness.WEIGHTD] + list(args), capture_output=True, text=True, timeout=30)
    assert r.returncode != 0
    return r.stderr.splitlines()[0]


def test_bad_daemon_flags_are_invalid_argument(tmp_path):
    root = str(tmp_path)
    assert _daemon_flags_error(tmp_path, "--model-root", root).startswith(
        "error: INVALID_ARGUMENT: --socket is required")
    assert _daemon_flags_error(tmp_path, "--socket", str(tmp_path / "s"), "--model-root", root,
                               "--bogus").startswith("error: INVALID_ARGUMENT: unknown flag")
    assert _daemon_flags_error(tmp_path, "--socket", str(tmp_path / "s"), "--model-root",
                               str(tmp_path / "missing")).startswith("error: INVALID_ARGUMENT: --model-root")
    assert _daemon_flags_error(tmp_path, "--socket", str(tmp_path / "s"), "--model-root", root,
                               "--host-memory-bytes", "lots").startswith("error: INVALID_ARGUMENT: ")


def test_preload_failure_is_reported(tmp_path):
    line = _daemon_flags_error(tmp_path, "--socket", str(tmp_path / "s"), "--model-root", str(tmp_path),
                               "--preload", "x=/etc/passwd")
    assert line.startswith("error: PERMISSION_DENIED: "), line


def test_memory_budget_refuses_oversized_load(tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    path = os.path.join(str(root), "big.safetensors")
    st_io.save({"w": torch.zeros(1 << 20, dtype=torch.float32)}, path)  # 4 MiB
    small = _write_model(str(root))
    with harness.Daemon(model_root=str(root), workdir=str(tmp_path / "d"),
                        extra_args=["--host-memory-bytes", str(1 << 20)]) as d:
        r = d.ctl("load", "big", path)
        assert r.error_code == "RESOURCE_EXHAUSTED", r.stderr
        assert "big" not in d.ctl_ok("list").stdout
        d.ctl_ok("load", "small", small)
        assert "bytes_resident: 4096\n" in d.ctl_ok("stats").stdout

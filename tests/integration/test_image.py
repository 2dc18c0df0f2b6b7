"""The container image, really built and run (podman, rootful, on this host).

scripts/image.sh builds it from the .deb of the build under test on a base
it makes with debootstrap; the test runs it as a DaemonSet would — its own
UID, no capability, no new privileges, a read-only root file system, no
network, the socket directory and the models mounted from the host — and
serves a worker on the host through the socket: a PyTorch comparison of the
shard it maps (the memfds cross the container boundary over SCM_RIGHTS), the
packaged weightctl inside the container, and a SIGTERM that ends it with 0.
"""
import json
import os
import subprocess
import time
import uuid

import pytest
import torch

from harness import BUILD, REPO, WEIGHTCTL, wait_leases
from reference import cast_shard_ref
import st_io
import weightd

def _podman(*args, check=True, timeout=120):
    r = subprocess.run(["podman", "--runtime", "runc", *args], capture_output=True, text=True,
                       timeout=timeout)
    if check:
        assert r.returncode == 0, "podman %s: %s%s" % (" ".join(args), r.stdout, r.stderr)
    return r


def _limits():
    # As scripts/image.sh: no higher than the host's hard limits.
    hard = int(subprocess.run(["bash", "-c", "ulimit -Hn"], capture_output=True,
                              text=True).stdout.strip().replace("unlimited", "65536"))
    n = min(hard, 65536)
    return ["--ulimit", "nofile=%d:%d" % (n, n), "--ulimit", "nproc=16384:16384"]


@pytest.fixture(scope="module")
def image():
    tag = "localhost/weightd-test:%s" % uuid.uuid4().hex[:8]
    r = subprocess.run(["bash", os.path.join(REPO, "scripts/image.sh"), "--no-build", "--tag", tag],
                       capture_output=True, text=True, timeout=1200,
                       env=dict(os.environ, BUILD_DIR=BUILD))
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert r.stdout.strip().splitlines()[-1] == tag
    yield tag
    _podman("rmi", "--force", tag, check=False)


@pytest.fixture(scope="module")
def running(image, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    models = tmp_path_factory.mktemp("models")
    os.chown(run_dir, 10001, 10001)
    os.chmod(run_dir, 0o770)
    g = torch.Generator().manual_seed(11)
    tensors = {"a.weight": torch.randn(9, 6, generator=g).to(torch.bfloat16),
               "a.bias": torch.randn(9, generator=g),
               "b.weight": torch.randn(4, 3, 5, generator=g).to(torch.float16)}
    os.chmod(models, 0o755)
    st_io.save(tensors, str(models / "m.safetensors"))
    os.chmod(models / "m.safetensors", 0o644)
    name = "weightd-test-%s" % uuid.uuid4().hex[:8]
    _podman("run", "-d", "--name", name, *_limits(), "--network", "none", "--cap-drop=ALL",
            "--security-opt", "no-new-privileges", "--read-only",
            "-v", "%s:/run/weightd" % run_dir, "-v", "%s:/models:ro" % models, image)
    sock = str(run_dir / "weightd.sock")
    deadline = time.time() + 30
    while time.time() < deadline and not os.path.exists(sock):
        time.sleep(0.1)
    if not os.path.exists(sock):
        logs = _podman("logs", name, check=False)
        _podman("rm", "--force", name, check=False)
        pytest.fail("the container's daemon made no socket: " + logs.stdout + logs.stderr)
    yield name, sock, tensors
    _podman("rm", "--force", name, check=False)


def test_image_config(image):
    cfg = json.loads(_podman("image", "inspect", image).stdout)[0]["Config"]
    assert cfg["User"] == "10001:10001"
    assert cfg["Entrypoint"] == ["/usr/bin/weightd"]
    assert "--socket" in cfg["Cmd"] and "/run/weightd/weightd.sock" in cfg["Cmd"]
    # The packaged daemon, no compiler or -dev package.
    out = _podman("run", "--rm", *_limits(), "--network", "none", "--entrypoint", "sh", image,
                  "-c", "dpkg-query -W -f '${Package}\\n' | grep -E '^(weightd|g\\+\\+|gcc|.*-dev)$'",
                  check=False).stdout.split()
    assert out == ["weightd"], out


def test_serves_a_host_worker_through_the_socket(running, tmp_path):
    name, sock, tensors = running
    # The host's weightctl loads (the path as the container sees it) and fetches.
    subprocess.run([WEIGHTCTL, "--socket", sock, "load", "m", "/models/m.safetensors"],
                   check=True, capture_output=True)
    out = str(tmp_path / "f.st")
    subprocess.run([WEIGHTCTL, "--socket", sock, "fetch", "m", "--world", "2", "--rank", "0",
                    "--dtype", "bf16", "--out", out], check=True, capture_output=True)
    got = st_io.load(out)
    for k, t in tensors.items():
        ref = cast_shard_ref(t, 2, 0, torch.bfloat16)
        assert torch.equal(got[k].view(torch.int16), ref.view(torch.int16)), k
    # A PyTorch worker on the host maps the shards zero-copy.
    with weightd.Client(socket=sock) as c:
        for world, rank in ((1, 0), (2, 1), (3, 2)):
            with c.fetch("m", world=world, rank=rank, dtype="f16") as h:
                sd = h.state_dict()
                for k, t in tensors.items():
                    ref = cast_shard_ref(t, world, rank, torch.float16)
                    assert sd[k].shape == ref.shape and torch.equal(
                        sd[k].view(torch.int16), ref.view(torch.int16)), (k, world, rank)
        assert wait_leases(c, 0) == 0  # every lease released across the boundary
    # The packaged weightctl, inside the container, sees the same daemon.
    out = _podman("exec", name, "weightctl", "list").stdout
    assert out.startswith("m\t") and "path=/models/m.safetensors" in out, out


def test_runs_unprivileged(running):
    name, _, _ = running
    status = _podman("exec", name, "cat", "/proc/1/status").stdout
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert fields["Name"].strip() == "weightd"
    assert fields["Uid"].split()[:2] == ["10001", "10001"], fields["Uid"]
    for cap in ("CapEff", "CapPrm", "CapBnd"):
        assert int(fields[cap], 16) == 0, (cap, fields[cap])
    assert fields["NoNewPrivs"].strip() == "1"
    # The root file system is read-only to it.
    r = _podman("exec", name, "sh", "-c", "touch /usr/x", check=False)
    assert r.returncode != 0 and "Read-only file system" in r.stderr, r.stderr


def test_sigterm_stops_it_cleanly(image, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.chown(run_dir, 10001, 10001)
    name = "weightd-stop-%s" % uuid.uuid4().hex[:8]
    _podman("run", "-d", "--name", name, *_limits(), "--network", "none", "--cap-drop=ALL",
            "-v", "%s:/run/weightd" % run_dir, image)
    try:
        deadline = time.time() + 30
        while time.time() < deadline and not (run_dir / "weightd.sock").exists():
            time.sleep(0.1)
        assert (run_dir / "weightd.sock").exists()
        _podman("stop", "--time", "20", name)
        state = json.loads(_podman("inspect", name).stdout)[0]["State"]
        assert state["ExitCode"] == 0, state
        # It removed its sockets on the way out.
        assert not (run_dir / "weightd.sock").exists()
    finally:
        _podman("rm", "--force", name, check=False)

"""Clients find the data socket beside the Unix socket they connect to.

A daemon in a container (a DaemonSet, a sidecar) and its workers may mount
the socket directory at different paths. The daemon says where its data
socket is (FetchResponse.data_socket) and, when it lies beside its gRPC
socket, its name (data_socket_name); clients connected over a Unix socket
look for it beside the socket they connected to. Shown without containers:
a client in its own mount namespace sees the daemon's directory only under
another path (a bind mount, the original hidden under a tmpfs). Both clients
are compared with PyTorch's cast-and-shard.
"""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from harness import BUILD, WEIGHTCTL, Daemon
from reference import cast_shard_ref
import st_io

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare(1) for a private mount namespace")


@pytest.fixture
def ckpt(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    g = torch.Generator().manual_seed(5)
    tensors = {"x.weight": torch.randn(6, 4, generator=g).to(torch.bfloat16),
               "x.bias": torch.randn(6, generator=g)}
    st_io.save(tensors, str(models / "m.safetensors"))
    return str(models), str(models / "m.safetensors"), tensors


def _in_namespace(hide, alias, script, *args):
    """Runs `script` (Python) where the directory `hide` is reachable only as
    `alias`: a private mount namespace, `hide` bind-mounted on `alias`, then
    covered by an empty tmpfs."""
    shell = 'mount --bind "$1" "$2" && mount -t tmpfs tmpfs "$1" && shift 2 && exec "$@"'
    env = dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python"))
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", shell,
                           "sh", hide, alias, sys.executable, "-c", script, *args],
                          capture_output=True, text=True, timeout=120, env=env)


PY_FETCH = textwrap.dedent("""
    import os, sys, torch, weightd
    sock, out = sys.argv[1], sys.argv[2]
    assert not os.path.exists(sys.argv[3])  # the daemon's own path is hidden here
    with weightd.Client(socket=sock) as c:
        with c.fetch("m", world=2, rank=1, dtype="f16") as h:
            torch.save({k: v.clone() for k, v in h.state_dict().items()}, out)
    # The C++ client (weightctl) too.
    import subprocess
    r = subprocess.run([sys.argv[4], "--socket", sock, "fetch", "m", "--world", "2", "--rank",
                        "0", "--dtype", "f16", "--out", out + ".st"], capture_output=True,
                       text=True)
    sys.exit(r.returncode and (r.stderr or "weightctl failed"))
""")


def test_clients_look_beside_the_socket_they_connect_to(ckpt, tmp_path):
    models, path, tensors = ckpt
    daemon_dir, alias = tmp_path / "daemon", tmp_path / "alias"
    alias.mkdir()
    with Daemon(model_root=models, workdir=str(daemon_dir)) as d:
        d.ctl_ok("load", "m", path)
        out = str(tmp_path / "sd.pt")
        r = _in_namespace(str(daemon_dir), str(alias), PY_FETCH,
                          str(alias / "w.sock"), out, d.data_socket, WEIGHTCTL)
        assert r.returncode == 0, r.stdout + r.stderr
    got = torch.load(out)
    ref = {k: cast_shard_ref(t, 2, 1, torch.float16) for k, t in tensors.items()}
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert torch.equal(got[k].view(torch.int16), ref[k].view(torch.int16)), k
    got0 = st_io.load(out + ".st")
    for k, t in tensors.items():
        assert torch.equal(got0[k].view(torch.int16),
                           cast_shard_ref(t, 2, 0, torch.float16).view(torch.int16)), k


def test_a_data_socket_elsewhere_is_used_as_given(ckpt, tmp_path):
    """--data-socket in another directory: clients use the daemon's path, so
    where that path is hidden the fetch fails naming it (no guessing)."""
    models, path, _ = ckpt
    daemon_dir, alias, data_dir = tmp_path / "daemon", tmp_path / "alias", tmp_path / "data"
    alias.mkdir()
    data_dir.mkdir()
    data_sock = str(data_dir / "d.sock")
    with Daemon(model_root=models, workdir=str(daemon_dir),
                extra_args=["--data-socket", data_sock]) as d:
        d.ctl_ok("load", "m", path)
        # Visible: the given path works from anywhere.
        d.ctl_ok("fetch", "m", "--world", "2", "--rank", "0", "--out", str(tmp_path / "ok.st"))
        script = textwrap.dedent("""
            import sys, weightd
            with weightd.Client(socket=sys.argv[1], retry_deadline=0) as c:
                try:
                    c.fetch("m", world=2, rank=0)
                except weightd.Error as e:
                    print(e.code, e.message)
        """)
        r = _in_namespace(str(data_dir), str(alias), script, d.socket)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("UNAVAILABLE") and data_sock in r.stdout, r.stdout

"""Access control (docs/access-control.md): every rule is tried once where it
must refuse and once where it must allow.

* socket files: --socket-mode (default 0660) holds for both sockets whatever
  the daemon's umask; a uid outside owner/group cannot connect at 0660 and can
  at 0666.
* --allow-uid / --allow-gid (SO_PEERCRED, supplementary groups included) on
  the gRPC socket (PERMISSION_DENIED naming the uid on every call) and on the
  data socket (no fds); the daemon's own uid is always allowed.
* --admin-uid / --admin-gid / --admin-token-names for Load/Unload/Adapter
  Load/Unload/Apply.
* per-model and per-adapter readers (uid:, gid:, token:, cn:): Fetch, Get,
  List, Watch, and a tenant-private adapter making a generation private.
* leases: an id + token used from another uid is refused on the data socket
  and on Read; the uid that fetched gets its fds.
* TCP: TLS (server cert), client certificates (--tls-client-ca), bearer
  tokens (UNAUTHENTICATED), Health reachable without a token, and the refusal
  to start a token listener in clear text on a non-loopback address.
* fleet RPCs (FindCheckpoint, ReadCheckpoint): --fleet-members only (not a
  local admin, not an unlisted token), refused before the request is read;
  a copy only if a holder's readers admit the member, and only the one
  matching its samples.
* --model-root confinement after resolving symlinks.
Tests run as root; other users are played with setpriv.
"""
import json
import math
import os
import random
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import BUILD, WEIGHTD, Daemon, user_prefix  # noqa: E402
import st_io  # noqa: E402
import weightd  # noqa: E402

PYTHON = "/usr/bin/python3"
NOBODY = 65534
OTHER = 1234        # a second unprivileged uid
GROUP = 3000        # a supplementary group
TOKENS = {"alice": "alice-0123456789abcdef-token", "bob": "bob-fedcba9876543210-token"}
BASE = {"emb.weight": torch.arange(40, dtype=torch.float32).reshape(10, 4),
        "head.weight": torch.full((6, 4), 0.5)}

if os.geteuid() != 0:
    pytest.skip("access-control tests switch users and need root", allow_module_level=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def files():
    """Checkpoints, an adapter, a token file and a small PKI, in a directory
    every test user can read."""
    tmp = tempfile.mkdtemp(prefix="weightd-acl-")
    os.chmod(tmp, 0o755)
    models = os.path.join(tmp, "models")
    os.makedirs(models)
    st_io.save(BASE, os.path.join(models, "base.safetensors"))
    st_io.save({"emb.diff": torch.ones(10, 4)}, os.path.join(models, "tenant.safetensors"))
    tokens = os.path.join(tmp, "tokens")
    with open(tokens, "w") as f:
        f.write("# name token\n")
        for name, tok in TOKENS.items():
            f.write("%s %s\n" % (name, tok))
    for name, tok in TOKENS.items():
        with open(os.path.join(tmp, name + ".token"), "w") as f:
            f.write(tok + "\n")
    pki = os.path.join(tmp, "pki")
    os.makedirs(pki)
    _make_pki(pki)
    out = os.path.join(tmp, "out")
    os.makedirs(out)
    os.chmod(out, 0o777)
    yield {"dir": tmp, "models": models, "tokens": tokens, "pki": pki, "out": out}
    shutil.rmtree(tmp, ignore_errors=True)


def _openssl(*args, cwd):
    subprocess.run(["openssl"] + list(args), cwd=cwd, check=True, capture_output=True)


def _make_pki(d):
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=weightd-test-ca", cwd=d)
    with open(os.path.join(d, "server.ext"), "w") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    with open(os.path.join(d, "client.ext"), "w") as f:
        f.write("extendedKeyUsage=clientAuth\n")
    for name, cn, ext in (("server", "localhost", "server.ext"), ("alice", "alice", "client.ext"),
                          ("bob", "bob", "client.ext")):
        _openssl("req", *ec, "-keyout", name + ".key", "-out", name + ".csr",
                 "-subj", "/CN=" + cn, cwd=d)
        _openssl("x509", "-req", "-in", name + ".csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", name + ".pem", "-days", "2", "-extfile", ext, cwd=d)
    # A certificate for "alice" that our CA never signed.
    _openssl("req", "-x509", *ec, "-keyout", "rogue.key", "-out", "rogue.pem", "-days", "2",
             "-subj", "/CN=alice", cwd=d)
    for n in os.listdir(d):
        os.chmod(os.path.join(d, n), 0o644)


def daemon(files, *args, umask=None):
    d = Daemon(model_root=files["models"], extra_args=list(args))
    os.chmod(d.workdir, 0o755)   # other users must reach the socket files
    return d.start(umask=umask)


def open_daemon(files, *args):
    """A daemon whose sockets every user can open (mode 0666): what stands
    between them and the models is the access control under test."""
    return daemon(files, "--socket-mode", "0666", *args)


def model_path(files, name):
    return os.path.join(files["models"], name)


def out_file(files, name):
    p = os.path.join(files["out"], name)
    if os.path.exists(p):
        os.unlink(p)
    return p


def assert_refused(r, code, *words):
    assert r.returncode != 0, r.stdout
    assert r.error_code == code, r.stderr
    for w in words:
        assert w in r.error_message, (w, r.stderr)


def fetch_as(d, user, model, name, files, **kw):
    """weightctl fetch as `user`; returns (result, tensors or None)."""
    out = out_file(files, name)
    r = d.ctl("fetch", model, "--out", out, user=user, **kw)
    return r, (st_io.load(out) if r.returncode == 0 else None)


def run_py(user, code, *args):
    """Runs Python `code` as `user` with the weightd package importable."""
    env = dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python"))
    return subprocess.run(user_prefix(user) + [PYTHON, "-c", code] + [str(a) for a in args],
                          capture_output=True, text=True, timeout=60, env=env)


# Fetches over gRPC only (no data socket) and prints "lease_id token_hex".
_FETCH_LEASE = r"""
import sys, grpc
from weightd.v1 import weightd_pb2 as pb, weightd_pb2_grpc as pbg
ch = grpc.insecure_channel("unix:" + sys.argv[1])
try:
    r = pbg.ShardsStub(ch).Fetch(pb.FetchRequest(model=sys.argv[2], transport=int(sys.argv[3])))
except grpc.RpcError as e:
    print("error", e.code().name, e.details()); sys.exit(3)
print(r.lease_id, r.token.hex(), r.data_socket)
"""

# Attaches a lease on the data socket; prints "fds N" or "error CODE message".
_ATTACH = r"""
import os, sys
from weightd import _datasock
from weightd.errors import Error
path, lease, token, nseg = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3]), int(sys.argv[4])
try:
    conn, fds = _datasock.attach(path, lease, token, nseg, timeout=10)
except Error as e:
    print("error", e.code, e.message); sys.exit(3)
print("fds", len(fds))
"""

# Opens a publish session for emb.weight; prints "session token staging_bytes".
_BEGIN_PUBLISH = r"""
import sys, weightd
with weightd.Client(socket=sys.argv[1]) as c:
    s = c.begin_publish(sys.argv[2], {"emb.weight": ("f32", (10, 4))})
print(s.session, s.token, s.staging_bytes)
"""

# Takes a publish session's staging memfd; prints "fd SIZE" or "error CODE message".
_STAGE = r"""
import os, sys
from weightd import _datasock
from weightd.errors import Error
try:
    fd = _datasock.stage(sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3]), timeout=10)
except Error as e:
    print("error", e.code, e.message); sys.exit(3)
print("fd", os.fstat(fd).st_size)
"""

# Reads segment 0 of a grpc-transport lease; prints "bytes N" or "error CODE message".
_READ = r"""
import sys, grpc
from weightd.v1 import weightd_pb2 as pb, weightd_pb2_grpc as pbg
ch = grpc.insecure_channel("unix:" + sys.argv[1])
try:
    n = sum(len(c.data) for c in pbg.ShardsStub(ch).Read(
        pb.ReadRequest(lease_id=int(sys.argv[2]), token=bytes.fromhex(sys.argv[3]), segment=0)))
except grpc.RpcError as e:
    print("error", e.code().name, e.details()); sys.exit(3)
print("bytes", n)
"""

SHM, GRPC = 1, 2   # weightd.v1.Transport


def fetch_lease(d, user, model, transport=SHM):
    r = run_py(user, _FETCH_LEASE, d.socket, model, transport)
    assert r.returncode == 0, r.stdout + r.stderr
    lease, token, _ = (r.stdout.split() + [""])[:3]
    return int(lease), token


def parse_result(r):
    words = r.stdout.split(None, 2)
    assert words, r.stderr
    return words


# ------------------------------------------------------------ socket files


def test_socket_files_get_the_default_mode_0660_whatever_the_umask(files):
    d = daemon(files, umask=0)   # a umask of 0 would leave them 0777
    try:
        for p in (d.socket, d.data_socket):
            st = os.stat(p)
            assert stat.S_ISSOCK(st.st_mode)
            assert stat.S_IMODE(st.st_mode) == 0o660, (p, oct(st.st_mode))
    finally:
        d.stop()


@pytest.mark.parametrize("mode", [0o600, 0o666])
def test_socket_mode_flag_sets_both_sockets(files, mode):
    d = daemon(files, "--socket-mode", "%04o" % mode, umask=0o077)
    try:
        for p in (d.socket, d.data_socket):
            assert stat.S_IMODE(os.stat(p).st_mode) == mode, (p, oct(os.stat(p).st_mode))
    finally:
        d.stop()


def test_socket_mode_0660_keeps_other_users_out_and_0666_lets_them_in(files):
    d = daemon(files)   # 0660, owned by root:root
    try:
        r = d.ctl("list", user=NOBODY)
        assert_refused(r, "UNAVAILABLE", "Permission denied")
    finally:
        d.stop()
    d = open_daemon(files)
    try:
        d.ctl_ok("list", user=NOBODY)
    finally:
        d.stop()


# ------------------------------------------------------------ allow-list


def test_allow_uid_refuses_other_uids_on_every_call_naming_them(files):
    d = open_daemon(files, "--allow-uid", "1000")
    try:
        d.ctl_ok("load", "m", model_path(files, "base.safetensors"))   # the daemon's uid
        for verb in (["list"], ["stats"], ["info", "m"], ["fetch", "m", "--out",
                                                          out_file(files, "x")]):
            r = d.ctl(*verb, user=NOBODY)
            assert_refused(r, "PERMISSION_DENIED", "uid 65534", "--allow-uid")
    finally:
        d.stop()


def test_allow_uid_lets_listed_uids_fetch_through_both_sockets(files):
    d = open_daemon(files, "--allow-uid", "1000,%d" % NOBODY)
    try:
        d.ctl_ok("load", "m", model_path(files, "base.safetensors"))
        r, got = fetch_as(d, NOBODY, "m", "allowed.safetensors", files)   # shm: data socket
        assert r.returncode == 0, r.stderr
        assert torch.equal(got["emb.weight"], BASE["emb.weight"])
    finally:
        d.stop()


def test_allow_gid_matches_supplementary_groups(files):
    d = open_daemon(files, "--allow-gid", str(GROUP))
    try:
        assert_refused(d.ctl("list", user=(OTHER, OTHER)), "PERMISSION_DENIED", "uid 1234")
        d.ctl_ok("list", user=(OTHER, OTHER, [GROUP]))
        d.ctl_ok("list", user=(OTHER, GROUP))   # primary group
    finally:
        d.stop()


def test_data_socket_refuses_peers_outside_the_allow_list(files):
    d = open_daemon(files, "--allow-uid", str(NOBODY))
    try:
        d.ctl_ok("load", "m", model_path(files, "base.safetensors"))
        lease, token = fetch_lease(d, NOBODY, "m")
        # uid 1234 holds a valid id + token but may not use the daemon at all.
        r = run_py(OTHER, _ATTACH, d.data_socket, lease, token, 1)
        words = parse_result(r)
        assert words[:2] == ["error", "PERMISSION_DENIED"], r.stdout + r.stderr
        assert "uid 1234" in words[2] and "--allow-uid" in words[2]
        # The fetcher gets its fds (the refused attach did not take the lease).
        r = run_py(NOBODY, _ATTACH, d.data_socket, lease, token, 1)
        assert parse_result(r) == ["fds", "1"], r.stdout + r.stderr
    finally:
        d.stop()


# ------------------------------------------------------------ admins


def test_admin_uid_guards_every_mutating_call(files):
    d = open_daemon(files, "--admin-uid", "1000")
    try:
        d.ctl_ok("load", "m", model_path(files, "base.safetensors"))   # daemon uid: admin
        d.ctl_ok("adapter", "load", "t", model_path(files, "tenant.safetensors"))
        calls = [["load", "m2", model_path(files, "base.safetensors")], ["unload", "m"],
                 ["adapter", "load", "t2", model_path(files, "tenant.safetensors")],
                 ["adapter", "unload", "t"], ["apply", "m", "t:1"],
                 ["publish", "m", model_path(files, "base.safetensors")]]
        for call in calls:
            assert_refused(d.ctl(*call, user=NOBODY), "PERMISSION_DENIED", "uid 65534",
                           "--admin-uid")
        d.ctl_ok("list", user=NOBODY)   # reading is not administering
        # Writing a publish's staging memory is publishing: a non-admin
        # holding a session's id and token is refused on the data socket.
        r = run_py(None, _BEGIN_PUBLISH, d.socket, "m")
        assert r.returncode == 0, r.stdout + r.stderr
        session, token, staging_bytes = r.stdout.split()
        r = run_py(NOBODY, _STAGE, d.data_socket, session, token)
        words = parse_result(r)
        assert words[:2] == ["error", "PERMISSION_DENIED"], r.stdout + r.stderr
        assert "uid 65534" in words[2] and "--admin-uid" in words[2], words
        r = run_py(None, _STAGE, d.data_socket, session, token)
        assert parse_result(r) == ["fd", staging_bytes], r.stdout + r.stderr
        # Nothing the refused calls asked for happened.
        assert "m2" not in d.ctl_ok("list").stdout
        assert "adapters: (none)" in d.ctl_ok("info", "m").stdout
        assert "t\t" in d.ctl_ok("adapter", "list").stdout
    finally:
        d.stop()
    d = open_daemon(files, "--admin-uid", str(NOBODY))
    try:
        d.ctl_ok("load", "m", model_path(files, "base.safetensors"), user=NOBODY)
        d.ctl_ok("adapter", "load", "t", model_path(files, "tenant.safetensors"), user=NOBODY)
        d.ctl_ok("apply", "m", "t:1", user=NOBODY)
        out = d.ctl_ok("publish", "m", model_path(files, "base.safetensors"), user=NOBODY).stdout
        assert "0 changed" in out, out   # the same bytes: no new generation
        d.ctl_ok("unload", "m", user=NOBODY)
    finally:
        d.stop()


def test_admin_gid(files):
    d = open_daemon(files, "--admin-gid", str(GROUP))
    try:
        assert_refused(d.ctl("load", "m", model_path(files, "base.safetensors"),
                             user=(OTHER, OTHER)), "PERMISSION_DENIED", "uid 1234")
        d.ctl_ok("load", "m", model_path(files, "base.safetensors"), user=(OTHER, OTHER, [GROUP]))
    finally:
        d.stop()


# ------------------------------------------------------------ readers


def test_private_model_is_served_to_its_readers_only(files):
    d = open_daemon(files)
    try:
        d.ctl_ok("load", "priv", model_path(files, "base.safetensors"),
                 "--readers", "uid:%d,gid:%d" % (NOBODY, GROUP))
        d.ctl_ok("load", "pub", model_path(files, "base.safetensors"))
        r, got = fetch_as(d, NOBODY, "priv", "n.safetensors", files)
        assert r.returncode == 0, r.stderr
        assert torch.equal(got["head.weight"], BASE["head.weight"])
        r, _ = fetch_as(d, (OTHER, OTHER, [GROUP]), "priv", "g.safetensors", files)
        assert r.returncode == 0, r.stderr
        r, got = fetch_as(d, OTHER, "priv", "o.safetensors", files)
        assert_refused(r, "PERMISSION_DENIED", "uid 1234", 'model "priv"')
        assert got is None
        r = d.ctl("fetch", "priv", "--transport", "grpc", "--out",
                  out_file(files, "o2.safetensors"), user=OTHER)
        assert_refused(r, "PERMISSION_DENIED", 'model "priv"')
        # Nor does uid 1234 see it or its details.
        assert_refused(d.ctl("info", "priv", user=OTHER), "PERMISSION_DENIED", 'model "priv"')
        assert_refused(d.ctl("verify", "priv", user=OTHER), "PERMISSION_DENIED", 'model "priv"')
        assert_refused(d.ctl("watch", "priv", "--count", "1", user=OTHER, timeout=20),
                       "PERMISSION_DENIED", 'model "priv"')
        listed = d.ctl_ok("list", user=OTHER).stdout
        assert "pub" in listed and "priv" not in listed
        assert "priv" in d.ctl_ok("list", user=NOBODY).stdout
        assert "readers: uid:65534,gid:3000" in d.ctl_ok("info", "priv", user=NOBODY).stdout
        r, _ = fetch_as(d, OTHER, "pub", "p.safetensors", files)
        assert r.returncode == 0, r.stderr
    finally:
        d.stop()


def test_non_reader_learns_nothing_about_a_private_models_generations(files):
    """Issue 16 F18: an unknown --generation / --changed-since used to answer
    NOT_FOUND "... (current is N)" before checking the readers."""
    d = open_daemon(files)
    try:
        d.ctl_ok("load", "priv", model_path(files, "base.safetensors"),
                 "--readers", "uid:%d" % NOBODY)
        d.ctl_ok("adapter", "load", "pubad", model_path(files, "tenant.safetensors"))
        for _ in range(4):   # generation 5
            d.ctl_ok("apply", "priv", "pubad:1")
        for flag in ("--generation", "--changed-since"):
            for transport in ("shm", "grpc"):
                r = d.ctl("fetch", "priv", flag, "99", "--transport", transport, "--out",
                          out_file(files, "g.safetensors"), user=OTHER)
                assert_refused(r, "PERMISSION_DENIED", "uid 1234", 'model "priv"')
                assert "current" not in r.stderr and "5" not in r.error_message, r.stderr
        # Its reader is still told what there is.
        r = d.ctl("fetch", "priv", "--generation", "99", "--out",
                  out_file(files, "r.safetensors"), user=NOBODY)
        assert_refused(r, "NOT_FOUND", "current is 5")
    finally:
        d.stop()


# Publishes as whoever runs it (argv: socket, model, JSON [[name, dtype, shape,
# hex bytes]], expect_generation) over gRPC; prints {"generation", "changed"}
# or {"error", "message"}.
_PUBLISH = r"""
import json, sys, grpc
from weightd.v1 import weightd_pb2 as pb, weightd_pb2_grpc as pbg
models = pbg.ModelsStub(grpc.insecure_channel("unix:" + sys.argv[1]))
tensors = json.loads(sys.argv[3])
try:
    s = models.BeginPublish(pb.BeginPublishRequest(
        model=sys.argv[2], expect_generation=int(sys.argv[4]),
        tensors=[pb.PublishTensor(name=n, dtype=d, shape=shape) for n, d, shape, _ in tensors]),
        timeout=30)
    chunks = [pb.PublishChunk(runs=[pb.PublishRun(tensor=i, offset=0, length=len(h) // 2)],
                              data=bytes.fromhex(h)) for i, (*_, h) in enumerate(tensors)]
    chunks[0].session, chunks[0].token = s.session, s.token
    r = models.PublishWrite(iter(chunks), timeout=30)
    print(json.dumps({"generation": r.result.generation, "changed": r.result.changed}))
except grpc.RpcError as e:
    print(json.dumps({"error": e.code().name, "message": e.details()}))
"""

# Every call on a publish session, given its id and token (argv: socket, data
# socket, session, token, hex bytes to write at offset 0 of its first tensor);
# prints {call: [code, message]}.
_SESSION_CALLS = r"""
import json, os, sys, grpc
from weightd import _datasock
from weightd.errors import Error
from weightd.v1 import weightd_pb2 as pb, weightd_pb2_grpc as pbg
sock, data_sock, session, token, data = sys.argv[1:6]
session, data = int(session), bytes.fromhex(data)
models = pbg.ModelsStub(grpc.insecure_channel("unix:" + sock))
out = {}
def call(name, fn):
    try:
        fn()
        out[name] = ["OK", ""]
    except grpc.RpcError as e:
        out[name] = [e.code().name, e.details()]
    except Error as e:
        out[name] = [e.code, e.message]
call("stage", lambda: os.close(_datasock.stage(data_sock, session, bytes.fromhex(token), timeout=10)))
call("write", lambda: models.PublishWrite(iter([pb.PublishChunk(
    session=session, token=token, runs=[pb.PublishRun(tensor=0, offset=0, length=len(data))],
    data=data)]), timeout=30))
call("commit", lambda: models.CommitPublish(
    pb.CommitPublishRequest(session=session, token=token), timeout=30))
call("abort", lambda: models.AbortPublish(
    pb.AbortPublishRequest(session=session, token=token), timeout=30))
print(json.dumps(out))
"""

F32 = 2   # weightd.v1.DType


def publish_as(d, user, model, tensors, expect=0):
    """Publishes [(name, shape, tensor)] as `user`; the _PUBLISH reply."""
    spec = [[n, F32, list(shape), t.contiguous().numpy().tobytes().hex()] for n, shape, t in tensors]
    r = run_py(user, _PUBLISH, d.socket, model, json.dumps(spec), expect)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def test_publishing_requires_reading_the_model(files):
    """Issue 38 M1: an admin who may not read a private model used to learn
    its tensor names (NOT_FOUND), dtypes and shapes (INVALID_ARGUMENT),
    whether guessed bytes were its bytes (changed=0), and could make a new
    generation of it. Every publish call now needs reading too: a non-reader
    gets the one PERMISSION_DENIED Fetch gives it, whatever it asked, and a
    session's token does not help it; an unknown model is NOT_FOUND, as for
    Fetch; a reader is told what there is and publishes."""
    d = open_daemon(files)
    try:
        d.ctl_ok("load", "priv", model_path(files, "base.safetensors"),
                 "--readers", "uid:%d" % NOBODY)
        head = BASE["head.weight"]
        probes = {
            "unknown name": [("no.such.weight", (6, 4), head)],
            "wrong shape": [("head.weight", (4, 6), head.reshape(4, 6))],
            "its own bytes": [("head.weight", (6, 4), head)],
            "other bytes": [("head.weight", (6, 4), torch.zeros(6, 4))],
        }
        r, _ = fetch_as(d, OTHER, "priv", "f.safetensors", files)
        assert_refused(r, "PERMISSION_DENIED")
        refusal = r.error_message
        assert refusal == 'uid %d (gid %d) is not a reader of model "priv"' % (OTHER, OTHER), refusal
        for what, tensors in probes.items():
            for expect in (0, 1, 7):
                got = publish_as(d, OTHER, "priv", tensors, expect)
                assert got == {"error": "PERMISSION_DENIED", "message": refusal}, (what, got)
        with weightd.Client(socket=d.socket) as c:
            assert c.info("priv").generation == 1
        # A model that is not loaded: NOT_FOUND, as Fetch says.
        got = publish_as(d, OTHER, "nomodel", probes["its own bytes"])
        assert got["error"] == "NOT_FOUND" and "not loaded" in got["message"], got
        r, _ = fetch_as(d, OTHER, "nomodel", "n.safetensors", files)
        assert_refused(r, "NOT_FOUND", "not loaded")
        # Its reader is told what there is, and publishes.
        got = publish_as(d, NOBODY, "priv", probes["unknown name"])
        assert got["error"] == "NOT_FOUND" and '"no.such.weight"' in got["message"], got
        got = publish_as(d, NOBODY, "priv", probes["wrong shape"])
        assert got["error"] == "INVALID_ARGUMENT" and "is F32 [6, 4]" in got["message"], got
        assert publish_as(d, NOBODY, "priv", probes["its own bytes"]) == \
            {"generation": 1, "changed": 0}
        assert publish_as(d, NOBODY, "priv", probes["other bytes"]) == \
            {"generation": 2, "changed": 1}
        # A session's token is not enough: the reader's session, every call
        # by a non-reader holding its id and token is refused, on gRPC and
        # on the data socket, and the session stays the reader's.
        r = run_py(NOBODY, _BEGIN_PUBLISH, d.socket, "priv")
        assert r.returncode == 0, r.stdout + r.stderr
        session, token, _ = r.stdout.split()
        emb = torch.full((10, 4), 0.25).numpy().tobytes().hex()
        r = run_py(OTHER, _SESSION_CALLS, d.socket, d.data_socket, session, token, emb)
        assert r.returncode == 0, r.stdout + r.stderr
        for call, (code, message) in json.loads(r.stdout).items():
            assert (code, message) == ("PERMISSION_DENIED", refusal), (call, code, message)
        r = run_py(NOBODY, _SESSION_CALLS, d.socket, d.data_socket, session, token, emb)
        assert r.returncode == 0, r.stdout + r.stderr
        calls = json.loads(r.stdout)
        assert calls["stage"][0] == "OK" and calls["write"][0] == "OK", calls
        assert calls["commit"][0] == "OK", calls
        assert calls["abort"][0] == "FAILED_PRECONDITION", calls   # complete
        _, tensors = fetch_as(d, NOBODY, "priv", "p.safetensors", files)
        assert torch.equal(tensors["emb.weight"], torch.full((10, 4), 0.25))
        assert torch.equal(tensors["head.weight"], torch.zeros(6, 4))
    finally:
        d.stop()


def test_bad_reader_specs_are_invalid_argument(files):
    d = open_daemon(files)
    try:
        for spec in ("uid:abc", "user:1", "token:", "1000"):
            r = d.ctl("load", "m", model_path(files, "base.safetensors"), "--readers", spec)
            assert_refused(r, "INVALID_ARGUMENT", "reader")
        assert "m" not in d.ctl_ok("list").stdout
    finally:
        d.stop()


def test_tenant_private_adapter_makes_the_generation_private(files):
    d = open_daemon(files)
    try:
        d.ctl_ok("load", "m", model_path(files, "base.safetensors"))
        d.ctl_ok("adapter", "load", "tenant", model_path(files, "tenant.safetensors"),
                 "--readers", "uid:%d" % NOBODY)
        r, _ = fetch_as(d, OTHER, "m", "before.safetensors", files)
        assert r.returncode == 0, r.stderr
        # uid 1234 does not see the private adapter; nobody does.
        assert "tenant" not in d.ctl_ok("adapter", "list", user=OTHER).stdout
        assert "tenant" in d.ctl_ok("adapter", "list", user=NOBODY).stdout
        # A watcher that may not read the next generation is cut off.
        def watch(user):
            return subprocess.Popen(
                user_prefix(user) + [os.path.join(BUILD, "bin", "weightctl"), "--socket",
                                     d.socket, "watch", "m", "--count", "1"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        outsider, reader = watch(OTHER), watch(NOBODY)
        time.sleep(0.5)
        d.ctl_ok("apply", "m", "tenant:1")
        out, err = outsider.communicate(timeout=20)
        assert outsider.returncode != 0, out
        assert "PERMISSION_DENIED" in err and 'adapter "tenant"' in err, err
        out, err = reader.communicate(timeout=20)
        assert reader.returncode == 0, err
        assert out.startswith("m generation 2: tenant:1"), out
        r, got = fetch_as(d, OTHER, "m", "after.safetensors", files)
        assert_refused(r, "PERMISSION_DENIED", "uid 1234", 'adapter "tenant"', "generation 2")
        r, got = fetch_as(d, NOBODY, "m", "tenant.safetensors", files)
        assert r.returncode == 0, r.stderr
        assert torch.equal(got["emb.weight"], BASE["emb.weight"] + 1)
        d.ctl_ok("apply", "m")   # back to the base: public again
        r, got = fetch_as(d, OTHER, "m", "base_again.safetensors", files)
        assert r.returncode == 0, r.stderr
        assert torch.equal(got["emb.weight"], BASE["emb.weight"])
    finally:
        d.stop()


# ------------------------------------------------------------ every byte a client maps


# Runs as one user: reads fetch requests as JSON lines on stdin, fetches, maps
# or Reads every segment of the lease WHOLE (what a hostile client can do,
# not just the ranges its table names) and answers which marker patterns
# (16-bit words) occur anywhere in them. Every value the test serves is
# exact in bf16, so an f32 element v shows as the words {0, bf16(v)} and a
# bf16 element as itself: a marker word occurs iff a served element equals
# the marker value, whatever dtype and alignment the segment mixes.
_TENANT = r"""
import json, mmap, os, sys, grpc
import numpy as np
from weightd import _datasock
from weightd.errors import Error
from weightd.v1 import weightd_pb2 as pb, weightd_pb2_grpc as pbg
markers = np.array([int(m) for m in sys.argv[2].split(",")], dtype=np.uint16)
channel = grpc.insecure_channel("unix:" + sys.argv[1])
stub = pbg.ShardsStub(channel)
models = pbg.ModelsStub(channel)
held = []   # leases kept open ("hold"), until a {"release": true} line
for line in sys.stdin:
    q = json.loads(line)
    if "publish" in q:   # [[name, dtype, shape, hex bytes]] over gRPC
        try:
            s = models.BeginPublish(pb.BeginPublishRequest(model=q["publish"], tensors=[
                pb.PublishTensor(name=n, dtype=d, shape=sh) for n, d, sh, _ in q["tensors"]]),
                timeout=30)
            chunks = [pb.PublishChunk(runs=[pb.PublishRun(tensor=i, offset=0, length=len(h) // 2)],
                                      data=bytes.fromhex(h))
                      for i, (*_, h) in enumerate(q["tensors"])]
            chunks[0].session, chunks[0].token = s.session, s.token
            r = models.PublishWrite(iter(chunks), timeout=30)
            print(json.dumps({"generation": r.result.generation, "changed": r.result.changed}),
                  flush=True)
        except grpc.RpcError as e:
            print(json.dumps({"error": e.code().name, "message": e.details()}), flush=True)
        continue
    if q.get("release"):
        for lease_id, token, conn in held:
            stub.Release(pb.ReleaseRequest(lease_id=lease_id, token=token), timeout=30)
            if conn is not None:
                conn.close()
        print(json.dumps({"released": len(held)}), flush=True)
        held = []
        continue
    try:
        r = stub.Fetch(pb.FetchRequest(
            model=q["model"], names=q["names"], dtype=q["dtype"], mesh_shape=[q["world"]],
            coord=[q["rank"]], placements=[pb.Placement(shard_dim=q["dim"])],
            transport=q["transport"]), timeout=30)
    except grpc.RpcError as e:
        print(json.dumps({"error": e.code().name, "message": e.details()}), flush=True)
        continue
    blobs, conn = [], None
    if q["transport"] == 1:
        conn, fds = _datasock.attach(r.data_socket, r.lease_id, r.token, len(r.segment_sizes))
        for fd in fds:
            size = os.fstat(fd).st_size   # the whole memfd
            if size:
                with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as m:
                    blobs.append(bytes(m))
            os.close(fd)
    else:
        for i in range(len(r.segment_sizes)):
            blobs.append(b"".join(c.data for c in stub.Read(
                pb.ReadRequest(lease_id=r.lease_id, token=r.token, segment=i), timeout=30)))
    found = set()
    for b in blobs:
        words = np.frombuffer(b, dtype=np.uint16, count=len(b) // 2)
        found.update(int(m) for m in markers[np.isin(markers, words)])
    if q.get("hold"):
        held.append((r.lease_id, r.token, conn))
    else:
        stub.Release(pb.ReleaseRequest(lease_id=r.lease_id, token=r.token), timeout=30)
        if conn is not None:
            conn.close()
    print(json.dumps({"found": sorted(found), "tensors": len(r.tensors),
                      "bytes": sum(len(b) for b in blobs)}), flush=True)
"""


class _Tenant:
    """A long-lived _TENANT process running as `uid`."""

    def __init__(self, d, uid, markers):
        env = dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python"))
        self.uid = uid
        self.proc = subprocess.Popen(
            user_prefix(uid) + [PYTHON, "-c", _TENANT, d.socket,
                                ",".join(str(m) for m in markers)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env)

    def fetch(self, **q):
        self.proc.stdin.write(json.dumps(q) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "tenant %d died: %s" % (self.uid, self.proc.stderr.read())
        return json.loads(line)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=20)


def _bf16_word(v):
    return int(torch.tensor([v], dtype=torch.bfloat16).view(torch.int16)[0]) & 0xFFFF


A, B = 1001, 1002
# Public values are k/8 (exact in bf16); each secret has a value of its own.
SECRET = {"P": 1536.0, "R": 3072.0, "TA": 6144.0, "TB": 12288.0}
READABLE = {A: {"P", "TA"}, B: {"R", "TB"}, NOBODY: set()}


class _Tenants:
    """Private models P (uid A) and R (uid B) holding public model Q's shared
    tensors byte for byte, tenant adapters TA (uid A) and TB (uid B) turning
    Q's "shared.a.weight" into their secret, and one _Tenant per uid."""

    def __init__(self, files, seed):
        gen = torch.Generator().manual_seed(seed)

        def public(*shape):
            return torch.randint(-8, 9, shape, generator=gen).float() / 8

        shared = {"shared.a.weight": public(12, 8), "shared.b.weight": public(6, 10)}
        models = tempfile.mkdtemp(prefix="tenants-", dir=files["dir"])
        os.chmod(models, 0o755)
        self.ckpts = {
            "P": dict(shared, **{"p.secret.weight": torch.full((8, 8), SECRET["P"])}),
            "R": dict(shared, **{"r.secret.weight": torch.full((4, 16), SECRET["R"])}),
            "Q": dict(shared, **{"q.own.weight": public(10, 6)}),
        }
        for name, tensors in self.ckpts.items():
            st_io.save(tensors, os.path.join(models, name + ".safetensors"))
        # What each model's base holds now (publishes change it).
        self.current = {name: dict(tensors) for name, tensors in self.ckpts.items()}
        for name in ("TA", "TB"):   # dense diffs: merged, the tensor is the secret
            st_io.save({"shared.a.diff": SECRET[name] - shared["shared.a.weight"]},
                       os.path.join(models, name + ".safetensors"))
        self.word = {k: _bf16_word(v) for k, v in SECRET.items()}
        self.d = Daemon(model_root=models, extra_args=["--socket-mode", "0666"])
        os.chmod(self.d.workdir, 0o755)
        self.d.start()
        self.tenants = {}
        try:
            path = lambda n: os.path.join(models, n + ".safetensors")  # noqa: E731
            self.d.ctl_ok("load", "P", path("P"), "--readers", "uid:%d" % A)
            self.d.ctl_ok("load", "R", path("R"), "--readers", "uid:%d" % B)
            self.d.ctl_ok("load", "Q", path("Q"))
            self.d.ctl_ok("adapter", "load", "TA", path("TA"), "--readers", "uid:%d" % A)
            self.d.ctl_ok("adapter", "load", "TB", path("TB"), "--readers", "uid:%d" % B)
            markers = sorted(self.word.values())
            for u in (A, B, NOBODY):
                self.tenants[u] = _Tenant(self.d, u, markers)
        except BaseException:
            self.close()
            raise

    def fetch(self, uid, **q):
        """Fetches as `uid`; returns (reply, the secrets its segments hold)."""
        r = self.tenants[uid].fetch(**q)
        return r, {k for k, w in self.word.items() if w in r.get("found", ())}

    def close(self):
        for t in self.tenants.values():
            t.close()
        self.d.stop()


def _q(model, names=(), dtype=0, world=1, rank=0, dim=0, transport=1, hold=False):
    return dict(model=model, names=list(names), dtype=dtype, world=world, rank=rank, dim=dim,
                transport=transport, hold=hold)


@pytest.mark.parametrize("transport", [1, 2])
def test_shared_tensor_of_a_public_model_never_exposes_a_private_models_segment(files, transport):
    """F1 (a): P (private) and Q (public) hold identical bytes; a non-reader of
    P fetching that tensor of Q must not receive P's segment."""
    t = _Tenants(files, seed=3)
    try:
        for dtype, dim in ((0, 0), (4, 0), (0, 1)):   # a view; packed casts and slices
            r, seen = t.fetch(A, **_q("P", dtype=dtype, dim=dim, transport=transport))
            assert "error" not in r and seen == {"P"}, r
            r, seen = t.fetch(B, **_q("Q", ["shared.a.weight"], dtype=dtype, dim=dim,
                                      transport=transport))
            assert "error" not in r and r["tensors"] == 1, r
            assert not seen, (dtype, dim, r)
    finally:
        t.close()


@pytest.mark.parametrize("transport", [1, 2])
def test_a_removed_private_adapter_leaves_no_bytes_in_public_fetches(files, transport):
    """F1 (b): a tenant-private adapter applied (generation 2) then removed
    (generation 3): a public fetch of an untouched tensor must not get the
    segment packed for generation 2 (which holds the merged secret)."""
    t = _Tenants(files, seed=4)
    try:
        t.d.ctl_ok("apply", "Q", "TA:1")
        # uid A keeps its lease on generation 2, so its segments live on.
        r, seen = t.fetch(A, **_q("Q", dtype=4, transport=transport, hold=True))
        assert "error" not in r and seen == {"TA"}, r
        t.d.ctl_ok("apply", "Q")
        r, seen = t.fetch(B, **_q("Q", ["shared.b.weight"], dtype=4, transport=transport))
        assert "error" not in r and r["tensors"] == 1, r
        assert not seen, r
    finally:
        t.close()


def _publish_step(t, rng, q_stack, root):
    """One publish by a random uid to a random model: a served or made-up
    name, its shape or another, public values or the model's current bytes
    (an equality guess). Who may not read the model (its readers, the
    adapter applied to Q) gets the very refusal a made-up request gets, and
    nothing changes; a reader publishes or is told what is wrong."""
    uid = rng.choice([A, B, NOBODY])
    model = rng.choice(["P", "R", "Q"])
    names = sorted(t.ckpts[model])
    name = rng.choice(names + ["made.up.weight"])
    shape = list(t.current[model][name].shape) if name in t.current[model] else [2, 3]
    if rng.random() < 0.2:
        shape = shape[::-1] + [1]
    if name in t.current[model] and rng.random() < 0.5:
        values = t.current[model][name]   # its bytes now
    else:
        values = torch.randint(-8, 9, tuple(shape)).float() / 8
    values = values.reshape(shape) if values.numel() == math.prod(shape) else torch.zeros(shape)
    spec = [[name, 2, shape, values.contiguous().numpy().tobytes().hex()]]
    generation = root.info(model).generation
    r = t.tenants[uid].fetch(publish=model, tensors=spec)
    needs = {model} - {"Q"} | ({q_stack} if model == "Q" and q_stack else set())
    if not needs <= READABLE[uid]:
        probe = t.tenants[uid].fetch(publish=model, tensors=[["no.such", 2, [1], "00000000"]])
        assert r.get("error") == "PERMISSION_DENIED" and r == probe, (uid, model, spec[0][:3], r)
        assert name not in r["message"] and "F32" not in r["message"], r
        assert root.info(model).generation == generation
        return
    if name not in t.current[model] or shape != list(t.current[model][name].shape):
        assert r.get("error") in ("NOT_FOUND", "INVALID_ARGUMENT"), (uid, model, name, r)
        return
    assert "error" not in r, (uid, model, name, r)
    same = torch.equal(values, t.current[model][name])
    assert r["changed"] == (0 if same else 1), (r, same)
    t.current[model][name] = values


@pytest.mark.parametrize("seed", [1, 2])
def test_no_client_ever_maps_or_reads_a_byte_it_may_not_read(files, seed):
    """F1 as a property: models sharing tensors, tenant-private models and
    adapters applied and removed, three uids, both transports, keep and bf16,
    row and column shards; after every fetch, every byte of every segment the
    client maps (shm) or Reads (grpc) belongs to something it may read.
    Issue 38 M1: publishes by every uid mixed in; one to a model the uid may
    not read gets no name, shape or equality answer, and changes nothing."""
    rng = random.Random(seed)
    t = _Tenants(files, seed)
    root = weightd.Client(socket=t.d.socket)
    try:
        q_stack = None   # the adapter applied to Q, if any
        fetched = published = 0
        for step in range(110):
            if rng.random() < 0.05:   # leases held so far end
                for u in (A, B, NOBODY):
                    t.tenants[u].fetch(release=True)
                continue
            if rng.random() < 0.15:
                q_stack = rng.choice([None, "TA", "TB"])
                t.d.ctl_ok("apply", "Q", *([q_stack + ":1"] if q_stack else []))
                continue
            if rng.random() < 0.15:
                _publish_step(t, rng, q_stack, root)
                published += 1
                continue
            uid = rng.choice([A, B, NOBODY])
            model = rng.choice(["P", "R", "Q", "Q"])
            names = sorted(t.ckpts[model])
            names = rng.sample(names, rng.randint(1, len(names))) if rng.random() < 0.5 else []
            world = rng.choice([1, 2, 3])
            q = _q(model, names, dtype=rng.choice([0, 4]), world=world,
                   rank=rng.randrange(world), dim=rng.choice([0, 1]),
                   transport=rng.choice([1, 2]), hold=rng.random() < 0.3)
            r, seen = t.fetch(uid, **q)
            needs = {model} - {"Q"} | ({q_stack} if model == "Q" and q_stack else set())
            if not needs <= READABLE[uid]:
                assert r.get("error") == "PERMISSION_DENIED", (step, uid, q, r)
                continue
            assert "error" not in r, (step, uid, q, r)
            fetched += 1
            leaked = seen - READABLE[uid]
            assert not leaked, ("step %d: uid %d fetched %s and could read bytes of %s"
                                % (step, uid, q, sorted(leaked)))
        assert fetched >= 30 and published >= 5, (fetched, published)
    finally:
        root.close()
        t.close()


# ------------------------------------------------------------ leases


def test_leaked_lease_token_is_useless_from_another_uid(files):
    d = open_daemon(files)
    try:
        d.ctl_ok("load", "m", model_path(files, "base.safetensors"))
        lease, token = fetch_lease(d, NOBODY, "m")
        r = run_py(OTHER, _ATTACH, d.data_socket, lease, token, 1)
        words = parse_result(r)
        assert words[:2] == ["error", "PERMISSION_DENIED"], r.stdout + r.stderr
        assert "fetched by uid 65534" in words[2] and "uid 1234" in words[2]
        r = run_py(NOBODY, _ATTACH, d.data_socket, lease, token, 1)
        assert parse_result(r) == ["fds", "1"], r.stdout + r.stderr
        # The grpc transport's Read: the same rule.
        lease, token = fetch_lease(d, NOBODY, "m", transport=GRPC)
        r = run_py(OTHER, _READ, d.socket, lease, token)
        words = parse_result(r)
        assert words[:2] == ["error", "PERMISSION_DENIED"], r.stdout + r.stderr
        r = run_py(NOBODY, _READ, d.socket, lease, token)
        words = parse_result(r)
        # The whole segment the tensors live in (at least their 256 bytes).
        assert words[0] == "bytes" and int(words[1]) >= 10 * 4 * 4 + 6 * 4 * 4, r.stdout + r.stderr
    finally:
        d.stop()


# ------------------------------------------------------------ TCP: TLS and tokens


def tcp_daemon(files, *args):
    port = free_port()
    d = open_daemon(files, "--listen", "127.0.0.1:%d" % port, *args)
    d.target = "127.0.0.1:%d" % port
    return d


def pki(files, name):
    return os.path.join(files["pki"], name)


def test_tls_listener_refuses_plaintext_and_serves_verified_clients(files):
    d = tcp_daemon(files, "--tls-cert", pki(files, "server.pem"), "--tls-key",
                   pki(files, "server.key"))
    try:
        d.ctl_ok("load", "m", model_path(files, "base.safetensors"))
        r = d.ctl("list", target=d.target)
        assert_refused(r, "UNAVAILABLE")
        ok = d.ctl_ok("list", target=d.target, global_args=["--tls-ca", pki(files, "ca.pem")])
        assert "m" in ok.stdout
        # A daemon certificate our CA did not sign is not trusted.
        r = d.ctl("list", target=d.target, global_args=["--tls-ca", pki(files, "rogue.pem")])
        assert_refused(r, "UNAVAILABLE")
    finally:
        d.stop()


def test_client_ca_requires_a_certificate_it_signed(files):
    d = tcp_daemon(files, "--tls-cert", pki(files, "server.pem"), "--tls-key",
                   pki(files, "server.key"), "--tls-client-ca", pki(files, "ca.pem"))
    try:
        d.ctl_ok("load", "alice_only", model_path(files, "base.safetensors"),
                 "--readers", "cn:alice")
        ca = ["--tls-ca", pki(files, "ca.pem")]
        assert_refused(d.ctl("list", target=d.target, global_args=ca), "UNAVAILABLE")
        rogue = ca + ["--tls-cert", pki(files, "rogue.pem"), "--tls-key", pki(files, "rogue.key")]
        assert_refused(d.ctl("list", target=d.target, global_args=rogue), "UNAVAILABLE")
        alice = ca + ["--tls-cert", pki(files, "alice.pem"), "--tls-key", pki(files, "alice.key")]
        bob = ca + ["--tls-cert", pki(files, "bob.pem"), "--tls-key", pki(files, "bob.key")]
        out = out_file(files, "alice.safetensors")
        d.ctl_ok("fetch", "alice_only", "--transport", "grpc", "--out", out, target=d.target,
                 global_args=alice)
        assert torch.equal(st_io.load(out)["emb.weight"], BASE["emb.weight"])
        r = d.ctl("fetch", "alice_only", "--transport", "grpc", "--out",
                  out_file(files, "bob.safetensors"), target=d.target, global_args=bob)
        assert_refused(r, "PERMISSION_DENIED", 'certificate CN "bob"', 'model "alice_only"')
    finally:
        d.stop()


def test_bearer_token_required_on_tcp_except_for_health(files):
    d = tcp_daemon(files, "--auth-token-file", files["tokens"])   # loopback: no TLS needed
    try:
        d.ctl_ok("load", "m", model_path(files, "base.safetensors"))
        assert_refused(d.ctl("list", target=d.target), "UNAUTHENTICATED", "missing bearer token")
        r = d.ctl("list", target=d.target, env={"WEIGHTD_TOKEN": "not-a-valid-token-at-all"})
        assert_refused(r, "UNAUTHENTICATED", "invalid bearer token")
        # kubelet's gRPC probe sends no token.
        assert d.ctl_ok("health", target=d.target).stdout.strip() == "SERVING"
        d.ctl_ok("list", target=d.target, env={"WEIGHTD_TOKEN": TOKENS["alice"]})
        d.ctl_ok("list", target=d.target,
                 global_args=["--token-file", os.path.join(files["dir"], "bob.token")])
        # The Unix socket needs no token (peer credentials instead).
        d.ctl_ok("list")
    finally:
        d.stop()


def test_token_readers_and_token_admins(files):
    d = tcp_daemon(files, "--auth-token-file", files["tokens"], "--admin-token-names", "alice")
    try:
        alice = {"WEIGHTD_TOKEN": TOKENS["alice"]}
        bob = {"WEIGHTD_TOKEN": TOKENS["bob"]}
        path = model_path(files, "base.safetensors")
        assert_refused(d.ctl("load", "m", path, target=d.target, env=bob), "PERMISSION_DENIED",
                       'token "bob"', "--admin-token-names")
        d.ctl_ok("load", "m", path, "--readers", "token:alice", target=d.target, env=alice)
        out = out_file(files, "t.safetensors")
        d.ctl_ok("fetch", "m", "--transport", "grpc", "--out", out, target=d.target, env=alice)
        assert torch.equal(st_io.load(out)["head.weight"], BASE["head.weight"])
        r = d.ctl("fetch", "m", "--transport", "grpc", "--out", out, target=d.target, env=bob)
        assert_refused(r, "PERMISSION_DENIED", 'token "bob"', 'model "m"')
        # Unix-socket uids are not token principals: uid 1234 is no reader either.
        assert_refused(d.ctl("info", "m", user=OTHER), "PERMISSION_DENIED", "uid 1234")
    finally:
        d.stop()


def test_python_client_tls_and_token(files):
    import weightd
    d = tcp_daemon(files, "--tls-cert", pki(files, "server.pem"), "--tls-key",
                   pki(files, "server.key"), "--auth-token-file", files["tokens"])
    try:
        d.ctl_ok("load", "m", model_path(files, "base.safetensors"), "--readers", "token:alice")
        with weightd.Client(target=d.target, tls_ca=pki(files, "ca.pem"),
                            token=TOKENS["alice"]) as c:
            assert [m.name for m in c.list()] == ["m"]
            assert c.list()[0].readers == ("token:alice",)
            with c.fetch("m", transport="grpc") as h:
                assert torch.equal(h.state_dict()["emb.weight"], BASE["emb.weight"])
        with weightd.Client(target=d.target, tls_ca=pki(files, "ca.pem"),
                            token=TOKENS["bob"]) as c:
            assert c.list() == []
            with pytest.raises(weightd.Error) as e:
                c.fetch("m", transport="grpc")
            assert e.value.code == "PERMISSION_DENIED"
        with weightd.Client(target=d.target, tls_ca=pki(files, "ca.pem"),
                            token="wrong-token-wrong-token") as c:
            with pytest.raises(weightd.Error) as e:
                c.list()
            assert e.value.code == "UNAUTHENTICATED"
            assert c.health()   # no token needed
    finally:
        d.stop()


def test_token_in_clear_text_on_a_non_loopback_address_is_refused_at_start(files):
    port = free_port()
    args = [WEIGHTD, "--socket", os.path.join(files["dir"], "never.sock"), "--model-root",
            files["models"], "--listen", "0.0.0.0:%d" % port, "--auth-token-file",
            files["tokens"]]
    r = subprocess.run(args, capture_output=True, text=True, timeout=20)
    assert r.returncode == 2, r.stderr
    assert "error: INVALID_ARGUMENT:" in r.stderr and "--allow-insecure-token" in r.stderr
    assert not os.path.exists(os.path.join(files["dir"], "never.sock"))
    # Explicitly allowed: it starts and still checks the token.
    d = daemon(files, "--listen", "0.0.0.0:%d" % port, "--auth-token-file", files["tokens"],
               "--allow-insecure-token")
    try:
        target = "127.0.0.1:%d" % port
        assert_refused(d.ctl("list", target=target), "UNAUTHENTICATED")
        d.ctl_ok("list", target=target, env={"WEIGHTD_TOKEN": TOKENS["bob"]})
    finally:
        d.stop()


@pytest.mark.parametrize("args, words", [
    (["--tls-cert", "x.pem"], ["--tls-key"]),
    (["--listen", "127.0.0.1:1", "--tls-client-ca", "ca.pem"], ["--tls-client-ca"]),
    (["--auth-token-file", "t"], ["--listen"]),
    (["--allow-uid", "12x"], ["--allow-uid", "12x"]),
])
def test_inconsistent_security_flags_stop_the_daemon(files, args, words):
    r = subprocess.run([WEIGHTD, "--socket", os.path.join(files["dir"], "never.sock"),
                        "--model-root", files["models"]] + args,
                       capture_output=True, text=True, timeout=20)
    assert r.returncode == 2, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr


def test_short_or_missing_token_file_stops_the_daemon(files):
    short = os.path.join(files["dir"], "short.tokens")
    with open(short, "w") as f:
        f.write("alice short\n")
    for path, word in ((short, "shorter than 16"), (os.path.join(files["dir"], "nope"), "nope")):
        r = subprocess.run([WEIGHTD, "--socket", os.path.join(files["dir"], "never.sock"),
                            "--model-root", files["models"], "--listen",
                            "127.0.0.1:%d" % free_port(), "--auth-token-file", path],
                           capture_output=True, text=True, timeout=20)
        assert r.returncode != 0 and word in r.stderr, r.stderr


# ------------------------------------------------------------ fleet RPCs (peers)
# FindCheckpoint / ReadCheckpoint are for the daemons --fleet-members lists
# (the identities they present on --listen), and answer only about copies a
# model or adapter holding them lets that member read, matching its samples.


def _peer_call(d, method, req, token=None, unix=False):
    """Calls Models.`method` as a peer would: over --listen with `token`'s
    bearer token, or on the Unix socket (a local admin: root is the daemon's
    uid). Returns ("OK", answer) or (code name, details)."""
    import grpc
    from weightd.v1 import weightd_pb2_grpc as pbg
    ch = grpc.insecure_channel("unix:" + d.socket if unix else d.target)
    md = [("authorization", "Bearer " + TOKENS[token])] if token else []
    try:
        call = getattr(pbg.ModelsStub(ch), method)
        if method == "ReadCheckpoint":
            return "OK", b"".join(c.data for c in call(req, metadata=md, timeout=10))
        return "OK", call(req, metadata=md, timeout=10)
    except grpc.RpcError as e:
        return e.code().name, e.details()
    finally:
        ch.close()


def _base_query(files):
    """(FindCheckpointRequest with true samples, ReadCheckpointRequest of
    the first 16 bytes, the file) for base.safetensors."""
    from weightd.v1 import weightd_pb2 as pb
    import peer_protocol as pp
    f = pp.StFile(model_path(files, "base.safetensors"))
    find = pp.find_request(pb, [f], [(0, 0, 64), (0, 100, 60)])
    read = pb.ReadCheckpointRequest(key=find.key, copy=pp.copy_id([f]),
                                    range=pb.CheckpointRange(file=0, offset=0, length=16))
    return find, read, f


def test_peer_rpcs_are_off_without_fleet_members(files):
    d = tcp_daemon(files, "--auth-token-file", files["tokens"])
    try:
        d.ctl_ok("load", "m", model_path(files, "base.safetensors"))
        find, read, _ = _base_query(files)
        for who in ({"unix": True}, {"token": "alice"}):
            for method, req in (("FindCheckpoint", find), ("ReadCheckpoint", read)):
                code, msg = _peer_call(d, method, req, **who)
                assert code == "PERMISSION_DENIED" and "--fleet-members" in msg, (who, code, msg)
    finally:
        d.stop()


def test_only_listed_fleet_members_may_call_the_peer_rpcs(files):
    from weightd.v1 import weightd_pb2 as pb
    d = tcp_daemon(files, "--auth-token-file", files["tokens"], "--fleet-members", "token:alice")
    try:
        d.ctl_ok("load", "m", model_path(files, "base.safetensors"))
        find, read, f = _base_query(files)
        # A local admin (root, the daemon's uid) and a token the flag does
        # not list are refused, before the request is looked at (a malformed
        # key is still PERMISSION_DENIED); no token is UNAUTHENTICATED.
        bad = pb.FindCheckpointRequest(key=b"x")
        for who, name in (({"unix": True}, "uid 0"), ({"token": "bob"}, 'token "bob"')):
            for method, req in (("FindCheckpoint", find), ("ReadCheckpoint", read),
                                ("FindCheckpoint", bad)):
                code, msg = _peer_call(d, method, req, **who)
                assert code == "PERMISSION_DENIED", (who, method, code, msg)
                assert name in msg and "is not a fleet member" in msg, msg
        assert _peer_call(d, "FindCheckpoint", find)[0] == "UNAUTHENTICATED"
        # The member gets the public model's digests and bytes.
        code, got = _peer_call(d, "FindCheckpoint", find, token="alice")
        assert code == "OK", got
        assert list(got.tensor_digests) == [f.tensor_digests()]
        assert got.copy == read.copy
        assert _peer_call(d, "ReadCheckpoint", read, token="alice") == ("OK", f.data[:16])
    finally:
        d.stop()


def test_a_private_checkpoint_is_offered_only_to_members_its_readers_admit(files):
    import peer_protocol as pp
    d = tcp_daemon(files, "--auth-token-file", files["tokens"],
                   "--fleet-members", "token:alice,token:bob")
    try:
        path = model_path(files, "base.safetensors")
        find, read, f = _base_query(files)
        code, unknown = _peer_call(d, "FindCheckpoint", find, token="alice")
        assert code == "NOT_FOUND"
        d.ctl_ok("load", "priv", path, "--readers", "uid:%d" % OTHER)
        # Held only by a model whose readers do not admit the member: the
        # same NOT_FOUND as when nothing is held (no existence oracle), no
        # bytes, as Fetch refuses it.
        for who in ("alice", "bob"):
            code, msg = _peer_call(d, "FindCheckpoint", find, token=who)
            assert (code, msg) == ("NOT_FOUND", unknown), msg
            code, msg = _peer_call(d, "ReadCheckpoint", read, token=who)
            assert code == "NOT_FOUND", msg
        r = d.ctl("fetch", "priv", "--transport", "grpc", "--out", out_file(files, "p.st"),
                  target=d.target, env={"WEIGHTD_TOKEN": TOKENS["alice"]})
        assert_refused(r, "PERMISSION_DENIED")
        # Another holder of the same files admits alice: alice, not bob.
        d.ctl_ok("load", "alices", path, "--readers", "token:alice")
        assert _peer_call(d, "FindCheckpoint", find, token="alice")[0] == "OK"
        assert _peer_call(d, "ReadCheckpoint", read, token="alice") == ("OK", f.data[:16])
        assert _peer_call(d, "FindCheckpoint", find, token="bob")[0] == "NOT_FOUND"
        assert _peer_call(d, "ReadCheckpoint", read, token="bob")[0] == "NOT_FOUND"
        # A public holder admits every member.
        d.ctl_ok("unload", "alices")
        d.ctl_ok("load", "pub", path)
        assert _peer_call(d, "FindCheckpoint", find, token="bob")[0] == "OK"
        assert _peer_call(d, "ReadCheckpoint", read, token="bob") == ("OK", f.data[:16])
        d.ctl_ok("unload", "pub")
        assert _peer_call(d, "FindCheckpoint", find, token="bob")[0] == "NOT_FOUND"
        assert pp.copy_id([f]) == read.copy
    finally:
        d.stop()


def test_the_copy_offered_is_the_one_matching_the_askers_samples_or_none(files):
    from weightd.v1 import weightd_pb2 as pb
    d = tcp_daemon(files, "--auth-token-file", files["tokens"], "--fleet-members", "token:alice")
    try:
        d.ctl_ok("load", "m", model_path(files, "base.safetensors"))
        find, _, _ = _base_query(files)
        assert _peer_call(d, "FindCheckpoint", find, token="alice")[0] == "OK"
        # Samples whose digests are not the held bytes': no copy, not the
        # first one.
        wrong = pb.FindCheckpointRequest()
        wrong.CopyFrom(find)
        wrong.sample_digests[1] = bytes(16)
        code, msg = _peer_call(d, "FindCheckpoint", wrong, token="alice")
        assert code == "NOT_FOUND", msg
        # No samples: nothing picks a copy.
        code, msg = _peer_call(d, "FindCheckpoint", pb.FindCheckpointRequest(key=find.key),
                               token="alice")
        assert code == "INVALID_ARGUMENT" and "samples" in msg, msg
        del wrong.sample_digests[1]
        code, msg = _peer_call(d, "FindCheckpoint", wrong, token="alice")
        assert code == "INVALID_ARGUMENT", msg
    finally:
        d.stop()


# ------------------------------------------------------------ model roots


def test_load_paths_are_confined_to_the_model_root_after_symlinks(files):
    outside = tempfile.mkdtemp(prefix="weightd-outside-")
    try:
        st_io.save(BASE, os.path.join(outside, "secret.safetensors"))
        link = os.path.join(files["models"], "escape.safetensors")
        os.symlink(os.path.join(outside, "secret.safetensors"), link)
        inside = os.path.join(files["models"], "inside.safetensors")
        os.symlink(os.path.join(files["models"], "base.safetensors"), inside)
        d = open_daemon(files)
        try:
            for p in (link, os.path.join(outside, "secret.safetensors"),
                      os.path.join(files["models"], "..", os.path.basename(outside),
                                   "secret.safetensors")):
                assert_refused(d.ctl("load", "x", p), "PERMISSION_DENIED")
                assert_refused(d.ctl("adapter", "load", "x", p), "PERMISSION_DENIED")
            d.ctl_ok("load", "x", inside)
        finally:
            d.stop()
            os.unlink(link)
            os.unlink(inside)
    finally:
        shutil.rmtree(outside, ignore_errors=True)

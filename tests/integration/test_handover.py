"""Hand-over on upgrade (issue [restart]): a new weightd started with
--take-over receives the running daemon's checkpoint segments and sockets,
restores the same state from the same --state-dir without reading the
checkpoints, and takes over while 8 client processes fetch in a loop.

Real daemons and real client processes: zero failed fetches, zero wrong
bytes (each fetch compared with the bytes served before the hand-over, and
those with PyTorch's torch.chunk of the file), the old process exits 0, the
successor holds the very same memory (the same memfd inodes, the same
checkpoint bytes) and serves the same models, stacks, generations and
weights_id. A successor that dies or lies halfway leaves the old daemon
serving, changes included; --take-over with nothing running starts as usual.
"""
import fcntl
import hashlib
import json
import os
import signal
import socket
import struct
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from harness import Daemon, WEIGHTD, user_prefix
from reference import cast_shard_ref
import st_io
import test_lora_parity as lora

import weightd  # noqa: E402  (harness puts the build's package on the path)

SEGMENT = 4 << 20  # --checkpoint-segment-bytes: several segments per checkpoint


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("models"))
    base = lora.build_base()
    st_io.save(base["llama32"], os.path.join(root, "base32.safetensors"))
    mods = lora._modules(layers=[0], mods={"self_attn.q_proj": lora.PROJ["self_attn.q_proj"]})
    lora.make_peft(root, "a1", mods, r=4, alpha=8)
    g = torch.Generator().manual_seed(7)
    big = {"layers.%d.weight" % i: torch.randn(512, 1024, generator=g).to(torch.bfloat16)
           for i in range(12)}  # 12 MiB in 3 files: 3 segments of 4 MiB
    os.mkdir(os.path.join(root, "big"))
    names = sorted(big)
    for f in range(3):
        st_io.save({n: big[n] for n in names[4 * f:4 * f + 4]},
                   os.path.join(root, "big", "part-%d.safetensors" % f))
    return root, big


def _args(root, state):
    return ["--state-dir", state, "--checkpoint-segment-bytes", str(SEGMENT)]


def _setup(d, root):
    d.ctl_ok("load", "m1", os.path.join(root, "base32.safetensors"))
    d.ctl_ok("load", "big", os.path.join(root, "big"))
    d.ctl_ok("load", "big2", os.path.join(root, "big"))  # the same files, shared
    d.ctl_ok("adapter", "load", "a1", os.path.join(root, "a1"))
    d.ctl_ok("apply", "m1", "a1:0.5")


def _hashes(state_dict):
    return {n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, t in state_dict.items()}


def _state(c):
    models = {m.name: (m.generation, tuple(m.adapters)) for m in c.list()}
    ids = {m: c.info(m).weights_id for m in models}
    digests = {m: {t.name: t.digest for t in c.info(m).tensors} for m in models}
    return models, ids, digests


def _checkpoint_memfds(pid):
    """{inode: size} of the process's checkpoint segments (/proc/PID/fd)."""
    out = {}
    fd_dir = "/proc/%d/fd" % pid
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue
        if target.startswith("/memfd:weightd:checkpoint"):
            st = os.stat(os.path.join(fd_dir, fd))
            out[st.st_ino] = st.st_size
    return out


_WORKER = r"""
import hashlib, json, os, sys, time
import torch
import weightd
sock, model, world, rank, dtype, expect_file, stop_file, out_file = sys.argv[1:]
with open(expect_file) as f:
    expect = json.load(f)
ok = wrong = 0
failures, done_at = [], []
c = weightd.Client(socket=sock, retry_deadline=30)
while not os.path.exists(stop_file):
    try:
        with c.fetch(model, world=int(world), rank=int(rank), dtype=dtype or None) as h:
            got = {n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                   for n, t in h.state_dict().items()}
        if got == expect:
            ok += 1
        else:
            wrong += 1
        done_at.append(time.time())
        if len(done_at) == 1:
            open(out_file + ".started", "w").close()
    except Exception as e:  # every failure counts
        failures.append(repr(e))
        time.sleep(0.05)
with open(out_file, "w") as f:
    json.dump({"ok": ok, "wrong": wrong, "failures": failures, "done_at": done_at}, f)
"""

# (model, world, rank, dtype) of the 8 workers.
_WORKERS = [("m1", 2, 0, ""), ("m1", 2, 1, "bf16"), ("big", 2, 0, ""), ("big", 2, 1, "f32"),
            ("big2", 3, 2, ""), ("big2", 1, 0, "f16"), ("m1", 1, 0, ""), ("big", 4, 3, "bf16")]


def _successor(d, state, log_path, *extra):
    log = open(log_path, "ab")
    proc = subprocess.Popen(
        [WEIGHTD, "--socket", d.socket, "--model-root", d.model_root, *_args(d.model_root, state),
         "--take-over", *extra], stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc


def _read(path):
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")


def _wait_for(pred, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError("timed out waiting for " + what)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_handover_under_load_loses_no_fetch_and_keeps_the_memory(files, tmp_path):
    root, big = files
    state = str(tmp_path / "state")
    listen = "127.0.0.1:%d" % _free_port()  # the successor binds it too (SO_REUSEPORT)
    d = Daemon(model_root=root, extra_args=_args(root, state) + ["--listen", listen],
               workdir=str(tmp_path / "run"))
    d.start()
    succ = None
    workers = []
    try:
        _setup(d, root)
        with weightd.Client(socket=d.socket) as c:
            before = _state(c)
            stats_before = c.stats()
            # What each worker must get: the bytes served now, the base
            # checkpoint's equal to PyTorch's torch.chunk of the file.
            expect = {}
            for i, (model, world, rank, dtype) in enumerate(_WORKERS):
                with c.fetch(model, world=world, rank=rank, dtype=dtype or None) as h:
                    sd = h.state_dict()
                if model.startswith("big"):
                    want_dtype = {"": None, "f32": torch.float32, "bf16": torch.bfloat16,
                                  "f16": torch.float16}[dtype]
                    for n, t in big.items():
                        ref = cast_shard_ref(t, world, rank, want_dtype)
                        assert torch.equal(sd[n], ref), (model, n, rank, dtype)
                expect_file = str(tmp_path / ("expect%d.json" % i))
                with open(expect_file, "w") as f:
                    json.dump(_hashes(sd), f)
                expect[i] = expect_file
        old_memfds = _checkpoint_memfds(d.proc.pid)
        assert len(old_memfds) >= 4, old_memfds  # base32 + 3 segments of big

        stop_file = str(tmp_path / "stop")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        for i, (model, world, rank, dtype) in enumerate(_WORKERS):
            out = str(tmp_path / ("out%d.json" % i))
            workers.append((out, subprocess.Popen(
                [sys.executable, "-c", _WORKER, d.socket, model, str(world), str(rank), dtype,
                 expect[i], stop_file, out], env=env)))
        # Every worker fetching before the hand-over begins.
        _wait_for(lambda: all(os.path.exists(out + ".started") for out, _ in workers), 120,
                  "every worker's first fetch")
        time.sleep(0.5)
        handover_began = time.time()

        succ_log = str(tmp_path / "successor.log")
        succ = _successor(d, state, succ_log, "--listen", listen)
        assert d.proc.wait(timeout=90) == 0, d.log()
        switched = time.time()
        _wait_for(lambda: "taken_over" in _read(succ_log), 30, "the successor's taken_over")
        assert succ.poll() is None, _read(succ_log)
        new_memfds = _checkpoint_memfds(succ.pid)
        time.sleep(3.0)  # the workers fetch from the successor
        open(stop_file, "w").close()
        results = []
        for out, p in workers:
            assert p.wait(timeout=60) == 0
            with open(out) as f:
                results.append(json.load(f))
        workers = []

        print("fetches per worker:", [r["ok"] for r in results])
        failures = [f for r in results for f in r["failures"]]
        assert failures == [], failures
        assert sum(r["wrong"] for r in results) == 0
        assert all(r["ok"] > 0 for r in results), [r["ok"] for r in results]
        before_n = sum(1 for r in results for t in r["done_at"] if t < handover_began)
        after = sum(1 for r in results for t in r["done_at"] if t > switched)
        print("fetches before the hand-over began:", before_n,
              "after the old daemon exited:", after)
        assert before_n >= len(_WORKERS) and after >= len(_WORKERS), (before_n, after)

        old_log, new_log = d.log(), _read(succ_log)
        assert "handed_over" in old_log and "handed over to a successor" in old_log, old_log
        # Both checkpoints' segments adopted and checked in full, none read.
        assert new_log.count("load_adopted") == 2, new_log
        assert "handover_segments_refused" not in new_log, new_log
        assert "verify=full" in new_log or '"verify":"full"' in new_log, new_log
        # The very same memory: every checkpoint memfd of the old process.
        assert new_memfds == old_memfds
        with weightd.Client(socket=d.socket) as c:
            assert _state(c) == before
            s = c.stats()
            for key in ("checkpoint_bytes_logical", "checkpoint_bytes_resident"):
                assert s[key] == stats_before[key], key
            # The successor serves changes too.
            c.load("m3", os.path.join(root, "base32.safetensors"))
            assert c.info("m3").generation >= 1
        assert os.path.exists(d.socket) and os.path.exists(d.data_socket)
        assert "m3" in d.ctl_ok("list", target=listen).stdout
    finally:
        for _, p in workers:
            p.kill()
        if succ is not None and succ.poll() is None:
            succ.send_signal(signal.SIGTERM)
            assert succ.wait(timeout=30) == 0
        d.stop()


# ------------------------------------------------------------ failed hand-overs

def _msg(kind, payload=b""):
    return b"WDH1" + bytes([kind, 0, 0, 0]) + struct.pack("<I", len(payload)) + payload


def _recv_msg(s):
    head = b""
    fds = []
    while len(head) < 12:
        data, anc, _, _ = s.recvmsg(12 - len(head), socket.CMSG_SPACE(250 * 4))
        if not data:
            raise EOFError
        head += data
        for level, typ, raw in anc:
            if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
                fds += list(struct.unpack("%di" % (len(raw) // 4), raw[:len(raw) - len(raw) % 4]))
    assert head[:4] == b"WDH1"
    n = struct.unpack("<I", head[8:12])[0]
    body = b""
    while len(body) < n:
        chunk = s.recv(n - len(body))
        if not chunk:
            raise EOFError
        body += chunk
    return head[4], body, fds


def _fake_successor(path, stage):
    """Speaks the successor's side up to `stage`, then hangs up:
    'begin' (after BEGIN), 'manifest' (after the manifest), 'go' (after GO,
    without STARTED), 'garbage' (a malformed first message)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.settimeout(30)
    got_fds = []
    try:
        if stage == "garbage":
            s.sendall(b"not a hand-over message at all")
            time.sleep(0.2)
            return None
        s.sendall(_msg(1, json.dumps({"pid": os.getpid()}).encode()))
        if stage == "begin":
            return None
        manifest = b""
        while True:
            kind, body, fds = _recv_msg(s)
            got_fds += fds
            if kind == 2:
                manifest += body
            elif kind == 4:
                break
        m = json.loads(manifest)
        assert m["fds"] == len(got_fds)
        if stage == "manifest":
            return m
        s.sendall(_msg(5))
        kind, _, _ = _recv_msg(s)
        assert kind == 6  # GO: the old daemon has stopped accepting
        time.sleep(0.5)   # ... and its clients retry meanwhile
        return m
    finally:
        for fd in got_fds:
            os.close(fd)
        s.close()


@pytest.mark.parametrize("stage", ["garbage", "begin", "manifest", "go"])
def test_a_successor_that_fails_halfway_leaves_the_daemon_serving(files, tmp_path, stage):
    root, big = files
    state = str(tmp_path / "state")
    with Daemon(model_root=root, extra_args=_args(root, state)) as d:
        d.ctl_ok("load", "big", os.path.join(root, "big"))
        with weightd.Client(socket=d.socket) as c:
            before = _state(c)
        m = _fake_successor(os.path.join(state, "handover.sock"), stage)
        if stage in ("manifest", "go"):
            names = {t[0] for ck in m["checkpoints"] for t in ck["tensors"]}
            assert names == set(big)
        _wait_for(lambda: "handover_failed" in d.log(), 10, "handover_failed in the log")
        assert d.alive()
        with weightd.Client(socket=d.socket, retry_deadline=10) as c:
            assert c.health()
            assert _state(c) == before
            with c.fetch("big", world=2, rank=1) as h:
                sd = h.state_dict()
            for n, t in big.items():
                assert torch.equal(sd[n], cast_shard_ref(t, 2, 1)), n
            # Changes are open again.
            c.load("m1", os.path.join(root, "base32.safetensors"))
            c.unload("m1")
        # And a real successor still takes over afterwards.
        succ = _successor(d, state, str(tmp_path / "successor.log"))
        try:
            assert d.proc.wait(timeout=60) == 0, d.log()
            _wait_for(lambda: "taken_over" in _read(str(tmp_path / "successor.log")), 30,
                      "taken_over")
            with weightd.Client(socket=d.socket) as c:
                assert _state(c) == before
        finally:
            succ.send_signal(signal.SIGTERM)
            assert succ.wait(timeout=30) == 0


def test_a_successor_killed_during_its_restore_leaves_the_daemon_serving(files, tmp_path):
    root, big = files
    state = str(tmp_path / "state")
    with Daemon(model_root=root, extra_args=_args(root, state)) as d:
        _setup(d, root)
        for i in range(8):  # a restore long enough to be caught in (its log lines)
            d.ctl_ok("load", "s%d" % i, os.path.join(root, "base32.safetensors"))
        with weightd.Client(socket=d.socket) as c:
            before = _state(c)
        # The successor logs to a 4 KiB pipe this test stops reading once
        # the hand-over has begun: it blocks in its restore, deterministically
        # before READY, and is killed there.
        r, w = os.pipe()
        fcntl.fcntl(w, 1031, 4096)  # F_SETPIPE_SZ
        succ = subprocess.Popen(
            [WEIGHTD, "--socket", d.socket, "--model-root", d.model_root, *_args(root, state),
             "--take-over"], stdout=w, stderr=subprocess.STDOUT)
        os.close(w)
        seen = b""
        while b"take_over_begin" not in seen:
            chunk = os.read(r, 256)
            assert chunk, seen
            seen += chunk
        time.sleep(1.0)
        assert succ.poll() is None
        assert d.alive()
        succ.kill()
        succ.wait()
        rest = b""
        while True:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            rest += chunk
        os.close(r)
        assert b"restore_entry" in seen + rest and b"taken_over" not in rest, rest
        _wait_for(lambda: "handover_failed" in d.log(), 30, "handover_failed")
        assert d.alive()
        with weightd.Client(socket=d.socket, retry_deadline=10) as c:
            assert _state(c) == before
            c.unload("big2")
            c.load("big2", os.path.join(root, "big"))
            with c.fetch("big2", world=2, rank=0) as h:
                sd = h.state_dict()
            for n, t in big.items():
                assert torch.equal(sd[n], cast_shard_ref(t, 2, 0)), n


def test_take_over_with_nothing_running_starts_as_usual(files, tmp_path):
    root, _ = files
    state = str(tmp_path / "state")
    with Daemon(model_root=root, extra_args=["--take-over", "--state-dir", state]) as d:
        assert "take_over_none" in d.log()
        d.ctl_ok("load", "m1", os.path.join(root, "base32.safetensors"))


def test_take_over_needs_the_same_state_dir_on_both_sides(files, tmp_path):
    root, _ = files
    # Without --state-dir the successor could not restore anything.
    r = subprocess.run([WEIGHTD, "--socket", str(tmp_path / "x.sock"), "--model-root", root,
                        "--take-over"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--take-over needs --state-dir" in r.stderr, r.stderr
    # A running daemon without --state-dir, or with another one, offers no
    # hand-over where the successor looks (its own state directory); told
    # where the other's is, the successor refuses it. Either way the running
    # daemon serves on and its journal is untouched.
    s2, s4 = str(tmp_path / "s2"), str(tmp_path / "s4")
    for old_args, succ_args, why in (
            ([], ["--state-dir", str(tmp_path / "s1")], "offers no hand-over"),
            (["--state-dir", s2], ["--state-dir", str(tmp_path / "s3")], "offers no hand-over"),
            (["--state-dir", s4], ["--state-dir", str(tmp_path / "s5"), "--handover-socket",
                                   os.path.join(s4, "handover.sock")],
             "give both the same directory")):
        with Daemon(model_root=root, extra_args=old_args) as d:
            d.ctl_ok("load", "m1", os.path.join(root, "base32.safetensors"))
            journal = os.path.join(old_args[1], "journal") if old_args else None
            before = open(journal, "rb").read() if journal else None
            r = subprocess.run([WEIGHTD, "--socket", d.socket, "--model-root", root,
                                "--take-over", *succ_args],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 1 and "FAILED_PRECONDITION" in r.stderr, r.stderr
            assert why in r.stderr, r.stderr
            if "--handover-socket" in succ_args:
                _wait_for(lambda: "handover_failed" in d.log(), 10, "handover_failed")
            assert d.alive()
            d.ctl_ok("load", "m2", os.path.join(root, "base32.safetensors"))
            assert "m1" in d.ctl_ok("list").stdout
            if before is not None:
                assert open(journal, "rb").read().startswith(before)


def test_a_second_daemon_is_refused_before_it_touches_the_state_dir(files, tmp_path):
    root, _ = files
    state = str(tmp_path / "state")
    with Daemon(model_root=root, extra_args=["--state-dir", state]) as d:
        d.ctl_ok("load", "m1", os.path.join(root, "base32.safetensors"))
        journal = open(os.path.join(state, "journal"), "rb").read()
        r = subprocess.run([WEIGHTD, "--socket", d.socket, "--model-root", root,
                            "--state-dir", state], capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "already serves on" in r.stderr, r.stderr
        assert "--take-over" in r.stderr
        assert open(os.path.join(state, "journal"), "rb").read() == journal
        assert not os.path.exists(os.path.join(state, "journal.new"))
        d.ctl_ok("load", "m2", os.path.join(root, "base32.safetensors"))


def test_a_replaced_pods_restarted_container_cannot_take_the_sockets_back(files, tmp_path):
    """Kubernetes restarts the old pod's container after it hands over (it
    exits 0); with --take-over it must not take the node back from the pod
    that replaced it. Pods differ by host name (a UTS namespace here)."""
    root, big = files
    state = str(tmp_path / "state")
    d = Daemon(model_root=root, extra_args=_args(root, state), workdir=str(tmp_path / "run"))
    d.start()
    new_log = str(tmp_path / "new.log")
    new = None
    try:
        d.ctl_ok("load", "big", os.path.join(root, "big"))
        with open(new_log, "ab") as log:
            new = subprocess.Popen(
                ["unshare", "--uts", "sh", "-c", 'hostname weightd-new-pod && exec "$@"', "sh",
                 WEIGHTD, "--socket", d.socket, "--model-root", root, *_args(root, state),
                 "--take-over"], stdout=log, stderr=subprocess.STDOUT)
        assert d.proc.wait(timeout=60) == 0, d.log()
        _wait_for(lambda: "taken_over" in _read(new_log), 30, "taken_over")
        # The old pod's container again (this host's name), with --take-over.
        r = subprocess.run([WEIGHTD, "--socket", d.socket, "--model-root", root,
                            *_args(root, state), "--take-over"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1, r.stderr
        assert "does not hand back" in r.stderr, r.stderr
        assert new.poll() is None
        with weightd.Client(socket=d.socket) as c:
            with c.fetch("big", world=2, rank=1) as h:
                sd = h.state_dict()
            for n, t in big.items():
                assert torch.equal(sd[n], cast_shard_ref(t, 2, 1)), n
            c.load("m1", os.path.join(root, "base32.safetensors"))  # changes open again
    finally:
        if new is not None and new.poll() is None:
            new.send_signal(signal.SIGTERM)
            assert new.wait(timeout=30) == 0
        d.stop()


def test_a_checkpoint_sharing_tensors_is_read_again_by_the_successor(tmp_path):
    """A checkpoint whose tensors share another model's bytes (a load of
    other files with the same tensors, test_shared_checkpoints.py) is not
    laid out by file, so the hand-over does not offer its segments: the
    successor adopts the holder's, reads that checkpoint's files again,
    shares the same tensors again and serves the same bytes, with no
    segments refused."""
    root = str(tmp_path / "models")
    os.mkdir(root)
    g = torch.Generator().manual_seed(11)
    base = {"w%d" % i: torch.randn(256, 1024, generator=g).to(torch.bfloat16) for i in range(8)}
    st_io.save(base, os.path.join(root, "base.safetensors"))
    ft = dict(base, w7=torch.randn(256, 1024, generator=g).to(torch.bfloat16))
    st_io.save(ft, os.path.join(root, "ft.safetensors"))
    state = str(tmp_path / "state")
    d = Daemon(model_root=root, extra_args=_args(root, state), workdir=str(tmp_path / "run"))
    d.start()
    succ = None
    try:
        d.ctl_ok("load", "a", os.path.join(root, "base.safetensors"))
        d.ctl_ok("load", "ft", os.path.join(root, "ft.safetensors"))
        assert d.log().count("load_tensors_shared") == 1, d.log()
        with weightd.Client(socket=d.socket) as c:
            before = _state(c)
            resident = c.stats()["checkpoint_bytes_resident"]
        succ_log = str(tmp_path / "successor.log")
        succ = _successor(d, state, succ_log)
        assert d.proc.wait(timeout=90) == 0, d.log()
        _wait_for(lambda: "taken_over" in _read(succ_log), 30, "the successor's taken_over")
        new_log = _read(succ_log)
        assert new_log.count("load_adopted") == 1, new_log
        assert "handover_segments_refused" not in new_log, new_log
        _wait_for(lambda: "restore_done" in _read(succ_log), 60, "the successor's restore")
        assert _read(succ_log).count("load_tensors_shared") == 1, _read(succ_log)
        with weightd.Client(socket=d.socket) as c:
            assert _state(c) == before
            assert c.stats()["checkpoint_bytes_resident"] == resident
            for model, ref in (("a", base), ("ft", ft)):
                for rank in range(2):
                    with c.fetch(model, world=2, rank=rank) as h:
                        got = h.state_dict()
                    for n, t in ref.items():
                        assert torch.equal(got[n], torch.chunk(t, 2, 0)[rank]), (model, n)
    finally:
        if succ is not None and succ.poll() is None:
            succ.send_signal(signal.SIGTERM)
            assert succ.wait(timeout=30) == 0
        d.stop()


# A process of another user listening where a successor looks for its
# predecessor: it counts the bytes the successor sends it.
_FOREIGN_PREDECESSOR = r"""
import os, socket, sys
path, out = sys.argv[1:]
s = socket.socket(socket.AF_UNIX)
s.bind(path)
s.listen(1)
open(out + ".ready", "w").close()
c, _ = s.accept()
c.settimeout(5)
got = b""
try:
    while True:
        b = c.recv(4096)
        if not b:
            break
        got += b
except socket.timeout:
    pass
with open(out, "w") as f:
    f.write(str(len(got)))
"""


def test_a_successor_takes_nothing_from_a_predecessor_of_another_uid(files, tmp_path):
    """L2: a local user who can bind the hand-over socket's path (a
    --handover-socket in a directory others may write) listens there; a
    root successor started with --take-over must not take that process's
    sockets or memory: it checks the listener's uid (SO_PEERCRED), refuses
    with PERMISSION_DENIED naming it, and sends it nothing, not even BEGIN."""
    root, _ = files
    shared = tempfile.mkdtemp(prefix="weightd-handover-")  # tmp_path's parents are root's
    try:
        os.chmod(shared, 0o777)
        sock, out = os.path.join(shared, "handover.sock"), os.path.join(shared, "got")
        fake = subprocess.Popen(user_prefix(65534) + [sys.executable, "-c", _FOREIGN_PREDECESSOR,
                                                      sock, out])
        try:
            _wait_for(lambda: os.path.exists(out + ".ready"), 30, "the listener")
            assert os.stat(sock).st_uid == 65534
            r = subprocess.run([WEIGHTD, "--socket", str(tmp_path / "w.sock"), "--model-root", root,
                                "--state-dir", str(tmp_path / "state"), "--take-over",
                                "--handover-socket", sock],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 1, r.stderr
            assert ("error: PERMISSION_DENIED: the process listening on the hand-over socket %s "
                    "runs as uid 65534 (pid %d), not as this daemon's uid 0 or root"
                    % (sock, fake.pid)) in r.stderr, r.stderr
            assert fake.wait(timeout=30) == 0
            with open(out) as f:
                assert f.read() == "0"
            assert not os.path.exists(str(tmp_path / "w.sock"))
        finally:
            if fake.poll() is None:
                fake.kill()
                fake.wait()
    finally:
        shutil.rmtree(shared, ignore_errors=True)

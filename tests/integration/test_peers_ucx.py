"""The UCX data plane between daemons (issue 41): a holder with
--peer-transport ucx|auto answers a fleet member's FindCheckpoint (asked
with ucx=true) with its UCX worker address and a grant per file; the loader
reads the ranges over UCX (active-message requests the holder checks, the
bytes by UCX's rendezvous straight into the loader's segment) and checks
them exactly as bytes from gRPC. Real daemons, UCX's TCP and shared-memory
transports (UCX_TLS), bytes compared with PyTorch's reading of the files.
Faults: a holder stopped then SIGKILLed with reads in flight, a grant whose
checkpoint was unloaded (its memory reused by another model), a non-member
and a wrong token asking for grants, a private model never granted, a
loader or holder speaking gRPC only.
"""
import os
import signal
import subprocess
import threading
import time

import grpc
import pytest

from harness import Daemon, free_port, scrape_metrics
import peer_protocol as pp

import weightd  # noqa: E402  (harness puts the build's package on the path)
from weightd.v1 import weightd_pb2 as pb
from weightd.v1 import weightd_pb2_grpc as pb_grpc

from test_fleet import (CHUNK, FLEET_AUTH, FLEET_TOKEN, _check_bytes, _fleet_args, _load,
                        _running, _write_checkpoint)

OTHER_TOKEN = "bob-is-no-fleet-member-0123456789"


def _ucx_available():
    try:
        out = subprocess.run(["ucx_info", "-v"], capture_output=True, text=True).stdout
    except OSError:
        return False
    return "Version" in out


pytestmark = pytest.mark.skipif(not _ucx_available(), reason="UCX (ucx-utils) not installed")


def _tokens(tmp_path):
    p = tmp_path / "ucx.tokens"
    if not p.exists():
        p.write_text("fleet %s\nbob %s\n" % (FLEET_TOKEN, OTHER_TOKEN))
    return p


def _holder(tmp_path, root, name, transport="ucx", *extra, binary=None):
    addr = "127.0.0.1:%d" % free_port()
    tokens = _tokens(tmp_path)
    return Daemon(model_root=str(root), workdir=str(tmp_path / name), binary=binary,
                  extra_args=["--listen", addr, "--auth-token-file", str(tokens),
                              "--fleet-members", "token:fleet", "--peer-token-file",
                              str(tokens), "--peer-transport", transport, *extra]), addr


def _loader(tmp_path, root, peers, transport="ucx", *extra, binary=None):
    return Daemon(model_root=str(root), workdir=str(tmp_path / "c"), binary=binary,
                  extra_args=["--peers", ",".join(peers), *_fleet_args(tmp_path, listens=False),
                              "--read-chunk-bytes", str(CHUNK), "--peer-transport", transport,
                              *extra])


# A daemon built with -DWEIGHTD_UCX=OFF (scripts/test.sh builds one beside
# the default build and names it here).
NO_UCX_BUILD = os.environ.get("WEIGHTD_BUILD_NO_UCX", "")
NO_UCX_WEIGHTD = os.path.join(NO_UCX_BUILD, "bin", "weightd")


@pytest.fixture
def checkpoint(tmp_path):
    models = tmp_path / "models"
    path, tensors = _write_checkpoint(models, seed=7, mib=24)
    return models, path, tensors


@pytest.fixture(params=["tcp", "sm,tcp"])
def ucx_tls(request, monkeypatch):
    """The daemons' UCX transports: TCP (loopback), or shared memory on one
    host as Debian's UCX 1.13 can use it with peer failure detection (which
    the daemon always asks for): with UCX_TLS=sm alone every endpoint is
    "Destination is unreachable" (posix/sysv cannot detect a dead peer;
    ucx_perftest -e says the same), so sm comes with tcp, and the endpoint
    takes what it can of each (the log names them)."""
    monkeypatch.setenv("UCX_TLS", request.param)
    return request.param


def _endpoint_transports(log):
    return [line for line in log.splitlines() if "ucx_endpoint" in line and "failed" not in line]


def test_loads_over_ucx_equal_pytorchs_reading(tmp_path, checkpoint, ucx_tls):
    models, path, tensors = checkpoint
    a, a_addr = _holder(tmp_path, models, "a")
    with _running(a):
        a.ctl_ok("load", "m", str(path))
        metrics = free_port()
        c = _loader(tmp_path, models, [a_addr], "ucx", "--metrics-listen",
                    "127.0.0.1:%d" % metrics)
        with _running(c):
            info, last, _ = _load(c, "m", path, source="peers")
            # Stats, weightctl stats and the metrics say the bytes came
            # over UCX, and at what rate.
            with weightd.Client(socket=c.socket) as cl:
                by = cl.stats()["peer_transports"]
            assert set(by) == {a_addr} and set(by[a_addr]) == {"ucx"}, by
            assert by[a_addr]["ucx"]["bytes"] >= last.bytes_from_peers > 0, by
            assert by[a_addr]["ucx"]["seconds"] > 0 and by[a_addr]["ucx"]["failures"] == 0
            out = c.ctl_ok("stats").stdout
            assert "peer_transport: %s\tucx\tbytes=%d" % (a_addr, by[a_addr]["ucx"]["bytes"]) in out
            # weightctl peers too, under the peer's line.
            out = c.ctl_ok("peers").stdout
            assert "transport: %s\tucx\tbytes=%d" % (a_addr, by[a_addr]["ucx"]["bytes"]) in out
            m = scrape_metrics(metrics)
            key = 'weightd_peer_bytes_total{peer="%s",transport="ucx"}' % a_addr
            assert m[key] == by[a_addr]["ucx"]["bytes"], m
            assert last.bytes_from_peers > 0 and list(last.peers) == [a_addr], last
            # The load's progress says what carried them.
            assert list(last.peer_transports) == ["ucx"], last
            # Only the samples (and secret pieces) came from storage.
            assert last.bytes_from_storage == 0, last
            wid = _check_bytes(c, "m", tensors)
            assert wid == _check_bytes(a, "m", tensors)
            # Both said at start what UCX found; the loader logged what
            # its endpoint chose, of the transports UCX_TLS allows.
            for d in (a, c):
                assert "ucx state=on" in d.log(), d.log()[-2000:]
            lines = _endpoint_transports(c.log())
            assert lines, c.log()[-3000:]
            assert "tcp/" in lines[0], lines
            if "sm" in ucx_tls:
                assert "posix/memory" in c.log() and "cma/memory" in c.log()
            assert "peer_read_failed" not in c.log()


class _FindProxy(pp.HolderProxy):
    """A holder's control plane in front of a real daemon (so the grants are
    the holder's own) that runs `after` once, in a thread, when the first
    FindCheckpoint answer is on its way (or `before`, in line, before it is
    sent). The bytes go over UCX to the holder itself, not through here."""

    def __init__(self, upstream, before=None, after=None):
        self.before, self.after = before, after
        self.done = threading.Event()
        super().__init__(upstream, FLEET_AUTH)

    def on_find(self, req, resp):
        if not self.done.is_set():
            self.done.set()
            if self.before:
                self.before(resp)
            if self.after:
                threading.Thread(target=self.after, daemon=True).start()
        return resp


def test_holder_killed_with_reads_in_flight(tmp_path, checkpoint, ucx_tls):
    """a is SIGSTOPped as its grants go out and SIGKILLed a second later,
    with the loader's UCX reads from it in flight: they fail (the endpoint
    fails, or the deadline passes), a is dropped, and its ranges come from
    b."""
    models, path, tensors = checkpoint
    a, a_addr = _holder(tmp_path, models, "a")
    b, b_addr = _holder(tmp_path, models, "b")

    def stop_then_kill():
        a.proc.send_signal(signal.SIGSTOP)
        time.sleep(1.0)
        a.proc.kill()

    with _running(a, b):
        a.ctl_ok("load", "m", str(path))
        b.ctl_ok("load", "m", str(path))
        with _FindProxy(a_addr, after=stop_then_kill) as proxy:
            c = _loader(tmp_path, models, [proxy.address, b_addr], "ucx", "--peer-streams", "2")
            with _running(c):
                info, last, _ = _load(c, "m", path, source="peers")
                assert a.proc.poll() is not None
                assert list(last.peers) == [b_addr], last
                assert "peer_read_failed" in c.log()
                assert "ucx_endpoint_failed" in c.log() or "did not finish in time" in c.log()
                _check_bytes(c, "m", tensors)


def test_a_grant_whose_checkpoint_went_reads_nothing(tmp_path, checkpoint, ucx_tls):
    """The holder answers with its grants, then the model is unloaded (its
    segments freed, their UCX registrations unmapped first) and another
    checkpoint is loaded into the memory: the loader's reads with the stale
    grants are refused (NOT_FOUND), never served other bytes; it loads from
    storage (auto) with the right bytes, and the holder keeps serving."""
    models, path, tensors = checkpoint
    other, _ = _write_checkpoint(models / "o", seed=8, mib=24)
    a, a_addr = _holder(tmp_path, models, "a")

    def unload_first(resp):
        assert resp.ucx_worker and len(resp.ucx_files) == 2
        a.ctl_ok("unload", "m")
        deadline = time.time() + 20
        with weightd.Client(socket=a.socket) as cl:
            while cl.stats()["bytes_resident"] != 0 and time.time() < deadline:
                time.sleep(0.05)
        a.ctl_ok("load", "n", str(other))

    with _running(a):
        a.ctl_ok("load", "m", str(path))
        with _FindProxy(a_addr, before=unload_first) as proxy:
            c = _loader(tmp_path, models, [proxy.address], "ucx", "--peer-streams", "1")
            with _running(c):
                info, last, _ = _load(c, "m", path, source="auto")
                assert last.bytes_from_peers == 0 and list(last.peers) == [], last
                assert "refused the UCX read: no such grant" in c.log(), c.log()[-3000:]
                _check_bytes(c, "m", tensors)
        assert a.alive()
        a.ctl_ok("health")


def _find(addr, req, token):
    ch = grpc.insecure_channel(addr)
    md = [("authorization", "Bearer " + token)] if token else []
    try:
        return "OK", pb_grpc.ModelsStub(ch).FindCheckpoint(req, metadata=md, timeout=10)
    except grpc.RpcError as e:
        return e.code().name, e.details()
    finally:
        ch.close()


def test_grants_only_to_fleet_members_for_copies_they_may_read(tmp_path, checkpoint):
    """A member asking with ucx=true gets the worker address and a 16-byte
    token per file; without ucx=true, none. A wrong token
    (UNAUTHENTICATED), a caller that is no fleet member (PERMISSION_DENIED)
    and a member asking about a private model (NOT_FOUND, as for nothing
    held) get no answer at all, so no grant."""
    models, path, tensors = checkpoint
    a, a_addr = _holder(tmp_path, models, "a")
    files = [pp.StFile(str(path / n)) for n in sorted(os.listdir(path)) if n.endswith(".safetensors")]
    req = pp.find_request(pb, files, [(0, 0, 64), (1, 100, 60)])
    req.ucx = True
    with _running(a):
        assert _find(a_addr, req, FLEET_TOKEN)[0] == "NOT_FOUND"
        a.ctl_ok("load", "priv", str(path), "--readers", "uid:%d" % (os.getuid() + 4242))
        code, msg = _find(a_addr, req, FLEET_TOKEN)
        assert code == "NOT_FOUND", msg
        a.ctl_ok("load", "m", str(path))
        code, got = _find(a_addr, req, FLEET_TOKEN)
        assert code == "OK", got
        assert got.ucx_worker and len(got.ucx_files) == 2
        assert [len(r.token) for r in got.ucx_files] == [16, 16]
        assert [r.length for r in got.ucx_files] == [len(f.data) for f in files]
        assert got.ucx_files[0].token != got.ucx_files[1].token
        plain = pb.FindCheckpointRequest()
        plain.CopyFrom(req)
        plain.ucx = False
        code, got = _find(a_addr, plain, FLEET_TOKEN)
        assert code == "OK" and not got.ucx_worker and len(got.ucx_files) == 0
        assert _find(a_addr, req, "wrong-token-wrong-token-wrong")[0] == "UNAUTHENTICATED"
        code, msg = _find(a_addr, req, OTHER_TOKEN)
        assert code == "PERMISSION_DENIED" and "fleet member" in msg, msg


@pytest.mark.parametrize("holder,loader", [("ucx", "grpc"), ("grpc", "auto")])
def test_a_side_without_ucx_is_served_over_grpc(tmp_path, checkpoint, holder, loader):
    """A loader with --peer-transport grpc asks for no grant and reads
    ReadCheckpoint streams from a UCX holder; a loader with auto reads a
    holder without UCX over gRPC as well."""
    models, path, tensors = checkpoint
    a, a_addr = _holder(tmp_path, models, "a", holder)
    with _running(a):
        a.ctl_ok("load", "m", str(path))
        c = _loader(tmp_path, models, [a_addr], loader)
        with _running(c):
            info, last, _ = _load(c, "m", path, source="peers")
            assert list(last.peers) == [a_addr] and last.bytes_from_storage == 0, last
            assert list(last.peer_transports) == ["grpc"], last
            assert not _endpoint_transports(c.log())
            with weightd.Client(socket=c.socket) as cl:
                by = cl.stats()["peer_transports"]
            assert set(by[a_addr]) == {"grpc"} and by[a_addr]["grpc"]["bytes"] > 0, by
            _check_bytes(c, "m", tensors)
            with weightd.Client(socket=a.socket) as cl:
                assert cl.stats()["bytes_sent_to_peers"] > 0  # ReadCheckpoint's counter


@pytest.mark.skipif(not os.path.exists(NO_UCX_WEIGHTD),
                    reason="no build without UCX (WEIGHTD_BUILD_NO_UCX; scripts/test.sh sets it)")
@pytest.mark.parametrize("side", ["holder", "loader"])
def test_a_daemon_built_without_ucx_works_beside_ucx_builds(tmp_path, checkpoint, side):
    """A weightd built without UCX starts with --peer-transport auto, says
    why it has no UCX, and serves (or loads) over gRPC beside a UCX build
    with auto; with --peer-transport ucx it refuses to start, saying why."""
    models, path, tensors = checkpoint
    holder_bin = NO_UCX_WEIGHTD if side == "holder" else None
    loader_bin = NO_UCX_WEIGHTD if side == "loader" else None
    a, a_addr = _holder(tmp_path, models, "a", "auto", binary=holder_bin)
    with _running(a):
        a.ctl_ok("load", "m", str(path))
        c = _loader(tmp_path, models, [a_addr], "auto", binary=loader_bin)
        with _running(c):
            info, last, _ = _load(c, "m", path, source="peers")
            assert list(last.peers) == [a_addr] and last.bytes_from_storage == 0, last
            assert list(last.peer_transports) == ["grpc"], last
            _check_bytes(c, "m", tensors)
            no_ucx_log = (a if side == "holder" else c).log()
            assert "built without UCX" in no_ucx_log, no_ucx_log
            assert "peers are read and served over gRPC" in no_ucx_log, no_ucx_log
    d = Daemon(model_root=str(models), workdir=str(tmp_path / "u"), binary=NO_UCX_WEIGHTD,
               extra_args=["--peer-transport", "ucx"])
    with pytest.raises(RuntimeError) as e:
        d.start()
    assert "--peer-transport ucx: this weightd was built without UCX" in str(e.value), e.value
    d.stop()


def test_ucx_loader_refuses_a_holder_without_ucx(tmp_path, checkpoint):
    """--peer-transport ucx: a holder that offers no UCX is not used (with
    --source peers the load fails UNAVAILABLE and leaves nothing)."""
    models, path, tensors = checkpoint
    a, a_addr = _holder(tmp_path, models, "a", "grpc")
    with _running(a):
        a.ctl_ok("load", "m", str(path))
        c = _loader(tmp_path, models, [a_addr], "ucx")
        with _running(c):
            r = c.ctl("load", "m", str(path), "--source", "peers")
            assert r.returncode != 0 and "UNAVAILABLE" in r.stderr, r.stderr
            assert "offers no UCX data plane" in c.log()


def test_a_lying_holder_is_caught_by_the_digests(tmp_path, checkpoint, ucx_tls):
    """A holder whose answer swaps its two files' grants (the shards are of
    equal length): every UCX read succeeds and brings another file's bytes,
    from the real holder's memory. The tensor digests catch it: the holder
    is dropped (peer_data_loss), nothing it sent is kept, and the ranges
    come from the honest holder b. (Flipping bits in the holder's memory
    through /proc/PID/mem is not possible: its checkpoint segments are
    sealed memfds mapped read-only, and the write fails EIO.)"""
    models, path, tensors = checkpoint
    a, a_addr = _holder(tmp_path, models, "a")
    b, b_addr = _holder(tmp_path, models, "b")

    def swap(resp):
        assert len(resp.ucx_files) == 2
        assert resp.ucx_files[0].length == resp.ucx_files[1].length
        first = pb.UcxRegion()
        first.CopyFrom(resp.ucx_files[0])
        resp.ucx_files[0].CopyFrom(resp.ucx_files[1])
        resp.ucx_files[1].CopyFrom(first)

    with _running(a, b):
        a.ctl_ok("load", "m", str(path))
        b.ctl_ok("load", "m", str(path))
        with _FindProxy(a_addr, before=swap) as proxy:
            c = _loader(tmp_path, models, [proxy.address, b_addr], "ucx")
            with _running(c):
                info, last, _ = _load(c, "m", path, source="peers")
                assert list(last.peers) == [b_addr], last
                assert "peer_data_loss" in c.log() and proxy.address in c.log()
                wid = _check_bytes(c, "m", tensors)
                assert wid == _check_bytes(b, "m", tensors)

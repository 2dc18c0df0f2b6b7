"""Fleets (issue [cluster], first part): daemons that know each other
(--peers) poll one another over their TCP listeners, with the listener's
token, and `weightctl peers` / `Client.peers()` show, from any node, which
peers answer and what each holds: the same checkpoint on two nodes reports
the same weights_id. Three real daemons on loopback ports; one stopped is
reported unreachable, a wrong peer token UNAUTHENTICATED.
"""
import os
import shutil
import subprocess
import time

import pytest
import torch

from harness import Daemon, free_port
import st_io

import weightd  # noqa: E402  (harness puts the build's package on the path)


def _wait(pred, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("timed out waiting for " + what)


def _by_address(c):
    return {p["address"]: p for p in c.peers()}


@pytest.fixture
def fleet(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    g = torch.Generator().manual_seed(11)
    st_io.save({"w%d" % i: torch.randn(64, 32, generator=g).to(torch.bfloat16) for i in range(4)},
               str(models / "m.safetensors"))
    tokens = tmp_path / "tokens"
    tokens.write_text("fleet fleet-token-0123456789abcdef\n")
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-fleet-token-0123456789\n")
    addrs = ["127.0.0.1:%d" % free_port() for _ in range(3)]
    daemons = []
    for i, addr in enumerate(addrs):
        others = ",".join(a for a in addrs if a != addr)
        daemons.append(Daemon(model_root=str(models), workdir=str(tmp_path / ("d%d" % i)),
                              extra_args=["--listen", addr, "--advertise", addr,
                                          "--peers", others, "--peer-poll-seconds", "1",
                                          "--auth-token-file", str(tokens),
                                          "--fleet-members", "token:fleet",
                                          "--peer-token-file",
                                          str(wrong if i == 2 else tokens)]))
    for d in daemons:
        d.start()
    try:
        yield str(models / "m.safetensors"), addrs, daemons
    finally:
        for d in daemons:
            d.stop()


def test_peers_show_who_answers_and_what_they_hold(fleet):
    path, addrs, (a, b, c) = fleet
    a.ctl_ok("load", "m", path)
    b.ctl_ok("load", "m", path)
    b.ctl_ok("load", "other", path)
    with weightd.Client(socket=a.socket) as ca:
        want = ca.info("m").weights_id
    assert want
    with weightd.Client(socket=b.socket) as cb:
        # b polls a and c with the fleet's token: a holds m, c nothing.
        peers = _wait(lambda: (lambda p: p if p[addrs[0]]["models"] else None)(_by_address(cb)),
                      10, "b to see a's model")
        assert set(peers) == {addrs[0], addrs[2]}
        assert peers[addrs[0]]["reachable"] and peers[addrs[2]]["reachable"]
        assert peers[addrs[0]]["models"] == [{"name": "m", "generation": 1, "weights_id": want}]
        assert peers[addrs[2]]["models"] == []
    with weightd.Client(socket=a.socket) as ca:
        peers = _wait(lambda: (lambda p: p if len(p[addrs[1]]["models"]) == 2 else None)(
            _by_address(ca)), 10, "a to see b's models")
        held = {m["name"]: m["weights_id"] for m in peers[addrs[1]]["models"]}
        assert held == {"m": want, "other": want}, "the same files: the same weights_id"
    # c presents a wrong token: its peers refuse it, and it says so.
    with weightd.Client(socket=c.socket) as cc:
        peers = _wait(lambda: (lambda p: p if p[addrs[0]]["polled"] else None)(
            {q["address"]: dict(q, polled=q["error"] != "not polled yet") for q in cc.peers()}),
            10, "c's first poll")
        for addr in addrs[:2]:
            assert not peers[addr]["reachable"]
            assert peers[addr]["error"].startswith("UNAUTHENTICATED"), peers[addr]
    out = b.ctl_ok("peers").stdout
    assert "advertise: %s" % addrs[1] in out
    assert "peer: %s\treachable" % addrs[0] in out
    assert "model: %s\tm\tgeneration=1\tweights_id=%s" % (addrs[0], want) in out

    # A peer that stops is reported unreachable, and why.
    a.stop()
    with weightd.Client(socket=b.socket) as cb:
        peers = _wait(lambda: (lambda p: p if not p[addrs[0]]["reachable"] else None)(
            _by_address(cb)), 10, "a unreachable")
        assert peers[addrs[0]]["error"].startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED"))
        assert peers[addrs[0]]["last_seen"] is not None
    assert "peer: %s\tunreachable" % addrs[0] in b.ctl_ok("peers").stdout


def test_bad_peer_addresses_are_refused_at_start(tmp_path):
    d = Daemon(extra_args=["--peers", "no-port-here"])
    with pytest.raises(RuntimeError) as e:
        d.start(timeout=10)
    assert "--peers: expected HOST:PORT" in str(e.value)
    d.stop()


def test_without_peers_the_list_is_empty(tmp_path):
    with Daemon() as d, weightd.Client(socket=d.socket) as c:
        assert c.peers() == []
        assert d.ctl_ok("peers").stdout == ""


def test_peer_dns_finds_every_pod_and_follows_the_name(tmp_path):
    """--peer-dns NAME:PORT (a headless Service in Kubernetes): every address
    the name resolves to is a peer but this daemon's own (--advertise), and
    the name is resolved again at every poll. Three daemons on 127.0.0.2-4,
    each in a mount namespace whose /etc/hosts (bind-mounted, rewritten by
    the test) gives fleet.test those addresses."""
    models = tmp_path / "models"
    models.mkdir()
    st_io.save({"w": torch.arange(8, dtype=torch.float32)}, str(models / "m.safetensors"))
    hosts = tmp_path / "hosts"
    ips = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]

    def write_hosts(names):
        hosts.write_text("127.0.0.1 localhost\n" + "".join("%s fleet.test\n" % ip for ip in names))

    write_hosts(ips)
    port = free_port()
    prefix = ["unshare", "--mount", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"',
              str(hosts)]
    daemons = [Daemon(model_root=str(models), workdir=str(tmp_path / ip), prefix=prefix,
                      extra_args=["--listen", "%s:%d" % (ip, port),
                                  "--advertise", "%s:%d" % (ip, port),
                                  "--peer-dns", "fleet.test:%d" % port,
                                  "--peer-poll-seconds", "1"]) for ip in ips]
    for d in daemons:
        d.start()
    try:
        daemons[1].ctl_ok("load", "m", str(models / "m.safetensors"))
        others = ["%s:%d" % (ip, port) for ip in ips[1:]]
        with weightd.Client(socket=daemons[0].socket) as c:
            peers = _wait(lambda: (lambda p: p if set(p) == set(others) and all(
                q["reachable"] for q in p.values()) and p[others[0]]["models"] else None)(
                _by_address(c)), 15, "both other daemons, reachable")
            assert [m["name"] for m in peers[others[0]]["models"]] == ["m"]
            # The name loses a pod: it leaves the table at the next poll.
            write_hosts(ips[:2])
            _wait(lambda: set(_by_address(c)) == {others[0]}, 15, "the third peer gone")
            # And gains it back.
            write_hosts(ips)
            _wait(lambda: set(_by_address(c)) == set(others), 15, "the third peer back")
        out = daemons[0].ctl_ok("peers").stdout
        assert "peer_dns: fleet.test:%d\n" % port in out
        # A name that no longer resolves keeps the peers found before.
        write_hosts([])
        with weightd.Client(socket=daemons[0].socket) as c:
            _wait(lambda: "error=" in daemons[0].ctl_ok("peers").stdout, 60, "the DNS error")
            assert set(_by_address(c)) == set(others)
    finally:
        for d in daemons:
            d.stop()


def _openssl(*args, cwd):
    subprocess.run(["openssl"] + list(args), cwd=cwd, check=True, capture_output=True)


def test_peers_with_mutual_tls(tmp_path):
    """Daemon-to-daemon calls with the listener's TLS: each daemon serves
    its certificate and presents it as its client certificate
    (--tls-cert/--tls-key), requires the fleet CA's client certificates
    (--tls-client-ca) and verifies peers against it (--peer-tls-ca). Two
    daemons of the fleet see each other; one whose certificate the CA never
    signed is refused both ways."""
    pki = tmp_path / "pki"
    pki.mkdir()
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=fleet-ca", cwd=pki)
    (pki / "node.ext").write_text(
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    for name in ("a", "b"):
        _openssl("req", *ec, "-keyout", name + ".key", "-out", name + ".csr",
                 "-subj", "/CN=node-" + name, cwd=pki)
        _openssl("x509", "-req", "-in", name + ".csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", name + ".pem", "-days", "2", "-extfile", "node.ext",
                 cwd=pki)
    _openssl("req", "-x509", *ec, "-keyout", "rogue.key", "-out", "rogue.pem", "-days", "2",
             "-subj", "/CN=node-rogue", "-addext", "subjectAltName=IP:127.0.0.1", cwd=pki)
    models = tmp_path / "models"
    models.mkdir()
    st_io.save({"w": torch.arange(8, dtype=torch.float32)}, str(models / "m.safetensors"))
    addrs = {n: "127.0.0.1:%d" % free_port() for n in ("a", "b", "rogue")}
    daemons = {}
    for n, addr in addrs.items():
        others = ",".join(v for k, v in addrs.items() if k != n)
        daemons[n] = Daemon(model_root=str(models), workdir=str(tmp_path / n), extra_args=[
            "--listen", addr, "--peers", others, "--peer-poll-seconds", "1",
            "--tls-cert", str(pki / (n + ".pem")), "--tls-key", str(pki / (n + ".key")),
            "--tls-client-ca", str(pki / "ca.pem"), "--peer-tls-ca", str(pki / "ca.pem"),
            "--fleet-members", "cn:node-a,cn:node-b"])
    for d in daemons.values():
        d.start()
    try:
        daemons["b"].ctl_ok("load", "m", str(models / "m.safetensors"))
        with weightd.Client(socket=daemons["a"].socket) as c:
            peers = _wait(lambda: (lambda p: p if p[addrs["b"]]["models"] and
                                   p[addrs["rogue"]]["error"] != "not polled yet" else None)(
                _by_address(c)), 15, "a's polls")
            assert peers[addrs["b"]]["reachable"]
            assert [m["name"] for m in peers[addrs["b"]]["models"]] == ["m"]
            # The rogue's server certificate is not the fleet CA's.
            assert not peers[addrs["rogue"]]["reachable"]
            assert peers[addrs["rogue"]]["error"].startswith("UNAVAILABLE"), peers
        with weightd.Client(socket=daemons["rogue"].socket) as c:
            # And its client certificate is refused by a and b.
            peers = _wait(lambda: (lambda p: p if all(
                q["error"] != "not polled yet" for q in p.values()) else None)(_by_address(c)),
                15, "the rogue's polls")
            assert not any(q["reachable"] for q in peers.values()), peers
        # Loads replicate over the same mutual TLS: a takes m's bytes from
        # b; the rogue, whose client certificate a and b refuse, cannot.
        r = daemons["a"].ctl_ok("load", "m", str(models / "m.safetensors"), "--source", "peers")
        assert "from peers %s:" % addrs["b"] in r.stdout, r.stdout
        r = daemons["rogue"].ctl("load", "m", str(models / "m.safetensors"), "--source", "peers")
        assert r.returncode != 0 and r.error_code == "UNAVAILABLE", r.stderr
    finally:
        for d in daemons.values():
            d.stop()


def _threads_and_fds(pid):
    return len(os.listdir("/proc/%d/task" % pid)), len(os.listdir("/proc/%d/fd" % pid))


def test_many_peers_cost_a_bounded_number_of_threads_and_connections(tmp_path):
    """300 peers (one gRPC server answering on every loopback address;
    FindCheckpoint says NOT_FOUND after 0.3 s): the daemon considers
    --peer-max of them (default 64; the truncation logged), polls and asks
    them 8 at a time and keeps a connection to each of those only. Its
    threads and fds, sampled through a load that asks every peer, stay
    within a bound over a daemon without peers (before: a thread and a
    connection per peer)."""
    import threading
    from concurrent import futures

    import grpc
    from weightd.v1 import weightd_pb2 as pb

    models = tmp_path / "models"
    models.mkdir()
    st_io.save({"w": torch.arange(64, dtype=torch.float32)}, str(models / "m.safetensors"))

    def find(req, ctx):
        time.sleep(0.3)
        ctx.abort(grpc.StatusCode.NOT_FOUND, "not held")

    server = grpc.server(futures.ThreadPoolExecutor(64))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("weightd.v1.Models", {
        "List": grpc.unary_unary_rpc_method_handler(
            lambda req, ctx: pb.ListModelsResponse(),
            request_deserializer=pb.ListModelsRequest.FromString,
            response_serializer=pb.ListModelsResponse.SerializeToString),
        "FindCheckpoint": grpc.unary_unary_rpc_method_handler(
            find, request_deserializer=pb.FindCheckpointRequest.FromString,
            response_serializer=pb.FindCheckpointResponse.SerializeToString)})])
    port = server.add_insecure_port("0.0.0.0:0")
    server.start()
    addrs = ["127.0.%d.%d:%d" % (1 + i // 200, 2 + i % 200, port) for i in range(300)]

    def measure(d):
        """(peak threads, peak fds) through a load from --source auto."""
        peak = [0, 0]
        done = threading.Event()

        def sample():
            while not done.is_set():
                t, f = _threads_and_fds(d.proc.pid)
                peak[0], peak[1] = max(peak[0], t), max(peak[1], f)
                time.sleep(0.01)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            d.ctl_ok("load", "m", str(models / "m.safetensors"))
        finally:
            done.set()
            sampler.join()
        return peak

    try:
        with Daemon(model_root=str(models), workdir=str(tmp_path / "plain")) as plain:
            base = measure(plain)
        d = Daemon(model_root=str(models), workdir=str(tmp_path / "many"),
                   extra_args=["--peers", ",".join(addrs), "--peer-poll-seconds", "1"])
        d.start()
        try:
            with weightd.Client(socket=d.socket) as c:
                peers = _wait(lambda: (lambda p: p if len(p) == 64 and all(
                    q["reachable"] for q in p) else None)(c.peers()), 30, "64 peers polled")
            assert {p["address"] for p in peers} <= set(addrs)
            assert "peer_list_truncated" in d.log()
            threads, fds = measure(d)
            # 8 calls at once, 64 connections (and gRPC's own threads).
            assert threads <= base[0] + 8 + 24, (threads, base)
            assert fds <= base[1] + 64 + 16, (fds, base)
        finally:
            d.stop()
    finally:
        server.stop(0)


def test_a_daemon_in_its_own_peer_dns_leaves_itself_out(tmp_path):
    """--peer-dns naming every daemon, and no --advertise: each daemon finds
    its own address among the name's. Its answers carry its instance id, so
    it recognizes itself at its first poll (peer_is_self), lists only the
    other daemon and never asks itself for bytes: a copy of a file it holds
    is not loaded from itself."""
    models = tmp_path / "models"
    (models / "copy").mkdir(parents=True)
    st_io.save({"w": torch.arange(4096, dtype=torch.float32)}, str(models / "m.safetensors"))
    shutil.copy(models / "m.safetensors", models / "copy" / "m.safetensors")
    hosts = tmp_path / "hosts"
    ips = ["127.0.0.2", "127.0.0.3"]
    hosts.write_text("127.0.0.1 localhost\n" + "".join("%s fleet.test\n" % ip for ip in ips))
    tokens = tmp_path / "tokens"
    tokens.write_text("fleet fleet-token-0123456789abcdef\n")
    port = free_port()
    prefix = ["unshare", "--mount", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"',
              str(hosts)]
    daemons = [Daemon(model_root=str(models), workdir=str(tmp_path / ip), prefix=prefix,
                      extra_args=["--listen", "%s:%d" % (ip, port),
                                  "--peer-dns", "fleet.test:%d" % port,
                                  "--peer-poll-seconds", "1", "--auth-token-file", str(tokens),
                                  "--fleet-members", "token:fleet",
                                  "--peer-token-file", str(tokens)]) for ip in ips]
    for d in daemons:
        d.start()
    try:
        a, b = daemons
        me, other = "%s:%d" % (ips[0], port), "%s:%d" % (ips[1], port)
        a.ctl_ok("load", "m", str(models / "m.safetensors"))
        with weightd.Client(socket=a.socket) as c:
            _wait(lambda: "peer_is_self" in a.log(), 15, "a to find itself")
            time.sleep(2)  # more polls
            assert set(_by_address(c)) == {other}
        assert "peer: %s" % me not in a.ctl_ok("peers").stdout
        r = a.ctl("load", "c", str(models / "copy" / "m.safetensors"), "--source", "peers")
        assert r.returncode != 0 and r.error_code == "UNAVAILABLE", r.stdout + r.stderr
        # b, which holds nothing, finds a's copy and itself likewise.
        with weightd.Client(socket=b.socket) as c:
            _wait(lambda: set(_by_address(c)) == {me}, 15, "b to list a only")
        out = b.ctl_ok("load", "c", str(models / "copy" / "m.safetensors"), "--source", "peers")
        assert "from peers %s" % me in out.stdout, out.stdout
    finally:
        for d in daemons:
            d.stop()

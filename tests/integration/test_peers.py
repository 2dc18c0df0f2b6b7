"""Fleets (issue [cluster], first part): daemons that know each other
(--peers) poll one another over their TCP listeners, with the listener's
token, and `weightctl peers` / `Client.peers()` show, from any node, which
peers answer and what each holds: the same checkpoint on two nodes reports
the same weights_id. Three real daemons on loopback ports; one stopped is
reported unreachable, a wrong peer token UNAUTHENTICATED.
"""
import os
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

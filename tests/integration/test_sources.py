"""[sources] (issue 42): checkpoints loaded straight from an S3-compatible
server and from HTTPS, against real servers started here (tests/
sources_servers.py: @20minutes/s3rver from npm, Debian's nginx, and a fault
proxy that is a test tool, not a server under test).

test_servers_*: the servers themselves (SigV4 really checked, ranges and
ETags, each scripted fault as a client sees it).
The rest: the daemon (docs/sources.md, the contract in issue 42): bytes equal
to PyTorch's reading of the same files; every fault with its precise status
code and nothing resident or listed afterwards; confinement (no request made
for a URL outside --model-source); credentials named, never printed.
"""
import hashlib
import json
import os
import subprocess
import time

import pytest
import torch

from harness import Daemon, WEIGHTCTL
import st_io
import sources_servers as ss

pytestmark = pytest.mark.skipif(not (ss.have_s3rver() and ss.have_nginx()),
                                reason="s3rver/nginx not installed (scripts/deps.sh)")

BUCKET = "models"


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def s3():
    server = ss.S3Server().start()
    try:
        server.create_bucket(BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def web():
    server = ss.NginxServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3proxy(s3):
    with ss.FaultProxy(s3.host, s3.port) as p:
        yield p


@pytest.fixture
def webproxy(web):
    with ss.FaultProxy(web.host, web.port, upstream_ca=web.ca_file) as p:
        yield p


def _curl(*args, check=False):
    return subprocess.run(["curl", "-sS"] + list(args), capture_output=True, timeout=60,
                          check=check)


# ------------------------------------------------------------------ the servers themselves


def test_servers_s3_signs_ranges_and_etags(s3):
    data = os.urandom(300_000)
    etag = s3.put(BUCKET, "t/blob.bin", data)
    assert etag == '"%s"' % hashlib.md5(data).hexdigest()
    status, headers, body = s3.get(BUCKET, "t/blob.bin", byte_range="1000-1999")
    assert status == 206 and body == data[1000:2000]
    assert headers["content-range"] == "bytes 1000-1999/300000"
    assert headers["etag"] == etag
    # SigV4 is really verified: a wrong secret is refused, the right one not.
    status, _, body = s3.get(BUCKET, "t/blob.bin", secret="not-the-secret", check=False)
    assert status == 403 and b"SignatureDoesNotMatch" in body
    status, _, body = s3.get(BUCKET, "t/blob.bin", byte_range="0-9")
    assert status == 206 and body == data[:10]
    # Listing (path-style, ListObjectsV2; sorted query parameters).
    status, _, body = s3.curl("GET", "/%s?list-type=2&prefix=t%%2F" % BUCKET)
    assert b"<Key>t/blob.bin</Key>" in body
    s3.delete(BUCKET, "t/blob.bin")
    assert s3.head(BUCKET, "t/blob.bin")[0] == 404


def test_servers_nginx_https_ranges_etag_bearer(tmp_path):
    with ss.NginxServer(bearer_token="tok-123") as web:
        data = os.urandom(100_000)
        with open(os.path.join(web.root, "x.bin"), "wb") as f:
            f.write(data)
        code, body = web.curl("x.bin", "-r", "10-19", token="tok-123")
        assert code == 206 and body == data[10:20]
        code, _ = web.curl("x.bin", token="wrong")
        assert code == 401
        r = _curl("-D-", "-o", "/dev/null", "--cacert", web.ca_file, "-H",
                  "Authorization: Bearer tok-123", "--http2", web.url("x.bin"), check=True)
        head = r.stdout.decode()
        assert head.startswith("HTTP/2 200") and "etag:" in head.lower()
        # The certificate is the test CA's: without it, curl refuses.
        assert _curl(web.url("x.bin")).returncode != 0
        assert [(m, u, s) for m, u, s, _, _ in web.requests()][:1] == [("GET", "/x.bin", 206)]


def test_servers_fault_proxy_each_fault(s3):
    data = os.urandom(64 * 1024)
    s3.put(BUCKET, "t/f.bin", data)
    with ss.FaultProxy(s3.host, s3.port) as p:
        via = ss.S3Server(host=s3.host, port=p.port)  # the same server, through the proxy
        # Untouched: signatures stay valid through it, requests counted.
        status, headers, body = via.get(BUCKET, "t/f.bin", byte_range="100-199")
        assert status == 206 and body == data[100:200]
        status, headers = via.head(BUCKET, "t/f.bin")
        assert status == 200 and headers["content-length"] == str(len(data))
        assert p.count("GET") == 1 and p.count("HEAD") == 1

        p.add("status503", times=2)
        for _ in range(2):
            assert via.get(BUCKET, "t/f.bin", byte_range="100-199", check=False)[0] == 503
        assert via.get(BUCKET, "t/f.bin", byte_range="100-199")[2] == data[100:200]

        p.add("wrong_range", times=1)
        status, headers, body = via.get(BUCKET, "t/f.bin", byte_range="100-199")
        assert headers["content-range"] == "bytes 108-207/65536" and body == data[100:200]

        p.add("short", times=1)
        status, headers, body = via.get(BUCKET, "t/f.bin", byte_range="100-199")
        assert headers["content-range"] == "bytes 100-199/65536" and body == data[100:150]

        p.add("reset", times=1)
        with pytest.raises(RuntimeError):
            via.get(BUCKET, "t/f.bin", byte_range="100-1099")

        p.add("drip", times=1, interval=0.2)
        t0 = time.time()
        assert via.get(BUCKET, "t/f.bin", byte_range="100-104")[2] == data[100:105]
        assert time.time() - t0 >= 0.8

        # Header reads (a range from byte 0) are not faulted by default.
        p.add("status503")
        assert via.get(BUCKET, "t/f.bin", byte_range="0-7")[2] == data[:8]
        p.clear()
        assert p.count() == 0


def test_servers_fault_proxy_https_upstream_and_hold(web):
    data = os.urandom(10_000)
    with open(os.path.join(web.root, "h.bin"), "wb") as f:
        f.write(data)
    with ss.FaultProxy(web.host, web.port, upstream_ca=web.ca_file) as p:
        rule = p.add("hold", times=1)
        import threading
        got = {}
        t = threading.Thread(target=lambda: got.update(
            r=_curl("-r", "5-9", "-o", "-", p.url("h.bin"))))
        t.start()
        deadline = time.time() + 10
        while rule.waiting == 0 and time.time() < deadline:
            time.sleep(0.02)
        assert rule.waiting == 1 and "r" not in got
        rule.release()
        t.join(10)
        assert got["r"].stdout == data[5:10]


def test_servers_netsim_storage_namespace_and_cleanup():
    """tests/netsim.py: s3rver inside the storage namespace, a node reads
    from it over the bridge, the storage's link counters see the bytes, and
    every namespace is gone afterwards, also when the body raised."""
    import netsim
    netsim.require()

    def namespaces():
        return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout

    with pytest.raises(ZeroDivisionError):
        with netsim.Net(nodes=2, storage_rate="200mbit") as net:
            tag = net.tag
            s3 = ss.S3Server(host=net.storage.addr, prefix=net.storage.prefix).start()
            try:
                s3.create_bucket(BUCKET, via=net.storage.prefix)
                data = os.urandom(1 << 20)
                s3.put(BUCKET, "n/x.bin", data, via=net.storage.prefix)
                before = net.storage.tx_bytes()
                status, _, body = s3.get(BUCKET, "n/x.bin", via=net.nodes[1].prefix)
                assert status == 200 and body == data
                assert net.storage.tx_bytes() - before >= len(data)
                assert net.nodes[0].tx_bytes() < len(data) // 4  # node0 took no part
                # node0 cannot reach the root namespace's loopback servers.
                assert net.nodes[0].run(["curl", "-sS", "-m", "2", "http://127.0.0.1:%d/" %
                                         s3.port]).returncode != 0
            finally:
                s3.stop()
            assert tag in namespaces()
            1 / 0
    assert tag not in namespaces()

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


# ------------------------------------------------------------------ the daemon: helpers

AWS_ENV = {"AWS_ACCESS_KEY_ID": ss.S3_KEY, "AWS_SECRET_ACCESS_KEY": ss.S3_SECRET,
           "AWS_REGION": ss.S3_REGION, "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials"}
SECRET_PROBE = "wrong-secret-Zq9v7XkP3m"  # a wrong secret no log line or error may show
CHUNK = 1 << 20  # --source-chunk-bytes' minimum: the fault cases' checkpoint spans 4 chunks
MEMORY = ("models", "segments", "bytes_resident", "checkpoint_bytes_resident",
          "checkpoint_bytes_logical")


def _start(extra, env=AWS_ENV, **kw):
    """A Daemon with `env` in its environment (where it reads credentials)."""
    d = Daemon(extra_args=list(extra), **kw)
    saved = dict(os.environ)
    for k in list(os.environ):
        if k.startswith("AWS_"):
            del os.environ[k]
    os.environ.update(env)
    try:
        d.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return d


def _stats(d):
    out = d.ctl_ok("stats").stdout
    return {k.strip(): v.strip() for k, v in
            (line.split(":", 1) for line in out.splitlines() if ":" in line)}


def _memory(d):
    s = _stats(d)
    return {k: s[k] for k in MEMORY}


def _listed(d):
    return [l.split("\t", 1)[0] for l in d.ctl_ok("list").stdout.splitlines() if l.strip()]


def _counter(d, name):
    s = _stats(d)
    assert name in s, "weightctl stats lacks %s: %s" % (name, sorted(s))
    return int(s[name])


def _ckpt(seed, n=4, rows=64, cols=512):
    """Tensors of mixed dtypes, ~rows*cols*n*3 bytes."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        t = torch.randn(rows, cols, generator=g)
        out["layer%d.w" % i] = t.to((torch.float32, torch.bfloat16, torch.float16)[i % 3])
    out["step"] = torch.arange(7, dtype=torch.int64) + seed
    return out


def _data_offset(path):
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def _assert_serves(d, name, want):
    """The daemon's bytes of `name` equal PyTorch's tensors `want` (the same
    tensors st_io saved: the reference reading of those files)."""
    import weightd
    with weightd.Client(socket=d.socket) as c, c.fetch(name) as h:
        got = h.state_dict()
        assert sorted(got) == sorted(want)
        for k, t in want.items():
            assert got[k].dtype == t.dtype and torch.equal(got[k], t), k


def _error(r):
    assert r.returncode != 0, "expected a failure: " + r.stdout
    lines = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
    assert len(lines) == 1, r.stderr
    return r.error_code, r.error_message


def _assert_nothing_left(d, name, before):
    assert d.alive()
    assert name not in _listed(d)
    assert _memory(d) == before, "a failed load left memory charged"


# ------------------------------------------------------------------ the daemon: fixtures


@pytest.fixture(scope="module")
def files(s3, web, tmp_path_factory):
    """Checkpoints uploaded to s3://models/... and put under nginx's root."""
    root = tmp_path_factory.mktemp("ckpts")
    made = {}

    def save(rel, tensors):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        st_io.save(tensors, str(path))
        return str(path)

    single = _ckpt(1)
    save("single/m.safetensors", single)
    big = _ckpt(9, n=5, rows=512, cols=512)              # 3.5 MiB: several ranges
    save("big/m.safetensors", big)
    a, b = _ckpt(2, n=2), _ckpt(3, n=3)
    b = {k.replace("layer", "blk"): v for k, v in b.items() if k != "step"}
    save("shards/a.safetensors", a)
    save("shards/b.safetensors", b)
    (root / "shards" / "README.md").write_text("not a checkpoint\n")
    save("shards/sub/c.safetensors", _ckpt(4, n=1))    # not directly under the prefix
    x, y = _ckpt(5, n=2), {"head.w": torch.randn(32, 16, generator=torch.Generator().manual_seed(6))}
    save("hf/model-00001-of-00002.safetensors", x)
    save("hf/model-00002-of-00002.safetensors", y)
    save("hf/stray.safetensors", _ckpt(7, n=1))          # not in the index: not loaded
    index = {"metadata": {}, "weight_map": dict(
        [(k, "model-00001-of-00002.safetensors") for k in x] +
        [(k, "model-00002-of-00002.safetensors") for k in y])}
    (root / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    for dirpath, _, names in os.walk(root):
        for n in names:
            full = os.path.join(dirpath, n)
            rel = os.path.relpath(full, root)
            s3.put(BUCKET, rel, path=full)
            dst = os.path.join(web.root, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with open(full, "rb") as fs, open(dst, "wb") as fd:
                fd.write(fs.read())
    made.update(root=str(root), single=single, big=big, shards={**a, **b}, hf={**x, **y})
    return made


@pytest.fixture(scope="module")
def front(s3):
    """The module daemon's S3 endpoint: a fault proxy in front of s3rver
    that only counts (tests add rules and clear them)."""
    with ss.FaultProxy(s3.host, s3.port) as p:
        yield p


@pytest.fixture(scope="module")
def d(front, web, tmp_path_factory):
    daemon = _start(["--model-source", "s3://models/", "--model-source", web.url(),
                     "--s3-endpoint", front.endpoint, "--source-ca-file", web.ca_file],
                    workdir=str(tmp_path_factory.mktemp("d")))
    try:
        yield daemon
    finally:
        daemon.stop()


@pytest.fixture
def fresh(front):
    front.clear()
    yield front
    front.clear()


# ------------------------------------------------------------------ loads


def test_s3_single_file_equals_torch(d, files, fresh):
    before = {k: _counter(d, k) for k in ("source_bytes", "source_requests")}
    d.ctl_ok("load", "s3single", "s3://models/single/m.safetensors")
    _assert_serves(d, "s3single", files["single"])
    size = os.path.getsize(os.path.join(files["root"], "single/m.safetensors"))
    assert _counter(d, "source_bytes") - before["source_bytes"] >= size
    assert _counter(d, "source_requests") - before["source_requests"] >= 2  # header + data
    assert fresh.count() >= 2
    # The Python client sends the URL unchanged.
    import weightd
    with weightd.Client(socket=d.socket) as c:
        c.load("s3single-py", "s3://models/single/m.safetensors")
    _assert_serves(d, "s3single-py", files["single"])
    d.ctl_ok("unload", "s3single")
    d.ctl_ok("unload", "s3single-py")


def test_s3_prefix_of_shards_sorted_by_key(d, files, fresh):
    d.ctl_ok("load", "s3dir", "s3://models/shards/")
    _assert_serves(d, "s3dir", files["shards"])   # not README.md, not sub/c.safetensors
    d.ctl_ok("unload", "s3dir")


@pytest.mark.parametrize("url", ["s3://models/hf/", "s3://models/hf/model.safetensors.index.json"])
def test_s3_hf_index(d, files, fresh, url):
    d.ctl_ok("load", "s3hf", url)
    _assert_serves(d, "s3hf", files["hf"])        # not stray.safetensors
    assert fresh.count(path="stray") == 0
    d.ctl_ok("unload", "s3hf")


@pytest.mark.parametrize("rel,key", [("single/m.safetensors", "single"),
                                     ("hf/model.safetensors.index.json", "hf")])
def test_https_single_file_and_index(d, files, web, rel, key):
    d.ctl_ok("load", "web", web.url(rel))
    _assert_serves(d, "web", files[key])
    assert any(r[1] == "/" + rel for r in web.requests())
    d.ctl_ok("unload", "web")


def test_adapter_from_s3_equals_the_same_adapter_from_a_file(d, s3, tmp_path):
    import test_lora_parity as lora
    base = lora.build_base()["llama32"]
    st_io.save(base, os.path.join(d.model_root, "base.safetensors"))
    mods = lora._modules(layers=[0], mods={"self_attn.q_proj": lora.PROJ["self_attn.q_proj"]})
    ad = lora.make_peft(d.model_root, "lora1", mods, r=4, alpha=8)
    for n in ("adapter_config.json", "adapter_model.safetensors"):
        s3.put(BUCKET, "adapters/lora1/" + n, path=os.path.join(ad.path, n))
    d.ctl_ok("load", "base", os.path.join(d.model_root, "base.safetensors"))
    d.ctl_ok("adapter", "load", "from-file", ad.path)
    d.ctl_ok("adapter", "load", "from-s3", "s3://models/adapters/lora1/")
    outs = {}
    for a in ("from-file", "from-s3"):
        d.ctl_ok("apply", "base", a)
        out = str(tmp_path / (a + ".safetensors"))
        d.ctl_ok("fetch", "base", "--out", out)
        outs[a] = st_io.load_raw(out)
    assert outs["from-s3"] == outs["from-file"]
    assert outs["from-s3"]["model.layers.0.self_attn.q_proj.weight"][2] != \
        st_io.tensor_bytes(base["model.layers.0.self_attn.q_proj.weight"]), "the adapter applied"
    d.ctl_ok("apply", "base")
    for a in ("from-file", "from-s3"):
        d.ctl_ok("adapter", "unload", a)
    d.ctl_ok("unload", "base")


# ------------------------------------------------------------------ confinement, credentials


def test_urls_outside_model_sources_make_no_request(d, web, fresh):
    before_web = len(web.requests())
    mem = _memory(d)
    port = web.port
    outside = [
        "s3://models-evil/single/m.safetensors",
        "s3://other/single/m.safetensors",
        "https://127.0.0.2:%d/single/m.safetensors" % port,
        "https://localhost:%d/single/m.safetensors" % port,
        "http://127.0.0.1:%d/single/m.safetensors" % fresh.port,
        fresh.url("models/single/m.safetensors"),
        "ftp://127.0.0.1/single/m.safetensors",
    ]
    tricky = [  # refused whatever the reason (malformed or outside): never fetched
        "s3://models/../other/m.safetensors",
        "s3://models/single/%2e%2e/%2e%2e/other/m.safetensors",
        "s3://models%2Fsingle/m.safetensors",
        "https://user:pw@127.0.0.1:%d/single/m.safetensors" % port,
        "https://127.0.0.1:%d/single/m.safetensors?x=1" % port,
        "https://127.0.0.1:%d/single/m.safetensors#frag" % port,
        "https://127.0.0.1:%d/../single/m.safetensors" % port,
        "https://127.0.0.1:%d%%2F..%%2Fsingle/m.safetensors" % port,
    ]
    for url in outside:
        code, msg = _error(d.ctl("load", "evil", url))
        assert code == "PERMISSION_DENIED", (url, code, msg)
        assert "outside the model sources" in msg, msg
    for url in tricky:
        code, msg = _error(d.ctl("load", "evil", url))
        assert code in ("PERMISSION_DENIED", "INVALID_ARGUMENT"), (url, code, msg)
        assert ":pw@" not in msg, "a URL's password echoed: " + msg
    assert fresh.count() == 0, "a refused URL reached the object store: %s" % fresh.requests
    assert len(web.requests()) == before_web, "a refused URL reached the https server"
    _assert_nothing_left(d, "evil", mem)


def test_wrong_secret_is_permission_denied_naming_the_source_not_the_secret(front, files):
    env = dict(AWS_ENV, AWS_SECRET_ACCESS_KEY=SECRET_PROBE)
    d = _start(["--model-source", "s3://models/", "--s3-endpoint", front.endpoint,
                "--source-retries", "1"], env=env)
    try:
        mem = _memory(d)
        r = d.ctl("load", "m", "s3://models/single/m.safetensors")
        code, msg = _error(r)
        assert code == "PERMISSION_DENIED", r.stderr
        assert "AWS_ACCESS_KEY_ID" in msg and "environment" in msg, msg
        assert ss.S3_KEY not in msg, "the key id's value is in the error: " + msg
        _assert_nothing_left(d, "m", mem)
        assert _counter(d, "source_failures") >= 1
        r2 = d.ctl("load", "m", "s3://models/shards/")
        assert _error(r2)[0] == "PERMISSION_DENIED", r2.stderr
        printed = r.stderr + r.stdout + r2.stderr + r2.stdout + d.ctl_ok("stats").stdout
        log = d.log()
    finally:
        d.stop()
    assert SECRET_PROBE not in printed
    assert SECRET_PROBE not in log, "the secret is in the daemon's log"


def test_missing_object_and_bucket_are_not_found(d, fresh):
    mem = _memory(d)
    for url in ("s3://models/nope/m.safetensors", "s3://models/nope/"):
        code, msg = _error(d.ctl("load", "nf", url))
        assert code == "NOT_FOUND", (url, msg)
    _assert_nothing_left(d, "nf", mem)


def test_https_bearer_token_file_reread_on_each_load(files, tmp_path):
    token = tmp_path / "token"
    token.write_text("tok-good-7781\n")
    with ss.NginxServer(bearer_token="tok-good-7781") as web:
        src = os.path.join(files["root"], "single", "m.safetensors")
        with open(src, "rb") as fs, open(os.path.join(web.root, "m.safetensors"), "wb") as fd:
            fd.write(fs.read())
        d = _start(["--model-source", web.url(), "--source-ca-file", web.ca_file,
                    "--https-bearer-token-file", str(token), "--source-retries", "0"],
                   workdir=str(tmp_path / "d"))
        try:
            d.ctl_ok("load", "m", web.url("m.safetensors"))
            _assert_serves(d, "m", files["single"])
            mem = _memory(d)
            token.write_text("tok-bad-9911\n")
            code, msg = _error(d.ctl("load", "m2", web.url("m.safetensors")))
            assert code == "PERMISSION_DENIED", msg
            assert "tok-bad-9911" not in msg
            _assert_nothing_left(d, "m2", mem)
            log = d.log()
        finally:
            d.stop()
        assert "tok-bad-9911" not in log and "tok-good-7781" not in log


# ------------------------------------------------------------------ faults

FAULT_FLAGS = ["--source-retries", "2", "--source-timeout-seconds", "2",
               "--source-chunk-bytes", str(CHUNK), "--source-streams", "2"]


@pytest.fixture(scope="module")
def fd(front, tmp_path_factory):
    """A daemon for the faults: small chunks (many ranges), 2 retries."""
    daemon = _start(["--model-source", "s3://models/", "--s3-endpoint", front.endpoint] +
                    FAULT_FLAGS, workdir=str(tmp_path_factory.mktemp("fd")))
    try:
        yield daemon
    finally:
        daemon.stop()


BIG = "s3://models/big/m.safetensors"


def _big(files):
    path = os.path.join(files["root"], "big", "m.safetensors")
    return path, _data_offset(path)


@pytest.mark.parametrize("fault,times", [("reset", 1), ("status503", 2)])
def test_fault_then_recover_succeeds_and_counts_retries(fd, files, fresh, fault, times):
    _, off = _big(files)
    retries = _counter(fd, "source_retries")
    rule = fresh.add(fault, times=times, min_start=off)
    fd.ctl_ok("load", "rec", BIG)
    assert rule.hits == times
    _assert_serves(fd, "rec", files["big"])
    assert _counter(fd, "source_retries") - retries >= times
    fd.ctl_ok("unload", "rec")


@pytest.mark.parametrize("fault,code", [("reset", "UNAVAILABLE"), ("status503", "UNAVAILABLE"),
                                        ("wrong_range", "DATA_LOSS"), ("short", "DATA_LOSS")])
def test_fault_fails_with_its_code_and_leaves_nothing(fd, files, fresh, fault, code):
    _, off = _big(files)
    mem = _memory(fd)
    failures = _counter(fd, "source_failures")
    rule = fresh.add(fault, min_start=off)
    got, msg = _error(fd.ctl("load", "bad", BIG))
    assert got == code, msg
    assert rule.hits >= 1
    if code == "UNAVAILABLE":
        assert rule.hits >= 3, "2 retries: the range was asked 3 times"
        assert "503" in msg or "reset" in msg.lower() or "recv" in msg.lower(), msg
    _assert_nothing_left(fd, "bad", mem)
    assert _counter(fd, "source_failures") > failures
    # The daemon keeps serving: the same URL loads once the fault is gone.
    fresh.clear()
    fd.ctl_ok("load", "bad", BIG)
    _assert_serves(fd, "bad", files["big"])
    fd.ctl_ok("unload", "bad")


def test_drip_past_the_source_timeout_is_deadline_exceeded(front, files, fresh, tmp_path):
    _, off = _big(files)
    d = _start(["--model-source", "s3://models/", "--s3-endpoint", front.endpoint,
                "--source-retries", "0", "--source-timeout-seconds", "1",
                "--source-chunk-bytes", str(CHUNK)], workdir=str(tmp_path / "d"))
    try:
        mem = _memory(d)
        fresh.add("drip", min_start=off, interval=2.5)
        t0 = time.time()
        code, msg = _error(d.ctl("load", "slow", BIG, timeout=60))
        assert code == "DEADLINE_EXCEEDED", msg
        assert time.time() - t0 < 30
        _assert_nothing_left(d, "slow", mem)
    finally:
        d.stop()


def _background_load(d, name, url):
    return subprocess.Popen([WEIGHTCTL, "--socket", d.socket, "load", name, url],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_held(rule, timeout=20):
    deadline = time.time() + timeout
    while rule.waiting == 0:
        assert time.time() < deadline, "the load never reached the held range"
        time.sleep(0.02)


def test_object_replaced_mid_load_is_aborted(fd, s3, files, fresh):
    path, off = _big(files)
    key = "replaced/m.safetensors"
    old = s3.put(BUCKET, key, path=path)
    mem = _memory(fd)
    # Every data range waits in the proxy while the object is replaced: none
    # is in flight during the upload (s3rver rewrites the object's file in
    # place, so a read racing the upload sees a torn file or a 416).
    rule = fresh.add("hold", min_start=off, path=key)
    proc = _background_load(fd, "repl", "s3://models/" + key)
    try:
        _wait_held(rule)
        other = {k: v * 2 if v.is_floating_point() else v for k, v in files["big"].items()}
        tmp = path + ".other"
        st_io.save(other, tmp)
        new = s3.put(BUCKET, key, path=tmp)
        os.unlink(tmp)
        assert new != old
    finally:
        rule.release()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0, "a load across two object versions succeeded"
    line = [l for l in err.splitlines() if l.startswith("error: ")][0]
    code, msg = line[len("error: "):].split(":", 1)
    assert code == "ABORTED", err
    assert "changed while loading" in msg and old.strip('"') in msg and new.strip('"') in msg, msg
    _assert_nothing_left(fd, "repl", mem)


def test_unload_cancels_a_slow_load_promptly(fd, files, fresh):
    """unload while the object store holds a range: the load ends CANCELLED
    within seconds (its request in flight ended, not waited out), and
    nothing of it stays listed or charged."""
    _, off = _big(files)
    mem = _memory(fd)
    rule = fresh.add("hold", min_start=off)
    proc = _background_load(fd, "slowload", BIG)
    try:
        _wait_held(rule)
        t0 = time.time()
        unload = fd.ctl("unload", "slowload")
        out, err = proc.communicate(timeout=10)
        took = time.time() - t0
    finally:
        rule.release()
    assert proc.returncode != 0
    assert "error: CANCELLED" in err, (err, unload.returncode, unload.stderr)
    assert took < 5, "the load took %.1f s to end after unload" % took
    _assert_nothing_left(fd, "slowload", mem)


def test_client_cancel_abandons_a_slow_load_promptly(fd, files, fresh):
    """Ctrl-C on weightctl load: the daemon drops the load (its requests
    too) while the object store still holds the range."""
    import signal
    _, off = _big(files)
    mem = _memory(fd)
    rule = fresh.add("hold", min_start=off)
    proc = _background_load(fd, "ctrlc", BIG)
    try:
        _wait_held(rule)
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=10)
        deadline = time.time() + 5
        while _memory(fd) != mem or "ctrlc" in _listed(fd):
            assert time.time() < deadline, "the load went on after its client cancelled"
            time.sleep(0.05)
        assert rule.waiting >= 1, "the proxy let the range go: the test proved nothing"
    finally:
        rule.release()
    time.sleep(0.5)
    _assert_nothing_left(fd, "ctrlc", mem)


def _absurd(header_len=None, shape=None, offsets=None):
    hdr = {"w": {"dtype": "F32", "shape": shape or [4], "data_offsets": offsets or [0, 16]}}
    raw = json.dumps(hdr).encode()
    raw += b" " * (-len(raw) % 8)
    n = len(raw) if header_len is None else header_len
    return n.to_bytes(8, "little") + raw + b"\0" * 16


ABSURD = {
    "header_len_2pow40": _absurd(header_len=2 ** 40),
    "header_len_u64_max": _absurd(header_len=2 ** 64 - 1),
    "shape_2pow62": _absurd(shape=[2 ** 31, 2 ** 31], offsets=[0, 2 ** 64 - 16]),
    "offsets_past_end": _absurd(offsets=[0, 1 << 40], shape=[1 << 38]),
}


@pytest.mark.parametrize("slug", sorted(ABSURD))
def test_absurd_header_sizes_are_refused_without_absurd_reads(fd, s3, fresh, slug):
    blob = ABSURD[slug]
    key = "absurd/%s.safetensors" % slug
    s3.put(BUCKET, key, blob)
    mem = _memory(fd)
    code, msg = _error(fd.ctl("load", "absurd", "s3://models/" + key))
    assert code in ("INVALID_ARGUMENT", "DATA_LOSS"), msg
    # Only this object's requests: the module's daemon may still be reading
    # another test's object (a load an earlier test let run on).
    mine = [r for r in fresh.requests if r["path"] == "/%s/%s" % (BUCKET, key)]
    assert mine, fresh.requests  # the load did ask for the object
    for r in mine:
        if r["range"] is not None and r["range"][1] is not None:
            assert r["range"][1] < len(blob), "asked for bytes past the object: %s" % r
    _assert_nothing_left(fd, "absurd", mem)


def test_https_503_then_recover_through_the_proxy(web, files, tmp_path):
    with ss.FaultProxy(web.host, web.port, upstream_ca=web.ca_file) as p:
        d = _start(["--model-source", p.endpoint + "/", "--source-retries", "3",
                    "--source-chunk-bytes", str(CHUNK)], workdir=str(tmp_path / "d"))
        try:
            off = _data_offset(os.path.join(files["root"], "hf", "model-00001-of-00002.safetensors"))
            rule = p.add("status503", times=2, min_start=off)
            d.ctl_ok("load", "h", p.url("hf/model.safetensors.index.json"))
            _assert_serves(d, "h", files["hf"])
            assert rule.hits == 2 and _counter(d, "source_retries") >= 2
        finally:
            d.stop()


# ------------------------------------------------------------------ restart


def test_restart_restores_an_s3_model_or_says_why_not(front, s3, files, tmp_path):
    path = os.path.join(files["root"], "single", "m.safetensors")
    key = "restart/m.safetensors"
    s3.put(BUCKET, key, path=path)
    state = str(tmp_path / "state")
    args = ["--model-source", "s3://models/", "--s3-endpoint", front.endpoint, "--state-dir", state]
    d = _start(args, workdir=str(tmp_path / "d1"))
    try:
        d.ctl_ok("load", "r", "s3://models/" + key)
        d.proc.kill()
        d.proc.wait()
    finally:
        d.stop()
    d = _start(args, workdir=str(tmp_path / "d2"))
    try:
        assert _listed(d) == ["r"]
        _assert_serves(d, "r", files["single"])
        d.proc.kill()
        d.proc.wait()
    finally:
        d.stop()
    # Replaced while the daemon was down: not restored, and the log says why.
    other = path + ".other"
    st_io.save({k: v + 1 if v.is_floating_point() else v for k, v in files["single"].items()}, other)
    s3.put(BUCKET, key, path=other)
    os.unlink(other)
    d = _start(args, workdir=str(tmp_path / "d3"))
    try:
        assert _listed(d) == []
        log = d.log()
        assert "restore_skipped" in log and key in log, log[-2000:]
        skipped = [json.loads(l) for l in open(os.path.join(state, "skipped.log"))]
        assert skipped[-1]["entry"].startswith('model load "r"'), skipped
        assert "FAILED_PRECONDITION" in json.dumps(skipped[-1]) or "changed" in log, skipped
    finally:
        d.stop()



# ------------------------------------------------------------------ fleet


def test_a_peer_supplies_a_url_load_storage_serves_it_once(front, files, tmp_path):
    """Two peered daemons: A loads the S3 checkpoint, then B loads the same
    URL and takes the bytes from A; what B reads from the object store
    (through the counting proxy) is headers and samples, not the data."""
    from harness import free_port
    import weightd
    tokens = tmp_path / "tokens"
    tokens.write_text("fleet fleet-token-0123456789abcdef\n")
    addrs = ["127.0.0.1:%d" % free_port() for _ in range(2)]
    ds = []
    try:
        for i, addr in enumerate(addrs):
            ds.append(_start(["--model-source", "s3://models/", "--s3-endpoint", front.endpoint,
                              "--listen", addr, "--advertise", addr,
                              "--peers", addrs[1 - i], "--peer-poll-seconds", "1",
                              "--auth-token-file", str(tokens), "--fleet-members", "token:fleet",
                              "--peer-token-file", str(tokens)], workdir=str(tmp_path / str(i))))
        a, b = ds
        path, off = _big(files)
        size = os.path.getsize(path)
        front.clear()
        a.ctl_ok("load", "m", BIG)
        assert front.sent_bytes() >= size - off
        with weightd.Client(socket=b.socket) as cb:
            deadline = time.time() + 15
            while not any(p["models"] for p in cb.peers()):
                assert time.time() < deadline, "b never saw a's model"
                time.sleep(0.1)
        front.clear()
        b.ctl_ok("load", "m", BIG, "--source", "peers")
        assert front.sent_bytes() < (size - off) // 2, \
            "b read %d of %d bytes from storage" % (front.sent_bytes(), size)
        _assert_serves(b, "m", files["big"])
        assert _counter(b, "load_bytes_peers") >= size - off - 4096
    finally:
        for d in ds:
            d.stop()


# ------------------------------------------------------------------ loaders that serve what they have

SWARM = "s3://models/swarm/m.safetensors"


@pytest.fixture(scope="module")
def swarm_file(s3, tmp_path_factory):
    """16 MiB in 8 tensors: 16 ranges of the 1 MiB --source-chunk-bytes."""
    g = torch.Generator().manual_seed(41)
    tensors = {"w%d" % i: torch.randn(512, 1024, generator=g) for i in range(8)}
    path = str(tmp_path_factory.mktemp("swarm") / "m.safetensors")
    st_io.save(tensors, path)
    s3.put(BUCKET, "swarm/m.safetensors", path=path)
    return path, tensors


FLEET_TOKEN = "fleet-token-0123456789abcdef"


def _fleet(n, front, tmp_path, extra=(), peers_of=None, addrs=None):
    """n daemons (at `addrs`, or free ports), every one a peer of every other
    (or of peers_of(i, addrs)), reading S3 through `front`."""
    from harness import free_port
    tokens = tmp_path / "tokens"
    tokens.write_text("fleet %s\n" % FLEET_TOKEN)
    addrs = addrs or ["127.0.0.1:%d" % free_port() for _ in range(n)]
    ds = []
    try:
        for i, addr in enumerate(addrs):
            others = [a for a in addrs if a != addr]
            if peers_of is not None:
                others = peers_of(i, addrs)
            ds.append(_start(["--model-source", "s3://models/", "--s3-endpoint", front.endpoint,
                              "--listen", addr, "--advertise", addr,
                              "--peers", ",".join(others), "--peer-poll-seconds", "1",
                              "--source-chunk-bytes", str(1 << 20), "--source-streams", "2",
                              "--auth-token-file", str(tokens), "--fleet-members", "token:fleet",
                              "--peer-token-file", str(tokens)] + list(extra),
                             workdir=str(tmp_path / str(i))))
    except BaseException:
        for d in ds:
            d.stop()
        raise
    return ds


def _loads_at_once(ds, name, url):
    """Starts `weightctl load` on every daemon at once; the processes."""
    return [subprocess.Popen([WEIGHTCTL, "--socket", d.socket, "load", name, url],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for d in ds]


def _succeed(procs):
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err


def _slow_swarm_loads(front, ds, off):
    """Every daemon loads SWARM at once while `front` holds each data GET
    0.3 s; the bytes the store sent."""
    front.clear()
    front.add("delay", delay=0.3, path="swarm/", min_start=off)
    _succeed(_loads_at_once(ds, "m", SWARM))
    sent = front.sent_bytes()
    front.clear()
    return sent


def test_loaders_at_once_share_out_storage_and_serve_each_other(front, swarm_file, tmp_path):
    """Three daemons load one 16 MiB object at once from a slow store (each
    data GET held 0.3 s): each reads its share from storage and the rest from
    the others while they are still loading, so the store sends about one
    copy of the data, not three; every daemon's bytes equal PyTorch's."""
    path, tensors = swarm_file
    off = _data_offset(path)
    data = os.path.getsize(path) - off
    ds = _fleet(3, front, tmp_path)
    try:
        sent = _slow_swarm_loads(front, ds, off)
        for d in ds:
            _assert_serves(d, "m", tensors)
        from_peers = [_counter(d, "load_bytes_peers") for d in ds]
        # Alone, each would read all of it: 3x. Shared out: one copy, plus
        # each daemon's samples and checks and the ranges it began before it
        # saw the others.
        assert sent < 2.0 * data, "the store sent %.2fx the data" % (sent / data)
        assert sum(from_peers) >= data, from_peers
        assert sum(1 for b in from_peers if b > 0) >= 2, from_peers
    finally:
        for d in ds:
            d.stop()


def test_a_partial_holder_killed_mid_load_costs_only_its_ranges(front, swarm_file, tmp_path):
    """Three daemons load at once; one is SIGKILLed while they are all still
    reading. The other two finish with PyTorch's bytes (the dead one's ranges
    come from storage or the survivor) and keep serving."""
    path, tensors = swarm_file
    off = _data_offset(path)
    ds = _fleet(3, front, tmp_path)
    try:
        front.clear()
        front.add("delay", delay=0.3, path="swarm/", min_start=off)
        procs = _loads_at_once(ds, "m", SWARM)
        time.sleep(1.0)
        ds[2].proc.kill()
        _succeed(procs[:2])
        procs[2].communicate(timeout=30)
        front.clear()
        for d in ds[:2]:
            assert d.alive()
            _assert_serves(d, "m", tensors)
    finally:
        for d in ds:
            d.stop()


def test_a_partial_holder_sending_wrong_bytes_is_caught_and_dropped(front, swarm_file, tmp_path):
    """Two daemons load at once; b reaches a through a proxy that flips a bit
    in every chunk a sends while still loading. b compares what it received
    with storage (--peer-verify all), drops a (peer_data_loss), keeps nothing
    it sent and reads those ranges again: both end with PyTorch's bytes."""
    import grpc
    import peer_protocol as pp
    from harness import free_port
    from weightd.v1 import weightd_pb2 as pb

    auth = [("authorization", "Bearer " + FLEET_TOKEN)]

    class Flipper(pp.HolderProxy):
        flipped = 0

        def handlers(self):
            return {"ReadCheckpoint": self.grpc.unary_stream_rpc_method_handler(
                self._read, request_deserializer=pb.ReadCheckpointRequest.FromString,
                response_serializer=pb.ReadChunk.SerializeToString)}

        def _read(self, req, ctx):
            try:
                for chunk in self.stub.ReadCheckpoint(req, metadata=auth):
                    if chunk.data:
                        data = bytearray(chunk.data)
                        data[len(data) // 2] ^= 0x10
                        Flipper.flipped += 1
                        chunk = pb.ReadChunk(offset=chunk.offset, data=bytes(data))
                    yield chunk
            except grpc.RpcError as e:
                ctx.abort(e.code(), e.details())

    path, tensors = swarm_file
    off = _data_offset(path)
    a_port = free_port()
    with Flipper("127.0.0.1:%d" % a_port, auth, workers=8) as proxy:
        # a's address is fixed up front: the proxy dials it lazily.
        def peers_of(i, addrs):
            return [addrs[1]] if i == 0 else [proxy.address]
        ds = _fleet(2, front, tmp_path, extra=["--peer-verify", "all"], peers_of=peers_of,
                    addrs=["127.0.0.1:%d" % a_port, "127.0.0.1:%d" % free_port()])
        try:
            _slow_swarm_loads(front, ds, off)
            for d in ds:
                _assert_serves(d, "m", tensors)
            b = ds[1]
            assert Flipper.flipped > 0, "b never read from a while a was loading"
            assert "peer_data_loss" in b.log()
            assert _counter(b, "load_bytes_peers") == 0
        finally:
            for d in ds:
                d.stop()


def test_simulated_fleet_loads_at_once_reading_storage_once(swarm_file, tmp_path):
    """tests/netsim.py: a storage namespace (s3rver behind a 200 Mbit/s
    limit) and four node namespaces (200 Mbit/s each), one daemon per node,
    peers of each other, load the 16 MiB object at once. The storage link's
    own counter (read outside every daemon) shows about one copy leaving
    storage, and every daemon serves PyTorch's bytes."""
    import netsim
    netsim.require()
    path, tensors = swarm_file
    size = os.path.getsize(path)
    tokens = tmp_path / "tokens"
    tokens.write_text("fleet %s\n" % FLEET_TOKEN)
    with netsim.Net(nodes=4, storage_rate="200mbit", node_rate="200mbit") as net:
        s3 = ss.S3Server(host=net.storage.addr, prefix=net.storage.prefix).start(timeout=60)
        ds = []
        try:
            s3.create_bucket(BUCKET, via=net.storage.prefix)
            s3.put(BUCKET, "swarm/m.safetensors", path=path, via=net.storage.prefix)
            addrs = ["%s:7471" % n.addr for n in net.nodes]
            for i, node in enumerate(net.nodes):
                ds.append(_start([
                    "--model-source", "s3://models/", "--s3-endpoint", s3.endpoint,
                    "--source-chunk-bytes", str(1 << 20), "--listen", addrs[i],
                    "--advertise", addrs[i], "--peers", ",".join(a for a in addrs if a != addrs[i]),
                    "--peer-poll-seconds", "1", "--auth-token-file", str(tokens),
                    "--fleet-members", "token:fleet", "--peer-token-file", str(tokens),
                    "--allow-insecure-token"], workdir=str(tmp_path / ("n%d" % i)),
                    prefix=node.prefix))
            before = net.storage.tx_bytes()
            _succeed(_loads_at_once(ds, "m", SWARM))
            sent = net.storage.tx_bytes() - before
            for d in ds:
                _assert_serves(d, "m", tensors)
            # Alone each would read it all (4x); shared out, about once
            # (plus samples, checks, framing).
            assert sent < 1.6 * size, "storage sent %.2fx the object" % (sent / size)
            assert sum(_counter(d, "load_bytes_peers") for d in ds) >= 2 * size
        finally:
            for d in ds:
                d.stop()
            s3.stop()

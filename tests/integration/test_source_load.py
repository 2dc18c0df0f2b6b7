"""Loads from remote sources (issue 42), the daemon side's own first checks:
s3:// from an s3rver the test starts (requests signed with SigV4; s3rver
3.7.1 checks the access key id, not the signature), https://
from nginx with a CA the test makes; bytes equal PyTorch's reading of the
same files; single files, prefixes, HF indexes; the allow-list and 403s
refuse with the contract's codes and never print a secret. The fault
cases and the benchmarks are tests/integration/test_sources.py's (the
sources-test branch)."""
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import Daemon, free_port  # noqa: E402
import st_io  # noqa: E402  (harness puts tests/parity on sys.path)
import weightd  # noqa: E402
import sources_servers  # noqa: E402

KEY, SECRET = "S3RVER", "S3RVER"  # s3rver's defaults
BUCKET = "models"


class S3:
    """The suite's S3 server (tests/sources_servers.S3Server: @20minutes/s3rver,
    which checks SigV4 signatures) with the bucket BUCKET."""

    def __init__(self, tmp):
        if not sources_servers.have_s3rver():
            pytest.skip("s3rver is not installed (scripts/deps.sh installs it)")
        self.server = sources_servers.S3Server(workdir=tmp).start()
        self.endpoint = self.server.endpoint
        self.server.create_bucket(BUCKET)

    def put(self, key, path, secret=SECRET):
        self.server.curl("PUT", "/%s/%s" % (BUCKET, key), "-T", path, secret=secret,
                         body_sha="UNSIGNED-PAYLOAD")

    def stop(self):
        self.server.stop()


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = S3(str(tmp_path_factory.mktemp("s3")))
    yield server
    server.stop()


def _ref(seed, names=("a.weight", "b.weight")):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(64 + 8 * i, 32, generator=g) for i, n in enumerate(names)}


def _daemon(tmp, s3, extra=(), env=None):
    env = dict(env or {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET})
    prefix = ["env", "-u", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE=/nonexistent"] + \
        ["%s=%s" % kv for kv in env.items()]
    return Daemon(workdir=str(tmp), prefix=prefix,
                  extra_args=["--model-source", "s3://%s/ok/" % BUCKET,
                              "--s3-endpoint", s3.endpoint, "--source-chunk-bytes", "1048576",
                              "--source-retries", "1", "--source-timeout-seconds", "5",
                              *extra])


def _serves(c, name, ref):
    with c.fetch(name, world=1, rank=0) as h:
        got = h.state_dict()
    assert sorted(got) == sorted(ref)
    for n, t in ref.items():
        assert torch.equal(got[n], t), n


def test_s3_single_file_prefix_and_index_equal_torch(tmp_path, s3):
    one = _ref(1)
    st_io.save(one, str(tmp_path / "one.safetensors"))
    s3.put("ok/single/model.safetensors", str(tmp_path / "one.safetensors"))
    # A prefix of two shards (sorted by key) and no index.
    shards = [_ref(2, ("x.weight",)), _ref(3, ("y.weight", "z.weight"))]
    for i, part in enumerate(shards):
        st_io.save(part, str(tmp_path / ("s%d.safetensors" % i)))
        s3.put("ok/dir/part-%d.safetensors" % i, str(tmp_path / ("s%d.safetensors" % i)))
    # An HF index beside its shards.
    weight_map = {}
    for i, part in enumerate(shards):
        fname = "model-%05d-of-00002.safetensors" % (i + 1)
        s3.put("ok/hf/" + fname, str(tmp_path / ("s%d.safetensors" % i)))
        weight_map.update({n: fname for n in part})
    (tmp_path / "index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    s3.put("ok/hf/model.safetensors.index.json", str(tmp_path / "index.json"))
    both = dict(shards[0], **shards[1])
    # The reference is PyTorch's reading of the uploaded file.
    assert all(torch.equal(st_io.load(str(tmp_path / "one.safetensors"))[n], one[n]) for n in one)

    with _daemon(tmp_path / "d", s3) as d, weightd.Client(socket=d.socket) as c:
        c.load("single", "s3://%s/ok/single/model.safetensors" % BUCKET)
        _serves(c, "single", one)
        c.load("dir", "s3://%s/ok/dir/" % BUCKET)
        _serves(c, "dir", both)
        c.load("hf", "s3://%s/ok/hf/" % BUCKET)
        _serves(c, "hf", both)
        c.load("hf2", "s3://%s/ok/hf/model.safetensors.index.json" % BUCKET)
        _serves(c, "hf2", both)
        assert c.info("single").path == "s3://%s/ok/single/model.safetensors" % BUCKET


def test_s3_refusals_name_no_secret(tmp_path, s3):
    st_io.save(_ref(4), str(tmp_path / "m.safetensors"))
    s3.put("ok/m.safetensors", str(tmp_path / "m.safetensors"))
    s3.put("secret/m.safetensors", str(tmp_path / "m.safetensors"))
    with _daemon(tmp_path / "d", s3) as d, weightd.Client(socket=d.socket) as c:
        for url in ("s3://%s/secret/m.safetensors" % BUCKET,
                    "s3://%s/ok/../secret/m.safetensors" % BUCKET,
                    "s3://%s/ok/%%2E%%2E/secret/m.safetensors" % BUCKET,
                    "s3://%s-evil/ok/m.safetensors" % BUCKET,
                    "s3://u:p@%s/ok/m.safetensors" % BUCKET,
                    "https://example.com/ok/m.safetensors"):
            with pytest.raises(weightd.Error) as e:
                c.load("x", url)
            assert e.value.code == "PERMISSION_DENIED", (url, e.value)
            assert "is outside the model sources [s3://models/ok/]" in str(e.value), e.value
        with pytest.raises(weightd.Error) as e:
            c.load("x", "s3://%s/ok/missing.safetensors" % BUCKET)
        assert e.value.code == "NOT_FOUND", e.value
        assert c.list() == []
    # Unknown credentials: 403. (s3rver 3.7.1 checks the key id but not the
    # SigV4 signature itself; see docs/sources.md.)
    with _daemon(tmp_path / "d2", s3, env={"AWS_ACCESS_KEY_ID": "WRONGKEYID7",
                                           "AWS_SECRET_ACCESS_KEY": "WRONG-SECRET-9"}) as d, \
            weightd.Client(socket=d.socket) as c:
        with pytest.raises(weightd.Error) as e:
            c.load("x", "s3://%s/ok/m.safetensors" % BUCKET)
        assert e.value.code == "PERMISSION_DENIED", e.value
        assert "S3 credentials from environment (AWS_ACCESS_KEY_ID)" in str(e.value), e.value
        assert "WRONG-SECRET-9" not in str(e.value) and "WRONGKEYID7" not in str(e.value)
        assert "WRONG-SECRET-9" not in d.log() and "WRONGKEYID7" not in d.log()
        assert c.list() == []
        assert c.stats()["bytes_resident"] == 0


def _nginx(tmp, root):
    if shutil.which("nginx") is None and not os.path.exists("/usr/sbin/nginx"):
        pytest.skip("nginx is not installed")
    ca_key, ca, key, csr, crt = (os.path.join(tmp, n) for n in
                                 ("ca.key", "ca.pem", "srv.key", "srv.csr", "srv.pem"))
    ext = os.path.join(tmp, "ext.cnf")
    with open(ext, "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run = lambda *a: subprocess.run(a, check=True, capture_output=True)  # noqa: E731
    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca,
        "-days", "2", "-subj", "/CN=weightd-test-ca")
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
        "-subj", "/CN=127.0.0.1")
    run("openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
        "-out", crt, "-days", "2", "-extfile", ext)
    port = free_port()
    conf = os.path.join(tmp, "nginx.conf")
    with open(conf, "w") as f:
        f.write("""daemon off; user root; pid %(t)s/nginx.pid; error_log %(t)s/error.log;
events {}
http { access_log %(t)s/access.log; client_body_temp_path %(t)s;
  server { listen 127.0.0.1:%(p)d ssl http2; ssl_certificate %(c)s; ssl_certificate_key %(k)s;
           root %(r)s; } }
""" % {"t": tmp, "p": port, "c": crt, "k": key, "r": root})
    proc = subprocess.Popen(["nginx", "-c", conf, "-p", tmp], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    return proc, port, ca


def test_https_file_and_index_equal_torch(tmp_path, s3):
    root = tmp_path / "www" / "org"
    root.mkdir(parents=True)
    one = _ref(5)
    st_io.save(one, str(root / "model.safetensors"))
    shards = [_ref(6, ("p.weight",)), _ref(7, ("q.weight",))]
    weight_map = {}
    for i, part in enumerate(shards):
        fname = "model-%05d-of-00002.safetensors" % (i + 1)
        st_io.save(part, str(root / fname))
        weight_map.update({n: fname for n in part})
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    proc, port, ca = _nginx(str(tmp_path), str(tmp_path / "www"))
    try:
        base = "https://127.0.0.1:%d/org/" % port
        with _daemon(tmp_path / "d", s3, extra=["--model-source", base,
                                                "--source-ca-file", ca]) as d, \
                weightd.Client(socket=d.socket) as c:
            c.load("one", base + "model.safetensors")
            _serves(c, "one", one)
            c.load("hf", base + "model.safetensors.index.json")
            _serves(c, "hf", dict(shards[0], **shards[1]))
            c.load("dir", base)  # a directory with an index: the index
            _serves(c, "dir", dict(shards[0], **shards[1]))
            with pytest.raises(weightd.Error) as e:
                c.load("nodir", base + "none/")  # without one: cannot be listed
            assert e.value.code == "INVALID_ARGUMENT", e.value
            assert "cannot be listed" in str(e.value), e.value
            with pytest.raises(weightd.Error) as e:
                c.load("x", "https://127.0.0.1:%d/other/model.safetensors" % port)
            assert e.value.code == "PERMISSION_DENIED", e.value
    finally:
        proc.terminate()
        proc.wait(10)


def test_s3_peft_adapter_dir_merges_as_peft(tmp_path, s3):
    g = torch.Generator().manual_seed(9)
    base = {"layers.0.q.weight": torch.randn(16, 8, generator=g),
            "emb.weight": torch.randn(10, 8, generator=g)}
    a, b = torch.randn(2, 8, generator=g), torch.randn(16, 2, generator=g)
    st_io.save(base, str(tmp_path / "base.safetensors"))
    st_io.save({"base_model.model.layers.0.q.lora_A.weight": a,
                "base_model.model.layers.0.q.lora_B.weight": b},
               str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    s3.put("ok/base/model.safetensors", str(tmp_path / "base.safetensors"))
    s3.put("ok/lora/adapter_model.safetensors", str(tmp_path / "adapter_model.safetensors"))
    s3.put("ok/lora/adapter_config.json", str(tmp_path / "adapter_config.json"))
    with _daemon(tmp_path / "d", s3) as d, weightd.Client(socket=d.socket) as c:
        c.load("m", "s3://%s/ok/base/" % BUCKET)
        c.load_adapter("l", "s3://%s/ok/lora/" % BUCKET)
        c.apply("m", [("l", 1.0)])
        with c.fetch("m", world=1, rank=0) as h:
            got = h.state_dict()
        want = base["layers.0.q.weight"] + (b @ a) * 2.0  # alpha / r
        assert torch.allclose(got["layers.0.q.weight"], want, rtol=1e-6, atol=1e-6)
        assert torch.equal(got["emb.weight"], base["emb.weight"])
        with pytest.raises(weightd.Error) as e:
            c.load_adapter("x", "s3://%s/elsewhere/lora/" % BUCKET)
        assert e.value.code == "PERMISSION_DENIED", e.value
        s = c.stats()
        assert s["source_requests"] > 0 and s["source_bytes"] > 0 and s["source_failures"] == 0


def test_restart_restores_the_same_versions_or_says_why(tmp_path, s3):
    one, two = _ref(11), _ref(12)
    st_io.save(one, str(tmp_path / "one.safetensors"))
    st_io.save(two, str(tmp_path / "two.safetensors"))
    s3.put("ok/r/keep.safetensors", str(tmp_path / "one.safetensors"))
    s3.put("ok/r/change.safetensors", str(tmp_path / "one.safetensors"))
    state = str(tmp_path / "state")
    with _daemon(tmp_path / "d1", s3, extra=["--state-dir", state]) as d, \
            weightd.Client(socket=d.socket) as c:
        c.load("keep", "s3://%s/ok/r/keep.safetensors" % BUCKET)
        c.load("change", "s3://%s/ok/r/change.safetensors" % BUCKET)
        d.proc.kill()
    journal = open(os.path.join(state, "journal"), "rb").read()
    assert journal.count(b'"objects":[{') == 2, journal
    s3.put("ok/r/change.safetensors", str(tmp_path / "two.safetensors"))  # a new ETag
    with _daemon(tmp_path / "d2", s3, extra=["--state-dir", state]) as d, \
            weightd.Client(socket=d.socket) as c:
        deadline = time.time() + 30
        while "restore_done" not in d.log() and time.time() < deadline:
            time.sleep(0.1)
        assert sorted(m.name for m in c.list()) == ["keep"]
        _serves(c, "keep", one)
        skipped = [json.loads(l) for l in open(os.path.join(state, "skipped.log"))]
        assert skipped[-1]["entry"].startswith('model load "change"'), skipped
        # Refused from the journaled ETag, before a byte of the new object was read.
        assert "changed since it was loaded (ETag" in skipped[-1]["reason"], skipped


def test_a_fleet_reads_an_object_store_checkpoint_once(tmp_path, s3):
    """Node a loads from S3; node b, whose peer a holds the same objects at
    the same ETags, takes the data from a: the object store sees headers and
    samples only (source_bytes far below the checkpoint's size)."""
    g = torch.Generator().manual_seed(21)
    ref = {"w%d" % i: torch.randn(512, 1024, generator=g) for i in range(4)}  # 8 MiB
    st_io.save(ref, str(tmp_path / "m.safetensors"))
    size = os.path.getsize(str(tmp_path / "m.safetensors"))
    s3.put("ok/fleet/model.safetensors", str(tmp_path / "m.safetensors"))
    tokens = tmp_path / "fleet.tokens"
    tokens.write_text("fleet fleet-token-0123456789abcdef\n")
    addr = "127.0.0.1:%d" % free_port()
    url = "s3://%s/ok/fleet/" % BUCKET
    a = _daemon(tmp_path / "a", s3, extra=["--listen", addr, "--auth-token-file", str(tokens),
                                           "--fleet-members", "token:fleet"])
    b = _daemon(tmp_path / "b", s3, extra=["--peers", addr, "--peer-token-file", str(tokens),
                                           "--peer-poll-seconds", "1"])
    with a, b, weightd.Client(socket=a.socket) as ca, weightd.Client(socket=b.socket) as cb:
        ca.load("m", url)
        assert ca.stats()["source_bytes"] >= size
        reports = []
        cb.load("m", url, source="peers", progress=reports.append)
        last = reports[-1]
        assert last.done and last.bytes_from_peers == last.bytes_total > 0, last
        s = cb.stats()
        assert s["source_bytes"] < size / 4, (s["source_bytes"], size)
        _serves(cb, "m", ref)
        assert ca.info("m").weights_id == cb.info("m").weights_id

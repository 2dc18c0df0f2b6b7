"""Daemon lifecycle: preload, health, SIGTERM shutdown (exit 0, sockets
unlinked), flag errors in the `error: CODE: message` form."""
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest
import torch

import harness
import st_io



def _fd_targets(pid):
    """What the process's fds point at now; an fd closed between the listing
    and its readlink is left out (the daemon keeps opening and closing)."""
    out = []
    for n in os.listdir("/proc/%d/fd" % pid):
        try:
            out.append(os.readlink("/proc/%d/fd/%s" % (pid, n)))
        except FileNotFoundError:
            pass
    return out

def _write_model(root):
    path = os.path.join(root, "m.safetensors")
    st_io.save({"w": torch.arange(12, dtype=torch.float32).reshape(4, 3)}, path)
    return path


def test_preload_serves_and_sigterm_exits_cleanly(tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    path = _write_model(str(root))
    d = harness.Daemon(model_root=str(root), workdir=str(tmp_path),
                       extra_args=["--preload", "pre=" + path])
    d.start()
    assert "pre\t" in d.ctl_ok("list").stdout
    out = tmp_path / "r1.safetensors"
    d.ctl_ok("fetch", "pre", "--world", "2", "--rank", "1", "--out", out)
    assert torch.equal(st_io.load(str(out))["w"], torch.arange(6, 12, dtype=torch.float32).reshape(2, 3))
    assert os.path.exists(d.socket) and os.path.exists(d.data_socket)
    rc = d.stop()
    assert rc == 0, d.log()
    assert not os.path.exists(d.socket)
    assert not os.path.exists(d.data_socket)
    assert "shutdown" in d.log() and "stopped" in d.log()


def test_health_fails_when_no_daemon(tmp_path):
    r = subprocess.run([harness.WEIGHTCTL, "--socket", str(tmp_path / "none.sock"), "health"],
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert r.stderr.startswith("error: UNAVAILABLE: ")


def _daemon_flags_error(tmp_path, *args):
    r = subprocess.run([harness.WEIGHTD] + list(args), capture_output=True, text=True, timeout=30)
    assert r.returncode != 0
    errors = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
    assert len(errors) == 1, r.stderr
    return errors[0]


def _preloaded_daemon(tmp_path, *flags, prefix=()):
    """A daemon (not started) serving _write_model's checkpoint as "m"."""
    root = tmp_path / "models"
    root.mkdir()
    path = _write_model(str(root))
    return harness.Daemon(model_root=str(root), workdir=str(tmp_path / "d"),
                          extra_args=["--preload", "m=" + path] + list(flags), prefix=prefix)


def test_bad_daemon_flags_are_invalid_argument(tmp_path):
    root = str(tmp_path)
    assert _daemon_flags_error(tmp_path, "--model-root", root).startswith(
        "error: INVALID_ARGUMENT: --socket is required")
    assert _daemon_flags_error(tmp_path, "--socket", str(tmp_path / "s"), "--model-root", root,
                               "--bogus").startswith("error: INVALID_ARGUMENT: unknown flag")
    assert _daemon_flags_error(tmp_path, "--socket", str(tmp_path / "s"), "--model-root",
                               str(tmp_path / "missing")).startswith("error: INVALID_ARGUMENT: --model-root")
    assert _daemon_flags_error(tmp_path, "--socket", str(tmp_path / "s"), "--model-root", root,
                               "--host-memory-bytes", "lots").startswith("error: INVALID_ARGUMENT: ")


def test_preload_failure_is_reported(tmp_path):
    line = _daemon_flags_error(tmp_path, "--socket", str(tmp_path / "s"), "--model-root", str(tmp_path),
                               "--preload", "x=/etc/passwd")
    assert line.startswith("error: PERMISSION_DENIED: "), line


def test_memory_budget_refuses_oversized_load(tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    path = os.path.join(str(root), "big.safetensors")
    st_io.save({"w": torch.zeros(1 << 20, dtype=torch.float32)}, path)  # 4 MiB
    small = _write_model(str(root))
    with harness.Daemon(model_root=str(root), workdir=str(tmp_path / "d"),
                        extra_args=["--host-memory-bytes", str(1 << 20)]) as d:
        r = d.ctl("load", "big", path)
        assert r.error_code == "RESOURCE_EXHAUSTED", r.stderr
        assert "big" not in d.ctl_ok("list").stdout
        d.ctl_ok("load", "small", small)
        # one page of data + the metadata of tensor "w" [4, 3] (docs/limits.md)
        assert "bytes_resident: %d\n" % (4096 + 1024 + 24 * 1 + 16 * 2) in d.ctl_ok("stats").stdout


def test_tensor_metadata_counts_against_the_memory_budget(tmp_path):
    """A small file of very many tensors is refused RESOURCE_EXHAUSTED when
    their bookkeeping does not fit the budget (about 1 KiB each), though its
    bytes would (F14); the daemon keeps serving."""
    import struct
    root = tmp_path / "models"
    root.mkdir()
    n = 20000
    header = {"t%05d" % i: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
              for i in range(n)}
    blob = json.dumps(header).encode()
    path = os.path.join(str(root), "many.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + b"\0" * (4 * n))   # 80 KB of data
    small = _write_model(str(root))
    with harness.Daemon(model_root=str(root), workdir=str(tmp_path / "d"),
                        extra_args=["--host-memory-bytes", str(16 << 20)]) as d:
        r = d.ctl("load", "many", path)
        assert r.error_code == "RESOURCE_EXHAUSTED", r.stderr
        assert "metadata of 20000 tensors" in r.error_message, r.error_message
        assert "many" not in d.ctl_ok("list").stdout
        assert "bytes_resident: 0\n" in d.ctl_ok("stats").stdout
        d.ctl_ok("load", "small", small)


def test_flags_from_environment_and_config_file(tmp_path):
    """Every flag also comes from WEIGHTD_<FLAG> and a config file; the
    command line wins over the environment, which wins over the file."""
    root = tmp_path / "models"
    root.mkdir()
    path = _write_model(str(root))
    conf = tmp_path / "weightd.conf"
    conf.write_text("# weightd config\nsocket = %s\nmodel-root = %s\nlog-format = text\n"
                    "preload = fromfile=%s\n" % (tmp_path / "file.sock", root, path))
    env = dict(os.environ, WEIGHTD_CONFIG=str(conf), WEIGHTD_LOG_FORMAT="json",
               WEIGHTD_SOCKET=str(tmp_path / "env.sock"))
    proc = subprocess.Popen([harness.WEIGHTD, "--threads", "1"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        sock = tmp_path / "env.sock"
        for _ in range(200):
            if sock.exists():
                break
            time.sleep(0.05)
        r = subprocess.run([harness.WEIGHTCTL, "--socket", str(sock), "list"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("fromfile\t")
        assert not (tmp_path / "file.sock").exists()
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    lines = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    config = [l for l in lines if l.get("event") == "config"]
    assert config and "--socket %s" % (tmp_path / "env.sock") in config[0]["args"]
    assert any(l.get("event") == "load" and l.get("model") == "fromfile" for l in lines)
    bad = tmp_path / "bad.conf"
    bad.write_text("colour = blue\n")
    r = subprocess.run([harness.WEIGHTD, "--config", str(bad)], capture_output=True, text=True)
    assert r.returncode != 0 and 'error: INVALID_ARGUMENT: config %s: unknown flag "colour"' % bad in r.stderr


def test_metrics_endpoint_counts_the_work(tmp_path):
    port = harness.free_port()
    root = tmp_path / "models"
    root.mkdir()
    path = _write_model(str(root))
    with harness.Daemon(model_root=str(root), workdir=str(tmp_path / "d"),
                        extra_args=["--metrics-listen", "127.0.0.1:%d" % port]) as d:
        def scrape():
            return harness.scrape_metrics(port)
        m0 = scrape()
        assert m0["weightd_models"] == 0
        d.ctl_ok("load", "m", path)
        for r in range(2):
            d.ctl_ok("fetch", "m", "--world", "2", "--rank", r, "--out", tmp_path / "o.st")
        d.ctl_ok("fetch", "m", "--dtype", "bf16", "--transport", "grpc", "--out", tmp_path / "o.st")
        d.ctl("fetch", "nope", "--out", tmp_path / "o.st")
        m1 = scrape()
        assert m1["weightd_models"] == 1
        assert m1["weightd_loads_total"] == 1 and m1["weightd_load_bytes_total"] == 48
        assert m1["weightd_fetches_total"] == 3
        assert m1["weightd_fetch_errors_total"] == 1
        assert m1["weightd_served_bytes_total"] == 24 + 24 + 24
        assert m1['weightd_fetch_duration_seconds_count{transport="shm"}'] == 2
        assert m1['weightd_fetch_duration_seconds_count{transport="grpc"}'] == 1
        assert m1["weightd_resident_bytes"] > m0["weightd_resident_bytes"]
        assert m1["weightd_materialization_cache_misses_total"] >= 3
        assert m1["weightd_leases_open"] == 0
        # a push into the client's own memory: counted, its lease gone
        assert m1["weightd_pushes_total"] == 0
        d.ctl_ok("fetch", "m", "--world", "2", "--rank", 1, "--transport", "push",
                 "--out", tmp_path / "o.st")
        m2 = scrape()
        assert m2["weightd_pushes_total"] == 1 and m2["weightd_push_bytes_total"] == 24
        assert m2["weightd_fetches_total"] == 4 and m2["weightd_leases_open"] == 0
        gpus = dict(l.split(": ", 1) for l in d.ctl_ok("stats").stdout.splitlines())["gpus"]
        assert m2["weightd_gpus"] == int(gpus)


def test_idle_connections_do_not_stop_metrics(tmp_path):
    """300 idle TCP connections to --metrics-listen (none sends a request;
    prometheus-cpp's civetweb gave each a worker until ~224 stopped /metrics)
    cost the daemon at most an fd each, up to its cap: every connect is
    accepted, /metrics answers while they are open, the oldest idle ones are
    closed for newer ones; bad requests get their status and the server
    serves on."""
    import socket
    port = harness.free_port()
    root = tmp_path / "models"
    root.mkdir()
    with harness.Daemon(model_root=str(root), workdir=str(tmp_path / "d"),
                        extra_args=["--metrics-listen", "127.0.0.1:%d" % port]) as d:
        assert harness.scrape_metrics(port)["weightd_models"] == 0
        idle = []
        try:
            for _ in range(300):
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            t = time.monotonic()
            m = harness.scrape_metrics(port)  # 5 s timeout
            assert m["weightd_models"] == 0 and time.monotonic() - t < 5
            # The daemon keeps at most its cap of them (64), not 300.
            sockets = sum(1 for t in _fd_targets(d.proc.pid) if t.startswith("socket:"))
            assert sockets < 100, sockets
            idle[0].settimeout(5)
            assert idle[0].recv(1) == b""  # the oldest was closed for a newer one

            def ask(raw):
                with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                    s.sendall(raw)
                    out = b""
                    while chunk := s.recv(65536):
                        out += chunk
                    return out
            assert ask(b"POST /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405 ")
            assert ask(b"GET /nope HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404 ")
            assert ask(b"garbage\r\n\r\n").startswith(b"HTTP/1.1 400 ")
            assert ask(b"GET /metrics HTTP/1.1\r\nX: " + b"y" * 20000).startswith(b"HTTP/1.1 431 ")
            head = ask(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n"), head
            assert b"text/plain; version=0.0.4" in head
        finally:
            for s in idle:
                s.close()
        assert harness.scrape_metrics(port)["weightd_models"] == 0
        assert d.alive()


def _cpu_seconds(pid):
    fields = open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_metrics_out_of_fds_neither_spins_nor_stops_scrapes(tmp_path):
    """With the daemon out of fds, a connection waiting in the metrics
    listener's backlog keeps it readable: the server must not spin on
    accept (EMFILE) but back off, and an idle connection it holds gives its
    fd to a scraper."""
    import resource
    import socket
    port = harness.free_port()
    root = tmp_path / "models"
    root.mkdir()
    with harness.Daemon(model_root=str(root), workdir=str(tmp_path / "d"),
                        extra_args=["--metrics-listen", "127.0.0.1:%d" % port]) as d:
        pid = d.proc.pid
        assert harness.scrape_metrics(port)["weightd_models"] == 0
        soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        held = []
        try:
            time.sleep(0.5)  # the scrape's connection is closed
            # No fd left: the limit is one past the highest fd it holds.
            fds = [int(n) for n in os.listdir("/proc/%d/fd" % pid)]
            assert sorted(fds) == list(range(len(fds)))
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (len(fds), hard))
            for _ in range(8):  # stay in the backlog: nothing to accept them with
                held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            time.sleep(0.5)
            assert "metrics accept: Too many open files" in d.log()
            before = _cpu_seconds(pid)
            time.sleep(2)
            spent = _cpu_seconds(pid) - before
            assert spent < 0.25, "the daemon spent %.2f s of CPU in 2 s idle" % spent
            # One fd more: the idle connections take it in turn, each giving
            # it up after a back-off, until the scraper's turn (5 s timeout).
            resource.prlimit(pid, resource.RLIMIT_NOFILE,
                             (len(os.listdir("/proc/%d/fd" % pid)) + 1, hard))
            assert harness.scrape_metrics(port)["weightd_models"] == 0
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
            for s in held:
                s.close()
        assert harness.scrape_metrics(port)["weightd_models"] == 0
        assert d.alive()


def test_structured_json_log_has_one_line_per_event(tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    path = _write_model(str(root))
    d = harness.Daemon(model_root=str(root), workdir=str(tmp_path / "d"),
                       extra_args=["--log-format", "json", "--log-level", "debug"])
    d.start()
    d.ctl_ok("load", "m", path)
    d.ctl_ok("fetch", "m", "--out", tmp_path / "o.st")
    d.ctl_ok("fetch", "m", "--transport", "grpc", "--out", tmp_path / "o.st")
    assert d.stop() == 0
    events = [json.loads(l) for l in d_log_lines(tmp_path / "d" / "weightd.log")]
    kinds = [e.get("event") for e in events]
    assert kinds.count("load") == 1 and kinds.count("lease_grant") == 2
    assert "lease_release" in kinds  # weightctl releases each lease when done
    grant = next(e for e in events if e.get("event") == "lease_grant")
    assert grant["model"] == "m" and grant["generation"] == "1" and grant["tensors"] == "1"
    assert all("ts" in e and "level" in e for e in events)


def d_log_lines(path):
    with open(path) as f:
        return [l for l in f.read().splitlines() if l.startswith("{")]


def test_verify_recomputes_digests(tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    path = _write_model(str(root))
    with harness.Daemon(model_root=str(root), workdir=str(tmp_path / "d")) as d:
        d.ctl_ok("load", "m", path)
        out = d.ctl_ok("verify", "m").stdout
        assert out.startswith("verified m: 1 tensors, 48.0 B match the digests recorded at "
                              "load (memory checked, not storage)"), out
        assert d.ctl("verify", "nope").error_code == "NOT_FOUND"


def _exit_seconds(d):
    t = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    rc = d.proc.wait(timeout=30)
    return rc, time.monotonic() - t


def test_sigterm_with_idle_clients_exits_at_once(tmp_path):
    """Idle client connections (a Python channel that made one call, an open
    watch) do not hold the exit: the watch ends UNAVAILABLE, the daemon exits
    0 well inside the grace (gRPC alone waits ~5 s for idle Python channels)."""
    import grpc
    import weightd
    from weightd.v1 import weightd_pb2 as pb, weightd_pb2_grpc as pbg
    d = _preloaded_daemon(tmp_path)
    d.start()
    idle = weightd.Client(d.socket, retry_deadline=0)
    assert [m.name for m in idle.list()] == ["m"]
    watch_channel = grpc.insecure_channel("unix:" + d.socket)
    watch = pbg.ShardsStub(watch_channel).Watch(pb.WatchRequest(model="m", include_current=True))
    assert next(watch).model == "m"
    rc, took = _exit_seconds(d)
    assert rc == 0, d.log()
    assert took < 2.0, (took, d.log())
    with pytest.raises(grpc.RpcError) as e:
        next(watch)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
    assert "shutting down" in e.value.details()
    d.stop()


def test_draining_daemon_answers_new_calls_unavailable(tmp_path):
    """While a call is in flight (a grpc Read its client does not consume),
    a SIGTERMed daemon says NOT_SERVING and answers new calls on the open
    connection UNAVAILABLE; when --shutdown-grace-seconds runs out it cancels
    the call, logs it and exits 0."""
    import grpc
    from weightd.v1 import weightd_pb2 as pb, weightd_pb2_grpc as pbg
    root = tmp_path / "models"
    root.mkdir()
    path = os.path.join(str(root), "big.safetensors")
    st_io.save({"w": torch.zeros(16 << 20, dtype=torch.float32)}, path)  # 64 MiB
    d = harness.Daemon(model_root=str(root), workdir=str(tmp_path / "d"),
                       extra_args=["--preload", "big=" + path, "--shutdown-grace-seconds", "3"])
    d.start()
    channel = grpc.insecure_channel("unix:" + d.socket,
                                    options=[("grpc.max_receive_message_length", 64 << 20)])
    shards = pbg.ShardsStub(channel)
    models = pbg.ModelsStub(channel)
    f = shards.Fetch(pb.FetchRequest(model="big", transport=pb.GRPC))
    read = shards.Read(pb.ReadRequest(lease_id=f.lease_id, token=f.token, segment=0,
                                      offset=0, length=f.segment_sizes[0]))
    assert len(next(read).data) > 0  # the rest waits on flow control
    t = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    health = channel.unary_unary("/grpc.health.v1.Health/Check",
                                 request_serializer=lambda _: b"",
                                 response_deserializer=lambda b: b)
    deadline = time.monotonic() + 2
    while health(None, timeout=2) != b"\x08\x02":  # status: NOT_SERVING
        assert time.monotonic() < deadline, "health still SERVING after SIGTERM"
        time.sleep(0.02)
    for call in (lambda: models.List(pb.ListModelsRequest(), timeout=2),
                 lambda: shards.Fetch(pb.FetchRequest(model="big"), timeout=2)):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
        assert "shutting down" in e.value.details(), e.value.details()
    assert d.alive(), "exited before the grace ran out"
    rc = d.proc.wait(timeout=30)
    took = time.monotonic() - t
    assert rc == 0, d.log()
    assert 2.5 < took < (12 if harness.SANITIZE else 6), took
    assert "shutdown_grace_expired" in d.log() and "calls_in_flight=1" in d.log(), d.log()
    d.stop()


# ------------------------------------------------------------ node limits
# One client (or one uid) must not stall or starve the node: issue 16 F3,
# F4 and F9.


def _hostile_attach_flood(data_socket, limit=200000):
    """Connects to the data socket and sends attach requests (for a lease that
    does not exist) until the daemon stops taking them, never reading a
    reply. Returns the socket, left open, and how many requests went out."""
    import socket
    import struct
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(data_socket)
    s.setblocking(False)
    batch = b"".join(struct.pack("<4sIQ16s", b"WDA1", 0, 0xdead0000 + i, b"\0" * 16)
                     for i in range(64))
    sent = 0
    while sent < limit * 32:
        try:
            n = s.send(batch)
        except BlockingIOError:
            break
        sent += n
        if n < len(batch):
            break
    return s, sent // 32


def test_a_data_client_that_never_reads_stalls_nobody(tmp_path):
    """A data-socket client that sends thousands of attach requests and reads
    no reply holds only its own connection: another client's shm fetch gets
    its fds, and SIGTERM exits within the grace."""
    d = _preloaded_daemon(tmp_path, "--shutdown-grace-seconds", "5")
    d.start()
    hostile, sent = _hostile_attach_flood(d.data_socket)
    try:
        assert sent > 500, sent
        out = tmp_path / "m.safetensors"
        try:
            r = d.ctl("fetch", "m", "--out", out, timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail("an shm fetch hung behind a client that does not read")
        assert r.returncode == 0, r.stderr
        assert torch.equal(st_io.load(str(out))["w"],
                           torch.arange(12, dtype=torch.float32).reshape(4, 3))
        rc, took = _exit_seconds(d)
        assert rc == 0, d.log()
        assert took < 5, took
    finally:
        hostile.close()
        d.stop()


LIMITED_UID = 4242   # the daemon's uid under RLIMIT_NPROC, which does not bind root


def _open_dir(path):
    """A directory that another uid can use."""
    os.makedirs(path, exist_ok=True)
    os.chmod(path, 0o777)
    return path


@pytest.fixture
def open_tmp():
    """A temporary directory that another uid can reach (tmp_path's parents
    are root's alone)."""
    path = _open_dir(tempfile.mkdtemp(prefix="weightd-limits-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _wait_for(cond, what, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _cpu_seconds(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _watch(stub, model="m", timeout=30):
    """A Watch stream and its first event or error: ("ok", stream) or
    (code name, details)."""
    import grpc
    from weightd.v1 import weightd_pb2 as pb
    stream = stub.Watch(pb.WatchRequest(model=model, include_current=True), timeout=timeout)
    try:
        next(stream)
        return "ok", stream
    except grpc.RpcError as e:
        return e.code().name, e.details()


def test_watch_streams_are_capped_and_the_excess_refused(tmp_path):
    """--max-watch-streams: the stream past the cap gets RESOURCE_EXHAUSTED
    naming the flag; a stream that ends gives its slot back; SIGTERM exits at
    once."""
    import grpc
    from weightd.v1 import weightd_pb2_grpc as pbg
    d = _preloaded_daemon(tmp_path, "--max-watch-streams", "4")
    d.start()
    channel = grpc.insecure_channel("unix:" + d.socket)
    try:
        stub = pbg.ShardsStub(channel)
        open_ = [_watch(stub) for _ in range(4)]
        assert [r[0] for r in open_] == ["ok"] * 4, open_
        code, details = _watch(stub)
        assert code == "RESOURCE_EXHAUSTED", (code, details)
        assert "4 Watch streams are open" in details, details
        assert "--max-watch-streams" in details, details
        open_[0][1].cancel()
        # The cancelled stream's thread notices within its 500 ms wait.
        deadline = time.monotonic() + 10
        while True:
            code, got = _watch(stub)
            if code == "ok":
                break
            assert code == "RESOURCE_EXHAUSTED" and time.monotonic() < deadline, (code, got)
            time.sleep(0.1)
        d.ctl_ok("health")
        rc, took = _exit_seconds(d)
        assert rc == 0, d.log()
        assert took < 3, took
    finally:
        channel.close()
        d.stop()


# Holds argv[2] Watch streams of model "m" on socket argv[1], each past its
# first event, says "ready" and sleeps (to be killed).
_WATCHER = r"""
import sys, time, grpc
from weightd.v1 import weightd_pb2 as pb, weightd_pb2_grpc as pbg
stub = pbg.ShardsStub(grpc.insecure_channel("unix:" + sys.argv[1]))
streams = [stub.Watch(pb.WatchRequest(model="m", include_current=True))
           for _ in range(int(sys.argv[2]))]
for s in streams:
    next(s)
print("ready", flush=True)
time.sleep(600)
"""


def _fds(pid):
    return sorted(_fd_targets(pid))


def test_cancelled_watch_streams_leave_no_fds_or_threads_behind(tmp_path):
    """Floods of Watch streams that their clients cancel (before the first
    event, after it, several at once on one channel, a channel per stream,
    and the client process killed) leave the daemon's fds and threads where
    they were: the baseline is taken after one warm-up flood (gRPC's own
    steady-state fds and pool threads)."""
    import grpc
    import signal as sig
    from weightd.v1 import weightd_pb2 as pb, weightd_pb2_grpc as pbg
    d = _preloaded_daemon(tmp_path)
    d.start()
    env = dict(os.environ, PYTHONPATH=os.path.join(harness.BUILD, "python"))

    def flood():
        ch = grpc.insecure_channel("unix:" + d.socket)
        stub = pbg.ShardsStub(ch)
        held = []
        for i in range(40):
            s = stub.Watch(pb.WatchRequest(model="m", include_current=True), timeout=30)
            if i % 2:
                next(s)
            if i % 4 == 3:
                held.append(s)  # cancelled together below
            else:
                s.cancel()
        for i in range(10):
            with grpc.insecure_channel("unix:" + d.socket) as own:
                s = pbg.ShardsStub(own).Watch(pb.WatchRequest(model="m", include_current=True))
                next(s)
                s.cancel()
        for s in held:
            s.cancel()
        ch.close()
        killed = subprocess.Popen(["/usr/bin/python3", "-c", _WATCHER, d.socket, "10"],
                                  stdout=subprocess.PIPE, text=True, env=env)
        assert killed.stdout.readline().strip() == "ready"
        killed.send_signal(sig.SIGKILL)
        killed.wait(timeout=10)

    def settled(fds, threads):
        # (gRPC's pool may grow a thread or two under a flood: not ours.)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if len(_fds(d.proc.pid)) <= len(fds) and _thread_count(d) <= threads + 2:
                return True
            time.sleep(0.1)
        return False

    try:
        flood()
        time.sleep(1)  # the cancelled watches' threads notice within 500 ms
        fds, threads = _fds(d.proc.pid), _thread_count(d)
        for _ in range(3):  # 180 watches in all
            flood()
            assert settled(fds, threads), ("\n".join(fds), "\n".join(_fds(d.proc.pid)),
                                           threads, _thread_count(d))
        d.ctl_ok("health")
    finally:
        d.stop()


def _thread_count(d):
    with open("/proc/%d/status" % d.proc.pid) as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise AssertionError("no Threads line for the daemon")


def test_at_the_thread_limit_the_daemon_refuses_and_serves_on(open_tmp):
    """Under RLIMIT_NPROC (a pids cgroup or TasksMax does the same) watches
    past what the system lets the daemon start get RESOURCE_EXHAUSTED, never
    an abort; fetches that want several materialization threads still work
    (on fewer), and SIGTERM exits within the grace."""
    import grpc
    from weightd.v1 import weightd_pb2_grpc as pbg
    base = open_tmp
    models = _open_dir(os.path.join(base, "models"))
    path = os.path.join(models, "m.safetensors")
    st_io.save({"t%d" % i: torch.full((64, 64), float(i)) for i in range(8)}, path)
    os.chmod(path, 0o644)
    d = harness.Daemon(model_root=models, workdir=_open_dir(os.path.join(base, "d")),
                       extra_args=["--preload", "m=" + path, "--threads", "2",
                                   "--shutdown-grace-seconds", "5"],
                       prefix=harness.user_prefix(LIMITED_UID) + ["prlimit", "--nproc=40", "--"])
    d.start()
    channel = grpc.insecure_channel("unix:" + d.socket)
    try:
        stub = pbg.ShardsStub(channel)
        d.ctl_ok("health")
        baseline_threads = _thread_count(d)
        # Watches until a few are refused (each holds a thread; about ten fit
        # under the limit). A watch gRPC itself cannot serve for want of a
        # thread runs into its deadline: short, so that such a run stays
        # bounded; it is gRPC's starvation, not an abort, and not ours to
        # answer.
        results = []
        while len(results) < 48 and sum(r[0] == "RESOURCE_EXHAUSTED" for r in results) < 3:
            results.append(_watch(stub, timeout=5))
        codes = [r[0] for r in results]
        assert d.alive(), d.log()
        refused = [r for r in results if r[0] == "RESOURCE_EXHAUSTED"]
        assert refused and "ok" in codes, codes
        assert set(codes) <= {"ok", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}, results
        assert all("thread limit" in details for _, details in refused), refused
        for code, stream in results:  # give the watchers' threads back
            if code == "ok":
                stream.cancel()
        # Each cancelled watch's thread notices within its 500 ms wait; until
        # the threads are gone the system still refuses new ones, and gRPC,
        # short of threads, may not even answer a new connection's handshake
        # (seen on a loaded CI machine). Serving on means: once the watchers
        # are gone, fetches work again, with nothing lost. So wait for the
        # daemon's thread count to fall back, then fetch, retrying a refused
        # connection for a bounded time.
        # (gRPC's own pool may keep a few threads it grew, so the wait is
        # bounded and not asserted; the fetch below is.)
        settle = time.monotonic() + 10
        while _thread_count(d) > baseline_threads + 2 and time.monotonic() < settle:
            time.sleep(0.1)
        deadline = time.monotonic() + 60
        out = os.path.join(base, "f.safetensors")
        while True:
            try:
                r = d.ctl("fetch", "m", "--world", "2", "--rank", "1", "--out", out, timeout=20)
            except subprocess.TimeoutExpired:
                # gRPC short of threads may accept a call and never run it
                # (seen once in CI: weightctl, which sets no deadline, waited
                # 120 s): a starved attempt, retried like the others.
                assert time.monotonic() < deadline, "no fetch answered in 60 s\n" + d.log()
                continue
            if r.returncode == 0 or time.monotonic() > deadline:
                break
            # gRPC short of threads: the handshake times out (UNAVAILABLE) or
            # the call its deadline (DEADLINE_EXCEEDED); both are retried.
            assert "UNAVAILABLE" in r.stderr or "DEADLINE_EXCEEDED" in r.stderr, \
                r.stderr + d.log()
            time.sleep(0.5)
        assert r.returncode == 0, r.stderr + d.log()
        assert torch.equal(st_io.load(out)["t3"], torch.full((32, 64), 3.0))
        if harness.SANITIZE == "thread":
            # A teardown stuck at the thread limit ends by SIGALRM, and TSan
            # defers asynchronous signal handlers to points it controls, which
            # a thread-starved teardown may not reach in time: the exit bound
            # is checked in the other builds (under TSan it failed the same
            # way before this stop's changes).
            return
        rc, took = _exit_seconds(d)
        assert rc == 0, d.log()
        # Usually at once; gRPC starved of threads may leave a call it never
        # completes, and then the teardown ends 2 s after the grace (seen:
        # 7.0 s); 3 s more for a loaded machine.
        assert took < 5 + 2 + 3, took
    finally:
        channel.close()
        d.stop()


OTHER_UID = 1234

# Run as another uid: opens argv[2] connections to the data socket argv[1]
# and sends nothing. Prints how many the daemon answered at once (a refusal:
# reply then EOF) and their messages as JSON, then holds the rest open until
# its stdin closes.
_IDLE_CONNECTIONS = r"""
import json, select, socket, struct, sys, time
conns = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    conns.append(s)
want, refused, deadline = int(sys.argv[3]), [], time.monotonic() + 20
while len(refused) < want and time.monotonic() < deadline:
    ready, _, _ = select.select([c for c in conns if c not in refused], [], [], 0.5)
    for c in ready:
        head = c.recv(16)
        magic, code, nfds, mlen = struct.unpack("<4siII", head)
        msg = c.recv(mlen).decode() if mlen else ""
        refused.append(c)
        print(json.dumps({"code": code, "message": msg}), flush=True)
print("held %d" % (len(conns) - len(refused)), flush=True)
sys.stdin.read()
"""


def test_data_connections_are_capped_per_uid_and_in_all(open_tmp):
    """--max-data-connections-per-uid: one uid's idle connections past its cap
    are answered RESOURCE_EXHAUSTED and closed, and another uid still fetches;
    --max-data-connections: past the total even that uid is refused, until
    idle connections close."""
    import socket
    models = _open_dir(os.path.join(open_tmp, "models"))
    path = _write_model(models)
    os.chmod(path, 0o644)
    d = harness.Daemon(model_root=models, workdir=_open_dir(os.path.join(open_tmp, "d")),
                       extra_args=["--preload", "m=" + path, "--socket-mode", "0666",
                                   "--max-data-connections", "8",
                                   "--max-data-connections-per-uid", "4"])
    d.start()
    hog = subprocess.Popen(harness.user_prefix(OTHER_UID) +
                           ["/usr/bin/python3", "-c", _IDLE_CONNECTIONS, d.data_socket, "10", "6"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    mine = []
    try:
        lines = [hog.stdout.readline() for _ in range(7)]
        assert lines[-1].strip() == "held 4", lines
        for line in lines[:-1]:
            reply = json.loads(line)
            assert reply["code"] == 8, reply   # RESOURCE_EXHAUSTED
            assert "uid 1234 has 4 data connections open" in reply["message"], reply
            assert "--max-data-connections-per-uid" in reply["message"], reply
        out = os.path.join(open_tmp, "a.safetensors")
        d.ctl_ok("fetch", "m", "--out", out)   # root: a uid of its own
        for _ in range(4):   # 4 + 4: the total cap
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(d.data_socket)
            mine.append(s)
        r = d.ctl("fetch", "m", "--out", out)
        assert r.returncode != 0
        assert r.error_code == "RESOURCE_EXHAUSTED", r.stderr
        assert "--max-data-connections" in r.error_message, r.stderr
        for s in mine:
            s.close()
        # The daemon sees the closes in its own time: retry until it has.
        deadline = time.monotonic() + 10
        while (r := d.ctl("fetch", "m", "--out", out)).returncode != 0:
            assert r.error_code == "RESOURCE_EXHAUSTED" and time.monotonic() < deadline, r.stderr
            time.sleep(0.05)
        assert torch.equal(st_io.load(out)["w"], torch.arange(12, dtype=torch.float32).reshape(4, 3))
        rc, took = _exit_seconds(d)
        assert rc == 0, d.log()
        assert took < 3, took
    finally:
        for s in mine:
            s.close()
        hog.stdin.close()
        hog.wait(timeout=10)
        d.stop()


def test_accept_backs_off_at_the_fd_limit(tmp_path):
    """With caps above the open-file limit, idle connections drive accept()
    into EMFILE: the daemon backs off instead of spinning on it, serves again
    once they close, and exits on SIGTERM."""
    import socket
    d = _preloaded_daemon(tmp_path, "--max-data-connections", "100000",
                          "--max-data-connections-per-uid", "100000",
                          prefix=["prlimit", "--nofile=64", "--"])
    d.start()
    idle = []
    try:
        fd_dir = "/proc/%d/fd" % d.proc.pid
        for _ in range(100):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(d.data_socket)
            idle.append(s)
        _wait_for(lambda: len(os.listdir(fd_dir)) >= 63, "the daemon never ran out of fds")
        _wait_for(lambda: "data_accept_failed" in d.log(), "no data_accept_failed event")
        before = _cpu_seconds(d.proc.pid)
        time.sleep(1.0)   # a measurement window, not a synchronisation
        spent = _cpu_seconds(d.proc.pid) - before
        assert spent < 0.3, "the daemon spins at the fd limit: %.2f s CPU in 1 s" % spent
        for s in idle:
            s.close()
        idle = []
        out = tmp_path / "m.safetensors"
        deadline = time.monotonic() + 15
        while (r := d.ctl("fetch", "m", "--out", out, timeout=30)).returncode != 0:
            assert time.monotonic() < deadline, r.stderr
            time.sleep(0.1)
        assert torch.equal(st_io.load(str(out))["w"],
                           torch.arange(12, dtype=torch.float32).reshape(4, 3))
        rc, took = _exit_seconds(d)
        assert rc == 0, d.log()
        assert took < 5, took
    finally:
        for s in idle:
            s.close()
        d.stop()


def _unblock_fifos(paths):
    """Opens each FIFO for writing and closes it: a reader stuck in open()
    (the bug under test) gets EOF, so a failing test does not hang."""
    for p in paths:
        try:
            os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass


def test_fifo_files_are_refused_at_once_and_do_not_hold_shutdown(tmp_path):
    """A FIFO where a file should be (an adapter_config.json, a shard of a
    model directory) is refused at once with INVALID_ARGUMENT naming it,
    however many such loads run together; the name is free again, other
    calls are served and SIGTERM exits promptly (F7)."""
    import threading
    root = tmp_path / "models"
    root.mkdir()
    good = _write_model(str(root))
    adapter = root / "fifo_adapter"
    adapter.mkdir()
    st_io.save({"base_model.model.w.lora_A.weight": torch.ones(2, 3),
                "base_model.model.w.lora_B.weight": torch.ones(4, 2)},
               str(adapter / "adapter_model.safetensors"))
    model = root / "fifo_model"
    model.mkdir()
    st_io.save({"a": torch.ones(4)}, str(model / "a.safetensors"))
    fifos = [str(adapter / "adapter_config.json"), str(model / "b.safetensors")]
    for f in fifos:
        os.mkfifo(f)
    d = harness.Daemon(model_root=str(root), workdir=str(tmp_path / "d"),
                       extra_args=["--preload", "m=" + good, "--threads", "2"])
    d.start()
    try:
        results = {}

        def run(key, *args):
            try:
                results[key] = d.ctl(*args, timeout=15)
            except subprocess.TimeoutExpired:
                results[key] = None

        calls = [("adapter%d" % i, ("adapter", "load", "fifo%d" % i, str(adapter)))
                 for i in range(6)] + [("model", ("load", "fifo_model", str(model)))]
        threads = [threading.Thread(target=run, args=(k,) + a) for k, a in calls]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for key, _ in calls:
            r = results[key]
            assert r is not None, "%s hung on a FIFO; log:\n%s" % (key, d.log()[-2000:])
            assert r.error_code == "INVALID_ARGUMENT", (key, r.stderr)
            assert "FIFO" in r.error_message, r.error_message
        assert "adapter_config.json" in results["adapter0"].error_message
        assert "b.safetensors" in results["model"].error_message
        # Still serving; the model's name was given back.
        d.ctl_ok("info", "m")
        d.ctl_ok("verify", "m")
        d.ctl_ok("fetch", "m", "--world", "2", "--rank", "0", "--out", str(tmp_path / "f.st"))
        assert "fifo_model" not in d.ctl_ok("list").stdout
        os.unlink(str(model / "b.safetensors"))
        st_io.save({"b": torch.ones(4)}, str(model / "b.safetensors"))
        d.ctl_ok("load", "fifo_model", str(model))
        rc, took = _exit_seconds(d)
        assert rc == 0, d.log()
        assert took < 5.0, (took, d.log()[-2000:])
    finally:
        _unblock_fifos(fifos)
        d.stop()


def test_a_second_daemon_on_live_sockets_refuses_to_start(tmp_path):
    """A second daemon started on the sockets of a live one exits non-zero
    with FAILED_PRECONDITION and leaves them alone (the first keeps serving);
    the socket files of a dead daemon are still replaced (F13)."""
    d = _preloaded_daemon(tmp_path)
    d.start()
    try:
        for args in (["--socket", d.socket],
                     ["--socket", d.socket, "--data-socket", str(tmp_path / "other.data")],
                     ["--socket", str(tmp_path / "other.sock"), "--data-socket", d.data_socket]):
            second = subprocess.Popen([harness.WEIGHTD, "--model-root", d.model_root] + args,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                _, err = second.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                second.kill()
                second.communicate()
                pytest.fail("a second daemon started on the sockets of a live one: %s" % args)
            assert second.returncode != 0
            errors = [l for l in err.splitlines() if l.startswith("error: ")]
            assert len(errors) == 1, err
            assert errors[0].startswith("error: FAILED_PRECONDITION: "), errors[0]
            assert "already" in errors[0], errors[0]
            # The first daemon still owns and serves both sockets.
            assert os.path.exists(d.socket) and os.path.exists(d.data_socket)
            d.ctl_ok("fetch", "m", "--out", str(tmp_path / "f.st"))
        assert not os.path.exists(str(tmp_path / "other.sock"))
        assert not os.path.exists(str(tmp_path / "other.data"))
        # A daemon killed outright leaves its socket files behind: they are
        # stale, and a new daemon replaces them.
        d.proc.kill()
        d.proc.wait()
        assert os.path.exists(d.socket) and os.path.exists(d.data_socket)
        d2 = harness.Daemon(model_root=d.model_root, workdir=d.workdir, extra_args=d.extra_args)
        d2.start()
        d2.ctl_ok("fetch", "m", "--out", str(tmp_path / "f2.st"))
        assert d2.stop() == 0
    finally:
        d.stop()


def test_adapters_count_against_the_memory_budget(tmp_path):
    """An adapter's fp32 factors are charged to --host-memory-bytes while it
    lives: three 24 MiB adapters under a 64 MiB budget, the third is
    RESOURCE_EXHAUSTED before it is read; unloading one makes room (F11)."""
    root = tmp_path / "models"
    root.mkdir()
    for i in range(3):
        a = root / ("a%d" % i)
        a.mkdir()
        # lora_A [1536, 2048] + lora_B [2048, 1536] fp32 = 24 MiB
        st_io.save({"base_model.model.w.lora_A.weight": torch.zeros(1536, 2048),
                    "base_model.model.w.lora_B.weight": torch.zeros(2048, 1536)},
                   str(a / "adapter_model.safetensors"))
        with open(str(a / "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": 1536, "lora_alpha": 1536}, f)
    with harness.Daemon(model_root=str(root), workdir=str(tmp_path / "d"),
                        extra_args=["--host-memory-bytes", str(64 << 20)]) as d:
        d.ctl_ok("adapter", "load", "a0", str(root / "a0"))
        d.ctl_ok("adapter", "load", "a1", str(root / "a1"))
        stats = d.ctl_ok("stats").stdout
        assert "bytes_resident: %d\n" % (48 << 20) in stats, stats
        r = d.ctl("adapter", "load", "a2", str(root / "a2"))
        assert r.error_code == "RESOURCE_EXHAUSTED", r.stderr
        assert "a2" in r.error_message, r.error_message
        assert "a2" not in d.ctl_ok("adapter", "list").stdout
        d.ctl_ok("adapter", "unload", "a0")
        assert "bytes_resident: %d\n" % (24 << 20) in d.ctl_ok("stats").stdout
        d.ctl_ok("adapter", "load", "a2", str(root / "a2"))


def _refused_start(tmp_path, *args, prefix=()):
    """Starts weightd expecting it to refuse: its one `error:` line. A daemon
    that starts instead fails the test (after 15 s)."""
    proc = subprocess.Popen(list(prefix) + [harness.WEIGHTD, "--socket", str(tmp_path / "r.sock"),
                                            "--model-root", str(tmp_path)] + list(args),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("weightd started with %s" % (args,))
    assert proc.returncode == 1, err
    errors = [l for l in err.splitlines() if l.startswith("error: ")]
    assert len(errors) == 1, err
    return errors[0]


def test_a_state_dir_another_user_could_write_is_refused_at_start(tmp_path):
    """M5: the state directory must be the daemon's own (its uid) and
    writable by nobody else, else another user could plant links there for
    the daemon to write through. Refused at start with FAILED_PRECONDITION
    naming the directory, its owner and mode, and what to do; nothing is
    written in it. A missing one is created 0700 (whatever the umask)."""
    state = str(tmp_path / "state")
    os.mkdir(state, 0o700)
    for uid, mode, want in (
            (65534, 0o700, "%s is owned by uid 65534 (mode 0700), not by uid 0 that runs the "
                           "daemon" % state),
            (0, 0o777, "%s is writable by others (mode 0777, owner uid 0)" % state),
            (0, 0o1777, "%s is writable by others (mode 1777, owner uid 0)" % state),
            (0, 0o770, "%s is writable by its group (mode 0770, owner uid 0)" % state)):
        os.chown(state, uid, uid)
        os.chmod(state, mode)
        error = _refused_start(tmp_path, "--state-dir", state)
        assert error.startswith("error: FAILED_PRECONDITION: --state-dir: " + want), error
        assert ("chown 0 %s && chmod 0700 %s" % (state, state) if uid else
                "chmod 0700 " + state) in error, error
        assert os.listdir(state) == []
    # A link to a directory of its own is not followed either.
    os.chown(state, 0, 0)
    os.chmod(state, 0o700)
    link = str(tmp_path / "link")
    os.symlink(state, link)
    for given in (link, link + "/"):
        error = _refused_start(tmp_path, "--state-dir", given)
        assert error.startswith("error: FAILED_PRECONDITION: --state-dir: %s is a symbolic link "
                                "(to %s)" % (link, state)), error
    assert os.listdir(state) == []
    # Its own, and writable by none else: it starts (and writes there).
    with harness.Daemon(model_root=str(tmp_path), extra_args=["--state-dir", state]) as d:
        assert os.path.exists(os.path.join(state, "journal"))
    created = str(tmp_path / "new" / "state")
    os.mkdir(str(tmp_path / "new"))
    d = harness.Daemon(model_root=str(tmp_path), extra_args=["--state-dir", created])
    d.start(umask=0)
    try:
        assert os.stat(created).st_mode & 0o7777 == 0o700
    finally:
        d.stop()


def test_a_read_only_state_dir_is_refused_at_start(tmp_path):
    """L4: a state directory on a read-only file system (a read-only tmpfs
    mounted over it in a private mount namespace: root writes through mode
    bits, not through a read-only mount) is FAILED_PRECONDITION saying it is
    not writable, not INTERNAL."""
    state = str(tmp_path / "state")
    os.mkdir(state, 0o700)
    mount = ["unshare", "-m", "sh", "-c",
             'mount -t tmpfs -o ro,mode=0700 weightd-ro "$0" && exec "$@"', state]
    probe = subprocess.run(mount + ["touch", os.path.join(state, "x")], capture_output=True,
                           text=True)
    if "Read-only file system" not in probe.stderr:
        pytest.skip("no private read-only mount here: %s" % probe.stderr.strip())
    error = _refused_start(tmp_path, "--state-dir", state, prefix=mount)
    assert error == ("error: FAILED_PRECONDITION: --state-dir: %s is not writable: it is on a "
                     "read-only file system, and the daemon writes its journal there; mount it "
                     "read-write or give another directory" % state), error

"""Real servers for the [sources] suites (issue 42), started by the tests:

- S3Server: an S3-compatible server, `@20minutes/s3rver` from npm (pinned in
  scripts/deps.sh, installed outside the repo into /opt/weightd-test). Why
  that one: the registries we have are Debian's and npm's; Debian ships no
  S3 server short of Ceph's radosgw (a whole cluster), and npm's `s3rver`
  3.7.1 does not verify SigV4 signatures (any V4 signature from a known key
  passes). Its fork @20minutes/s3rver does: a wrong secret gets 403
  SignatureDoesNotMatch, which the tests check. Key id and secret: S3RVER /
  S3RVER (its defaults). Path-style on 127.0.0.1. It ignores If-Match (the
  daemon compares the ETag of every response) and accepts unsigned requests.
- NginxServer: Debian's nginx serving a directory over HTTPS (HTTP/2 on)
  with a CA and a server certificate made here with openssl; ranges and
  ETags are nginx's defaults; an optional bearer token it requires.
- FaultProxy: a small threaded HTTP/1.1 proxy in front of either server,
  scripted per request (reset mid-body, 503 N times, wrong Content-Range,
  short body, drip, hold until released) and counting every request. It is
  a test tool, not a server under test: it reads each upstream response
  whole before it answers, which is fine for test-sized objects.

Objects are uploaded with curl's --aws-sigv4 (Debian's curl 7.88), not
with anything written here. Everything listens on 127.0.0.1 (or on the
address given, inside a tests/netsim.py namespace) on a free port and lives
in a temporary directory removed by stop().
"""
import hashlib
import os
import re
import select
import shutil
import socket
import ssl
import struct
import subprocess
import tempfile
import threading
import time

S3_KEY = "S3RVER"
S3_SECRET = "S3RVER"
S3_REGION = "us-east-1"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()

TOOLS = os.environ.get("WEIGHTD_TEST_TOOLS", "/opt/weightd-test")
S3RVER_CLI = os.environ.get(
    "WEIGHTD_S3RVER", os.path.join(TOOLS, "node_modules", "@20minutes", "s3rver", "lib", "cli.js"))


def free_port(host="127.0.0.1"):
    s = socket.socket()
    s.bind((host, 0))
    port = s.getsockname()[1]
    s.close()
    return port


def have_s3rver():
    return os.path.exists(S3RVER_CLI) and shutil.which("node") is not None


def have_nginx():
    return shutil.which("nginx") is not None and shutil.which("openssl") is not None


def _wait_port(host, port, proc, timeout, what, log=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError("%s exited early: %s" % (what, _read(log)))
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("%s did not listen on %s:%d: %s" % (what, host, port, _read(log)))


def _read(path):
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")[-4000:]
    except OSError:
        return ""


def _stop_proc(proc, timeout=10):
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def proc_io(pid):
    """{rchar, wchar, read_bytes, write_bytes, ...} of /proc/PID/io: a
    server's bytes through read()/write() (sockets included), counted by
    the kernel from outside the process."""
    out = {}
    with open("/proc/%d/io" % pid) as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out


class _ServerProcess:
    """A server process the tests start (self.proc, its output in
    self._log) with its own temp directory (self._tmp, when it made one):
    stop() ends the process and removes the directory; a context manager."""
    proc = None
    _tmp = None

    def stop(self):
        _stop_proc(self.proc)
        if self.proc is not None:
            self._log.close()
            self.proc = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# ------------------------------------------------------------------ S3


class S3Server(_ServerProcess):
    """@20minutes/s3rver on HOST:port with a temp data directory.

    prefix: a command prefix for node (e.g. netsim's `ip netns exec NS`)."""

    def __init__(self, host="127.0.0.1", port=None, prefix=(), workdir=None):
        self.host = host
        self.port = port or free_port("127.0.0.1" if prefix else host)
        self.prefix = list(prefix)
        self._tmp = None
        if workdir is None:
            self._tmp = tempfile.mkdtemp(prefix="weightd-s3rver-")
            workdir = self._tmp
        self.workdir = workdir
        self.data = os.path.join(workdir, "data")
        self.log_path = os.path.join(workdir, "s3rver.log")
        self.proc = None

    @property
    def endpoint(self):
        return "http://%s:%d" % (self.host, self.port)

    def start(self, timeout=30):
        if not have_s3rver():
            raise RuntimeError("s3rver not installed at %s (scripts/deps.sh)" % S3RVER_CLI)
        os.makedirs(self.data, exist_ok=True)
        self._log = open(self.log_path, "ab")
        js = ("require(%r).parseAsync(['node', 's3rver'].concat(process.argv.slice(1)))"
              ".catch((e) => { console.error(e); process.exit(1) })") % S3RVER_CLI
        self.proc = subprocess.Popen(
            self.prefix + ["node", "-e", js, "--", "-d", self.data, "-a", self.host,
                           "-p", str(self.port), "--silent"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        if self.prefix:
            # Inside another network namespace: wait for its log line.
            deadline = time.time() + timeout
            while "listening on" not in _read(self.log_path):
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("s3rver did not start: " + _read(self.log_path))
                time.sleep(0.05)
        else:
            _wait_port(self.host, self.port, self.proc, timeout, "s3rver", self.log_path)
        return self

    def io(self):
        """/proc/PID/io of the node process (wchar: bytes it sent)."""
        return proc_io(self.proc.pid)

    # Requests, signed with curl --aws-sigv4 (through `via` = a command
    # prefix, e.g. to reach the server inside a namespace).
    def curl(self, method, path, *args, secret=S3_SECRET, key=S3_KEY, body_sha=EMPTY_SHA256,
             via=(), check=True):
        """Runs curl against the server; returns (status, headers dict, body bytes)."""
        hdr = tempfile.NamedTemporaryFile(prefix="s3hdr-", delete=False)
        hdr.close()
        try:
            cmd = list(via) + ["curl", "-sS", "-X", method, "-D", hdr.name,
                               "--aws-sigv4", "aws:amz:%s:s3" % S3_REGION,
                               "--user", "%s:%s" % (key, secret),
                               "-H", "x-amz-content-sha256: " + body_sha] + list(args) + \
                  [self.endpoint + path]
            r = subprocess.run(cmd, capture_output=True, timeout=300)
            if r.returncode != 0:
                raise RuntimeError("curl %s %s: %s" % (method, path, r.stderr.decode()))
            status, headers = _parse_head(open(hdr.name, "rb").read())
        finally:
            os.unlink(hdr.name)
        if check and status >= 300:
            raise RuntimeError("%s %s -> %d: %s" % (method, path, status, r.stdout[:500]))
        return status, headers, r.stdout

    def create_bucket(self, bucket, via=()):
        self.curl("PUT", "/" + bucket, via=via)

    def put(self, bucket, key, data=None, path=None, via=()):
        """Uploads bytes `data` or the file `path`; returns the new ETag."""
        tmp = None
        if path is None:
            tmp = tempfile.NamedTemporaryFile(prefix="s3obj-", delete=False)
            tmp.write(data)
            tmp.close()
            path = tmp.name
        try:
            _, headers, _ = self.curl("PUT", "/%s/%s" % (bucket, key), "-T", path,
                                      body_sha="UNSIGNED-PAYLOAD", via=via)
        finally:
            if tmp is not None:
                os.unlink(tmp.name)
        return headers.get("etag")

    def put_file_tree(self, bucket, prefix, directory, via=()):
        """Uploads every file of `directory` (not recursive) under `prefix`."""
        return {name: self.put(bucket, prefix + name, path=os.path.join(directory, name), via=via)
                for name in sorted(os.listdir(directory))
                if os.path.isfile(os.path.join(directory, name))}

    def delete(self, bucket, key, via=()):
        self.curl("DELETE", "/%s/%s" % (bucket, key), via=via)

    def head(self, bucket, key, via=()):
        status, headers, _ = self.curl("HEAD", "/%s/%s" % (bucket, key), "-I", via=via, check=False)
        return status, headers

    def get(self, bucket, key, byte_range=None, secret=S3_SECRET, via=(), check=True):
        args = ["-r", byte_range] if byte_range else []
        return self.curl("GET", "/%s/%s" % (bucket, key), *args, secret=secret, via=via,
                         check=check)


def _parse_head(raw):
    """(status, {lower-case name: value}) of the last response head in a
    curl -D dump (skipping 100 Continue)."""
    blocks = [b for b in raw.replace(b"\r\n", b"\n").split(b"\n\n") if b.strip()]
    status, headers = 0, {}
    for block in blocks:
        lines = block.decode(errors="replace").split("\n")
        if not lines[0].startswith("HTTP/"):
            continue
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
    return status, headers


# ------------------------------------------------------------------ HTTPS


def make_ca(directory, hosts=("127.0.0.1", "localhost")):
    """A self-signed CA and a server certificate for `hosts` signed by it
    (openssl). Returns (ca.pem, server.pem, server.key)."""
    ca_key, ca = os.path.join(directory, "ca.key"), os.path.join(directory, "ca.pem")
    key, csr, crt = (os.path.join(directory, n) for n in ("server.key", "server.csr", "server.pem"))
    ext = os.path.join(directory, "san.ext")
    san = ",".join(("IP:" if re.match(r"^[0-9.]+$", h) else "DNS:") + h for h in hosts)
    with open(ext, "w") as f:
        f.write("subjectAltName=%s\nbasicConstraints=CA:FALSE\n"
                "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n" % san)
    run = lambda *a: subprocess.run(["openssl"] + list(a), check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", "/CN=weightd test CA")
    run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", key, "-out", csr, "-subj", "/CN=%s" % hosts[0])
    run("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
        "-out", crt, "-days", "2", "-extfile", ext)
    return ca, crt, key


class NginxServer(_ServerProcess):
    """nginx serving `root` over https://HOST:port/ (HTTP/2, ranges, ETags).

    bearer_token: when set, every request must carry `Authorization: Bearer
    TOKEN` (else 401). access log lines: `request status bytes_sent range`
    (see requests())."""

    def __init__(self, root=None, host="127.0.0.1", port=None, bearer_token=None, prefix=()):
        self._tmp = tempfile.mkdtemp(prefix="weightd-nginx-")
        self.root = root or os.path.join(self._tmp, "www")
        os.makedirs(self.root, exist_ok=True)
        self.host = host
        self.port = port or free_port("127.0.0.1" if prefix else host)
        self.bearer_token = bearer_token
        self.prefix = list(prefix)
        self.proc = None
        self.ca_file, self.cert, self.key = make_ca(self._tmp, hosts=(host, "localhost"))
        self.access_log = os.path.join(self._tmp, "access.log")
        self.error_log = os.path.join(self._tmp, "error.log")

    def url(self, rel=""):
        return "https://%s:%d/%s" % (self.host, self.port, rel.lstrip("/"))

    def _conf(self):
        auth = ""
        if self.bearer_token:
            auth = ('if ($http_authorization != "Bearer %s") { return 401; }' % self.bearer_token)
        t = self._tmp
        return """
daemon off;
master_process off;
worker_processes 1;
pid %(t)s/nginx.pid;
error_log %(t)s/error.log warn;
events { worker_connections 256; }
http {
  types { application/octet-stream safetensors; application/json json; }
  default_type application/octet-stream;
  client_body_temp_path %(t)s/body; proxy_temp_path %(t)s/proxy;
  fastcgi_temp_path %(t)s/fcgi; uwsgi_temp_path %(t)s/uwsgi; scgi_temp_path %(t)s/scgi;
  log_format ranges '$request_method $uri $status $bytes_sent "$http_range"';
  access_log %(t)s/access.log ranges;
  sendfile on;
  etag on;
  server {
    listen %(host)s:%(port)d ssl http2;
    ssl_certificate %(crt)s;
    ssl_certificate_key %(key)s;
    root %(root)s;
    location / { %(auth)s }
  }
}
""" % dict(t=t, host=self.host, port=self.port, crt=self.cert, key=self.key, root=self.root,
           auth=auth)

    def start(self, timeout=20):
        conf = os.path.join(self._tmp, "nginx.conf")
        with open(conf, "w") as f:
            f.write(self._conf())
        self._log = open(os.path.join(self._tmp, "stderr.log"), "ab")
        self.proc = subprocess.Popen(self.prefix + ["nginx", "-e", self.error_log, "-c", conf,
                                                    "-p", self._tmp],
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        if self.prefix:
            deadline = time.time() + timeout
            while not os.path.exists(os.path.join(self._tmp, "nginx.pid")):
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("nginx did not start: " + _read(self.error_log))
                time.sleep(0.05)
        else:
            _wait_port(self.host, self.port, self.proc, timeout, "nginx", self.error_log)
        return self

    def requests(self):
        """[(method, uri, status, bytes_sent, range)] from the access log."""
        out = []
        for line in _read_all(self.access_log).splitlines():
            m = re.match(r'(\S+) (\S+) (\d+) (\d+) "(.*)"$', line)
            if m:
                out.append((m.group(1), m.group(2), int(m.group(3)), int(m.group(4)),
                            m.group(5) if m.group(5) != "-" else None))
        return out

    def curl(self, rel, *args, token=None):
        """(status, body) of a GET through curl with this CA."""
        cmd = ["curl", "-sS", "--cacert", self.ca_file, "-o", "-", "-w", "\n%{http_code}"]
        if token:
            cmd += ["-H", "Authorization: Bearer " + token]
        r = subprocess.run(cmd + list(args) + [self.url(rel)], capture_output=True, timeout=120,
                           check=True)
        body, _, code = r.stdout.rpartition(b"\n")
        return int(code), body


def _read_all(path):
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


# ------------------------------------------------------------------ fault proxy


class Rule:
    """One scripted fault. Matches GETs carrying a Range header whose first
    byte is >= min_start (the data section: the daemon's header reads start
    lower), and whose path contains `path` when given; applies `times` times
    (None: always). hits counts the requests it applied to."""

    def __init__(self, fault, times=None, path=None, min_start=1, interval=2.5, delay=0.0):
        self.fault = fault
        self.times = times
        self.path = path
        self.min_start = min_start
        self.interval = interval
        self.delay = delay
        self.hits = 0
        self.released = threading.Event()
        self.waiting = 0  # held requests waiting for release()

    def release(self):
        self.released.set()

    def matches(self, method, path, rng):
        if self.times is not None and self.hits >= self.times:
            return False
        if method != "GET" or rng is None or rng[0] < self.min_start:
            return False
        return self.path is None or self.path in path


FAULTS = ("reset", "status503", "wrong_range", "short", "drip", "hold", "delay")


class FaultProxy:
    """A plain-HTTP proxy on 127.0.0.1:port in front of upstream HOST:PORT
    (TLS to the upstream when upstream_ca is given). Request heads are
    forwarded unchanged but for `Connection: close` (SigV4 signatures stay
    valid: the daemon signed the Host it sent). requests: one dict per
    request (method, path, range, status, sent = body bytes sent)."""

    def __init__(self, upstream_host, upstream_port, upstream_ca=None, host="127.0.0.1"):
        self.upstream = (upstream_host, upstream_port)
        self.upstream_ctx = None
        if upstream_ca:
            self.upstream_ctx = ssl.create_default_context(cafile=upstream_ca)
            self.upstream_ctx.set_alpn_protocols(["http/1.1"])
        self.host = host
        self.rules = []
        self.requests = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._conns = set()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self.port = self._sock.getsockname()[1]
        self._thread = None

    @property
    def endpoint(self):
        return "http://%s:%d" % (self.host, self.port)

    def url(self, rel=""):
        return "%s/%s" % (self.endpoint, rel.lstrip("/"))

    def start(self):
        self._sock.listen(64)
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        for r in self.rules:
            r.release()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def add(self, fault, **kw):
        assert fault in FAULTS, fault
        rule = Rule(fault, **kw)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self):
        with self._lock:
            for r in self.rules:
                r.release()
            self.rules = []
            self.requests = []

    def count(self, method=None, path=None, ranged=None):
        with self._lock:
            return sum(1 for r in self.requests
                       if (method is None or r["method"] == method)
                       and (path is None or path in r["path"])
                       and (ranged is None or (r["range"] is not None) == ranged))

    def sent_bytes(self):
        with self._lock:
            return sum(r["sent"] for r in self.requests)

    # -- the server side

    def _accept(self):
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        buf = b""
        try:
            while not self._stop.is_set():
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, buf = buf.split(b"\r\n\r\n", 1)
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = [tuple(x.strip() for x in l.split(":", 1)) for l in lines[1:] if ":" in l]
                hmap = {k.lower(): v for k, v in headers}
                body_len = int(hmap.get("content-length", "0"))
                while len(buf) < body_len:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                body, buf = buf[:body_len], buf[body_len:]
                rng = _parse_range(hmap.get("range"))
                with self._lock:
                    rule = next((r for r in self.rules if r.matches(method, path, rng)), None)
                    if rule is not None:
                        rule.hits += 1
                    record = {"method": method, "path": path, "range": rng, "status": 0,
                              "sent": 0, "fault": rule.fault if rule else None}
                    self.requests.append(record)
                if not self._answer(conn, method, path, headers, body, rng, rule, record):
                    return
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            try:
                conn.close()
            except OSError:
                pass

    def _upstream_fetch(self, method, path, headers, body):
        s = socket.create_connection(self.upstream, timeout=60)
        if self.upstream_ctx is not None:
            s = self.upstream_ctx.wrap_socket(s, server_hostname=self.upstream[0])
        try:
            out = ["%s %s HTTP/1.1" % (method, path)]
            out += ["%s: %s" % (k, v) for k, v in headers if k.lower() not in ("connection",)]
            out.append("Connection: close")
            s.sendall(("\r\n".join(out) + "\r\n\r\n").encode("latin-1") + body)
            data = b""
            while True:
                chunk = s.recv(1 << 20)
                if not chunk:
                    break
                data += chunk
        finally:
            s.close()
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        reason = lines[0].split(" ", 2)[2] if len(lines[0].split(" ", 2)) > 2 else ""
        rh = [tuple(x.strip() for x in l.split(":", 1)) for l in lines[1:] if ":" in l]
        if any(k.lower() == "transfer-encoding" and "chunked" in v.lower() for k, v in rh):
            rest = _dechunk(rest)
        cl = next((int(v) for k, v in rh if k.lower() == "content-length"), None)
        if method == "HEAD":
            rest = b""
        elif cl is not None:
            rest = rest[:cl]
        return status, reason, rh, rest, cl

    def _answer(self, conn, method, path, headers, body, rng, rule, record):
        """Returns False when the client connection must end."""
        fault = rule.fault if rule else None
        if fault == "status503":
            payload = b"<Error><Code>SlowDown</Code><Message>fault proxy</Message></Error>"
            self._send(conn, 503, "Service Unavailable",
                       [("Content-Type", "application/xml")], payload, record, method)
            return True
        if fault == "hold":
            with self._lock:
                rule.waiting += 1
            rule.released.wait(timeout=120)
            with self._lock:
                rule.waiting -= 1
            if self._stop.is_set():
                return False
        if fault == "delay":
            time.sleep(rule.delay)
        status, reason, rh, payload, length = self._upstream_fetch(method, path, headers, body)
        if method != "HEAD":
            length = None
        rh = [(k, v) for k, v in rh if k.lower() not in
              ("connection", "keep-alive", "transfer-encoding", "content-length")]
        if fault == "wrong_range" and status == 206:
            rh = [(k, _shift_range(v, 8) if k.lower() == "content-range" else v) for k, v in rh]
        elif fault == "short" and status == 206:
            payload = payload[:len(payload) // 2]
        elif fault == "reset":
            head = self._head(status, reason, rh, len(payload))
            conn.sendall(head + payload[:len(payload) // 2])
            record["status"], record["sent"] = status, len(payload) // 2
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return False
        elif fault == "drip":
            conn.sendall(self._head(status, reason, rh, len(payload)))
            record["status"] = status
            for i in range(len(payload)):
                if self._stop.is_set():
                    return False
                r, _, _ = select.select([conn], [], [], rule.interval)
                if r:  # the client closed (or sent something): stop
                    return False
                conn.sendall(payload[i:i + 1])
                record["sent"] += 1
            return True
        self._send(conn, status, reason, rh, payload, record, method, length)
        return True

    @staticmethod
    def _head(status, reason, rh, length):
        lines = ["HTTP/1.1 %d %s" % (status, reason)] + ["%s: %s" % kv for kv in rh]
        lines += ["Content-Length: %d" % length, "Connection: keep-alive"]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def _send(self, conn, status, reason, rh, payload, record, method, length=None):
        """length: the Content-Length to announce (a HEAD's: the object's)."""
        conn.sendall(self._head(status, reason, rh, len(payload) if length is None else length) +
                     (b"" if method == "HEAD" else payload))
        record["status"] = status
        record["sent"] = 0 if method == "HEAD" else len(payload)


def _parse_range(value):
    if not value:
        return None
    m = re.match(r"bytes=(\d+)-(\d*)$", value.strip())
    if not m:
        return None
    return int(m.group(1)), (int(m.group(2)) if m.group(2) else None)


def _shift_range(value, by):
    m = re.match(r"bytes (\d+)-(\d+)/(\S+)", value)
    if not m:
        return value
    return "bytes %d-%d/%s" % (int(m.group(1)) + by, int(m.group(2)) + by, m.group(3))


def _dechunk(data):
    out, i = b"", 0
    while True:
        j = data.index(b"\r\n", i)
        n = int(data[i:j].split(b";")[0], 16)
        if n == 0:
            return out
        out += data[j + 2:j + 2 + n]
        i = j + 2 + n + 2

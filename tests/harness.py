"""Test harness shared by the Python suites: starts a real weightd on Unix
sockets in a temp dir and drives it through the real weightctl binary.

Environment: WEIGHTD_BUILD (default: <repo>/build) locates build/bin.
"""
import os
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.environ.get("WEIGHTD_BUILD", os.path.join(REPO, "build"))
WEIGHTD = os.path.join(BUILD, "bin", "weightd")
WEIGHTCTL = os.path.join(BUILD, "bin", "weightctl")


def _sanitizer():
    """The WEIGHTD_SANITIZE the build was configured with ("" = none)."""
    try:
        with open(os.path.join(BUILD, "CMakeCache.txt")) as f:
            for line in f:
                if line.startswith("WEIGHTD_SANITIZE:"):
                    return line.split("=", 1)[1].strip()
    except OSError:
        pass
    return ""


# Sanitizer builds run several times slower and TSan keeps shadow memory and
# history that grow with the run: timing bounds widen, RSS bounds do not apply.
SANITIZE = _sanitizer()
sys.path.insert(0, os.path.join(REPO, "tests", "parity"))
sys.path.insert(0, os.path.join(BUILD, "python"))


def user_prefix(user):
    """A command prefix that runs the command as another user (tests run as
    root). `user`: a uid (gid = uid, no supplementary groups) or a tuple
    (uid, gid[, [supplementary gids]])."""
    if user is None:
        return []
    if isinstance(user, int):
        user = (user, user)
    uid, gid = user[0], user[1]
    groups = list(user[2]) if len(user) > 2 else []
    cmd = ["setpriv", "--reuid=%d" % uid, "--regid=%d" % gid]
    cmd += ["--groups=" + ",".join(str(g) for g in groups)] if groups else ["--clear-groups"]
    return cmd + ["--"]


def leases_open(client):
    """The daemon's open leases, through a weightd.Client."""
    return client.stats()["leases_open"]


def wait_leases(client, want, timeout=10.0):
    """Waits (up to `timeout` s) for the daemon's open leases to be `want`
    and returns the count then: the daemon ends a lease when it sees its data
    connection close, a moment after the client closed it."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        n = leases_open(client)
        if n == want:
            return n
        time.sleep(0.05)
    return leases_open(client)


def free_port():
    """A TCP port on 127.0.0.1 free now (for --metrics-listen, --listen)."""
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def scrape_metrics(port):
    """{series: value} from the daemon's Prometheus /metrics on `port`."""
    import urllib.request
    text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            values[k] = float(v)
    return values


class CtlResult:
    def __init__(self, proc):
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr

    @property
    def error_code(self):
        """The CANONICAL_CODE of an `error: CODE: message` line, or None."""
        for line in self.stderr.splitlines():
            if line.startswith("error: "):
                return line.split(":", 2)[1].strip()
        return None

    @property
    def error_message(self):
        for line in self.stderr.splitlines():
            if line.startswith("error: "):
                return line.split(":", 2)[2].strip()
        return None


class Daemon:
    """A weightd process. Use as a context manager or call start()/stop()."""

    def __init__(self, model_root=None, extra_args=(), workdir=None, prefix=(), binary=None):
        """prefix: a command prefix for weightd itself (another user, limits).
        binary: another build's weightd (default: WEIGHTD_BUILD's)."""
        self._tmp = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="weightd-test-")
            workdir = self._tmp.name
        os.makedirs(workdir, exist_ok=True)
        self.workdir = workdir
        self.model_root = model_root or os.path.join(workdir, "models")
        os.makedirs(self.model_root, exist_ok=True)
        self.socket = os.path.join(workdir, "w.sock")
        self.data_socket = self.socket + ".data"
        self.log_path = os.path.join(workdir, "weightd.log")
        self.extra_args = list(extra_args)
        self.prefix = list(prefix)
        self.binary = binary or WEIGHTD
        self.proc = None

    def start(self, timeout=20.0, umask=None):
        """umask: the daemon's umask (default: inherited)."""
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.prefix + [self.binary, "--socket", self.socket, "--model-root", self.model_root] + self.extra_args,
            stdout=self._log, stderr=subprocess.STDOUT,
            preexec_fn=None if umask is None else (lambda: os.umask(umask)))
        # (a restore at start reads its checkpoints first: several times
        # slower under a sanitizer)
        deadline = time.time() + timeout * (3 if SANITIZE else 1)
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("weightd exited early: " + self.log())
            if os.path.exists(self.socket) and self.ctl("health").returncode == 0:
                return self
            time.sleep(0.05)
        self.proc.kill()  # not left running (and holding its memory) past the test
        self.proc.wait()
        raise RuntimeError("weightd did not become healthy: " + self.log())

    def stop(self, timeout=20.0):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self._log.close()
        rc = self.proc.returncode if self.proc else None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        return rc

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def log(self):
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def ctl(self, *args, timeout=120, user=None, target=None, global_args=(), env=None):
        """Runs weightctl on this daemon's socket (or on `target` HOST:PORT),
        as `user` (see user_prefix) when given; global_args go before the verb
        (e.g. --tls-ca FILE); env: extra environment variables."""
        where = ["--target", target] if target is not None else ["--socket", self.socket]
        full_env = None
        if env:
            full_env = dict(os.environ)
            full_env.update(env)
        proc = subprocess.run(user_prefix(user) + [WEIGHTCTL] + where + list(global_args) +
                              [str(a) for a in args],
                              capture_output=True, text=True, timeout=timeout, env=full_env)
        return CtlResult(proc)

    def ctl_ok(self, *args, timeout=120, **kwargs):
        r = self.ctl(*args, timeout=timeout, **kwargs)
        if r.returncode != 0:
            raise AssertionError("weightctl %s failed (%d): %s" % (" ".join(map(str, args)),
                                                                     r.returncode, r.stderr))
        return r

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

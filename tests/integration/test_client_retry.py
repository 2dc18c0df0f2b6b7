"""Client retry across a daemon restart: a fetch issued while the daemon is
down (SIGTERM) succeeds once a new daemon is up on the same sockets, with
the right bytes over both transports; retry_deadline=0 fails at once and a
short deadline gives up after about that long, both with UNAVAILABLE;
weightctl --retry-deadline does the same through the C++ client."""
import os
import sys
import threading
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # noqa: E402
import st_io  # noqa: E402

import weightd  # noqa: E402  (build/python, put on sys.path by harness)

RESTART_DELAY = 1.0


def _checkpoint(root):
    g = torch.Generator().manual_seed(5)
    tensors = {"emb.weight": torch.randn(64, 48, generator=g),
               "fc.weight": torch.randn(33, 16, generator=g),
               "fc.bias": torch.randn(16, generator=g)}
    path = os.path.join(root, "m.safetensors")
    st_io.save(tensors, path)
    return path, tensors


def _rank1_of_2(t):
    c = -(-t.shape[0] // 2)
    return t[c:2 * c]


def _check_rank1(handle, tensors):
    got = handle.state_dict()
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(got[name], _rank1_of_2(t)), name


def _first_daemon(tmp_path):
    """A checkpoint under tmp_path/models and a started daemon on
    tmp_path/d that preloads it as "m" (the way _Restarter's daemon does)."""
    root = str(tmp_path / "models")
    os.makedirs(root)
    path, tensors = _checkpoint(root)
    workdir = str(tmp_path / "d")
    d = harness.Daemon(model_root=root, workdir=workdir, extra_args=["--preload", "m=" + path])
    d.start()
    return root, workdir, path, tensors, d


class _Restarter:
    """Starts a new daemon on `workdir`'s sockets (with the model preloaded,
    so it is there before the socket answers) after `delay` seconds, in a
    background thread."""

    def __init__(self, root, workdir, path, delay=RESTART_DELAY):
        self.daemon = harness.Daemon(model_root=root, workdir=workdir,
                                     extra_args=["--preload", "m=" + path])
        self.error = None
        self.started_at = None
        self._thread = threading.Thread(target=self._run, args=(delay,), daemon=True)
        self._thread.start()

    def _run(self, delay):
        time.sleep(delay)
        try:
            self.started_at = time.monotonic()
            self.daemon.start()
        except BaseException as e:  # reported by join()
            self.error = e

    def join(self):
        self._thread.join(timeout=60)
        if self.error is not None:
            raise self.error
        return self.daemon


def test_fetch_retries_across_a_daemon_restart(tmp_path):
    root, workdir, path, tensors, d = _first_daemon(tmp_path)
    client = weightd.Client(socket=d.socket)  # retry_deadline=30 by default
    no_retry = weightd.Client(socket=d.socket, retry_deadline=0)
    try:
        with client.fetch("m", world=2, rank=1) as h:
            _check_rank1(h, tensors)
        with no_retry.fetch("m", world=2, rank=1) as h:
            _check_rank1(h, tensors)
        assert d.stop() == 0, d.log()
        assert not os.path.exists(d.socket) and not os.path.exists(d.data_socket)

        # Down, no retries: UNAVAILABLE at once.
        t0 = time.monotonic()
        with pytest.raises(weightd.Error) as e:
            no_retry.fetch("m", world=2, rank=1)
        assert e.value.code == "UNAVAILABLE", e.value
        assert time.monotonic() - t0 < 1.0

        # Down, restarting in the background: the fetch waits it out on
        # both the gRPC channel and a fresh data-socket connection.
        r = _Restarter(root, workdir, path)
        t0 = time.monotonic()
        with client.fetch("m", world=2, rank=1) as h:
            took = time.monotonic() - t0
            assert h.transport == "shm"
            _check_rank1(h, tensors)
        d = r.join()
        assert took >= RESTART_DELAY * 0.8, took  # it really waited for the new daemon
        assert took < 15, took
        with client.fetch("m", world=2, rank=1, transport="grpc") as h:
            _check_rank1(h, tensors)
        assert [m.name for m in client.list()] == ["m"]

        # Again with the grpc transport and read-only calls, through a
        # second restart.
        assert d.stop() == 0, d.log()
        r = _Restarter(root, workdir, path)
        assert client.health() is True
        assert client.info("m").tensor_count == len(tensors)
        with client.fetch("m", world=2, rank=1, transport="grpc") as h:
            _check_rank1(h, tensors)
        d = r.join()
        assert client.stats()["leases_open"] == 0

        # weightctl (C++ client): --retry-deadline rides out a restart;
        # without it a call while the daemon is down fails at once.
        assert d.stop() == 0, d.log()
        down = d.ctl("list")
        assert down.returncode != 0 and down.error_code == "UNAVAILABLE", down.stderr
        r = _Restarter(root, workdir, path)
        out = tmp_path / "r1.safetensors"
        t0 = time.monotonic()
        res = d.ctl("--retry-deadline", "30", "fetch", "m", "--world", "2", "--rank", "1",
                    "--out", out)
        took = time.monotonic() - t0
        d = r.join()
        assert res.returncode == 0, res.stderr
        assert took >= RESTART_DELAY * 0.8, took
        got = st_io.load(str(out))
        for name, t in tensors.items():
            assert torch.equal(got[name], _rank1_of_2(t)), name
    finally:
        client.close()
        no_retry.close()
        d.stop()


def test_fetch_during_drain_reaches_the_restarted_daemon(tmp_path):
    """SIGTERM without waiting: calls arriving while the old daemon drains
    (it cancels them) or after it exited are retried until the new one is up."""
    root, workdir, path, tensors, d = _first_daemon(tmp_path)
    client = weightd.Client(socket=d.socket)
    try:
        with client.fetch("m", world=2, rank=1) as h:
            _check_rank1(h, tensors)
        old_pid = d.proc.pid
        d.proc.terminate()
        time.sleep(0.2)  # health NOT_SERVING, the gRPC socket unlinked, draining

        def restart_after_exit():
            d.proc.wait(timeout=60)
            return _Restarter(root, workdir, path, delay=0.2)
        holder = {}
        t = threading.Thread(target=lambda: holder.update(r=restart_after_exit()), daemon=True)
        t.start()
        with client.fetch("m", world=2, rank=1) as h:
            _check_rank1(h, tensors)
        t.join(timeout=60)
        assert d.proc.returncode == 0, d.log()
        d = holder["r"].join()
        assert d.proc.pid != old_pid
        assert client.health() is True
    finally:
        client.close()
        d.stop()


def test_short_retry_deadline_gives_up_with_unavailable(tmp_path):
    sock = str(tmp_path / "none.sock")
    with weightd.Client(socket=sock, retry_deadline=0.5) as c:
        for call in (lambda: c.fetch("m"), c.health, c.list):
            t0 = time.monotonic()
            with pytest.raises(weightd.Error) as e:
                call()
            took = time.monotonic() - t0
            assert e.value.code == "UNAVAILABLE", e.value
            assert 0.4 <= took <= 5.0, took
            assert "gave up after" in e.value.message
    with weightd.Client(socket=sock, retry_deadline=0) as c:
        t0 = time.monotonic()
        with pytest.raises(weightd.Error) as e:
            c.fetch("m")
        assert e.value.code == "UNAVAILABLE"
        assert time.monotonic() - t0 < 1.0
    r = harness.Daemon(workdir=str(tmp_path / "x"))  # just for ctl on a dead socket
    r.socket = sock
    t0 = time.monotonic()
    res = r.ctl("--retry-deadline", "0.5", "list")
    took = time.monotonic() - t0
    assert res.error_code == "UNAVAILABLE", res.stderr
    assert 0.4 <= took <= 5.0, took
    assert r.ctl("--retry-deadline", "soon", "list").error_code == "INVALID_ARGUMENT"

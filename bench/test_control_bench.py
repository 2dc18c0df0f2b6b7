"""Smoke test of the control-plane benchmark (CTest bench_control_smoke):
control_bench against a real daemon serving a tiny 201-tensor model, 4
clients for 2 s, prints one sane JSON line, with blocking and callback-API
clients, closed and open loop. Asserts nothing about latency; open loop must
keep to its offered rate."""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, HERE)

import harness  # noqa: E402
import llama_ckpt  # noqa: E402

TOOL = os.path.join(harness.BUILD, "bench", "control_bench")


def run(d, *args):
    out = subprocess.run([TOOL, "--socket", d.socket, "--model", "m"] + list(args),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, out.stdout
    return json.loads(lines[0])


def test_control_bench_prints_sane_json(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    path = str(models / "model.safetensors")
    llama_ckpt.write_checkpoint(path, llama_ckpt.llama_shapes(**llama_ckpt.CONFIGS["table201"]))
    with harness.Daemon(model_root=str(models), workdir=str(tmp_path / "d")) as d:
        d.ctl_ok("load", "m", path)
        res = run(d, "--clients", "4", "--seconds", "2", "--warmup-seconds", "0.2",
                  "--world", "8")
        assert res["rpc"] == "fetch" and res["clients"] == 4
        assert res["errors"] == 0
        assert res["tensors"] == 201
        assert res["calls"] > 0 and res["calls_per_s"] > 0
        assert 0 < res["p50_ms"] <= res["p99_ms"] <= res["max_ms"]
        assert 0 < res["release_p50_ms"] <= res["release_p99_ms"]
        # Reading only lease and token still sees the whole table (its
        # tensors counted while skipped) and releases every lease.
        lean = run(d, "--clients", "4", "--seconds", "1", "--warmup-seconds", "0.2",
                   "--world", "8", "--decode", "lease")
        assert lean["decode"] == "lease" and lean["errors"] == 0
        assert lean["tensors"] == 201 and lean["calls"] > 0
        floor = run(d, "--rpc", "stats", "--clients", "4", "--seconds", "1",
                    "--warmup-seconds", "0.2")
        assert floor["errors"] == 0 and floor["calls"] > 0
        # The callback-API clients: same answers, every lease released.
        cb = run(d, "--clients", "4", "--seconds", "1", "--warmup-seconds", "0.2",
                 "--world", "8", "--decode", "lease", "--api", "callback")
        assert cb["api"] == "callback" and cb["errors"] == 0
        assert cb["tensors"] == 201 and cb["calls"] > 0
        assert 0 < cb["p50_ms"] <= cb["p99_ms"] <= cb["max_ms"]
        cbs = run(d, "--rpc", "stats", "--clients", "4", "--seconds", "1",
                  "--warmup-seconds", "0.2", "--api", "callback")
        assert cbs["errors"] == 0 and cbs["calls"] > 0
        # Open loop: the clients call at the offered rate, not as fast as
        # they can (closed loop makes thousands per second here). Calls that
        # fell behind during the warm-up (slow first connections, sanitizers)
        # are still made, late: a little over the rate is allowed.
        for api in ("sync", "callback"):
            paced = run(d, "--clients", "4", "--seconds", "2", "--warmup-seconds", "0.2",
                        "--world", "8", "--decode", "lease", "--api", api, "--rate", "100")
            assert paced["rate"] == 100 and paced["errors"] == 0
            assert 50 <= paced["calls_per_s"] <= 150, paced
        # Every lease the benchmark took was released.
        assert "leases_open: 0" in d.ctl_ok("stats").stdout
        bad = subprocess.run([TOOL, "--socket", d.socket, "--clients", "0"],
                             capture_output=True, text=True, timeout=30)
        assert bad.returncode == 2 and "INVALID_ARGUMENT" in bad.stderr
        for flag, value in (("--api", "async"), ("--rate", "-1")):
            bad = subprocess.run([TOOL, "--socket", d.socket, flag, value],
                                 capture_output=True, text=True, timeout=30)
            assert bad.returncode == 2 and "INVALID_ARGUMENT" in bad.stderr, (flag, bad.stderr)

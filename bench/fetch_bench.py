#!/usr/bin/python3
"""Warm fetch of a ~2 GiB Llama-shaped bf16 checkpoint by N ranks at once:
weightd (shm transport, C++ client, every page of the shard touched) against
the in-process PyTorch baseline measured in the same run (each rank mmaps the
safetensors file, casts, torch.chunks, keeps its shard).

  /usr/bin/python3 bench/fetch_bench.py [--ranks 2] [--dtype keep] [--rounds 5]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))
sys.path.insert(0, HERE)

import harness  # noqa: E402
import llama_ckpt  # noqa: E402

def run_baseline(path, world, dtype):
    """The in-process PyTorch baseline, one rank_worker.py (bench/suite.py's
    rank process) per rank; all ranks start the round together once each has
    imported torch."""
    worker = os.path.join(HERE, "rank_worker.py")
    procs = [subprocess.Popen(["/usr/bin/python3", worker, os.path.join(harness.BUILD, "python")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(world)]
    for p in procs:
        assert json.loads(p.stdout.readline()).get("ready"), "rank_worker did not start"
    for r, p in enumerate(procs):
        p.stdin.write(json.dumps({"op": "torch", "path": path, "world": world, "rank": r,
                                  "dtype": dtype}) + "\n")
        p.stdin.flush()
    results = [json.loads(p.stdout.readline()) for p in procs]
    for p in procs:
        p.stdin.write(json.dumps({"op": "quit"}) + "\n")
        p.stdin.flush()
        p.wait()
    for r in results:
        if "error" in r:
            raise RuntimeError("baseline rank failed: " + r["error"])
    return max(r["ready_s"] for r in results), sum(r["bytes"] for r in results)


def run_weightd(d, world, dtype, transport):
    tool = os.path.join(harness.BUILD, "bench", "fetch_rank")
    procs = [subprocess.Popen([tool, "--socket", d.socket, "--model", "llama", "--world", str(world),
                               "--rank", str(r), "--dtype", dtype, "--transport", transport],
                              stdout=subprocess.PIPE, text=True) for r in range(world)]
    results = [json.loads(p.communicate()[0]) for p in procs]
    return max(r["ready_s"] for r in results), sum(r["bytes"] for r in results)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dtype", default="keep")
    ap.add_argument("--transport", default="shm")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ckpt-dir", default=os.path.join(HERE, "out", "tinyllama-bf16"))
    args = ap.parse_args()

    t = time.time()
    path = llama_ckpt.ensure_checkpoint(args.ckpt_dir)
    size = os.path.getsize(path)
    print("checkpoint: %s (%.2f GiB, ready in %.1f s)" % (path, size / 2**30, time.time() - t))
    with open(path, "rb") as f:  # warm the page cache for the baseline
        while f.read(64 << 20):
            pass

    with tempfile.TemporaryDirectory(prefix="weightd-bench-") as tmp:
        d = harness.Daemon(model_root=args.ckpt_dir, workdir=tmp)
        d.start()
        try:
            t = time.time()
            d.ctl_ok("load", "llama", path)
            print("daemon load: %.2f s (%.2f GB/s)" % (time.time() - t, size / (time.time() - t) / 1e9))
            run_weightd(d, args.ranks, args.dtype, args.transport)  # warm: first fetch digests views
            wd = [run_weightd(d, args.ranks, args.dtype, args.transport)[0] for _ in range(args.rounds)]
            base = [run_baseline(path, args.ranks, args.dtype)[0] for _ in range(args.rounds)]
        finally:
            d.stop()
    wd_med, base_med = statistics.median(wd), statistics.median(base)
    result = {
        "figure": "warm_fetch", "ranks": args.ranks, "dtype": args.dtype,
        "transport": args.transport, "checkpoint_bytes": size,
        "weightd_s": wd, "baseline_s": base,
        "weightd_median_s": wd_med, "baseline_median_s": base_med,
        "speedup": base_med / wd_med,
    }
    print("weightd  (%s, %d ranks, dtype %s): median %.4f s  [%s]" % (
        args.transport, args.ranks, args.dtype, wd_med, ", ".join("%.4f" % x for x in wd)))
    print("PyTorch baseline (mmap+cast+chunk+clone): median %.4f s  [%s]" % (
        base_med, ", ".join("%.4f" % x for x in base)))
    print("speedup: %.1fx" % result["speedup"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""A PyTorch worker's time to a ready state dict through the Python client
(shm, zero copy, one byte per page touched), N ranks at once, against the
in-process PyTorch baseline of fetch_bench.py measured in the same run.

  /usr/bin/python3 bench/python_fetch_bench.py [--ranks 2] [--dtype keep] [--rounds 5]
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
sys.path.insert(0, HERE)
import fetch_bench  # noqa: E402
from fetch_bench import harness, llama_ckpt  # noqa: E402

WORKER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch, weightd
sock, world, rank, dtype = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
client = weightd.Client(socket=sock)
sys.stdin.readline()
t0 = time.perf_counter()
with client.fetch("llama", world=world, rank=rank, dtype=None if dtype == "keep" else dtype,
                  populate=True) as h:
    sd = h.state_dict()
    total = 0
    for t in sd.values():  # one element per 4 KiB page: the shard is then resident for us
        flat = t.view(-1)
        if flat.numel():
            total += float(flat[:: max(1, 4096 // t.element_size())].float().sum())
    t1 = time.perf_counter()
print(json.dumps({"rank": rank, "ready_s": t1 - t0, "tensors": len(sd)}))
"""


def run_python_workers(d, world, dtype):
    procs = [subprocess.Popen(["/usr/bin/python3", "-c", WORKER, os.path.join(harness.BUILD, "python"),
                               d.socket, str(world), str(r), dtype],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for r in range(world)]
    time.sleep(3.0)  # imports done before the start signal, as for the baseline
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    return max(json.loads(p.communicate()[0])["ready_s"] for p in procs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dtype", default="keep")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ckpt-dir", default=os.path.join(HERE, "out", "tinyllama-bf16"))
    args = ap.parse_args()
    path = llama_ckpt.ensure_checkpoint(args.ckpt_dir)
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass
    with tempfile.TemporaryDirectory(prefix="weightd-pybench-") as tmp:
        d = harness.Daemon(model_root=args.ckpt_dir, workdir=tmp)
        d.start()
        try:
            d.ctl_ok("load", "llama", path)
            run_python_workers(d, args.ranks, args.dtype)  # warm
            wd = [run_python_workers(d, args.ranks, args.dtype) for _ in range(args.rounds)]
        finally:
            d.stop()
    base = [fetch_bench.run_baseline(path, args.ranks, args.dtype)[0] for _ in range(args.rounds)]
    wd_med, base_med = statistics.median(wd), statistics.median(base)
    print("python workers via weightd (%d ranks, dtype %s): median %.4f s [%s]" % (
        args.ranks, args.dtype, wd_med, ", ".join("%.4f" % x for x in wd)))
    print("PyTorch baseline (mmap+cast+chunk+clone): median %.4f s [%s]" % (
        base_med, ", ".join("%.4f" % x for x in base)))
    print("speedup: %.1fx" % (base_med / wd_med))
    print(json.dumps({"figure": "python_ready_state_dict", "ranks": args.ranks, "dtype": args.dtype,
                      "weightd_s": wd, "baseline_s": base, "speedup": base_med / wd_med}))


if __name__ == "__main__":
    main()

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

BASELINE = r"""
import json, mmap, os, struct, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
path, world, rank, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
DT = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
want = {"keep": None, "bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[dtype]
sys.stdin.readline()  # start signal: both ranks begin together
t0 = time.perf_counter()
with open(path, "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(n))
    mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE)
base = 8 + n
shard, nbytes = {}, 0
for name, e in header.items():
    if name == "__metadata__":
        continue
    b, end = e["data_offsets"]
    t = torch.frombuffer(mm, dtype=DT[e["dtype"]], count=(end - b) // torch.tensor([], dtype=DT[e["dtype"]]).element_size(), offset=base + b).reshape(e["shape"])
    if want is not None:
        t = t.to(want)
    pieces = torch.chunk(t, world, 0) if t.dim() > 0 else [t] * world
    mine = pieces[rank] if rank < len(pieces) else t[0:0]
    shard[name] = mine.clone()
    nbytes += shard[name].numel() * shard[name].element_size()
t1 = time.perf_counter()
print(json.dumps({"rank": rank, "ready_s": t1 - t0, "bytes": nbytes}))
"""


def run_baseline(path, world, dtype):
    procs = [subprocess.Popen(["/usr/bin/python3", "-c", BASELINE, path, str(world), str(r), dtype],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for r in range(world)]
    time.sleep(3.0)  # let every rank import torch before the start signal
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    results = [json.loads(p.communicate()[0]) for p in procs]
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

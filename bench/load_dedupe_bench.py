#!/usr/bin/python3
"""Loading a fine-tune beside its base: what per-tensor sharing at load
costs in time and saves in memory.

The base is bench/suite.py's Llama-shaped bf16 checkpoint (`--config`); the
fine-tune is the same file with tensors making up a `--changed` fraction of
its bytes perturbed (in name order, each that still fits), written as
another file. Measured in
the same run, interleaved, `--repeats` times, each in a fresh daemon:

  alone    load the fine-tune into an empty daemon: time of the load,
           growth of bytes_resident (what the daemon holds after it)
  beside   load the base, then the fine-tune: time of the fine-tune's load
           (read, digest, find the base's tensors, move the rest to a
           segment of its size, free what was read), growth of
           bytes_resident and of checkpoint_bytes_resident

Page cache warm for both files (each is read once before the first round).

  bench/load_dedupe_bench.py [--config 0.3g] [--changed 0.1] [--repeats 3]
                             [--build build-rel] [--out FILE]
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="0.3g")
    ap.add_argument("--changed", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--build", default=os.path.join(REPO, "build-rel"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(args.build, "python"))
    sys.path.insert(0, os.path.join(REPO, "tests", "parity"))
    import suite
    import st_io
    import torch

    base_path = suite.checkpoint(args.config)
    tmp = tempfile.mkdtemp(prefix="weightd-load-dedupe-bench-")
    models = os.path.join(tmp, "models")
    os.makedirs(models)
    base_file = os.path.join(models, "base.safetensors")
    ft_file = os.path.join(models, "ft.safetensors")
    shutil.copy(base_path, base_file)
    base = st_io.load(base_path)
    names = sorted(base)
    size = {n: t.numel() * t.element_size() for n, t in base.items()}
    budget = args.changed * sum(size.values())
    changed = []  # in name order, each that still fits the budget
    for n in names:
        if size[n] <= budget:
            changed.append(n)
            budget -= size[n]
    k = len(changed)
    g = torch.Generator().manual_seed(1)
    ft = dict(base)
    for n in changed:
        t = base[n]
        ft[n] = (t.float() + 0.05 * torch.randn(t.shape, generator=g)).to(t.dtype)
    st_io.save(ft, ft_file)
    changed_bytes = sum(size[n] for n in changed)
    ft_bytes = sum(t.numel() * t.element_size() for t in ft.values())
    del base, ft
    for f in (base_file, ft_file):
        suite.warm_cache(f)
    results = {"config": args.config, "changed_fraction": args.changed, "tensors": len(names),
               "changed_tensors": k, "ft_bytes": ft_bytes, "changed_bytes": changed_bytes,
               "facts": suite.machine_facts(args.build), "runs": []}

    def daemon_round(preload):
        with suite.fresh_daemon(args.build, tmp, models) as c:
            if preload:
                c.load("base", base_file)
            s0 = c.stats()
            t0 = time.perf_counter()
            c.load("ft", ft_file)
            seconds = time.perf_counter() - t0
            time.sleep(0.3)  # freed segments are unmapped off the load's path
            s1 = c.stats()
            return {"seconds": seconds,
                    "resident_growth": s1["bytes_resident"] - s0["bytes_resident"],
                    "checkpoint_growth": s1["checkpoint_bytes_resident"] -
                    s0["checkpoint_bytes_resident"]}

    try:
        for rep in range(args.repeats):
            run = {"alone": daemon_round(False), "beside": daemon_round(True)}
            results["runs"].append(run)
            suite.log("round %d: alone %.3f s +%.0f MiB, beside %.3f s +%.0f MiB" % (
                rep, run["alone"]["seconds"], run["alone"]["resident_growth"] / 2**20,
                run["beside"]["seconds"], run["beside"]["resident_growth"] / 2**20))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def med(which, key):
        return statistics.median(r[which][key] for r in results["runs"])

    results["summary"] = {
        "alone_seconds": med("alone", "seconds"),
        "beside_seconds": med("beside", "seconds"),
        "time_ratio_beside_vs_alone": med("beside", "seconds") / med("alone", "seconds"),
        "alone_resident_growth": med("alone", "resident_growth"),
        "beside_resident_growth": med("beside", "resident_growth"),
        "memory_ratio_beside_vs_alone":
            med("beside", "resident_growth") / med("alone", "resident_growth"),
        "beside_growth_vs_changed_bytes": med("beside", "resident_growth") / changed_bytes,
    }
    text = json.dumps(results, indent=1)
    print(json.dumps(results["summary"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""A host push that casts as it writes (FetchRequest.defer_casts, the
clients' default for pushes) against one that has the daemon materialize
the cast shard first (cast_on_push=False), in the same run.

The checkpoint is bench/suite.py's Llama-shaped BF16 one (`--config`); every
rank of a `--world` mesh pushes its shard as `--dtype` (F32 by default: a
widening cast, the GPU case's common one) into memory of its own, one rank
after another. Each round runs each mode in a fresh daemon (interleaved,
page cache warm):

  first   the world's first pushes: time, and the growth of the daemon's
          bytes_resident (the cast copies it keeps, shared by later fetches)
  again   the same pushes once more: a cache hit for cast-at-fetch (the copy
          is kept), a second cast for cast-on-push

With --lora-rank R a rank-R PEFT adapter on every projection (bench/
lora_bench.py's) is applied first, and a third mode joins: merge-on-push
(defer_merges: the patched tensors merged element by element as they are
written, the GPU push's merge run by its host twin on the CPU), against the
materializer's vectorized merge (cast-at-fetch) and cast-on-push (which
materializes the patched tensors, casts the rest as it writes).

  bench/push_cast_bench.py [--config 0.3g] [--world 2] [--dtype f32]
                           [--lora-rank R] [--repeats 3] [--build build]
                           [--out FILE]
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
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dtype", default="f32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lora-rank", type=int, default=0)
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(args.build, "python"))
    import suite

    path = suite.checkpoint(args.config)
    tmp = tempfile.mkdtemp(prefix="weightd-push-cast-bench-")
    models = os.path.join(tmp, "models")
    os.makedirs(models)
    model_file = os.path.join(models, "m.safetensors")
    shutil.copy(path, model_file)
    suite.warm_cache(model_file)
    adapter_dir = None
    if args.lora_rank:
        import lora_bench
        import st_io
        shapes = [(n, tuple(t.shape)) for n, t in st_io.load(model_file).items()
                  if t.dim() == 2]
        adapter_dir = os.path.join(models, "adapter")
        lora_bench.make_adapter(adapter_dir, shapes, args.lora_rank, 3)
    modes = {"cast_at_fetch": (False, False), "cast_on_push": (True, False)}
    if args.lora_rank:
        modes["merge_on_push"] = (True, True)
    results = {"config": args.config, "world": args.world, "dtype": args.dtype,
               "lora_rank": args.lora_rank,
               "checkpoint_bytes": os.path.getsize(model_file),
               "facts": suite.machine_facts(args.build), "runs": []}

    def pushes(c, mode):
        cast_on_push, merge_on_push = modes[mode]
        t0 = time.perf_counter()
        nbytes = 0
        for rank in range(args.world):
            with c.fetch("m", world=args.world, rank=rank, dtype=args.dtype, mode="push",
                         cast_on_push=cast_on_push, merge_on_push=merge_on_push) as h:
                nbytes += sum(m.length for m in h.tensors)
        return time.perf_counter() - t0, nbytes

    def daemon_round(mode):
        with suite.fresh_daemon(args.build, tmp, models) as c:
            c.load("m", model_file)
            if adapter_dir:
                c.load_adapter("a", adapter_dir)
                c.apply("m", ["a"])
            s0 = c.stats()
            first, nbytes = pushes(c, mode)
            s1 = c.stats()
            again, _ = pushes(c, mode)
            return {"first_seconds": first, "again_seconds": again, "pushed_bytes": nbytes,
                    "resident_growth": s1["bytes_resident"] - s0["bytes_resident"],
                    "materialization_bytes": s1["materialization_bytes"] -
                    s0["materialization_bytes"]}

    try:
        for rep in range(args.repeats):
            run = {mode: daemon_round(mode) for mode in modes}
            results["runs"].append(run)
            suite.log("round %d: %s" % (rep, "; ".join(
                "%s %.3f s (again %.3f s) +%.0f MiB" % (
                    mode.replace("_", " "), r["first_seconds"], r["again_seconds"],
                    r["resident_growth"] / 2**20) for mode, r in run.items())))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def med(which, key):
        return statistics.median(r[which][key] for r in results["runs"])

    pushed = results["runs"][0]["cast_on_push"]["pushed_bytes"]
    results["summary"] = {
        "pushed_bytes": pushed,
        "first_seconds_cast_at_fetch": med("cast_at_fetch", "first_seconds"),
        "first_seconds_cast_on_push": med("cast_on_push", "first_seconds"),
        "first_speedup_cast_on_push": med("cast_at_fetch", "first_seconds") /
        med("cast_on_push", "first_seconds"),
        "again_seconds_cast_at_fetch": med("cast_at_fetch", "again_seconds"),
        "again_seconds_cast_on_push": med("cast_on_push", "again_seconds"),
        "again_ratio_cast_on_push_vs_at_fetch": med("cast_on_push", "again_seconds") /
        med("cast_at_fetch", "again_seconds"),
        "resident_growth_cast_at_fetch": med("cast_at_fetch", "resident_growth"),
        "resident_growth_cast_on_push": med("cast_on_push", "resident_growth"),
    }
    if args.lora_rank:
        results["summary"].update({
            "first_seconds_merge_on_push": med("merge_on_push", "first_seconds"),
            "first_ratio_merge_on_push_vs_cast_at_fetch": med("merge_on_push", "first_seconds") /
            med("cast_at_fetch", "first_seconds"),
            "again_seconds_merge_on_push": med("merge_on_push", "again_seconds"),
            "resident_growth_merge_on_push": med("merge_on_push", "resident_growth"),
        })
    print(json.dumps(results["summary"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()

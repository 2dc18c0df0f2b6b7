#!/usr/bin/python3
"""One RL step: a trainer has new weights for a served model; how long until
workers are served them, and what must move.

Measured in the same run, on one daemon, interleaved, `--repeats` times:

  reload        today without publish: the trainer writes a safetensors
                file, the operator unloads the model and loads the file
                (weightctl unload + load), from the write's start to the
                load's end (page cache warm: the file was just written)
  publish_all   client.publish(model, state_dict) with every tensor changed
                (gRPC stream from the trainer's memory, digests, generation)
  publish_10    the same state_dict where only 10% of the tensors changed
                (the trainer sends all; the daemon keeps the unchanged ones'
                bytes and digests)

and the worker's refresh after publish_10: a fetch with changed_since (the
tensors that changed) against a full fetch (world 1, shm, bytes served).

  bench/publish_bench.py [--config 0.3g] [--repeats 3] [--build build-rel] [--out FILE]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="0.3g")
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
    import weightd

    path = suite.checkpoint(args.config)
    nbytes = os.path.getsize(path)
    weightd_bin = os.path.join(args.build, "bin", "weightd")
    weightctl = os.path.join(args.build, "bin", "weightctl")
    tmp = tempfile.mkdtemp(prefix="weightd-publish-bench-")
    sock = os.path.join(tmp, "w.sock")
    out_dir = os.path.join(tmp, "models")
    os.makedirs(out_dir)
    shutil.copy(path, os.path.join(out_dir, "model.safetensors"))
    proc = subprocess.Popen([weightd_bin, "--socket", sock, "--model-root", out_dir,
                             "--huge-pages", "off"],
                            stdout=open(os.path.join(tmp, "log"), "wb"), stderr=subprocess.STDOUT)
    results = {"config": args.config, "checkpoint_bytes": nbytes, "facts": suite.machine_facts(args.build),
               "runs": []}
    try:
        deadline = time.time() + 30
        while not os.path.exists(sock) and time.time() < deadline:
            time.sleep(0.05)
        c = weightd.Client(socket=sock, retry_deadline=30)
        c.health()

        def ctl(*a):
            subprocess.run([weightctl, "--socket", sock, *a], check=True, capture_output=True)

        ctl("load", "m", os.path.join(out_dir, "model.safetensors"))
        base = st_io.load(path)
        names = sorted(base)
        g = torch.Generator().manual_seed(1)

        current = dict(base)  # what the daemon serves

        def step(changed_fraction):
            """The next state_dict: a `changed_fraction` of the tensors perturbed."""
            k = max(1, int(len(names) * changed_fraction))
            new = dict(current)
            for n in names[:k]:
                t = current[n]
                new[n] = (t.float() + 0.05 * torch.randn(t.shape, generator=g)).to(t.dtype)
            return new, k

        for rep in range(args.repeats):
            run = {}
            new, _ = step(1.0)
            # reload: write the file, unload, load.
            t0 = time.perf_counter()
            fresh = os.path.join(out_dir, "step.safetensors")
            st_io.save(new, fresh)
            ctl("unload", "m")
            ctl("load", "m", fresh)
            run["reload_s"] = time.perf_counter() - t0
            current = new
            # publish_all
            new, _ = step(1.0)
            t0 = time.perf_counter()
            r = c.publish("m", new)
            run["publish_all_s"] = time.perf_counter() - t0
            run["publish_all_changed"] = r.changed
            current = new
            # publish_10
            new, k = step(0.10)
            gen_before = c.info("m").generation
            t0 = time.perf_counter()
            r = c.publish("m", new)
            run["publish_10_s"] = time.perf_counter() - t0
            run["publish_10_changed"] = r.changed
            run["publish_10_bytes_stored"] = r.bytes_stored
            assert r.changed == k, (r.changed, k)
            current = new
            # The worker's refresh.
            t0 = time.perf_counter()
            with c.fetch("m", world=1, rank=0, changed_since=gen_before) as h:
                run["refresh_bytes"] = h.nbytes
                run["refresh_tensors"] = len(h)
            run["refresh_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            with c.fetch("m", world=1, rank=0) as h:
                run["full_fetch_bytes"] = h.nbytes
            run["full_fetch_s"] = time.perf_counter() - t0
            results["runs"].append(run)
            print("rep %d: %s" % (rep, json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                                   for k, v in run.items()})), flush=True)
            os.unlink(fresh)

        def med(key):
            return statistics.median(r[key] for r in results["runs"])
        results["median"] = {k: med(k) for k in results["runs"][0]}
        m = results["median"]
        results["ratios"] = {
            "reload_over_publish_all": m["reload_s"] / m["publish_all_s"],
            "reload_over_publish_10": m["reload_s"] / m["publish_10_s"],
            "refresh_bytes_fraction": m["refresh_bytes"] / m["full_fetch_bytes"],
            "publish_all_gb_per_s": nbytes / m["publish_all_s"] / 1e9,
        }
        print(json.dumps(results["ratios"], indent=1))
        c.close()
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

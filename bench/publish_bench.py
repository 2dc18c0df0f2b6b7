#!/usr/bin/python3
"""One RL step: a trainer has new weights for a served model; how long until
workers are served them, and what must move.

Measured in the same run, on one daemon, interleaved, `--repeats` times:

  reload        today without publish: the trainer writes a safetensors
                file, the operator unloads the model and loads the file
                (weightctl unload + load), from the write's start to the
                load's end (page cache warm: the file was just written)
  memcpy        copying the trainer's tensors into one pre-faulted buffer
                of their size (NumPy): the bandwidth floor of any publish
  publish_first client.publish(model, state_dict) with every tensor changed,
                transport "shm": each tensor copied once, straight into the
                daemon's staging memfd, then digested and made a generation;
                the model's first publish since its load, so the daemon
                allocates and faults in the staging when the session begins
  publish_all_grpc  the same, streamed over gRPC in 4 MiB chunks
  publish_all   publish_first again, 0.5 s after the previous publish (a
                trainer's step is longer): the steady state of an RL loop,
                where the daemon prepared this staging after the previous
                publish (--publish-staging-ahead, on by default)
  publish_10    the same state_dict where only 10% of the tensors changed
                (the trainer sends all; the daemon keeps the unchanged ones'
                bytes and digests), transport "shm"
  inproc_step   the in-process way of one RL step: the trainer torch.save()s
                the state dict to /dev/shm, then 2 workers (one after the
                other, in this process) torch.load() it and torch.chunk() out
                their rank's shard (world 2)
  step_10       publish_10, then the same 2 workers refresh: each fetches
                its rank's changed tensors (changed_since, world 2, shm) as a
                state dict
  step_10_bytes step_10 where the changed tensors hold 10% of the bytes
                (10% of the tensors, above, include the embeddings: about half
                of them), 0.5 s after the previous publish

and the worker's refresh after publish_10: a fetch with changed_since (the
tensors that changed) against a full fetch (world 1, shm, bytes served).

  bench/publish_bench.py [--config 0.3g] [--repeats 3] [--build build-rel] [--out FILE]
                         [--huge-pages off|require]

--huge-pages require adds 2 MiB pages to the hugetlb pool for the run (root;
given back after) and runs the daemon with --huge-pages require, so its
staging, repacked and checkpoint segments are hugetlb: on these VMs the
first write to each 4 KiB page through a new mapping costs ~5 us even when
the page is resident and the mapping populated, which 2 MiB pages pay 512
times less often.
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

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="0.3g")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--build", default=os.path.join(REPO, "build-rel"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--huge-pages", choices=["off", "require"], default="off")
    args = ap.parse_args()
    if args.huge_pages == "require":
        sys.path.insert(0, HERE)
        import suite
        path = suite.checkpoint(args.config)
        # The checkpoint and up to 5 generations' worth of staging and
        # repacked segments (freed lazily).
        pages = 6 * (-(-os.path.getsize(path) // (2 << 20))) + 64
        with suite.HugetlbPool(pages) as pool:
            if pool.granted < pages:
                sys.exit("the kernel gave %d of %d 2 MiB pages" % (pool.granted, pages))
            run(args)
    else:
        run(args)


def run(args):
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
                             "--huge-pages", args.huge_pages],
                            stdout=open(os.path.join(tmp, "log"), "wb"), stderr=subprocess.STDOUT)
    results = {"config": args.config, "huge_pages": args.huge_pages, "checkpoint_bytes": nbytes, "facts": suite.machine_facts(args.build),
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

        size = {n: base[n].numel() * base[n].element_size() for n in names}

        def step_bytes(fraction):
            """The next state_dict: tensors holding `fraction` of the bytes perturbed."""
            budget = fraction * sum(size.values())
            new = dict(current)
            k = 0
            for n in names:
                if size[n] <= budget:
                    budget -= size[n]
                    t = current[n]
                    new[n] = (t.float() + 0.05 * torch.randn(t.shape, generator=g)).to(t.dtype)
                    k += 1
            return new, k

        def rl_step(new, k):
            """Publishes `new` (k tensors changed) in place, then 2 workers
            fetch their rank's changed tensors: (result, publish seconds,
            step seconds)."""
            gen_before = c.info("m").generation
            t0 = time.perf_counter()
            r = c.publish("m", new, transport="shm")
            published = time.perf_counter() - t0
            assert r.changed == k, (r.changed, k)
            for rank in range(2):
                with c.fetch("m", world=2, rank=rank, changed_since=gen_before) as h:
                    sd = h.state_dict()
                    assert len(sd) == k, (len(sd), k)
                    del sd
            return r, published, time.perf_counter() - t0

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
            # memcpy: the trainer's bytes into one pre-faulted buffer.
            new, _ = step(1.0)
            flat = [t.reshape(-1).view(torch.uint8).numpy() for t in new.values()]
            dest = np.ones(sum(a.size for a in flat), np.uint8)
            t0 = time.perf_counter()
            at = 0
            for a in flat:
                dest[at:at + a.size] = a
                at += a.size
            run["memcpy_s"] = time.perf_counter() - t0
            del dest, flat
            # publish_first (shm, the first publish since the load), then
            # over gRPC, then publish_all (shm, the staging prepared ahead)
            t0 = time.perf_counter()
            r = c.publish("m", new, transport="shm")
            run["publish_first_s"] = time.perf_counter() - t0
            assert r.changed == len(names), r.changed
            current = new
            new, _ = step(1.0)
            t0 = time.perf_counter()
            r = c.publish("m", new, transport="grpc")
            run["publish_all_grpc_s"] = time.perf_counter() - t0
            assert r.changed == len(names), r.changed
            current = new
            new, _ = step(1.0)
            time.sleep(0.5)  # a trainer's step: the daemon prepares the next staging
            t0 = time.perf_counter()
            r = c.publish("m", new, transport="shm")
            run["publish_all_s"] = time.perf_counter() - t0
            run["publish_all_changed"] = r.changed
            current = new
            # inproc_step: torch.save to /dev/shm, 2 workers torch.load + chunk.
            new, k = step(0.10)
            t0 = time.perf_counter()
            shm_file = os.path.join("/dev/shm", "weightd-bench-%d.pt" % os.getpid())
            torch.save(new, shm_file)
            for rank in range(2):
                sd = torch.load(shm_file)
                shard = {n: torch.chunk(t, 2, 0)[rank] if t.dim() else t for n, t in sd.items()}
                del sd, shard
            run["inproc_step_s"] = time.perf_counter() - t0
            os.unlink(shm_file)
            # publish_10 and the 2 workers' refresh (step_10)
            gen_before = c.info("m").generation
            r, run["publish_10_s"], run["step_10_s"] = rl_step(new, k)
            run["publish_10_changed"] = r.changed
            run["publish_10_bytes_stored"] = r.bytes_stored
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
            # step_10_bytes: step_10 where the changed tensors hold 10% of
            # the bytes (in name order, each that still fits; 10% of the
            # tensors above includes the embeddings, about half the bytes),
            # 0.5 s after the previous publish as in an RL loop.
            new, kb = step_bytes(0.10)
            time.sleep(0.5)
            r, run["publish_10_bytes_s"], run["step_10_bytes_s"] = rl_step(new, kb)
            run["step_10_bytes_changed"] = r.changed
            run["step_10_bytes_stored"] = r.bytes_stored
            current = new
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
            "publish_all_over_memcpy_bandwidth": m["memcpy_s"] / m["publish_all_s"],
            "publish_first_over_memcpy_bandwidth": m["memcpy_s"] / m["publish_first_s"],
            "grpc_over_shm_publish_all": m["publish_all_grpc_s"] / m["publish_all_s"],
            "inproc_step_over_step_10": m["inproc_step_s"] / m["step_10_s"],
            "inproc_step_over_step_10_bytes": m["inproc_step_s"] / m["step_10_bytes_s"],
            "refresh_bytes_fraction": m["refresh_bytes"] / m["full_fetch_bytes"],
            "publish_all_gb_per_s": nbytes / m["publish_all_s"] / 1e9,
            "publish_first_gb_per_s": nbytes / m["publish_first_s"] / 1e9,
            "memcpy_gb_per_s": nbytes / m["memcpy_s"] / 1e9,
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

#!/usr/bin/python3
"""Time until a model is servable again after the daemon restarts.

Both ways measured in the same run, interleaved, from the new process's
start to the first shard a worker holds (world 2, rank 0, shm, bf16, page
tables populated):

  manual   today without --state-dir: start weightd, wait for health, an
           operator (here: this script, at once) runs `weightctl load`,
           then the worker fetches
  restore  --state-dir holding the journal of the same load: start weightd,
           it restores (health NOT_SERVING meanwhile); health polled every
           5 ms, then the worker fetches (a client that retries its fetch
           instead adds up to its backoff: at most 2 s with the Python
           client's defaults)

each with the checkpoint warm in the page cache and cold (evicted with
posix_fadvise(DONTNEED), bench/pread_bench --evict). A hand-over to a
successor without reading the checkpoint again is not built yet.

  bench/restart_bench.py [--config 4g] [--repeats 3] [--build build-rel] [--out FILE]
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
    ap.add_argument("--config", default="4g")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--build", default=os.path.join(REPO, "build-rel"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(args.build, "python"))
    import suite
    import weightd

    path = suite.checkpoint(args.config)
    nbytes = os.path.getsize(path)
    weightd_bin = os.path.join(args.build, "bin", "weightd")
    weightctl = os.path.join(args.build, "bin", "weightctl")
    pread = os.path.join(args.build, "bench", "pread_bench")
    tmp = tempfile.mkdtemp(prefix="weightd-restart-bench-")
    state = os.path.join(tmp, "state")
    sock = os.path.join(tmp, "w.sock")

    def start(extra):
        return subprocess.Popen([weightd_bin, "--socket", sock, "--model-root", suite.OUT_DIR,
                                 "--huge-pages", "off", *extra],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(proc):
        proc.terminate()
        proc.wait(timeout=120)

    def wait_socket(proc):
        while not os.path.exists(sock):
            if proc.poll() is not None:
                raise RuntimeError("weightd exited")
            time.sleep(0.002)

    def first_shard():
        with weightd.Client(socket=sock, retry_deadline=600) as c:
            with c.fetch("m", world=2, rank=0, populate=True) as h:
                return len(h.state_dict())

    def manual():
        t0 = time.perf_counter()
        proc = start([])
        try:
            wait_socket(proc)
            serving()
            subprocess.run([weightctl, "--socket", sock, "load", "m", path], check=True,
                           capture_output=True)
            first_shard()
            return time.perf_counter() - t0
        finally:
            stop(proc)

    def serving():
        # Health every 5 ms (no client backoff in the measurement): the
        # first instant the daemon serves.
        with weightd.Client(socket=sock, retry_deadline=0) as c:
            while True:
                try:
                    if c.health(timeout=5):
                        return
                except weightd.Error:
                    time.sleep(0.005)

    def restore():
        t0 = time.perf_counter()
        proc = start(["--state-dir", state])
        try:
            wait_socket(proc)
            serving()
            first_shard()
            return time.perf_counter() - t0
        finally:
            stop(proc)

    # The journal the restores start from.
    proc = start(["--state-dir", state])
    wait_socket(proc)
    with weightd.Client(socket=sock, retry_deadline=60) as c:
        c.health()
    subprocess.run([weightctl, "--socket", sock, "load", "m", path], check=True,
                   capture_output=True)
    stop(proc)
    journal = open(os.path.join(state, "journal"), "rb").read()

    times = {(k, cache): [] for k in ("manual", "restore") for cache in ("warm", "cold")}
    for r in range(args.repeats):
        for cache in ("warm", "cold"):
            for kind, fn in (("manual", manual), ("restore", restore)):
                # Every restore starts from the same one-load journal.
                with open(os.path.join(state, "journal"), "wb") as f:
                    f.write(journal)
                if cache == "cold":
                    subprocess.run([pread, "--evict", path], check=True, capture_output=True)
                else:
                    suite.warm_cache(path)
                times[(kind, cache)].append(fn())
                print("round %d %s %s: %.2f s" % (r + 1, cache, kind, times[(kind, cache)][-1]),
                      file=sys.stderr)
    shutil.rmtree(tmp, ignore_errors=True)
    out = {"config": args.config, "checkpoint_bytes": nbytes, "repeats": args.repeats,
           "seconds": {"%s_%s" % k: {"median": statistics.median(v), "min": min(v),
                                     "max": max(v), "all": v} for k, v in times.items()}}
    for cache in ("warm", "cold"):
        m = out["seconds"]["manual_" + cache]["median"]
        s = out["seconds"]["restore_" + cache]["median"]
        print("| %s, %s page cache | manual reload %.2f s | restore from --state-dir %.2f s "
              "| %.2f× |" % (suite.gib(nbytes), cache, m, s, m / s))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

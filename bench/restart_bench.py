#!/usr/bin/python3
"""Time until a model is servable again after the daemon restarts.

Every way measured in the same run, interleaved, from the new process's
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
posix_fadvise(DONTNEED), bench/pread_bench --evict), and

  handover a daemon serving the model (the previous round's successor) is
           taken over: start weightd --take-over on its sockets and
           --state-dir; it adopts the checkpoint's segments (digests
           checked: --take-over-verify full, and sample) instead of reading
           them; timed to its `taken_over` log line, then the worker
           fetches from it (the page cache does not matter: nothing is read)

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

    def start(extra, on=None, stdout=subprocess.DEVNULL):
        return subprocess.Popen([weightd_bin, "--socket", on or sock, "--model-root",
                                 suite.OUT_DIR, "--huge-pages", "off", *extra],
                                stdout=stdout, stderr=subprocess.STDOUT)

    def stop(proc):
        proc.terminate()
        proc.wait(timeout=120)

    def wait_socket(proc):
        while not os.path.exists(sock):
            if proc.poll() is not None:
                raise RuntimeError("weightd exited")
            time.sleep(0.002)

    def first_shard(on=None):
        with weightd.Client(socket=on or sock, retry_deadline=600) as c:
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

    # The hand-over chain: a daemon serving the model on its own sockets;
    # each round's successor serves the next round's hand-over.
    hsock = os.path.join(tmp, "h.sock")
    hstate = os.path.join(tmp, "hstate")
    holder = [start(["--state-dir", hstate], on=hsock)]
    while not os.path.exists(hsock):
        time.sleep(0.01)
    with weightd.Client(socket=hsock, retry_deadline=60) as c:
        c.health()
    subprocess.run([weightctl, "--socket", hsock, "load", "m", path], check=True,
                   capture_output=True)

    def handover(verify):
        old = holder[0]
        t0 = time.perf_counter()
        proc = start(["--state-dir", hstate, "--take-over", "--take-over-verify", verify,
                      "--log-format", "json"], on=hsock, stdout=subprocess.PIPE)
        for line in proc.stdout:
            if b'"taken_over"' in line:
                break
        else:
            raise RuntimeError("the successor exited without taking over")
        first_shard(on=hsock)
        took = time.perf_counter() - t0
        if old.wait(timeout=120) != 0:
            raise RuntimeError("the old daemon exited %d" % old.returncode)
        # Keep draining the successor's log so it never blocks on a full pipe.
        import threading
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
        holder[0] = proc
        return took

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
    times[("handover", "full")] = []
    times[("handover", "sample")] = []
    for r in range(args.repeats):
        for verify in ("full", "sample"):
            times[("handover", verify)].append(handover(verify))
            print("round %d handover (verify %s): %.2f s"
                  % (r + 1, verify, times[("handover", verify)][-1]), file=sys.stderr)
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
    stop(holder[0])
    shutil.rmtree(tmp, ignore_errors=True)
    out = {"config": args.config, "checkpoint_bytes": nbytes, "repeats": args.repeats,
           "seconds": {"%s_%s" % k: {"median": statistics.median(v), "min": min(v),
                                     "max": max(v), "all": v} for k, v in times.items()}}
    for cache in ("warm", "cold"):
        m = out["seconds"]["manual_" + cache]["median"]
        s = out["seconds"]["restore_" + cache]["median"]
        print("| %s, %s page cache | manual reload %.2f s | restore from --state-dir %.2f s "
              "| %.2f× |" % (suite.gib(nbytes), cache, m, s, m / s))
    for verify in ("full", "sample"):
        h = out["seconds"]["handover_" + verify]["median"]
        m = out["seconds"]["manual_warm"]["median"]
        r = out["seconds"]["restore_warm"]["median"]
        print("| %s, hand-over (verify %s) | %.2f s | %.1f× faster than a warm restore, "
              "%.1f× than a warm manual reload |" % (suite.gib(nbytes), verify, h, r / h, m / h))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

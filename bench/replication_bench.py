#!/usr/bin/python3
"""Replicating a checkpoint to 1, 2 and 3 daemons from a peer, against each
of them reading storage with a cold page cache, and the loopback gRPC floor.

Four daemons on loopback ports know each other (--peers). The source loads
the checkpoint from storage once. Then, in each round, k = 1, 2, 3 of the
others load it at once:

  peers    --source peers: headers and samples from storage, the tensor
           bytes streamed from the source (ReadCheckpoint, --peer-streams
           ranges at once), digested and checked
  storage  --source storage, the file evicted from the page cache first
           (bench/pread_bench --evict: fdatasync + POSIX_FADV_DONTNEED)

and unload it again. The floor, measured in the same run against the same
source: bench/peer_read_floor reads every range of the file through the
same RPC, streams and range size into memory faulted in beforehand, and
does nothing else with the bytes. Goal: one daemon replicating from a peer
at >= 0.7x that floor.

  bench/replication_bench.py [--config 2g] [--repeats 3] [--streams 4]
                             [--daemons 1,2,3] [--build build] [--out FILE]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="2g")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--daemons", default="1,2,3", help="how many load at once, per round")
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ks = [int(k) for k in args.daemons.split(",")]
    if not ks or min(ks) < 1 or max(ks) > 3:
        ap.error("--daemons: numbers from 1 to 3")
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(args.build, "python"))
    import suite
    import weightd
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from harness import free_port

    path = suite.checkpoint(args.config)
    nbytes = os.path.getsize(path)
    weightd_bin = os.path.join(args.build, "bin", "weightd")
    pread = os.path.join(args.build, "bench", "pread_bench")
    floor_bin = os.path.join(args.build, "bench", "peer_read_floor")
    tmp = tempfile.mkdtemp(prefix="weightd-replication-bench-")
    addrs = ["127.0.0.1:%d" % free_port() for _ in range(4)]
    socks = [os.path.join(tmp, "d%d.sock" % i) for i in range(4)]
    procs = []
    # Fleet members of each other (docs/access-control.md, Fleet members).
    token = "bench-fleet-0123456789abcdef"
    tokens = os.path.join(tmp, "fleet.tokens")
    with open(tokens, "w") as f:
        f.write("fleet %s\n" % token)
    for i, addr in enumerate(addrs):
        procs.append(subprocess.Popen(
            [weightd_bin, "--socket", socks[i], "--listen", addr, "--model-root", suite.OUT_DIR,
             "--huge-pages", "off", "--peers", ",".join(a for a in addrs if a != addr),
             "--peer-streams", str(args.streams), "--auth-token-file", tokens,
             "--fleet-members", "token:fleet", "--peer-token-file", tokens],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def client(i):
        return weightd.Client(socket=socks[i], retry_deadline=60)

    def evict():
        subprocess.run([pread, "--evict", path], check=True, capture_output=True)

    def load_all(which, source):
        """Loads the checkpoint on daemons `which` at once; returns the wall
        time and each one's seconds."""
        each = {}
        errors = []

        def one(i):
            t0 = time.perf_counter()
            try:
                with client(i) as c:
                    c.load("m", path, source=source)
                each[i] = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 (reported below)
                errors.append(e)
        t0 = time.perf_counter()
        threads = [threading.Thread(target=one, args=(i,)) for i in which]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        if errors:
            raise errors[0]
        for i in which:
            with client(i) as c:
                c.unload("m")
        return wall, [each[i] for i in which]

    try:
        for i in range(4):
            with client(i) as c:
                c.health()
        evict()
        t0 = time.perf_counter()
        with client(0) as c:
            c.load("m", path, source="storage")
        source_load = time.perf_counter() - t0
        print("source: read %s from storage (cold) in %.2f s" % (suite.gib(nbytes), source_load),
              file=sys.stderr)
        floors, times = [], {}
        for r in range(args.repeats):
            out = subprocess.run([floor_bin, "--peer", addrs[0], "--file", path, "--token", token,
                                  "--streams", str(args.streams), "--repeats", "1"],
                                 check=True, capture_output=True, text=True).stdout
            floors.append(json.loads(out)["gbps"][0])
            print("round %d floor: %.2f GB/s" % (r + 1, floors[-1]), file=sys.stderr)
            for k in ks:
                for source in ("peers", "storage"):
                    if source == "storage":
                        evict()
                    wall, each = load_all(range(1, 1 + k), source)
                    times.setdefault((k, source), []).append(wall)
                    print("round %d k=%d %s: %.2f s (each %s)"
                          % (r + 1, k, source, wall, ", ".join("%.2f" % e for e in each)),
                          file=sys.stderr)
        with client(1) as c:
            stats = c.stats()
        floor = statistics.median(floors)
        result = {"config": args.config, "checkpoint_bytes": nbytes, "repeats": args.repeats,
                  "streams": args.streams, "source_load_seconds": source_load,
                  "floor_gbps": {"median": floor, "all": floors},
                  "seconds": {"%d_%s" % k: {"median": statistics.median(v), "all": v}
                              for k, v in times.items()},
                  "replicator_1_stats": {"load_bytes_peers": stats["load_bytes_peers"],
                                         "load_bytes_storage": stats["load_bytes_storage"]}}
        print("| daemons loading at once | from a peer | from storage, cold cache | "
              "from a peer: GB/s in all | vs the floor |")
        print("|---|---|---|---|---|")
        for k in ks:
            p = result["seconds"]["%d_peers" % k]["median"]
            s = result["seconds"]["%d_storage" % k]["median"]
            agg = k * nbytes / p / 1e9
            print("| %d | %.2f s | %.2f s | %.2f | %.2f× |" % (k, p, s, agg, agg / floor))
        print("loopback gRPC floor (peer_read_floor, %d streams): %.2f GB/s; checkpoint %s"
              % (args.streams, floor, suite.gib(nbytes)))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=120)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""A simulated fleet loading one object-store checkpoint at once (issue 41:
loaders that serve what they have).

Setup (tests/netsim.py, root): a storage network namespace runs
@20minutes/s3rver (tests/sources_servers.py) behind a tc limit on its egress
(--rate); --nodes node namespaces each run one weightd, peers of each other,
each node's egress limited to --node-rate. Bytes leaving storage are read
from its link counter, outside every daemon. In the same run:

  one       one daemon (node0) loads the checkpoint alone (cold)
  all       every daemon loads it at once (cold: each daemon freshly
            started); the time is the last one's
  no_peers  (--no-peers-baseline) the same, with daemons that have no peers:
            what a fleet does without weightd's peer path

Goal (issue 41): `all` within 1.5x the time of `one`, storage sending about
one copy of the checkpoint for the whole fleet. The machine's CPU use
(/proc/stat) during each phase says whether the links or the CPUs were the
limit: every daemon, s3rver and the gRPC streams between them share its
cores.

--huge-pages N (root) adds N 2 MiB hugetlb pages to the pool for the run
(given back at its end) and starts every daemon with --huge-pages require:
loads then write into the pool's pages instead of 4 KiB shmem pages the
kernel clears at each first fault (on this VM about as much CPU as moving
the bytes). Each round then starts with an untimed warm-up load of every
daemon at once: the VM's host backs the pool's pages at their first touch.

  bench/fleet_bench.py [--nodes 8] [--size-mib 256] [--rate 400mbit]
                       [--node-rate 400mbit] [--streams 8] [--chunk-mib 1]
                       [--repeats 2] [--no-peers-baseline] [--huge-pages N]
                       [--build build] [--out bench/fleet_results.json]
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
sys.path.insert(0, os.path.join(REPO, "tests"))
sys.path.insert(0, HERE)

import netsim  # noqa: E402
import sources_servers as ss  # noqa: E402
import hugepages  # noqa: E402
from source_bench import AWS_ENV, counters, log, start_daemon, write_checkpoint  # noqa: E402

BUCKET = "bench"
KEY = "ckpt.safetensors"
PORT = 7461


def start_fleet(args, net, s3, tmp, tag, peers=True):
    addrs = ["%s:%d" % (n.addr, PORT) for n in net.nodes]
    tokens = os.path.join(tmp, "fleet.tokens")
    with open(tokens, "w") as f:
        f.write("fleet bench-fleet-0123456789abcdef\n")
    ds = []
    try:
        for i, node in enumerate(net.nodes):
            extra = ["--model-source", "s3://%s/" % BUCKET, "--s3-endpoint", s3.endpoint,
                     "--source-streams", str(args.streams),
                     "--source-chunk-bytes", str(args.chunk_mib << 20)]
            if peers:
                extra += ["--listen", addrs[i], "--advertise", addrs[i],
                          "--peers", ",".join(a for a in addrs if a != addrs[i]),
                          "--peer-poll-seconds", "1", "--auth-token-file", tokens,
                          "--fleet-members", "token:fleet", "--peer-token-file", tokens,
                          "--allow-insecure-token"]
            ds.append(start_daemon(args.build, node, os.path.join(tmp, "%s%d" % (tag, i)), extra,
                                   huge_pages="require" if args.huge_pages else "off"))
    except BaseException:
        for d in ds:
            d.stop()
        raise
    return ds


def cpu_busy():
    """(busy, total) jiffies of the whole machine (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def busy_since(start):
    b, t = cpu_busy()
    return (b - start[0]) / max(1, t - start[1])


def load_at_once(ds, url):
    """Every daemon's load started at once; seconds until each ended."""
    from harness import WEIGHTCTL
    t0 = time.perf_counter()
    procs = [subprocess.Popen([WEIGHTCTL, "--socket", d.socket, "load", "m", url],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for d in ds]
    took = [None] * len(procs)
    while any(t is None for t in took):
        for i, p in enumerate(procs):
            if took[i] is None and p.poll() is not None:
                took[i] = time.perf_counter() - t0
                if p.returncode != 0:
                    raise RuntimeError("load on daemon %d failed: %s" % (i, p.stderr.read()))
        time.sleep(0.02)
    return took


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--rate", default="400mbit")
    ap.add_argument("--node-rate", default="400mbit")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--chunk-mib", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-peers-baseline", action="store_true")
    ap.add_argument("--build", default=os.environ.get("WEIGHTD_BUILD", os.path.join(REPO, "build")))
    ap.add_argument("--huge-pages", type=int, default=0,
                    help="2 MiB hugetlb pages to add to the pool for the daemons (root)")
    ap.add_argument("--out", default=os.path.join(HERE, "fleet_results.json"))
    args = ap.parse_args()
    with hugepages.pool(args.huge_pages, log):
        run_bench(args)


def run_bench(args):
    os.environ["WEIGHTD_BUILD"] = os.path.abspath(args.build)
    ok, why = netsim.available()
    if not ok:
        sys.exit("fleet_bench: " + why)
    tmp = tempfile.mkdtemp(prefix="wd-fleet-bench-")
    ckpt = os.path.join(tmp, KEY)
    log("writing a %d MiB checkpoint" % args.size_mib)
    write_checkpoint(ckpt, args.size_mib)
    nbytes = os.path.getsize(ckpt)
    url = "s3://%s/%s" % (BUCKET, KEY)
    result = {"checkpoint_bytes": nbytes, "nodes": args.nodes, "rate": args.rate,
              "node_rate": args.node_rate, "streams": args.streams, "repeats": args.repeats,
              "chunk_bytes": args.chunk_mib << 20,
              "huge_pages": "require (a pool of %d 2 MiB pages)" % args.huge_pages
              if args.huge_pages else "off",
              "nproc": os.cpu_count(), "runs": []}
    net = netsim.Net(nodes=args.nodes, storage_rate=args.rate, node_rate=args.node_rate)
    s3 = None
    try:
        s3 = ss.S3Server(host=net.storage.addr, prefix=net.storage.prefix).start(timeout=60)
        s3.create_bucket(BUCKET, via=net.storage.prefix)
        s3.put(BUCKET, KEY, path=ckpt, via=net.storage.prefix)
        for r in range(args.repeats):
            run = {}
            if args.huge_pages:
                ds = start_fleet(args, net, s3, tmp, "warm%d-" % r)
                try:
                    run["warmup_all_seconds"] = max(load_at_once(ds, url))
                finally:
                    for d in ds:
                        d.stop()
            ds = start_fleet(args, net, s3, tmp, "one%d-" % r)
            try:
                before = net.storage.tx_bytes()
                cpu = cpu_busy()
                run["one_seconds"] = load_at_once(ds[:1], url)[0]
                run["one_cpu_busy"] = busy_since(cpu)
                run["one_storage_over_checkpoint"] = (net.storage.tx_bytes() - before) / nbytes
            finally:
                for d in ds:
                    d.stop()
            ds = start_fleet(args, net, s3, tmp, "all%d-" % r)
            try:
                before = net.storage.tx_bytes()
                cpu = cpu_busy()
                took = load_at_once(ds, url)
                run["all_cpu_busy"] = busy_since(cpu)
                run["all_seconds"] = max(took)
                run["all_each_seconds"] = took
                run["all_storage_over_checkpoint"] = (net.storage.tx_bytes() - before) / nbytes
                run["all_counters"] = [counters(d) for d in ds]
            finally:
                for d in ds:
                    d.stop()
            if args.no_peers_baseline:
                ds = start_fleet(args, net, s3, tmp, "np%d-" % r, peers=False)
                try:
                    before = net.storage.tx_bytes()
                    run["no_peers_seconds"] = max(load_at_once(ds, url))
                    run["no_peers_storage_over_checkpoint"] = (
                        (net.storage.tx_bytes() - before) / nbytes)
                finally:
                    for d in ds:
                        d.stop()
            run["all_over_one"] = run["all_seconds"] / run["one_seconds"]
            log("round %d: one %.2f s (storage %.3fx, CPU %.0f%% busy); all %d at once %.2f s = "
                "%.2fx one (storage %.3fx, CPU %.0f%% busy)%s" % (
                    r + 1, run["one_seconds"], run["one_storage_over_checkpoint"],
                    100 * run["one_cpu_busy"], args.nodes, run["all_seconds"],
                    run["all_over_one"], run["all_storage_over_checkpoint"],
                    100 * run["all_cpu_busy"],
                    "; no peers %.2f s (storage %.3fx)" % (
                        run["no_peers_seconds"], run["no_peers_storage_over_checkpoint"])
                    if args.no_peers_baseline else ""))
            result["runs"].append(run)
        result["all_over_one_median"] = statistics.median(x["all_over_one"] for x in result["runs"])
        result["all_storage_over_checkpoint_median"] = statistics.median(
            x["all_storage_over_checkpoint"] for x in result["runs"])
    finally:
        if s3 is not None:
            s3.stop()
        net.close()
        shutil.rmtree(tmp, ignore_errors=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
        f.write("\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()

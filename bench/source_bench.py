#!/usr/bin/python3
"""Cold loads straight from an S3-compatible server (issue 42), against the
link rate and against download-then-load, and a fleet reading one
object-store checkpoint from storage once.

Setup (tests/netsim.py, root): a storage network namespace runs
@20minutes/s3rver (tests/sources_servers.py) behind a tc tbf limit on its
egress (--rate); node namespaces run weightd. In the same run:

  link      iperf3 -R from a node to the storage namespace (--iperf-seconds)
  daemon    `weightctl load m s3://bench/ckpt.safetensors` on node0: the
            daemon streams ranged GETs (--source-streams) into its segments
  baseline  on node0: `curl --aws-sigv4 -o FILE` (one stream, as an init
            container would) then `weightctl load m FILE` (FILE in the page
            cache: the baseline's most favourable case)
  fleet     three daemons in three namespaces, peers of each other: node0
            loads from s3, then node1 and node2 load the same URL (--source
            auto); the storage namespace's link counter (read from outside)
            says how many bytes left storage in all

With --flow-rate R each storage connection is also paced to R (netsim's
per-connection HTB classes), as object stores serve one connection well
below a node's link (S3: tens of MB/s each); the link is then iperf3 with
--streams connections, and the baseline's one curl stream gets R.

Goals (issue 42): daemon >= 0.8x link; daemon >= 1.5x faster than baseline;
fleet storage bytes ~= 1x the checkpoint.

  bench/source_bench.py [--size-mib 512] [--rate 1gbit] [--flow-rate R] [--repeats 3]
                        [--streams 8] [--no-fleet] [--build build]
                        [--out bench/source_results.json]
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
sys.path.insert(0, os.path.join(REPO, "tests", "parity"))

import netsim  # noqa: E402
import sources_servers as ss  # noqa: E402

AWS_ENV = {"AWS_ACCESS_KEY_ID": ss.S3_KEY, "AWS_SECRET_ACCESS_KEY": ss.S3_SECRET,
           "AWS_REGION": ss.S3_REGION}
BUCKET = "bench"
KEY = "ckpt.safetensors"


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def summary(values):
    return {"median": statistics.median(values), "all": values}


def write_checkpoint(path, size_mib):
    """bf16 tensors of 32 MiB each (the last smaller), normal values."""
    import torch
    import st_io
    g = torch.Generator().manual_seed(42)
    tensors, left, i = {}, size_mib << 20, 0
    while left > 0:
        n = min(32 << 20, left) // 2
        tensors["layers.%d.weight" % i] = torch.randn(n, generator=g).to(torch.bfloat16)
        left -= n * 2
        i += 1
    st_io.save(tensors, path)


def start_daemon(build, node, workdir, extra, huge_pages="off"):
    from harness import Daemon
    d = Daemon(workdir=workdir, prefix=node.prefix, extra_args=["--huge-pages", huge_pages] + extra)
    saved = dict(os.environ)
    os.environ.update(AWS_ENV)
    try:
        d.start(timeout=60)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return d


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def iperf(net, seconds, streams=1):
    """Bytes/s from the storage namespace to node0 (iperf3 -R, `streams`
    connections), through the same shaped link the object store's bytes
    take."""
    srv = net.storage.popen(["iperf3", "-s", "-1", "-B", net.storage.addr],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            r = net.nodes[0].run(["iperf3", "-c", net.storage.addr, "-R", "-t", str(seconds),
                                  "-P", str(streams), "-J"])
            if r.returncode == 0:
                break
            time.sleep(0.2)
        else:
            raise RuntimeError("iperf3 failed: " + r.stdout[-500:] + r.stderr[-500:])
    finally:
        if srv.poll() is None:
            srv.terminate()
            srv.wait(timeout=10)
    j = json.loads(r.stdout)
    return j["end"]["sum_received"]["bits_per_second"] / 8


def counters(d):
    out = d.ctl_ok("stats").stdout
    s = {k.strip(): v.strip() for k, v in (l.split(":", 1) for l in out.splitlines() if ":" in l)}
    return {k: int(v) for k, v in s.items()
            if k.startswith(("source_", "load_bytes_")) and v.isdigit()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--rate", default="1gbit", help="tc rate of the storage's egress")
    ap.add_argument("--flow-rate", default=None,
                    help="also pace each storage connection to this rate (an object store's "
                         "per-connection limit); the link is then iperf3 with --streams "
                         "connections")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--iperf-seconds", type=int, default=3)
    ap.add_argument("--no-fleet", action="store_true")
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--out", default=os.path.join(HERE, "source_results.json"))
    ap.add_argument("--label", default=None, help="key of this run in --out (default: RATE)")
    args = ap.parse_args()
    os.environ["WEIGHTD_BUILD"] = os.path.abspath(args.build)  # read by tests/harness.py
    ok, why = netsim.available()
    if not ok:
        sys.exit("source_bench: " + why)
    tmp = tempfile.mkdtemp(prefix="weightd-source-bench-")
    ckpt = os.path.join(tmp, KEY)
    log("writing a %d MiB checkpoint" % args.size_mib)
    write_checkpoint(ckpt, args.size_mib)
    nbytes = os.path.getsize(ckpt)
    result = {"checkpoint_bytes": nbytes, "rate": args.rate, "flow_rate": args.flow_rate,
              "streams": args.streams,
              "repeats": args.repeats, "s3_server": "@20minutes/s3rver 5.0.0 (node %s)" %
              subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip(),
              "nproc": os.cpu_count()}
    daemons = []
    net = netsim.Net(nodes=3 if not args.no_fleet else 1, storage_rate=args.rate,
                     storage_flow_rate=args.flow_rate)
    s3 = None
    try:
        s3 = ss.S3Server(host=net.storage.addr, prefix=net.storage.prefix).start(timeout=60)
        s3.create_bucket(BUCKET, via=net.storage.prefix)
        etag = s3.put(BUCKET, KEY, path=ckpt, via=net.storage.prefix)
        log("uploaded %d bytes to s3://%s/%s (ETag %s)" % (nbytes, BUCKET, KEY, etag))
        # The link: what as many connections as the daemon opens get (one
        # is all of it when connections are not paced).
        link_streams = args.streams if args.flow_rate else 1
        link = iperf(net, args.iperf_seconds, link_streams)
        result["link_bytes_per_s"] = link
        result["link_iperf3_streams"] = link_streams
        if args.flow_rate:
            result["one_connection_bytes_per_s"] = iperf(net, args.iperf_seconds, 1)
        log("link (iperf3 -R -P %d, %s, per connection %s): %.1f MB/s"
            % (link_streams, args.rate, args.flow_rate or "-", link / 1e6))

        src = ["--model-source", "s3://%s/" % BUCKET, "--s3-endpoint", s3.endpoint,
               "--source-streams", str(args.streams)]
        d0 = start_daemon(args.build, net.nodes[0], os.path.join(tmp, "d0"), src)
        daemons.append(d0)
        url = "s3://%s/%s" % (BUCKET, KEY)
        local = os.path.join(d0.model_root, "dl.safetensors")
        dl = lambda: net.nodes[0].run(  # noqa: E731
            ["curl", "-sS", "--fail", "--aws-sigv4", "aws:amz:%s:s3" % ss.S3_REGION,
             "--user", "%s:%s" % (ss.S3_KEY, ss.S3_SECRET),
             "-H", "x-amz-content-sha256: " + ss.EMPTY_SHA256, "-o", local,
             "%s/%s/%s" % (s3.endpoint, BUCKET, KEY)], check=True)
        daemon_s, base_dl_s, base_load_s = [], [], []
        for r in range(args.repeats):
            before = net.storage.tx_bytes()
            daemon_s.append(timed(lambda: d0.ctl_ok("load", "m", url, timeout=1800)))
            sent = net.storage.tx_bytes() - before
            d0.ctl_ok("unload", "m")
            if os.path.exists(local):
                os.unlink(local)
            base_dl_s.append(timed(dl))
            base_load_s.append(timed(lambda: d0.ctl_ok("load", "b", local, timeout=1800)))
            d0.ctl_ok("unload", "b")
            os.unlink(local)
            log("round %d: daemon %.2f s (%.1f MB/s, storage sent %.3fx); curl %.2f s + load "
                "%.2f s" % (r + 1, daemon_s[-1], nbytes / daemon_s[-1] / 1e6, sent / nbytes,
                            base_dl_s[-1], base_load_s[-1]))
        base_s = [a + b for a, b in zip(base_dl_s, base_load_s)]
        dmed = statistics.median(daemon_s)
        result.update({
            "daemon_seconds": summary(daemon_s),
            "baseline_download_seconds": summary(base_dl_s),
            "baseline_load_seconds": summary(base_load_s),
            "baseline_seconds": summary(base_s),
            "daemon_bytes_per_s": nbytes / dmed,
            "daemon_vs_link": nbytes / dmed / link,
            "baseline_vs_daemon": statistics.median(base_s) / dmed,
            "daemon_counters": counters(d0),
        })
        log("daemon %.2fx link; download-then-load takes %.2fx the daemon's time"
            % (result["daemon_vs_link"], result["baseline_vs_daemon"]))

        if not args.no_fleet:
            result["fleet"] = fleet(args, net, s3, tmp, url, nbytes, daemons)
    finally:
        for d in daemons:
            d.stop()
        if s3 is not None:
            s3.stop()
        net.close()
        shutil.rmtree(tmp, ignore_errors=True)
    label = args.label or args.rate
    try:
        with open(args.out) as f:
            allres = json.load(f)
    except (OSError, ValueError):
        allres = {}
    allres[label] = result
    with open(args.out, "w") as f:
        json.dump(allres, f, indent=1, sort_keys=True)
        f.write("\n")
    print(json.dumps(result, indent=1, sort_keys=True))


def fleet(args, net, s3, tmp, url, nbytes, daemons):
    """node0 loads from storage, node1 and node2 then load the same URL;
    returns the storage's bytes sent (its link counter) over the three."""
    port = 7451
    addrs = ["%s:%d" % (n.addr, port) for n in net.nodes]
    tokens = os.path.join(tmp, "fleet.tokens")
    with open(tokens, "w") as f:
        f.write("fleet bench-fleet-0123456789abcdef\n")
    # d0 already runs without peers: the fleet is three fresh daemons.
    for d in daemons:
        d.stop()
    daemons.clear()
    for i, node in enumerate(net.nodes):
        daemons.append(start_daemon(args.build, node, os.path.join(tmp, "f%d" % i), [
            "--model-source", "s3://%s/" % BUCKET, "--s3-endpoint", s3.endpoint,
            "--source-streams", str(args.streams),
            "--listen", addrs[i], "--advertise", addrs[i],
            "--peers", ",".join(a for a in addrs if a != addrs[i]), "--peer-poll-seconds", "1",
            "--auth-token-file", tokens, "--fleet-members", "token:fleet",
            "--peer-token-file", tokens, "--allow-insecure-token"]))
    before = net.storage.tx_bytes()
    t0 = time.perf_counter()
    daemons[0].ctl_ok("load", "m", url, timeout=1800)
    first = time.perf_counter() - t0
    after_first = net.storage.tx_bytes()
    # Wait until the others see node0 holding it (their poll), then load.
    deadline = time.time() + 30
    for d in daemons[1:]:
        while "\tm\t" not in d.ctl_ok("peers").stdout:
            if time.time() > deadline:
                raise RuntimeError("peers never saw node0's model: " + d.ctl_ok("peers").stdout)
            time.sleep(0.2)
    others = []
    for d in daemons[1:]:
        t0 = time.perf_counter()
        d.ctl_ok("load", "m", url, timeout=1800)
        others.append(time.perf_counter() - t0)
    total = net.storage.tx_bytes() - before
    out = {"daemons": len(daemons), "first_load_seconds": first, "other_load_seconds": others,
           "storage_bytes_first": after_first - before, "storage_bytes_total": total,
           "storage_bytes_over_checkpoint": total / nbytes,
           "counters": [counters(d) for d in daemons]}
    log("fleet: storage sent %.3fx the checkpoint for %d daemons (first %.2f s, others %s)"
        % (total / nbytes, len(daemons), first, ", ".join("%.2f s" % s for s in others)))
    return out


if __name__ == "__main__":
    main()

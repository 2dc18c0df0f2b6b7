#!/usr/bin/python3
"""One holder -> one loader over the UCX data plane (issue 41), against
iperf3 between the same two places and against today's gRPC path, in one
run.

Where: with tests/netsim.py (the sources-test helper's network namespaces)
and root, the holder and the loader each run in their own namespace
(node0, node1; veth pairs on one bridge, unshaped); otherwise both on
loopback. The holder loads a checkpoint of --mib MiB from storage
(--peer-transport auto); then, --repeats times each, a fresh loader
(--peer-transport ucx, then grpc) loads it with --source peers (headers
and samples from storage: the page cache, which holds the files) and the
time from the request to the answer is taken; the best and median are
reported as GB/s of the checkpoint's bytes. iperf3 -c runs between the
same two places (-t 5, one stream, and -P 4). Goals: UCX >= 0.7x iperf3's
one-stream TCP, UCX >= 3x gRPC.

--huge-pages N (root) adds N 2 MiB hugetlb pages to the pool for the run
(given back at its end) and starts the loaders with --huge-pages require,
as a node that serves weights would: a load then writes into pages the
pool has, not into 4 KiB shmem pages the kernel allocates and zeroes one
fault at a time (on this VM that costs about as much CPU as the transfer).
Each transport's first load is then an untimed warm-up (reported apart):
the VM's host backs the pool's pages at their first touch.

  bench/ucx_bench.py [--mib 1024] [--repeats 3] [--streams 4] [--tls tcp]
                     [--huge-pages N] [--build build] [--out bench/ucx_results.json]
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

import hugepages

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def write_checkpoint(directory, mib):
    import torch
    sys.path.insert(0, os.path.join(REPO, "tests", "integration"))
    import st_io
    os.makedirs(directory)
    g = torch.Generator().manual_seed(1)
    shard = {}
    for i in range(mib // 16):  # 16 MiB tensors
        shard["w.%d" % i] = torch.randn(2048, 2048, generator=g)
    st_io.save(shard, os.path.join(directory, "model.safetensors"))
    return os.path.getsize(os.path.join(directory, "model.safetensors"))


def iperf(server_prefix, client_prefix, server_addr, streams):
    port = "5299"
    srv = subprocess.Popen(server_prefix + ["iperf3", "-s", "-1", "-p", port, "-B", server_addr],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    try:
        out = subprocess.run(client_prefix + ["iperf3", "-c", server_addr, "-p", port, "-t", "5",
                                              "-P", str(streams), "-J"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    finally:
        srv.wait(timeout=10)
    return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 8 / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--chunk-mib", type=int, default=16)
    ap.add_argument("--tls", default="tcp", help="UCX_TLS for both daemons")
    ap.add_argument("--loopback", action="store_true", help="no namespaces even if netsim works")
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--huge-pages", type=int, default=0,
                    help="2 MiB hugetlb pages to add to the pool for the loaders (root)")
    ap.add_argument("--out", default=os.path.join(HERE, "ucx_results.json"))
    args = ap.parse_args()
    with hugepages.pool(args.huge_pages) as got:
        if args.huge_pages and got * 2 < args.mib + 64:
            sys.exit("huge pages: %d MiB in the pool is too few for a %d MiB load" %
                     (got * 2, args.mib))
        run(args)


def run(args):
    sys.path.insert(0, os.path.join(args.build, "python"))
    sys.path.insert(0, os.path.join(REPO, "tests"))
    os.environ["WEIGHTD_BUILD"] = args.build
    from harness import Daemon, free_port
    import weightd

    net = None
    if not args.loopback:
        try:
            import netsim
            ok, why = netsim.available()
            if ok:
                net = netsim.Net(nodes=2, storage=False)
            else:
                print("netsim unavailable (%s): loopback" % why)
        except ImportError:
            print("no tests/netsim.py: loopback")
    where = "two network namespaces (netsim veth pair, unshaped)" if net else "loopback"
    prefixes = [n.prefix for n in net.nodes] if net else [[], []]
    hosts = [n.addr for n in net.nodes] if net else ["127.0.0.1", "127.0.0.1"]

    tmp = tempfile.mkdtemp(prefix="weightd-ucx-bench-")
    models = os.path.join(tmp, "models")
    nbytes = write_checkpoint(os.path.join(models, "m"), args.mib)
    path = os.path.join(models, "m")
    token = "bench-fleet-0123456789abcdef"
    tokens = os.path.join(tmp, "fleet.tokens")
    with open(tokens, "w") as f:
        f.write("fleet %s\n" % token)
    os.environ["UCX_TLS"] = args.tls
    chunk = str(args.chunk_mib << 20)
    holder_addr = "%s:%d" % (hosts[0], free_port())
    holder = Daemon(model_root=models, workdir=os.path.join(tmp, "a"), prefix=prefixes[0],
                    extra_args=["--listen", holder_addr, "--auth-token-file", tokens,
                                "--fleet-members", "token:fleet", "--peer-transport", "auto",
                                "--allow-insecure-token",
                                "--huge-pages", "off"])
    loader_pages = "require" if args.huge_pages else "off"
    results = {"where": where, "checkpoint_bytes": nbytes, "ucx_tls": args.tls,
               "peer_streams": args.streams, "read_chunk_bytes": int(chunk),
               "loader_huge_pages": loader_pages, "runs": {}}
    try:
        holder.start(timeout=60)
        holder.ctl_ok("load", "m", path)
        for transport in ("ucx", "grpc"):
            secs = []
            warmup = []
            for r in range(args.repeats + (1 if args.huge_pages else 0)):
                c = Daemon(model_root=models, workdir=os.path.join(tmp, "c-%s-%d" % (transport, r)),
                           prefix=prefixes[1],
                           extra_args=["--peers", holder_addr, "--peer-token-file", tokens,
                                       "--peer-transport", transport, "--peer-streams",
                                       str(args.streams), "--read-chunk-bytes", chunk,
                                       "--huge-pages", loader_pages])
                c.start(timeout=60)
                try:
                    with weightd.Client(socket=c.socket, retry_deadline=60) as cl:
                        t0 = time.perf_counter()
                        reports = []
                        cl.load("m", path, source="peers", progress=reports.append)
                        (warmup if args.huge_pages and r == 0 else secs).append(
                            time.perf_counter() - t0)
                        assert reports[-1].bytes_from_peers == reports[-1].bytes_total - \
                            reports[-1].bytes_from_storage
                    if transport == "ucx":
                        lanes = [l for l in c.log().splitlines() if "ucx_endpoint " in l]
                        results["ucx_endpoint"] = lanes[0].split("transports=")[-1] if lanes else ""
                finally:
                    c.stop()
            results["runs"][transport] = {
                "seconds": secs, "best_gbps": nbytes / min(secs) / 1e9,
                "median_gbps": nbytes / statistics.median(secs) / 1e9}
            if warmup:
                results["runs"][transport]["warmup_seconds"] = warmup[0]
            print("%-5s best %.2f GB/s  median %.2f GB/s  (%s)" % (
                transport, results["runs"][transport]["best_gbps"],
                results["runs"][transport]["median_gbps"],
                ", ".join("%.2fs" % s for s in secs)))
    finally:
        holder.stop()
    if shutil.which("iperf3"):
        for streams in (1, 4):
            gbps = iperf(prefixes[0], prefixes[1], hosts[0], streams)
            results["iperf3_P%d_gbps" % streams] = gbps
            print("iperf3 -P %d: %.2f GB/s" % (streams, gbps))
    if net:
        net.close()
    shutil.rmtree(tmp, ignore_errors=True)
    ucx = results["runs"]["ucx"]["best_gbps"]
    results["ucx_vs_grpc"] = ucx / results["runs"]["grpc"]["best_gbps"]
    results["ucx_vs_grpc_median"] = (results["runs"]["ucx"]["median_gbps"] /
                                     results["runs"]["grpc"]["median_gbps"])
    if "iperf3_P1_gbps" in results:
        results["ucx_vs_iperf3_P1"] = ucx / results["iperf3_P1_gbps"]
        results["ucx_median_vs_iperf3_P1"] = (results["runs"]["ucx"]["median_gbps"] /
                                              results["iperf3_P1_gbps"])
    results["machine"] = "%d CPUs, %s" % (os.cpu_count(), os.uname().release)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps({k: v for k, v in results.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()

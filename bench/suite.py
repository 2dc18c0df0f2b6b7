#!/usr/bin/python3
"""The benchmark suite (issue #8). bench/run.sh builds and calls this.

Every figure is measured against a baseline measured in the same run, each
several times, interleaved round-robin so that noise from other work on the
machine spreads over all of them; medians and min/max are reported.

  1. load: `weightctl load` cold (files evicted from the page cache with
     posix_fadvise(DONTNEED)) and warm, vs pread() of the same files into
     fresh memory on 2 threads (bench/pread_bench; the machine's limit) and
     vs `cat FILE > /dev/null` from the page cache;
  2. warm fetch to a ready state dict (PyTorch workers through the Python
     client; also the C++ client), 1/2/4/8 ranks, same dtype and with a
     cast, shm and grpc transports, vs the in-process PyTorch baseline
     (mmap + cast + torch.chunk + clone per rank);
  3. cast kernels vs memcpy (bench/cast_bench, bytes read + written);
  4. LoRA apply-to-ready vs PyTorch merges of the same shapes (lora_bench.py);
  5. control plane: Fetch+Release of a cached 201-tensor shard table with
     1/4/16/64 clients vs the cheapest unary RPC (Stats) on the same socket,
     closed loop with blocking and with callback-API clients, and at 64
     clients open loop at the target's 5,000 Fetch/s (latency at that load);
  6. scaling: figures 1 and 2 at three model sizes, fitted to
     t = fixed + bytes / rate;
  7. huge pages: figure 2 on a ~2 GiB bf16 checkpoint with 4 KiB segments
     (--huge-pages off) and 2 MiB hugetlb segments (--huge-pages require)
     side by side, 1/2/4/8 ranks, Python and C++ clients, each against the
     same in-process PyTorch baseline, plus the page-population floor
     (populate_floor.py) for both page sizes. It reserves the hugetlb pool
     it needs (root, a writable vm.nr_hugepages) and gives it back.

  bench/suite.py [--quick] [--build DIR] [--repeats N] [--out FILE] [--plot FILE]
                 [--only load,fetch,cast,lora,control,hugepages] [--merge]

  --merge: keep the other figures of an existing --out file (a run of some
  figures updates those only).
"""
import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
OUT_DIR = os.path.join(HERE, "out")

FULL = dict(sizes=["0.3g", "1g", "4g"], main="1g", ranks=[1, 2, 4, 8], scale_ranks=2,
            repeats=3, cast="f16", lora_ranks=[8, 16, 64], control_clients=[1, 4, 16, 64],
            control_seconds=2.0, huge_size="2g")
QUICK = dict(sizes=["10m", "37m", "167m"], main="37m", ranks=[1, 2, 4], scale_ranks=2,
             repeats=1, cast="f16", lora_ranks=[8, 16, 64], control_clients=[1, 4, 16, 64],
             control_seconds=0.5, huge_size="167m")


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def summary(values):
    v = sorted(values)
    return {"median": statistics.median(v), "min": v[0], "max": v[-1], "n": len(v),
            "values": values}


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout


def json_line(text):
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in: %r" % text[-500:])


# ----------------------------------------------------------------- machine

def machine_facts(build):
    facts = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "kernel": platform.release(), "cores": os.cpu_count(),
             "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    facts["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    facts["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
        flags = open("/proc/cpuinfo").read().split("flags", 1)[1].split("\n", 1)[0]
        facts["simd"] = [x for x in ("avx2", "f16c", "avx512f", "avx512bw") if " " + x in flags]
    except (OSError, IndexError):
        pass
    cache = os.path.join(build, "CMakeCache.txt")
    try:
        cxx, btype = None, None
        for line in open(cache):
            if line.startswith("CMAKE_CXX_COMPILER:"):
                cxx = line.split("=", 1)[1].strip()
            if line.startswith("CMAKE_BUILD_TYPE:"):
                btype = line.split("=", 1)[1].strip()
        facts["build_type"] = btype
        if cxx:
            facts["compiler"] = sh([cxx, "--version"]).splitlines()[0]
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        facts["git_commit"] = sh(["git", "-C", REPO, "rev-parse", "HEAD"]).strip()
        facts["git_dirty"] = bool(sh(["git", "-C", REPO, "status", "--porcelain",
                                      "--untracked-files=no"]).strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        import torch
        facts["torch"] = torch.__version__
        facts["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    facts["loadavg_start"] = os.getloadavg()
    return facts


# ----------------------------------------------------------------- inputs

def checkpoint(name):
    import llama_ckpt
    d = os.path.join(OUT_DIR, name)
    path = os.path.join(d, "model.safetensors")
    if not os.path.exists(path):
        t = time.time()
        os.makedirs(d, exist_ok=True)
        llama_ckpt.write_checkpoint(path, llama_ckpt.llama_shapes(**llama_ckpt.CONFIGS[name]))
        log("  wrote %s (%.2f GiB) in %.1f s" % (path, os.path.getsize(path) / 2**30,
                                                   time.time() - t))
    return path


def warm_cache(path):
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


@contextlib.contextmanager
def fresh_daemon(build, tmp, model_root):
    """A weightd of `build` serving `model_root`, its socket and log in
    `tmp`, started for the block: yields a connected weightd.Client (closed,
    and the daemon stopped, after it)."""
    import weightd
    sock = os.path.join(tmp, "w.sock")
    with open(os.path.join(tmp, "log"), "ab") as log:
        proc = subprocess.Popen([os.path.join(build, "bin", "weightd"), "--socket", sock,
                                 "--model-root", model_root],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 30
        while not os.path.exists(sock) and time.time() < deadline:
            time.sleep(0.05)
        c = weightd.Client(socket=sock, retry_deadline=30)
        try:
            c.health()
            yield c
        finally:
            c.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if os.path.exists(sock):
            os.unlink(sock)


# ----------------------------------------------------------------- figure 1

LOAD_KEYS = ("cold_load", "cold_pread", "warm_load", "warm_pread", "warm_pread_memfd", "warm_cat")

def figure_load(ctx):
    import harness
    sizes, repeats = ctx.cfg["sizes"], ctx.repeats
    pread = os.path.join(ctx.build, "bench", "pread_bench")
    paths = {s: checkpoint(s) for s in sizes}
    series = {(s, k): [] for s in sizes for k in
              LOAD_KEYS}
    resid = []
    with tempfile.TemporaryDirectory(prefix="weightd-bench-load-") as tmp:
        d = harness.Daemon(model_root=OUT_DIR, workdir=tmp)
        d.start()
        try:
            def timed_load(path):
                t0 = time.perf_counter()
                d.ctl_ok("load", "m", path, timeout=600)
                t = time.perf_counter() - t0
                d.ctl_ok("unload", "m")
                return t

            def evict(path):
                resid.append(json_line(sh([pread, "--evict", path]))["resident_fraction"])

            for r in range(repeats):
                for s in sizes:
                    p = paths[s]
                    log("  load %s round %d/%d" % (s, r + 1, repeats))
                    evict(p)
                    series[(s, "cold_pread")].append(json_line(sh([pread, "--threads", "2", p]))["seconds"])
                    evict(p)
                    series[(s, "cold_load")].append(timed_load(p))
                    warm_cache(p)
                    series[(s, "warm_pread")].append(json_line(sh([pread, "--threads", "2", p]))["seconds"])
                    series[(s, "warm_pread_memfd")].append(json_line(sh(
                        [pread, "--threads", "2", "--memory", "memfd", p]))["seconds"])
                    t0 = time.perf_counter()
                    subprocess.run("cat '%s' > /dev/null" % p, shell=True, check=True)
                    series[(s, "warm_cat")].append(time.perf_counter() - t0)
                    series[(s, "warm_load")].append(timed_load(p))
        finally:
            d.stop()
    out = {"resident_fraction_after_evict_max": max(resid) if resid else None, "sizes": {}}
    for s in sizes:
        nbytes = os.path.getsize(paths[s])
        out["sizes"][s] = {"bytes": nbytes, **{k: summary(series[(s, k)]) for k in LOAD_KEYS}}
    return out


# ----------------------------------------------------------------- figure 2

class Workers:
    """max(ranks) persistent rank_worker.py processes."""

    def __init__(self, build, n):
        pydir = os.path.join(build, "python")
        self.procs = [subprocess.Popen(["/usr/bin/python3", os.path.join(HERE, "rank_worker.py"),
                                        pydir], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True) for _ in range(n)]
        for p in self.procs:
            json.loads(p.stdout.readline())  # imports done

    def round(self, cmds):
        """Sends cmds[i] to worker i, all before reading any answer; returns
        the slowest rank's ready_s and the total bytes."""
        for p, c in zip(self.procs, cmds):
            p.stdin.write(json.dumps(c) + "\n")
            p.stdin.flush()
        outs = [json.loads(p.stdout.readline()) for p in self.procs[:len(cmds)]]
        for o in outs:
            if "error" in o:
                raise RuntimeError("rank worker: " + o["error"])
        return max(o["ready_s"] for o in outs), sum(o["bytes"] for o in outs)

    def close(self):
        for p in self.procs:
            try:
                p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                p.stdin.flush()
            except OSError:
                pass
        for p in self.procs:
            p.wait(timeout=30)


def cpp_round(build, socket, world, dtype, transport):
    tool = os.path.join(build, "bench", "fetch_rank")
    procs = [subprocess.Popen([tool, "--socket", socket, "--model", "m", "--world", str(world),
                               "--rank", str(r), "--dtype", dtype, "--transport", transport],
                              stdout=subprocess.PIPE, text=True) for r in range(world)]
    res = [json.loads(p.communicate()[0]) for p in procs]
    return max(x["ready_s"] for x in res)


def figure_fetch(ctx):
    import harness
    cfg, repeats = ctx.cfg, ctx.repeats
    cast = cfg["cast"]
    workers = Workers(ctx.build, max(cfg["ranks"]))
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="weightd-bench-fetch-") as tmp:
            # 4 KiB segments: figure 7 has the huge-page twin of this figure.
            d = harness.Daemon(model_root=OUT_DIR, workdir=tmp,
                               extra_args=["--huge-pages", "off"])
            d.start()
            try:
                for size in cfg["sizes"]:
                    path = checkpoint(size)
                    nbytes = os.path.getsize(path)
                    warm_cache(path)
                    d.ctl_ok("load", "m", path, timeout=600)
                    # (client, transport, dtype, ranks); "torch" is the baseline.
                    if size == cfg["main"]:
                        configs = [(c, t, dt, n) for dt in ("keep", cast) for t in ("shm", "grpc")
                                   for n in cfg["ranks"] for c in ("python",)]
                        configs += [("cpp", "shm", dt, n) for dt in ("keep", cast)
                                    for n in cfg["ranks"]]
                        configs += [("torch", "-", dt, n) for dt in ("keep", cast)
                                    for n in cfg["ranks"]]
                    else:
                        n = cfg["scale_ranks"]
                        configs = [(c, "shm" if c != "torch" else "-", dt, n)
                                   for c in ("python", "torch") for dt in ("keep", cast)]
                    times = {c: [] for c in configs}
                    first = {}

                    def one(c):
                        client, transport, dtype, n = c
                        if client == "python":
                            return workers.round([{"op": "weightd", "socket": d.socket,
                                                   "model": "m", "world": n, "rank": r,
                                                   "dtype": dtype, "transport": transport}
                                                  for r in range(n)])[0]
                        if client == "cpp":
                            return cpp_round(ctx.build, d.socket, n, dtype, transport)
                        return workers.round([{"op": "torch", "path": path, "world": n,
                                               "rank": r, "dtype": dtype}
                                              for r in range(n)])[0]

                    log("  fetch %s: %d configs x (1 + %d) rounds" % (size, len(configs),
                                                                     repeats))
                    for c in configs:  # warm-up; with a cast the first fetch packs the shard
                        if c[0] != "torch":
                            first[c] = one(c)
                    for r in range(repeats):
                        for c in configs:
                            times[c].append(one(c))
                    for c in configs:
                        client, transport, dtype, n = c
                        row = {"size": size, "checkpoint_bytes": nbytes, "client": client,
                               "transport": transport, "dtype": dtype, "ranks": n,
                               "ready_s": summary(times[c])}
                        if c in first:
                            row["first_fetch_s"] = first[c]
                        results.append(row)
                    d.ctl_ok("unload", "m")
            finally:
                d.stop()
    finally:
        workers.close()
    return results


# ----------------------------------------------------------------- figure 7

HP_SYSFS = "/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages"


class HugetlbPool:
    """Adds `pages` 2 MiB pages to the host's hugetlb pool for the figure and
    restores the old size afterwards; `granted` = what the kernel gave."""

    def __init__(self, pages):
        self.pages, self.old, self.granted = pages, None, 0

    def __enter__(self):
        with open(HP_SYSFS) as f:
            self.old = int(f.read())
        with open(HP_SYSFS, "w") as f:
            f.write(str(self.old + self.pages))
        with open(HP_SYSFS) as f:
            self.granted = int(f.read()) - self.old
        return self

    def __exit__(self, *exc):
        with open(HP_SYSFS, "w") as f:
            f.write(str(self.old))


def figure_hugepages(ctx):
    import harness
    import populate_floor
    cfg, repeats = ctx.cfg, ctx.repeats
    size, cast = cfg["huge_size"], cfg["cast"]
    path = checkpoint(size)
    nbytes = os.path.getsize(path)
    # The checkpoint, the cast's packed shards (2 ranks) and the floor's 512 MiB.
    need = 2 * (-(-nbytes // (2 << 20))) + 256 + 64
    if os.geteuid() != 0 or not os.access(HP_SYSFS, os.W_OK):
        return {"skipped": "needs root and a writable %s" % HP_SYSFS}
    out = {"size": size, "checkpoint_bytes": nbytes, "pool_pages_asked": need,
           "shmem_thp": populate_floor.shmem_thp(), "floor": {}, "fetch": []}
    with HugetlbPool(need) as pool:
        out["pool_pages_granted"] = pool.granted
        if pool.granted < need:
            return dict(out, skipped="the kernel gave %d of %d 2 MiB pages (memory too "
                                     "fragmented or too small)" % (pool.granted, need))
        for pages, huge in (("4k", False), ("2m", True)):
            out["floor"][pages] = populate_floor.floor(512 << 20, hugetlb=huge)
        workers = Workers(ctx.build, max(cfg["ranks"]))
        daemons = {}
        try:
            with tempfile.TemporaryDirectory(prefix="weightd-bench-huge-") as tmp:
                for pages, mode in (("4k", "off"), ("2m", "require")):
                    d = daemons[pages] = harness.Daemon(
                        model_root=OUT_DIR, workdir=os.path.join(tmp, pages),
                        extra_args=["--huge-pages", mode])
                    d.start()
                warm_cache(path)
                for pages, d in daemons.items():
                    d.ctl_ok("load", "m", path, timeout=600)
                    info = d.ctl_ok("info", "m").stdout
                    out["segments_" + pages] = [l for l in info.splitlines()
                                                if l.startswith("segment_bytes:")][0]
                # (pages, client, dtype, ranks); pages "-" with client "torch" is the baseline.
                configs = [(p, c, "keep", n) for p in daemons for c in ("python", "cpp")
                           for n in cfg["ranks"]]
                configs += [(p, c, cast, 2) for p in daemons for c in ("python", "cpp")]
                configs += [("-", "torch", "keep", n) for n in cfg["ranks"]]
                configs += [("-", "torch", cast, 2)]

                def one(c):
                    pages, client, dtype, n = c
                    if client == "python":
                        return workers.round([{"op": "weightd", "socket": daemons[pages].socket,
                                               "model": "m", "world": n, "rank": r,
                                               "dtype": dtype, "transport": "shm"}
                                              for r in range(n)])[0]
                    if client == "cpp":
                        return cpp_round(ctx.build, daemons[pages].socket, n, dtype, "shm")
                    return workers.round([{"op": "torch", "path": path, "world": n, "rank": r,
                                           "dtype": dtype} for r in range(n)])[0]

                log("  hugepages %s: %d configs x (1 + %d) rounds" % (size, len(configs),
                                                                     repeats))
                times = {c: [] for c in configs}
                for c in configs:  # warm-up; with a cast the first fetch packs the shard
                    if c[1] != "torch":
                        one(c)
                for _ in range(repeats):
                    for c in configs:
                        times[c].append(one(c))
                for c in configs:
                    pages, client, dtype, n = c
                    out["fetch"].append({"pages": pages, "client": client, "dtype": dtype,
                                         "ranks": n, "ready_s": summary(times[c])})
                with weightd_client(daemons["2m"]) as cl:
                    st = cl.stats()
                out["stats_2m"] = {k: st[k] for k in ("segment_bytes_4k", "segment_bytes_hugetlb",
                                                      "huge_page_fallbacks")}
        finally:
            for d in daemons.values():
                d.stop()
            workers.close()
    return out


def weightd_client(d):
    import weightd
    return weightd.Client(socket=d.socket)


# ----------------------------------------------------------------- figure 3

def figure_cast(ctx):
    tool = os.path.join(ctx.build, "bench", "cast_bench")
    if not os.path.exists(tool):
        return {"skipped": "cast_bench not built (Google Benchmark missing)"}
    reps = max(ctx.repeats, 1)
    out = sh([tool, "--benchmark_format=json", "--benchmark_repetitions=%d" % reps,
              "--benchmark_min_time=%s" % ("0.05" if ctx.quick else "0.3")])
    data = json.loads(out)
    per = {}
    for b in data["benchmarks"]:
        if b.get("run_type") != "iteration":
            continue
        name = b["run_name"] if "run_name" in b else b["name"]
        name = name.replace("BM_Cast/", "").replace("BM_", "").split("/")[0]
        per.setdefault(name, {"label": b.get("label", ""), "gbps": []})
        per[name]["gbps"].append(b["bytes_per_second"] / 1e9)
    return {k: {"label": v["label"], "gb_per_s": summary(v["gbps"])} for k, v in per.items()}


# ----------------------------------------------------------------- figure 4

def figure_lora(ctx):
    import llama_ckpt
    size = ctx.cfg["main"]
    path = checkpoint(size)
    proj = 0  # bytes the merges write: every projection, bf16
    for name, shape in llama_ckpt.llama_shapes(**llama_ckpt.CONFIGS[size]):
        if name.endswith("_proj.weight"):
            proj += shape[0] * shape[1] * 2
    reserve_gib = max(0.25, round(proj * 1.3 / 2**30 * 4 + 0.5) / 4)
    rows = []
    for r in ctx.cfg["lora_ranks"]:
        log("  lora rank %d" % r)
        out = sh(["/usr/bin/python3", os.path.join(HERE, "lora_bench.py"), "--config", size,
                  "--ckpt-dir", os.path.dirname(path), "--rank", str(r),
                  "--rounds", str(max(ctx.repeats, 1)), "--pytorch-rounds",
                  str(max(ctx.repeats - 1, 1)), "--reserve-gib", str(reserve_gib)],
                 env=dict(os.environ), timeout=1200)
        res = json_line(out)
        rows.append({"size": size, "lora_rank": r, "merged_bytes": proj,
                     "reserve_gib": reserve_gib,
                     "weightd_s": summary(res["weightd_s"]),
                     "pytorch_s": summary(res.get("pytorch_all_s", [res["pytorch_s"]])),
                     "reserve_refill_wait_s": res["reserve_refill_wait_s"]})
    return rows


# ----------------------------------------------------------------- figure 5

# Figure 5's target: Fetch at >= 5,000/s with p99 < 5 ms, 64 clients.
CONTROL_TARGET_RATE = 5000


def figure_control(ctx):
    import harness
    tool = os.path.join(ctx.build, "bench", "control_bench")
    path = checkpoint("table201")
    series = {}
    with tempfile.TemporaryDirectory(prefix="weightd-bench-ctl-") as tmp:
        d = harness.Daemon(model_root=OUT_DIR, workdir=tmp)
        d.start()
        try:
            d.ctl_ok("load", "m", path)
            for r in range(ctx.repeats):
                for n in ctx.cfg["control_clients"]:
                    # fetch: every response parsed into a message (as a
                    # worker does); fetch-lease: the clients read only lease
                    # and token, leaving the shared cores to the daemon;
                    # *-cb: the same through gRPC's callback API, no thread
                    # per client (a lighter load generator; the daemon's
                    # work per call is the same).
                    runs = [("fetch", "full", "sync", 0), ("fetch", "lease", "sync", 0),
                            ("stats", "full", "sync", 0), ("fetch", "lease", "callback", 0),
                            ("stats", "full", "callback", 0)]
                    if n == max(ctx.cfg["control_clients"]):
                        # Open loop at the target rate: latency at that load.
                        runs.append(("fetch", "lease", "callback", CONTROL_TARGET_RATE))
                    for rpc, decode, api, rate in runs:
                        res = json_line(sh([tool, "--socket", d.socket, "--model", "m",
                                            "--rpc", rpc, "--decode", decode, "--api", api,
                                            "--rate", str(rate),
                                            "--clients", str(n), "--seconds",
                                            str(ctx.cfg["control_seconds"]), "--world", "8"]))
                        if res["errors"]:
                            raise RuntimeError("control_bench errors: %s" % res)
                        key = rpc + ("-lease" if decode == "lease" else "") + \
                            ("-cb" if api == "callback" else "") + ("-rate" if rate else "")
                        series.setdefault((n, key), []).append(res)
        finally:
            d.stop()
    rows = []
    for n in ctx.cfg["control_clients"]:
        f, s = series[(n, "fetch")], series[(n, "stats")]
        fl = series[(n, "fetch-lease")]
        rows.append({"clients": n, "tensors": f[0]["tensors"],
                     "fetch_lease_per_s": summary([x["calls_per_s"] for x in fl]),
                     "fetch_lease_p50_ms": summary([x["p50_ms"] for x in fl]),
                     "fetch_lease_p99_ms": summary([x["p99_ms"] for x in fl]),
                     "fetch_per_s": summary([x["calls_per_s"] for x in f]),
                     "fetch_p50_ms": summary([x["p50_ms"] for x in f]),
                     "fetch_p99_ms": summary([x["p99_ms"] for x in f]),
                     "release_p50_ms": summary([x["release_p50_ms"] for x in f]),
                     "release_p99_ms": summary([x["release_p99_ms"] for x in f]),
                     "stats_per_s": summary([x["calls_per_s"] for x in s]),
                     "stats_p99_ms": summary([x["p99_ms"] for x in s])})
        cb, scb = series[(n, "fetch-lease-cb")], series[(n, "stats-cb")]
        rows[-1].update({"callback_fetch_per_s": summary([x["calls_per_s"] for x in cb]),
                         "callback_fetch_p50_ms": summary([x["p50_ms"] for x in cb]),
                         "callback_fetch_p99_ms": summary([x["p99_ms"] for x in cb]),
                         "callback_stats_per_s": summary([x["calls_per_s"] for x in scb]),
                         "callback_stats_p99_ms": summary([x["p99_ms"] for x in scb])})
        op = series.get((n, "fetch-lease-cb-rate"))
        if op:
            rows[-1].update({"open_loop_rate": CONTROL_TARGET_RATE,
                             "open_loop_per_s": summary([x["calls_per_s"] for x in op]),
                             "open_loop_p50_ms": summary([x["p50_ms"] for x in op]),
                             "open_loop_p99_ms": summary([x["p99_ms"] for x in op])})
    return rows


# ----------------------------------------------------------------- figure 6

def linear_fit(points):
    """Least squares t = a + b*x; returns (a, b, r2)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return my, 0.0, 0.0
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    a = my - b * mx
    ss = sum((y - my) ** 2 for _, y in points)
    res = sum((y - a - b * x) ** 2 for x, y in points)
    return a, b, (1 - res / ss) if ss else 1.0


def scaling(figs, cfg):
    out = []

    def add(name, points, bytes_label):
        if len(points) < 2:
            return
        a, b, r2 = linear_fit(points)
        out.append({"series": name, "points": [{"bytes": x, "s": y} for x, y in points],
                    "fixed_s": a, "gb_per_s": (1 / b / 1e9) if b > 0 else None, "r2": r2,
                    "bytes": bytes_label})

    load = figs.get("load")
    if load:
        for k in LOAD_KEYS:
            add("load." + k, [(v["bytes"], v[k]["median"]) for v in load["sizes"].values()],
                "checkpoint")
    fetch = figs.get("fetch")
    if fetch:
        n = cfg["scale_ranks"]
        for client, transport in (("python", "shm"), ("torch", "-")):
            for dt in ("keep", cfg["cast"]):
                pts = [(r["checkpoint_bytes"], r["ready_s"]["median"]) for r in fetch
                       if r["client"] == client and r["transport"] == transport and
                       r["dtype"] == dt and r["ranks"] == n]
                add("fetch.%s.%s.%dranks" % (client, dt, n), sorted(pts), "checkpoint")
        # rank scaling at the main size: time vs ranks
        for client, transport in (("python", "shm"), ("python", "grpc"), ("cpp", "shm"),
                                  ("torch", "-")):
            for dt in ("keep", cfg["cast"]):
                rows = sorted((r["ranks"], r["ready_s"]["median"]) for r in fetch
                              if r["size"] == cfg["main"] and r["client"] == client and
                              r["transport"] == transport and r["dtype"] == dt)
                if len(rows) >= 2:
                    out.append({"series": "ranks.%s.%s.%s" % (client, transport, dt),
                                "ranks": [x for x, _ in rows], "s": [y for _, y in rows],
                                "max_over_min_ranks": rows[-1][1] / rows[0][1]})
    return out


# ----------------------------------------------------------------- report

def fmt_s(s):
    m = s["median"]
    unit, k = ("s", 1.0) if m >= 1 else ("ms", 1e3)
    if s["n"] == 1:
        return "%.3g %s" % (m * k, unit)
    return "%.3g %s (%.3g–%.3g)" % (m * k, unit, s["min"] * k, s["max"] * k)


def fmt_v(s, unit, digits="%.3g"):
    if s["n"] == 1:
        return (digits + " %s") % (s["median"], unit)
    return (digits + " %s (" + digits + "–" + digits + ")") % (s["median"], unit, s["min"],
                                                               s["max"])


def ratio(x):
    return ("%.1f×" if x >= 10 else "%.2f×") % x


def gib(b):
    return "%.2f GiB" % (b / 2**30) if b >= 2**30 * 0.9 else "%.0f MiB" % (b / 2**20)


def table(figs, cfg):
    """Rows: (figure, config, weightd, baseline, ratio)."""
    rows = []
    load = figs.get("load")
    if load:
        for s, v in load["sizes"].items():
            b = v["bytes"]
            rate = lambda x: b / x["median"] / 1e9  # noqa: E731
            rows.append(("1 load cold", "%s, evicted" % gib(b),
                         "%s, %.2f GB/s" % (fmt_s(v["cold_load"]), rate(v["cold_load"])),
                         "pread 2 thr fresh mem %s, %.2f GB/s" % (fmt_s(v["cold_pread"]),
                                                                  rate(v["cold_pread"])),
                         "%.2f of limit" % (v["cold_pread"]["median"] / v["cold_load"]["median"])))
            rows.append(("1 load warm", "%s, page cache" % gib(b),
                         "%s, %.2f GB/s" % (fmt_s(v["warm_load"]), rate(v["warm_load"])),
                         "pread fresh mem %s, %.2f GB/s; into memfd %.2f GB/s; cat %.2f GB/s" % (
                             fmt_s(v["warm_pread"]), rate(v["warm_pread"]),
                             rate(v["warm_pread_memfd"]), rate(v["warm_cat"])),
                         "%.2f of pread, %.2f of memfd pread, %.2f of cat" % (
                             v["warm_pread"]["median"] / v["warm_load"]["median"],
                             v["warm_pread_memfd"]["median"] / v["warm_load"]["median"],
                             v["warm_cat"]["median"] / v["warm_load"]["median"])))
    fetch = figs.get("fetch")
    if fetch:
        base = {(r["size"], r["dtype"], r["ranks"]): r["ready_s"] for r in fetch
                if r["client"] == "torch"}
        for r in fetch:
            if r["client"] == "torch":
                continue
            bl = base.get((r["size"], r["dtype"], r["ranks"]))
            dt = "bf16" if r["dtype"] == "keep" else "bf16→" + r["dtype"]
            who = "py" if r["client"] == "python" else "C++"
            extra = ""
            if r["dtype"] != "keep" and "first_fetch_s" in r and r["client"] == "python" and \
                    r["transport"] == "shm":  # the first config to ask: it packs the shard
                extra = "; first (casts) %.3g s" % r["first_fetch_s"]
            rows.append(("2 warm fetch", "%s, %d rank%s, %s, %s %s" % (
                gib(r["checkpoint_bytes"]), r["ranks"], "s" if r["ranks"] > 1 else "", dt,
                r["transport"], who), fmt_s(r["ready_s"]) + extra,
                "PyTorch %s" % fmt_s(bl) if bl else "-",
                ratio(bl["median"] / r["ready_s"]["median"]) if bl else "-"))
    hp = figs.get("hugepages")
    if hp and "skipped" not in hp:
        base = {(r["dtype"], r["ranks"]): r["ready_s"] for r in hp["fetch"]
                if r["client"] == "torch"}
        for r in hp["fetch"]:
            if r["client"] == "torch":
                continue
            bl = base.get((r["dtype"], r["ranks"]))
            dt = "bf16" if r["dtype"] == "keep" else "bf16→" + r["dtype"]
            rows.append(("7 warm fetch, %s pages" % ("2 MiB hugetlb" if r["pages"] == "2m"
                                                     else "4 KiB"),
                         "%s, %d rank%s, %s, shm %s" % (
                             gib(hp["checkpoint_bytes"]), r["ranks"], "s" if r["ranks"] > 1 else "",
                             dt, "py" if r["client"] == "python" else "C++"),
                         fmt_s(r["ready_s"]), "PyTorch %s" % fmt_s(bl) if bl else "-",
                         ratio(bl["median"] / r["ready_s"]["median"]) if bl else "-"))
        fl = hp["floor"]
        rows.append(("7 page-population floor", "512 MiB resident, MADV_POPULATE_READ",
                     "2 MiB: %.2f ms" % (fl["2m"]["populate_read"] * 1e3),
                     "4 KiB: %.1f ms" % (fl["4k"]["populate_read"] * 1e3),
                     ratio(fl["4k"]["populate_read"] / fl["2m"]["populate_read"])))
    elif hp:
        rows.append(("7 huge pages", "skipped", hp["skipped"], "-", "-"))
    cast = figs.get("cast")
    if cast and "skipped" not in cast:
        mc = cast.get("Memcpy")
        for k, v in cast.items():
            if k == "Memcpy":
                continue
            rows.append(("3 cast", "%s [%s] 64 MiB src" % (k, v["label"]),
                         fmt_v(v["gb_per_s"], "GB/s", "%.1f"),
                         "memcpy " + fmt_v(mc["gb_per_s"], "GB/s", "%.1f") if mc else "-",
                         "%.2f×" % (v["gb_per_s"]["median"] / mc["gb_per_s"]["median"])
                         if mc else "-"))
    for r in figs.get("lora") or []:
        rows.append(("4 LoRA apply→ready", "%s, r=%d, all projections, 1 rank" % (
            gib(os.path.getsize(checkpoint(r["size"]))), r["lora_rank"]),
            fmt_s(r["weightd_s"]), "PyTorch merges %s" % fmt_s(r["pytorch_s"]),
            ratio(r["pytorch_s"]["median"] / r["weightd_s"]["median"])))
    for r in figs.get("control") or []:
        rows.append(("5 control", "Fetch+Release, %d tensors, %d client%s" % (
            r["tensors"], r["clients"], "s" if r["clients"] > 1 else ""),
            "%s/s, p50 %s, p99 %s" % (fmt_v(r["fetch_per_s"], "", "%.0f").strip(),
                                       fmt_v(r["fetch_p50_ms"], "ms", "%.2f"),
                                       fmt_v(r["fetch_p99_ms"], "ms", "%.2f")),
            "Stats %.0f/s, p99 %.2f ms" % (r["stats_per_s"]["median"],
                                             r["stats_p99_ms"]["median"]),
            "%.2f of floor" % (r["fetch_per_s"]["median"] / r["stats_per_s"]["median"])))
        rows.append(("5 control", "same, clients read lease+token only, %d client%s" % (
            r["clients"], "s" if r["clients"] > 1 else ""),
            "%s/s, p50 %s, p99 %s" % (fmt_v(r["fetch_lease_per_s"], "", "%.0f").strip(),
                                       fmt_v(r["fetch_lease_p50_ms"], "ms", "%.2f"),
                                       fmt_v(r["fetch_lease_p99_ms"], "ms", "%.2f")),
            "Stats %.0f/s" % r["stats_per_s"]["median"],
            "%.2f of floor" % (r["fetch_lease_per_s"]["median"] / r["stats_per_s"]["median"])))
        if "callback_fetch_per_s" in r:
            rows.append(("5 control", "same, callback-API clients, %d client%s" % (
                r["clients"], "s" if r["clients"] > 1 else ""),
                "%s/s, p50 %s, p99 %s" % (fmt_v(r["callback_fetch_per_s"], "", "%.0f").strip(),
                                           fmt_v(r["callback_fetch_p50_ms"], "ms", "%.2f"),
                                           fmt_v(r["callback_fetch_p99_ms"], "ms", "%.2f")),
                "Stats %.0f/s, p99 %.2f ms" % (r["callback_stats_per_s"]["median"],
                                                 r["callback_stats_p99_ms"]["median"]),
                "%.2f of floor" % (r["callback_fetch_per_s"]["median"] /
                                   r["callback_stats_per_s"]["median"])))
        if "open_loop_per_s" in r:
            rows.append(("5 control", "open loop at %d Fetch/s, callback clients, %d clients" % (
                r["open_loop_rate"], r["clients"]),
                "%s/s, p50 %s, p99 %s" % (fmt_v(r["open_loop_per_s"], "", "%.0f").strip(),
                                           fmt_v(r["open_loop_p50_ms"], "ms", "%.2f"),
                                           fmt_v(r["open_loop_p99_ms"], "ms", "%.2f")),
                "target p99 < 5 ms", "p99 %s" % (
                    "met" if r["open_loop_p99_ms"]["median"] < 5.0 else "missed")))
    for s in figs.get("scaling") or []:
        if "gb_per_s" in s:
            rows.append(("6 scaling", s["series"], "fixed %.3g s + bytes at %s GB/s" % (
                s["fixed_s"], "%.2f" % s["gb_per_s"] if s["gb_per_s"] else "∞"),
                "%d sizes" % len(s["points"]), "R² %.3f" % s["r2"]))
        else:
            rows.append(("6 scaling", s["series"] + " vs ranks " + "/".join(map(str, s["ranks"])),
                         " / ".join("%.3g" % x for x in s["s"]) + " s", "-",
                         "%.2f× from %d to %d" % (s["max_over_min_ranks"], s["ranks"][0],
                                                  s["ranks"][-1])))
    return rows


def print_table(rows, facts, mode):
    lines = ["| figure | configuration | weightd (median, min–max) | baseline, same run | ratio |",
             "|---|---|---|---|---|"]
    lines += ["| %s |" % " | ".join(r) for r in rows]
    head = "%s run, %s: %s, %s cores, %s GiB, kernel %s, %s, commit %s%s, load avg %s → %s" % (
        mode, facts.get("date_utc"), facts.get("cpu"), facts.get("cores"),
        facts.get("memory_gib"), facts.get("kernel"), facts.get("compiler"),
        (facts.get("git_commit") or "?")[:10], " (dirty)" if facts.get("git_dirty") else "",
        "%.1f" % facts["loadavg_start"][0], "%.1f" % facts.get("loadavg_end", [0])[0])
    return head + "\n\n" + "\n".join(lines)


# ----------------------------------------------------------------- plot

def plot(figs, cfg, png):
    if shutil.which("gnuplot") is None:
        log("gnuplot missing: no plot")
        return False
    fetch = figs.get("fetch") or []
    cast = cfg["cast"]
    with tempfile.TemporaryDirectory(prefix="weightd-bench-plot-") as tmp:
        def dat(name, rows):
            p = os.path.join(tmp, name)
            with open(p, "w") as f:
                for row in rows:
                    f.write(" ".join("%.6g" % x for x in row) + "\n")
            return p

        left, right = [], []
        styles = {("python", "shm", "keep"): ("weightd shm, bf16", 1),
                  ("python", "shm", cast): ("weightd shm, →%s" % cast, 2),
                  ("python", "grpc", "keep"): ("weightd grpc, bf16", 3),
                  ("python", "grpc", cast): ("weightd grpc, →%s" % cast, 4),
                  ("torch", "-", "keep"): ("PyTorch, bf16", 7),
                  ("torch", "-", cast): ("PyTorch, →%s" % cast, 6)}
        for (client, transport, dt), (title, lt) in styles.items():
            rows = sorted((r["ranks"], r["ready_s"]["median"], r["ready_s"]["min"],
                           r["ready_s"]["max"]) for r in fetch
                          if r["size"] == cfg["main"] and r["client"] == client and
                          r["transport"] == transport and r["dtype"] == dt)
            if rows:
                left.append("'%s' u 1:2:3:4 w yerrorlines lt %d pt 7 ps 0.6 t '%s'" % (
                    dat("l%d" % lt, rows), lt, title))
        n = cfg["scale_ranks"]
        for (client, transport, dt), (title, lt) in styles.items():
            if transport == "grpc":
                continue
            rows = sorted((r["checkpoint_bytes"] / 2**30, r["ready_s"]["median"],
                           r["ready_s"]["min"], r["ready_s"]["max"]) for r in fetch
                          if r["ranks"] == n and r["client"] == client and
                          r["transport"] == transport and r["dtype"] == dt)
            if len(rows) > 1:
                right.append("'%s' u 1:2:3:4 w yerrorlines lt %d pt 7 ps 0.6 t '%s, %d ranks'"
                             % (dat("r%d" % lt, rows), lt, title.replace("weightd ", "wd "), n))
        load = figs.get("load")
        if load:
            for k, title, lt in (("cold_load", "load cold (weightctl)", 8),
                                 ("cold_pread", "pread cold (limit)", 9),
                                 ("warm_load", "load warm", 10)):
                rows = sorted((v["bytes"] / 2**30, v[k]["median"], v[k]["min"], v[k]["max"])
                              for v in load["sizes"].values())
                right.append("'%s' u 1:2:3:4 w yerrorlines lt %d dt 2 pt 5 ps 0.6 t '%s'" % (
                    dat("k" + k, rows), lt, title))
        if not left or not right:
            return False
        main_b = next((r["checkpoint_bytes"] for r in fetch if r["size"] == cfg["main"]), 0)
        script = """
set terminal pngcairo size 1100,460 font 'DejaVu Sans,9'
set output '%s'
set multiplot layout 1,2
set logscale y
set grid
set key top left font ',8' spacing 0.9
set xlabel 'ranks'
set ylabel 'seconds to a ready state dict (slowest rank)'
set title 'Fig. 2: warm fetch, %s bf16 checkpoint'
set xtics (%s)
set xrange [0.85:9.5]
set logscale x 2
plot %s
set title 'Fig. 6: scaling with model size'
set xlabel 'checkpoint GiB'
set ylabel 'seconds'
set logscale x 10
set autoscale x
set xtics auto
set key top left font ',8' spacing 0.9
plot %s
unset multiplot
""" % (png, gib(main_b), ",".join(str(x) for x in cfg["ranks"]), ", ".join(left) or "NaN",
       ", ".join(right) or "NaN")
        p = os.path.join(tmp, "plot.gp")
        with open(p, "w") as f:
            f.write(script)
        r = subprocess.run(["gnuplot", p], capture_output=True, text=True)
        if r.returncode != 0:
            log("gnuplot failed: " + r.stderr[-800:])
            return False
    return True


# ----------------------------------------------------------------- main

class Ctx:
    pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--build", default=os.path.join(REPO, "build-rel"))
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--out", default=os.path.join(HERE, "results.json"))
    ap.add_argument("--plot", default=os.path.join(HERE, "results.png"))
    ap.add_argument("--table", default=None, help="also write the markdown table here")
    ap.add_argument("--only", default="load,fetch,cast,lora,control,hugepages")
    ap.add_argument("--merge", action="store_true",
                    help="keep the other figures of an existing --out file")
    ap.add_argument("--replot", metavar="RESULTS_JSON",
                    help="only redraw --plot from an earlier results file")
    args = ap.parse_args()
    if args.replot:
        with open(args.replot) as f:
            res = json.load(f)
        return 0 if plot(res["figures"], res["config"], args.plot) else 1
    build = os.path.abspath(args.build)
    os.environ["WEIGHTD_BUILD"] = build
    sys.path.insert(0, os.path.join(REPO, "tests"))
    sys.path.insert(0, HERE)

    ctx = Ctx()
    ctx.quick, ctx.build = args.quick, build
    ctx.cfg = dict(QUICK if args.quick else FULL)
    ctx.repeats = args.repeats or ctx.cfg["repeats"]
    mode = "quick" if args.quick else "full"
    facts = machine_facts(build)
    log("weightd bench (%s, %d repeat%s), build %s" % (mode, ctx.repeats,
                                                      "s" if ctx.repeats > 1 else "", build))
    t_all = time.time()
    figs, timing = {}, {}
    for name, fn in (("load", figure_load), ("fetch", figure_fetch), ("cast", figure_cast),
                     ("lora", figure_lora), ("control", figure_control),
                     ("hugepages", figure_hugepages)):
        if name not in args.only.split(","):
            continue
        log("figure %s" % name)
        t = time.time()
        figs[name] = fn(ctx)
        timing[name] = round(time.time() - t, 1)
        log("  %.1f s" % timing[name])
    if args.merge and os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)
        for k, v in old.get("figures", {}).items():
            if k not in figs and k != "scaling":
                figs[k] = v
        facts["merged_from"] = {"machine": old.get("machine"), "mode": old.get("mode")}
    figs["scaling"] = scaling(figs, ctx.cfg)
    facts["loadavg_end"] = os.getloadavg()
    facts["suite_seconds"] = round(time.time() - t_all, 1)
    facts["figure_seconds"] = timing
    rows = table(figs, ctx.cfg)
    text = print_table(rows, facts, mode)
    result = {"mode": mode, "repeats": ctx.repeats, "config": ctx.cfg, "machine": facts,
              "figures": figs, "table": [dict(zip(("figure", "configuration", "weightd",
                                                   "baseline", "ratio"), r)) for r in rows]}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if args.table:
        with open(args.table, "w") as f:
            f.write(text + "\n")
    if plot(figs, ctx.cfg, args.plot):
        log("plot: %s (%d KB)" % (args.plot, os.path.getsize(args.plot) // 1024))
    print(text)
    log("results: %s (%.0f s in all)" % (args.out, facts["suite_seconds"]))


if __name__ == "__main__":
    main()

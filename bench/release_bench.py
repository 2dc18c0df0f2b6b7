#!/usr/bin/python3
"""Release latency when it drops the last hold on a large checkpoint (one
unloaded while a lease still pinned it), against the cost of freeing the same
bytes inline: closing a resident memfd of that size in this process, which is
what the Release used to pay on the gRPC thread before the daemon handed such
drops to its background disposer.

  bench/release_bench.py [--build build-rel] [--config 1g] [--repeats 5]

Uses bench/out/<config>/model.safetensors (made by bench/run.sh or
bench/llama_ckpt.py). Prints one JSON line.
"""
import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def inline_free_s(size):
    """Seconds to give `size` bytes of resident shared memory back."""
    fd = os.memfd_create("weightd-release-bench")
    os.ftruncate(fd, size)
    with mmap.mmap(fd, size) as m:
        step = 64 << 20
        for off in range(0, size, step):
            m[off:min(off + step, size)] = b"\1" * (min(off + step, size) - off)
    t0 = time.perf_counter()
    os.close(fd)  # the mapping is gone; this frees the pages
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build-rel"))
    ap.add_argument("--config", default="1g")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(args.build, "python"))
    import grpc
    from weightd.v1 import weightd_pb2 as pb, weightd_pb2_grpc as pbg

    models = os.path.join(HERE, "out")
    ckpt = os.path.join(models, args.config, "model.safetensors")
    if not os.path.exists(ckpt):
        sys.exit("error: NOT_FOUND: %s (make it with bench/run.sh or bench/llama_ckpt.py)" % ckpt)
    with tempfile.TemporaryDirectory(prefix="weightd-release-bench-") as tmp:
        sock = os.path.join(tmp, "w.sock")
        daemon = subprocess.Popen([os.path.join(args.build, "bin", "weightd"), "--socket", sock,
                                   "--model-root", models],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ctl = [os.path.join(args.build, "bin", "weightctl"), "--socket", sock]
        try:
            for _ in range(200):
                if os.path.exists(sock):
                    break
                time.sleep(0.05)
            ch = grpc.insecure_channel("unix:" + sock)
            grpc.channel_ready_future(ch).result(timeout=20)
            shards = pbg.ShardsStub(ch)
            release_s = []
            for _ in range(args.repeats):
                subprocess.run(ctl + ["load", "m", ckpt], check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                r = shards.Fetch(pb.FetchRequest(model="m", mesh_shape=[1], coord=[0],
                                                 transport=pb.SHM))
                subprocess.run(ctl + ["unload", "m"], check=True, stdout=subprocess.DEVNULL)
                t0 = time.perf_counter()
                shards.Release(pb.ReleaseRequest(lease_id=r.lease_id, token=r.token))
                release_s.append(time.perf_counter() - t0)
        finally:
            daemon.terminate()
            daemon.wait()
    size = os.path.getsize(ckpt)
    free_s = [inline_free_s(size) for _ in range(args.repeats)]
    rel, base = statistics.median(release_s), statistics.median(free_s)
    print(json.dumps({"config": args.config, "bytes": size,
                      "release_ms": round(rel * 1e3, 2),
                      "release_ms_all": [round(t * 1e3, 2) for t in release_s],
                      "inline_free_ms": round(base * 1e3, 2),
                      "ratio": round(base / rel, 1) if rel > 0 else None}))


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""Push into the client's own memory (mode="push", the host twin of the CUDA
push) against what a worker does today to own its shard — shm fetch, then
copy into memory of its own — and against a plain resident-to-resident copy
of the same bytes between resident pages (the floor), all in the same run,
same process.

Each round a fresh destination is allocated (push: memfd + fallocate; copy:
torch.empty), so both pay for new pages; the floor does not. Warm daemon (the first round is
dropped). Prints one JSON line.

  /usr/bin/python3 bench/push_bench.py [--mib 1024] [--world 2] [--dtype keep|bf16] [--rounds 5]
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))

import harness  # noqa: E402
import torch  # noqa: E402

import st_io  # noqa: E402  (tests/parity, put on sys.path by harness)
import weightd  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024, help="checkpoint size (f32)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dtype", default="keep")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    dtype = None if args.dtype == "keep" else args.dtype
    rows = 4096
    cols = max(1, args.mib * (1 << 20) // 4 // rows // 8)
    g = torch.Generator().manual_seed(5)
    ck = {"layer%d.weight" % i: torch.randn(rows, cols, generator=g) for i in range(8)}
    with tempfile.TemporaryDirectory(prefix="push_bench.") as root:
        path = os.path.join(root, "m.safetensors")
        st_io.save(ck, path)
        del ck
        d = harness.Daemon(model_root=root)
        d.start()
        try:
            d.ctl_ok("load", "m", path)
            client = weightd.Client(socket=d.socket)
            times = {"copy_from_shm": [], "push": [], "push_reused": [], "floor_copy": []}
            nbytes = 0
            for rnd in range(args.rounds + 1):
                # today: map the daemon's segments, copy into memory of our own
                t0 = time.perf_counter()
                with client.fetch("m", world=args.world, rank=0, dtype=dtype) as h:
                    own = {n: torch.empty_like(t).copy_(t) for n, t in h.state_dict().items()}
                t1 = time.perf_counter()
                nbytes = sum(t.numel() * t.element_size() for t in own.values())
                # push: the daemon writes into our memfd
                t2 = time.perf_counter()
                p = client.fetch("m", world=args.world, rank=0, dtype=dtype, mode="push")
                t3 = time.perf_counter()
                got = p.state_dict()
                # push again into the same (resident) destination: what a
                # refresh that changes everything costs
                t6 = time.perf_counter()
                resp = client._shards.Fetch(weightd.client.pb.FetchRequest(
                    model="m", mesh_shape=[args.world], coord=[0],
                    dtype=weightd.client._dtypes.enum_of_name(
                        weightd.client._dtypes.parse_request_dtype(dtype)) if dtype else 0))
                weightd._datasock.push(resp.data_socket, resp.lease_id, bytes(resp.token),
                                       p._push.fd, [t.offset for t in p.tensors])
                t7 = time.perf_counter()
                assert all(torch.equal(got[n].view(torch.uint8), own[n].view(torch.uint8))
                           for n in own), "push and shm bytes differ"
                # floor: the same bytes copied between resident pages (the
                # destination faulted in before the clock starts)
                again = {n: torch.empty_like(t).fill_(0) for n, t in own.items()}
                t4 = time.perf_counter()
                for n, t in own.items():
                    again[n].copy_(t)
                t5 = time.perf_counter()
                p.release()
                del got, own, again
                if rnd == 0:
                    continue  # warm-up: the daemon's cache, first faults
                times["copy_from_shm"].append(t1 - t0)
                times["push"].append(t3 - t2)
                times["push_reused"].append(t7 - t6)
                times["floor_copy"].append(t5 - t4)
            med = {k: statistics.median(v) for k, v in times.items()}
            print(json.dumps({
                "bench": "push", "shard_bytes": nbytes, "world": args.world, "dtype": args.dtype,
                "rounds": args.rounds,
                "seconds_median": {k: round(v, 4) for k, v in med.items()},
                "gb_per_s": {k: round(nbytes / v / 1e9, 2) for k, v in med.items()},
                "push_speedup_vs_copy_from_shm": round(med["copy_from_shm"] / med["push"], 2),
                "push_vs_floor": round(med["floor_copy"] / med["push"], 2),
                "push_reused_vs_floor": round(med["floor_copy"] / med["push_reused"], 2),
            }))
        finally:
            d.stop()


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""One benchmark rank that stays up for many rounds (bench/suite.py starts
one per rank, so torch is imported once, not per round). Reads one JSON
command per line on stdin, answers one JSON line on stdout:

  {"op": "weightd", "socket": S, "model": M, "world": W, "rank": R,
   "dtype": "keep"|"f16"|..., "transport": "shm"|"grpc"}
      a PyTorch worker's time to a ready state dict through the Python client
      (shm: zero-copy, page tables populated; one element per 4 KiB page read)
  {"op": "torch", "path": P, "world": W, "rank": R, "dtype": D}
      the in-process PyTorch baseline: mmap the safetensors file, cast each
      tensor, torch.chunk it, keep (clone) this rank's piece
  {"op": "quit"}

Answers {"ready_s": seconds, "bytes": shard bytes, "tensors": n}; the state
dict is dropped before the answer, so every round starts from nothing.

  rank_worker.py BUILD_PYTHON_DIR
"""
import gc
import json
import mmap
import struct
import sys
import time
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, sys.argv[1])

import torch  # noqa: E402
import weightd  # noqa: E402

ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
WANT = {"keep": None, "bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
_clients = {}


def touch_pages(sd):
    """Reads one element per 4 KiB page of every tensor."""
    total = 0.0
    for t in sd.values():
        flat = t.reshape(-1)
        if flat.numel():
            total += float(flat[:: max(1, 4096 // t.element_size())].float().sum())
    return total


def weightd_round(cmd):
    client = _clients.get(cmd["socket"])
    if client is None:
        client = _clients[cmd["socket"]] = weightd.Client(socket=cmd["socket"])
    dtype = None if cmd["dtype"] == "keep" else cmd["dtype"]
    shm = cmd["transport"] == "shm"
    t0 = time.perf_counter()
    with client.fetch(cmd["model"], world=cmd["world"], rank=cmd["rank"], dtype=dtype,
                      transport=cmd["transport"], populate=shm) as h:
        sd = h.state_dict()
        touch_pages(sd)
        t1 = time.perf_counter()
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        n = len(sd)
        del sd
    return {"ready_s": t1 - t0, "bytes": nbytes, "tensors": n}


def torch_round(cmd):
    world, rank, want = cmd["world"], cmd["rank"], WANT[cmd["dtype"]]
    t0 = time.perf_counter()
    with open(cmd["path"], "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE)
    base = 8 + n
    shard, nbytes = {}, 0
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        dt = ST_DTYPES[e["dtype"]]
        esize = torch.tensor([], dtype=dt).element_size()
        t = torch.frombuffer(mm, dtype=dt, count=(end - b) // esize,
                             offset=base + b).reshape(e["shape"])
        if want is not None:
            t = t.to(want)
        pieces = torch.chunk(t, world, 0) if t.dim() > 0 else [t] * world
        mine = pieces[rank] if rank < len(pieces) else t[0:0]
        shard[name] = mine.clone()
        nbytes += shard[name].numel() * shard[name].element_size()
    t1 = time.perf_counter()
    count = len(shard)
    del shard, t, pieces, mine
    del mm
    return {"ready_s": t1 - t0, "bytes": nbytes, "tensors": count}


def main():
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            out = weightd_round(cmd) if cmd["op"] == "weightd" else torch_round(cmd)
        except Exception as e:  # reported, the driver decides
            out = {"error": "%s: %s" % (type(e).__name__, e)}
        gc.collect()
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

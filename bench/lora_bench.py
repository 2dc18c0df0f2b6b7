#!/usr/bin/python3
"""LoRA apply-to-ready: time from `weightctl apply` to a rank holding its
merged shard, for a rank-16 PEFT adapter on every attention and MLP
projection of the ~2 GiB TinyLlama-shaped bf16 checkpoint, against the same
merges done by PyTorch (W.float() + s * (B @ A), then cast) in the same run.

  /usr/bin/python3 bench/lora_bench.py [--world 1] [--rank 16] [--rounds 3]
                                      [--reserve-gib 2.5 | --no-reserve]

The daemon runs with a warm reserve of pre-faulted output segments
(--warm-reserve-bytes): before each apply the bench waits until the
background filler has refilled it, and reports how long that took; the
apply-to-ready time is then what an operator sees when swaps are not back to
back. --no-reserve measures the cold path (every output page faulted in).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))
sys.path.insert(0, os.path.join(REPO, "tests", "parity"))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import harness  # noqa: E402
import llama_ckpt  # noqa: E402
import st_io  # noqa: E402

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(directory, shapes, r, seed):
    os.makedirs(directory, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, shape in shapes:
        if not any(name.endswith(p + ".weight") for p in PROJ):
            continue
        module = "base_model.model." + name[:-len(".weight")]
        sd[module + ".lora_A.weight"] = 0.01 * torch.randn(r, shape[1], generator=g)
        sd[module + ".lora_B.weight"] = 0.01 * torch.randn(shape[0], r, generator=g)
    st_io.save(sd, os.path.join(directory, "adapter_model.safetensors"))
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r}, f)
    return sd


def pytorch_merges(ckpt_path, adapter_sd, strength, scale):
    full = st_io.load(ckpt_path)
    t0 = time.perf_counter()
    for key, a in adapter_sd.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[:-len(".lora_A.weight")]
        b = adapter_sd[module + ".lora_B.weight"]
        name = module[len("base_model.model."):] + ".weight"
        w = full[name]
        full[name] = (w.float() + strength * scale * (b @ a)).to(w.dtype)
    return time.perf_counter() - t0


def stats(dmn):
    out = dmn.ctl_ok("stats").stdout
    return dict(line.split(": ", 1) for line in out.strip().splitlines())


def wait_reserve(dmn, timeout=120.0):
    """Seconds until the daemon's warm reserve is full (0 without one)."""
    t0 = time.perf_counter()
    while True:
        s = stats(dmn)
        if int(s["reserve_ready_bytes"]) >= int(s["reserve_target_bytes"]):
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError("warm reserve not full after %.0f s: %s" % (timeout, s))
        time.sleep(0.05)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-pytorch", action="store_true")
    ap.add_argument("--reserve-gib", type=float, default=2.5)
    ap.add_argument("--no-reserve", action="store_true")
    ap.add_argument("--pytorch-rounds", type=int, default=1)
    ap.add_argument("--config", default="tinyllama",
                    help="checkpoint shape: tinyllama or a name in llama_ckpt.CONFIGS")
    ap.add_argument("--ckpt-dir", default=None,
                    help="default bench/out/tinyllama-bf16 (or bench/out/<config>)")
    args = ap.parse_args()
    config = llama_ckpt.TINYLLAMA if args.config == "tinyllama" else \
        llama_ckpt.CONFIGS[args.config]
    if args.ckpt_dir is None:
        args.ckpt_dir = os.path.join(HERE, "out", "tinyllama-bf16" if args.config == "tinyllama"
                                     else args.config)
    path = llama_ckpt.ensure_checkpoint(args.ckpt_dir, config)
    shapes = llama_ckpt.llama_shapes(**config)
    tool = os.path.join(harness.BUILD, "bench", "fetch_rank")
    times = []
    refill_s = []
    with tempfile.TemporaryDirectory(prefix="weightd-lora-") as tmp:
        adapters = []
        for i in range(args.rounds):
            d = os.path.join(args.ckpt_dir, "lora-r%d-%d" % (args.rank, i))
            if not os.path.exists(os.path.join(d, "adapter_config.json")):
                make_adapter(d, shapes, args.rank, seed=i)
            adapters.append(d)
        extra = [] if args.no_reserve else [
            "--warm-reserve-bytes", str(int(args.reserve_gib * (1 << 30)))]
        dmn = harness.Daemon(model_root=args.ckpt_dir, workdir=tmp, extra_args=extra)
        dmn.start()
        try:
            dmn.ctl_ok("load", "llama", path)
            for i, d in enumerate(adapters):
                dmn.ctl_ok("adapter", "load", "a%d" % i, d)
            subprocess.run([tool, "--socket", dmn.socket, "--model", "llama", "--world",
                            str(args.world), "--rank", "0"], check=True, stdout=subprocess.DEVNULL)
            for i in range(args.rounds):
                refill_s.append(wait_reserve(dmn))
                t0 = time.perf_counter()
                dmn.ctl_ok("apply", "llama", "a%d:0.5" % i)
                procs = [subprocess.Popen([tool, "--socket", dmn.socket, "--model", "llama",
                                           "--world", str(args.world), "--rank", str(r)],
                                          stdout=subprocess.PIPE, text=True)
                         for r in range(args.world)]
                for p in procs:
                    p.communicate()
                times.append(time.perf_counter() - t0)
        finally:
            dmn.stop()
        base = None
        if not args.skip_pytorch:
            adapter_sd = st_io.load(os.path.join(adapters[0], "adapter_model.safetensors"))
            base_all = [pytorch_merges(path, adapter_sd, 0.5, 2.0)
                        for _ in range(max(1, args.pytorch_rounds))]
            base = statistics.median(base_all)
    med = statistics.median(times)
    print("weightd apply -> %d rank(s) hold merged shards (rank-%d LoRA on all projections): "
          "median %.2f s [%s]" % (args.world, args.rank, med, ", ".join("%.2f" % t for t in times)))
    if not args.no_reserve:
        print("warm reserve %.1f GiB: waited %s s for the background refill before each apply"
              % (args.reserve_gib, ", ".join("%.1f" % t for t in refill_s)))
    result = {"figure": "lora_apply_to_ready", "world": args.world, "lora_rank": args.rank,
              "reserve_bytes": 0 if args.no_reserve else int(args.reserve_gib * (1 << 30)),
              "reserve_refill_wait_s": refill_s,
              "weightd_s": times, "weightd_median_s": med}
    if base is not None:
        print("PyTorch merges (W.float() + s*(B@A)).to(bf16), same shapes: %.2f s" % base)
        print("speedup: %.1fx" % (base / med))
        result.update({"pytorch_s": base, "pytorch_all_s": base_all, "speedup": base / med})
    print(json.dumps(result))


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# The demo (README): builds weightd, makes a small Llama-shaped checkpoint,
# starts the daemon, serves two ranks their shards at once over shared
# memory, shows a cast and the grpc transport, and prints what happened.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
bash scripts/deps.sh
bash scripts/build.sh >/dev/null
BIN=$REPO/build/bin
DEMO=${DEMO_DIR:-$(mktemp -d /tmp/weightd-demo-XXXXXX)}
mkdir -p "$DEMO/models"
SOCK=$DEMO/weightd.sock
ctl() { "$BIN/weightctl" --socket "$SOCK" "$@"; }
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "making a small Llama-shaped bf16 checkpoint in $DEMO/models/llama-mini"
/usr/bin/python3 - "$DEMO/models/llama-mini" <<'PY'
import sys
sys.path.insert(0, "bench")
import llama_ckpt
cfg = dict(vocab=1000, hidden=256, intermediate=688, layers=4, heads=8, kv_heads=2)
path = llama_ckpt.ensure_checkpoint(sys.argv[1], cfg)
print("wrote", path)
PY

step "starting weightd"
"$BIN/weightd" --socket "$SOCK" --model-root "$DEMO/models" >"$DEMO/weightd.log" 2>&1 &
DAEMON=$!
trap 'kill -TERM $DAEMON 2>/dev/null; wait $DAEMON 2>/dev/null || true' EXIT
for _ in $(seq 100); do ctl health >/dev/null 2>&1 && break; sleep 0.1; done
ctl health

step "loading the checkpoint"
ctl load llama "$DEMO/models/llama-mini"
ctl list

step "two ranks fetch their FSDP shards at the same time (shm, zero copy)"
ctl fetch llama --world 2 --rank 0 --out "$DEMO/rank0.safetensors" &
R0=$!
ctl fetch llama --world 2 --rank 1 --out "$DEMO/rank1.safetensors" &
R1=$!
wait $R0 $R1

step "checking the shards against PyTorch (torch.chunk of the full tensors)"
/usr/bin/python3 - "$DEMO" <<'PY'
import sys, torch
sys.path.insert(0, "tests/parity")
import st_io
demo = sys.argv[1]
full = st_io.load(demo + "/models/llama-mini/model.safetensors")
for r in range(2):
    shard = st_io.load("%s/rank%d.safetensors" % (demo, r))
    assert shard.keys() == full.keys()
    for k, t in full.items():
        assert torch.equal(shard[k], torch.chunk(t, 2, 0)[r]), k
    print("rank %d: %d tensors, %.1f MiB, equal to torch.chunk(t, 2, 0)[%d]" % (
        r, len(shard), sum(t.numel() * t.element_size() for t in shard.values()) / 2**20, r))
PY

step "the same checkpoint as a tensor-parallel model, through the Llama profile"
ctl load llama-tp "$DEMO/models/llama-mini" --profile deploy/profiles/llama-tp.json
ctl info llama-tp | grep -E "tensor: layers\.0\.(attn\.qkv|mlp\.gate_up)\.weight"
ctl fetch llama-tp --world 2 --rank 1 --out "$DEMO/tp-rank1.safetensors"
/usr/bin/python3 - "$DEMO" <<'PY'
import sys, torch
sys.path.insert(0, "tests/parity")
import st_io
demo = sys.argv[1]
full = st_io.load(demo + "/models/llama-mini/model.safetensors")
tp = st_io.load(demo + "/tp-rank1.safetensors")
p = "model.layers.0.self_attn."
want = torch.cat([torch.chunk(full[p + x + "_proj.weight"], 2, 0)[1] for x in "qkv"], 0)
assert torch.equal(tp["layers.0.attn.qkv.weight"], want)
print("TP rank 1 qkv = cat(q, k, v row halves), as vLLM's QKVParallelLinear: %s" % list(want.shape))
PY

step "an HSDP 2x2 rank asks for f32 over the grpc transport"
ctl fetch llama --mesh 2x2 --coord 1,0 --dtype f32 --transport grpc --out "$DEMO/hsdp-1-0.safetensors"

step "a bad request gets a precise error, and the daemon keeps serving"
ctl fetch llama --world 2 --rank 5 --out "$DEMO/bad.safetensors" || true
ctl health

step "making a PEFT LoRA adapter (r=4 on q_proj and v_proj)"
/usr/bin/python3 - "$DEMO/models/style-lora" <<'PY'
import json, os, sys, torch
sys.path.insert(0, "tests/parity")
import st_io
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
g = torch.Generator().manual_seed(7)
sd = {}
for l in range(4):
    for proj, rows in (("q_proj", 256), ("v_proj", 64)):
        key = "base_model.model.model.layers.%d.self_attn.%s" % (l, proj)
        sd[key + ".lora_A.weight"] = 0.05 * torch.randn(4, 256, generator=g)
        sd[key + ".lora_B.weight"] = 0.05 * torch.randn(rows, 4, generator=g)
st_io.save(sd, out + "/adapter_model.safetensors")
json.dump({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
           "target_modules": ["q_proj", "v_proj"]}, open(out + "/adapter_config.json", "w"))
print("wrote", out)
PY
ctl adapter load style "$DEMO/models/style-lora"

step "a worker watches for new generations while the operator swaps the adapter in live"
ctl watch llama --count 1 > "$DEMO/watch.txt" &
WATCH=$!
sleep 0.5
ctl apply llama style:0.8
wait $WATCH
echo "watcher saw: $(cat "$DEMO/watch.txt")"

step "rank 0 refreshes only what changed since generation 1, and checks the merge"
ctl fetch llama --world 2 --rank 0 --changed-since 1 --out "$DEMO/rank0-delta.safetensors"
/usr/bin/python3 - "$DEMO" <<'PY'
import sys, torch
sys.path.insert(0, "tests/parity")
import st_io
demo = sys.argv[1]
base = st_io.load(demo + "/models/llama-mini/model.safetensors")
lora = st_io.load(demo + "/models/style-lora/adapter_model.safetensors")
delta = st_io.load(demo + "/rank0-delta.safetensors")
print("changed tensors:", len(delta), "(the q_proj and v_proj weights)")
worst = 0
for name, got in sorted(delta.items()):
    key = "base_model.model." + name[:-len(".weight")]
    A, B = lora[key + ".lora_A.weight"], lora[key + ".lora_B.weight"]
    want = (base[name].float() + 0.8 * 2.0 * (B @ A)).to(torch.bfloat16)
    want = torch.chunk(want, 2, 0)[0]
    ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs().max().item()
    worst = max(worst, ulps)
print("merged shards vs PyTorch W + 0.8*(alpha/r)*(B@A), rounded once to bf16: max %d ulp" % worst)
PY
ctl info llama | grep -E "^(generation|adapters):"

step "back to the base weights"
ctl apply llama

step "daemon statistics"
ctl stats
step "daemon log"
cat "$DEMO/weightd.log"
echo
echo "demo files are in $DEMO"

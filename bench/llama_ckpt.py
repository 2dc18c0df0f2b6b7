"""Llama-shaped safetensors checkpoints for the benchmarks, written tensor by
tensor (never the whole model in memory). TinyLlama-1.1B layout by default:
~2.2 GB in bf16."""
import json
import os
import struct

import torch

TINYLLAMA = dict(vocab=32000, hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4)

# The benchmark suite's sizes (bench/suite.py). Llama-shaped, bf16; bytes in
# the comments. "table201" has TinyLlama's 201-tensor table at tiny sizes
# (the control-plane benchmark).
CONFIGS = {
    "table201": dict(vocab=1024, hidden=64, intermediate=176, layers=22, heads=4, kv_heads=2),
    "10m": dict(vocab=4096, hidden=256, intermediate=704, layers=4, heads=4, kv_heads=2),
    "37m": dict(vocab=8000, hidden=512, intermediate=1408, layers=4, heads=8, kv_heads=2),
    "167m": dict(vocab=16000, hidden=768, intermediate=2048, layers=10, heads=12,
                      kv_heads=4),
    "0.3g": dict(vocab=32000, hidden=1024, intermediate=2816, layers=8, heads=16, kv_heads=4),
    "1g": dict(vocab=32000, hidden=2048, intermediate=5632, layers=9, heads=32, kv_heads=4),
    "2g": dict(vocab=32000, hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4),
    "4g": dict(vocab=32000, hidden=2560, intermediate=6912, layers=28, heads=20, kv_heads=4),
}


def config_bytes(config, esize=2):
    total = 0
    for _, shape in llama_shapes(**config):
        n = 1
        for d in shape:
            n *= d
        total += n * esize
    return total


def llama_shapes(vocab, hidden, intermediate, layers, heads, kv_heads):
    head_dim = hidden // heads
    shapes = [("model.embed_tokens.weight", [vocab, hidden])]
    for i in range(layers):
        p = "model.layers.%d." % i
        shapes += [
            (p + "input_layernorm.weight", [hidden]),
            (p + "self_attn.q_proj.weight", [heads * head_dim, hidden]),
            (p + "self_attn.k_proj.weight", [kv_heads * head_dim, hidden]),
            (p + "self_attn.v_proj.weight", [kv_heads * head_dim, hidden]),
            (p + "self_attn.o_proj.weight", [hidden, heads * head_dim]),
            (p + "post_attention_layernorm.weight", [hidden]),
            (p + "mlp.gate_proj.weight", [intermediate, hidden]),
            (p + "mlp.up_proj.weight", [intermediate, hidden]),
            (p + "mlp.down_proj.weight", [hidden, intermediate]),
        ]
    shapes += [("model.norm.weight", [hidden]), ("lm_head.weight", [vocab, hidden])]
    return shapes


def write_checkpoint(path, shapes, dtype=torch.bfloat16, seed=0):
    esize = torch.tensor([], dtype=dtype).element_size()
    st = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}[dtype]
    header, off = {}, 0
    for name, shape in shapes:
        n = 1
        for d in shape:
            n *= d
        header[name] = {"dtype": st, "shape": shape, "data_offsets": [off, off + n * esize]}
        off += n * esize
    hb = json.dumps(header).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    gen = torch.Generator().manual_seed(seed)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for name, shape in shapes:
            t = torch.randn(shape, generator=gen).mul_(0.02).to(dtype)
            f.write(t.view(-1).view(torch.uint8).numpy().tobytes())
    os.replace(tmp, path)
    return off


def ensure_checkpoint(directory, config=TINYLLAMA, dtype=torch.bfloat16):
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "model.safetensors")
    if not os.path.exists(path):
        write_checkpoint(path, llama_shapes(**config), dtype)
    return path

"""Minimal safetensors reader/writer for the test suites (no `safetensors`
package on Debian bookworm). Tensors are torch tensors; bf16 and the FP8
types (absent from torch 1.13) are carried as raw bytes where needed."""
import json
import struct

import torch

_TO_ST = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
    torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
_FROM_ST = {v: k for k, v in _TO_ST.items()}


def tensor_bytes(t):
    t = t.contiguous()
    if t.numel() == 0:
        return b""
    return t.view(-1).view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool \
        else t.view(-1).to(torch.uint8).numpy().tobytes()


def save(tensors, path, metadata=None, raw=None):
    """tensors: {name: torch.Tensor}; raw: {name: (dtype_str, shape, bytes)}."""
    entries = []
    for name, t in tensors.items():
        entries.append((name, _TO_ST[t.dtype], list(t.shape), tensor_bytes(t)))
    for name, (dt, shape, data) in (raw or {}).items():
        entries.append((name, dt, list(shape), data))
    header = {}
    if metadata:
        header["__metadata__"] = metadata
    off = 0
    for name, dt, shape, data in entries:
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(data)]}
        off += len(data)
    hb = json.dumps(header).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for _, _, _, data in entries:
            f.write(data)


def load_raw(path):
    """{name: (dtype_str, shape, bytes)} in file order."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    base = 8 + n
    out = {}
    for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        b, end = e["data_offsets"]
        out[name] = (e["dtype"], e["shape"], blob[base + b:base + end])
    return out


def to_tensor(dtype_str, shape, data):
    dt = _FROM_ST[dtype_str]
    if len(data) == 0:
        return torch.empty(shape, dtype=dt)
    if dt == torch.bool:
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.bool).reshape(shape)
    return torch.frombuffer(bytearray(data), dtype=dt).reshape(shape).clone()


def load(path):
    return {k: to_tensor(*v) for k, v in load_raw(path).items()}

"""Independent references shared by the parity suites: a bit-level port of
PyTorch's FP8 conversions, the DTensor sharding rule (torch.chunk), and the
comparison of fetched tensors with PyTorch's."""
import numpy as np
import torch

import st_io


# --------------------------------------------------------------------------
# FP8 reference: bit-level port of c10/util/Float8_e4m3fn.h
# (fp8e4m3fn_from_fp32_value) and c10/util/Float8_e5m2.h (fp8e5m2_from_fp32_value).
# Inputs are float32; wider/narrower inputs reach these through float, as in
# PyTorch (F64 is rounded to F32 first, F16/BF16 widen exactly).
# --------------------------------------------------------------------------
def _f32_bits(x):
    return np.uint32(np.array([x], dtype=np.float32).view(np.uint32)[0])


def _bits_f32(b):
    return np.array([b], dtype=np.uint32).view(np.float32)[0]


def fp8e4m3fn_from_fp32_value(f):
    fp8_max = 1087 << 20
    denorm_mask = 141 << 23
    f_bits = int(_f32_bits(f))
    sign = f_bits & 0x80000000
    f_bits ^= sign
    if f_bits >= fp8_max:
        result = 0x7F
    elif f_bits < (121 << 23):
        # float32 addition (round to nearest even) does the denormal rounding
        s = np.float32(_bits_f32(f_bits)) + np.float32(_bits_f32(denorm_mask))
        f_bits = int(_f32_bits(s))
        result = (f_bits - denorm_mask) & 0xFF
    else:
        mant_odd = (f_bits >> 20) & 1
        f_bits = (f_bits + (((7 - 127) << 23) & 0xFFFFFFFF) + 0x7FFFF) & 0xFFFFFFFF
        f_bits = (f_bits + mant_odd) & 0xFFFFFFFF
        result = (f_bits >> 20) & 0xFF
    return result | ((sign >> 24) & 0xFF)


def fp8e5m2_from_fp32_value(f):
    fp32_inf = 255 << 23
    fp8_max = 143 << 23
    denorm_mask = 134 << 23
    f_bits = int(_f32_bits(f))
    sign = f_bits & 0x80000000
    f_bits ^= sign
    if f_bits >= fp8_max:
        result = 0x7F if f_bits > fp32_inf else 0x7C
    elif f_bits < (113 << 23):
        s = np.float32(_bits_f32(f_bits)) + np.float32(_bits_f32(denorm_mask))
        f_bits = int(_f32_bits(s))
        result = (f_bits - denorm_mask) & 0xFF
    else:
        mant_odd = (f_bits >> 21) & 1
        f_bits = (f_bits + (((15 - 127) << 23) & 0xFFFFFFFF) + 0xFFFFF) & 0xFFFFFFFF
        f_bits = (f_bits + mant_odd) & 0xFFFFFFFF
        result = (f_bits >> 21) & 0xFF
    return result | ((sign >> 24) & 0xFF)


FP8_FN = {"f8_e4m3": fp8e4m3fn_from_fp32_value, "f8_e5m2": fp8e5m2_from_fp32_value}


def fp8_bytes(t, req):
    """Reference FP8 bytes of a float tensor (any float dtype), via float32."""
    vals = t.detach().to(torch.float32).contiguous().view(-1).numpy()
    fn = FP8_FN[req]
    with np.errstate(all="ignore"):
        return bytes(bytearray(fn(v) for v in vals))


def chunk_range(n, m, r):
    c = -(-n // m)
    return min(n, r * c), min(n, (r + 1) * c)


def _same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and st_io.tensor_bytes(a) == st_io.tensor_bytes(b)


def shard_ref(t, mesh, coord, placements):
    """Local piece of t; None when a Shard dim is out of range (expected error).
    Placements apply in mesh-dim order on the piece the previous one left."""
    if t.dim() == 0:
        return t
    piece = t
    for m, r, p in zip(mesh, coord, placements):
        if p == "R":
            continue
        d = int(p[1:])
        if d >= piece.dim():
            return None
        s, e = chunk_range(piece.shape[d], m, r)
        sub = piece.narrow(d, s, e - s)
        chunks = torch.chunk(piece, m, d)
        if len(chunks) > r:   # torch.chunk may return fewer pieces than m
            assert _same_bits(chunks[r], sub), "chunk rule disagrees with torch.chunk"
        piece = sub
    return piece




def cast_shard_ref(t, world, rank, dtype=None):
    """docs/DESIGN.md §2.1 on a 1-D mesh: torch.chunk(t.to(dtype), world, 0)[rank] (an
    empty piece where torch.chunk returns fewer pieces; 0-dim tensors whole).
    Integer and bool tensors keep their dtype; `dtype` is a torch dtype or
    None (keep)."""
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return shard_ref(t, [world], [rank], ["S0"])


_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
         torch.bfloat16: torch.int16}


def assert_matches_torch(got, ref, what):
    """{name: tensor} `got` equals `ref` bit for bit, except that NaN is
    compared as NaN-ness (docs/DESIGN.md §2.3)."""
    assert sorted(got) == sorted(ref), what
    for k, r in ref.items():
        g = got[k]
        assert (g.dtype, tuple(g.shape)) == (r.dtype, tuple(r.shape)), "%s: %s" % (what, k)
        if r.dtype in _BITS:
            nan = torch.isnan(r)
            assert torch.equal(torch.isnan(g), nan), "%s: %s NaN-ness" % (what, k)
            bits = _BITS[r.dtype]
            assert torch.equal(g.contiguous().view(bits)[~nan], r.contiguous().view(bits)[~nan]), \
                "%s: %s differs from PyTorch" % (what, k)
        else:
            assert torch.equal(g, r), "%s: %s differs from PyTorch" % (what, k)

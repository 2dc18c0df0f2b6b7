"""LoRA merge parity (docs/DESIGN.md §2.5, §2.4 "LoRA merge", reference lora-formats.md §0,
§1.3-1.6, §2.1, §2.4.1) through the real weightd + weightctl.

One daemon for the module. Base: a small Llama-shaped checkpoint (hidden 64,
intermediate 96, 2 layers, GQA k/v with 32 rows, embed, norms, lm_head, plus a
GPT-2-style `model.layers.0.mlp.c_fc.weight` stored [in, out]) served twice:
as BF16 ("llama16") and as an F32 model ("llama32", the full-precision values
the BF16 copy was rounded from). Adapters are written by the test: PEFT (plain,
use_rslora, alpha_pattern + rank_pattern, fan_in_fan_out, DoRA,
modules_to_save), kohya, and a FastVideo dense payload (.diff / .set_weight /
.diff_param, incl. a parameter the base lacks). Every case is applied with
`weightctl apply` (one new generation each) and fetched at the current
generation over TP 1/2/4 on dim 0 (default placements and --placements S0)
and dim 1 (--placements S1), in keep/bf16/f16/f32.

PyTorch reference (one rounding):
    W' = (fp32(W) + Σ_i s_i · (fp32(B_i) @ fp32(A_i))).to(out_dtype),
    s_i = fp32(strength_i · scale_i), scale = alpha/r (alpha/sqrt(r) with
    use_rslora), ΔW transposed for fan_in_fan_out, .set_weight → strength·V,
    .diff → += strength·V, modules_to_save → V (PEFT has no strength for it),
    DoRA (lora_patch.h, PEFT set_scale semantics: strength enters ΔW inside
    the norm): W' = (m / ||W + ΔW||_row) ⊙ (W + ΔW).
Tolerances (GEMM order / FMA differ from PyTorch): F32 outputs of low-rank
merges allclose(rtol=1e-5, atol=1e-6·max|W'|); BF16/F16 outputs equal up to
1 ulp (int16 bit patterns |diff| <= 1) on at most 0.5% of the elements (counted
per case, model, dtype and tensor over all layouts) -- except that an element
where W + ΔW nearly cancels may be further off in narrow ulps as long as it is
within the F32 atol of the fp32 reference (there the fp32 GEMM-order error is
larger than the result's bf16 ulp); dense payloads, modules_to_save and
untouched tensors bit for bit.

Error cases: unknown adapter, shape-mismatched LoRA, a module the model lacks,
bad strengths, malformed adapter files, paths outside the model root, stale
--expect-generation.
"""
import collections
import concurrent.futures
import itertools
import json
import math
import os
import re
import sys
import threading

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import Daemon  # noqa: E402
import st_io  # noqa: E402
from reference import chunk_range  # noqa: E402

H, INTER, KV, VOCAB, LAYERS = 64, 96, 32, 128, 2
MODELS = {"llama16": torch.bfloat16, "llama32": torch.float32}
PARALLEL = 6
# (world, placements flag or None = default placements Shard(0))
LAYOUTS = [(1, None), (2, None), (4, "S0"), (2, "S1"), (4, "S1")]
DTYPES = {"llama16": ("keep", "bf16", "f16", "f32"), "llama32": ("keep", "bf16", "f16")}
_REQ = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
_ST = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_FROM_ST = {v: k for k, v in _ST.items()}
ULP_FRACTION = 0.005

# --------------------------------------------------------------------------
# Base checkpoint
# --------------------------------------------------------------------------
PROJ = {  # module suffix -> (out, in) of its weight
    "self_attn.q_proj": (H, H), "self_attn.k_proj": (KV, H), "self_attn.v_proj": (KV, H),
    "self_attn.o_proj": (H, H), "mlp.gate_proj": (INTER, H), "mlp.up_proj": (INTER, H),
    "mlp.down_proj": (H, INTER),
}
CFC = "model.layers.0.mlp.c_fc"   # GPT-2 Conv1D layout: weight stored [in=64, out=96]


def build_base():
    g = torch.Generator().manual_seed(20240611)

    def w(*shape, s=0.05):
        return torch.randn(*shape, generator=g, dtype=torch.float32) * s

    ck = {"model.embed_tokens.weight": w(VOCAB, H, s=1.0)}
    for i in range(LAYERS):
        p = "model.layers.%d." % i
        ck[p + "input_layernorm.weight"] = 1 + w(H, s=0.1)
        for mod, (o, n) in PROJ.items():
            ck[p + mod + ".weight"] = w(o, n)
        ck[p + "post_attention_layernorm.weight"] = 1 + w(H, s=0.1)
    ck[CFC + ".weight"] = w(H, INTER)
    ck["model.norm.weight"] = 1 + w(H, s=0.1)
    ck["lm_head.weight"] = w(VOCAB, H)
    return {"llama32": ck, "llama16": {k: v.to(torch.bfloat16) for k, v in ck.items()}}


# --------------------------------------------------------------------------
# Adapters (files + the ops the reference applies)
# --------------------------------------------------------------------------
class Adapter:
    def __init__(self, name, path, fmt="auto"):
        self.name, self.path, self.fmt = name, path, fmt
        self.ops = []   # (kind, target, payload...) in application order

    def targets(self):
        return [op[1] for op in self.ops]


_gen = torch.Generator().manual_seed(777)


def _factors(out, inn, r, dtype):
    a = (torch.randn(r, inn, generator=_gen) * 0.2).to(dtype)
    b = (torch.randn(out, r, generator=_gen) * 0.2).to(dtype)
    return a, b


def _modules(layers=range(LAYERS), mods=PROJ):
    return ["model.layers.%d.%s" % (i, m) for i in layers for m in mods]


def _shape(module):
    return PROJ[module.split(".", 3)[3]]


def _peft_dir(root, name, config, tensors):
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    if not isinstance(config, str):   # a str is written as is (malformed configs)
        cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "bias": "none"}
        cfg.update(config)
        config = json.dumps(cfg)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write(config)
    st_io.save(tensors, os.path.join(path, "adapter_model.safetensors"))
    return path


def _peft_match(patterns, module):
    """PEFT: first key in order with re.match(rf"(.*\\.)?({key})$", module)."""
    for k, v in patterns.items():
        if re.match(r"(.*\.)?(%s)$" % k, module):
            return v
    return None


def make_peft(root, name, modules, r, alpha, dtype=torch.float32, rslora=False,
              rank_pattern=None, alpha_pattern=None, extra_config=None):
    ad = Adapter(name, None)
    tensors = {}
    for m in modules:
        rr = _peft_match(rank_pattern or {}, m) or r
        aa = _peft_match(alpha_pattern or {}, m)
        aa = alpha if aa is None else aa
        out, inn = _shape(m)
        a, b = _factors(out, inn, rr, dtype)
        tensors["base_model.model.%s.lora_A.weight" % m] = a
        tensors["base_model.model.%s.lora_B.weight" % m] = b
        scale = aa / math.sqrt(rr) if rslora else aa / rr
        ad.ops.append(("lora", m + ".weight", a.float(), b.float(), scale, False))
    cfg = {"r": r, "lora_alpha": alpha, "use_rslora": rslora,
           "target_modules": sorted({m.rsplit(".", 1)[1] for m in modules}),
           "rank_pattern": rank_pattern or {}, "alpha_pattern": alpha_pattern or {}}
    cfg.update(extra_config or {})
    ad.path = _peft_dir(root, name, cfg, tensors)
    return ad


def make_fifo(root, name):
    """fan_in_fan_out on the [in, out]-stored c_fc: A [r, in=64], B [out=96, r],
    ΔW = (B @ A)ᵀ of shape [64, 96]."""
    ad = Adapter(name, None)
    a, b = _factors(INTER, H, 4, torch.float32)
    tensors = {"base_model.model.%s.lora_A.weight" % CFC: a,
               "base_model.model.%s.lora_B.weight" % CFC: b}
    ad.ops.append(("lora", CFC + ".weight", a, b, 8 / 4, True))
    ad.path = _peft_dir(root, name, {"r": 4, "lora_alpha": 8, "fan_in_fan_out": True,
                                     "target_modules": ["c_fc"]}, tensors)
    return ad


def make_dora(root, name, base32):
    ad = Adapter(name, None)
    tensors = {}
    r, alpha = 8, 16
    for m in ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.k_proj",
              "model.layers.1.mlp.down_proj"):
        out, inn = _shape(m)
        a, b = _factors(out, inn, r, torch.float32)
        w = base32[m + ".weight"]
        # the trained magnitude starts at ||W + s·BA||_row; perturb it a little
        mag = torch.linalg.norm(w + (b @ a) * (alpha / r), dim=1)
        mag = (mag * (1 + 0.1 * torch.randn(out, generator=_gen))).to(torch.float32)
        tensors["base_model.model.%s.lora_A.weight" % m] = a
        tensors["base_model.model.%s.lora_B.weight" % m] = b
        tensors["base_model.model.%s.lora_magnitude_vector" % m] = mag
        ad.ops.append(("dora", m + ".weight", a, b, alpha / r, mag))
    ad.path = _peft_dir(root, name, {"r": r, "lora_alpha": alpha, "use_dora": True,
                                     "target_modules": ["q_proj", "k_proj", "down_proj"]},
                        tensors)
    return ad


def make_mts(root, name):
    """modules_to_save lm_head (a replacement) + a LoRA on o_proj of layer 0."""
    ad = Adapter(name, None)
    m = "model.layers.0.self_attn.o_proj"
    a, b = _factors(H, H, 8, torch.bfloat16)
    head = (torch.randn(VOCAB, H, generator=_gen) * 0.05).to(torch.bfloat16)
    tensors = {"base_model.model.%s.lora_A.weight" % m: a,
               "base_model.model.%s.lora_B.weight" % m: b,
               "base_model.model.lm_head.weight": head}
    ad.ops.append(("lora", m + ".weight", a.float(), b.float(), 8 / 8, False))
    ad.ops.append(("replace", "lm_head.weight", head.float()))
    ad.path = _peft_dir(root, name, {"r": 8, "lora_alpha": 8, "target_modules": ["o_proj"],
                                     "modules_to_save": ["lm_head"]}, tensors)
    return ad


def make_kohya(root, name):
    ad = Adapter(name, os.path.join(root, name + ".safetensors"), "kohya")
    tensors = {}
    # (module, r, alpha tensor or None): alpha 4 -> 4/8; missing -> r; 0 -> r
    for m, r, alpha in (("model.layers.0.self_attn.q_proj", 8, 4.0),
                        ("model.layers.1.self_attn.v_proj", 4, None),
                        ("model.layers.1.mlp.gate_proj", 8, 0.0)):
        out, inn = _shape(m)
        a, b = _factors(out, inn, r, torch.float16)
        flat = "lora_unet_" + m.replace(".", "_")
        tensors[flat + ".lora_down.weight"] = a
        tensors[flat + ".lora_up.weight"] = b
        if alpha is not None:
            tensors[flat + ".alpha"] = torch.tensor(alpha, dtype=torch.float32)
        eff = r if not alpha else alpha
        ad.ops.append(("lora", m + ".weight", a.float(), b.float(), eff / r, False))
    st_io.save(tensors, ad.path)
    return ad


NEW_PARAM = "model.layers.0.self_attn.gate_compress.weight"


def make_dense(root, name):
    """FastVideo payload: `M.diff` (+= on M.weight), `M.set_weight` (M.weight =
    strength·V; may add a parameter), `P.diff_param` (+= on P)."""
    ad = Adapter(name, os.path.join(root, name + ".safetensors"), "dense")
    diff = torch.randn(H, INTER, generator=_gen) * 0.01
    setw = (torch.randn(H, INTER, generator=_gen) * 0.05).to(torch.bfloat16)
    dnorm = (torch.randn(H, generator=_gen) * 0.01).to(torch.float16)
    newp = torch.randn(16, H, generator=_gen) * 0.1
    tensors = {"model.layers.0.mlp.down_proj.diff": diff,
               "model.layers.1.mlp.down_proj.set_weight": setw,
               "model.norm.weight.diff_param": dnorm,
               "model.layers.0.self_attn.gate_compress.set_weight": newp}
    ad.ops += [("add", "model.layers.0.mlp.down_proj.weight", diff),
               ("set", "model.layers.1.mlp.down_proj.weight", setw.float()),
               ("add", "model.norm.weight", dnorm.float()),
               ("set", NEW_PARAM, newp)]
    st_io.save(tensors, ad.path)
    return ad


# --------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------
def _f32(x):
    return torch.tensor(np.float32(x), dtype=torch.float32)


def reference(base, stack):
    """base: {name: stored tensor}; stack: [(Adapter, strength)].
    Returns ({name: fp32 merged}, {name: "exact"|"lowrank"}) for patched names."""
    base32 = {k: v.float() for k, v in base.items()}
    acc, kinds = {}, {}
    for ad, strength in stack:
        st = np.float32(strength)
        for op in ad.ops:
            kind, tgt = op[0], op[1]
            cur = acc.get(tgt, base32.get(tgt))
            if kind in ("lora", "dora"):
                a, b, scale = op[2], op[3], op[4]
                s = _f32(float(st) * scale)   # fp32(strength · scale), after the matmul
                delta = (b.float() @ a.float()) * s
                if kind == "lora":
                    cur = cur + (delta.t() if op[5] else delta)
                else:
                    v = base32[tgt] + delta   # the norm comes from the pristine base
                    norm = torch.linalg.norm(v.double(), dim=1).float()
                    factor = op[5].float() / norm
                    cur = factor[:, None] * (cur + delta)
                kinds[tgt] = "lowrank"
            elif kind == "add":
                cur = cur + op[2].float() * _f32(st)
                kinds.setdefault(tgt, "exact")
            elif kind == "set":
                cur = op[2].float() * _f32(st)
                kinds.setdefault(tgt, "exact")
            elif kind == "replace":
                cur = op[2].float().clone()
                kinds.setdefault(tgt, "exact")
            acc[tgt] = cur
    return acc, kinds


def _piece(t, world, rank, dim):
    if t.dim() == 0 or world == 1:
        return t
    s, e = chunk_range(t.shape[dim], world, rank)
    return t.narrow(dim, s, e - s)


# --------------------------------------------------------------------------
# Fixture
# --------------------------------------------------------------------------
class Env:
    def __init__(self, d):
        self.d = d
        self.outdir = os.path.join(d.workdir, "out")
        os.makedirs(self.outdir, exist_ok=True)
        self._n = itertools.count()
        self._lock = threading.Lock()
        self.adapters = {}
        self.base = {}
        self.stored = {}

    def out(self):
        with self._lock:
            return os.path.join(self.outdir, "o%06d.safetensors" % next(self._n))

    def fetch(self, model, args):
        out = self.out()
        r = self.d.ctl("fetch", model, *args, "--out", out)
        if r.returncode != 0:
            return args, r, None
        got = st_io.load_raw(out)
        os.unlink(out)
        return args, r, got

    def fetch_many(self, jobs):
        """jobs: [(model, args)] -> [(args, CtlResult, {name: raw} or None)] in order."""
        with concurrent.futures.ThreadPoolExecutor(PARALLEL) as ex:
            return list(ex.map(lambda j: self.fetch(*j), jobs))

    def info(self, model):
        r = self.d.ctl_ok("info", model)
        gen, adapters, patched = None, None, {}
        for line in r.stdout.splitlines():
            if line.startswith("generation: "):
                gen = int(line.split(":", 1)[1])
            elif line.startswith("adapters: "):
                adapters = line.split(":", 1)[1].strip()
            elif line.startswith("tensor: "):
                fields = line[len("tensor: "):].split("\t")
                by = [f for f in fields if f.startswith("patched_by=")]
                patched[fields[0]] = by[0][len("patched_by="):].split(",") if by else []
        return gen, adapters, patched


@pytest.fixture(scope="module")
def env():
    d = Daemon(extra_args=[
        # Merges write into the warm reserve: small chunks, so a fetch's
        # outputs span several chunks, fresh segments (tensors larger than a
        # chunk) and, once the reserve runs dry, the fallback path.
        "--warm-reserve-bytes", str(4 << 20), "--reserve-chunk-bytes", str(64 << 10)])
    d.start()
    try:
        e = Env(d)
        bases = build_base()
        for model, ck in bases.items():
            path = os.path.join(d.model_root, model + ".safetensors")
            st_io.save(ck, path)
            d.ctl_ok("load", model, path)
            e.base[model] = st_io.load(path)
        root = os.path.join(d.model_root, "adapters")
        os.makedirs(root)
        b32 = {k: v.float() for k, v in bases["llama16"].items()}  # DoRA magnitudes
        ads = [
            make_peft(root, "plain", _modules(), 8, 16, dtype=torch.bfloat16),
            make_peft(root, "rslora", _modules(mods=["self_attn.q_proj", "self_attn.v_proj"]),
                      16, 8, dtype=torch.float16, rslora=True),
            # "proj" must match nothing (PEFT anchors the key at a '.' boundary)
            make_peft(root, "pattern",
                      _modules(mods=["self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj",
                                     "mlp.down_proj"]), 8, 16,
                      rank_pattern={"q_proj": 4, "down_proj": 12},
                      alpha_pattern={"proj": 1000, "q_proj": 32, "layers.1.mlp.down_proj": 6}),
            make_fifo(root, "fifo"),
            make_dora(root, "dora", b32),
            make_mts(root, "mts"),
            make_kohya(root, "kohya"),
            make_dense(root, "dense"),
        ]
        for ad in ads:
            args = ["adapter", "load", ad.name, ad.path]
            if ad.fmt != "auto":
                args += ["--format", ad.fmt]
            d.ctl_ok(*args)
            e.adapters[ad.name] = ad
        yield e
    finally:
        d.stop()


def test_adapter_list(env):
    r = env.d.ctl_ok("adapter", "list")
    rows = {line.split("\t")[0]: line for line in r.stdout.splitlines() if line.strip()}
    assert set(rows) == set(env.adapters), r.stdout
    formats = {n: re.search(r"format=(\w+)", l).group(1) for n, l in rows.items()}
    assert formats == {"plain": "peft", "rslora": "peft", "pattern": "peft", "fifo": "peft",
                       "dora": "peft", "mts": "peft", "kohya": "kohya", "dense": "dense"}
    params = {n: int(re.search(r"parameters=(\d+)", l).group(1)) for n, l in rows.items()}
    assert params == {n: len(a.ops) for n, a in env.adapters.items()}, r.stdout


# --------------------------------------------------------------------------
# Parity cases
# --------------------------------------------------------------------------
CASES = [
    ("base", []),
    ("plain", [("plain", 1.0)]),
    ("rslora", [("rslora", 1.0)]),
    ("pattern", [("pattern", 1.0)]),
    ("fan_in_fan_out", [("fifo", 1.0)]),
    ("dora", [("dora", 1.0)]),
    ("dora_strength", [("dora", 0.6)]),
    ("modules_to_save", [("mts", 0.8)]),
    ("kohya", [("kohya", 1.0)]),
    ("dense", [("dense", 1.0)]),
    ("dense_half", [("dense", 0.5)]),
    ("stack", [("plain", 0.7), ("kohya", -0.3)]),
    ("stack_dense_then_lora", [("dense", 1.0), ("plain", 0.5)]),
    ("back_to_base", []),
]


def _stack_args(stack):
    return ["%s:%r" % (n, s) for n, s in stack]


def _apply(env, model, stack):
    gen0, _, _ = env.info(model)
    r = env.d.ctl_ok("apply", model, *_stack_args(stack))
    assert r.stdout.startswith("%s generation %d: " % (model, gen0 + 1)), r.stdout
    gen, adapters, patched = env.info(model)
    assert gen == gen0 + 1
    # info's adapter line: "name:strength ..." in stack order, or "(none)"
    if stack:
        got = [a.rsplit(":", 1) for a in adapters.split()]
        assert [g[0] for g in got] == [n for n, _ in stack], adapters
        assert [float(g[1]) for g in got] == pytest.approx([s for _, s in stack]), adapters
    else:
        assert adapters == "(none)"
    return gen, patched


def _compare(label, raw, ref, exact, ulps, src32=None, atol32=0.0):
    gdt, gshape, gdata = raw
    assert gdt == _ST[ref.dtype], "%s: dtype %s, expected %s" % (label, gdt, _ST[ref.dtype])
    assert list(gshape) == list(ref.shape), "%s: shape %s, expected %s" % (label, gshape,
                                                                          list(ref.shape))
    want = st_io.tensor_bytes(ref)
    if exact or gdata == want:
        if gdata != want:
            g = np.frombuffer(gdata, dtype=np.uint8)
            w = np.frombuffer(want, dtype=np.uint8)
            n = int(np.count_nonzero(g != w)) if len(g) == len(w) else -1
            raise AssertionError("%s: not bit-exact (%d differing bytes)" % (label, n))
        if ulps is not None:
            ulps[1] += ref.numel()
        return
    if ref.dtype == torch.float32:
        got = st_io.to_tensor(gdt, gshape, gdata)
        atol = 1e-6 * float(ref.abs().max()) if ref.numel() else 0.0
        if not torch.allclose(got, ref, rtol=1e-5, atol=atol):
            err = ((got - ref).abs() - 1e-5 * ref.abs()).max().item()
            raise AssertionError("%s: F32 beyond rtol 1e-5 (max excess %g, atol %g)" % (
                label, err, atol))
        return
    gi = np.frombuffer(gdata, dtype=np.int16).astype(np.int32)
    wi = np.frombuffer(want, dtype=np.int16).astype(np.int32)
    diff = np.abs(gi - wi)
    big = diff > 1
    if big.any() and src32 is not None:
        # Catastrophic cancellation (W + ΔW ≈ 0): the fp32 GEMM-order error, a few
        # fp32 ulps of the operands, can be several narrow ulps of the tiny result.
        # Accept those when |got - fp32 ref| is within the F32 rule's atol.
        got = st_io.to_tensor(gdt, gshape, gdata).float().reshape(-1).numpy()
        r32 = src32.reshape(-1).numpy()
        big &= np.abs(got - r32) > atol32
    if big.any():
        i = int(np.flatnonzero(big)[0])
        got = st_io.to_tensor(gdt, gshape, gdata).reshape(-1)[i].item()
        f32 = "" if src32 is None else " (fp32 reference %r)" % src32.reshape(-1)[i].item()
        raise AssertionError("%s: %s differs by %d ulp at flat index %d: got %r, expected %r%s"
                             % (label, gdt, int(diff[i]), i, got, ref.reshape(-1)[i].item(), f32))
    ulps[0] += int(np.count_nonzero(diff))
    ulps[1] += diff.size


def _expected_patched(env, stack):
    want = collections.defaultdict(list)
    for name, _ in stack:
        for tgt in env.adapters[name].targets():
            if not want[tgt] or want[tgt][-1] != name:
                want[tgt].append(name)
    return dict(want)


@pytest.mark.parametrize("case,stack", CASES, ids=[c[0] for c in CASES])
def test_merge_parity(env, case, stack):
    resolved = [(env.adapters[n], s) for n, s in stack]
    jobs, refs = [], {}
    for model in MODELS:
        _, patched = _apply(env, model, stack)
        merged, kinds = reference(env.base[model], resolved)
        refs[model] = (merged, kinds)
        # info: patched_by= on exactly the targeted tensors, adapters in stack order
        want_by = _expected_patched(env, stack)
        got_by = {n: by for n, by in patched.items() if by}
        assert got_by == want_by, "%s/%s: patched_by %s, expected %s" % (model, case, got_by,
                                                                         want_by)
        names = set(env.base[model]) | set(merged)
        assert set(patched) == names, "%s: info lists %s" % (model, sorted(patched))
        two_d = sorted(n for n in names
                       if (merged[n] if n in merged else env.base[model][n]).dim() == 2)
        for (world, pl), dt in itertools.product(LAYOUTS, DTYPES[model]):
            for rank in range(world):
                args = ["--world", world, "--rank", rank, "--dtype", dt]
                if pl is not None:
                    args += ["--placements", pl]
                if pl == "S1":
                    args += ["--names", ",".join(two_d)]
                # The daemon's segments (shm) and the client's own memory
                # (push, the host twin of the CUDA push): the same bytes;
                # and a push that merges as it writes, element by element
                # (the GPU's merge, run on the CPU: --merge-on-push).
                for tr in (["shm"], ["push"], ["push", "--merge-on-push"]):
                    jobs.append((model, [str(a) for a in args + ["--transport"] + tr]))
    results = env.fetch_many(jobs)
    ulp_counts = collections.defaultdict(lambda: [0, 0])
    failures = []
    for (model, _), (args, r, got) in zip(jobs, results):
        label = "%s %s %s" % (case, model, " ".join(args))
        if r.returncode != 0:
            failures.append("%s: %s" % (label, r.stderr.strip()))
            continue
        merged, kinds = refs[model]
        a = dict(zip(args[::2], args[1::2]))
        world, rank, dt = int(a["--world"]), int(a["--rank"]), a["--dtype"]
        dim = 1 if a.get("--placements") == "S1" else 0
        base = env.base[model]
        want_names = set(a["--names"].split(",")) if "--names" in a else set(base) | set(merged)
        if set(got) != want_names:
            failures.append("%s: names %s, expected %s" % (label, sorted(got),
                                                           sorted(want_names)))
            continue
        for name, raw in got.items():
            if name in merged:
                src = merged[name]
                if dt != "keep":
                    out_dt = _REQ[dt]
                elif name in base:
                    out_dt = base[name].dtype
                else:   # a parameter the base lacks (docs/DESIGN.md §2.4):
                        # served in the dtype it arrives in
                    out_dt = _FROM_ST.get(raw[0], torch.float32)
                exact = kinds[name] == "exact"
            else:
                src = base[name]
                out_dt = _REQ[dt] if dt != "keep" else src.dtype
                exact = True
            piece = _piece(src, world, rank, dim)
            ref = piece.to(out_dt)
            ulps = ulp_counts[(model, dt, name)] if out_dt != torch.float32 else None
            try:
                _compare("%s: %s" % (label, name), raw, ref, exact, ulps,
                         piece.float().contiguous(), 1e-6 * float(src.abs().max()))
            except AssertionError as ex:
                failures.append(str(ex))
    assert not failures, "%d failures:\n%s" % (len(failures), "\n".join(failures[:25]))
    for (model, dt, name), (bad, total) in ulp_counts.items():
        assert bad <= ULP_FRACTION * total, "%s %s %s %s: %d of %d elements off by 1 ulp" % (
            case, model, dt, name, bad, total)


# --------------------------------------------------------------------------
# Error cases
# --------------------------------------------------------------------------
ERR_MODEL = "errm"


@pytest.fixture(scope="module")
def err_env(env):
    d = env.d
    d.ctl_ok("load", ERR_MODEL, os.path.join(d.model_root, "llama16.safetensors"))
    root = os.path.join(d.model_root, "bad")
    os.makedirs(root, exist_ok=True)
    return env, root


def _snapshot(env):
    """(generation, {name: raw}) of ERR_MODEL at the current generation."""
    gen, _, _ = env.info(ERR_MODEL)
    _, r, got = env.fetch(ERR_MODEL, ["--world", "2", "--rank", "1", "--dtype", "f32"])
    assert r.returncode == 0, r.stderr
    return gen, got


def _expect(r, code, what):
    assert r.returncode != 0, "%s: succeeded, expected %s: %s" % (what, code, r.stdout)
    assert r.error_code == code, "%s: got %r (%s), expected %s" % (what, r.error_code,
                                                                  r.stderr.strip(), code)


def test_apply_errors_leave_generation_unchanged(err_env):
    env, root = err_env
    d = env.d
    d.ctl_ok("apply", ERR_MODEL, "plain:0.25")
    gen, before = _snapshot(env)

    # unknown adapter
    _expect(d.ctl("apply", ERR_MODEL, "no_such_adapter"), "NOT_FOUND", "unknown adapter")
    _expect(d.ctl("apply", ERR_MODEL, "plain:1", "no_such_adapter:0.5"), "NOT_FOUND",
            "unknown adapter in a stack")

    # shape-mismatched LoRA: in=48 for a 64-wide layer; loads (it cannot know), apply fails
    m = "model.layers.0.self_attn.q_proj"
    a, b = _factors(H, 48, 8, torch.float32)
    p = _peft_dir(root, "shape48", {"r": 8, "lora_alpha": 8, "target_modules": ["q_proj"]},
                  {"base_model.model.%s.lora_A.weight" % m: a,
                   "base_model.model.%s.lora_B.weight" % m: b})
    d.ctl_ok("adapter", "load", "shape48", p)
    r = d.ctl("apply", ERR_MODEL, "shape48")
    _expect(r, "INVALID_ARGUMENT", "shape-mismatched LoRA")
    assert m in r.error_message, r.stderr
    _expect(d.ctl("apply", ERR_MODEL, "plain:1", "shape48:1"), "INVALID_ARGUMENT",
            "shape-mismatched LoRA second in a stack")

    # a module the model lacks (PEFT)
    m = "model.layers.5.self_attn.q_proj"
    a, b = _factors(H, H, 8, torch.float32)
    p = _peft_dir(root, "layer5", {"r": 8, "lora_alpha": 8, "target_modules": ["q_proj"]},
                  {"base_model.model.%s.lora_A.weight" % m: a,
                   "base_model.model.%s.lora_B.weight" % m: b})
    d.ctl_ok("adapter", "load", "layer5", p)
    r = d.ctl("apply", ERR_MODEL, "layer5")
    _expect(r, "INVALID_ARGUMENT", "module the model lacks")
    assert m in r.error_message, r.stderr
    # a .diff (additive: needs an existing parameter) on a parameter the model lacks
    p = os.path.join(root, "diff_missing.safetensors")
    st_io.save({"model.layers.9.mlp.down_proj.diff": torch.zeros(H, INTER)}, p)
    d.ctl_ok("adapter", "load", "diff_missing", p)
    _expect(d.ctl("apply", ERR_MODEL, "diff_missing"), "INVALID_ARGUMENT",
            ".diff on a missing parameter")
    # a .diff of the wrong shape
    p = os.path.join(root, "diff_shape.safetensors")
    st_io.save({"model.layers.0.mlp.down_proj.diff": torch.zeros(INTER, H)}, p)
    d.ctl_ok("adapter", "load", "diff_shape", p)
    _expect(d.ctl("apply", ERR_MODEL, "diff_shape"), "INVALID_ARGUMENT", ".diff of wrong shape")

    # bad strengths (CLI parsing)
    for spec in ("plain:abc", "plain:nan", "plain:inf", "plain:-inf", "plain:", "plain:1.0x"):
        _expect(d.ctl("apply", ERR_MODEL, spec), "INVALID_ARGUMENT", "strength %r" % spec)

    # stale --expect-generation
    r = d.ctl("apply", ERR_MODEL, "plain:1", "--expect-generation", gen - 1)
    _expect(r, "ABORTED", "stale --expect-generation")
    _expect(d.ctl("apply", ERR_MODEL, "plain:1", "--expect-generation", gen + 1), "ABORTED",
            "future --expect-generation")

    # nothing moved: same generation, same stack, same bytes
    gen2, after = _snapshot(env)
    assert gen2 == gen
    assert env.info(ERR_MODEL)[1] == "plain:0.25"
    assert after == before, "bytes changed after failed applies"

    # a matching --expect-generation succeeds
    r = d.ctl_ok("apply", ERR_MODEL, "--expect-generation", gen)
    assert r.stdout.startswith("%s generation %d: " % (ERR_MODEL, gen + 1)), r.stdout
    assert d.alive()


def test_nonfinite_strength_rejected_by_daemon(err_env):
    """The CLI refuses nan itself; the daemon must refuse it from any client."""
    env, _ = err_env
    import weightd
    c = weightd.Client(socket=env.d.socket)
    try:
        gen = env.info(ERR_MODEL)[0]
        for bad in (float("nan"), float("inf")):
            with pytest.raises(weightd.Error) as ei:
                c.apply(ERR_MODEL, [("plain", bad)])
            assert ei.value.code == "INVALID_ARGUMENT", ei.value
        assert env.info(ERR_MODEL)[0] == gen
    finally:
        c.close()


def test_adapter_load_errors(err_env):
    env, root = err_env
    d = env.d
    m = "model.layers.0.self_attn.q_proj"
    a, b = _factors(H, H, 8, torch.float32)
    cfg = {"r": 8, "lora_alpha": 8, "target_modules": ["q_proj"]}
    A, B = "base_model.model.%s.lora_A.weight" % m, "base_model.model.%s.lora_B.weight" % m
    cases = {
        "a_without_b": (cfg, {A: a}),
        "b_without_a": (cfg, {B: b}),
        "rank_mismatch": (cfg, {A: a, B: b[:, :4].contiguous()}),
        "config_r_mismatch": (dict(cfg, r=4), {A: a, B: b}),
        "config_not_json": ("{\"r\": 8, \"lora_alpha\": ", {A: a, B: b}),
        "config_r_string": (dict(cfg, r="eight"), {A: a, B: b}),
        "config_not_lora": (dict(cfg, peft_type="IA3"), {A: a, B: b}),
        "factor_3d": (cfg, {A: a.reshape(8, 8, 8), B: b}),
        "dora_without_magnitude": (dict(cfg, use_dora=True), {A: a, B: b}),
    }
    for name, (c, tensors) in cases.items():
        p = _peft_dir(root, name, c, tensors)
        _expect(d.ctl("adapter", "load", name, p), "INVALID_ARGUMENT", name)
    # kohya: up without down
    p = os.path.join(root, "kohya_up_only.safetensors")
    st_io.save({"lora_unet_model_layers_0_self_attn_q_proj.lora_up.weight": b}, p)
    _expect(d.ctl("adapter", "load", "kohya_up_only", p, "--format", "kohya"), "INVALID_ARGUMENT",
            "kohya up without down")
    # truncated safetensors
    p = os.path.join(root, "truncated")
    _peft_dir(root, "truncated", cfg, {A: a, B: b})
    f = os.path.join(p, "adapter_model.safetensors")
    with open(f, "rb") as fh:
        blob = fh.read()
    with open(f, "wb") as fh:
        fh.write(blob[:len(blob) - 100])
    _expect(d.ctl("adapter", "load", "truncated", p), "INVALID_ARGUMENT", "truncated file")
    # unknown --format
    _expect(d.ctl("adapter", "load", "fmt", env.adapters["kohya"].path, "--format", "lycoris"),
            "INVALID_ARGUMENT", "unknown --format")

    # outside the model root: a real path, a ../ escape and a symlink inside pointing out
    outside = os.path.join(d.workdir, "outside")
    _peft_dir(d.workdir, "outside", cfg, {A: a, B: b})
    _expect(d.ctl("adapter", "load", "outside", outside), "PERMISSION_DENIED", "outside path")
    _expect(d.ctl("adapter", "load", "outside", os.path.join(d.model_root, "..", "outside")),
            "PERMISSION_DENIED", "../ escape")
    link = os.path.join(root, "link_out")
    os.symlink(outside, link)
    _expect(d.ctl("adapter", "load", "outside", link), "PERMISSION_DENIED", "symlink out")

    # none of them is listed; the good ones still are; the daemon serves
    listed = {l.split("\t")[0] for l in d.ctl_ok("adapter", "list").stdout.splitlines() if l}
    assert not listed & (set(cases) | {"kohya_up_only", "truncated", "fmt", "outside"}), listed
    assert set(env.adapters) <= listed
    # loading a name twice fails without replacing the first
    _expect(d.ctl("adapter", "load", "plain", env.adapters["kohya"].path), "ALREADY_EXISTS",
            "duplicate adapter name")
    assert d.alive()


def test_unload_adapter_in_use(err_env):
    """An unloaded adapter can no longer be applied, but the generation that uses
    it keeps serving its merged bytes."""
    env, root = err_env
    d = env.d
    d.ctl_ok("adapter", "load", "tmp_kohya", env.adapters["kohya"].path)
    d.ctl_ok("apply", ERR_MODEL, "tmp_kohya:0.5")
    gen, before = _snapshot(env)
    d.ctl_ok("adapter", "unload", "tmp_kohya")
    _expect(d.ctl("adapter", "unload", "tmp_kohya"), "NOT_FOUND", "second unload")
    _expect(d.ctl("apply", ERR_MODEL, "tmp_kohya:0.5"), "NOT_FOUND", "apply unloaded")
    gen2, after = _snapshot(env)
    assert gen2 == gen and after == before
    _expect(d.ctl("apply", "no_such_model", "plain"), "NOT_FOUND", "unknown model")


def test_kohya_module_the_model_lacks(err_env):
    """Like PEFT above: an adapter that does not fit the model is the request's
    fault (INVALID_ARGUMENT); NOT_FOUND would read as "adapter/model not loaded"."""
    env, root = err_env
    d = env.d
    gen = env.info(ERR_MODEL)[0]
    p = os.path.join(root, "kohya_layer7.safetensors")
    a, b = _factors(H, H, 4, torch.float32)
    st_io.save({"lora_unet_model_layers_7_self_attn_q_proj.lora_down.weight": a,
                "lora_unet_model_layers_7_self_attn_q_proj.lora_up.weight": b}, p)
    d.ctl_ok("adapter", "load", "kohya_layer7", p)
    r = d.ctl("apply", ERR_MODEL, "kohya_layer7")
    assert env.info(ERR_MODEL)[0] == gen
    _expect(r, "INVALID_ARGUMENT", "kohya module the model lacks")

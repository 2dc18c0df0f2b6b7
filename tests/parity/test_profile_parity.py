"""Profile parity (docs/DESIGN.md §3, issue [2/7]): a Python reference written from
the seed loader's semantics — regex name mapping (first full match wins),
merge by index along dim 0, distribute_tensor = torch.chunk on the merged
full tensor (FSDP/HSDP), per-part tensor-parallel sharding as vLLM's
QKVParallelLinear / MergedColumnParallelLinear do, dtype rules, FP8
per-tensor quantization — against the real daemon, bit for bit.
"""
import json
import os
import re

import numpy as np
import pytest
import torch

from harness import Daemon
import st_io
from reference import chunk_range, fp8_bytes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROFILES = os.path.join(REPO, "deploy", "profiles")
CFG = dict(vocab=64, hidden=32, intermediate=48, layers=2, heads=4, kv_heads=2)

QUANT_PROFILE_EXTRA = {
    "quantize": [{"match": r"layers\.\d+\.(attn\.(qkv|o_proj)|mlp\.(gate_up|down_proj))\.weight",
                  "scheme": "fp8_e4m3_per_tensor"}]
}


def llama_state_dict(cfg, dtype=torch.bfloat16, seed=1):
    g = torch.Generator().manual_seed(seed)
    h, i, hd = cfg["hidden"], cfg["intermediate"], cfg["hidden"] // cfg["heads"]
    kv = cfg["kv_heads"] * hd
    sd = {"model.embed_tokens.weight": torch.randn(cfg["vocab"], h, generator=g)}
    for l in range(cfg["layers"]):
        p = "model.layers.%d." % l
        sd[p + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        sd[p + "self_attn.q_proj.weight"] = torch.randn(h, h, generator=g)
        sd[p + "self_attn.k_proj.weight"] = torch.randn(kv, h, generator=g)
        sd[p + "self_attn.v_proj.weight"] = torch.randn(kv, h, generator=g)
        sd[p + "self_attn.o_proj.weight"] = torch.randn(h, h, generator=g)
        sd[p + "post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        sd[p + "mlp.gate_proj.weight"] = torch.randn(i, h, generator=g)
        sd[p + "mlp.up_proj.weight"] = torch.randn(i, h, generator=g)
        sd[p + "mlp.down_proj.weight"] = torch.randn(h, i, generator=g)
    sd["model.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    sd["lm_head.weight"] = torch.randn(cfg["vocab"], h, generator=g)
    return {k: v.to(dtype) for k, v in sd.items()}


# ---------------------------------------------------------------- reference
def map_names(profile, sd):
    """The seed's param_names_mapping: {served: [(merge_index, source), ...]}."""
    groups = {}
    for name in sd:
        target, index = name, None
        for rule in profile.get("name_mapping", []):
            m = re.fullmatch(rule["match"], name)
            if m:
                target = m.expand(rule["target"])
                if rule.get("num_merges", 1) > 1:
                    index = rule["merge_index"]
                break
        groups.setdefault(target, []).append((index or 0, name))
    return {t: [n for _, n in sorted(parts)] for t, parts in groups.items()}


def first_rule(rules, name):
    for r in rules:
        if re.fullmatch(r["match"], name):
            return r
    return None


def expected_state(profile, sd, mesh, coord, dtype):
    """{served: (dtype_str, shape, bytes)} a rank must receive."""
    out = {}
    for served, parts in map_names(profile, sd).items():
        tensors = [sd[p] for p in parts]
        rule = first_rule(profile.get("placements", []), served)
        placements = rule["placements"] if rule else ["R"] * (len(mesh) - 1) + ["S0"]
        per_part = bool(rule and rule.get("per_part")) and len(tensors) > 1

        def shard(t):
            piece = t
            for m, r, p in zip(mesh, coord, placements):
                if p != "R":
                    d = int(p[1:])
                    s, e = chunk_range(piece.shape[d], m, r)
                    piece = piece.narrow(d, s, e - s)
            return piece

        if per_part:  # vLLM QKVParallelLinear: each projection split on its own
            local = torch.cat([shard(t) for t in tensors], 0)
        else:         # FSDP: distribute_tensor of the merged full tensor
            local = shard(torch.cat(tensors, 0))
        q = first_rule(profile.get("quantize", []), served)
        if q is not None:
            full = torch.cat(tensors, 0).float()
            amax = full.abs().max()
            scale = (amax / torch.tensor(448.0)).to(torch.float32)
            scaled = (local.float() / scale).clamp(-448.0, 448.0)
            out[served] = ("F8_E4M3", list(local.shape), fp8_bytes(scaled, "f8_e4m3"))
            out[served + "_scale"] = ("F32", [], st_io.tensor_bytes(scale.reshape([])))
            continue
        dr = first_rule(profile.get("dtype_rules", []), served)
        want = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[
            dr["dtype"] if dr else dtype]
        local = local.to(want)
        out[served] = ({torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}[want],
                       list(local.shape), st_io.tensor_bytes(local))
    return out


# ---------------------------------------------------------------- fixture
@pytest.fixture(scope="module")
def env(tmp_path_factory):
    work = tmp_path_factory.mktemp("profile")
    d = Daemon(workdir=str(work))
    sd = llama_state_dict(CFG)
    os.makedirs(os.path.join(d.model_root, "llama"))
    st_io.save(sd, os.path.join(d.model_root, "llama", "model.safetensors"))
    d.start()
    profiles = {}
    for name in ("llama-fsdp", "llama-tp"):
        with open(os.path.join(PROFILES, name + ".json")) as f:
            profiles[name] = json.load(f)
    quant = dict(profiles["llama-fsdp"], **QUANT_PROFILE_EXTRA)
    qpath = os.path.join(str(work), "quant.json")
    with open(qpath, "w") as f:
        json.dump(quant, f)
    profiles["quant"] = quant
    d.ctl_ok("load", "fsdp", os.path.join(d.model_root, "llama"), "--profile",
             os.path.join(PROFILES, "llama-fsdp.json"))
    d.ctl_ok("load", "tp", os.path.join(d.model_root, "llama"), "--profile",
             os.path.join(PROFILES, "llama-tp.json"))
    d.ctl_ok("load", "quant", os.path.join(d.model_root, "llama"), "--profile", qpath)
    yield d, sd, profiles, work
    d.stop()


def fetch_and_compare(env, model, profile_key, mesh, coord, dtype, transport="shm"):
    d, sd, profiles, work = env
    out = os.path.join(str(work), "%s-%s-%s-%s.safetensors" % (
        model, "x".join(map(str, mesh)), "_".join(map(str, coord)), dtype))
    args = ["fetch", model, "--dtype", dtype, "--transport", transport, "--out", out]
    if len(mesh) == 1:
        args += ["--world", mesh[0], "--rank", coord[0]]
    else:
        args += ["--mesh", "x".join(map(str, mesh)), "--coord", ",".join(map(str, coord))]
    d.ctl_ok(*args)
    got = st_io.load_raw(out)
    exp = expected_state(profiles[profile_key], sd, mesh, coord, dtype)
    assert sorted(got) == sorted(exp)
    for name, (dt, shape, data) in exp.items():
        assert got[name][0] == dt, name
        assert list(got[name][1]) == shape, (name, got[name][1], shape)
        assert got[name][2] == data, "%s differs (rank %s of %s)" % (name, coord, mesh)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tensor_parallel_per_part(env, tp):
    for rank in range(tp):
        fetch_and_compare(env, "tp", "llama-tp", [tp], [rank], "bf16")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fsdp_merged_sharded_as_whole(env, world):
    for rank in range(world):
        fetch_and_compare(env, "fsdp", "llama-fsdp", [world], [rank], "bf16")
        fetch_and_compare(env, "fsdp", "llama-fsdp", [world], [rank], "f16", "grpc")


def test_hsdp_2x2(env):
    for i in range(2):
        for j in range(2):
            fetch_and_compare(env, "fsdp", "llama-fsdp", [2, 2], [i, j], "bf16")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fp8_quantization_shares_one_scale(env, world):
    for rank in range(world):
        fetch_and_compare(env, "quant", "quant", [world], [rank], "bf16")


def test_info_shows_reverse_map(env):
    d = env[0]
    info = d.ctl_ok("info", "fsdp").stdout
    assert ("tensor: layers.0.attn.qkv.weight\tBF16\t[64,32]" in info), info
    assert ("from=model.layers.0.self_attn.q_proj.weight,model.layers.0.self_attn.k_proj.weight,"
            "model.layers.0.self_attn.v_proj.weight") in info
    assert "tensor: layers.1.input_layernorm.weight\tF32\t[32]" in info


# ---------------------------------------------------------------- bad profiles
BAD_PROFILES = [
    ({"name_mapping": [{"match": "(", "target": "x"}]}, "INVALID_ARGUMENT", "name_mapping[0].match"),
    ({"dtype_rules": [{"match": ".*", "dtype": "f13"}]}, "INVALID_ARGUMENT", "dtype_rules[0].dtype"),
    ({"placements": [{"match": ".*", "placements": ["X"]}]}, "INVALID_ARGUMENT", "placements[0].placements[0]"),
    ({"placements": [{"match": ".*", "placements": ["S0"], "per_part": True}]}, "INVALID_ARGUMENT", "per_part"),
    ({"name_mapping": [{"match": "a", "target": "b", "merge_index": 3, "num_merges": 3}]},
     "INVALID_ARGUMENT", "merge_index"),
    ({"bogus_key": 1}, "INVALID_ARGUMENT", "bogus_key"),
    ({"quantize": [{"match": ".*", "scheme": "int4"}]}, "INVALID_ARGUMENT", "quantize[0].scheme"),
    ({"strict": "yes"}, "INVALID_ARGUMENT", "strict"),
    # q and k merge into qkv but v never arrives: the group is incomplete.
    ({"name_mapping": [
        {"match": r"model\.layers\.(\d+)\.self_attn\.q_proj\.(.*)", "target": r"l.\1.qkv.\2", "merge_index": 0, "num_merges": 3},
        {"match": r"model\.layers\.(\d+)\.self_attn\.k_proj\.(.*)", "target": r"l.\1.qkv.\2", "merge_index": 1, "num_merges": 3}]},
     "FAILED_PRECONDITION", "l.0.qkv.weight"),
    # Parts that disagree on dims after 0 cannot be concatenated.
    ({"name_mapping": [
        {"match": r"model\.layers\.0\.self_attn\.q_proj\.weight", "target": "m", "merge_index": 0, "num_merges": 2},
        {"match": r"model\.layers\.0\.mlp\.down_proj\.weight", "target": "m", "merge_index": 1, "num_merges": 2}]},
     "INVALID_ARGUMENT", "m"),
    ({"expected": {"model.embed_tokens.weight": {"shape": [3, 3]}}, "strict": False},
     "INVALID_ARGUMENT", "[3, 3]"),
    ({"expected": {"model.missing.weight": {"shape": [2]}}, "strict": False},
     "FAILED_PRECONDITION", "model.missing.weight"),
]


@pytest.mark.parametrize("profile,code,needle", BAD_PROFILES)
def test_bad_profile_loads_nothing(env, profile, code, needle):
    d, _, _, work = env
    before = d.ctl_ok("stats").stdout
    path = os.path.join(str(work), "bad.json")
    with open(path, "w") as f:
        json.dump(profile, f)
    r = d.ctl("load", "badprof", os.path.join(d.model_root, "llama"), "--profile", path)
    assert r.error_code == code, r.stderr
    assert needle in r.error_message, r.stderr
    assert "badprof" not in d.ctl_ok("list").stdout
    resident = [l for l in before.splitlines() if l.startswith("bytes_resident")]
    assert resident == [l for l in d.ctl_ok("stats").stdout.splitlines() if l.startswith("bytes_resident")]


def test_expected_keys_report_and_zero_fill(env):
    d, sd, _, work = env
    expected = {k.replace("model.", "", 1): {"shape": list(v.shape)} for k, v in sd.items()
                if k.startswith("model.") and "layers.1." not in k}
    for l in range(CFG["layers"]):
        expected["layers.%d.attn.gate_compress.weight" % l] = {"shape": [4, 4], "dtype": "bf16"}
    profile = {"name_mapping": [{"match": r"model\.(.*)", "target": r"\1"}],
               "expected": expected, "strict": False, "allow_new": ["gate_compress"]}
    path = os.path.join(str(work), "expected.json")
    with open(path, "w") as f:
        json.dump(profile, f)
    r = d.ctl_ok("load", "exp", os.path.join(d.model_root, "llama"), "--profile", path)
    assert "layers.{0,1}.attn.gate_compress.weight" in r.stdout, r.stdout  # summarized, one line
    assert "layers.1." in r.stdout  # unexpected keys reported, summarized
    out = os.path.join(str(work), "exp.safetensors")
    d.ctl_ok("fetch", "exp", "--names", "layers.0.attn.gate_compress.weight,embed_tokens.weight",
             "--out", out)
    got = st_io.load(out)
    assert torch.equal(got["layers.0.attn.gate_compress.weight"], torch.zeros(4, 4, dtype=torch.bfloat16))
    assert torch.equal(got["embed_tokens.weight"], sd["model.embed_tokens.weight"])
    assert d.ctl("fetch", "exp", "--names", "layers.1.mlp.up_proj.weight", "--out", out).error_code == "NOT_FOUND"
    profile["strict"] = True
    with open(path, "w") as f:
        json.dump(profile, f)
    r = d.ctl("load", "exp_strict", os.path.join(d.model_root, "llama"), "--profile", path)
    assert r.error_code == "INVALID_ARGUMENT", r.stderr
    assert "layers.1." in r.error_message

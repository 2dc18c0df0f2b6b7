"""Bad-input catalogue, adapters and apply requests (docs/DESIGN.md §2.4, §2.5 "LoRA merge",
§4.2 adapter load / apply, docs/style.md rule 3; the checkpoint cases are in
test_bad_inputs_core.py, the profile cases in tests/parity/test_profile_parity.py).

One daemon serves the module. Model "good" is loaded and adapter "ok" applied
(generation 2, so the bytes it serves are merged ones); a few ranks/dtypes
are fetched as the baseline. Every malformed adapter, bad strength and bad
apply below must fail with exactly its canonical code, in one `error: CODE:
message` line whose message names the file or tensor at fault; after each
case the model is still at generation 2 with the same tensor digests and a
fetch returns bit-identical bytes; the last test re-fetches every baseline.
A few inputs that look wrong but are legal (kohya without alpha, negative
lora_alpha, keys not understood without --strict) are checked to load and
merge as the reference says.

Run: WEIGHTD_BUILD=build /usr/bin/python3 -m pytest -q tests/integration/test_bad_inputs_adapters.py
"""
import json
import os
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import Daemon  # noqa: E402
import st_io  # noqa: E402

import weightd  # noqa: E402  (build/python, put on sys.path by harness)

MODEL = "good"
IN = 8
SHAPES = {"layers.0.q.weight": (16, IN), "layers.0.v.weight": (12, IN), "emb.weight": (10, IN)}


def _base():
    g = torch.Generator().manual_seed(515)
    return {"layers.0.q.weight": torch.randn(16, IN, generator=g),
            "layers.0.v.weight": torch.randn(12, IN, generator=g).to(torch.bfloat16),
            "emb.weight": torch.randn(10, IN, generator=g),
            "norm.weight": torch.randn(IN, generator=g),
            "ids": torch.arange(5, dtype=torch.int64)}


BASELINE_REQUESTS = [
    ("w2r1_f32", ["--world", 2, "--rank", 1, "--dtype", "f32"]),
    ("w1_keep", []),
    ("w3r0_bf16_grpc", ["--world", 3, "--rank", 0, "--dtype", "bf16", "--transport", "grpc"]),
]


# --------------------------------------------------------------------------- adapter files

def peft_dir(path, tensors, config):
    """A PEFT adapter directory: adapter_model.safetensors + adapter_config.json
    (`config` a dict, or raw text when a str, or None for no config file)."""
    os.makedirs(path, exist_ok=True)
    st_io.save(tensors, os.path.join(path, "adapter_model.safetensors"))
    if config is not None:
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            f.write(config if isinstance(config, str) else json.dumps(config))
    return path


def lora(module, r, out, inn, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return {"base_model.model.%s.lora_A.weight" % module: torch.randn(r, inn, generator=g).to(dtype),
            "base_model.model.%s.lora_B.weight" % module: torch.randn(out, r, generator=g).to(dtype)}


CFG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4}


class Ctx:
    def __init__(self, d):
        self.d = d
        self.root = d.model_root
        self.out_dir = os.path.join(d.workdir, "out")
        self.outside = os.path.join(d.workdir, "outside")
        for p in (self.out_dir, self.outside):
            os.makedirs(p, exist_ok=True)
        self.baseline = {}
        self.generation = None
        self.digests = None
        self._n = 0

    def path(self, name):
        return os.path.join(self.root, name)

    def out(self, label):
        self._n += 1
        return os.path.join(self.out_dir, "%03d_%s.safetensors" % (self._n, label))

    def fetch_bytes(self, label, flags):
        path = self.out(label)
        self.d.ctl_ok("fetch", MODEL, *flags, "--out", path)
        with open(path, "rb") as f:
            data = f.read()
        os.unlink(path)
        return data

    def info(self):
        gen, digests = None, {}
        for line in self.d.ctl_ok("info", MODEL).stdout.splitlines():
            if line.startswith("generation: "):
                gen = int(line.split(":", 1)[1])
            elif line.startswith("tensor: "):
                f = line[len("tensor: "):].split("\t")
                digests[f[0]] = f[3]
        return gen, digests

    def adapters(self):
        return [l.split("\t", 1)[0] for l in self.d.ctl_ok("adapter", "list").stdout.splitlines()
                if l.strip()]

    def assert_unchanged(self, what):
        """The model still serves generation 2's exact bytes."""
        assert self.d.alive(), "daemon died on %s; log:\n%s" % (what, self.d.log()[-3000:])
        gen, digests = self.info()
        assert gen == self.generation, "%s moved the generation %d -> %d" % (what, self.generation,
                                                                              gen)
        assert digests == self.digests, "%s changed tensor digests" % what
        label, flags = BASELINE_REQUESTS[0]
        assert self.fetch_bytes(label, flags) == self.baseline[label], \
            "%s changed the served bytes" % what


@pytest.fixture(scope="module")
def ctx():
    d = Daemon()
    d.start()
    try:
        c = Ctx(d)
        c.base = _base()
        st_io.save(c.base, c.path("good.safetensors"))
        d.ctl_ok("load", MODEL, c.path("good.safetensors"))
        c.ok_tensors = lora("layers.0.q", 2, 16, IN, seed=9)
        peft_dir(c.path("ok"), c.ok_tensors, CFG)
        d.ctl_ok("adapter", "load", "ok", c.path("ok"))
        out = d.ctl_ok("apply", MODEL, "ok:1", "--expect-generation", 1).stdout
        assert out.strip() == "%s generation 2: ok:1" % MODEL, out
        c.generation, c.digests = c.info()
        assert c.generation == 2
        for label, flags in BASELINE_REQUESTS:
            c.baseline[label] = c.fetch_bytes(label, flags)
        yield c
    finally:
        d.stop()


def assert_error(ctx, r, code, what, needles=()):
    """One `error: CODE: message` line naming every needle; exit non-zero;
    the model unchanged."""
    assert ctx.d.alive(), "daemon died on %s; log tail:\n%s" % (what, ctx.d.log()[-3000:])
    assert r.returncode != 0, "%s: expected %s, but it succeeded: %r" % (what, code, r.stdout)
    lines = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
    assert len(lines) == 1, "%s: want one error line, stderr=%r" % (what, r.stderr)
    assert r.error_code == code, "%s: expected %s, got %s (stderr=%r)" % (what, code, r.error_code,
                                                                          r.stderr)
    assert len(r.error_message.encode()) <= 4096, "%s: %d-byte message" % (
        what, len(r.error_message.encode()))
    for n in needles:
        assert n in r.error_message, "%s: message does not name %r: %r" % (what, n,
                                                                             r.error_message)
    ctx.assert_unchanged(what)


def test_baseline_is_the_peft_merge(ctx):
    path = ctx.out("check")
    ctx.d.ctl_ok("fetch", MODEL, "--dtype", "f32", "--out", path)
    got = st_io.load(path)
    a = ctx.ok_tensors["base_model.model.layers.0.q.lora_A.weight"]
    b = ctx.ok_tensors["base_model.model.layers.0.q.lora_B.weight"]
    want = ctx.base["layers.0.q.weight"] + (b @ a) * 2.0   # alpha / r = 4 / 2
    assert torch.allclose(got["layers.0.q.weight"], want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got["emb.weight"], ctx.base["emb.weight"])


# --------------------------------------------------------------------------- adapter load

def _truncated(ctx, name):
    p = peft_dir(ctx.path(name), lora("layers.0.q", 2, 16, IN), CFG)
    f = os.path.join(p, "adapter_model.safetensors")
    with open(f, "rb") as fh:
        data = fh.read()
    with open(f, "wb") as fh:
        fh.write(data[:-20])   # cut inside the last tensor
    return p, ["adapter_model.safetensors", "lora_B.weight"]


def _header_cut(ctx, name):
    p = peft_dir(ctx.path(name), lora("layers.0.q", 2, 16, IN), CFG)
    f = os.path.join(p, "adapter_model.safetensors")
    with open(f, "rb") as fh:
        data = fh.read()
    with open(f, "wb") as fh:
        fh.write(data[:40])   # inside the JSON header
    return p, ["adapter_model.safetensors"]


def _config(text, *needles):
    def build(ctx, name):
        return peft_dir(ctx.path(name), lora("layers.0.q", 2, 16, IN), text), \
            ["adapter_config.json", *needles]
    return build


NESTS = "nests deeper than 64 levels"


def _cfg(**kw):
    c = dict(CFG)
    c.update(kw)
    return json.dumps(c)


def _rank_mismatch(ctx, name):
    t = lora("layers.0.q", 2, 16, IN)
    t["base_model.model.layers.0.q.lora_B.weight"] = torch.randn(16, 3)
    return peft_dir(ctx.path(name), t, CFG), ["layers.0.q.lora_B.weight", "rank mismatch"]


def _config_rank_mismatch(ctx, name):
    return peft_dir(ctx.path(name), lora("layers.0.q", 4, 16, IN), CFG), \
        ["layers.0.q.lora_A.weight", "r=2"]


def _a_without_b(ctx, name):
    t = lora("layers.0.q", 2, 16, IN)
    del t["base_model.model.layers.0.q.lora_B.weight"]
    return peft_dir(ctx.path(name), t, CFG), ["layers.0.q.lora_A.weight", "without lora_B"]


def _int_factor(ctx, name):
    t = lora("layers.0.q", 2, 16, IN)
    t["base_model.model.layers.0.q.lora_A.weight"] = torch.ones(2, IN, dtype=torch.int64)
    return peft_dir(ctx.path(name), t, CFG), ["layers.0.q.lora_A.weight", "floating"]


def _conv_factor(ctx, name):
    t = lora("layers.0.q", 2, 16, IN)
    t["base_model.model.layers.0.q.lora_A.weight"] = torch.randn(2, IN, 1, 1)
    return peft_dir(ctx.path(name), t, CFG), ["layers.0.q.lora_A.weight", "2-D"]


def _no_weights(ctx, name):
    p = ctx.path(name)
    os.makedirs(p)
    with open(os.path.join(p, "adapter_config.json"), "w") as f:
        json.dump(CFG, f)
    return p, [name, "adapter_model.safetensors"]


def _kohya_missing_up(ctx, name):
    p = ctx.path(name + ".safetensors")
    st_io.save({"lora_unet_layers_0_q.lora_down.weight": torch.randn(2, IN),
                "lora_unet_layers_0_q.alpha": torch.tensor(2.0)}, p)
    return p, [name + ".safetensors", "lora_unet_layers_0_q.lora_down.weight", "lora_up"]


def _no_adapter_keys(ctx, name):
    p = ctx.path(name + ".safetensors")
    st_io.save({"layers.0.q.weight": torch.randn(16, IN)}, p)
    return p, [name + ".safetensors", "cannot tell the adapter format"]


def _mixed_flavours(ctx, name):
    p = ctx.path(name + ".safetensors")
    t = lora("layers.0.q", 2, 16, IN)
    t["lora_unet_layers_0_v.lora_down.weight"] = torch.randn(2, IN)
    t["lora_unet_layers_0_v.lora_up.weight"] = torch.randn(12, 2)
    st_io.save(t, p)
    return p, [name + ".safetensors", "mixes PEFT"]


def _two_payloads(ctx, name):
    p = ctx.path(name + ".safetensors")
    st_io.save({"layers.0.q.diff": torch.randn(16, IN), "layers.0.q.set_weight": torch.randn(16, IN)},
               p)
    return p, [name + ".safetensors", "layers.0.q.weight", "both patch"]


# (slug, builder(ctx, name) -> (path, needles), extra flags, code)
BAD_LOADS = [
    ("truncated_weights", _truncated, [], "INVALID_ARGUMENT"),
    ("truncated_header", _header_cut, [], "INVALID_ARGUMENT"),
    ("config_not_json", _config('{"peft_type": "LORA", "r": 2,'), [], "INVALID_ARGUMENT"),
    ("config_not_object", _config("[2, 4]"), [], "INVALID_ARGUMENT"),
    ("config_r_string", _config(_cfg(r="2")), [], "INVALID_ARGUMENT"),
    ("config_r_zero", _config(_cfg(r=0)), [], "INVALID_ARGUMENT"),
    ("config_r_negative", _config(_cfg(r=-2)), [], "INVALID_ARGUMENT"),
    ("config_alpha_string", _config(_cfg(lora_alpha="4")), [], "INVALID_ARGUMENT"),
    ("config_alpha_overflow", _config('{"peft_type": "LORA", "r": 2, "lora_alpha": 1e999}'), [],
     "INVALID_ARGUMENT"),
    ("config_alpha_nan_token", _config('{"peft_type": "LORA", "r": 2, "lora_alpha": NaN}'), [],
     "INVALID_ARGUMENT"),
    ("config_fan_in_fan_out_string", _config(_cfg(fan_in_fan_out="yes")), [], "INVALID_ARGUMENT"),
    ("config_peft_type_ia3", _config(_cfg(peft_type="IA3")), [], "INVALID_ARGUMENT"),
    # 100,000 levels: the daemon's stack overflowed formatting (or walking) it.
    ("config_nested_100k_in_peft_type", _config(
        '{"peft_type": ' + "[" * 100000 + "]" * 100000 + ', "r": 2}', NESTS), [],
     "INVALID_ARGUMENT"),
    ("config_nested_100k_unknown_key", _config(
        '{"r": 2, "x": ' + '{"a": [' * 50000 + "]}" * 50000 + "}", NESTS), [], "INVALID_ARGUMENT"),
    ("config_nested_100k_top_level", _config("[" * 100000 + "]" * 100000, NESTS), [],
     "INVALID_ARGUMENT"),
    ("config_nested_100k_unterminated", _config('{"r": 2, "x": ' + "[" * 100000, NESTS), [],
     "INVALID_ARGUMENT"),
    # Values the message quotes are bounded (they overflowed gRPC's metadata
    # limit and arrived as RESOURCE_EXHAUSTED).
    ("config_peft_type_deep_and_wide", _config(
        '{"peft_type": ' + ('["' + "x" * 4000 + '", ') * 60 + "1" + "]" * 60 + "}", "peft_type"), [],
     "INVALID_ARGUMENT"),
    ("config_peft_type_1mib_string", _config(_cfg(peft_type="I" * (1 << 20)), "IIII..."), [],
     "INVALID_ARGUMENT"),
    ("config_r_1mib_array", _config('{"r": [' + "7, " * 300000 + "7]}", '"r"'), [],
     "INVALID_ARGUMENT"),
    ("config_pissa_init", _config(_cfg(init_lora_weights="pissa")), [], "INVALID_ARGUMENT"),
    ("config_rank_pattern_zero", _config(_cfg(rank_pattern={"q": 0})), [], "INVALID_ARGUMENT"),
    ("rank_mismatch_a_b", _rank_mismatch, [], "INVALID_ARGUMENT"),
    ("rank_mismatch_config", _config_rank_mismatch, [], "INVALID_ARGUMENT"),
    ("lora_a_without_b", _a_without_b, [], "INVALID_ARGUMENT"),
    ("integer_factor", _int_factor, [], "INVALID_ARGUMENT"),
    ("conv_factor", _conv_factor, [], "INVALID_ARGUMENT"),
    ("dir_without_weights", _no_weights, [], "NOT_FOUND"),
    ("kohya_missing_up", _kohya_missing_up, [], "INVALID_ARGUMENT"),
    ("no_adapter_keys", _no_adapter_keys, [], "INVALID_ARGUMENT"),
    ("mixed_peft_and_kohya", _mixed_flavours, [], "INVALID_ARGUMENT"),
    ("two_payloads_one_param", _two_payloads, [], "INVALID_ARGUMENT"),
]


@pytest.mark.parametrize("slug,build,flags,code", BAD_LOADS, ids=[c[0] for c in BAD_LOADS])
def test_bad_adapter_load(ctx, slug, build, flags, code):
    name = "bad_" + slug
    path, needles = build(ctx, name)
    r = ctx.d.ctl("adapter", "load", name, path, *flags)
    assert_error(ctx, r, code, "adapter load %s" % slug, needles)
    assert name not in ctx.adapters()


def test_unknown_format(ctx):
    r = ctx.d.ctl("adapter", "load", "bad_format", ctx.path("ok"), "--format", "lycoris")
    assert_error(ctx, r, "INVALID_ARGUMENT", "unknown format", ["lycoris", "peft"])
    assert "bad_format" not in ctx.adapters()


def test_directory_with_a_file_format(ctx):
    r = ctx.d.ctl("adapter", "load", "bad_dirfmt", ctx.path("ok"), "--format", "kohya")
    assert_error(ctx, r, "INVALID_ARGUMENT", "directory as kohya", [ctx.path("ok")])


def test_duplicate_adapter_name(ctx):
    other = peft_dir(ctx.path("other"), lora("layers.0.q", 2, 16, IN, seed=3), CFG)
    for path in (ctx.path("ok"), other):
        r = ctx.d.ctl("adapter", "load", "ok", path)
        assert_error(ctx, r, "ALREADY_EXISTS", "duplicate adapter name", ['"ok"'])
    assert ctx.adapters().count("ok") == 1


def test_bad_adapter_name(ctx):
    r = ctx.d.ctl("adapter", "load", "bad name!", ctx.path("ok"))
    assert_error(ctx, r, "INVALID_ARGUMENT", "adapter name with a space", ["bad name!"])


def test_missing_path_inside_root(ctx):
    r = ctx.d.ctl("adapter", "load", "bad_missing", ctx.path("no/such/adapter"))
    assert_error(ctx, r, "NOT_FOUND", "missing adapter path", ["no/such/adapter"])


def test_path_outside_root(ctx):
    p = peft_dir(os.path.join(ctx.outside, "out_adapter"), lora("layers.0.q", 2, 16, IN), CFG)
    r = ctx.d.ctl("adapter", "load", "bad_outside", p)
    assert_error(ctx, r, "PERMISSION_DENIED", "adapter outside the model root")
    r = ctx.d.ctl("adapter", "load", "bad_dotdot",
                  os.path.join(ctx.root, "..", "outside", "out_adapter"))
    assert_error(ctx, r, "PERMISSION_DENIED", "root/../outside adapter")
    assert "bad_outside" not in ctx.adapters() and "bad_dotdot" not in ctx.adapters()


def test_symlink_dir_escape(ctx):
    target = peft_dir(os.path.join(ctx.outside, "linked_adapter"), lora("layers.0.q", 2, 16, IN),
                      CFG)
    link = ctx.path("link_adapter")
    os.symlink(target, link)
    r = ctx.d.ctl("adapter", "load", "bad_link_dir", link)
    assert_error(ctx, r, "PERMISSION_DENIED", "adapter dir symlink pointing outside")


def test_symlinked_weights_inside_a_root_dir_escape(ctx):
    """The directory lies inside the root, its adapter_model.safetensors is a
    symlink to a file outside every root: refused, the file named."""
    secret = peft_dir(os.path.join(ctx.outside, "secret_w"), lora("layers.0.q", 2, 16, IN), CFG)
    d = ctx.path("link_weights")
    os.makedirs(d)
    os.symlink(os.path.join(secret, "adapter_model.safetensors"),
               os.path.join(d, "adapter_model.safetensors"))
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        json.dump(CFG, f)
    r = ctx.d.ctl("adapter", "load", "bad_link_weights", d)
    assert_error(ctx, r, "PERMISSION_DENIED", "weights symlinked outside the root",
                 ["adapter_model.safetensors", "outside the model roots"])
    assert "bad_link_weights" not in ctx.adapters()
    # The same file copied in (not linked) loads: the refusal was the link.
    os.unlink(os.path.join(d, "adapter_model.safetensors"))
    shutil.copy(os.path.join(secret, "adapter_model.safetensors"), d)
    ctx.d.ctl_ok("adapter", "load", "ok_link_weights", d)
    ctx.d.ctl_ok("adapter", "unload", "ok_link_weights")


def test_symlinked_sibling_config_escape(ctx):
    """A single adapter file inside the root whose sibling adapter_config.json
    links outside: the config is not read, the load refused."""
    secret = peft_dir(os.path.join(ctx.outside, "secret_c"), lora("layers.0.q", 2, 16, IN), CFG)
    d = ctx.path("link_config")
    peft_dir(d, lora("layers.0.q", 2, 16, IN), None)
    os.symlink(os.path.join(secret, "adapter_config.json"), os.path.join(d, "adapter_config.json"))
    for name, path in (("bad_link_cfg_dir", d),
                       ("bad_link_cfg_file", os.path.join(d, "adapter_model.safetensors"))):
        r = ctx.d.ctl("adapter", "load", name, path)
        assert_error(ctx, r, "PERMISSION_DENIED", "config symlinked outside the root (%s)" % name,
                     ["adapter_config.json", "outside the model roots"])
        assert name not in ctx.adapters()
    # A link that stays inside the root is fine.
    inside_cfg = ctx.path("inside_cfg.json")
    with open(inside_cfg, "w") as f:
        json.dump(CFG, f)
    os.unlink(os.path.join(d, "adapter_config.json"))
    os.symlink(inside_cfg, os.path.join(d, "adapter_config.json"))
    ctx.d.ctl_ok("adapter", "load", "ok_link_cfg", d)
    ctx.d.ctl_ok("adapter", "unload", "ok_link_cfg")


def test_keys_not_understood_strict_and_lenient(ctx):
    t = lora("layers.0.q", 2, 16, IN, seed=4)
    t["base_model.model.layers.0.q.hada_w1_a"] = torch.randn(2, IN)   # LoHa: not understood
    p = peft_dir(ctx.path("extra_keys"), t, CFG)
    r = ctx.d.ctl("adapter", "load", "bad_strict", p, "--strict")
    assert_error(ctx, r, "INVALID_ARGUMENT", "--strict with keys not understood",
                 ["hada_w1_a", "not understood"])
    assert "bad_strict" not in ctx.adapters()
    r = ctx.d.ctl_ok("adapter", "load", "lenient", p)
    assert "hada_w1_a" in r.stdout, r.stdout    # reported, not an error
    ctx.d.ctl_ok("adapter", "unload", "lenient")
    ctx.assert_unchanged("lenient load")


# --------------------------------------------------------------------------- apply

def _load(ctx, name, path, *flags):
    ctx.d.ctl_ok("adapter", "load", name, path, *flags)


def test_shape_mismatch_vs_base(ctx):
    # lora_A has 9 inputs: layers.0.q.weight is [16, 8].
    _load(ctx, "wide", peft_dir(ctx.path("wide"), lora("layers.0.q", 2, 16, IN + 1), CFG))
    r = ctx.d.ctl("apply", MODEL, "wide:1")
    assert_error(ctx, r, "INVALID_ARGUMENT", "LoRA of the wrong shape",
                 ["layers.0.q.weight", "[16, 9]", "[16, 8]"])
    r = ctx.d.ctl("apply", MODEL, "ok:1", "wide:0.5")   # also inside a stack
    assert_error(ctx, r, "INVALID_ARGUMENT", "LoRA of the wrong shape in a stack",
                 ["layers.0.q.weight"])


@pytest.mark.parametrize("strict", [False, True], ids=["lenient", "strict"])
def test_adapter_for_a_missing_module(ctx, strict):
    name = "ghost_strict" if strict else "ghost"
    p = peft_dir(ctx.path(name), lora("layers.7.q", 2, 16, IN), CFG)
    flags = ["--strict"] if strict else []
    _load(ctx, name, p, *flags)   # the adapter itself is well-formed
    r = ctx.d.ctl("apply", MODEL, "%s:1" % name)
    assert_error(ctx, r, "INVALID_ARGUMENT", "adapter for a missing module",
                 ["layers.7.q.weight", MODEL])


def test_kohya_module_missing_from_base(ctx):
    p = ctx.path("kohya_ghost.safetensors")
    st_io.save({"lora_unet_layers_9_k.lora_down.weight": torch.randn(2, IN),
                "lora_unet_layers_9_k.lora_up.weight": torch.randn(16, 2)}, p)
    _load(ctx, "kghost", p)
    r = ctx.d.ctl("apply", MODEL, "kghost:1")
    assert_error(ctx, r, "INVALID_ARGUMENT", "kohya module missing from the base",
                 ["lora_unet_layers_9_k"])


def test_dense_diff_with_wrong_shape(ctx):
    p = ctx.path("diff_wrong.safetensors")
    st_io.save({"emb.diff": torch.randn(10, IN + 2)}, p)
    _load(ctx, "diffw", p)
    r = ctx.d.ctl("apply", MODEL, "diffw:1")
    assert_error(ctx, r, "INVALID_ARGUMENT", "dense diff of the wrong shape",
                 ["emb.weight", "[10, 10]", "[10, 8]"])


def test_dense_diff_on_an_integer_tensor(ctx):
    p = ctx.path("diff_int.safetensors")
    st_io.save({"ids.diff_param": torch.ones(5)}, p)
    _load(ctx, "diffi", p)
    r = ctx.d.ctl("apply", MODEL, "diffi:1")
    assert_error(ctx, r, "INVALID_ARGUMENT", "dense diff on an integer tensor",
                 ["ids", "not a floating tensor"])


def test_apply_unknown_adapter_and_model(ctx):
    r = ctx.d.ctl("apply", MODEL, "ok:1", "nosuch:0.5")
    assert_error(ctx, r, "NOT_FOUND", "apply of an unknown adapter", ['"nosuch"'])
    r = ctx.d.ctl("apply", "nomodel", "ok:1")
    assert_error(ctx, r, "NOT_FOUND", "apply to an unknown model", ['"nomodel"'])


@pytest.mark.parametrize("spec", ["ok:x", "ok:nan", "ok:inf", "ok:-inf", "ok:", "ok:1e40",
                                  "ok:0x1p3z", ":1"])
def test_bad_strength_syntax(ctx, spec):
    r = ctx.d.ctl("apply", MODEL, spec)
    assert_error(ctx, r, "INVALID_ARGUMENT", "apply %s" % spec, [spec])


@pytest.mark.parametrize("strength", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_strength_over_grpc(ctx, strength):
    # weightctl refuses these itself; the daemon must too (Python client).
    c = weightd.Client(socket=ctx.d.socket)
    try:
        with pytest.raises(weightd.Error) as e:
            c.apply(MODEL, [("ok", strength)])
        assert e.value.code == "INVALID_ARGUMENT", e.value
        assert '"ok"' in e.value.message and "finite" in e.value.message, e.value.message
    finally:
        c.close()
    ctx.assert_unchanged("strength %r over gRPC" % strength)


def test_expect_generation_mismatch(ctx):
    for stale in (1, 3, 99):
        r = ctx.d.ctl("apply", MODEL, "ok:0.5", "--expect-generation", stale)
        assert_error(ctx, r, "ABORTED", "--expect-generation %d" % stale,
                     ["generation 2", "not %d" % stale])
    r = ctx.d.ctl("apply", MODEL, "--expect-generation", 0)
    assert_error(ctx, r, "INVALID_ARGUMENT", "--expect-generation 0", ["--expect-generation"])


# --------------------------------------------------------------------------- legal look-alikes

def _merged_f32(ctx, spec, adapter_path, *flags):
    """Loads an adapter as `spec`'s name, applies it on top of ok:1, fetches
    f32, then restores ok:1 (generation +2) and returns the fetched tensors."""
    name = spec.split(":")[0]
    _load(ctx, name, adapter_path, *flags)
    gen = ctx.info()[0]
    ctx.d.ctl_ok("apply", MODEL, "ok:1", spec, "--expect-generation", gen)
    path = ctx.out(name)
    ctx.d.ctl_ok("fetch", MODEL, "--dtype", "f32", "--out", path)
    got = st_io.load(path)
    ctx.d.ctl_ok("apply", MODEL, "ok:1", "--expect-generation", gen + 1)
    ctx.d.ctl_ok("adapter", "unload", name)
    ctx.generation = gen + 2   # same stack as before: same digests and bytes
    return got


def test_kohya_without_alpha_means_alpha_equals_rank(ctx):
    g = torch.Generator().manual_seed(21)
    down, up = torch.randn(2, IN, generator=g), torch.randn(12, 2, generator=g)
    p = ctx.path("kohya_noalpha.safetensors")
    st_io.save({"lora_unet_layers_0_v.lora_down.weight": down,
                "lora_unet_layers_0_v.lora_up.weight": up}, p)
    got = _merged_f32(ctx, "knoalpha:1", p)
    want = ctx.base["layers.0.v.weight"].float() + up @ down   # scale alpha / r = 1
    assert torch.allclose(got["layers.0.v.weight"], want, rtol=1e-6, atol=1e-6)
    ctx.assert_unchanged("kohya without alpha")


def test_negative_lora_alpha_is_legal_like_peft(ctx):
    # PEFT does not reject a negative lora_alpha: the scale is alpha / r < 0,
    # the same as a negative strength. The daemon merges it the same way.
    t = lora("layers.0.v", 2, 12, IN, seed=22)
    p = peft_dir(ctx.path("neg_alpha"), t, _cfg(lora_alpha=-4))
    got = _merged_f32(ctx, "negalpha:1", p)
    a = t["base_model.model.layers.0.v.lora_A.weight"]
    b = t["base_model.model.layers.0.v.lora_B.weight"]
    want = ctx.base["layers.0.v.weight"].float() + (b @ a) * (-2.0)
    assert torch.allclose(got["layers.0.v.weight"], want, rtol=1e-6, atol=1e-6)
    ctx.assert_unchanged("negative lora_alpha")


# --------------------------------------------------------------------------- afterwards

def test_zz_daemon_still_serving_and_baseline_bit_identical(ctx):
    assert ctx.d.alive(), ctx.d.log()[-3000:]
    assert "SERVING" in ctx.d.ctl_ok("health").stdout
    gen, digests = ctx.info()
    assert gen == ctx.generation and digests == ctx.digests
    assert "ok:1" in ctx.d.ctl_ok("info", MODEL).stdout
    for label, flags in BASELINE_REQUESTS:
        assert ctx.fetch_bytes(label + "_again", flags) == ctx.baseline[label], \
            "baseline %s changed after the catalogue" % label

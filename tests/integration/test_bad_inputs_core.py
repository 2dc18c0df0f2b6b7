"""Bad-input catalogue for weightd (docs/DESIGN.md §4.2, docs/style.md rule 3).

One daemon serves the whole module. A good model is loaded first and a few
ranks/dtypes are fetched as the baseline. Then every malformed checkpoint,
bad path and bad request below must fail with exactly the canonical code the
contract names, print one `error: CODE: message` line, leave no half-loaded
model behind, and leave the daemon serving. The last test re-fetches the
baseline and demands bit-identical bytes.

Run: WEIGHTD_BUILD=build /usr/bin/python3 -m pytest -q tests/integration/test_bad_inputs_core.py
"""
import json
import os
import struct
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import Daemon  # noqa: E402
import st_io  # noqa: E402  (harness puts tests/parity on sys.path)

import weightd  # noqa: E402  (build/python, put on sys.path by harness)

GOOD = {
    "w2d": torch.arange(60, dtype=torch.float32).reshape(10, 6) * 0.25 - 3.0,
    "bias": torch.linspace(-1.0, 1.0, 7, dtype=torch.float32),
    "h16": (torch.arange(20, dtype=torch.float32).reshape(5, 4) / 7.0).to(torch.float16),
    "ints": torch.arange(9, dtype=torch.int64) * 1000003,
    "scalar": torch.tensor(3.5, dtype=torch.float32),
}

# (label, fetch flags). Kept bytes of each are compared at the end.
BASELINE_REQUESTS = [
    ("w2r0_keep", ["--world", 2, "--rank", 0]),
    ("w2r1_f16", ["--world", 2, "--rank", 1, "--dtype", "f16"]),
    ("m2x2_c11_bf16", ["--mesh", "2x2", "--coord", "1,1", "--dtype", "bf16"]),
    ("w3r2_grpc", ["--world", 3, "--rank", 2, "--transport", "grpc"]),
]


# --------------------------------------------------------------------------- fixture

class Ctx:
    def __init__(self, d):
        self.d = d
        self.root = d.model_root
        self.bad_dir = os.path.join(self.root, "bad")
        self.outside = os.path.join(d.workdir, "outside")
        self.out_dir = os.path.join(d.workdir, "out")
        for p in (self.bad_dir, self.outside, self.out_dir):
            os.makedirs(p, exist_ok=True)
        self.good_path = os.path.join(self.root, "good.safetensors")
        self.baseline = {}
        self._n = 0

    def out(self, label):
        self._n += 1
        return os.path.join(self.out_dir, "%03d_%s.safetensors" % (self._n, label))

    def fetch_bytes(self, label, flags):
        path = self.out(label)
        self.d.ctl_ok("fetch", "good", *flags, "--out", path)
        with open(path, "rb") as f:
            return f.read()

    def listed_names(self):
        r = self.d.ctl_ok("list")
        return [line.split("\t", 1)[0] for line in r.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def ctx():
    d = Daemon()
    d.start()
    try:
        c = Ctx(d)
        st_io.save(GOOD, c.good_path)
        d.ctl_ok("load", "good", c.good_path)
        for label, flags in BASELINE_REQUESTS:
            c.baseline[label] = c.fetch_bytes(label, flags)
        yield c
    finally:
        d.stop()


def assert_error(ctx, r, code, what):
    """One `error: CODE: message` line, exit non-zero, daemon still alive."""
    assert ctx.d.alive(), "daemon died on %s; log tail:\n%s" % (what, ctx.d.log()[-3000:])
    assert r.returncode != 0, "%s: expected %s, but it succeeded: %r" % (what, code, r.stdout)
    error_lines = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
    assert len(error_lines) == 1, "%s: want one error line, stderr=%r" % (what, r.stderr)
    assert r.error_code == code, "%s: expected %s, got %s (stderr=%r)" % (
        what, code, r.error_code, r.stderr)
    assert r.error_message, "%s: empty error message" % what


# --------------------------------------------------------------------------- baseline

def test_baseline_matches_torch_chunk(ctx):
    got = st_io.load_raw(os.path.join(ctx.out_dir, "001_w2r0_keep.safetensors"))
    assert set(got) == set(GOOD)
    for name, t in GOOD.items():
        want = t if t.dim() == 0 else torch.chunk(t, 2, 0)[0]
        dt, shape, data = got[name]
        assert shape == list(want.shape), name
        assert data == st_io.tensor_bytes(want), name
    f16 = st_io.load(os.path.join(ctx.out_dir, "002_w2r1_f16.safetensors"))
    w = torch.chunk(GOOD["w2d"], 2, 0)[1].to(torch.float16)
    assert torch.equal(f16["w2d"], w)
    assert f16["ints"].dtype == torch.int64  # integers keep their dtype
    assert "good" in ctx.listed_names()


# --------------------------------------------------------------------------- malformed files

def hdr(obj):
    return json.dumps(obj).encode()


def assemble(header, data=b"", pad=True, hlen=None):
    """8-byte little-endian header length + header bytes + data section."""
    if pad:
        header += b" " * ((8 - len(header) % 8) % 8)
    n = len(header) if hlen is None else hlen
    return struct.pack("<Q", n) + header + data


def f32(n):
    return struct.pack("<%df" % n, *[float(i) for i in range(n)])


def one(name, dtype="F32", shape=(4,), offsets=(0, 16), **extra):
    e = {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}
    e.update(extra)
    return {name: e}


def _truncated():
    h = {"trunc.ok": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
         "trunc.cut": {"dtype": "F32", "shape": [16], "data_offsets": [16, 80]}}
    return assemble(hdr(h), f32(20))[:-40]  # file cut inside trunc.cut


def _dup_names():
    h = (b'{"dup.weight":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},'
         b'"dup.weight":{"dtype":"F32","shape":[4],"data_offsets":[16,32]}}')
    return assemble(h, f32(8))


def _non_utf8_name():
    h = b'{"bad\xff\xfe.name":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'
    return assemble(h, f32(4))


def _nul_in_name():
    h = b'{"nul\x00.name":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'
    return assemble(h, f32(4))


def _nul_padding():
    h = hdr(one("nulpad.w"))
    h += b"\x00" * (16 - len(h) % 8)  # padded with NUL instead of spaces
    return assemble(h, f32(4), pad=False)


def _two(name_a, off_a, name_b, off_b, data):
    h = {name_a: {"dtype": "F32", "shape": [6], "data_offsets": list(off_a)},
         name_b: {"dtype": "F32", "shape": [6], "data_offsets": list(off_b)}}
    return assemble(hdr(h), data)


# (slug, builder, tensor names of which the message must name at least one, or None)
MALFORMED = [
    ("empty_file", lambda: b"", None),
    ("shorter_than_8", lambda: b"\x10\x00\x00", None),
    ("seven_bytes", lambda: b"\x02\x00\x00\x00\x00\x00\x00", None),
    ("header_len_past_eof", lambda: assemble(hdr(one("eof.w")), b"", hlen=4096), None),
    ("header_len_2pow40", lambda: assemble(hdr(one("huge.w")), f32(4), hlen=2**40), None),
    ("header_len_u64_max", lambda: assemble(hdr(one("max.w")), f32(4), hlen=2**64 - 1), None),
    ("header_len_0", lambda: assemble(b"", hdr(one("zero.w")) + f32(4)), None),
    ("header_not_json", lambda: assemble(b"this is not json at all!"), None),
    ("header_json_truncated", lambda: assemble(b'{"cut.w": {"dtype": "F32", "sha'), None),
    ("header_json_array", lambda: assemble(b"[1, 2, 3]"), None),
    ("header_json_string", lambda: assemble(b'"hello"'), None),
    ("header_json_number", lambda: assemble(b"12345678"), None),
    ("truncated_data_section", _truncated, ("trunc.cut",)),
    ("data_offsets_past_end", lambda: assemble(
        hdr(one("past.w", offsets=(2**40, 2**40 + 16))), f32(4)), ("past.w",)),
    ("data_offsets_past_end_2pow63", lambda: assemble(
        hdr(one("past63.w", offsets=(2**63, 2**63 + 16))), f32(4)), ("past63.w",)),
    ("offsets_overlap", lambda: _two("ov.first", (0, 24), "ov.second", (16, 40), f32(10)),
     ("ov.first", "ov.second")),
    ("gap_between_tensors", lambda: _two("gap.first", (0, 24), "gap.second", (32, 56), f32(14)),
     ("gap.first", "gap.second")),
    ("first_not_at_0", lambda: assemble(
        hdr(one("late.start", shape=(6,), offsets=(8, 32))), f32(8)), ("late.start",)),
    ("trailing_bytes", lambda: assemble(hdr(one("trail.w")), f32(4) + b"\xAB" * 16), None),
    ("byte_count_mismatch", lambda: assemble(
        hdr(one("mismatch.w", shape=(4,), offsets=(0, 12))), f32(3)), ("mismatch.w",)),
    ("byte_count_mismatch_dtype", lambda: assemble(
        hdr(one("mismatch16.w", dtype="F16", shape=(4,), offsets=(0, 16))), f32(4)),
     ("mismatch16.w",)),
    ("unknown_dtype_F13", lambda: assemble(hdr(one("odd.dtype", dtype="F13")), f32(4)),
     ("odd.dtype",)),
    ("dtype_not_string", lambda: assemble(hdr(one("num.dtype", dtype=7)), f32(4)), ("num.dtype",)),
    ("shape_negative_dim", lambda: assemble(hdr(one("neg.dim", shape=(-4,))), f32(4)),
     ("neg.dim",)),
    # (-2)*(-2)*4 == 16 bytes: a signed product would "match" the offsets.
    ("shape_two_negative_dims", lambda: assemble(hdr(one("neg2.dim", shape=(-2, -2))), f32(4)),
     ("neg2.dim",)),
    ("shape_float_dim", lambda: assemble(
        hdr(one("float.dim", shape=(2.5, 2), offsets=(0, 20))), f32(5)), ("float.dim",)),
    ("shape_as_string", lambda: assemble(
        hdr({"str.shape": {"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}}), f32(4)),
     ("str.shape",)),
    # 2**62 * 4 elements wraps to 0 in u64 and "matches" data_offsets [0, 0].
    ("shape_product_wraps_to_0", lambda: assemble(
        hdr(one("wrap.dims", shape=(2**62, 4), offsets=(0, 0)))), ("wrap.dims",)),
    ("shape_product_overflow", lambda: assemble(
        hdr(one("ovf.dims", shape=(2**32, 2**32, 2**32), offsets=(0, 16))), f32(4)),
     ("ovf.dims",)),
    ("shape_dim_beyond_u64", lambda: assemble(
        hdr(one("big.dim", shape=(2**70,), offsets=(0, 16))), f32(4)), None),
    ("shape_missing", lambda: assemble(
        hdr({"noshape.w": {"dtype": "F32", "data_offsets": [0, 16]}}), f32(4)), ("noshape.w",)),
    ("dtype_missing", lambda: assemble(
        hdr({"nodtype.w": {"shape": [4], "data_offsets": [0, 16]}}), f32(4)), ("nodtype.w",)),
    ("data_offsets_missing", lambda: assemble(
        hdr({"nooff.w": {"dtype": "F32", "shape": [4]}}), f32(4)), ("nooff.w",)),
    ("data_offsets_3_entries", lambda: assemble(
        hdr(one("off3.w", offsets=(0, 16, 32))), f32(8)), ("off3.w",)),
    ("data_offsets_strings", lambda: assemble(
        hdr({"stroff.w": {"dtype": "F32", "shape": [4], "data_offsets": ["0", "16"]}}), f32(4)),
     ("stroff.w",)),
    ("data_offsets_negative", lambda: assemble(
        hdr(one("negoff.w", offsets=(-16, 0))), f32(4)), ("negoff.w",)),
    ("begin_gt_end", lambda: assemble(hdr(one("rev.w", offsets=(16, 0))), f32(4)), ("rev.w",)),
    ("tensor_entry_not_object", lambda: assemble(hdr({"notobj.w": 5})), ("notobj.w",)),
    ("duplicate_tensor_names", _dup_names, ("dup.weight",)),
    ("non_utf8_tensor_name", _non_utf8_name, None),
    ("metadata_non_string_value", lambda: assemble(
        hdr({"__metadata__": {"format": 5}, "meta.w": one("x")["x"]}), f32(4)), None),
    ("nul_in_tensor_name", _nul_in_name, None),
    # A newline would forge `weightctl info` lines, an ESC drive the terminal.
    ("newline_in_tensor_name", lambda: assemble(
        hdr(one("evil\ntensor: forged\tF32\t[4]")), f32(4)), None),
    ("escape_in_tensor_name", lambda: assemble(hdr(one("evil\x1b[2Jname")), f32(4)), None),
    ("c1_control_in_tensor_name", lambda: assemble(hdr(one("evil\u009bname")), f32(4)), None),
    ("nul_padding_after_json", _nul_padding, None),
]


@pytest.mark.parametrize("idx,slug,build,tensors",
                         [(i, s, b, t) for i, (s, b, t) in enumerate(MALFORMED)],
                         ids=[s for s, _, _ in MALFORMED])
def test_malformed_safetensors(ctx, idx, slug, build, tensors):
    name = "bad_%d" % idx
    base = "case%02d_%s.safetensors" % (idx, slug)
    path = os.path.join(ctx.bad_dir, base)
    with open(path, "wb") as f:
        f.write(build())
    r = ctx.d.ctl("load", name, path)
    assert_error(ctx, r, "INVALID_ARGUMENT", "load %s (%s)" % (base, slug))
    msg = r.error_message
    assert base in msg, "message does not name the file: %r" % msg
    if tensors:
        assert any(t in msg for t in tensors), "message names none of %s: %r" % (tensors, msg)
    assert name not in ctx.listed_names()


# --------------------------------------------------------------------------- bad paths

def _write_index(dirpath, weight_map):
    with open(os.path.join(dirpath, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)


def _mkdir(ctx, name):
    p = os.path.join(ctx.root, name)
    os.makedirs(p, exist_ok=True)
    return p


def test_index_names_missing_file(ctx):
    p = _mkdir(ctx, "idx_missing")
    st_io.save({"a.w": torch.ones(4)}, os.path.join(p, "model-00001-of-00002.safetensors"))
    _write_index(p, {"a.w": "model-00001-of-00002.safetensors",
                     "b.w": "model-00002-of-00002.safetensors"})
    r = ctx.d.ctl("load", "bad_idx_missing", p)
    # The contract allows either; this daemon reports NOT_FOUND ("path .../model-00002-of-00002
    # .safetensors does not exist"). Either code passes, anything else fails.
    assert r.error_code in ("NOT_FOUND", "INVALID_ARGUMENT"), r.stderr
    assert_error(ctx, r, r.error_code, "index naming a missing file")
    assert "model-00002-of-00002.safetensors" in r.error_message, r.error_message
    assert "bad_idx_missing" not in ctx.listed_names()


def test_index_maps_tensor_to_wrong_file(ctx):
    p = _mkdir(ctx, "idx_wrong")
    f1, f2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    st_io.save({"first.w": torch.ones(4)}, os.path.join(p, f1))
    st_io.save({"second.w": torch.zeros(4)}, os.path.join(p, f2))
    _write_index(p, {"first.w": f2, "second.w": f1})
    r = ctx.d.ctl("load", "bad_idx_wrong", p)
    assert_error(ctx, r, "INVALID_ARGUMENT", "index mapping tensors to the wrong file")
    msg = r.error_message
    assert "first.w" in msg or "second.w" in msg, msg
    assert f1 in msg or f2 in msg, msg
    assert "bad_idx_wrong" not in ctx.listed_names()


def test_directory_without_safetensors(ctx):
    p = _mkdir(ctx, "no_st")
    with open(os.path.join(p, "README.txt"), "w") as f:
        f.write("nothing here\n")
    with open(os.path.join(p, "weights.bin"), "wb") as f:
        f.write(b"\0" * 64)
    r = ctx.d.ctl("load", "bad_no_st", p)
    assert_error(ctx, r, "NOT_FOUND", "directory without safetensors files")
    assert "no_st" in r.error_message, r.error_message
    assert "bad_no_st" not in ctx.listed_names()


def test_same_tensor_in_two_files(ctx):
    p = _mkdir(ctx, "dup_across")
    st_io.save({"dup.across": torch.ones(4), "only.a": torch.ones(2)},
               os.path.join(p, "part-a.safetensors"))
    st_io.save({"dup.across": torch.zeros(4), "only.b": torch.ones(2)},
               os.path.join(p, "part-b.safetensors"))
    r = ctx.d.ctl("load", "bad_dup_across", p)
    assert_error(ctx, r, "INVALID_ARGUMENT", "same tensor in two files")
    msg = r.error_message
    assert "part-a.safetensors" in msg and "part-b.safetensors" in msg, msg
    assert "dup.across" in msg, msg
    assert "bad_dup_across" not in ctx.listed_names()


def test_path_outside_root(ctx):
    p = os.path.join(ctx.outside, "outside.safetensors")
    st_io.save({"x": torch.ones(4)}, p)
    r = ctx.d.ctl("load", "bad_outside", p)
    assert_error(ctx, r, "PERMISSION_DENIED", "path outside the model root")
    assert "bad_outside" not in ctx.listed_names()


def test_dotdot_escape_from_root(ctx):
    p = os.path.join(ctx.outside, "dotdot.safetensors")
    st_io.save({"x": torch.ones(4)}, p)
    r = ctx.d.ctl("load", "bad_dotdot", os.path.join(ctx.root, "..", "outside",
                                                     "dotdot.safetensors"))
    assert_error(ctx, r, "PERMISSION_DENIED", "root/../outside path")
    assert "bad_dotdot" not in ctx.listed_names()


def test_symlink_file_pointing_outside(ctx):
    target = os.path.join(ctx.outside, "linked.safetensors")
    st_io.save({"x": torch.ones(4)}, target)
    link = os.path.join(ctx.root, "link_out.safetensors")
    os.symlink(target, link)
    r = ctx.d.ctl("load", "bad_symlink", link)
    assert_error(ctx, r, "PERMISSION_DENIED", "symlink inside root pointing outside")
    assert "bad_symlink" not in ctx.listed_names()


def test_symlink_dir_pointing_outside(ctx):
    target = os.path.join(ctx.outside, "linked_dir")
    os.makedirs(target, exist_ok=True)
    st_io.save({"x": torch.ones(4)}, os.path.join(target, "model.safetensors"))
    link = os.path.join(ctx.root, "link_dir_out")
    os.symlink(target, link)
    r = ctx.d.ctl("load", "bad_symlink_dir", link)
    assert_error(ctx, r, "PERMISSION_DENIED", "dir symlink inside root pointing outside")
    assert "bad_symlink_dir" not in ctx.listed_names()


def test_symlink_in_directory_pointing_outside(ctx):
    # The directory itself is inside the root; one shard in it links outside.
    p = _mkdir(ctx, "dir_with_out_link")
    st_io.save({"in.w": torch.ones(4)}, os.path.join(p, "a.safetensors"))
    target = os.path.join(ctx.outside, "shard_b.safetensors")
    st_io.save({"out.w": torch.ones(4)}, target)
    os.symlink(target, os.path.join(p, "b.safetensors"))
    r = ctx.d.ctl("load", "bad_inner_link", p)
    assert_error(ctx, r, "PERMISSION_DENIED", "shard symlink inside a root dir pointing outside")
    assert "bad_inner_link" not in ctx.listed_names()


def test_index_symlinked_outside_is_not_read(ctx):
    """model.safetensors.index.json goes through the root confinement like
    every shard: a link out of the roots is refused before it is read, and
    nothing of its content reaches the message (F8)."""
    secret = os.path.join(ctx.outside, "secret_index.json")
    with open(secret, "w") as f:
        f.write("TOP-SECRET-LINE-1 root:x:0:0 {not json")
    p = _mkdir(ctx, "index_link_out")
    st_io.save({"in.w": torch.ones(4)}, os.path.join(p, "a.safetensors"))
    os.symlink(secret, os.path.join(p, "model.safetensors.index.json"))
    for name, path in (("bad_index_link", p),
                       ("bad_index_link_direct", os.path.join(p, "model.safetensors.index.json"))):
        r = ctx.d.ctl("load", name, path)
        assert_error(ctx, r, "PERMISSION_DENIED", "index symlinked outside the roots")
        assert "SECRET" not in r.stderr and "root:x" not in r.stderr, r.stderr
        assert "outside the model roots" in r.error_message, r.error_message
        assert name not in ctx.listed_names()


def test_outside_paths_get_one_message_whether_or_not_they_exist(ctx):
    """No existence oracle outside the roots (F19): an existing and a missing
    path, named directly or through a link inside a root, get the same
    message but for the path itself."""
    there = os.path.join(ctx.outside, "there.safetensors")
    st_io.save({"x": torch.ones(4)}, there)
    missing = os.path.join(ctx.outside, "missing.safetensors")
    link_there = os.path.join(ctx.root, "oracle_there.safetensors")
    link_missing = os.path.join(ctx.root, "oracle_missing.safetensors")
    os.symlink(there, link_there)
    os.symlink(missing, link_missing)

    def message(path):
        r = ctx.d.ctl("load", "bad_oracle", path)
        assert_error(ctx, r, "PERMISSION_DENIED", "outside path %s" % path)
        return r.error_message.replace(path, "<P>")

    assert message("/etc/passwd") == message("/etc/no-such-file-weightd")
    assert message(there) == message(missing)
    assert message(link_there) == message(link_missing)
    assert message(link_there) == message("/etc/passwd")
    assert "/etc" not in message(link_there) and ctx.outside not in message(link_there)
    assert "bad_oracle" not in ctx.listed_names()


def test_nonexistent_path_inside_root(ctx):
    p = os.path.join(ctx.root, "does", "not", "exist.safetensors")
    r = ctx.d.ctl("load", "bad_missing", p)
    assert_error(ctx, r, "NOT_FOUND", "nonexistent path inside root")
    assert "exist.safetensors" in r.error_message, r.error_message
    assert "bad_missing" not in ctx.listed_names()


def test_load_name_already_loaded(ctx):
    other = os.path.join(ctx.root, "other.safetensors")
    st_io.save({"x": torch.ones(4)}, other)
    for path in (ctx.good_path, other):
        r = ctx.d.ctl("load", "good", path)
        assert_error(ctx, r, "ALREADY_EXISTS", "load of an already loaded name")
        assert "good" in r.error_message, r.error_message
    info = ctx.d.ctl_ok("info", "good").stdout
    assert "generation: 1" in info and ctx.good_path in info, info
    assert ctx.listed_names().count("good") == 1


# --------------------------------------------------------------------------- bad requests

W2 = ["--world", 2, "--rank", 0]
M22 = ["--mesh", "2x2", "--coord", "0,0"]

# (id, verb args with OUT for the output path, expected code, substring the message must hold)
BAD_REQUESTS = [
    ("fetch_unknown_model", ["fetch", "no_such_model", *W2, "--out", "OUT"],
     "NOT_FOUND", "no_such_model"),
    ("rank_eq_world", ["fetch", "good", "--world", 2, "--rank", 2, "--out", "OUT"],
     "INVALID_ARGUMENT", None),
    ("rank_gt_world", ["fetch", "good", "--world", 2, "--rank", 7, "--out", "OUT"],
     "INVALID_ARGUMENT", None),
    ("rank_negative", ["fetch", "good", "--world", 2, "--rank", -1, "--out", "OUT"],
     "INVALID_ARGUMENT", None),
    ("world_0", ["fetch", "good", "--world", 0, "--rank", 0, "--out", "OUT"],
     "INVALID_ARGUMENT", None),
    ("world_not_a_number", ["fetch", "good", "--world", "two", "--rank", 0, "--out", "OUT"],
     "INVALID_ARGUMENT", None),
    ("mesh_0x2", ["fetch", "good", "--mesh", "0x2", "--coord", "0,0", "--out", "OUT"],
     "INVALID_ARGUMENT", None),
    ("mesh_2x", ["fetch", "good", "--mesh", "2x", "--coord", "0,0", "--out", "OUT"],
     "INVALID_ARGUMENT", None),
    ("mesh_garbage", ["fetch", "good", "--mesh", "axb", "--coord", "0,0", "--out", "OUT"],
     "INVALID_ARGUMENT", None),
    ("coord_out_of_range", ["fetch", "good", "--mesh", "2x2", "--coord", "2,0", "--out", "OUT"],
     "INVALID_ARGUMENT", None),
    ("coord_out_of_range_dim1", ["fetch", "good", "--mesh", "2x3", "--coord", "1,3",
                                 "--out", "OUT"], "INVALID_ARGUMENT", None),
    ("coord_too_few", ["fetch", "good", "--mesh", "2x2", "--coord", "0", "--out", "OUT"],
     "INVALID_ARGUMENT", None),
    ("coord_too_many", ["fetch", "good", "--mesh", "2x2", "--coord", "0,0,0", "--out", "OUT"],
     "INVALID_ARGUMENT", None),
    ("placements_X1", ["fetch", "good", *W2, "--placements", "X1", "--out", "OUT"],
     "INVALID_ARGUMENT", None),
    ("placements_S", ["fetch", "good", *W2, "--placements", "S", "--out", "OUT"],
     "INVALID_ARGUMENT", None),
    ("placements_empty_entry", ["fetch", "good", *M22, "--placements", "R,,S0", "--out", "OUT"],
     "INVALID_ARGUMENT", None),
    ("placements_Sneg", ["fetch", "good", *W2, "--placements", "S-1", "--out", "OUT"],
     "INVALID_ARGUMENT", None),
    ("placements_too_few", ["fetch", "good", *M22, "--placements", "S0", "--out", "OUT"],
     "INVALID_ARGUMENT", None),
    ("placements_too_many", ["fetch", "good", *W2, "--placements", "R,S0", "--out", "OUT"],
     "INVALID_ARGUMENT", None),
    ("placements_S5_2d", ["fetch", "good", *W2, "--placements", "S5", "--names", "w2d",
                          "--out", "OUT"], "INVALID_ARGUMENT", "w2d"),
    ("placements_S5_all", ["fetch", "good", *W2, "--placements", "S5", "--out", "OUT"],
     "INVALID_ARGUMENT", None),
    ("dtype_bogus", ["fetch", "good", *W2, "--dtype", "bogus", "--out", "OUT"],
     "INVALID_ARGUMENT", None),
    ("transport_bogus", ["fetch", "good", *W2, "--transport", "bogus", "--out", "OUT"],
     "INVALID_ARGUMENT", None),
    ("generation_99", ["fetch", "good", *W2, "--generation", 99, "--out", "OUT"],
     "NOT_FOUND", None),
    ("names_unknown_tensor", ["fetch", "good", *W2, "--names", "w2d,no_such_tensor",
                              "--out", "OUT"], "NOT_FOUND", "no_such_tensor"),
    ("names_duplicate", ["fetch", "good", *W2, "--names", "w2d,bias,w2d", "--out", "OUT"],
     "INVALID_ARGUMENT", "\"w2d\""),
    ("unload_unknown_model", ["unload", "no_such_model"], "NOT_FOUND", "no_such_model"),
    ("info_unknown_model", ["info", "no_such_model"], "NOT_FOUND", "no_such_model"),
]


@pytest.mark.parametrize("args,code,needle", [(a, c, n) for _, a, c, n in BAD_REQUESTS],
                         ids=[i for i, _, _, _ in BAD_REQUESTS])
def test_bad_request(ctx, request, args, code, needle):
    out = ctx.out("bad_" + request.node.callspec.id)
    args = [out if a == "OUT" else a for a in args]
    r = ctx.d.ctl(*args)
    assert_error(ctx, r, code, " ".join(map(str, args)))
    assert not os.path.exists(out), "failed fetch left an output file behind: %s" % out
    if needle:
        assert needle in r.error_message, r.error_message


# --------------------------------------------------------------------------- hostile documents

BIG = 2 ** 62


def _merge_profile():
    return {"name_mapping": [
        {"match": "half.a", "target": "merged", "merge_index": 0, "num_merges": 2},
        {"match": "half.b", "target": "merged", "merge_index": 1, "num_merges": 2}]}


# (slug, profile text or dict, checkpoint builder or None for good.safetensors, needles)
BAD_PROFILES = [
    # 100,000 levels of nesting: refused before any parser or walk sees them.
    ("profile_nested_100k", "[" * 100000 + "]" * 100000, None, ["nests deeper than 64 levels"]),
    ("profile_nested_100k_in_expected",
     '{"expected": {"w2d": {"shape": ' + "[" * 100000 + "]" * 100000 + "}}}", None,
     ["nests deeper than 64 levels"]),
    # An element count that wraps int64 (the table showed [4611686018427387905]).
    ("expected_numel_overflows", {"strict": False, "expected": {
        "w2d": {"shape": [10, 6]}, "huge.new": {"shape": [BIG, 4]}}, "allow_new": ["new"]},
     None, ['expected["huge.new"].shape', "too large"]),
    # Fits as elements, not as bytes: the budget was asked for 8 EiB.
    ("expected_bytes_overflow", {"strict": False, "expected": {
        "w2d": {"shape": [10, 6]}, "huge.new": {"shape": [BIG // 2, 2], "dtype": "f32"}},
        "allow_new": ["new"]}, None, ['expected["huge.new"].shape', "too large"]),
    # Two zero-element parts whose merged dim 0 is 2^63 (it was served negative).
    ("merged_dim0_overflows", _merge_profile(), lambda: assemble(hdr({
        "half.a": {"dtype": "F32", "shape": [BIG, 0], "data_offsets": [0, 0]},
        "half.b": {"dtype": "F32", "shape": [BIG, 0], "data_offsets": [0, 0]}})),
     ['served tensor "merged"', "merged dim 0 overflows"]),
    # A target that puts a newline into a served name.
    ("target_with_newline", {"name_mapping": [{"match": "w2d", "target": "w2d\ntensor: x"}]},
     None, ["control character"]),
]


@pytest.mark.parametrize("slug,profile,build,needles", BAD_PROFILES,
                         ids=[c[0] for c in BAD_PROFILES])
def test_bad_profile_is_invalid_at_load(ctx, slug, profile, build, needles):
    ppath = os.path.join(ctx.bad_dir, "%s.profile.json" % slug)
    with open(ppath, "w") as f:
        f.write(profile if isinstance(profile, str) else json.dumps(profile))
    path = ctx.good_path
    if build is not None:
        path = os.path.join(ctx.bad_dir, "%s.safetensors" % slug)
        with open(path, "wb") as f:
            f.write(build())
    r = ctx.d.ctl("load", "bad_" + slug, path, "--profile", ppath)
    assert_error(ctx, r, "INVALID_ARGUMENT", "load with profile %s" % slug)
    for n in needles:
        assert n in r.error_message, r.error_message[:1000]
    assert ctx.listed_names() == ["good"]


def test_index_nested_100k_is_invalid(ctx):
    d = os.path.join(ctx.bad_dir, "nested_index")
    os.makedirs(d)
    st_io.save({"x": torch.ones(2)}, os.path.join(d, "model-00001-of-00001.safetensors"))
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        f.write('{"metadata": {"x": ' + "[" * 100000 + "]" * 100000 +
                '}, "weight_map": {"x": "model-00001-of-00001.safetensors"}}')
    r = ctx.d.ctl("load", "bad_nested_index", d)
    assert_error(ctx, r, "INVALID_ARGUMENT", "load of a 100,000-deep index")
    assert "nests deeper than 64 levels" in r.error_message, r.error_message
    assert ctx.listed_names() == ["good"]


# The daemon caps every error message it sends (docs/limits.md): a longer
# one would exceed gRPC's metadata limit and arrive as RESOURCE_EXHAUSTED.
MAX_MESSAGE = 4096


def _client_error(ctx, call, code, what):
    with weightd.Client(socket=ctx.d.socket, retry_deadline=0) as c:
        with pytest.raises(weightd.Error) as e:
            call(c)
    assert ctx.d.alive(), "daemon died on %s; log:\n%s" % (what, ctx.d.log()[-3000:])
    assert e.value.code == code, "%s: %s" % (what, e.value)
    assert len(e.value.message.encode()) <= MAX_MESSAGE, \
        "%s: %d-byte message" % (what, len(e.value.message.encode()))
    return e.value.message


def test_many_duplicate_names_are_refused_before_materializing(ctx):
    before = ctx.d.ctl_ok("stats").stdout
    msg = _client_error(ctx, lambda c: c.fetch("good", world=2, rank=0, dtype="f16",
                                                names=["w2d"] * 200),
                        "INVALID_ARGUMENT", "200 duplicate names")
    assert '"w2d"' in msg and "more than once" in msg, msg
    after = ctx.d.ctl_ok("stats").stdout
    key = "materialization_bytes: "
    grab = lambda t: int(t.split(key, 1)[1].split()[0])  # noqa: E731
    assert grab(after) == grab(before), (before, after)


def test_100k_unknown_names_get_not_found_with_a_bounded_message(ctx):
    names = ["no.such.layers.%d.weight" % i for i in range(100000)]
    msg = _client_error(ctx, lambda c: c.fetch("good", names=names), "NOT_FOUND",
                        "100k unknown names")
    assert "100000" in msg and "no.such.layers." in msg, msg[:500]


def test_1mib_model_name_gets_not_found_with_a_bounded_message(ctx):
    name = "m" * (1 << 20)
    _client_error(ctx, lambda c: c.info(name), "NOT_FOUND", "info of a 1 MiB name")
    _client_error(ctx, lambda c: c.fetch(name), "NOT_FOUND", "fetch of a 1 MiB name")


def test_1mib_unknown_name_gets_not_found_with_a_bounded_message(ctx):
    msg = _client_error(ctx, lambda c: c.fetch("good", names=["n" * (1 << 20)]), "NOT_FOUND",
                        "fetch of a 1 MiB tensor name")
    assert "nnnn" in msg, msg[:200]
    # Bytes outside ASCII travel percent-encoded (3 bytes each): still fits.
    _client_error(ctx, lambda c: c.fetch("good", names=["\u00e9" * (1 << 19), "w\u00e9" * 9999]),
                  "NOT_FOUND", "fetch of 1 MiB of non-ASCII tensor names")


def test_empty_shards_of_zero_element_tensors_lie_inside_their_segment(ctx):
    """A zero-element tensor sharded on a non-empty dim: the empty piece must
    point inside its segment (it pointed at its linear start, past the end,
    and for [0, 2**62] at byte 2**63)."""
    big = 2 ** 62
    h = {"zero.wide": {"dtype": "F32", "shape": [0, 5000], "data_offsets": [0, 0]},
         "zero.huge": {"dtype": "F32", "shape": [0, big], "data_offsets": [0, 0]},
         "zero.bf16": {"dtype": "BF16", "shape": [3, 0, 7], "data_offsets": [0, 0]},
         "real.w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    path = os.path.join(ctx.root, "empties.safetensors")
    with open(path, "wb") as f:
        f.write(assemble(hdr(h), f32(4)))
    ctx.d.ctl_ok("load", "empties", path)
    try:
        names = "zero.wide,zero.huge,zero.bf16"
        for transport in ("shm", "grpc"):
            for world, rank in ((2, 1), (3, 2), (2, 0)):
                out = ctx.out("empties_%s_%d_%d" % (transport, world, rank))
                ctx.d.ctl_ok("fetch", "empties", "--world", world, "--rank", rank,
                             "--placements", "S1", "--names", names, "--transport", transport,
                             "--out", out)
                got = st_io.load_raw(out)
                c = -(-5000 // world)
                assert got["zero.wide"] == ("F32", [0, min(5000, (rank + 1) * c) - rank * c], b"")
                c = -(-big // world)
                assert got["zero.huge"] == ("F32", [0, min(big, (rank + 1) * c) - rank * c], b"")
                assert got["zero.bf16"] == ("BF16", [3, 0, 7], b"")  # the split dim is the 0
        with weightd.Client(socket=ctx.d.socket, retry_deadline=0) as c:
            with c.fetch("empties", world=2, rank=1, placements="S1",
                         names=["zero.wide", "zero.huge"]) as h:
                assert sorted(h.names) == ["zero.huge", "zero.wide"]
    finally:
        ctx.d.ctl_ok("unload", "empties")


# --------------------------------------------------------------------------- afterwards

def test_zz_daemon_still_serving_and_baseline_bit_identical(ctx):
    assert ctx.d.alive(), ctx.d.log()[-3000:]
    health = ctx.d.ctl_ok("health")
    assert "SERVING" in health.stdout, health.stdout
    assert ctx.listed_names() == ["good"], ctx.listed_names()
    for label, flags in BASELINE_REQUESTS:
        again = ctx.fetch_bytes(label + "_again", flags)
        assert again == ctx.baseline[label], "baseline %s changed after the catalogue" % label

"""weights_id: the identity of the weights a generation serves.

Two real daemons serving the same checkpoint (under other model names, with
other generation numbers) report the same weights_id for the same adapter
stack, in info (Python and weightctl), fetch handles, watch events and
after a restart; another stack gives another id, and going back to the base
gives the base's id again. The reference is computed here with
python3-xxhash: weights_id is XXH3-128 over the served names in byte order,
each as (u64 little-endian length, name, the tensor's content identity);
the identity of a tensor no adapter patches is XXH3-128 of the XXH3-128 of
its bytes (here: read from the file, and fetched back); a patched tensor's
identity (its parts' digests and the patches' content and strengths) is
taken from info, and must differ from the base's exactly where a patch is.
"""
import os
import struct

import pytest
import torch
import xxhash

from harness import Daemon
import st_io
import test_lora_parity as lora

import weightd  # noqa: E402  (harness puts the build's package on the path)


def _combine(digests):
    """{served name: 16-byte digest} -> weights_id (hex)."""
    h = xxhash.xxh3_128()
    for name in sorted(digests, key=lambda n: n.encode()):
        raw = name.encode()
        h.update(struct.pack("<Q", len(raw)) + raw + digests[name])
    return h.hexdigest()


def _identity(data):
    """Content identity of an unpatched single-part tensor."""
    return xxhash.xxh3_128(xxhash.xxh3_128(data).digest()).digest()


def _file_identities(path):
    return {name: _identity(data) for name, (_, _, data) in st_io.load_raw(path).items()}


def _fetched_identities(client, model):
    """Identities of `model`'s tensors from their bytes fetched whole."""
    with client.fetch(model, world=1, rank=0) as h:
        out = {}
        for name, t in h.state_dict().items():
            data = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
            out[name] = _identity(data)
        return out, h.weights_id


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("models"))
    base = lora.build_base()["llama16"]
    st_io.save(base, os.path.join(root, "base.safetensors"))
    mods = lora._modules(layers=[0, 1], mods={"mlp.up_proj": lora.PROJ["mlp.up_proj"]})
    lora.make_peft(root, "a1", mods, r=4, alpha=8)
    return root


def test_same_weights_same_id_on_two_daemons(files, tmp_path):
    root = files
    path = os.path.join(root, "base.safetensors")
    base = _file_identities(path)
    base_id = _combine(base)
    with Daemon(model_root=root, workdir=str(tmp_path / "d1"),
                extra_args=["--state-dir", str(tmp_path / "state")]) as d1, \
            Daemon(model_root=root, workdir=str(tmp_path / "d2")) as d2:
        d1.ctl_ok("load", "m", path)
        d2.ctl_ok("load", "other-name", path)
        d1.ctl_ok("adapter", "load", "a1", os.path.join(root, "a1"))
        d2.ctl_ok("adapter", "load", "a1", os.path.join(root, "a1"))
        c1, c2 = weightd.Client(socket=d1.socket), weightd.Client(socket=d2.socket)
        try:
            info = c1.info("m")
            assert {t.name: t.digest for t in info.tensors} == base
            assert info.weights_id == base_id
            assert c2.info("other-name").weights_id == base_id
            assert _fetched_identities(c1, "m") == (base, base_id)
            assert "weights_id: %s" % base_id in d1.ctl_ok("info", "m").stdout
            with c1.fetch("m", world=2, rank=1) as h:
                assert h.weights_id == base_id   # the generation's, not the shard's
            # A stack: another id, the same on both daemons whatever the numbers.
            c2.apply("other-name", [("a1", 1.0)])
            assert c1.apply("m", [("a1", 0.5)]) == 2
            assert c2.apply("other-name", [("a1", 0.5)]) == 3
            info = c1.info("m")
            merged = {t.name: t.digest for t in info.tensors}
            merged_id = info.weights_id
            assert merged_id == _combine(merged) and merged_id != base_id
            patched = {t.name for t in info.tensors if t.patched_by}
            assert patched == {"model.layers.%d.mlp.up_proj.weight" % i for i in (0, 1)}
            assert {n for n in merged if merged[n] != base[n]} == patched
            assert c2.info("other-name").weights_id == merged_id
            with c1.fetch("m", world=4, rank=3) as h:
                assert h.weights_id == merged_id
            watch = c1.watch("m", include_current=True, timeout=10)
            event = next(iter(watch))
            assert (event.generation, event.weights_id) == (2, merged_id)
            watch.cancel()
            # Back to the base: its id again, under a new number.
            assert c1.apply("m", []) == 3
            assert c1.info("m").weights_id == base_id
            assert _fetched_identities(c1, "m") == (base, base_id)
            c1.apply("m", [("a1", 0.5)])
        finally:
            c1.close()
            c2.close()
        d1.proc.kill()
    # A restart restores the same weights (same id) under the same number.
    with Daemon(model_root=root, workdir=str(tmp_path / "d3"),
                extra_args=["--state-dir", str(tmp_path / "state")]) as d3:
        with weightd.Client(socket=d3.socket) as c3:
            info = c3.info("m")
            assert (info.generation, info.weights_id) == (4, merged_id)

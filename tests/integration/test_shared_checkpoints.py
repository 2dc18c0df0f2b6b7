"""Checkpoints loaded from the same files are held once (issue [publish],
its dedupe part): the same files loaded under three names and seen through
a profile share one copy, and so do identical files at other paths (a
copy, a copied sharded directory: read, compared, freed), every model serves bytes equal to PyTorch's
torch.chunk of the file's tensors, unloading one leaves the others serving,
and a file rewritten between loads (even with its mtime put back) is read
again, never mistaken for the resident one. Real daemon, real Python
client; stats and weightctl report logical and resident checkpoint bytes.
"""
import json
import os
import shutil

import torch

from harness import Daemon
import st_io

import weightd  # noqa: E402  (harness puts the build's package on the path)

PROFILE = {"name_mapping": [{"match": r"w(\d+)", "target": r"layers.\1.weight"}]}


def _write(path, seed):
    g = torch.Generator().manual_seed(seed)
    tensors = {"w%d" % i: torch.randn(256, 1024, generator=g).to(torch.bfloat16)
               for i in range(8)}  # 4 MiB
    st_io.save(tensors, path)
    return tensors


def _model_file(tmp_path, seed=1):
    """models/m.safetensors under tmp_path: (models dir, path, tensors, bytes)."""
    models = tmp_path / "models"
    models.mkdir()
    path = str(models / "m.safetensors")
    tensors = _write(path, seed)
    return models, path, tensors, sum(t.numel() * 2 for t in tensors.values())


def _held(c):
    s = c.stats()
    return s["bytes_resident"], s["checkpoint_bytes_logical"], s["checkpoint_bytes_resident"]


def _serves(c, model, ref, rename=lambda n: n, world=2):
    for rank in range(world):
        with c.fetch(model, world=world, rank=rank) as h:
            got = h.state_dict()
            assert sorted(got) == sorted(rename(n) for n in ref), model
            for name, t in ref.items():
                want = torch.chunk(t, world, 0)[rank]
                assert torch.equal(got[rename(name)], want), (model, name, rank)


def test_same_files_under_three_names_and_a_profile_are_held_once(tmp_path):
    models, path, ref, size = _model_file(tmp_path)
    with Daemon(model_root=str(models)) as d, weightd.Client(socket=d.socket) as c:
        c.load("a", path)
        first, logical, resident = _held(c)
        assert logical == resident == size
        c.load("b", path)
        c.load("c", path)
        c.load("viewed", path, profile=PROFILE)
        now, logical, resident = _held(c)
        print("resident bytes: %d after the first load, %d after three more" % (first, now))
        # < 5 % growth after the first: one copy of the bytes; each model
        # is charged the metadata it builds (names, layout, generations).
        assert now - first < 0.05 * first, (first, now)
        assert now > first, "each model's metadata is charged"
        assert (logical, resident) == (4 * size, size)
        assert d.log().count("load_shared") == 3, d.log()
        for m in ("a", "b", "c"):
            _serves(c, m, ref)
        _serves(c, "viewed", ref, rename=lambda n: "layers.%s.weight" % n[1:])
        out = d.ctl_ok("stats").stdout
        assert "checkpoint_bytes_logical: %d" % (4 * size) in out, out
        assert "checkpoint_bytes_resident: %d" % size in out, out
        # Unloading some leaves the others serving the same bytes.
        c.unload("a")
        c.unload("c")
        _serves(c, "b", ref)
        _serves(c, "viewed", ref, rename=lambda n: "layers.%s.weight" % n[1:])
        assert _held(c)[1:] == (2 * size, size)
        assert d.ctl_ok("verify", "b")
        c.unload("b")
        c.unload("viewed")
        # The copy went with the last model that held it (the fetches above
        # were views: no cached materialization holds memory).
        assert c.stats()["bytes_resident"] == 0
        # Nothing holds it now: a new load reads the file again.
        c.load("again", path)
        assert d.log().count("load_shared") == 3
        _serves(c, "again", ref)


def test_a_file_rewritten_between_loads_is_read_again(tmp_path):
    models, path, old, size = _model_file(tmp_path)
    with Daemon(model_root=str(models)) as d, weightd.Client(socket=d.socket) as c:
        c.load("old", path)
        st = os.stat(path)
        # Same size, same names, other values; the mtime put back as it was:
        # only the ctime (which no one can set) tells the files apart.
        new = _write(path, 2)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        now = os.stat(path)
        assert (now.st_ino, now.st_size, now.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
        c.load("new", path)
        assert "load_shared" not in d.log()
        assert _held(c)[1:] == (2 * size, 2 * size)
        assert c.stats()["bytes_resident"] > 2 * size
        _serves(c, "old", old)
        _serves(c, "new", new)
        # The old model still serves what it read, and a third load shares
        # the file as it is now.
        c.load("newer", path)
        assert d.log().count("load_shared") == 1
        _serves(c, "newer", new)


def test_a_shared_load_is_charged_the_metadata_it_builds(tmp_path):
    """The bytes are shared; each model's names, layout and generations are
    not: a shared load over the budget is refused RESOURCE_EXHAUSTED, and
    the model that holds the files keeps serving."""
    models, path, ref, data = _model_file(tmp_path)
    metadata = 8 * (1024 + 24 * 2 + 16 * 2)  # docs/limits.md: per tensor
    budget = data + metadata + 4096          # room for the first, not a second metadata
    with Daemon(model_root=str(models),
                extra_args=["--host-memory-bytes", str(budget)]) as d, \
            weightd.Client(socket=d.socket) as c:
        c.load("a", path)
        assert c.stats()["bytes_resident"] == data + metadata
        r = d.ctl("load", "b", path)
        assert r.error_code == "RESOURCE_EXHAUSTED", r.stderr
        assert "metadata of 8 tensors" in r.error_message, r.error_message
        assert [m.name for m in c.list()] == ["a"]
        assert c.stats()["bytes_resident"] == data + metadata
        _serves(c, "a", ref)


def _sharded(directory, seed):
    """A two-shard checkpoint with its index in `directory`; its tensors."""
    os.makedirs(directory)
    g = torch.Generator().manual_seed(seed)
    tensors, weight_map = {}, {}
    for s in range(2):
        shard = {"layers.%d.%d" % (s, i): torch.randn(128, 512, generator=g) for i in range(3)}
        name = "model-%05d-of-00002.safetensors" % (s + 1)
        st_io.save(shard, os.path.join(directory, name))
        tensors.update(shard)
        weight_map.update({k: name for k in shard})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    return tensors


def test_identical_files_at_another_path_are_held_once(tmp_path):
    """Files byte for byte those of a resident checkpoint, at other paths
    (a copy of the file under another name, a copied sharded directory),
    are read, compared and freed: the load shares the resident copy, which
    serves both models and stays while either does. A copy with one byte of
    one tensor changed under the same header is other files: only its
    changed tensor is stored, the rest shared per tensor (below); the same
    tensors in another order share all of them. Each serves its own
    bytes."""
    models, path, ref, size = _model_file(tmp_path)
    copy = str(models / "copy.safetensors")
    shutil.copy(path, copy)
    changed = str(models / "changed.safetensors")
    shutil.copy(path, changed)
    with open(changed, "r+b") as f:   # the last bf16's lowest mantissa bit
        f.seek(-2, os.SEEK_END)
        b = f.read(1)
        f.seek(-2, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x01]))
    changed_ref = st_io.load(changed)
    assert any(not torch.equal(changed_ref[n], ref[n]) for n in ref)
    reordered = str(models / "reordered.safetensors")
    st_io.save(dict(reversed(list(ref.items()))), reordered)
    sharded = _sharded(str(models / "sharded"), 5)
    shutil.copytree(str(models / "sharded"), str(models / "sharded-copy"))
    sharded_size = sum(t.numel() * 4 for t in sharded.values())
    with Daemon(model_root=str(models)) as d, weightd.Client(socket=d.socket) as c:
        c.load("a", path)
        first, _, resident = _held(c)
        assert resident == size
        c.load("b", copy)
        now, logical, resident = _held(c)
        assert (logical, resident) == (2 * size, size)
        assert now - first < 0.05 * size, (now, first)
        assert "load_deduplicated" in d.log() and "bytes_freed=%d" % size in d.log(), \
            d.log()[-2000:]
        _serves(c, "b", ref)
        # Each model lists the files it was loaded from.
        assert list(c.info("b").files) == [copy] and list(c.info("a").files) == [path]
        c.unload("a")
        _serves(c, "b", ref)
        assert _held(c)[2] == size
        # One byte off: other files; only the changed tensor is its own.
        c.load("x", changed)
        assert _held(c)[1:] == (2 * size, size + size // 8)
        _serves(c, "x", changed_ref)
        _serves(c, "b", ref)
        # The same tensors in another order: other files, every tensor shared.
        c.load("r", reordered)
        assert _held(c)[1:] == (3 * size, size + size // 8)
        _serves(c, "r", ref)
        assert d.log().count("load_tensors_shared") == 2
        # A copied sharded directory (index and two shards).
        c.load("s1", str(models / "sharded"))
        c.load("s2", str(models / "sharded-copy"))
        assert _held(c)[1:] == (3 * size + 2 * sharded_size,
                                size + size // 8 + sharded_size)
        _serves(c, "s2", sharded)
        c.unload("s1")
        _serves(c, "s2", sharded)
        assert d.log().count("load_deduplicated") == 2
        d.ctl_ok("verify", "s2")
        d.ctl_ok("verify", "b")


def test_tensors_another_model_holds_are_shared_at_load(tmp_path):
    """Per-tensor dedupe at load: a checkpoint of other files whose tensors
    are partly those a loaded model holds already (a fine-tune that kept
    most layers; a file saved from a published generation) points at the
    held bytes and keeps only the rest, once the shared bytes are over 1/8
    of it. Held bytes come only from public models (a checkpoint serves
    every model that loads its files). Every model serves exactly its
    file's tensors (PyTorch's torch.chunk); the holder unloaded, nothing is
    lost; verify passes."""
    models, path, base, size = _model_file(tmp_path)
    tensor = size // 8
    g = torch.Generator().manual_seed(7)
    new = lambda: torch.randn(256, 1024, generator=g).to(torch.bfloat16)  # noqa: E731
    # 6 of base's 8 tensors, one changed, one added: 6/8 held already.
    ft = {n: base[n] for n in ("w0", "w1", "w2", "w3", "w4", "w5")}
    ft.update({"w6": new(), "extra": new()})
    ft_path = str(models / "ft.safetensors")
    st_io.save(ft, ft_path)
    me = "uid:%d" % os.getuid()
    with Daemon(model_root=str(models)) as d, weightd.Client(socket=d.socket) as c:
        c.load("a", path)
        before, logical, resident = _held(c)
        c.load("ft", ft_path)
        after, logical2, resident2 = _held(c)
        assert logical2 == logical + 8 * tensor
        assert resident2 == resident + 2 * tensor, (resident, resident2)
        assert after - before < 2 * tensor + (256 << 10), (before, after)
        lines = [ln for ln in d.log().splitlines() if "load_tensors_shared" in ln]
        assert len(lines) == 1 and "bytes_shared=%d" % (6 * tensor) in lines[0], lines
        assert "shared_with=a" in lines[0], lines
        _serves(c, "ft", ft)
        _serves(c, "a", base)
        # A copy of ft's file is ft's checkpoint again.
        ft_copy = str(models / "ft-copy.safetensors")
        shutil.copy(ft_path, ft_copy)
        c.load("ft2", ft_copy)
        assert _held(c)[2] == resident2
        assert "load_deduplicated path=%s same_as=%s" % (ft_copy, ft_path) in d.log(), \
            d.log()[-1500:]
        _serves(c, "ft2", ft)
        c.unload("ft2")

        # The holder unloaded: ft keeps what it shares and serves it, and
        # the bytes it keeps alive count as its own.
        c.unload("a")
        _serves(c, "ft", ft)
        assert _held(c)[1:] == (8 * tensor, 8 * tensor)
        d.ctl_ok("verify", "ft")

        # A file saved from a published generation shares the published bytes.
        w6 = new()
        assert c.publish("ft", {"w6": w6}).changed == 1
        pub = {"w6": w6, "other": new()}
        pub_path = str(models / "pub.safetensors")
        st_io.save(pub, pub_path)
        c.load("pub", pub_path)
        lines = [ln for ln in d.log().splitlines() if "load_tensors_shared" in ln]
        assert len(lines) == 2 and "bytes_shared=%d" % tensor in lines[1], lines
        assert "shared_with=ft" in lines[1], lines
        _serves(c, "pub", pub)
        d.ctl_ok("verify", "pub")

        # A private model's bytes are not shared into a checkpoint others load.
        other_path = str(models / "other.safetensors")
        other = _write(other_path, 3)
        c.load("p", other_path, readers=me)
        copy = {n: other[n] for n in ("w0", "w1", "w2", "w3", "w4", "w5", "w6")}
        copy_path = str(models / "copy.safetensors")
        st_io.save(copy, copy_path)
        _, _, resident3 = _held(c)
        c.load("q", copy_path)
        _, _, resident4 = _held(c)
        assert resident4 == resident3 + 7 * tensor, (resident3, resident4)
        assert d.log().count("load_tensors_shared") == 2
        _serves(c, "q", copy)

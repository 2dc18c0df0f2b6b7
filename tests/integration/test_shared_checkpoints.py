"""Checkpoints loaded from the same files are held once (issue [publish],
its dedupe part): the same files loaded under three names and seen through
a profile share one copy, every model serves bytes equal to PyTorch's
torch.chunk of the file's tensors, unloading one leaves the others serving,
and a file rewritten between loads (even with its mtime put back) is read
again, never mistaken for the resident one. Real daemon, real Python
client; stats and weightctl report logical and resident checkpoint bytes.
"""
import os

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
    metadata = 8 * (1024 + 24 * 2 + 16 * 2)  # README, Limits: per tensor
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

"""--state-dir: a daemon killed with SIGKILL comes back serving what it served.

Real daemons, killed and restarted on the same state directory: the same
models, adapter stacks and generation numbers, byte-identical shards (and a
base model compared with PyTorch), numbers that continue upward; a journal
cut at every record boundary restores exactly the records before the cut; a
flipped byte loses only the record it hit, named in the log; a checkpoint
changed on disk is not served and is named in skipped.log.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import time

import pytest
import torch

from harness import Daemon
from reference import cast_shard_ref
import st_io
import test_lora_parity as lora

import weightd  # noqa: E402  (harness puts the build's package on the path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("models"))
    base = lora.build_base()
    st_io.save(base["llama32"], os.path.join(root, "base32.safetensors"))
    st_io.save(base["llama16"], os.path.join(root, "base16.safetensors"))
    mods = lora._modules(layers=[0], mods={"self_attn.q_proj": lora.PROJ["self_attn.q_proj"],
                                           "mlp.up_proj": lora.PROJ["mlp.up_proj"]})
    lora.make_peft(root, "a1", mods, r=4, alpha=8)
    lora.make_peft(root, "a2", mods[:1], r=2, alpha=2)
    lora.make_dense(root, "a3")
    return root, base


def _daemon(root, state, *extra):
    return Daemon(model_root=root, extra_args=["--state-dir", state, *extra])


def _fetch(d, model, world, rank, dtype, out):
    d.ctl_ok("fetch", model, "--world", world, "--rank", rank, "--dtype", dtype, "--out", out)
    with open(out, "rb") as f:
        return f.read()


def _state(d):
    """{model: (generation, adapters)}, sorted adapter names."""
    with weightd.Client(socket=d.socket) as c:
        models = {m.name: (m.generation, tuple(m.adapters)) for m in c.list()}
        adapters = sorted(a.name for a in c.list_adapters())
    return models, adapters


def _digests(d, model):
    with weightd.Client(socket=d.socket) as c:
        return {t.name: t.digest for t in c.info(model).tensors}


def _setup(d, root):
    d.ctl_ok("load", "m1", os.path.join(root, "base32.safetensors"))
    d.ctl_ok("load", "m2", os.path.join(root, "base16.safetensors"))
    d.ctl_ok("adapter", "load", "a1", os.path.join(root, "a1"))
    d.ctl_ok("adapter", "load", "a2", os.path.join(root, "a2"))
    d.ctl_ok("adapter", "load", "a3", os.path.join(root, "a3.safetensors"), "--format", "dense")
    d.ctl_ok("apply", "m1", "a1:1", "a2:0.5")
    d.ctl_ok("apply", "m1", "a1:0.25", "a2:1")
    d.ctl_ok("apply", "m2", "a3:1")
    # m1's stack keeps a2 alive; the name goes (a restore needs its old file).
    d.ctl_ok("adapter", "unload", "a2")


def test_sigkill_then_restart_serves_the_same(files, tmp_path):
    root, base = files
    state = str(tmp_path / "state")
    d = _daemon(root, state).start()
    try:
        _setup(d, root)
        before = _state(d)
        assert before == ({"m1": (3, ("a1:0.25", "a2:1")), "m2": (2, ("a3:1",))},
                          ["a1", "a3"]), before
        digests = {m: _digests(d, m) for m in ("m1", "m2")}
        shards = {(m, w, r, t): _fetch(d, m, w, r, t, str(tmp_path / ("%s%d%d%s" % (m, w, r, t))))
                  for m, w, r, t in (("m1", 2, 1, "bf16"), ("m1", 1, 0, "keep"),
                                     ("m2", 3, 2, "f32"))}
        # A worker holds a lease when the daemon dies.
        c = weightd.Client(socket=d.socket)
        held = c.fetch("m1", world=2, rank=0)
        sd = held.state_dict()
        d.proc.kill()
        d.proc.wait()
        # Its mapping outlives the daemon (the kernel keeps the memfds).
        assert torch.equal(sd["model.norm.weight"],
                           cast_shard_ref(base["llama32"]["model.norm.weight"], 2, 0))
    finally:
        d.stop()
    with _daemon(root, state) as d2:
        assert _state(d2) == before
        for m in ("m1", "m2"):
            assert _digests(d2, m) == digests[m], m
        for (m, w, r, t), data in shards.items():
            assert _fetch(d2, m, w, r, t, str(tmp_path / "again")) == data, (m, w, r, t)
        log = d2.log()
        assert "restore_done" in log and "restore_skipped" not in log, log
        # Numbers continue upward; the base serves PyTorch's bytes.
        with weightd.Client(socket=d2.socket) as c2:
            assert c2.apply("m2", []) == 3
            assert c2.apply("m1", ["a1"]) == 4
            with c2.fetch("m2", world=2, rank=1) as h:
                got = h.state_dict()
                for k, t in base["llama16"].items():
                    assert torch.equal(got[k], cast_shard_ref(t, 2, 1)), k
    # The restored state was journaled in turn: a second restart agrees.
    with _daemon(root, state) as d3:
        assert _state(d3) == ({"m1": (4, ("a1:1",)), "m2": (3, ())}, ["a1", "a3"])


def _records(path):
    with open(path, "rb") as f:
        data = f.read()
    starts = [m.start() for m in re.finditer(b"WDJ1", data)]
    return data, starts


def _expected(records):
    """Replays journal records (as the daemon's PlanRestore) to
    ({model: (generation, adapters)}, adapters)."""
    models, adapters = {}, set()
    for r in sorted(records, key=lambda r: r["seq"]):
        k = r["kind"]
        if k == "model_load":
            models[r["name"]] = (1, ())
        elif k == "model_unload":
            models.pop(r["name"], None)
        elif k == "adapter_load":
            adapters.add(r["name"])
        elif k == "adapter_unload":
            adapters.discard(r["name"])
        elif k == "apply" and r["name"] in models:
            models[r["name"]] = (r["generation"],
                                 tuple("%s:%g" % (e[0], e[1]) for e in r.get("stack", [])))
    return models, sorted(adapters)


def _payload(data, start):
    n = int.from_bytes(data[start + 4:start + 8], "little")
    return json.loads(data[start + 24:start + 24 + n])


def test_journal_cut_at_every_record_boundary(files, tmp_path):
    root, _ = files
    state = str(tmp_path / "state")
    with _daemon(root, state) as d:
        d.ctl_ok("load", "m1", os.path.join(root, "base32.safetensors"))
        d.ctl_ok("adapter", "load", "a1", os.path.join(root, "a1"))
        d.ctl_ok("load", "m2", os.path.join(root, "base16.safetensors"))
        d.ctl_ok("apply", "m1", "a1:1")
        d.ctl_ok("unload", "m2")
        d.proc.kill()
    data, starts = _records(os.path.join(state, "journal"))
    records = [_payload(data, s) for s in starts]
    assert [r["kind"] for r in records] == ["model_load", "adapter_load", "model_load", "apply",
                                           "model_unload"], records
    for k in range(len(starts) + 1):
        cut = starts[k] if k < len(starts) else len(data)
        st = tmp_path / ("cut%d" % k)
        st.mkdir()
        (st / "journal").write_bytes(data[:cut])
        with _daemon(root, str(st)) as d:
            models, adapters = _expected(records[:k])
            got = _state(d)
            # A model restored at its base after a lost apply is not expected here.
            assert got == (models, adapters), (k, got)
            assert "state_journal_damaged" not in d.log()
    # Cut inside the last record: the others restored, the damage reported.
    st = tmp_path / "mid"
    st.mkdir()
    (st / "journal").write_bytes(data[:starts[-1] + 10])
    with _daemon(root, str(st)) as d:
        assert _state(d) == _expected(records[:-1])
        assert "state_journal_damaged" in d.log() and "cut short" in d.log()


def test_a_flipped_byte_loses_only_its_record(files, tmp_path):
    root, _ = files
    state = str(tmp_path / "state")
    with _daemon(root, state) as d:
        d.ctl_ok("load", "m1", os.path.join(root, "base32.safetensors"))
        d.ctl_ok("adapter", "load", "a1", os.path.join(root, "a1"))
        d.ctl_ok("adapter", "load", "a3", os.path.join(root, "a3.safetensors"), "--format",
                 "dense")
        d.ctl_ok("load", "m2", os.path.join(root, "base16.safetensors"))
        d.ctl_ok("apply", "m1", "a1:1")
        d.ctl_ok("apply", "m2", "a3:0.5")
        d.proc.kill()
    data, starts = _records(os.path.join(state, "journal"))
    records = [_payload(data, s) for s in starts]
    assert records[1]["kind"] == "adapter_load" and records[1]["name"] == "a1"
    # A byte inside a1's path: the record still parses, its digest does not match.
    path_at = data.index(b"/a1", starts[1])
    bad = bytearray(data)
    bad[path_at + 1] ^= 0x20   # "/a1" -> "/A1"
    st = tmp_path / "flipped"
    st.mkdir()
    (st / "journal").write_bytes(bytes(bad))
    with _daemon(root, str(st)) as d:
        log = d.log()
        assert "state_journal_damaged" in log, log
        assert re.search(r'it reads as adapter load \\?"a1\\?"', log), log
        # Everything else came back; m1's stack needed a1, so m1 serves its base.
        models, adapters = _state(d)
        assert adapters == ["a3"]
        assert models["m2"] == (2, ("a3:0.5",))
        assert models["m1"] == (1, ())
        assert "restore_skipped" in log and "m1" in log
        # A damaged journal may have lost a record of a higher number: the
        # next numbers skip a wide margin (2 was m1+a1 before the restart).
        with weightd.Client(socket=d.socket) as c:
            assert c.apply("m1", []) == 2 + 1 + (1 << 20)
            assert c.apply("m2", []) == 2 + 1 + (1 << 20)
        skipped = (st / "skipped.log").read_text()
        assert [json.loads(l)["entry"] for l in skipped.splitlines()] == \
            ['apply "m1" (seq %d)' % records[4]["seq"]], skipped


def test_a_checkpoint_changed_on_disk_is_not_served(files, tmp_path):
    root, base = files
    models = tmp_path / "models"
    models.mkdir()
    changing = models / "c.safetensors"
    st_io.save(base["llama16"], str(changing))
    st_io.save(base["llama32"], str(models / "keep.safetensors"))
    state = str(tmp_path / "state")
    with Daemon(model_root=str(models), extra_args=["--state-dir", state]) as d:
        d.ctl_ok("load", "c", str(changing))
        d.ctl_ok("load", "k", str(models / "keep.safetensors"))
        d.proc.kill()
    other = {k: (v.float() * 2).to(torch.bfloat16) for k, v in base["llama16"].items()}
    st_io.save(other, str(changing))    # same names and shapes, other bytes
    with Daemon(model_root=str(models), extra_args=["--state-dir", state]) as d:
        models_now, _ = _state(d)
        assert list(models_now) == ["k"], models_now
        assert "restore_skipped" in d.log() and "changed since it was loaded" in d.log()
        skipped = [json.loads(l) for l in open(os.path.join(state, "skipped.log"))]
        assert skipped[-1]["entry"].startswith('model load "c"'), skipped
        # The name is free again: loading the new file serves the new bytes.
        d.ctl_ok("load", "c", str(changing))
        with weightd.Client(socket=d.socket) as c:
            with c.fetch("c") as h:
                got = h.state_dict()
                for k, t in other.items():
                    assert torch.equal(got[k], t), k


def _killed_with_a_big_model(tmp_path, extra_files=()):
    """A model directory with a 1 GiB checkpoint (4 x 256 MiB: a restore of
    ~0.3-1 s, long enough to be seen) and a state directory whose daemon
    loaded it and was SIGKILLed. Returns (models, state)."""
    models = tmp_path / "models"
    models.mkdir()
    big = {"w%d" % i: torch.full((64, 1 << 20), float(i), dtype=torch.float32)
           for i in range(4)}
    st_io.save(big, str(models / "big.safetensors"))
    del big
    for name, tensors in extra_files:
        st_io.save(tensors, str(models / name))
    state = str(tmp_path / "state")
    with Daemon(model_root=str(models), extra_args=["--state-dir", state]) as d:
        d.ctl_ok("load", "big", str(models / "big.safetensors"))
        d.proc.kill()
    return models, state


def _start_restoring(tmp_path, models, state, *extra):
    """Starts weightd on `state` (stderr piped) and returns (proc, socket,
    deadline) once its socket exists, before the restore ends."""
    from harness import WEIGHTD
    sock = str(tmp_path / "r.sock")
    proc = subprocess.Popen([WEIGHTD, "--socket", sock, "--model-root", str(models),
                             "--state-dir", state, *extra], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    # Until it accepts: the socket file exists a moment before listen().
    while time.time() < deadline:
        with socket.socket(socket.AF_UNIX) as probe:
            try:
                probe.connect(sock)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                time.sleep(0.001)
    return proc, sock, deadline


def test_not_serving_until_the_restore_is_done(tmp_path):
    """While a restore runs, health says NOT_SERVING and calls are refused
    UNAVAILABLE naming the restore; then the restored model serves. A 1 GiB
    checkpoint keeps the restore going long enough to be seen (~0.3-1 s)."""
    models, state = _killed_with_a_big_model(tmp_path)
    proc, sock, deadline = _start_restoring(tmp_path, models, state)
    seen = {"not_serving": 0, "refused": 0, "served": 0}
    try:
        with weightd.Client(socket=sock, retry_deadline=0) as c:
            while time.time() < deadline:
                try:
                    c.health(timeout=2)
                except weightd.Error as e:
                    assert "NOT_SERVING" in e.message, e.message
                    seen["not_serving"] += 1
                    try:
                        c.list()
                    except weightd.Error as e2:
                        assert e2.code == "UNAVAILABLE" and "restoring" in e2.message, e2
                        seen["refused"] += 1
                        continue
                    # Answered: only because the restore ended in between.
                    assert c.health(timeout=2)
                # SERVING: the restore is complete.
                assert [m.name for m in c.list()] == ["big"]
                with c.fetch("big", world=4, rank=3) as h:
                    assert float(h.state_dict()["w2"][-1, -1]) == 2.0
                seen["served"] += 1
                break
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    log = proc.stderr.read()
    # A long load says how far it is.
    assert "restore_progress" in log and "percent=50" in log, log
    print("restore window:", seen)
    assert seen["served"] == 1 and seen["not_serving"] >= 1 and seen["refused"] >= 1, seen


def test_serve_during_restore_serves_reads_and_holds_changes(tmp_path):
    """--serve-during-restore: health says SERVING and what is restored is
    served at once; loads, unloads and applies are refused UNAVAILABLE until
    the restore is done (they would race with it)."""
    small = {"x": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    models, state = _killed_with_a_big_model(tmp_path, [("small.safetensors", small)])
    proc, sock, deadline = _start_restoring(tmp_path, models, state, "--serve-during-restore")
    refused = served = 0
    try:
        with weightd.Client(socket=sock, retry_deadline=0) as c:
            assert c.health(timeout=5)
            while time.time() < deadline:
                c.list()   # reads answer at once
                served += 1
                try:
                    c.load("small", str(models / "small.safetensors"))
                    break  # the restore is done: changes are accepted
                except weightd.Error as e:
                    assert e.code == "UNAVAILABLE" and "restoring" in e.message, e
                    refused += 1
            assert sorted(m.name for m in c.list()) == ["big", "small"]
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    print("during the restore: %d reads served, %d changes refused" % (served, refused))
    assert refused >= 1 and served >= 1


def test_sigterm_during_a_restore_exits_and_keeps_the_journal(tmp_path):
    """SIGTERM while a restore runs (any thread may receive it, including
    the ones libraries start before main): the restore stops after the entry
    in progress, the daemon exits 0, and the journal is the one it started
    from, so the next start restores everything."""
    small = {"x": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    models, state = _killed_with_a_big_model(tmp_path, [("small.safetensors", small)])
    with Daemon(model_root=str(models), extra_args=["--state-dir", state]) as d:
        # The big model (seq 1) restored, then this load journaled after it.
        d.ctl_ok("load", "small", str(models / "small.safetensors"))
        d.proc.kill()
    with open(os.path.join(state, "journal"), "rb") as f:
        journal = f.read()
    proc, _, _ = _start_restoring(tmp_path, models, state)
    # The socket accepts a moment before the restore's first entry starts:
    # wait for the big model's first progress line, so that the signal
    # lands while it loads (90% of 1 GiB still to go).
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "restore_progress" in line:
            break
    proc.terminate()
    assert proc.wait(timeout=60) == 0
    log = "".join(seen) + proc.stderr.read()
    assert 'interrupted="yes (a signal)"' in log, log
    assert 'model load \\"small\\"' not in log and "restore_entry" in log, log
    with open(os.path.join(state, "journal"), "rb") as f:
        assert f.read() == journal
    with Daemon(model_root=str(models), extra_args=["--state-dir", state]) as d:
        assert sorted(_state(d)[0]) == ["big", "small"]


def _journal_record(payload):
    """One journal record as the daemon writes it (state_journal.h):
    "WDJ1" | u32 length (LE) | XXH3-128 of the payload | payload (JSON)."""
    import xxhash
    body = json.dumps(payload).encode()
    return b"WDJ1" + len(body).to_bytes(4, "little") + xxhash.xxh3_128(body).digest() + body


def test_a_forged_generation_floor_near_2_64_is_refused_and_numbers_never_wrap(files, tmp_path):
    """A journal with records whose generation no model can have (a floor of
    2^64 - 2, an apply numbered 2^64 - 1, digests intact: forged) must not
    make the next numbers wrap below ones the models had: such records are
    damage, named in the log and not restored. A floor of one past the
    largest (2^62 + 1) is kept: that model has no number left, and its next
    apply is FAILED_PRECONDITION instead of wrapping."""
    root, _ = files
    state = str(tmp_path / "state")
    with _daemon(root, state) as d:
        d.ctl_ok("load", "m1", os.path.join(root, "base32.safetensors"))
        d.ctl_ok("apply", "m1")  # generation 2
        d.ctl_ok("load", "m2", os.path.join(root, "base16.safetensors"))
        d.ctl_ok("load", "m3", os.path.join(root, "base16.safetensors"))
        d.proc.kill()
    journal = os.path.join(state, "journal")
    data, starts = _records(journal)
    seq = max(_payload(data, s)["seq"] for s in starts)
    with open(journal, "ab") as f:
        f.write(_journal_record({"kind": "generation_floor", "seq": seq + 1, "name": "m1",
                                 "generation": 2**64 - 2}))
        f.write(_journal_record({"kind": "apply", "seq": seq + 2, "name": "m2", "stack": [],
                                 "generation": 2**64 - 1, "content": "00" * 16}))
        f.write(_journal_record({"kind": "generation_floor", "seq": seq + 3, "name": "m3",
                                 "generation": 2**62 + 1}))
    with _daemon(root, state) as d:
        log = d.log()
        assert re.search(r'state_journal_damaged .*generation floor \\?"m1\\?" \(seq %d\): '
                         r'generation 18446744073709551614 is past the largest' % (seq + 1), log), log
        assert re.search(r'apply \\?"m2\\?" \(seq %d\): generation 18446744073709551615 is past'
                         % (seq + 2), log), log
        assert _state(d)[0] == {"m1": (2, ()), "m2": (1, ()), "m3": (1, ())}
        with weightd.Client(socket=d.socket) as c:
            # Past every number each had, and past the margin a damaged
            # journal adds (a lost record may have held a higher one).
            assert c.apply("m1", []) == 2 + 1 + (1 << 20)
            assert c.apply("m2", []) == 1 + 1 + (1 << 20)
            with pytest.raises(weightd.Error) as e:
                c.apply("m3", [])
            assert e.value.code == "FAILED_PRECONDITION", e.value
            assert "no generation number left" in str(e.value), e.value
            assert c.info("m3").generation == 1
        # The next restart keeps the numbers (the forged records are gone).
        d.proc.kill()
    with _daemon(root, state) as d:
        assert "state_journal_damaged" not in d.log()
        assert _state(d)[0] == {"m1": (2 + 1 + (1 << 20), ()), "m2": (2 + (1 << 20), ()),
                                "m3": (1, ())}


def _start_on(state, models, tmp_path):
    """Runs weightd on `state` expecting it to refuse: (returncode, stderr)."""
    from harness import WEIGHTD
    r = subprocess.run([WEIGHTD, "--socket", str(tmp_path / "refused.sock"), "--model-root",
                        str(models), "--state-dir", state], capture_output=True, text=True,
                       timeout=30)
    return r.returncode, r.stderr


@pytest.mark.parametrize("entry", ["journal.new", "skipped.log", "published", "journal",
                                   "journal.new:hard link", "published:another user's"])
def test_what_another_user_planted_in_the_state_dir_is_never_followed(files, tmp_path, entry):
    """A state directory another user could write once (now the daemon's
    own, 0700) still holds what that user planted: links to root's files
    and directories, a hard link to one, a directory of its own. The daemon
    refuses to start, naming the entry and what to do, and truncates,
    appends to or removes nothing through it (it used to truncate the file
    journal.new named, append to skipped.log's, and empty published's
    directory). With the entry removed it restores as before."""
    root, _ = files
    models = tmp_path / "models"
    models.mkdir()
    for name in ("m", "gone"):
        shutil.copy(os.path.join(root, "base16.safetensors"), models / (name + ".safetensors"))
    state = str(tmp_path / "state")
    with Daemon(model_root=str(models), extra_args=["--state-dir", state]) as d:
        d.ctl_ok("load", "m", str(models / "m.safetensors"))
        # Its file goes: the restore skips it and writes skipped.log.
        d.ctl_ok("load", "gone", str(models / "gone.safetensors"))
        d.proc.kill()
    os.unlink(models / "gone.safetensors")
    victim = tmp_path / "victim"
    victim.write_bytes(b"root's file")
    victim_dir = tmp_path / "victim-dir"
    victim_dir.mkdir(mode=0o700)
    (victim_dir / "root.safetensors").write_bytes(b"root's file in root's directory")
    name, _, how = entry.partition(":")
    planted = os.path.join(state, name)
    if name == "journal":
        os.rename(planted, str(tmp_path / "journal"))  # kept, to put back
    if how == "hard link":
        os.link(victim, planted)
        why = "has 2 hard links"
    elif how:
        os.mkdir(planted)
        os.chown(planted, 65534, 65534)
        os.chmod(planted, 0o777)
        why = "is owned by uid 65534, not by uid 0"
    else:
        os.symlink(victim_dir if name == "published" else victim, planted)
        why = "is a symbolic link (to %s)" % (victim_dir if name == "published" else victim)
    rc, err = _start_on(state, models, tmp_path)
    assert rc == 1, err
    assert "error: FAILED_PRECONDITION: --state-dir: %s %s" % (planted, why) in err, err
    assert "remove it" in err, err
    assert victim.read_bytes() == b"root's file"
    assert os.listdir(victim_dir) == ["root.safetensors"]
    assert not os.path.exists(os.path.join(state, "skipped.log")) or name == "skipped.log"
    if os.path.isdir(planted) and not os.path.islink(planted):
        os.rmdir(planted)
    else:
        os.unlink(planted)
    if name == "journal":
        os.rename(str(tmp_path / "journal"), planted)
    with Daemon(model_root=str(models), extra_args=["--state-dir", state]) as d:
        assert list(_state(d)[0]) == ["m"]
        assert "restore_skipped" in d.log()
    skipped = [json.loads(l) for l in open(os.path.join(state, "skipped.log"))]
    assert [s["entry"].split(" (")[0] for s in skipped] == ['model load "gone"'], skipped

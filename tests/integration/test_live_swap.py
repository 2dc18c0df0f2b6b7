"""Live adapter swap (docs/DESIGN.md §1.4, §1.7 "model"/"lease", §2.5 "LoRA merge",
§4.2 apply/watch/fetch --generation/--changed-since, §4.3 Watch).

* Two holder processes (Python client) fetch generation N (= a:0.5) and keep their
  leases while `weightctl apply` makes N+1; a `weightctl watch --count 1`
  started before the apply prints N+1; `fetch --generation N` still serves
  N's exact bytes while N is leased; `fetch --changed-since N` returns exactly
  the LoRA-targeted tensors; the holders re-read their mappings after the
  apply and still see N's exact bytes. When they exit (one releases, one just
  dies), leases_open returns to 0, every byte materialized for generation N
  is freed, and generation N becomes NOT_FOUND.
* Six operator processes race `weightctl apply MODEL a:<s> --expect-generation G`
  for the same G, five rounds: exactly one wins each round, the others get
  ABORTED; the final generation is start + 5, `info` shows the last winner's
  stack and the fetched bytes are the winner's merge (no torn state). Then
  the same race with two readers fetching the current generation throughout:
  each fetch is entirely the merge of the generation it reports.
"""
import hashlib
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import BUILD, Daemon, WEIGHTCTL  # noqa: E402
import st_io  # noqa: E402
from reference import chunk_range  # noqa: E402

MODEL = "live"
H, INTER, KV = 64, 96, 32
PYTHON = "/usr/bin/python3"
SHAPES = {"self_attn.q_proj": (H, H), "self_attn.k_proj": (KV, H), "self_attn.v_proj": (KV, H),
          "self_attn.o_proj": (H, H), "mlp.up_proj": (INTER, H), "mlp.down_proj": (H, INTER)}
TARGETS = ["model.layers.%d.%s" % (i, m) for i in range(2)
           for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")]
R, ALPHA = 8, 16

# A holder: fetches its rank of the current generation (f32: a cast, so the
# daemon materializes a segment for it), prints "ready GEN DIGEST", waits for a
# line, re-reads its mapped tensors and prints "after GEN DIGEST", waits for a
# line, then ends its lease: by release() ("release") or by dying ("die").
_HOLDER = r"""
import hashlib, os, sys
import weightd
sock, model, rank, how = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
c = weightd.Client(socket=sock)
h = c.fetch(model, world=2, rank=rank, dtype="f32")
def digest():
    m = hashlib.sha256()
    for name, arr in sorted(h.numpy_dict().items()):
        m.update(name.encode()); m.update(b"\0"); m.update(arr.tobytes())
    return m.hexdigest()
print("ready %d %s" % (h.generation, digest()), flush=True)
sys.stdin.readline()
print("after %d %s" % (h.generation, digest()), flush=True)
sys.stdin.readline()
if how == "release":
    h.release()
    c.close()
    print("released", flush=True)
    sys.exit(0)
os._exit(0)   # process death: the lease ends with the data connection
"""


def _child_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(BUILD, "python"),
                                         env.get("PYTHONPATH", "")])
    return env


def _digest(tensors):
    m = hashlib.sha256()
    for name in sorted(tensors):
        m.update(name.encode())
        m.update(b"\0")
        m.update(st_io.tensor_bytes(tensors[name]))
    return m.hexdigest()


def _rows(t, world, rank):
    s, e = chunk_range(t.shape[0], world, rank)
    return t[s:e]


@pytest.fixture(scope="module")
def daemon():
    d = Daemon()
    d.start()
    try:
        g = torch.Generator().manual_seed(4242)
        ck = {"model.embed_tokens.weight": torch.randn(128, H, generator=g)}
        for i in range(2):
            for m, shape in SHAPES.items():
                ck["model.layers.%d.%s.weight" % (i, m)] = torch.randn(*shape, generator=g) * 0.05
            ck["model.layers.%d.input_layernorm.weight" % i] = 1 + 0.1 * torch.randn(H, generator=g)
        ck["model.norm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
        ck = {k: v.to(torch.bfloat16) for k, v in ck.items()}
        path = os.path.join(d.model_root, "live.safetensors")
        st_io.save(ck, path)
        d.ctl_ok("load", MODEL, path)
        # PEFT adapter "a" on q/v/down of both layers
        ad = os.path.join(d.model_root, "adapter_a")
        os.makedirs(ad)
        factors, tensors = {}, {}
        for m in TARGETS:
            out, inn = SHAPES[m.split(".", 3)[3]]
            a = torch.randn(R, inn, generator=g) * 0.2
            b = torch.randn(out, R, generator=g) * 0.2
            tensors["base_model.model.%s.lora_A.weight" % m] = a
            tensors["base_model.model.%s.lora_B.weight" % m] = b
            factors[m + ".weight"] = (a, b)
        import json
        with open(os.path.join(ad, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": R, "lora_alpha": ALPHA,
                       "target_modules": ["q_proj", "v_proj", "down_proj"]}, f)
        st_io.save(tensors, os.path.join(ad, "adapter_model.safetensors"))
        d.ctl_ok("adapter", "load", "a", ad)
        d.ck = ck
        d.factors = factors
        d.nfetch = 0
        yield d
    finally:
        d.stop()


def _merged(d, strength):
    """fp32 reference of the model with stack a:strength (one rounding at the end)."""
    out = {}
    for name, w in d.ck.items():
        if name in d.factors:
            a, b = d.factors[name]
            s = torch.tensor(np.float32(float(np.float32(strength)) * (ALPHA / R)))
            out[name] = w.float() + (b @ a) * s
        else:
            out[name] = w.float()
    return out


def _fetch(d, *args):
    d.nfetch += 1
    out = os.path.join(d.workdir, "f%d.safetensors" % d.nfetch)
    r = d.ctl("fetch", MODEL, *args, "--out", out)
    if r.returncode != 0:
        return r, None
    got = st_io.load(out)
    os.unlink(out)
    return r, got


def _stats(d):
    out = {}
    for line in d.ctl_ok("stats").stdout.splitlines():
        k, _, v = line.partition(":")
        if v.strip().isdigit():
            out[k.strip()] = int(v)
    return out


def _info(d):
    gen, adapters, patched = None, None, {}
    for line in d.ctl_ok("info", MODEL).stdout.splitlines():
        if line.startswith("generation: "):
            gen = int(line.split(":", 1)[1])
        elif line.startswith("adapters: "):
            adapters = line.split(":", 1)[1].strip()
        elif line.startswith("tensor: "):
            f = line[len("tensor: "):].split("\t")
            by = [x for x in f if x.startswith("patched_by=")]
            patched[f[0]] = by[0][len("patched_by="):] if by else ""
    return gen, adapters, patched


def _readline(proc, timeout, what):
    """A line from proc.stdout within `timeout` s (os.read-free: poll + select)."""
    import select
    deadline = time.time() + timeout
    while time.time() < deadline:
        r, _, _ = select.select([proc.stdout], [], [], 0.1)
        if r:
            line = proc.stdout.readline()
            if line:
                return line.strip()
            break
        if proc.poll() is not None:
            break
    raise AssertionError("%s: no line within %gs (exit %s): %s" % (
        what, timeout, proc.poll(), proc.stderr.read() if proc.poll() is not None else ""))


def _assert_matches(got, want_f32, label):
    """got: fetched F32 tensors; want: fp32 reference (allclose for merged)."""
    assert set(got) == set(want_f32), "%s: names %s" % (label, sorted(got))
    for name, t in got.items():
        w = want_f32[name]
        assert t.dtype == torch.float32 and t.shape == w.shape, "%s: %s %s %s" % (
            label, name, t.dtype, list(t.shape))
        atol = 1e-6 * float(w.abs().max())
        assert torch.allclose(t, w, rtol=1e-5, atol=atol), "%s: %s max |diff| %g" % (
            label, name, float((t - w).abs().max()))


def test_live_swap(daemon):
    d = daemon
    s0 = _stats(d)
    assert s0["leases_open"] == 0
    r0 = s0["bytes_resident"]   # before any fetch: the checkpoint only
    # Generation N = a:0.5, so what the holders read is specific to N (merged,
    # tagged with N in the daemon's cache) and must be freed once N is gone.
    g0, _, _ = _info(d)
    d.ctl_ok("apply", MODEL, "a:0.5")
    gen_n, adapters, _ = _info(d)
    assert (gen_n, adapters) == (g0 + 1, "a:0.5")

    # Warm-up: the holders' exact requests (world 2, rank r, f32) at N. Their
    # bytes are N's reference bytes for the holders (checked against PyTorch).
    want_n = {}
    for rank in (0, 1):
        r, got = _fetch(d, "--world", 2, "--rank", rank, "--dtype", "f32")
        assert r.returncode == 0 and " generation %d," % gen_n in r.stdout, r.stderr
        _assert_matches(got, {k: _rows(v, 2, rank) for k, v in _merged(d, 0.5).items()},
                        "gen N rank %d" % rank)
        want_n[rank] = _digest(got)
    r_warm_n = _stats(d)["bytes_resident"]   # base + the cache of those fetches at N

    holders = []
    try:
        for rank, how in ((0, "release"), (1, "die")):
            holders.append(subprocess.Popen(
                [PYTHON, "-c", _HOLDER, d.socket, MODEL, str(rank), how],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env=_child_env()))
        for rank, p in enumerate(holders):
            line = _readline(p, 60, "holder %d ready" % rank)
            assert line == "ready %d %s" % (gen_n, want_n[rank]), \
                "holder %d: %r (gen %d expected)" % (rank, line, gen_n)
        assert _stats(d)["leases_open"] == 2

        watch = subprocess.Popen([WEIGHTCTL, "--socket", d.socket, "watch", MODEL, "--count", "1"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(1.0)   # let the Watch call reach the daemon before the apply
            assert watch.poll() is None, watch.stderr.read()
            r = d.ctl_ok("apply", MODEL, "a:0.75")
            assert r.stdout.strip() == "%s generation %d: a:0.75" % (MODEL, gen_n + 1), r.stdout
            out, err = watch.communicate(timeout=15)
        finally:
            if watch.poll() is None:
                watch.kill()
                watch.wait()
        assert watch.returncode == 0, err
        assert out.splitlines() == ["%s generation %d: a:0.75" % (MODEL, gen_n + 1)], out

        gen, adapters, patched = _info(d)
        assert (gen, adapters) == (gen_n + 1, "a:0.75")
        assert {n for n, by in patched.items() if by} == {t + ".weight" for t in TARGETS}
        assert all(by == "a" for by in patched.values() if by)

        # the test's own N+1 fetches (world 1): their cache is current-generation
        r1 = _stats(d)["bytes_resident"]
        r, got = _fetch(d, "--dtype", "f32")
        assert r.returncode == 0, r.stderr
        assert " generation %d," % (gen_n + 1) in r.stdout, r.stdout
        _assert_matches(got, _merged(d, 0.75), "current")
        # --changed-since N: exactly the LoRA-targeted tensors
        r, got = _fetch(d, "--changed-since", gen_n, "--dtype", "f32")
        assert r.returncode == 0, r.stderr
        assert set(got) == {t + ".weight" for t in TARGETS}, sorted(got)
        _assert_matches(got, {k: v for k, v in _merged(d, 0.75).items() if k in got},
                        "changed-since")
        extra_n1 = _stats(d)["bytes_resident"] - r1

        # --generation N while leased: N's exact bytes (a holder's request), and
        # a world-1 fetch of N matches the a:0.5 reference
        r, got = _fetch(d, "--generation", gen_n, "--world", 2, "--rank", 1, "--dtype", "f32")
        assert r.returncode == 0, r.stderr
        assert " generation %d," % gen_n in r.stdout, r.stdout
        assert _digest(got) == want_n[1]
        r, got = _fetch(d, "--generation", gen_n, "--dtype", "f32")
        assert r.returncode == 0, r.stderr
        _assert_matches(got, _merged(d, 0.5), "generation N world 1")

        # the holders re-read their mappings: still N's exact bytes
        for rank, p in enumerate(holders):
            p.stdin.write("\n")
            p.stdin.flush()
            line = _readline(p, 30, "holder %d after" % rank)
            assert line == "after %d %s" % (gen_n, want_n[rank]), "holder %d: %r" % (rank, line)
        # end the leases: holder 0 releases, holder 1 dies
        for p in holders:
            p.stdin.write("\n")
            p.stdin.flush()
        assert _readline(holders[0], 30, "holder 0 release") == "released"
        for p in holders:
            assert p.wait(timeout=30) == 0, p.stderr.read()
    finally:
        for p in holders:
            if p.poll() is None:
                p.kill()
                p.wait()

    # leases_open back to 0 (poll: the dead holder's lease ends with its connection)
    deadline = time.time() + 5
    while _stats(d)["leases_open"] != 0:
        assert time.time() < deadline, "leases_open stays %d" % _stats(d)["leases_open"]
        time.sleep(0.05)

    # generation N is gone once unleased
    deadline = time.time() + 5
    while True:
        r, _ = _fetch(d, "--generation", gen_n)
        if r.returncode != 0 and r.error_code == "NOT_FOUND":
            break
        if time.time() > deadline:
            raise AssertionError("fetch --generation %d after release: exit %d %s" % (
                gen_n, r.returncode, r.stderr.strip()))
        time.sleep(0.1)

    # Memory. What is compared: r_warm_n = bytes_resident with generation N
    # current, no lease, after the holders' two requests (world 2, rank 0/1,
    # f32) were fetched once at N: the checkpoint + their cached
    # materializations (merged pieces specific to N; the f32 casts of untouched
    # tensors are content-keyed and equally valid for N+1). Now we repeat the
    # identical warm-up at N+1: the merged pieces for N+1 have the same sizes, so
    # with N's pieces freed the level must be at most r_warm_n plus extra_n1 (what
    # the test's own world-1 and --changed-since fetches at N+1 added, measured
    # around them) and at least r0 (before any fetch; a daemon may also drop
    # current-generation cache entries). If N's merged pieces were still held,
    # the level would exceed the bound by their size. Poll for a few seconds.
    for rank in (0, 1):
        r, got = _fetch(d, "--world", 2, "--rank", rank, "--dtype", "f32")
        assert r.returncode == 0 and " generation %d," % (gen_n + 1) in r.stdout, r.stderr
        _assert_matches(got, {k: _rows(v, 2, rank) for k, v in _merged(d, 0.75).items()},
                        "gen N+1 rank %d" % rank)
    bound = r_warm_n + extra_n1
    deadline = time.time() + 5
    while True:
        s = _stats(d)
        if s["leases_open"] == 0 and r0 <= s["bytes_resident"] <= bound:
            break
        if time.time() > deadline:
            raise AssertionError(
                "after release and an identical warm-up at N+1: leases_open %d, bytes_resident "
                "%d, expected within [%d, %d] (r0 %d + N warm-up cache %d + N+1 extra %d)" % (
                    s["leases_open"], s["bytes_resident"], r0, bound, r0, r_warm_n - r0,
                    extra_n1))
        time.sleep(0.1)
    assert d.alive()


OPERATORS = 6
ROUNDS = 5


def test_apply_race(daemon):
    d = daemon
    start, _, _ = _info(d)
    winners = []
    for rnd in range(ROUNDS):
        g, _, _ = _info(d)
        assert g == start + rnd
        strengths = ["%.2f" % (0.1 * (i + 1) + 0.02 * rnd) for i in range(OPERATORS)]
        procs = [subprocess.Popen([WEIGHTCTL, "--socket", d.socket, "apply", MODEL, "a:" + s,
                                   "--expect-generation", str(g)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for s in strengths]
        results = []
        for s, p in zip(strengths, procs):
            out, err = p.communicate(timeout=60)
            results.append((s, p.returncode, out, err))
        ok = [x for x in results if x[1] == 0]
        assert len(ok) == 1, "round %d: %d winners: %s" % (rnd, len(ok), results)
        for s, rc, out, err in results:
            if rc != 0:
                assert err.startswith("error: ABORTED: "), "round %d a:%s: %s" % (rnd, s, err)
        s, _, out, _ = ok[0]
        assert out.strip() == "%s generation %d: a:%s" % (MODEL, g + 1, float(s)) or \
            out.strip() == "%s generation %d: a:%s" % (MODEL, g + 1, s), out
        winners.append(s)
        gen, adapters, _ = _info(d)
        assert gen == g + 1
        name, _, st = adapters.partition(":")
        assert name == "a" and float(st) == pytest.approx(float(s)), adapters
        # the bytes are the winner's merge, not another racer's (no torn state)
        r, got = _fetch(d, "--dtype", "f32")
        assert r.returncode == 0, r.stderr
        assert " generation %d," % (g + 1) in r.stdout, r.stdout
        _assert_matches(got, _merged(d, float(s)), "round %d winner a:%s" % (rnd, s))
    gen, adapters, _ = _info(d)
    assert gen == start + ROUNDS
    assert float(adapters.partition(":")[2]) == pytest.approx(float(winners[-1]))
    # bf16 keep fetch of the last winner: 1-ulp rule against the one-rounding reference
    r, got = _fetch(d, "--world", 2, "--rank", 0)
    assert r.returncode == 0, r.stderr
    ref = {k: _rows(v, 2, 0).to(torch.bfloat16) for k, v in _merged(d, float(winners[-1])).items()}
    bad = total = 0
    for name, t in got.items():
        gi = t.view(torch.int16).numpy().astype(np.int32)
        wi = ref[name].view(torch.int16).numpy().astype(np.int32)
        diff = np.abs(gi - wi)
        if name not in d.factors:
            assert not diff.any(), name
        else:
            # >1 ulp only where W + ΔW nearly cancels (fp32 GEMM-order error within atol)
            w32 = _rows(_merged(d, float(winners[-1]))[name], 2, 0)
            far = (diff > 1) & ((t.float() - w32).abs().numpy() > 1e-6 * float(w32.abs().max()))
            assert not far.any(), "%s: %d ulp" % (name, int(diff.max()))
            bad += int(np.count_nonzero(diff))
            total += diff.size
    assert bad <= 0.005 * total, "%d of %d off by 1 ulp" % (bad, total)
    assert _stats(d)["leases_open"] == 0


def test_apply_race_with_readers(daemon):
    """The same race while readers keep fetching (and releasing) the current
    generation: still exactly one winner per round, and every fetch a reader
    got is entirely the merge of the stack of the generation it reports."""
    import threading
    import weightd
    d = daemon
    strengths_of = {}   # generation -> strength of its stack ("a:s")
    g, adapters, _ = _info(d)
    strengths_of[g] = float(adapters.partition(":")[2]) if adapters != "(none)" else 0.0
    stop = threading.Event()
    seen, errors = [], []

    def reader():
        c = weightd.Client(socket=d.socket)
        try:
            while not stop.is_set():
                with c.fetch(MODEL, dtype="f32", names=sorted(d.factors)) as h:
                    seen.append((h.generation, {k: v.clone() for k, v in h.state_dict().items()}))
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))
        finally:
            c.close()

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for rnd in range(ROUNDS):
            g, _, _ = _info(d)
            strengths = ["%.2f" % (1.1 + 0.1 * i + 0.03 * rnd) for i in range(OPERATORS)]
            procs = [subprocess.Popen([WEIGHTCTL, "--socket", d.socket, "apply", MODEL, "a:" + s,
                                       "--expect-generation", str(g)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                     for s in strengths]
            results = [(s,) + (p.wait(timeout=60),) + p.communicate() for s, p in
                       zip(strengths, procs)]
            ok = [x for x in results if x[1] == 0]
            assert len(ok) == 1, "round %d (expect-generation %d, readers fetching): %d winners: %s" % (
                rnd, g, len(ok), [(x[0], x[1], x[3].strip()) for x in results])
            assert all(x[3].startswith("error: ABORTED: ") for x in results if x[1] != 0)
            strengths_of[g + 1] = float(ok[0][0])
            time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert not errors, errors
    assert seen
    refs = {}
    for gen, tensors in seen:
        assert gen in strengths_of, "a reader saw generation %d" % gen
        if gen not in refs:
            refs[gen] = _merged(d, strengths_of[gen])
        _assert_matches(tensors, {k: refs[gen][k] for k in tensors},
                        "reader at generation %d (a:%s)" % (gen, strengths_of[gen]))

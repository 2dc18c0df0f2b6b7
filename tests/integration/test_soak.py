"""Soak test (bounded in time, loopback only): 32 client processes fetch and
release random (world, rank, dtype) shards over shm, for LOOP_S seconds,
while the test process swaps the model's adapter stack every ~0.6 s and
SIGKILLs KILLS workers at random moments (some mid-fetch, some while holding
a lease; half of them are replaced). It ends with zero unexpected errors in
the surviving workers, every fetched shard bit-identical to the PyTorch
reference of the adapter stack of the generation it reports, and the daemon
back to its baseline: open leases, open fds, bytes_resident (same adapter
state, same cached requests), RSS within 5 %, healthy.

Exactness: the checkpoint holds multiples of 2^-10 and the LoRA factors
multiples of 2^-3, alpha / r is 1 and the strengths are multiples of 1/4, so
every merge W + s * (B @ A) (and a stack of two) is exact in fp32 whatever the
summation order (checked against fp64 below); the reference digests are
therefore exact, and the casts (bf16/f16, one round to nearest even of the
exact value) are compared bit for bit as well. Expected errors: none (a
fetch of the current generation does not fail during a swap).
"""
import hashlib
import json
import mmap
import os
import random
import signal
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import BUILD, SANITIZE, Daemon  # noqa: E402
import st_io  # noqa: E402
from reference import chunk_range  # noqa: E402
import weightd  # noqa: E402  (build/python, put on sys.path by harness)

MODEL = "soak"
PYTHON = "/usr/bin/python3"
WORKERS = 32
KILLS = 6
REPLACE = 3          # the first REPLACE killed workers get a replacement
LOOP_S = float(os.environ.get("WEIGHTD_SOAK_SECONDS", "18"))  # fetch/swap/kill phase (s)
WARM_S = 4.0         # concurrent warm-up before the baseline
SWAP_S = 0.6         # time between adapter swaps
LEASE_TTL_S = 4      # a worker killed between Fetch and attaching its lease: reclaimed by TTL
SETTLE_S = 12.0      # bounded wait for leases/fds/bytes to come back
WORLDS = (1, 2, 4)
DTYPES = ("keep", "bf16", "f16")
_TORCH = {"bf16": torch.bfloat16, "f16": torch.float16}
_ST = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}

R, ALPHA = 4, 4      # scale = strength * ALPHA / R = strength
# dim0 of most tensors is not divisible by 2 or 4; norm.weight (6 rows) gives
# world 4 / rank 3 an empty piece.
SHAPES = {
    "embed.weight": (1001, 256),
    "layers.0.q_proj.weight": (130, 96),
    "layers.0.v_proj.weight": (97, 96),
    "layers.1.q_proj.weight": (130, 96),
    "layers.1.v_proj.weight": (97, 96),
    "layers.1.mlp.weight": (257, 130),
    "norm.weight": (6,),
    "lm_head.weight": (515, 256),
}
TARGETS = ["layers.%d.%s" % (i, m) for i in range(2) for m in ("q_proj", "v_proj")]
# Adapter stacks; index 0 (the base) is the baseline state. Each swap picks
# one not used before (while there are), so every generation has new merged
# bytes and its cache entries must be freed once it is retired and unleased.
_S = [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, -0.25, -0.5, -0.75]
STATES = ([()] + [(("a", x),) for x in _S] + [(("b", x),) for x in _S] +
          [(("a", x), ("b", y)) for x, y in zip(_S, _S[3:] + _S[:3])] +
          [(("b", x), ("a", y)) for x, y in zip(_S, _S[5:] + _S[:5])])

# A worker. argv: socket model index stop_path phase_path refs_path seed.
# phase byte (for the test's kill choice): I importing/idle, R ready, F in
# fetch, H holding a lease. Prints one JSON line at exit.
_WORKER = r"""
import hashlib, json, mmap, os, random, sys, time
sock, model, idx, stop_path, phase_path, refs_path, seed = sys.argv[1:8]
pf = open(phase_path, "r+b")
ph = mmap.mmap(pf.fileno(), 1)
def phase(c):
    ph[0] = ord(c)
import weightd
with open(refs_path) as f:
    refs = json.load(f)   # "world,rank,dtype" -> {digest: state index}
rnd = random.Random(int(seed))
c = weightd.Client(socket=sock)
fetches, nbytes, errors, gens = 0, 0, [], {}
phase("R")
while not os.path.exists(stop_path):
    world = rnd.choice((1, 2, 4))
    rank = rnd.randrange(world)
    dt = rnd.choice(("keep", "bf16", "f16"))
    try:
        phase("F")
        h = c.fetch(model, world=world, rank=rank, dtype=dt, timeout=30)
        phase("H")
        arrs = h.numpy_dict()
        m = hashlib.sha256()
        for t in sorted(h.tensors, key=lambda t: t.name):
            m.update(("%s\0%s\0%s\0" % (t.name, t.dtype, ",".join(map(str, t.shape)))).encode())
            m.update(arrs[t.name].tobytes())
        del arrs
        state = refs["%d,%d,%s" % (world, rank, dt)].get(m.hexdigest())
        if state is None:
            errors.append("generation %d world %d rank %d %s: bytes match no adapter state"
                          % (h.generation, world, rank, dt))
        else:
            gens.setdefault(str(h.generation), set()).add(state)
        fetches += 1
        nbytes += h.nbytes
        if rnd.random() < 0.3:
            time.sleep(rnd.uniform(0.0, 0.15))   # hold the lease a while
        h.release()
        phase("R")
    except Exception as e:
        errors.append("world %d rank %d %s: %r" % (world, rank, dt, e))
    if len(errors) > 20:
        break
c.close()
print(json.dumps({"index": int(idx), "fetches": fetches, "bytes": nbytes, "errors": errors,
                  "gens": {g: sorted(s) for g, s in gens.items()}}), flush=True)
"""


def _child_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(BUILD, "python"),
                                         env.get("PYTHONPATH", "")])
    return env


def _digest(pieces):
    m = hashlib.sha256()
    for name in sorted(pieces):
        t = pieces[name]
        m.update(("%s\0%s\0%s\0" % (name, _ST[t.dtype], ",".join(map(str, t.shape)))).encode())
        m.update(st_io.tensor_bytes(t))
    return m.hexdigest()


def _combos():
    return [(w, r, dt) for w in WORLDS for r in range(w) for dt in DTYPES]


def _piece(full, world, rank, dt):
    out = {}
    for name, t in full.items():
        s, e = chunk_range(t.shape[0], world, rank)
        t = t[s:e]
        if dt != "keep":
            t = t.to(_TORCH[dt])
        out[name] = t
    return out


def _fds(pid):
    return len(os.listdir("/proc/%d/fd" % pid))


def _make_model(d):
    g = torch.Generator().manual_seed(2026)
    ck = {n: torch.randint(-1024, 1025, s, generator=g).float() / 1024 for n, s in SHAPES.items()}
    path = os.path.join(d.model_root, "soak.safetensors")
    st_io.save(ck, path)
    d.ctl_ok("load", MODEL, path)
    factors = {}
    for ad in ("a", "b"):
        adir = os.path.join(d.model_root, "adapter_" + ad)
        os.makedirs(adir)
        tensors = {}
        for m in TARGETS:
            out, inn = SHAPES[m + ".weight"]
            a = torch.randint(-4, 5, (R, inn), generator=g).float() / 8
            b = torch.randint(-4, 5, (out, R), generator=g).float() / 8
            tensors["base_model.model.%s.lora_A.weight" % m] = a
            tensors["base_model.model.%s.lora_B.weight" % m] = b
            factors[(ad, m + ".weight")] = (a, b)
        with open(os.path.join(adir, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": R, "lora_alpha": ALPHA,
                       "target_modules": ["q_proj", "v_proj"]}, f)
        st_io.save(tensors, os.path.join(adir, "adapter_model.safetensors"))
        d.ctl_ok("adapter", "load", ad, adir)
    return ck, factors


def _merged(ck, factors, stack):
    out = {}
    for name, w in ck.items():
        acc, acc64 = w.clone(), w.double()
        for ad, strength in stack:
            if (ad, name) in factors:
                a, b = factors[(ad, name)]
                acc = acc + (b @ a) * (strength * ALPHA / R)
                acc64 = acc64 + (b.double() @ a.double()) * (strength * ALPHA / R)
        assert torch.equal(acc.double(), acc64), "merge of %s not exact in fp32" % name
        out[name] = acc
    return out


def _apply(c, stack):
    return c.apply(MODEL, [(n, s) for n, s in stack])


def _warm(c, refs, state):
    """One fetch of every (world, rank, dtype), checked against state's bytes."""
    for w, r, dt in _combos():
        with c.fetch(MODEL, world=w, rank=r, dtype=dt) as h:
            arrs = h.numpy_dict()
            m = hashlib.sha256()
            for t in sorted(h.tensors, key=lambda t: t.name):
                m.update(("%s\0%s\0%s\0" % (t.name, t.dtype,
                                            ",".join(map(str, t.shape)))).encode())
                m.update(arrs[t.name].tobytes())
            del arrs
            got = refs["%d,%d,%s" % (w, r, dt)].get(m.hexdigest())
            assert got == state, "warm-up world %d rank %d %s: state %r, expected %d" % (
                w, r, dt, got, state)


def _settle(c, pid, timeout=SETTLE_S):
    """Waits until leases_open, bytes_resident and the fd count stop moving
    (the reaper prunes generations and sweeps the cache once a second)."""
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        s = c.stats()
        cur = (s["leases_open"], s["bytes_resident"], _fds(pid))
        if cur == last:
            return s
        last = cur
        time.sleep(1.2)
    return c.stats()


def _warm_base(c, refs, pid):
    """At the base stack: the warm-up's requests, twice, each followed by a
    settle. Why twice: the cache packs each fetch's misses into one segment
    tagged with the fetch's generation, and a segment of a retired
    generation is freed once unleased, taking with it the content-keyed
    entries (casts of unpatched tensors) that a base fetch may just have hit
    in it. The first round can thus leave some requests uncached; the second
    re-materializes them in live segments, so the cache then holds exactly one
    copy of every request: the same bytes and memfds at the baseline and at
    the end, whatever happened in between."""
    for _ in range(2):
        _settle(c, pid)
        _warm(c, refs, 0)
    return _settle(c, pid)


def _mem(pid):
    out = {}
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "Threads"):
                out[k] = int(v.split()[0]) * (1 if k == "Threads" else 1024)
    return out


class _Soak:
    """Worker processes, adapter swaps and kills against one daemon."""

    def __init__(self, d, c, tmp_path, refs_path, gen_state):
        self.d, self.c, self.tmp, self.refs_path = d, c, tmp_path, refs_path
        self.gen_state = gen_state
        self.env = _child_env()
        self.workers = {}   # index -> (Popen, phase mmap, out path, err path)
        self.next_index = 0
        self.current = None

    def spawn(self, stop_path):
        i = self.next_index
        self.next_index += 1
        ph_path = self.tmp / ("phase%d" % i)
        ph_path.write_bytes(b"I")
        out, err = str(self.tmp / ("w%d.out" % i)), str(self.tmp / ("w%d.err" % i))
        with open(out, "wb") as fo, open(err, "wb") as fe:
            p = subprocess.Popen([PYTHON, "-c", _WORKER, self.d.socket, MODEL, str(i), stop_path,
                                  str(ph_path), self.refs_path, str(1000 + i)],
                                 stdout=fo, stderr=fe, env=self.env)
        with open(ph_path, "r+b") as f:
            mm = mmap.mmap(f.fileno(), 1)
        self.workers[i] = (p, mm, out, err)
        return i

    def kill_all(self):
        for p, _, _, _ in self.workers.values():
            if p.poll() is None:
                p.kill()
                p.wait()

    def run(self, name, duration, kills, replace, rng):
        """WORKERS fresh workers for `duration` s after they are all ready,
        swapping every SWAP_S and SIGKILLing `kills` of them (alternately one
        holding a lease and one inside fetch); the first `replace` killed get
        a replacement. Returns (summaries, killed, loop seconds)."""
        stop_path = str(self.tmp / ("stop-" + name))
        mine = [self.spawn(stop_path) for _ in range(WORKERS)]
        deadline = time.time() + 60
        while any(self.workers[i][1][0] == ord("I") for i in mine):
            for i in mine:
                p, _, _, err = self.workers[i]
                assert p.poll() is None, "worker %d died starting: %s" % (
                    i, open(err).read()[-2000:])
            assert time.time() < deadline, "workers did not start"
            time.sleep(0.05)
        t_ready = time.time()
        kill_at = sorted(rng.uniform(1.0, duration - 2.0) for _ in range(kills))
        killed = []      # (index, phase when killed)
        next_swap = time.time() + SWAP_S
        next_stats, self.max_leases = time.time(), 0
        while time.time() < t_ready + duration:
            now = time.time()
            if now >= next_stats:
                # each worker holds at most one lease at a time; a killed one's
                # unattached lease may linger until its TTL
                self.max_leases = max(self.max_leases, self.c.stats()["leases_open"])
                next_stats = now + 0.25
            if now >= next_swap:
                fresh = [s for s in range(1, len(STATES)) if s not in self.gen_state.values()]
                nxt = rng.choice(fresh or [s for s in range(len(STATES)) if s != self.current])
                self.gen_state[_apply(self.c, STATES[nxt])] = nxt
                self.current = nxt
                next_swap = now + SWAP_S
            if kill_at and now - t_ready >= kill_at[0]:
                kill_at.pop(0)
                want = "H" if len(killed) % 2 == 0 else "F"
                done = {i for i, _ in killed}
                live = [i for i in mine if self.workers[i][0].poll() is None and i not in done]
                victim, wait_until = None, time.time() + 1.0
                while victim is None:
                    cand = [i for i in live if self.workers[i][1][0] == ord(want)]
                    if cand or time.time() > wait_until:
                        victim = rng.choice(cand or live)
                    else:
                        time.sleep(0.002)
                p, mm, _, _ = self.workers[victim]
                ph = chr(mm[0])
                p.send_signal(signal.SIGKILL)
                p.wait()
                killed.append((victim, ph))
                if len(killed) <= replace:
                    mine.append(self.spawn(stop_path))
            time.sleep(0.01)
        open(stop_path, "w").close()
        t_loop = time.time() - t_ready

        killed_ids = {i for i, _ in killed}
        summaries, failures = [], []
        for i in mine:
            if i in killed_ids:
                continue
            p, _, out, err = self.workers[i]
            try:
                rc = p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                failures.append("worker %d hung" % i)
                continue
            text = open(out).read().strip()
            if rc != 0 or not text:
                failures.append("worker %d: exit %d: %s" % (i, rc, open(err).read()[-2000:]))
                continue
            s = json.loads(text.splitlines()[-1])
            if s["errors"]:
                failures.append("worker %d: %d errors: %s" % (i, len(s["errors"]),
                                                              s["errors"][:5]))
            summaries.append(s)
        assert not failures, name + ":\n" + "\n".join(failures) + "\n" + self.d.log()[-3000:]
        assert len(summaries) == len(mine) - len(killed)
        assert self.max_leases <= len(mine), "%s: %d leases open at once, %d workers" % (
            name, self.max_leases, len(mine))
        # each generation a worker saw is entirely the merge of the stack the
        # test applied for it (no torn or stale state)
        for s in summaries:
            assert s["fetches"] > 0, "worker %d fetched nothing" % s["index"]
            for g, states in s["gens"].items():
                assert int(g) in self.gen_state, "worker %d saw generation %s" % (s["index"], g)
                assert states == [self.gen_state[int(g)]], \
                    "worker %d: generation %s served states %s, applied %d" % (
                        s["index"], g, states, self.gen_state[int(g)])
        return summaries, killed, t_loop


def test_soak(tmp_path):
    t_start = time.time()
    d = Daemon(extra_args=["--lease-ttl-seconds", str(LEASE_TTL_S)])
    d.start()
    c = soak = None
    try:
        pid = d.proc.pid
        ck, factors = _make_model(d)
        # reference digests of every (world, rank, dtype) under every adapter state
        refs = {}
        for si, stack in enumerate(STATES):
            full = _merged(ck, factors, stack)
            for w, r, dt in _combos():
                dig = _digest(_piece(full, w, r, dt))
                key = "%d,%d,%s" % (w, r, dt)
                assert dig not in refs.setdefault(key, {}), key   # states told apart
                refs[key][dig] = si
        refs_path = str(tmp_path / "refs.json")
        with open(refs_path, "w") as f:
            json.dump(refs, f)

        # the test's own client stays connected throughout (part of the baseline fds)
        c = weightd.Client(socket=d.socket)
        gen_state = {}
        soak = _Soak(d, c, tmp_path, refs_path, gen_state)
        rng = random.Random(99)
        # Warm-up: every request under every state, then WORKERS concurrent
        # clients for WARM_S with 2 kills (the gRPC server's threads,
        # per-thread malloc arenas, the data socket's buffers and the
        # dead-client paths exist after it), then back to the
        # base stack and one fetch of each of its requests (what the cache
        # holds at the baseline).
        for si in (1, 11, 21):
            gen_state[_apply(c, STATES[si])] = si
            _warm(c, refs, si)
        soak.current = 21
        soak.run("warm", WARM_S, 2, 0, rng)
        gen_state[_apply(c, STATES[0])] = 0
        base = _warm_base(c, refs, pid)
        base_fds, base_mem = _fds(pid), _mem(pid)
        base_rss = base_mem["VmRSS"]
        base_fetches = base["fetches"]
        assert base["leases_open"] == 0, base
        soak.current = 0
        gens_before = len(gen_state)

        summaries, killed, t_loop = soak.run("soak", LOOP_S, KILLS, REPLACE, rng)
        assert len(summaries) == WORKERS + REPLACE - KILLS
        seen_states = {gen_state[int(g)] for s in summaries for g in s["gens"]}
        assert len(seen_states) >= 10, seen_states
        worker_fetches = sum(s["fetches"] for s in summaries)
        n_gens = len(gen_state) - gens_before

        # back to the baseline: the base stack, the warm-up's cached requests
        gen_state[_apply(c, STATES[0])] = 0
        _warm_base(c, refs, pid)
        deadline = time.time() + SETTLE_S
        while True:
            s = c.stats()
            fds, mem = _fds(pid), _mem(pid)
            rss = mem["VmRSS"]
            # fds: exactly the baseline. The test's own gRPC connection is
            # part of it; every worker's gRPC and data connections and every
            # dropped segment's memfd must be closed by now.
            ok = (s["leases_open"] == 0 and fds == base_fds
                  and s["bytes_resident"] == base["bytes_resident"])
            if ok or time.time() > deadline:
                break
            time.sleep(0.2)
        report = ("soak: %d workers (+%d replacements), %d kills %s, loop %.1f s, %d worker "
                  "fetches (%d daemon fetches), %d generations; fds %d -> %d, rss %d -> %d "
                  "(%+.2f %%; before %s, after %s), bytes_resident %d -> %d, leases_open %d "
                  "(at most %d during the loop), total %.1f s" % (
                      WORKERS, REPLACE, len(killed), killed, t_loop, worker_fetches,
                      s["fetches"] - base_fetches, n_gens, base_fds, fds, base_rss,
                      rss, 100.0 * (rss - base_rss) / base_rss, base_mem, mem,
                      base["bytes_resident"], s["bytes_resident"], s["leases_open"],
                      soak.max_leases, time.time() - t_start))
        print(report)
        assert s["leases_open"] == 0, report
        assert fds == base_fds, report + "\n" + "\n".join(
            sorted(os.readlink("/proc/%d/fd/%s" % (pid, f))
                   for f in os.listdir("/proc/%d/fd" % pid)))
        assert s["bytes_resident"] == base["bytes_resident"], report
        if "thread" not in SANITIZE:  # TSan's shadow memory grows
            assert rss < base_rss * 1.05, report
        assert s["fetches"] - base_fetches >= worker_fetches
        assert d.alive(), d.log()[-3000:]
        assert c.health()
        assert d.ctl("health").returncode == 0
    finally:
        if soak is not None:
            soak.kill_all()
        if c is not None:
            c.close()
        rc = d.stop()
    assert rc == 0, "daemon exit %s" % rc

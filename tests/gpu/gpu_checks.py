#!/usr/bin/env python3
"""GPU checks of the Python client's device paths against a real weightd
(client/python/weightd/_cuda.py; fetch(device=...)). Run on a lent GPU
machine by tests/gpu/run_on_device.sh:

    python3 tests/gpu/gpu_checks.py --weightd PATH --weightctl PATH --out FILE.json

Without a GPU (torch.cuda.is_available() False) it writes
{"skipped": "no GPU: ..."} and exits 0. With one it starts its own weightd
on temp sockets, writes checkpoints, loads them with weightctl and records
every check as {name, ok, detail, seconds, metrics} in FILE.json (rewritten
after each check, so a run cut short still reports), going on after a
failure:

  setup        checkpoints (torch, random): "mix" ~240 MiB of F32 and BF16
               tensors with odd dims, a 0-dim and an empty tensor, ints and
               bools; "llama" ~1.4 GiB of Llama-shaped BF16. Daemon, loads.
  vmm          the client's CUDA side alone: vmm_alloc, a torch tensor over
               it (no copy), written and read back by torch; the allocation
               lives while a tensor or view of it does, and is freed after.
  a push       fetch(device="cuda:0") for world 1/2/3, every rank, dtype
               keep/bf16/f32 == torch.chunk(t.cuda().to(dtype), W, 0)[r] bit
               for bit (docs/DESIGN.md §2.1, §2.3), every tensor inside the one allocation.
  b pull       mode="pull" (pinned, and pin=False), the same parity on a
               subset; no lease left.
  b' zero-copy mode="zero-copy": the same parity read by kernels from the
               shm mapping in place (pageable access or a mapped read-only
               registration, reported), every tensor inside the page ranges
               the client mapped or registered, read-only; a tensor kept
               after release(). A GPU that can do neither (an x86 H100: both
               attributes 0) refuses with FAILED_PRECONDITION naming them:
               recorded as skipped with that reason (a failure if the
               daemon's driver reports one of them for that GPU).
  b" export    mode="export": the daemon's own device buffer (VMM, filled on
               the GPU), imported read-only, the same parity, every tensor
               inside the import; whether the driver took the read-only
               access or it fell back to read-write is recorded; a repeated
               export reuses the buffer.
  b'" nan      NaN/Inf/-0/subnormal patterns of F32/F64/F16/BF16 cast to
               keep/f32/bf16/f16 by push, export and pull: exact bits vs
               c10's scalar conversions (our convention, PyTorch's CPU per
               element: BF16 NaN 0x7FC0), NaN-ness and all other bits vs
               torch's CUDA .to() (BF16 NaN 0x7FFF); the encodings recorded.
  c lora       a PEFT adapter (peft, save_pretrained) on a Linear-only
               model: `weightctl adapter load` + `apply`, then a CUDA push
               of the merged weights (f32 and bf16; merged on the GPU as the
               daemon pushes, and merged on the CPU and copied) vs peft's
               merge_and_unload() in fp32, with the tolerance of
               tests/parity/test_lora_parity.py (F32: allclose rtol 1e-5,
               atol 1e-6*max|W'|; BF16: <= 1 ulp on <= 0.5% of the
               elements, larger only within the F32 atol); untouched
               tensors bit for bit; a push handle taken before `apply`
               refresh()ed in place equals a fresh push.
  d killed     a client SIGKILLed mid CUDA push of the ~2.8 GiB f32 shard,
               proven by the daemon's side (its "push" debug log line, which
               carries the push's duration, began before the kill and ended
               after it; its push counter is recorded beside; a kill too
               early or too late is retried with another delay, and none
               landing is a failure): the daemon serves on (health, no
               lease left, a new push correct).
  e bandwidth  push of the ~1.4 GiB BF16 shard into GPU memory (keep and
               bf16->f32, cast on the GPU and, for comparison, cast on the
               CPU at fetch; the daemon's copy alone and the whole fetch) vs a
               pinned torch H2D copy of as many bytes (and a pageable one),
               measured in the same run: GB/s and the ratio (goal >= 0.9x,
               reported, never failed on: the checkpoint's segments are
               pinned, the CPU path's cast copies are not), beside the
               daemon's pinned_bytes (stats) and its pin log lines for the
               checkpoint, without which the ratio cannot be read.
  f ready      time to a ready Llama-shaped BF16 shard on the GPU (world 1
               and 2): push vs safetensors.torch.load_file(device="cuda")
               + torch.chunk, same run, the two results compared bit for bit.

The whole run, stopping its daemon included, stays under --budget seconds
(default 280; run_on_device.sh passes what is left of its own): each check
runs under its own limit and what is left (SIGALRM), and one that needs
more than is left is skipped before it starts (Checks.plan). Exit 0 unless
the script itself is broken. When
$OUT/logs exists (run_on_device.sh), logs/gpu_checks.status says how many
checks failed.
"""
import argparse
import calendar
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEMA = "weightd-gpu-checks/1"
ULP_FRACTION = 0.005  # tests/parity/test_lora_parity.py
# Checkpoint sizes: "mix" (its two large tensors, F32 and BF16, odd dims) and
# "llama" (hidden, intermediate, vocab, layers; BF16).
MIX_LARGE = ((4097, 8191), (12289, 4095))  # ~134 MB + ~101 MB
LLAMA_DIMS = (4096, 11008, 32000, 3)        # ~1.48 GB
LORA_TOLERANCE = ("tests/parity/test_lora_parity.py: F32 allclose(rtol=1e-5, "
                  "atol=1e-6*max|W'|); BF16 <= 1 ulp on <= 0.5% of the elements, more "
                  "only within the F32 atol of the fp32 reference")


# ---------------------------------------------------------------- helpers


def chunk_ref(t, world, rank, dtype):
    """docs/DESIGN.md §2.1: torch.chunk(t.to(dtype), world, 0)[rank]; an empty piece
    (its dim 0 sized 0) where torch.chunk returns fewer pieces; 0-dim
    tensors whole; integer and bool tensors keep their dtype."""
    import torch
    table = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
    if dtype not in (None, "keep") and t.is_floating_point():
        t = t.to(table[dtype])
    if t.dim() == 0:
        return t
    chunks = torch.chunk(t, world, 0)
    if rank < len(chunks):
        return chunks[rank]
    return t.narrow(0, t.shape[0], 0)


def same_bits(a, b):
    """Same dtype, shape and bytes (on a's device). The parity checks hold
    torch's CUDA casts (chunk_ref of GPU tensors) to this on NaN-free data:
    NaN encodings differ between conventions (NAN_CONVENTION, the nan
    check)."""
    import torch
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    if a.numel() == 0:
        return True
    b = b.to(a.device)
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def lora_close(got, ref32):
    """(ok, detail): `got` (F32 or BF16/F16) against the fp32 reference with
    the tolerance of tests/parity/test_lora_parity.py."""
    import torch
    ref32 = ref32.to(got.device, torch.float32)
    if tuple(got.shape) != tuple(ref32.shape):
        return False, "shape %s != %s" % (list(got.shape), list(ref32.shape))
    if got.numel() == 0:
        return True, "empty"
    atol = 1e-6 * float(ref32.abs().max())
    g32 = got.float()
    maxdiff = float((g32 - ref32).abs().max())
    if got.dtype == torch.float32:
        ok = bool(torch.allclose(got, ref32, rtol=1e-5, atol=atol))
        return ok, "f32 max|diff| %.3g (atol %.3g, rtol 1e-5)" % (maxdiff, atol)
    want = ref32.to(got.dtype)
    bits = lambda t: t.reshape(-1).view(torch.int16).int()  # noqa: E731
    diff = (bits(got) - bits(want)).abs()
    off = int((diff > 0).sum())
    big = diff > 1
    big &= (g32.reshape(-1) - ref32.reshape(-1)).abs() > atol
    nbig = int(big.sum())
    ok = nbig == 0 and off <= ULP_FRACTION * got.numel()
    return ok, "%s max|diff| %.3g; %d of %d elements off (1 ulp allowed on <= %.1f%%), %d beyond " \
        "1 ulp and the f32 atol" % (str(got.dtype).replace("torch.", ""), maxdiff, off,
                                    got.numel(), ULP_FRACTION * 100, nbig)


class CheckTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise CheckTimeout()


class Recorder:
    """Runs checks one by one, each under a time limit, recording
    {name, ok, detail, seconds, metrics}; writes the document after each.
    A check finishes or is skipped within the budget: one that needs more
    than is left (need_s, its usual time on an H100) is skipped before it
    starts, and each runs under min(its limit, what is left) (SIGALRM; a
    check cut off there is a failure). reserve_s stays for close()."""

    def __init__(self, out, budget_s, doc=None, reserve_s=20.0):
        self.out = out
        self.start = time.monotonic()
        self.budget = float(budget_s)
        self.reserve = reserve_s
        self.doc = doc if doc is not None else {}
        self.checks = self.doc.setdefault("checks", [])

    def left(self):
        return self.budget - (time.monotonic() - self.start)

    def write(self):
        if not self.out:
            return
        self.doc["summary"] = {
            "passed": sum(1 for c in self.checks if c["ok"] is True),
            "failed": sum(1 for c in self.checks if c["ok"] is False),
            "skipped": sum(1 for c in self.checks if c["ok"] is None)}
        self.doc["ok"] = self.doc["summary"]["failed"] == 0 and "error" not in self.doc
        self.doc["elapsed_s"] = round(time.monotonic() - self.start, 1)
        tmp = self.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.doc, f, indent=1, default=str)
        os.replace(tmp, self.out)

    def skip(self, name, why):
        self.checks.append({"name": name, "ok": None, "detail": "skipped: " + why,
                            "seconds": 0.0, "metrics": {}})
        self.write()

    def run(self, name, fn, limit_s, need_s=0.0):
        """fn() -> (ok, detail, metrics); ok None: skipped (detail says
        why). Exceptions and timeouts fail the check; SystemExit /
        KeyboardInterrupt end the run. Skipped without running when less
        than need_s (or 3 s) of the budget is left."""
        left = self.left() - self.reserve
        if left < max(float(need_s), 3.0):
            self.skip(name, "time budget: it needs about %.0f s, %.0f s of the %.0f s budget "
                      "left" % (max(float(need_s), 3.0), max(left, 0.0), self.budget))
            return None
        limit = min(float(limit_s), left)
        rec = {"name": name, "ok": False, "detail": "", "seconds": 0.0, "metrics": {},
               "limit_s": round(limit, 1)}
        t0 = time.monotonic()
        use_alarm = hasattr(signal, "setitimer")
        old = signal.signal(signal.SIGALRM, _alarm) if use_alarm else None
        try:
            if use_alarm:
                signal.setitimer(signal.ITIMER_REAL, limit)
            ok, detail, metrics = fn()
            detail = str(detail)
            if ok is None and not detail.startswith("skipped: "):
                detail = "skipped: " + detail
            rec.update(ok=None if ok is None else bool(ok), detail=detail, metrics=metrics or {})
        except CheckTimeout:
            rec["detail"] = "timed out after %.0f s" % limit
        except Exception as e:
            rec["detail"] = "%s: %s\n%s" % (type(e).__name__, e, traceback.format_exc()[-3000:])
        finally:
            if use_alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, old)
            rec["seconds"] = round(time.monotonic() - t0, 2)
            self.checks.append(rec)
            self.write()
            print("gpu_checks: %-10s %-5s %6.1fs  %s" % (
                name, {True: "PASS", False: "FAIL", None: "SKIP"}[rec["ok"]], rec["seconds"],
                rec["detail"].splitlines()[0][:160] if rec["detail"] else ""), flush=True)
        return rec["ok"]


def _import_weightd():
    try:
        import weightd  # noqa: F401
    except ImportError:
        sys.path.insert(0, os.path.join(REPO, "build", "python"))
        try:
            import weightd  # noqa: F401,F811
        except Exception as e:
            return None, "failed: %s: %s" % (type(e).__name__, e)
    except Exception as e:
        return None, "failed: %s: %s" % (type(e).__name__, e)
    return weightd, "ok: " + weightd.__file__


def _save_safetensors(tensors, path):
    """safetensors.torch.save_file, or an equivalent writer without it."""
    try:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in tensors.items()}, path)
        return
    except ImportError:
        pass
    import torch
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
             torch.float64: "F64", torch.int64: "I64", torch.bool: "BOOL"}
    header, off, blobs = {}, 0, []
    for k, v in tensors.items():
        data = v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if v.numel() else b""
        header[k] = {"dtype": names[v.dtype], "shape": list(v.shape),
                     "data_offsets": [off, off + len(data)]}
        off += len(data)
        blobs.append(data)
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for b in blobs:
            f.write(b)


_LOG_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)')


def _log_time(text):
    """Unix seconds of the daemon's "2025-01-02T03:04:05.678Z", or None."""
    try:
        whole = calendar.timegm(time.strptime(text[:19], "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None
    frac = text[19:].rstrip("Z")
    return whole + (float(frac) if frac.startswith(".") else 0.0)


def log_events(path, events=None, start=0):
    """The daemon's text log (server/base/log.cc: "TS LEVEL EVENT k=v ...") from
    byte `start` as dicts: ts (unix seconds), level, event, line and every
    field (quoted values unquoted); only `events` when given."""
    out = []
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return out
    for line in data.splitlines():
        parts = line.split(" ", 3)
        ts = _log_time(parts[0]) if len(parts) >= 3 else None
        if ts is None or (events and parts[2] not in events):
            continue
        ev = {"ts": ts, "level": parts[1], "event": parts[2], "line": line}
        for k, v in _LOG_FIELD.findall(parts[3] if len(parts) > 3 else ""):
            try:
                ev[k] = json.loads(v) if v.startswith('"') else v
            except ValueError:
                ev[k] = v
        out.append(ev)
    return out


def judge_kill(t_kill, before, at_kill, after, child_done, push_lines, slack=0.002):
    """Whether a client killed at `t_kill` (unix s) died mid-push, from the
    daemon's side. push_lines: the daemon's "push" log events since the
    push was asked for (each logged as the push ends: ts, ms = its
    duration, status); before/at_kill/after: its push counter (stats
    pushes, counted as a push ends OK) then, right after the child died,
    and later. `slack` covers the log's millisecond stamps.
    Returns (verdict, detail): "mid-push" - a push began before the kill and
    ended after it (OK into memory the daemon still maps, or aborted);
    "finished" - it had ended before (or the client saw its reply);
    "after" - it began only after the client died (its request was still
    in flight); "not-begun" - no push at all; "unproven" - a push was
    counted but logged no line to time it."""
    if child_done:
        return "finished", "the client saw the push's reply before it died"
    for ev in push_lines:
        end = ev["ts"]
        begin = end - float(ev.get("ms", 0) or 0) / 1e3
        how = "(status %s; pushes %d before, %d right after the kill, %d later)" % (
            ev.get("status", "?"), before, at_kill, after)
        if end + slack < t_kill:
            return "finished", "the daemon's push ended %.3f s before the kill %s" % (
                t_kill - end, how)
        if begin - slack > t_kill:
            return "after", ("the daemon's push began %.3f s after the client died (its request "
                             "was in flight) %s" % (begin - t_kill, how))
        return "mid-push", ("the daemon's push began %.3f s before the kill and ended %.3f s "
                            "after it %s" % (t_kill - begin, end - t_kill, how))
    if at_kill > before:
        return "finished", "the push was counted before the kill (pushes %d -> %d), no line" % (
            before, at_kill)
    if after > at_kill:
        return "unproven", "a push was counted after the kill, but the daemon logged no push line"
    return "not-begun", "no push began: the client died before its request reached the daemon"


# ---------------------------------------------------------------- NaN sweep

# The NaN convention (README "Casting"): our casts give c10's scalar
# conversions - what PyTorch's CPU gives element by element: F32 -> BF16
# NaN = 0x7FC0 (sign and payload dropped, c10::BFloat16), F32 -> F16 NaN =
# 0x7E00 | sign (c10::Half); wider targets keep x86's NaN (sign, payload,
# quieted). PyTorch's vectorized CPU kernels (BF16 NaN 0xFFFF with AVX2 and
# AVX-512) and its CUDA casts (__float2bfloat16 / __float2half: 0x7FFF) give
# other NaN bits. So the sweep holds exact bits against c10_cast and only
# NaN-ness (plus every non-NaN bit) against torch's own .to() on CPU or CUDA.
NAN_SWEEP_BITS = {
    "F32": [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FC01234, 0x7FFFFFFF, 0xFFFFFFFF,
            0x7FA00000, 0x7F800000, 0xFF800000, 0x00000000, 0x80000000, 0x00000001, 0x807FFFFF,
            0x3F800000, 0x3F808000, 0x3F818000, 0x477FF000, 0x7F7FFFFF, 0x33800000],
    "F64": [0x7FF8000000000000, 0xFFF8000000000000, 0x7FF0000000000001, 0x7FF8DEADBEEF0001,
            0xFFFFFFFFFFFFFFFF, 0x7FF0000000000000, 0xFFF0000000000000, 0x8000000000000000,
            0x0000000000000001, 0x3FF0000000000000, 0x3FF0000010000000, 0x47EFFFFFE0000000],
    "F16": [0x7E00, 0xFE00, 0x7C01, 0xFC01, 0x7E55, 0x7FFF, 0xFFFF, 0x7C00, 0xFC00, 0x8000,
            0x0001, 0x3C00, 0x7BFF, 0x03FF],
    "BF16": [0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7FC5, 0x7FFF, 0xFFFF, 0x7F80, 0xFF80, 0x8000,
             0x0001, 0x3F80, 0x7F7F, 0x007F],
}
NAN_CONVENTION = ("exact bits = c10's scalar conversions (PyTorch CPU element by element: BF16 "
                  "NaN 0x7FC0, F16 NaN 0x7E00|sign); NaN positions and all other bits = torch's "
                  ".to() on CUDA (NaN 0x7FFF) and vectorized on CPU")


def _int_type(nbytes):
    import torch
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[nbytes]


def uint_bits(t):
    """The elements of `t` as unsigned ints of its width (on the CPU)."""
    n = t.element_size()
    mask = (1 << (8 * n)) - 1
    return [v & mask for v in t.detach().cpu().contiguous().view(_int_type(n)).reshape(-1).tolist()]


def from_bits(bits, dtype):
    """A CPU tensor of `dtype` with these bit patterns."""
    import torch
    n = torch.empty(0, dtype=dtype).element_size()
    signed = [b - (1 << (8 * n)) if b >= 1 << (8 * n - 1) else b for b in bits]
    return torch.tensor(signed, dtype=_int_type(n)).view(dtype)


def nan_sweep_tensors(seed=14):
    """{name: CPU tensor}: the NAN_SWEEP_BITS of each float dtype, then
    ordinary values, 1-D, a multiple of 4 elements."""
    import torch
    g = torch.Generator().manual_seed(seed)
    table = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16,
             "BF16": torch.bfloat16}
    out = {}
    for name, bits in NAN_SWEEP_BITS.items():
        special = from_bits(bits, table[name])
        rest = (torch.randn(64 - len(bits), generator=g) * 3).to(table[name])
        out["nan_" + name.lower()] = torch.cat([special, rest])
    return out


def c10_cast(src, dtype):
    """`src` (a CPU tensor) cast to `dtype` as c10's scalar conversions do,
    computed from the bits (numpy's IEEE conversions for the rounding), so
    it does not depend on which CPU kernel torch picks here: F32 -> BF16
    round to nearest even, NaN 0x7FC0; -> F16 IEEE round to nearest even,
    NaN 0x7E00 | sign; F16 -> F32 exact, NaN quieted keeping sign and
    payload; BF16 -> F32 the bits shifted; F64 rounds through F32 first
    (x86's conversion: NaN keeps sign and top payload bits, quieted)."""
    import numpy as np
    with np.errstate(all="ignore"):  # signalling NaNs and overflows are the point
        return _c10_cast(src, dtype)


def _c10_cast(src, dtype):
    import numpy as np
    import torch
    if dtype == src.dtype:
        return src.clone()
    if src.dtype == torch.float64:
        x = src.numpy()
        if dtype == torch.float32:
            return torch.from_numpy(x.astype(np.float32))
        f32 = x.astype(np.float32)
    elif src.dtype == torch.float32:
        f32 = src.numpy().copy()
    elif src.dtype == torch.float16:
        h = np.array(uint_bits(src), dtype=np.uint32)
        f32 = h.astype(np.uint16).view(np.float16).astype(np.float32)
        nan = ((h & 0x7C00) == 0x7C00) & ((h & 0x3FF) != 0)
        f32.view(np.uint32)[nan] = ((h[nan] & 0x8000) << 16) | 0x7FC00000 | ((h[nan] & 0x3FF) << 13)
    elif src.dtype == torch.bfloat16:
        f32 = (np.array(uint_bits(src), dtype=np.uint32) << 16).view(np.float32)
    else:
        raise ValueError("c10_cast: %s" % src.dtype)
    u = f32.view(np.uint32).astype(np.uint64)
    nan = np.isnan(f32)
    if dtype == torch.float32:
        return torch.from_numpy(f32)
    if dtype == torch.float64:
        return torch.from_numpy(f32.astype(np.float64))
    if dtype == torch.bfloat16:
        bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
        bits[nan] = 0x7FC0
    elif dtype == torch.float16:
        bits = f32.astype(np.float16).view(np.uint16).astype(np.uint64)
        bits[nan] = 0x7E00 | ((u[nan] >> 16) & 0x8000)
    else:
        raise ValueError("c10_cast: to %s" % dtype)
    return from_bits([int(b) for b in bits], dtype)


def nan_encodings(t):
    """The NaN bit patterns in `t`, as sorted hex strings."""
    import torch
    isnan = torch.isnan(t.detach().cpu().float() if t.element_size() < 4 else t.detach().cpu())
    bits = uint_bits(t)
    return sorted({"0x%x" % b for b, n in zip(bits, isnan.reshape(-1).tolist()) if n})


def nan_parity(got, exact_ref, loose_ref):
    """(exact, loose, detail): `got` equals `exact_ref` bit for bit; and
    has NaN where `loose_ref` has NaN and its bits everywhere else."""
    import torch
    g, e, l = uint_bits(got), uint_bits(exact_ref), uint_bits(loose_ref)
    gn = torch.isnan(got.detach().cpu().float()).reshape(-1).tolist()
    ln = torch.isnan(loose_ref.detach().cpu().float()).reshape(-1).tolist()
    exact = got.dtype == exact_ref.dtype and g == e
    bad = [i for i in range(len(g)) if gn[i] != ln[i] or (not gn[i] and g[i] != l[i])]
    loose = got.dtype == loose_ref.dtype and len(g) == len(l) and not bad
    diff = [i for i in range(min(len(g), len(e))) if g[i] != e[i]]
    detail = []
    if not exact:
        detail.append("%d elements differ from the exact reference (first: #%d 0x%x != 0x%x)" % (
            len(diff), diff[0], g[diff[0]], e[diff[0]]) if diff else "dtype/size differs")
    if not loose:
        detail.append("%d elements differ in NaN-ness or value from the loose reference%s" % (
            len(bad), " (first: #%d 0x%x vs 0x%x)" % (bad[0], g[bad[0]], l[bad[0]]) if bad else ""))
    return exact, loose, "; ".join(detail) or "ok"


# ---------------------------------------------------------------- the checks


class Checks:
    def __init__(self, args, weightd, torch, doc):
        self.args, self.weightd, self.torch, self.doc = args, weightd, torch, doc
        self.dev = torch.device("cuda", 0)
        self.tmp = tempfile.mkdtemp(prefix="wdgc.", dir="/tmp")  # socket paths stay short
        self.models = os.path.join(self.tmp, "models")
        os.makedirs(self.models)
        self.sock = os.path.join(self.tmp, "w.sock")
        self.log_path = os.path.join(self.tmp, "weightd.log")
        self.proc = None
        self.client = None
        self.mix = {}      # name -> tensor on the GPU (the reference)
        self.llama_path = None
        self.llama_bytes = 0
        self.llama_ref = {}  # a few llama tensors on the GPU

    def plan(self):
        """(name, check, limit s, need s) in the order run. need: about what
        the check takes on an H100 (checkpoints in the page cache); a check
        needing more than the budget has left is skipped, not started, so
        a short budget skips the costly ones at the end."""
        return [("setup", self.setup, 150, 45), ("vmm", self.vmm, 30, 5),
                ("push", self.push_parity, 120, 20), ("pull", self.pull_parity, 60, 10),
                ("zero-copy", self.zero_copy, 30, 8), ("export", self.export, 40, 8),
                ("nan", self.nan_parity, 40, 8), ("lora", self.lora, 90, 20),
                ("killed", self.killed, 90, 30), ("bandwidth", self.bandwidth, 90, 35),
                ("ready", self.ready, 90, 30)]

    # -- plumbing

    def ctl(self, *args, timeout=120):
        r = subprocess.run([self.args.weightctl, "--socket", self.sock] + [str(a) for a in args],
                           capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError("weightctl %s: %s" % (" ".join(map(str, args)),
                                                     (r.stderr or r.stdout).strip()[-800:]))
        return r.stdout

    def leases(self):
        return self.client.stats()["leases_open"]

    def wait_leases(self, want, timeout=10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.leases() != want:
            time.sleep(0.05)
        return self.leases()

    def sync(self):
        self.torch.cuda.synchronize(0)

    def close(self):
        if self.client is not None:
            try:
                self.doc["daemon_stats_at_end"] = self.client.stats()
            except Exception:
                pass
            try:
                self.client.close()
            except Exception:
                pass
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self.doc["daemon_exit"] = self.proc.returncode
            self._log.close()
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - 6000))
                self.doc["daemon_log_tail"] = f.read().decode("utf-8", "replace")
        except OSError:
            pass
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- setup

    def setup(self):
        torch = self.torch
        m = {}
        t0 = time.monotonic()
        g = torch.Generator(device="cuda")
        g.manual_seed(20250101)

        def rand(shape, dtype):
            return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)

        f32, bf16 = torch.float32, torch.bfloat16
        self.mix = {
            "a.weight": rand(MIX_LARGE[0], f32),
            "b.weight": rand(MIX_LARGE[1], bf16),
            "c.weight": rand((7, 3), bf16),
            "d.weight": rand((2, 5), f32),           # fewer rows than ranks at world 3
            "vec": rand((1001,), bf16),
            "scalar": torch.tensor(0.625, device="cuda"),
            "empty": torch.zeros((0, 4), device="cuda"),
            "ids": torch.arange(13, device="cuda", dtype=torch.int64),
            "mask": torch.tensor([True, False, True, True, False], device="cuda"),
        }
        path = os.path.join(self.models, "mix.safetensors")
        _save_safetensors({k: v.cpu() for k, v in self.mix.items()}, path)
        m["mix_bytes"] = sum(v.numel() * v.element_size() for v in self.mix.values())

        hidden, inter, vocab, layers = LLAMA_DIMS
        llama = {"model.embed_tokens.weight": (vocab, hidden)}
        for i in range(layers):
            p = "model.layers.%d." % i
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                llama[p + "self_attn.%s.weight" % name] = (hidden, hidden)
            llama[p + "mlp.gate_proj.weight"] = (inter, hidden)
            llama[p + "mlp.up_proj.weight"] = (inter, hidden)
            llama[p + "mlp.down_proj.weight"] = (hidden, inter)
            llama[p + "input_layernorm.weight"] = (hidden,)
            llama[p + "post_attention_layernorm.weight"] = (hidden,)
        llama["model.norm.weight"] = (hidden,)
        cpu = {}
        for k, shape in llama.items():
            t = rand(shape, bf16)
            if k in ("model.norm.weight", "model.layers.0.self_attn.v_proj.weight"):
                self.llama_ref[k] = t
            cpu[k] = t.cpu()
            del t
        self.llama_path = os.path.join(self.models, "llama.safetensors")
        _save_safetensors(cpu, self.llama_path)
        self.llama_bytes = sum(v.numel() * v.element_size() for v in cpu.values())
        del cpu
        m["llama_bytes"] = self.llama_bytes
        m["checkpoints_s"] = round(time.monotonic() - t0, 2)

        t0 = time.monotonic()
        self._log = open(self.log_path, "ab")
        # debug: the "push" line of every push (the killed check reads it)
        self.proc = subprocess.Popen([self.args.weightd, "--socket", self.sock, "--model-root",
                                      self.models, "--log-level", "debug"],
                                     stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("weightd exited with %s at start" % self.proc.returncode)
            if os.path.exists(self.sock) and subprocess.run(
                    [self.args.weightctl, "--socket", self.sock, "health"],
                    capture_output=True, timeout=30).returncode == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("weightd not healthy after 60 s")
            time.sleep(0.1)
        m["daemon_start_s"] = round(time.monotonic() - t0, 2)
        try:
            self.doc["daemon_gpus"] = self.ctl("gpus", timeout=30).strip()
        except Exception as e:
            self.doc["daemon_gpus"] = "weightctl gpus failed: %s" % e
        self.client = self.weightd.Client(socket=self.sock, retry_deadline=5)
        st = self.client.stats()
        m["cuda_built"] = bool(st.get("cuda_built"))
        m["daemon_gpus"] = [gpu.uuid for gpu in st["gpus"]] if "gpus" in st else None
        m["gpus_unavailable"] = st.get("gpus_unavailable", "")
        # what the daemon's driver reports of each GPU (zero-copy and the
        # checkpoint pinning depend on the last two)
        m["daemon_gpu_attributes"] = {
            gpu.uuid: {"name": gpu.name, "pageable_memory_access": gpu.pageable_memory_access,
                       "host_register": gpu.host_register,
                       "host_register_read_only": gpu.host_register_read_only}
            for gpu in st.get("gpus", [])}
        from weightd import _cuda
        m["client_gpu_uuid"] = _cuda.format_gpu_uuid(_cuda.gpu_uuid_bytes(0))
        self.doc["setup_gpu"] = m["daemon_gpu_attributes"].get(m["client_gpu_uuid"], {})
        t0 = time.monotonic()
        self.ctl("load", "mix", path)
        m["load_mix_s"] = round(time.monotonic() - t0, 2)
        t0 = time.monotonic()
        self.ctl("load", "llama", self.llama_path, timeout=180)
        m["load_llama_s"] = round(time.monotonic() - t0, 2)
        ok = m["cuda_built"] and bool(m["daemon_gpus"]) and \
            m["client_gpu_uuid"] in (m["daemon_gpus"] or [])
        detail = "daemon cuda_built=%s gpus=%s%s; client GPU %s" % (
            m["cuda_built"], m["daemon_gpus"],
            " (%s)" % m["gpus_unavailable"] if m["gpus_unavailable"] else "",
            m["client_gpu_uuid"])
        return ok, detail, m

    # -- the client's VMM allocation and tensors, without the daemon

    def vmm(self):
        import gc
        import weakref
        torch = self.torch
        from weightd import _cuda
        a = _cuda.vmm_alloc(0, 3 << 20)
        m = {"ptr": hex(a.ptr), "size": a.size, "granularity": a.granularity}
        fails = []
        if a.size % a.granularity or a.size < 3 << 20 or a.fd < 0:
            fails.append("size %d, granularity %d, fd %d" % (a.size, a.granularity, a.fd))
        t = _cuda.tensor_from_ptr(a.ptr, a.size, torch.float32, (a.size // 4,), 0, a)
        if t.data_ptr() != a.ptr or t.device != self.dev:
            fails.append("tensor at 0x%x on %s" % (t.data_ptr(), t.device))
        t.fill_(1.5)
        b = _cuda.view_bytes(t.view(torch.uint8), 256, 512, torch.bfloat16, (16, 16))
        b.fill_(-2.0)
        self.sync()
        # floats [0, 64) and [192, n) untouched; bytes [256, 768) the bf16 view
        n = a.size // 4
        got = (float(t[:64].double().sum()), float(t[192:].double().sum()),
               bool((b == -2.0).all()), b.data_ptr() - a.ptr)
        if got != (1.5 * 64, 1.5 * (n - 192), True, 256):
            fails.append("read back %r, want %r" % (got, (1.5 * 64, 1.5 * (n - 192), True, 256)))
        a.close_fd()
        ref = weakref.ref(a)
        del a, b
        gc.collect()
        view = t[10:20]
        del t
        gc.collect()
        if ref() is None or ref().freed:
            fails.append("the allocation was freed under a live view")
        if float(view.sum()) != 15.0:
            fails.append("the view reads %r" % float(view.sum()))
        del view
        gc.collect()
        if ref() is not None:
            fails.append("the allocation outlived its last tensor")
        return not fails, ("alloc %d bytes (granularity %d), tensor in place, freed with its "
                           "last view" % (m["size"], m["granularity"])
                           if not fails else "; ".join(fails)), m

    # -- a / b: parity

    def _compare(self, h, world, rank, dtype, fails, inside=True):
        torch = self.torch
        sd = h.state_dict()
        ranges = h._segment_ranges() if inside else []
        for name, t in self.mix.items():
            want = chunk_ref(t, world, rank, dtype)
            got = sd.get(name)
            what = "W%d r%d %s %s" % (world, rank, dtype, name)
            if got is None:
                fails.append(what + ": missing")
                continue
            if got.device != self.dev:
                fails.append(what + ": on %s" % got.device)
                continue
            if not same_bits(got, want):
                if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
                    fails.append(what + ": %s %s, want %s %s" % (
                        got.dtype, list(got.shape), want.dtype, list(want.shape)))
                else:
                    nb = int((got.reshape(-1).view(torch.uint8) !=
                              want.reshape(-1).view(torch.uint8)).sum())
                    fails.append(what + ": %d bytes differ" % nb)
                continue
            if inside and got.numel():
                p, n = got.data_ptr(), got.numel() * got.element_size()
                if not any(lo <= p and p + n <= hi for lo, hi in ranges):
                    fails.append(what + ": not inside the push's allocation")
        del sd

    def push_parity(self):
        fails, n, pushed = [], 0, 0
        base = self.leases()
        for world in (1, 2, 3):
            for rank in range(world):
                for dtype in ("keep", "bf16", "f32"):
                    h = self.client.fetch("mix", world=world, rank=rank, device="cuda:0",
                                          dtype=None if dtype == "keep" else dtype)
                    try:
                        if (h.mode, h.device) != ("push", "cuda:0") or \
                                len(h._segment_ranges()) != 1:
                            fails.append("W%d r%d %s: handle %r" % (world, rank, dtype, h))
                        pushed += h.nbytes
                        self._compare(h, world, rank, dtype, fails)
                    finally:
                        h.release()
                    n += 1
        self.torch.cuda.empty_cache()
        if self.wait_leases(base) != base:
            fails.append("leases_open %d after the pushes, %d before" % (self.leases(), base))
        return not fails, ("%d pushes x %d tensors bit-exact (%.0f MiB pushed)"
                           % (n, len(self.mix), pushed / 2**20) if not fails
                           else "; ".join(fails[:12])), {"pushes": n, "failures": len(fails)}

    def pull_parity(self):
        fails, n, pinned = [], 0, []
        base = self.leases()
        for world, rank, dtype, pin in ((1, 0, "keep", True), (3, 2, "bf16", True),
                                        (3, 0, "f32", True), (2, 1, "keep", False)):
            h = self.client.fetch("mix", world=world, rank=rank, device="cuda:0", mode="pull",
                                  dtype=None if dtype == "keep" else dtype, pin=pin)
            try:
                if (h.mode, h.device) != ("pull", "cuda:0"):
                    fails.append("W%d r%d: handle %r" % (world, rank, h))
                pinned.append({"pin": pin, "pinned": h.pinned, "pin_error": h.pin_error})
                self._compare(h, world, rank, dtype, fails, inside=False)
            finally:
                h.release()
            n += 1
        if self.wait_leases(base) != base:
            fails.append("leases_open %d after the pulls, %d before" % (self.leases(), base))
        note = ""
        if pinned[0]["pinned"] is not True:
            # A device without read-only registration is a fact to report;
            # any other refusal is a bug of the client's (flags, ranges).
            note = " NOT PINNED: %s" % pinned[0]["pin_error"]
            if "cannot register read-only host memory" not in pinned[0]["pin_error"]:
                fails.append("the pinned pull did not pin: %s" % pinned[0]["pin_error"])
        return not fails, ("%d pulls bit-exact; pinned: %s%s" % (
            n, [p["pinned"] for p in pinned], note) if not fails else "; ".join(fails[:12])), \
            {"pulls": pinned}

    def zero_copy(self):
        """mode="zero-copy": CUDA tensors over the shm mapping, read by the
        GPU in place (at the host address where the device reads pageable
        memory, else through a mapped read-only registration): the same
        parity, read by kernels, every tensor inside the page ranges the
        client mapped or registered (handle._segment_ranges: host addresses
        or the registrations' device addresses), read-only; a tensor kept
        after release() still reads right; no lease left. A device that can
        do neither (x86 discrete GPU: both attributes 0) refuses with
        FAILED_PRECONDITION naming them: recorded as skipped with that
        reason, unless the daemon's driver reports one of them for this GPU
        (then the refusal is wrong: a failure)."""
        torch = self.torch
        fails, m = [], {}
        base = self.leases()
        kept = None
        attrs = (self.doc.get("setup_gpu") or {})
        m["daemon_reports"] = attrs
        for world, rank, dtype in ((1, 0, "keep"), (3, 2, "bf16"), (2, 1, "f32")):
            try:
                h = self.client.fetch("mix", world=world, rank=rank, device="cuda:0",
                                      mode="zero-copy", dtype=None if dtype == "keep" else dtype)
            except self.weightd.Error as e:
                if kept is None and e.code == "FAILED_PRECONDITION" and \
                        "CU_DEVICE_ATTRIBUTE_" in e.message:
                    m["refused"] = e.message
                    if self.wait_leases(base) != base:
                        return False, "refused, but a lease was left: %s" % e.message, m
                    # refused up front although the daemon's driver reports a
                    # way (a torch that takes no host address, with no
                    # read-only registration to fall back on, is refused
                    # only after trying: a fact of this machine, a skip)
                    if "torch took no tensor" not in e.message and (
                            attrs.get("pageable_memory_access") or
                            attrs.get("host_register_read_only")):
                        return False, ("refused (%s), yet the daemon's driver reports %s for this "
                                       "GPU" % (e.message, attrs)), m
                    return None, "this GPU cannot read host pages in place: " + e.message, m
                raise
            try:
                if (h.mode, h.device) != ("zero-copy", "cuda:0"):
                    fails.append("W%d r%d: handle %r" % (world, rank, h))
                if (h.read_only, h.access) != (True, "read-only"):
                    fails.append("W%d r%d: read_only %r access %r" % (world, rank, h.read_only,
                                                                     h.access))
                m["pageable_access"] = h.pageable_access
                m.setdefault("ranges", []).append(
                    ["0x%x-0x%x" % r for r in h._segment_ranges()])
                self._compare(h, world, rank, dtype, fails, inside=True)
                if kept is None:
                    name = max(self.mix, key=lambda k: self.mix[k].numel())
                    kept = (h[name], chunk_ref(self.mix[name], world, rank, dtype), name)
            finally:
                h.release()
        t, want, name = kept
        if not same_bits(t.clone(), want):
            fails.append("%s kept after release() reads wrong" % name)
        t0 = time.monotonic()
        total = float(t.float().sum())  # a kernel reading every byte in place
        self.sync()
        m["read_in_place_GBps"] = round(t.numel() * t.element_size() /
                                        max(time.monotonic() - t0, 1e-9) / 1e9, 2)
        m["checksum"] = total
        del t, kept
        if self.wait_leases(base) != base:
            fails.append("leases_open %d after zero-copy, %d before" % (self.leases(), base))
        return not fails, ("3 zero-copy fetches bit-exact, every tensor inside the %s, read in "
                           "place (%.1f GB/s)" % (
                               "host pages it mapped (pageable access)" if m.get("pageable_access")
                               else "read-only mapped registration", m["read_in_place_GBps"])
                           if not fails else "; ".join(fails[:12])), m

    def export(self):
        """mode="export": the daemon's own device buffer (cuMemCreate, filled
        with casts on the GPU), imported read-only: the same parity, every
        tensor inside the imported range; whether the driver took the
        read-only access (CU_MEM_ACCESS_FLAGS_PROT_READ) or the import fell
        back to read-write is recorded (metrics.access; read-write is
        reported, not failed: the tensors are then writable views of a
        buffer others share); a second export of the same fetch reuses the
        daemon's buffer (the daemon logs filled=no); no lease left after
        release()."""
        fails, m = [], {"fills": [], "access": [], "ranges": []}
        base = self.leases()
        for world, rank, dtype in ((1, 0, "keep"), (3, 2, "bf16"), (2, 1, "f32"), (2, 1, "f32")):
            h = self.client.fetch("mix", world=world, rank=rank, device="cuda:0", mode="export",
                                  dtype=None if dtype == "keep" else dtype)
            try:
                if (h.mode, h.device, h.read_only) != ("export", "cuda:0", True):
                    fails.append("W%d r%d: handle %r" % (world, rank, h))
                m["access"].append(h.access)
                if h.access_error:
                    m["access_error"] = h.access_error
                m["ranges"].append(["0x%x-0x%x" % r for r in h._segment_ranges()])
                if len(h._segment_ranges()) != 1:
                    fails.append("W%d r%d: %d imported ranges" % (world, rank,
                                                                 len(h._segment_ranges())))
                self._compare(h, world, rank, dtype, fails, inside=True)
            finally:
                h.release()
        if self.wait_leases(base) != base:
            fails.append("leases_open %d after the exports, %d before" % (self.leases(), base))
        try:
            with open(self.log_path) as f:
                m["fills"] = [l.strip()[-200:] for l in f if "export" in l and "filled" in l][-4:]
        except OSError as e:
            fails.append("reading the daemon's log: %s" % e)
        if len(m["fills"]) < 4 or "cached" not in m["fills"][-1]:
            fails.append("the repeated export was not served from the daemon's buffer: %s"
                         % m["fills"][-1:])
        access = sorted(set(m["access"]))
        return not fails, ("4 exports bit-exact, inside the imported range, mapped %s%s (the last "
                           "one of a buffer already filled)" % (
                               "/".join(access), "" if access == ["read-only"] else
                               " (NOT read-only: %s)" % m.get("access_error", "?"))
                           if not fails else "; ".join(fails[:12])), m

    # -- NaN encodings

    def nan_parity(self):
        """The NaN sweep (NAN_SWEEP_BITS: NaNs with signs and payloads,
        signalling ones, +-Inf, -0, subnormals, ties, then ordinary values)
        of F32/F64/F16/BF16 cast to keep/f32/bf16/f16 by the push (GPU
        casts), the export (GPU fill) and the pull (the CPU's cast, copied):
        exact bits against c10_cast (our convention), NaN-ness and all other
        bits against torch's CUDA .to(); the NaN encodings each gives are
        recorded per cast."""
        torch = self.torch
        tensors = nan_sweep_tensors()
        path = os.path.join(self.models, "nans.safetensors")
        _save_safetensors(tensors, path)
        self.ctl("load", "nans", path)
        table = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
        fails, m = [], {"convention": NAN_CONVENTION, "encodings": {}}
        base = self.leases()
        n = 0
        for mode in ("push", "export", "pull"):
            for dtype in ("keep", "f32", "bf16", "f16"):
                h = self.client.fetch("nans", device="cuda:0", mode=mode,
                                      dtype=None if dtype == "keep" else dtype)
                try:
                    for name, src in tensors.items():
                        target = src.dtype if dtype == "keep" else table[dtype]
                        got = h[name].cpu()
                        exact_ref = c10_cast(src, target)
                        cuda_ref = src.to(self.dev).to(target).cpu()
                        exact, loose, detail = nan_parity(got, exact_ref, cuda_ref)
                        what = "%s %s -> %s" % (mode, name, str(target).replace("torch.", ""))
                        if not (exact and loose):
                            fails.append("%s: %s" % (what, detail))
                        key = "%s -> %s" % (str(src.dtype).replace("torch.", ""),
                                            str(target).replace("torch.", ""))
                        if mode == "push" and key not in m["encodings"]:
                            m["encodings"][key] = {
                                "ours_gpu_push": nan_encodings(got),
                                "c10": nan_encodings(exact_ref),
                                "torch_cuda": nan_encodings(cuda_ref),
                                "torch_cpu": nan_encodings(src.to(target))}
                        n += 1
                finally:
                    h.release()
        if self.wait_leases(base) != base:
            fails.append("leases_open %d after the sweep, %d before" % (self.leases(), base))
        bf16 = m["encodings"].get("float32 -> bfloat16", {})
        return not fails, ("%d casts of NaN/Inf/-0/subnormal patterns: %s. F32->BF16 NaN: ours %s, "
                           "torch CUDA %s, torch CPU vectorized %s" % (
                               n, NAN_CONVENTION, bf16.get("ours_gpu_push"),
                               bf16.get("torch_cuda"), bf16.get("torch_cpu"))
                           if not fails else "; ".join(fails[:10])), m

    # -- c: LoRA

    def lora(self):
        torch = self.torch
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError as e:
            return False, "peft not installed: %s" % e, {}
        torch.backends.cuda.matmul.allow_tf32 = False
        nn = torch.nn
        hidden, layers = 256, 2

        class Attn(nn.Module):
            def __init__(self):
                super().__init__()
                for name, out in (("q_proj", hidden), ("k_proj", hidden // 2),
                                  ("v_proj", hidden // 2), ("o_proj", hidden)):
                    setattr(self, name, nn.Linear(hidden, out, bias=False))

        class Layer(nn.Module):
            def __init__(self):
                super().__init__()
                self.self_attn = Attn()

        class Inner(nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = nn.ModuleList([Layer() for _ in range(layers)])

        class Tiny(nn.Module):
            def __init__(self):
                super().__init__()
                self.model = Inner()

            def forward(self, x):
                for layer in self.model.layers:
                    a = layer.self_attn
                    x = a.o_proj(torch.cat([a.q_proj(x)[..., :hidden // 2], a.v_proj(x)], -1))
                return x

        torch.manual_seed(4242)
        model = Tiny()
        with torch.no_grad():
            for p in model.parameters():
                p.copy_((p * 4).to(torch.bfloat16).float())  # bf16-exact fp32 values
        base16 = {k: v.detach().to(torch.bfloat16).contiguous()
                  for k, v in model.state_dict().items()}
        path = os.path.join(self.models, "lora.safetensors")
        _save_safetensors(base16, path)
        self.ctl("load", "lora", path)
        targets = sorted(k for k in base16 if ".q_proj." in k or ".v_proj." in k)
        fails, m = [], {"tolerance": LORA_TOLERANCE}

        h0 = self.client.fetch("lora", device="cuda:0")  # before apply: refreshed below
        before = h0.state_dict()
        for k, v in base16.items():
            if not same_bits(before[k], v):
                fails.append("base push %s differs from the checkpoint" % k)

        cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                         lora_dropout=0.0, bias="none")
        pm = get_peft_model(model, cfg)
        g = torch.Generator().manual_seed(77)
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_A" in n or "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        adir = os.path.join(self.models, "adapter_peft")
        pm.save_pretrained(adir, safe_serialization=True)
        m["adapter_files"] = sorted(os.listdir(adir))
        try:
            self.ctl("adapter", "load", "a", adir)
        except RuntimeError as e:
            fails.append("weightctl adapter load of peft's save_pretrained output: %s" % e)
            # Go on with the minimal config the test suites write, to still
            # check the merge.
            from safetensors.torch import load_file
            adir2 = os.path.join(self.models, "adapter_min")
            os.makedirs(adir2)
            with open(os.path.join(adir2, "adapter_config.json"), "w") as f:
                json.dump({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                           "target_modules": ["q_proj", "v_proj"]}, f)
            _save_safetensors(load_file(os.path.join(adir, "adapter_model.safetensors")),
                              os.path.join(adir2, "adapter_model.safetensors"))
            self.ctl("adapter", "load", "a", adir2)
        gen0 = h0.generation
        self.ctl("apply", "lora", "a")
        gen1 = self.client.info("lora").generation
        m["generations"] = [gen0, gen1]

        merged = pm.to(self.dev).merge_and_unload()
        ref32 = {k: v.detach().float() for k, v in merged.state_dict().items()}
        if sorted(ref32) != sorted(base16):
            fails.append("peft's merged names %s != the checkpoint's" % sorted(ref32)[:4])
        details = {}
        fresh = {}
        # Merged on the GPU as the daemon pushes (the default into a GPU),
        # then merged on the CPU by the materializer and copied.
        for where, dtype in (("gpu", "f32"), ("gpu", "keep"), ("cpu", "f32"), ("cpu", "keep")):
            h = self.client.fetch("lora", device="cuda:0", dtype=None if dtype == "keep" else dtype,
                                  merge_on_push=(where == "gpu"))
            label = dtype if where == "gpu" else dtype + " (CPU merge)"
            try:
                sd = h.state_dict()
                worst = ""
                for k in base16:
                    got = sd[k]
                    if k in targets:
                        ok, d = lora_close(got, ref32[k])
                        worst = d if not worst or not ok else worst
                        details["%s %s" % (label, k)] = d
                        if not ok:
                            fails.append("%s %s: %s" % (label, k, d))
                    else:
                        want = base16[k].float() if dtype == "f32" else base16[k]
                        if not same_bits(got, want):
                            fails.append("%s %s: an untouched tensor changed" % (label, k))
                if dtype == "keep" and where == "gpu":
                    fresh = {k: sd[k].clone() for k in base16}
                m["max_abs_diff_" + dtype + ("" if where == "gpu" else "_cpu_merge")] = max(
                    float((sd[k].float() - ref32[k]).abs().max()) for k in targets)
                del sd
            finally:
                h.release()
        m["per_tensor"] = details
        # The handle pushed before `apply`, refreshed in place.
        names = h0.refresh()
        if sorted(names) != targets:
            fails.append("refresh() rewrote %s, want %s" % (sorted(names), targets))
        if h0.generation != gen1:
            fails.append("refreshed handle at generation %d, want %d" % (h0.generation, gen1))
        for k in base16:
            if not same_bits(before[k], fresh[k]):
                fails.append("refreshed %s (a view taken before) != a fresh push" % k)
        h0.release()
        del before
        return not fails, ("peft merge parity, merged on the GPU: max|diff| f32 %.3g, bf16 %.3g "
                           "(on the CPU: %.3g, %.3g) (%s); refresh in place == fresh push" % (
                               m["max_abs_diff_f32"], m["max_abs_diff_keep"],
                               m["max_abs_diff_f32_cpu_merge"], m["max_abs_diff_keep_cpu_merge"],
                               LORA_TOLERANCE)
                           if not fails else "; ".join(fails[:10])), m

    # -- d: a client killed mid-push

    # The child says "pushing" (with its clock) right before the CUDA push
    # request goes out; the parent kills it some time later. Whether that
    # was mid-push is decided by the daemon's side (judge_kill): its push
    # counter had not moved at the kill, and its "push" log line (debug,
    # logged as the push ends, with its duration) began before the kill and
    # ended after it. A kill that came too late (the push had finished) or
    # too early (no push had begun) is retried with another delay.
    CHILD = r"""
import sys, time, weightd
sock, model, device, dtype = sys.argv[1:5]
if device == "cpu":   # a host push (the CPU test of this check)
    from weightd import _datasock as mod
    name, kwargs = "push", {"mode": "push"}
else:
    import torch
    from weightd import _cuda as mod
    torch.zeros(1, device=device)
    name, kwargs = "push_cuda", {"device": device}
c = weightd.Client(socket=sock, retry_deadline=0)
push = getattr(mod, name)
def pushing(*args, **kw):
    print("pushing %.6f" % time.time(), flush=True)
    return push(*args, **kw)
setattr(mod, name, pushing)
print("ready", flush=True)
sys.stdin.readline()
h = c.fetch(model, dtype=dtype, **kwargs)
print("done", flush=True)
time.sleep(120)
"""

    def _pushes(self):
        return int(self.client.stats().get("pushes", 0))

    def _push_lines(self, memory, start):
        return [e for e in log_events(self.log_path, ("push",), start=start)
                if e.get("memory") == memory]

    def _kill_once(self, model, device, dtype, delay, m):
        """One child pushing `model` into `device` ("cpu": host memory),
        killed `delay` s after it said "pushing". Returns judge_kill's
        (verdict, detail)."""
        memory = "host" if device == "cpu" else "cuda"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.dirname(os.path.dirname(self.weightd.__file__))] +
            [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        child = subprocess.Popen([sys.executable, "-c", self.CHILD, self.sock, model, device,
                                  dtype], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env)
        try:
            line = child.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError("child did not start: %s %s" % (line, child.stderr.read()[-1500:]))
            before = self._pushes()
            log_from = os.path.getsize(self.log_path)
            child.stdin.write("\n")
            child.stdin.flush()
            line = child.stdout.readline()
            if not line.startswith("pushing"):
                raise RuntimeError("child: %s %s" % (line, child.stderr.read()[-1500:]))
            time.sleep(delay)
            t_kill = time.time()
            child.kill()
            child.wait(timeout=30)
            at_kill = self._pushes()
            done = "done" in child.stdout.read()
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        # the push the child asked for ends (completed into memory the daemon
        # still holds, or aborted) and is logged: wait for its line
        deadline = time.monotonic() + 20
        while True:
            lines = self._push_lines(memory, log_from)
            if lines or done or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        after = self._pushes()
        verdict, detail = judge_kill(t_kill, before, at_kill, after, done, lines)
        m.setdefault("attempts", []).append({
            "delay_s": round(delay, 3), "verdict": verdict, "detail": detail,
            "pushes": [before, at_kill, after], "push_lines": [e["line"][-300:] for e in lines]})
        return verdict, detail

    def kill_mid_push(self, model, device, dtype, tries=5):
        """Kills a client pushing `model` (`dtype`) into `device` until a
        kill lands mid-push (judge_kill), at most `tries` times: a first
        push (its log line's duration sets the first delay), then kills
        sooner after a "finished" and later after a kill that came before
        the push. Returns (verdict of the last try, its detail, metrics)."""
        m = {}
        memory = "host" if device == "cpu" else "cuda"
        log_from = os.path.getsize(self.log_path)
        h = self.client.fetch(model, dtype=dtype,
                              **({"mode": "push"} if device == "cpu" else {"device": device}))
        if device != "cpu":
            self.sync()
        m["bytes"] = h.nbytes
        h.release()
        del h
        warm = self._push_lines(memory, log_from)
        if not warm:
            return "unproven", ("the daemon logged no \"push\" line (--log-level debug): a "
                                "kill cannot be timed against it"), m
        push_s = max(float(warm[-1].get("ms", 0) or 0) / 1e3, 0.01)
        m["push_s"] = push_s
        delay, verdict, detail = 0.5 * push_s, "", ""
        for _ in range(tries):
            verdict, detail = self._kill_once(model, device, dtype, delay, m)
            if verdict == "mid-push":
                break
            delay = delay * 0.4 if verdict == "finished" else delay + 0.5 * push_s
        return verdict, detail, m

    def killed(self):
        base = self.leases()
        verdict, detail, m = self.kill_mid_push("llama", "cuda:0", "f32")
        self.torch.cuda.empty_cache()
        fails = [] if verdict == "mid-push" else [
            "no kill landed mid-push in %d tries (last: %s: %s)" % (
                len(m.get("attempts", [])), verdict, detail)]
        if self.proc.poll() is not None:
            return False, "weightd died (exit %s)" % self.proc.returncode, m
        if self.client.health() is not True:
            fails.append("not healthy")
        left = self.wait_leases(base, timeout=30)
        if left != base:
            fails.append("leases_open %d, %d before" % (left, base))
        h = self.client.fetch("llama", world=2, rank=1, device="cuda:0")
        try:
            sd = h.state_dict()
            for k, t in self.llama_ref.items():
                if not same_bits(sd[k], chunk_ref(t, 2, 1, None)):
                    fails.append("the push after the kill: %s differs" % k)
            del sd
        finally:
            h.release()
        return not fails, ("killed mid-push (try %d: %s); the daemon serves, no lease left, a "
                           "new push is right" % (len(m["attempts"]), detail)
                           if not fails else "; ".join(fails)), m

    # -- e: bandwidth

    def bandwidth(self):
        torch = self.torch
        from weightd import _cuda, _datasock
        from weightd.v1 import weightd_pb2 as pb
        m = {}
        nbytes = self.llama_bytes
        reps = 3

        def best(times):
            return min(times), sorted(times)[len(times) // 2]

        def fetch_times(dtype):
            h = self.client.fetch("llama", device="cuda:0", dtype=dtype)  # warm (materialize)
            out_bytes = h.nbytes
            h.release()
            del h
            ts = []
            for _ in range(reps):
                t0 = time.monotonic()
                h = self.client.fetch("llama", device="cuda:0", dtype=dtype)
                self.sync()
                ts.append(time.monotonic() - t0)
                h.release()
                del h
            return out_bytes, ts

        def push_only_times(dtype, defer=True):
            """The daemon's part alone: Fetch, then time push_cuda into an
            allocation made beforehand. `defer`: casts on the GPU as the
            push writes (defer_casts, the clients' default); else the
            fetch casts on the CPU (cached) and the push copies."""
            dt = self.weightd._dtypes
            ts, alloc_ts = [], []
            for _ in range(reps):
                resp = self.client._shards.Fetch(pb.FetchRequest(
                    model="llama", mesh_shape=[1], coord=[0], transport=pb.SHM,
                    dtype=dt.enum_of_name(dt.parse_request_dtype(dtype)) if dtype
                    else pb.DTYPE_UNSPECIFIED, defer_casts=defer), timeout=60)
                _, size = _datasock.default_layout([t.length for t in resp.tensors])
                t0 = time.monotonic()
                try:
                    alloc = _cuda.vmm_alloc(0, size)
                except BaseException:
                    self.client._shards.Release(pb.ReleaseRequest(
                        lease_id=resp.lease_id, token=resp.token), timeout=10)
                    raise
                alloc_ts.append(time.monotonic() - t0)
                try:
                    t0 = time.monotonic()
                    _cuda.push_cuda(resp.data_socket, resp.lease_id, bytes(resp.token), alloc.fd,
                                    _cuda.gpu_uuid_bytes(0), alloc.size, None, timeout=120)
                    ts.append(time.monotonic() - t0)
                finally:
                    alloc.free()
            return ts, alloc_ts

        def h2d_times(pinned):
            src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            src.fill_(7)
            dst = torch.empty(nbytes, dtype=torch.uint8, device=self.dev)
            dst.copy_(src, non_blocking=True)  # warm
            self.sync()
            ts = []
            for _ in range(reps):
                t0 = time.monotonic()
                dst.copy_(src, non_blocking=True)
                self.sync()
                ts.append(time.monotonic() - t0)
            del src, dst
            torch.cuda.empty_cache()
            return ts

        gbs = lambda n, t: n / t / 1e9  # noqa: E731
        out_keep, t_keep = fetch_times(None)
        out_f32, t_f32 = fetch_times("f32")
        p_keep, a_keep = push_only_times(None)
        p_f32, a_f32 = push_only_times("f32")
        p_f32_cpu, _ = push_only_times("f32", defer=False)
        t_pinned = h2d_times(True)
        t_pageable = h2d_times(False)
        m["bytes_in"] = nbytes
        m["bytes_out_keep"], m["bytes_out_f32"] = out_keep, out_f32
        m["pinned_h2d_GBps"] = round(gbs(nbytes, best(t_pinned)[0]), 2)
        m["pageable_h2d_GBps"] = round(gbs(nbytes, best(t_pageable)[0]), 2)
        m["push_only_keep_GBps"] = round(gbs(out_keep, best(p_keep)[0]), 2)
        m["push_only_f32_GBps_out"] = round(gbs(out_f32, best(p_f32)[0]), 2)
        m["push_only_f32_GBps_in"] = round(gbs(nbytes, best(p_f32)[0]), 2)
        # the same push with the cast made on the CPU at fetch (cached)
        m["push_only_f32_cpu_cast_GBps_out"] = round(gbs(out_f32, best(p_f32_cpu)[0]), 2)
        m["fetch_keep_GBps"] = round(gbs(out_keep, best(t_keep)[0]), 2)
        m["fetch_f32_GBps_out"] = round(gbs(out_f32, best(t_f32)[0]), 2)
        m["vmm_alloc_keep_s"] = round(min(a_keep), 4)
        m["vmm_alloc_f32_s"] = round(min(a_f32), 4)
        m["ratio_push_only_keep_vs_pinned"] = round(m["push_only_keep_GBps"] /
                                                    m["pinned_h2d_GBps"], 3)
        m["ratio_fetch_keep_vs_pinned"] = round(m["fetch_keep_GBps"] / m["pinned_h2d_GBps"], 3)
        m["ratio_push_only_f32_in_vs_pinned"] = round(m["push_only_f32_GBps_in"] /
                                                      m["pinned_h2d_GBps"], 3)
        m["times_s"] = {"fetch_keep": t_keep, "fetch_f32": t_f32, "push_keep": p_keep,
                        "push_f32": p_f32, "push_f32_cpu_cast": p_f32_cpu,
                        "pinned": t_pinned, "pageable": t_pageable}
        m["goal"] = (">= 0.9x pinned (reported only; checkpoint segments are pinned with "
                     "--pin-host-memory auto, cast and merge outputs of the CPU path are not)")
        # Whether the daemon pinned the checkpoint the pushes copied from:
        # the ratio means nothing without it (a pageable source caps it
        # near pageable H2D).
        m["pinned_bytes"] = int(self.client.stats().get("pinned_bytes", 0))
        m["pin_log"] = [e["line"][-300:] for e in log_events(self.log_path)
                        if e["event"].startswith("pin") and e.get("model") == "llama"]
        pinned = ("daemon pinned %.2f GiB (stats pinned_bytes; the checkpoint is %.2f GiB)" % (
            m["pinned_bytes"] / 2**30, nbytes / 2**30))
        detail = ("push (daemon copy) %.1f GB/s keep, %.1f GB/s f32 out (cast on the GPU; "
                  "%.1f GB/s copying a CPU cast); whole fetch %.1f GB/s; "
                  "pinned H2D %.1f GB/s, pageable %.1f GB/s: ratio %.2f (goal 0.9); %s; log: %s" % (
                      m["push_only_keep_GBps"], m["push_only_f32_GBps_out"],
                      m["push_only_f32_cpu_cast_GBps_out"], m["fetch_keep_GBps"],
                      m["pinned_h2d_GBps"], m["pageable_h2d_GBps"],
                      m["ratio_push_only_keep_vs_pinned"], pinned,
                      " | ".join(m["pin_log"]) or "no pin line for llama"))
        return True, detail, m

    # -- f: time to a ready shard

    def ready(self):
        torch = self.torch
        m, fails = {}, []
        try:
            from safetensors.torch import load_file
        except ImportError as e:
            load_file = None
            fails.append("safetensors not installed: %s" % e)
        for world, rank in ((1, 0), (2, 0)):
            key = "w%d" % world
            for attempt in range(2):
                t0 = time.monotonic()
                h = self.client.fetch("llama", world=world, rank=rank, device="cuda:0")
                push_sd = h.state_dict()
                self.sync()
                m.setdefault(key + "_push_s", []).append(round(time.monotonic() - t0, 3))
                if load_file is not None:
                    t0 = time.monotonic()
                    full = load_file(self.llama_path, device="cuda:0")
                    st_sd = {k: chunk_ref(v, world, rank, None) for k, v in full.items()}
                    self.sync()
                    m.setdefault(key + "_safetensors_s", []).append(round(time.monotonic() - t0, 3))
                    if attempt == 0:
                        for k, v in st_sd.items():
                            if not same_bits(push_sd[k], v):
                                fails.append("W%d %s: push != safetensors" % (world, k))
                    del full, st_sd
                m[key + "_bytes"] = h.nbytes
                del push_sd
                h.release()
                del h
                torch.cuda.empty_cache()
        parts = []
        for world in (1, 2):
            key = "w%d" % world
            p = min(m[key + "_push_s"])
            s = min(m.get(key + "_safetensors_s") or [0.0])
            m[key + "_speedup"] = round(s / p, 2) if p and s else None
            parts.append("W%d (%.2f GiB): push %.3f s, safetensors %s" % (
                world, m[key + "_bytes"] / 2**30, p, "%.3f s" % s if s else "-"))
        m["note"] = "the checkpoint was just written: safetensors reads it from the page cache"
        return not fails, "; ".join(parts) if not fails else "; ".join(fails[:8]), m


# ---------------------------------------------------------------- main


def _status(doc):
    """logs/gpu_checks.status for run_on_device.sh (when run by it)."""
    out = os.environ.get("OUT")
    if not out or not os.path.isdir(os.path.join(out, "logs")):
        return
    checks = doc.get("checks", [])
    failed = [c["name"] for c in checks if c["ok"] is False]
    if "skipped" in doc:
        line = "skipped\t%s" % doc["skipped"]
    elif "error" in doc:
        line = "fail\tgpu_checks.py broke: %s" % doc["error"].strip().splitlines()[-1][:200]
    elif failed:
        line = "fail\t%d of %d checks failed: %s" % (len(failed), len(checks), ", ".join(failed))
    else:
        line = "pass\t%d checks passed" % sum(1 for c in checks if c["ok"])
    with open(os.path.join(out, "logs", "gpu_checks.status"), "w") as f:
        f.write(line.replace("\n", " ") + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weightd", required=True)
    ap.add_argument("--weightctl", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=280.0,
                    help="seconds for the whole run, stopping the daemon included "
                         "(run_on_device.sh passes what is left of its own)")
    args = ap.parse_args(argv)
    args.out = os.path.abspath(args.out)
    doc = {"schema": SCHEMA, "started_unix": int(time.time()), "checks": [],
           "weightd": args.weightd, "weightctl": args.weightctl}
    rec = Recorder(args.out, args.budget, doc)

    def term(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, term)

    checks = None
    try:
        try:
            import torch
        except Exception as e:
            doc["skipped"] = "no GPU: torch cannot be imported (%s: %s)" % (type(e).__name__, e)
            return 0
        doc["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda}
        weightd, doc["weightd_import"] = _import_weightd()
        if not torch.cuda.is_available():
            doc["skipped"] = "no GPU: torch.cuda.is_available() is False (torch %s, CUDA %s)" % (
                torch.__version__, torch.version.cuda)
            return 0
        if weightd is None:
            doc["error"] = "cannot import the weightd client: " + doc["weightd_import"]
            return 0
        p = torch.cuda.get_device_properties(0)
        doc["device"] = {"name": p.name, "uuid": str(getattr(p, "uuid", "")),
                         "total_memory": p.total_memory, "count": torch.cuda.device_count()}
        checks = Checks(args, weightd, torch, doc)
        doc["budget_s"] = args.budget
        doc["plan"] = [{"name": n, "limit_s": limit, "need_s": need} for n, _, limit, need in
                       checks.plan()]
        for name, fn, limit, need in checks.plan():
            if name != "setup" and checks.client is None:
                rec.skip(name, "setup failed")
                continue
            rec.run(name, fn, limit, need)
        return 0
    except BaseException as e:  # the script itself broke, or was told to stop
        doc["error"] = "%s: %s\n%s" % (type(e).__name__, e, traceback.format_exc()[-3000:])
        return 0 if not isinstance(e, (SystemExit, KeyboardInterrupt)) else 1
    finally:
        if checks is not None:
            try:
                checks.close()
            except Exception as e:
                doc["close_error"] = repr(e)
        rec.write()
        _status(doc)
        print("gpu_checks: %s -> %s" % (
            doc.get("skipped") or ("ERROR" if "error" in doc else doc.get("summary")), args.out),
            flush=True)


if __name__ == "__main__":
    sys.exit(main())

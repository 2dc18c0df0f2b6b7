#!/usr/bin/env bash
# Runs the GPU checks on a lent device from the bundle made by prepare_bundle.sh
# (no build there, no Debian packages needed), and writes ONE report:
#   OUT=DIR tests/gpu/run_on_device.sh [BUNDLE=gpu-bundle.tar.xz | an unpacked bundle dir]
# Every step is timed, bounded by `timeout` and recorded; a failing step never
# stops the next. Without a GPU every GPU step is recorded "skipped: no GPU"
# and the CPU steps (bundle loads, daemon serves, Python client works) still
# run, which is how this script is tested off the device (tests/gpu/test_bundle.py).
# Writes $OUT/report.json, $OUT/logs/*.log, $OUT/device_facts.json and
# whatever gpu_checks.py writes ($OUT/gpu_checks.json). Exit 0 when no step
# failed (skips are fine), 1 when one did, 2 when no report could be written.
# Env: PYTHON (default python3), WEIGHTD_GPU_BUDGET_S (default 450: the whole
# run, unpacking included, stays under 8 minutes), KEEP_WORK=1 keeps the temp
# dir, WEIGHTD_GPU_CHECKS_WITHOUT_GPU=1 runs gpu_checks.py even without a GPU,
# WEIGHTD_GPU_CHECKS=FILE runs another script in its place (tests do),
# WEIGHTD_GPU_CHECKS_TIMEOUT_S caps that step (default: all that is left).
#   tests/gpu/run_on_device.sh --dry-run   prints each step's time budget
# (they add up to WEIGHTD_GPU_BUDGET_S) and runs nothing.
set -uo pipefail   # no -e: a failing step is recorded, never the end of the run

# ---------------------------------------------------------------- budgets
# Every step has a budget: the most it may take when every step before it
# took all of its own. The budgets, plus `reserve` for stopping the daemon
# and writing the report, add up to the run's budget, so no step can eat
# into a later one's: a step may run for its budget plus what the steps
# before it left unused (never past its cap), and is killed (`timeout`)
# there. gpu_checks, last, gets all that is left and is told so (--budget):
# its checks finish or skip within it. Budgets: each step's floor, then 35%
# of the rest shared among the steps before gpu_checks (up to their caps),
# the rest to gpu_checks; below the sum of the floors, the floors scaled down.
budget=${WEIGHTD_GPU_BUDGET_S:-450}
reserve=15                      # seconds kept for stopping the daemon and the report
steps_order=(device_facts unpack libraries binaries_start cuda_cast_test daemon gpus_match_torch
             weightctl_cuda python_client daemon_stop gpu_checks)
declare -A floor=([device_facts]=30 [unpack]=10 [libraries]=5 [binaries_start]=5
                  [cuda_cast_test]=20 [daemon]=10 [gpus_match_torch]=5 [weightctl_cuda]=15
                  [python_client]=10 [daemon_stop]=17 [gpu_checks]=60)
declare -A cap=([device_facts]=90 [unpack]=45 [libraries]=30 [binaries_start]=20
                [cuda_cast_test]=120 [daemon]=45 [gpus_match_torch]=30 [weightctl_cuda]=60
                [python_client]=45 [daemon_stop]=20)
[ -n "${WEIGHTD_GPU_CHECKS_TIMEOUT_S:-}" ] && cap[gpu_checks]=$WEIGHTD_GPU_CHECKS_TIMEOUT_S
declare -A plan=()
spare=0                         # what a capped gpu_checks leaves of the budget
plan_budgets() {
  local avail=$((budget - reserve)) fsum=0 room=0 given=0 n last=gpu_checks
  for n in "${steps_order[@]}"; do fsum=$((fsum + floor[$n])); done
  for n in "${steps_order[@]}"; do
    [ "$n" = "$last" ] || room=$((room + cap[$n] - floor[$n]))
  done
  ((avail < 0)) && avail=0
  if ((avail <= fsum)); then
    for n in "${steps_order[@]}"; do
      [ "$n" = "$last" ] && continue
      plan[$n]=$((floor[$n] * avail / fsum)); given=$((given + plan[$n]))
    done
  else
    local extra=$((avail - fsum)) share
    share=$((extra * 35 / 100)); ((share > room)) && share=$room
    for n in "${steps_order[@]}"; do
      [ "$n" = "$last" ] && continue
      plan[$n]=$((floor[$n] + (cap[$n] - floor[$n]) * share / room)); given=$((given + plan[$n]))
    done
  fi
  plan[$last]=$((avail - given))
  if [ -n "${cap[$last]:-}" ] && ((plan[$last] > cap[$last])); then
    spare=$((plan[$last] - cap[$last])); plan[$last]=${cap[$last]}
  fi
}
plan_budgets
if [ "${1:-}" = "--dry-run" ]; then
  echo "run_on_device: budget ${budget} s (WEIGHTD_GPU_BUDGET_S). Each step's budget: the most it"
  echo "may take when every step before it took all of its own (a step also gets what the steps"
  echo "before it left unused, up to its cap; gpu_checks gets all that is left):"
  total=0
  for n in "${steps_order[@]}"; do
    printf '  %-18s %5d s%s\n' "$n" "${plan[$n]}" "$([ -n "${cap[$n]:-}" ] && echo " (cap ${cap[$n]} s)")"
    total=$((total + plan[$n]))
  done
  ((spare)) && printf '  %-18s %5d s (WEIGHTD_GPU_CHECKS_TIMEOUT_S caps gpu_checks)\n' unused "$spare"
  printf '  %-18s %5d s (stopping the daemon when a step failed, the report)\n' reserve "$reserve"
  printf '  %-18s %5d s\n' total "$((total + spare + reserve))"
  exit 0
fi

# step_limit NAME: the seconds NAME may take from now: its cap, within what
# is left once every later step's budget is kept.
step_limit() {
  local name=$1 later=0 seen=0 n
  for n in "${steps_order[@]}"; do
    ((seen)) && later=$((later + plan[$n]))
    [ "$n" = "$name" ] && seen=1
  done
  local left=$((budget - reserve - ($(date +%s) - t0) - later))
  local c=${cap[$name]:-$left}
  ((c > left)) && c=$left
  echo "$c"
}

repo=$(cd "$(dirname "$0")/../.." && pwd)
if [ -z "${OUT:-}" ]; then
  OUT=$(mktemp -d "${TMPDIR:-/tmp}/weightd-gpu-out.XXXXXX")
  echo "run_on_device: OUT not set, writing to $OUT"
fi
mkdir -p "$OUT/logs" || exit 2
OUT=$(cd "$OUT" && pwd)
rm -f "$OUT/report.json"
bundle_arg=${1:-$repo/gpu-bundle.tar.xz}
[ -e "$bundle_arg" ] && bundle_arg=$(cd "$(dirname "$bundle_arg")" && pwd)/$(basename "$bundle_arg")
gpu_checks_py=${WEIGHTD_GPU_CHECKS:-$repo/tests/gpu/gpu_checks.py}
[ -e "$gpu_checks_py" ] && gpu_checks_py=$(cd "$(dirname "$gpu_checks_py")" && pwd)/$(basename "$gpu_checks_py")
cd "$repo" || exit 2
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || ! command -v python >/dev/null 2>&1 || PY=python
t0=$(date +%s)
work=$(mktemp -d /tmp/wdgpu.XXXXXX) || exit 2   # short: socket paths must fit 108 bytes
B=$work/bundle                   # the unpacked bundle
daemon_pid=""
has_gpu=0
gpu_reason="not determined (device facts step did not finish)"
export OUT PY B work

have() { command -v "$1" >/dev/null 2>&1; }
now() { date +%s.%N 2>/dev/null || date +%s; }

cleanup() {
  if [ -n "$daemon_pid" ] && kill -0 "$daemon_pid" 2>/dev/null; then
    kill -KILL "$daemon_pid" 2>/dev/null
  fi
  if [ "${KEEP_WORK:-0}" != 1 ]; then
    [ -s "$work/alt" ] && rm -rf "$(cat "$work/alt")"
    rm -rf "$work"
  fi
}
trap cleanup EXIT

# record NAME KIND STATUS RC SECONDS REASON [LIMIT]: one line per step in
# steps.tsv (the report is assembled from it and from logs/NAME.log).
record() {
  local reason=${6//$'\t'/ }
  reason=${reason//$'\n'/ }
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" "$reason" "${7:-}" \
    >> "$OUT/steps.tsv"
  printf 'run_on_device: %-8s %-22s %6ss  %s\n' "$3" "$1" "$5" "$reason"
}
: > "$OUT/steps.tsv"

# step NAME KIND CMD...: runs CMD (an executable or an exported function)
# under `timeout` within the step's limit (step_limit; the command sees it
# as WD_STEP_BUDGET_S and should finish well within it), output to
# logs/NAME.log. KIND gpu = skipped without a GPU. CMD may write
# logs/NAME.status ("STATUS<TAB>REASON") to refine pass/fail.
step() {
  local name=$1 kind=$2; shift 2
  local log=$OUT/logs/$name.log status reason="" rc limit
  if [ "$kind" = gpu ] && [ "$has_gpu" != 1 ]; then
    record "$name" "$kind" skipped "" 0 "skipped: no GPU ($gpu_reason)"; return 0
  fi
  limit=$(step_limit "$name")
  if ((limit < 5)); then
    record "$name" "$kind" skipped "" 0 "skipped: time budget (${budget}s): ${limit}s left for it"
    return 0
  fi
  rm -f "$OUT/logs/$name.status"
  local s; s=$(now)
  # timeout runs executables: an (exported) function goes through bash -c.
  [ "$(type -t "$1")" = function ] && set -- bash -c '"$@"' "$name" "$@"
  # SIGTERM 3 s before the limit, SIGKILL at it: the step never runs past it.
  if have timeout; then
    WD_STEP_BUDGET_S=$limit timeout -k 3 "$((limit - 3))" "$@" > "$log" 2>&1 < /dev/null; rc=$?
  else
    WD_STEP_BUDGET_S=$limit "$@" > "$log" 2>&1 < /dev/null; rc=$?
  fi
  local secs; secs=$(awk "BEGIN{printf \"%.1f\", $(now) - $s}")
  if ((rc == 124 || rc == 137)); then
    status=timeout; reason="timed out: its limit is ${limit} s (SIGTERM at $((limit - 3)) s)"
  elif ((rc == 0)); then status=pass
  else
    status=fail
    reason="exit $rc: $(grep -v '^[[:space:]]*$' "$log" 2>/dev/null | tail -1 | cut -c1-200)"
  fi
  if [ -s "$OUT/logs/$name.status" ]; then
    IFS=$'\t' read -r status reason < "$OUT/logs/$name.status"
  fi
  record "$name" "$kind" "$status" "$rc" "$secs" "$reason" "$limit"
  [ "$status" = pass ]
}

# The bundle's Python side, for the steps that import the client: the client and
# a pure-Python protobuf first, C extension off. Only these steps get it: torch
# alone needs nothing from the bundle.
with_client_env() {
  PYTHONPATH="$B/python:$B/pyproto${PYTHONPATH:+:$PYTHONPATH}" \
  PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python PATH="$B/bin:$PATH" WEIGHTD_BUNDLE="$B" "$@"
}
export -f with_client_env

# ---------------------------------------------------------------- a. facts
cat > "$work/facts.py" <<'EOF'
"""Device facts: host, nvidia-smi, torch (in a child with its own timeout, so a
hanging CUDA init still leaves the rest). Writes $OUT/device_facts.json."""
import glob, json, os, platform, re, subprocess, sys, time
out = os.environ["OUT"]
# every command within the step's budget (torch's child last and longest)
deadline = time.monotonic() + float(os.environ.get("WD_STEP_BUDGET_S", "150")) - 8

def run(cmd, timeout=30):
    timeout = max(1.0, min(timeout, deadline - time.monotonic()))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return {"rc": p.returncode, "out": p.stdout.strip()[-4000:], "err": p.stderr.strip()[-2000:]}
    except FileNotFoundError:
        return {"rc": None, "out": "", "err": "not found"}
    except subprocess.TimeoutExpired:
        return {"rc": None, "out": "", "err": "timed out"}

facts = {"host": {}, "nvidia_smi": {}, "torch": {}}
h = facts["host"]
h["uname"] = " ".join(platform.uname())
try:
    osr = dict(l.rstrip("\n").split("=", 1) for l in open("/etc/os-release") if "=" in l)
    h["os"] = osr.get("PRETTY_NAME", "").strip('"')
except OSError:
    h["os"] = ""
h["glibc"] = " ".join(platform.libc_ver())
h["nproc"] = os.cpu_count()
try:
    h["mem_total_kb"] = int(re.search(r"MemTotal:\s+(\d+)", open("/proc/meminfo").read()).group(1))
except Exception:
    pass
h["python"] = sys.version.split()[0] + " " + sys.executable
for k in ("LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "CUDA_HOME"):
    h[k] = os.environ.get(k)
# The system libstdc++ and the newest GLIBCXX it has (the bundle's binaries need
# MANIFEST requires.GLIBCXX; lib-fallback/ is used when it is older).
cands = []
ldc = run(["ldconfig", "-p"])
for line in ldc["out"].splitlines():
    if "libstdc++.so.6 " in line and "x86-64" in line:
        cands.append(line.split("=>")[-1].strip())
cands += glob.glob("/usr/lib/x86_64-linux-gnu/libstdc++.so.6") + glob.glob("/usr/lib64/libstdc++.so.6")
for c in cands:
    try:
        data = open(os.path.realpath(c), "rb").read()
    except OSError:
        continue
    vs = {tuple(map(int, v.split(b"."))) for v in re.findall(rb"GLIBCXX_(3\.4(?:\.\d+)?)\x00", data)}
    h["libstdcxx"] = {"path": os.path.realpath(c),
                      "max_glibcxx": "GLIBCXX_" + ".".join(map(str, max(vs))) if vs else None}
    break
h["devices"] = {"/dev/nvidiactl": os.path.exists("/dev/nvidiactl"),
                "nvidia_nodes": sorted(glob.glob("/dev/nvidia[0-9]*"))}

# What the device's python brings (the client needs numpy and grpcio; the
# bundle's protobuf 4.21.12 shadows any protobuf listed here, see README).
import importlib.metadata as md
h["python_packages"] = {}
for dist in ("torch", "numpy", "grpcio", "protobuf", "safetensors", "peft", "transformers"):
    try:
        h["python_packages"][dist] = md.version(dist)
    except Exception:
        h["python_packages"][dist] = None

smi = facts["nvidia_smi"]
smi["L"] = run(["nvidia-smi", "-L"])
smi["query"] = run(["nvidia-smi", "--query-gpu=index,name,uuid,pci.bus_id,driver_version,memory.total,compute_cap",
                    "--format=csv,noheader"])
if smi["query"]["rc"] not in (0, None):   # older drivers lack compute_cap
    smi["query"] = run(["nvidia-smi", "--query-gpu=index,name,uuid,pci.bus_id,driver_version,memory.total",
                        "--format=csv,noheader"])
smi["uuids"] = re.findall(r"\(UUID: (GPU-[0-9a-fA-F-]+)\)", smi["L"]["out"])
m = re.search(r"^[^,]*,[^,]*,[^,]*,[^,]*,\s*([0-9.]+)", smi["query"]["out"], re.M)
smi["driver_version"] = m.group(1) if m else None

TORCH = r'''
import json, torch
f = {"version": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available()}
f["count"] = torch.cuda.device_count() if f["available"] else 0
f["devices"] = []
for i in range(f["count"]):
    p = torch.cuda.get_device_properties(i)
    f["devices"].append({"index": i, "name": p.name, "uuid": "GPU-" + str(p.uuid),
        "capability": "%d.%d" % (p.major, p.minor), "total_memory": p.total_memory,
        "multi_processor_count": p.multi_processor_count,
        "pci_bus_id": getattr(p, "pci_bus_id", None)})
if f["available"]:
    try:
        f["driver_api_version"] = torch._C._cuda_getDriverVersion()
    except Exception:
        pass
print(json.dumps(f))
'''
t = run([sys.executable, "-c", TORCH], timeout=120)
try:
    facts["torch"] = json.loads(t["out"].splitlines()[-1])
except Exception:
    facts["torch"] = {"error": (t["err"] or t["out"] or "no output")[-1500:]}

tc = facts["torch"].get("count", 0) or 0
sc = len(smi["uuids"])
facts["has_gpu"] = bool(tc or sc)
why = []
if not sc:
    why.append("nvidia-smi: " + ("not found" if smi["L"]["rc"] is None else (smi["L"]["err"] or smi["L"]["out"] or "no GPU listed")[:200]))
if not tc:
    why.append("torch: " + ((facts["torch"]["error"].strip().splitlines() or ["?"])[-1][-200:]
                            if "error" in facts["torch"]
               else "cuda available=%s (torch %s, cuda %s)" % (facts["torch"].get("available"),
                    facts["torch"].get("version"), facts["torch"].get("cuda"))))
facts["no_gpu_reason"] = "; ".join(why) if not facts["has_gpu"] else ""
with open(os.path.join(out, "device_facts.json"), "w") as f:
    json.dump(facts, f, indent=1)
print(json.dumps({k: facts[k] for k in ("has_gpu", "no_gpu_reason")}))
print("nvidia-smi -L:", smi["L"]["out"] or smi["L"]["err"])
print("torch:", json.dumps(facts["torch"]))
print("host:", json.dumps(h))
EOF
device_facts() { "$PY" "$work/facts.py"; }
export -f device_facts
step device_facts cpu device_facts
if [ -s "$OUT/device_facts.json" ]; then
  read -r has_gpu gpu_reason < <("$PY" -c '
import json, sys
f = json.load(open(sys.argv[1]))
print(int(bool(f.get("has_gpu"))), f.get("no_gpu_reason") or "-")' "$OUT/device_facts.json" 2>/dev/null) || has_gpu=0
fi
has_gpu=${has_gpu:-0}

# ---------------------------------------------------------------- unpack
unpack() {
  mkdir -p "$B" || return 1
  if [ -d "$bundle_arg" ]; then
    cp -a "$bundle_arg/." "$B/" || return 1
  elif [ ! -f "$bundle_arg" ]; then
    echo "no bundle at $bundle_arg (carry it: run prepare_bundle.sh here, then carry gpu-bundle.tar.xz)"
    return 1
  elif have xz && tar --version >/dev/null 2>&1; then
    tar -xJf "$bundle_arg" -C "$B" || return 1
  else   # no xz binary there: python's tarfile reads .tar.xz by itself
    "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$bundle_arg" "$B" || return 1
  fi
  [ -f "$B/bin/weightd" ] && [ -f "$B/bin/weightctl" ] && [ -f "$B/MANIFEST.json" ] || {
    echo "bundle incomplete: $(ls "$B")"; return 1; }
  # /tmp mounted noexec (some containers): run from a folder of the checkout.
  "$B/bin/weightctl" --help > /dev/null 2>&1
  if [ $? = 126 ]; then
    local alt; alt=$(mktemp -d "$repo/.wdgpu.XXXXXX") || return 1
    echo "$B is not executable here (noexec?): using $alt/bundle"
    mv "$B" "$alt/bundle" && ln -s "$alt/bundle" "$B" && echo "$alt" > "$work/alt" || return 1
  fi
  "$PY" -c 'import json, sys; m = json.load(open(sys.argv[1])); m.pop("files", None); print(json.dumps(m, indent=1))' \
    "$B/MANIFEST.json"
}
export bundle_arg repo
export -f unpack have
bundle_ok=0
step unpack cpu unpack && bundle_ok=1

if [ "$bundle_ok" = 1 ]; then
  # ---------------------------------------------------------- libraries
  # Every library resolves with the bundle's lib/ first; when only libstdc++ is
  # too old there, the bundled one (lib-fallback/) is used instead (recorded).
  libs_check() {
    local extra=$1 bad=0 f o rc
    for f in "$B"/libexec/*; do
      if have ldd; then
        o=$(LD_LIBRARY_PATH="$B/lib$extra${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "$f" 2>&1); rc=$?
      else
        o=$(LD_LIBRARY_PATH="$B/lib$extra${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" /lib64/ld-linux-x86-64.so.2 --list "$f" 2>&1); rc=$?
      fi
      echo "== $(basename "$f") (rc $rc; the bundle's own lib/ lines left out)"
      echo "$o" | grep -v "=> $B/lib/" || true
      if ((rc != 0)) || grep -qE 'not found|No such file|error while loading' <<<"$o"; then bad=1; fi
    done
    return $bad
  }
  libraries() {
    echo "-- with the system's libstdc++:"
    if libs_check ""; then echo system > "$work/stdcxx"; return 0; fi
    echo "-- with the bundled libstdc++ (lib-fallback/):"
    if libs_check ":$B/lib-fallback"; then
      echo bundled > "$work/stdcxx"
      printf 'pass\tsystem libstdc++ too old or missing: using the bundled one (lib-fallback/)\n' \
        > "$OUT/logs/libraries.status"
      return 0
    fi
    printf 'fail\tunresolved libraries (see log): the device lacks a glibc/libstdc++ this build needs\n' \
      > "$OUT/logs/libraries.status"
    return 1
  }
  export -f libs_check libraries
  step libraries cpu libraries
  export WEIGHTD_BUNDLE_STDCXX; WEIGHTD_BUNDLE_STDCXX=$(cat "$work/stdcxx" 2>/dev/null || echo system)

  # -------------------------------------------------- binaries start at all
  binaries_start() {
    "$B/bin/weightd" --help > /dev/null || { echo "weightd --help failed"; return 1; }
    "$B/bin/weightctl" --help > /dev/null || { echo "weightctl --help failed"; return 1; }
    if [ -x "$B/bin/cuda_cast_test" ]; then
      "$B/bin/cuda_cast_test" --gtest_list_tests || { echo "cuda_cast_test --gtest_list_tests failed"; return 1; }
    fi
    echo "weightd, weightctl and cuda_cast_test start with the bundled libraries"
  }
  export -f binaries_start
  step binaries_start cpu binaries_start

  # ---------------------------------------------------- b. cuda_cast_test
  cuda_cast_test() {
    if [ ! -x "$B/bin/cuda_cast_test" ]; then
      printf 'skipped\tcuda_cast_test is not in the bundle (not built)\n' > "$OUT/logs/cuda_cast_test.status"
      return 0
    fi
    "$B/bin/cuda_cast_test" --gtest_output="json:$OUT/cuda_cast_test.json"
    local rc=$?
    # gtest passes a skipped test: on the device a skip means the check did not run.
    if ((rc == 0)) && grep -q '^\[  SKIPPED \]' "$OUT/logs/cuda_cast_test.log"; then
      printf 'fail\tskipped on the device: %s\n' \
        "$(grep -m1 -A1 ': Skipped$' "$OUT/logs/cuda_cast_test.log" | tail -1)" > "$OUT/logs/cuda_cast_test.status"
    fi
    return $rc
  }
  export -f cuda_cast_test
  step cuda_cast_test gpu cuda_cast_test

  # ------------------------------------------- c. daemon, weightctl gpus
  export SOCK=$work/s/wd.sock MODELS=$work/models
  mkdir -p "$work/s" "$MODELS"
  s=$(now)
  "$B/bin/weightd" --socket "$SOCK" --model-root "$MODELS" > "$OUT/logs/weightd.log" 2>&1 < /dev/null &
  daemon_pid=$!
  export DAEMON_PID=$daemon_pid
  daemon_up() {
    for _ in $(seq 1 60); do
      if ! kill -0 "$DAEMON_PID" 2>/dev/null; then
        echo "weightd exited at start; its log:"; tail -c 3000 "$OUT/logs/weightd.log"; return 1
      fi
      if "$B/bin/weightctl" --socket "$SOCK" health 2>&1; then
        "$B/bin/weightctl" --socket "$SOCK" gpus > "$work/gpus.txt" 2>&1; local rc=$?
        echo "-- weightctl gpus (rc $rc):"; cat "$work/gpus.txt"
        echo "-- weightctl stats:"; "$B/bin/weightctl" --socket "$SOCK" stats
        return $rc
      fi
      sleep 0.5
    done
    echo "daemon not healthy after 30 s; its log:"; tail -c 3000 "$OUT/logs/weightd.log"
    return 1
  }
  export -f daemon_up
  daemon_ok=0
  step daemon cpu daemon_up && daemon_ok=1

  gpus_match_torch() {
    "$PY" - "$work/gpus.txt" "$OUT/device_facts.json" <<'EOF'
import json, os, sys
lines = open(sys.argv[1]).read().splitlines()
facts = json.load(open(sys.argv[2]))
got = [l.split("\t")[1] for l in lines if l.startswith("gpu:")]
want = [d["uuid"] for d in facts.get("torch", {}).get("devices", [])]
smi = facts.get("nvidia_smi", {}).get("uuids", [])
print("weightctl gpus:", got)
print("torch         :", want)
print("nvidia-smi -L :", smi)
status = os.path.join(os.environ["OUT"], "logs", "gpus_match_torch.status")
if not want:
    open(status, "w").write("fail\ttorch lists no GPU to compare with (%s)\n"
                            % facts.get("torch", {}).get("error", "cuda unavailable")[:200])
    sys.exit(1)
if sorted(got) != sorted(want):
    open(status, "w").write("fail\tweightctl gpus %s != torch %s%s\n" % (
        got, want, (" (" + lines[0][:200] + ")") if lines and not got else ""))
    sys.exit(1)
open(status, "w").write("pass\t%d GPU(s), same UUIDs as torch%s\n" % (
    len(got), "" if not smi or sorted(smi) == sorted(got) else " (nvidia-smi lists %s)" % smi))
EOF
  }
  export -f gpus_match_torch
  if [ "$daemon_ok" = 1 ]; then
    step gpus_match_torch gpu gpus_match_torch
  else
    record gpus_match_torch gpu skipped "" 0 "skipped: the daemon did not serve"
  fi

  # ------------------------------ weightctl --transport cuda vs the CPU path
  # The C++ client's CUDA push (a VMM allocation made through the driver,
  # copied back to host for the file) against the shm fetch of the same
  # request, byte for byte: a second client, independent of gpu_checks.py's.
  weightctl_cuda() {
    "$PY" - "$MODELS/wc" <<'EOF'
import os, sys, torch
from safetensors.torch import save_file
root = sys.argv[1]
os.makedirs(root, exist_ok=True)
g = torch.Generator().manual_seed(3)
save_file({"w": torch.randn(1000, 257, generator=g).to(torch.bfloat16),
           "f": torch.randn(33, 7, generator=g), "s": torch.tensor(1.5),
           "e": torch.zeros(0, 3)}, os.path.join(root, "wc.safetensors"))
EOF
    local C="$B/bin/weightctl --socket $SOCK" rc=0 n=0 bad=""
    $C load wc "$MODELS/wc/wc.safetensors" >/dev/null || return 1
    for dt in keep bf16 f32; do
      for wr in "1 0" "2 1" "3 2"; do
        set -- $wr
        $C fetch wc --world "$1" --rank "$2" --dtype "$dt" --out "$work/shm.st" >/dev/null || return 1
        if ! $C fetch wc --world "$1" --rank "$2" --dtype "$dt" --transport cuda --device 0 \
             --out "$work/cuda.st"; then
          bad="$bad $dt/$1/$2:error"; rc=1; continue
        fi
        n=$((n + 1))
        cmp -s "$work/shm.st" "$work/cuda.st" || { bad="$bad $dt/$1/$2:differs"; rc=1; }
      done
    done
    if ((rc == 0)); then
      printf 'pass\t%d fetches through the GPU equal the shm path byte for byte\n' "$n" \
        > "$OUT/logs/weightctl_cuda.status"
    else
      printf 'fail\t%s\n' "${bad# }" > "$OUT/logs/weightctl_cuda.status"
    fi
    return $rc
  }
  export -f weightctl_cuda
  if [ "$daemon_ok" = 1 ]; then
    step weightctl_cuda gpu weightctl_cuda
  else
    record weightctl_cuda gpu skipped "" 0 "skipped: the daemon did not serve"
  fi

  # ------------------------------ the Python client, bundled protobuf, shm path
  python_client() {
    with_client_env "$PY" - <<'EOF'
import json, os, struct, sys
import google.protobuf
from google.protobuf.internal import api_implementation
import weightd
B, OUT, SOCK, MODELS = (os.environ[k] for k in ("B", "OUT", "SOCK", "MODELS"))
r = {"protobuf": google.protobuf.__version__, "protobuf_file": google.protobuf.__file__,
     "protobuf_impl": api_implementation.Type(), "weightd_file": weightd.__file__}
assert r["protobuf_file"].startswith(B), "google.protobuf not from the bundle: " + r["protobuf_file"]
assert r["weightd_file"].startswith(B), "weightd not from the bundle: " + r["weightd_file"]
assert r["protobuf_impl"] == "python", r["protobuf_impl"]
try:
    import grpc
    r["grpc"] = grpc.__version__
except Exception:
    pass
# A tiny checkpoint: F32 [4, 2] = 0..7; rank 1 of 2 gets rows 2..3 (4..7), cast to f16.
path = os.path.join(MODELS, "tiny.safetensors")
header = json.dumps({"w": {"dtype": "F32", "shape": [4, 2], "data_offsets": [0, 32]}}).encode()
header += b" " * (-len(header) % 8)
with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(header)) + header + struct.pack("<8f", *range(8)))
with weightd.Client(socket=SOCK, retry_deadline=0) as c:
    r["health"] = c.health()
    st = c.stats()
    r["cuda_built"] = bool(st.get("cuda_built"))
    r["gpus"] = [g.uuid for g in st.get("gpus", [])]
    r["gpus_unavailable"] = st.get("gpus_unavailable", "")
    c.load("tiny", path)
    with c.fetch("tiny", world=2, rank=1, dtype="f16") as shard:
        w = shard.numpy_dict()["w"]
        r["fetched"] = {"dtype": str(w.dtype), "shape": list(w.shape), "values": w.ravel().tolist()}
    assert r["fetched"] == {"dtype": "float16", "shape": [2, 2], "values": [4.0, 5.0, 6.0, 7.0]}, r["fetched"]
    c.unload("tiny")
json.dump(r, open(os.path.join(OUT, "python_client.json"), "w"), indent=1)
print(json.dumps(r, indent=1))
EOF
  }
  export -f python_client
  if [ "$daemon_ok" = 1 ]; then
    step python_client cpu python_client
  else
    record python_client cpu skipped "" 0 "skipped: the daemon did not serve"
  fi

  # ------------------------------------------------------- daemon shutdown
  stop_daemon() {   # within its step limit (at most 15 s of waiting)
    local waits=$(((stop_limit - 2) * 4))
    ((waits > 60)) && waits=60
    ((waits < 4)) && waits=4
    kill -TERM "$daemon_pid" 2>/dev/null || { echo "daemon already gone"; return 1; }
    for _ in $(seq 1 "$waits"); do
      kill -0 "$daemon_pid" 2>/dev/null || break
      sleep 0.25
    done
    if kill -0 "$daemon_pid" 2>/dev/null; then
      kill -KILL "$daemon_pid"
      echo "daemon still running $((waits / 4)) s after SIGTERM: killed"; return 1
    fi
  }
  s=$(now)
  stop_limit=$(step_limit daemon_stop)
  if stop_daemon > "$OUT/logs/daemon_stop.log" 2>&1; then
    wait "$daemon_pid"; rc=$?
    [ "$rc" = 0 ] && st=pass || st=fail
    record daemon_stop cpu "$st" "$rc" "$(awk "BEGIN{printf \"%.1f\", $(now) - $s}")" \
      "$([ "$rc" = 0 ] || echo "weightd exited $rc after SIGTERM")" "$stop_limit"
  else
    record daemon_stop cpu fail "" "$(awk "BEGIN{printf \"%.1f\", $(now) - $s}")" \
      "$(tail -1 "$OUT/logs/daemon_stop.log")" "$stop_limit"
  fi
  daemon_pid=""

  # ------------------------------------------------------- d. gpu_checks.py
  # its budget: the step's limit less the 3 s of SIGTERM grace and 5 s for
  # python to exit; its own checks skip what would not fit (gpu_checks.py)
  gpu_checks() {
    with_client_env "$PY" "$gpu_checks_py" --weightd "$B/bin/weightd" \
      --weightctl "$B/bin/weightctl" --out "$OUT/gpu_checks.json" \
      --budget "$((WD_STEP_BUDGET_S - 8))"
  }
  export gpu_checks_py
  export -f gpu_checks
  if [ ! -f "$gpu_checks_py" ]; then
    record gpu_checks gpu skipped "" 0 "skipped: ${gpu_checks_py#"$repo"/} not present"
  elif [ "${WEIGHTD_GPU_CHECKS_WITHOUT_GPU:-0}" = 1 ]; then
    step gpu_checks cpu gpu_checks
  else
    step gpu_checks gpu gpu_checks
  fi
else
  for n in libraries binaries_start cuda_cast_test daemon gpus_match_torch weightctl_cuda python_client daemon_stop gpu_checks; do
    case $n in cuda_cast_test|gpus_match_torch|weightctl_cuda|gpu_checks) k=gpu ;; *) k=cpu ;; esac
    record "$n" "$k" skipped "" 0 "skipped: the bundle was not unpacked"
  done
fi

# ---------------------------------------------------------------- e. report
"$PY" - "$OUT" "$B" "$has_gpu" "$gpu_reason" "$t0" "${WEIGHTD_BUNDLE_STDCXX:-system}" "$budget" \
  "$(for n in "${steps_order[@]}"; do printf '%s=%s ' "$n" "${plan[$n]}"; done)" <<'EOF'
import json, os, sys, time
out, B, has_gpu, gpu_reason, t0, stdcxx, budget, plan = sys.argv[1:9]

def tail(p, n=3000):
    try:
        with open(p, "rb") as f:
            f.seek(0, 2); size = f.tell(); f.seek(max(0, size - n))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""

def load(p):
    try:
        return json.load(open(p))
    except FileNotFoundError:
        return None
    except Exception as e:
        return {"unreadable": "%s: %s" % (type(e).__name__, e), "tail": tail(p, 2000)}

steps = []
for line in open(os.path.join(out, "steps.tsv")):
    name, kind, status, rc, secs, reason, limit = (line.rstrip("\n").split("\t") + [""] * 7)[:7]
    steps.append({"name": name, "gpu": kind == "gpu", "status": status,
                  "rc": int(rc) if rc.lstrip("-").isdigit() else None,
                  "seconds": float(secs or 0), "reason": reason,
                  "limit_s": int(limit) if limit.isdigit() else None,
                  "output_tail": tail(os.path.join(out, "logs", name + ".log"),
                                      8000 if name in ("cuda_cast_test", "gpu_checks") else 3000)})
facts = load(os.path.join(out, "device_facts.json")) or {}
manifest = load(os.path.join(B, "MANIFEST.json")) or {}
manifest.pop("files", None)
counts = {s: sum(1 for x in steps if x["status"] == s) for s in ("pass", "fail", "timeout", "skipped")}
warnings = []
drv = (facts.get("nvidia_smi") or {}).get("driver_version")
cuda = manifest.get("cuda_compiler_version", "")
if drv and cuda.startswith("13.") and int(drv.split(".")[0]) < 580:
    warnings.append("driver %s is older than CUDA %s needs (580+): the binaries' static CUDA runtime "
                    "will say 'driver version is insufficient'" % (drv, cuda))
if manifest.get("python_client_stale_files"):
    warnings.append("bundle made from a stale build/python: " + " ".join(manifest["python_client_stale_files"]))
if has_gpu == "1" and not manifest.get("cuda_enabled_build", False):
    warnings.append("the bundled build is not a CUDA build")
report = {
    "schema": "weightd-gpu-report/1",
    "finished_unix": int(time.time()), "total_seconds": round(time.time() - float(t0), 1),
    "budget_seconds": int(budget),
    "step_budgets": {k: int(v) for k, v in (kv.split("=") for kv in plan.split())},
    "has_gpu": has_gpu == "1", "no_gpu_reason": "" if has_gpu == "1" else gpu_reason,
    "libstdcxx": stdcxx, "summary": counts, "ok": counts["fail"] == 0 and counts["timeout"] == 0,
    "warnings": warnings, "steps": steps, "device_facts": facts, "bundle": manifest,
    "python_client": load(os.path.join(out, "python_client.json")),
    "cuda_cast_test": load(os.path.join(out, "cuda_cast_test.json")),
    "gpu_checks": load(os.path.join(out, "gpu_checks.json")),
    "weightd_log_tail": tail(os.path.join(out, "logs", "weightd.log"), 3000),
}
with open(os.path.join(out, "report.json"), "w") as f:
    json.dump(report, f, indent=1)
gpus = [d.get("name", "?") for d in (facts.get("torch") or {}).get("devices", [])]
print("=" * 72)
print("weightd GPU run: %s | GPU: %s | driver %s | bundle CUDA %s | %.0f s" % (
    "OK" if report["ok"] else "FAILED", ", ".join(gpus) if gpus else "none (" + gpu_reason + ")",
    drv or "-", cuda or "-", report["total_seconds"]))
for s in steps:
    print("  %-8s %-18s %6.1fs  %s" % (s["status"].upper(), s["name"], s["seconds"], s["reason"]))
for w in warnings:
    print("  WARNING:", w)
print("report: %s/report.json" % out)
EOF
if [ ! -s "$OUT/report.json" ]; then
  echo "run_on_device: could not write report.json (python: $PY); steps:" >&2
  cat "$OUT/steps.tsv" >&2
  exit 2
fi
if cut -f3 "$OUT/steps.tsv" | grep -qE '^(fail|timeout)$'; then exit 1; fi
exit 0

#!/usr/bin/env bash
# Clang's thread-safety analysis over every translation unit of ours: each
# compile command of the build (compile_commands.json) is re-run with
# clang++ -fsyntax-only -Wthread-safety -Werror=thread-safety (no code is
# generated, so it costs a fraction of a build). Generated protobuf code and
# CUDA units (nvcc's flags; no locks there) are skipped. Fails when any unit
# has a finding.
#   scripts/thread_safety.sh [BUILD_DIR]   (default: build, configured)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
db="$build/compile_commands.json"
[ -f "$db" ] || { echo "thread_safety: $db is missing; configure $build first" >&2; exit 2; }
command -v clang++ >/dev/null || { echo "thread_safety: clang++ is not installed" >&2; exit 2; }
python3 - "$db" <<'PY' > "$build/thread_safety.cmds"
import json, shlex, sys
for c in json.load(open(sys.argv[1])):
    f = c["file"]
    if "/proto/gen/" in f or f.endswith((".cu", ".c")):  # generated code; nvcc and C units
        continue
    args = shlex.split(c["command"])[1:]
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("-o", "-MF", "-MT"):
            skip = True
            continue
        if a in ("-c", "-MD") or a.startswith("-fsanitize") or a == f:
            continue
        out.append(a)
    cmd = ["clang++", "-fsyntax-only", "-Wthread-safety", "-Werror=thread-safety",
           "-Wno-unknown-warning-option", "-Wno-error"] + out + ["-Werror=thread-safety", f]
    print("cd %s && %s" % (shlex.quote(c["directory"]), " ".join(shlex.quote(x) for x in cmd)))
PY
n=$(wc -l < "$build/thread_safety.cmds")
echo "thread_safety: $n translation units"
# -Werror from the g++ flags is dropped (-Wno-error): other clang-only
# warnings are not this check's business; thread-safety ones are errors.
tr '\n' '\0' < "$build/thread_safety.cmds" | xargs -0 -P"$(nproc)" -n1 bash -c
echo "thread_safety: clean"

#!/usr/bin/env bash
# Packs what a lent GPU machine needs to run our binaries and the Python client
# without any Debian package into ONE file, to be carried to the device:
#   tests/gpu/prepare_bundle.sh [BUILD_DIR=build] [OUT_DIR=gpu-bundle]
# Writes the tree OUT_DIR/ and the archive OUT_DIR.tar.xz (prints its size; fails
# above 60 MiB). Reads only the build (nothing is built here) and the system's
# libraries / python3-protobuf. See tests/gpu/README.md for the layout and why.
set -euo pipefail
umask 022
export LC_ALL=C
unset LD_LIBRARY_PATH LD_PRELOAD || true

repo=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$repo/build}
out=${2:-$repo/gpu-bundle}
build=$(cd "$build" && pwd)
out=${out%/}
archive=$out.tar.xz
limit_bytes=$((60 * 1024 * 1024))
protobuf_src=${WEIGHTD_PROTOBUF_PY:-/usr/lib/python3/dist-packages/google/protobuf}
py=/usr/bin/python3
start=$(date +%s)

die() { echo "prepare_bundle: error: $*" >&2; exit 1; }
warn() { echo "prepare_bundle: WARNING: $*" >&2; }

for tool in ldd objcopy objdump readelf tar xz sha256sum "$py"; do
  command -v "$tool" >/dev/null || die "needs $tool"
done
[ -x "$build/bin/weightd" ] || die "$build/bin/weightd missing (build first)"
[ -x "$build/bin/weightctl" ] || die "$build/bin/weightctl missing (build first)"
[ -f "$build/python/weightd/v1/weightd_pb2.py" ] || die "generated $build/python/weightd/v1/weightd_pb2.py missing"
[ -f "$build/python/weightd/v1/weightd_pb2_grpc.py" ] || die "generated $build/python/weightd/v1/weightd_pb2_grpc.py missing"
[ -f "$protobuf_src/__init__.py" ] || die "no python protobuf runtime at $protobuf_src (apt-get install python3-protobuf)"

bins=(weightd weightctl)
declare -A bin_src=([weightd]=$build/bin/weightd [weightctl]=$build/bin/weightctl)
if [ -x "$build/tests/cuda_cast_test" ]; then
  bins+=(cuda_cast_test)
  bin_src[cuda_cast_test]=$build/tests/cuda_cast_test
else
  warn "$build/tests/cuda_cast_test missing: the bundle will have no CUDA cast test"
fi
# Plugins the daemon dlopen()s (ldd cannot see them): libweightd_cuda_plugin.so,
# looked for beside the executable (/proc/self/exe: libexec/ here), so every
# shared object in BUILD_DIR/bin goes to libexec/ too.
plugins=()
for f in "$build"/bin/*.so "$build"/bin/*.so.*; do
  [ -f "$f" ] || continue
  p=$(basename "$f")
  plugins+=("$p")
  bin_src[$p]=$f
done
if grep -qa 'libweightd_cuda_plugin.so' "$build/bin/weightd" && [ ! -f "$build/bin/libweightd_cuda_plugin.so" ]; then
  die "weightd loads libweightd_cuda_plugin.so but $build/bin has none (build it first)"
fi
if ! grep -q '^WEIGHTD_CUDA_ENABLED_BUILD:INTERNAL=ON' "$build/CMakeCache.txt" 2>/dev/null; then
  warn "$build is not a CUDA build: on the device weightd will say 'built without CUDA'"
fi

rm -rf "$out" "$archive"
mkdir -p "$out/bin" "$out/libexec" "$out/lib" "$out/lib-fallback" "$out/python" "$out/pyproto/google"

# -- binaries: debug info dropped (symbols kept, so backtraces still name
# functions; the build id ties each to the unstripped file in BUILD_DIR), each
# behind a wrapper that puts the bundle's libraries first for that process only.
for p in "${plugins[@]}"; do
  objcopy --strip-debug "${bin_src[$p]}" "$out/libexec/$p"
  chmod 755 "$out/libexec/$p"
done
for b in "${bins[@]}"; do
  objcopy --strip-debug "${bin_src[$b]}" "$out/libexec/$b"
  chmod 755 "$out/libexec/$b"
  cat > "$out/bin/$b" <<EOF
#!/bin/sh
# Runs the bundled $b with the bundle's libraries first, for this process only
# (never exported to the caller: torch's python must keep its own libssl, libz).
# WEIGHTD_BUNDLE_STDCXX=bundled adds lib-fallback/ (Debian bookworm's libstdc++)
# for a system whose libstdc++ is older than the binaries need.
b=\$(CDPATH= cd -- "\$(dirname -- "\$0")/.." && pwd) || exit 127
libs="\$b/lib"
if [ "\${WEIGHTD_BUNDLE_STDCXX:-system}" = bundled ]; then libs="\$libs:\$b/lib-fallback"; fi
LD_LIBRARY_PATH="\$libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "\$b/libexec/$b" "\$@"
EOF
  chmod 755 "$out/bin/$b"
done

# -- shared libraries: everything ldd resolves, minus the glibc family (the
# device's own, which must be at least as new as what we link: GLIBC_2.34) and
# minus libstdc++ (see README: the device's is used; bookworm's goes to
# lib-fallback/ only). The driver (libcuda) must not be linked at all.
glibc_family='^(linux-vdso|ld-linux|libc|libm|libmvec|libpthread|libdl|librt|libresolv|libutil|libanl|libnsl|libBrokenLocale|libthread_db|libnss_[a-z]*|libgcc_s)\.so'
declare -A lib_src=()
for b in "${bins[@]}" "${plugins[@]}"; do
  ldd_out=$(ldd "${bin_src[$b]}") || die "ldd ${bin_src[$b]} failed"
  if grep -q 'not found' <<<"$ldd_out"; then
    die "$b has unresolved libraries here: $(grep 'not found' <<<"$ldd_out" | tr -s ' \t' ' ')"
  fi
  while read -r name arrow path _; do
    [ "$arrow" = "=>" ] || continue
    [[ "$path" == /* ]] || continue
    [[ "$name" =~ $glibc_family ]] && continue
    [[ "$name" =~ ^lib(cuda|nvidia-) ]] && die "$b links the driver ($name): it must load it at run time"
    lib_src[$name]=$path
  done <<<"$ldd_out"
done
for name in "${!lib_src[@]}"; do
  if [[ "$name" == libstdc++.so* ]]; then
    cp -L "${lib_src[$name]}" "$out/lib-fallback/$name"
  else
    cp -L "${lib_src[$name]}" "$out/lib/$name"
  fi
done
[ -n "$(ls "$out/lib")" ] || die "no libraries found (ldd output unexpected?)"

# -- no RPATH/RUNPATH in any bundled ELF: the build's (weightd's is
# "/usr/lib/x86_64-linux-gnu/openblas-pthread:", whose empty entry is the
# current directory: a library planted in the cwd would be loaded) means
# nothing on the device, where the wrappers' LD_LIBRARY_PATH is the one way
# libraries are found. The DT_RPATH/DT_RUNPATH entries are dropped from the
# dynamic section (its later entries move up; DT_NULL fills the end), as
# `patchelf --remove-rpath` does (no patchelf or chrpath here).
"$py" - "$out"/libexec/* "$out"/lib/* "$out"/lib-fallback/* <<'EOF' || die "removing RPATH/RUNPATH failed"
import os, struct, sys
DT_NULL, DT_RPATH, DT_RUNPATH, PT_DYNAMIC = 0, 15, 29, 2
for path in sys.argv[1:]:
    if not os.path.isfile(path):
        continue
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        if data[:4] != b"\x7fELF":
            continue
        if data[4] != 2 or data[5] != 1:
            sys.exit("%s: not a little-endian ELF64 file" % path)
        phoff, = struct.unpack_from("<Q", data, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
        for i in range(phnum):
            p_type, _, p_offset, _, _, p_filesz = struct.unpack_from(
                "<IIQQQQ", data, phoff + i * phentsize)
            if p_type != PT_DYNAMIC:
                continue
            entries = [struct.unpack_from("<qQ", data, p_offset + 16 * k)
                       for k in range(p_filesz // 16)]
            kept = [e for e in entries if e[0] not in (DT_RPATH, DT_RUNPATH)]
            if len(kept) < len(entries):
                kept += [(DT_NULL, 0)] * (len(entries) - len(kept))
                for k, (tag, val) in enumerate(kept):
                    struct.pack_into("<qQ", data, p_offset + 16 * k, tag, val)
                f.seek(0)
                f.write(data)
                print("prepare_bundle: removed RPATH/RUNPATH from", os.path.basename(path))
            break
EOF
for f in "$out"/libexec/* "$out"/lib/* "$out"/lib-fallback/*; do
  [ -f "$f" ] || continue
  if readelf -d "$f" 2>/dev/null | grep -qE '\((RPATH|RUNPATH)\)'; then
    die "$f still has an RPATH/RUNPATH: $(readelf -d "$f" | grep -E 'RPATH|RUNPATH')"
  fi
done

# -- Python: the package as the tests import it (build/python: the client's
# sources copied next to the generated weightd/v1/*_pb2*.py).
(cd "$build/python" && find weightd -name '__pycache__' -prune -o -type f -name '*.py' -print) |
  while read -r f; do mkdir -p "$out/python/$(dirname "$f")"; cp "$build/python/$f" "$out/python/$f"; done
stale=()
for f in "$repo"/client/python/weightd/*.py; do
  cmp -s "$f" "$out/python/weightd/$(basename "$f")" || stale+=("$(basename "$f")")
done
if ((${#stale[@]})); then
  warn "build/python is older than client/python/weightd (${stale[*]} differ): rebuild to bundle the current client"
fi

# ... and a pure-Python protobuf runtime matching the generated code (Debian's
# python3-protobuf, no C extension: those are built for this python, not the
# device's). internal/_api_implementation.py makes pure Python this copy's
# default even without PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python.
(cd "$(dirname "$protobuf_src")" && find protobuf -name '__pycache__' -prune -o -type f -name '*.py' -print) |
  while read -r f; do mkdir -p "$out/pyproto/google/$(dirname "$f")"; cp "$(dirname "$protobuf_src")/$f" "$out/pyproto/google/$f"; done
cat > "$out/pyproto/google/protobuf/internal/_api_implementation.py" <<'EOF'
# Added by tests/gpu/prepare_bundle.sh: this copy has no C extension, so pure
# Python is its compile-time default (api_version 0 = 'python').
api_version = 0
EOF

# -- check: the generated code works with this runtime, alone (python -S: no
# site packages, only the bundle), and record versions for the manifest.
protoc_bin=$(sed -n 's/^Protobuf_PROTOC_EXECUTABLE:FILEPATH=//p' "$build/CMakeCache.txt" 2>/dev/null || true)
protoc_version=$("${protoc_bin:-protoc}" --version 2>/dev/null | awk '{print $2}' || true)
PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python "$py" -S - "$out" "$protoc_version" <<'EOF' || die "generated protobuf code does not work with the bundled runtime"
import importlib.util, os, sys
out, protoc_version = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(out, "pyproto"))
import google.protobuf
from google.protobuf.internal import api_implementation
assert google.protobuf.__file__.startswith(out), google.protobuf.__file__
assert api_implementation.Type() == "python", api_implementation.Type()
# protoc 3.21.x <-> python runtime 4.21.x: the minor versions must agree.
if protoc_version:
    assert protoc_version.split(".")[1] == google.protobuf.__version__.split(".")[1], (
        "protoc %s vs python protobuf %s" % (protoc_version, google.protobuf.__version__))
# Load the generated module by path: importing the package would pull grpc/numpy.
path = os.path.join(out, "python", "weightd", "v1", "weightd_pb2.py")
spec = importlib.util.spec_from_file_location("weightd_pb2_bundle_check", path)
pb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pb)
m = pb.StatsResponse(cuda_built=True, gpus_unavailable="x")
m.gpus.add(uuid="GPU-00000000-0000-0000-0000-000000000000", ordinal=0, memory_bytes=1 << 40)
back = pb.StatsResponse.FromString(m.SerializeToString())
assert back == m and back.gpus[0].memory_bytes == 1 << 40
print("prepare_bundle: generated code OK with pure-Python protobuf", google.protobuf.__version__)
EOF

# -- manifest: what is in the bundle, where it came from, what it needs.
"$py" - "$out" "$repo" "$build" "$protoc_version" "${stale[*]:-}" <<'EOF'
import hashlib, json, os, re, subprocess, sys
out, repo, build, protoc_version, stale = sys.argv[1:6]

def sha(p):
    with open(p, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()

def run(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        return ""

def needs(path):
    syms = run("objdump", "-T", path)
    best = {}
    for fam in ("GLIBC", "GLIBCXX", "CXXABI"):
        vs = {tuple(int(x) for x in v.split(".")) for v in re.findall(r"\b%s_([0-9.]+[0-9])\b" % fam, syms)}
        if vs:
            best[fam] = fam + "_" + ".".join(map(str, max(vs)))
    return best

def maxver(items, fam):
    vs = [tuple(int(x) for x in d[fam].split("_", 1)[1].split(".")) for d in items if fam in d]
    return fam + "_" + ".".join(map(str, max(vs))) if vs else None

cache = {}
try:
    for line in open(os.path.join(build, "CMakeCache.txt")):
        k, _, v = line.rstrip("\n").partition("=")
        cache[k.split(":")[0]] = v
except OSError:
    pass
cuda_version = ""
for root, _, files in os.walk(os.path.join(build, "CMakeFiles")):
    if "CMakeCUDACompiler.cmake" in files:
        m = re.search(r'CMAKE_CUDA_COMPILER_VERSION "([^"]+)"', open(os.path.join(root, "CMakeCUDACompiler.cmake")).read())
        cuda_version = m.group(1) if m else ""
        break

entries, reqs = [], []
for sub in ("libexec", "lib", "lib-fallback"):
    for name in sorted(os.listdir(os.path.join(out, sub))):
        p = os.path.join(out, sub, name)
        e = {"path": sub + "/" + name, "sha256": sha(p), "bytes": os.path.getsize(p)}
        e["needs"] = needs(p)
        bid = re.search(r"Build ID: ([0-9a-f]+)", run("readelf", "-n", p))
        if sub == "libexec" and bid:
            e["build_id"] = bid.group(1)
        if sub != "lib-fallback":
            reqs.append(e["needs"])
        entries.append(e)

pbver = re.search(r"__version__ = '([^']+)'", open(os.path.join(out, "pyproto/google/protobuf/__init__.py")).read())
head = run("git", "-C", repo, "rev-parse", "HEAD")
dirty = bool(run("git", "-C", repo, "status", "--porcelain", "--untracked-files=no"))
manifest = {
    "schema": "weightd-gpu-bundle/1",
    "git_head": head, "git_dirty": dirty,
    "build_dir": os.path.relpath(build, repo) if build.startswith(repo) else build,
    "build_type": cache.get("CMAKE_BUILD_TYPE", ""),
    "cuda_enabled_build": cache.get("WEIGHTD_CUDA_ENABLED_BUILD") == "ON",
    "cuda_compiler_version": cuda_version,
    # not cached when cmake/WeightdCuda.cmake picks its default (90: H100/H200)
    "cuda_architectures": cache.get("CMAKE_CUDA_ARCHITECTURES") or (
        "90 (default of cmake/WeightdCuda.cmake)" if cache.get("WEIGHTD_CUDA_ENABLED_BUILD") == "ON" else ""),
    "binaries": sorted(os.listdir(os.path.join(out, "libexec"))),
    "requires": {fam: maxver(reqs, fam) for fam in ("GLIBC", "GLIBCXX", "CXXABI")},
    "python_protobuf": pbver.group(1) if pbver else "", "protoc": protoc_version,
    "python_client_stale_files": stale.split() if stale else [],
    "files": entries,
}
with open(os.path.join(out, "MANIFEST.json"), "w") as f:
    json.dump(manifest, f, indent=1, sort_keys=True)
    f.write("\n")
print("prepare_bundle: requires", manifest["requires"], "| CUDA", cuda_version or "-",
      "| cuda build:", manifest["cuda_enabled_build"])
EOF

cat > "$out/env.sh" <<'EOF'
# . env.sh — puts the bundle on PATH (wrappers) and PYTHONPATH (client and
# pure-Python protobuf). LD_LIBRARY_PATH is left alone on purpose: the wrappers
# in bin/ set it for our binaries only.
_wd_b=$(CDPATH= cd -- "$(dirname -- "${BASH_SOURCE[0]:-$0}")" && pwd)
export WEIGHTD_BUNDLE="$_wd_b"
export PATH="$_wd_b/bin:$PATH"
export PYTHONPATH="$_wd_b/python:$_wd_b/pyproto${PYTHONPATH:+:$PYTHONPATH}"
export PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python
unset _wd_b
EOF

# -- one deterministic archive: sorted names, fixed times and owners. xz -2 in
# multi-threaded mode (an explicit -T4: its output is the same for any thread
# count > 1, unlike -T0, which is single-threaded on one core): ~8 s for ~70 MB
# here, ~15 MB out (-6 saves 2 MB and costs 20 s more).
tar --sort=name --mtime='@0' --owner=0 --group=0 --numeric-owner --format=gnu \
    -C "$out" -cf - . | xz -2 -T4 -c > "$archive.tmp"
mv "$archive.tmp" "$archive"
size=$(stat -c %s "$archive")
echo "prepare_bundle: $archive: $size bytes ($(awk "BEGIN{printf \"%.1f\", $size/1048576}") MiB)" \
     "sha256 $(sha256sum "$archive" | cut -c1-16) in $(($(date +%s) - start)) s"
if ((size > limit_bytes)); then
  die "$archive is $size bytes, over the 60 MiB limit (the device call carries at most 64 MiB with the tree)"
fi
case "$archive" in
  "$repo"/*) echo "prepare_bundle: carry: ${archive#"$repo"/}" ;;
esac

#!/usr/bin/env bash
# Configures and builds weightd into ${BUILD_DIR:-build}.
#   scripts/build.sh [--release] [--sanitize address,undefined|thread] [extra cmake args]
set -euo pipefail
cd "$(dirname "$0")/.."
build_type=RelWithDebInfo
sanitize=""
extra=()
while (($#)); do
  case "$1" in
    --release) build_type=Release ;;
    --sanitize) sanitize="$2"; shift ;;
    *) extra+=("$1") ;;
  esac
  shift
done
BUILD_DIR=${BUILD_DIR:-build}
if [[ "$sanitize" == *thread* ]]; then
  # UCX's memory hooks (libucm's madvise, on the thread-exit path) call
  # into TSan's interceptors after TSan has let go of the exiting thread:
  # the daemon segfaults (even `weightd --help`, which the man page runs).
  # The hooks only feed UCX's registration cache; the daemon maps its
  # segments itself. Off in TSan builds, here and in what runs them.
  export UCX_MEM_EVENTS=no
fi
# ccache (installed by deps.sh) shares compiled units between build
# directories and runs: paths relative to the checkout, cwd not hashed.
launcher=()
if command -v ccache >/dev/null; then
  export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=1
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
fi
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="$build_type" \
  -DWEIGHTD_SANITIZE="$sanitize" "${launcher[@]}" "${extra[@]}"
cmake --build "$BUILD_DIR" -j"$(nproc)"

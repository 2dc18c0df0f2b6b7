#!/usr/bin/env bash
# The benchmark suite: builds weightd in Release (only the targets it needs),
# generates its inputs under bench/out/ (Llama-shaped bf16 checkpoints, LoRA
# adapters), runs every figure against its baseline in the same run, prints a
# markdown table and writes bench/results.json and bench/results.png.
#
#   bench/run.sh [--quick] [--no-build] [--repeats N]
#                [--only load,fetch,cast,lora,control,hugepages] [--merge]
#                [--out FILE] [--plot FILE] [--table FILE]
#
#   --quick     tiny checkpoints (10/37/167 MiB), 1 repeat: a smoke run (< 3 min)
#   full        0.3/1/3.9 GiB checkpoints, 3 repeats (~15 min; ~14 GiB of memory at
#               peak, ~6 GiB of disk under bench/out/)
#   --no-build  use the existing build in $BUILD_DIR (default build-rel)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build-rel}
build=1
args=()
while (($#)); do
  case "$1" in
    --no-build) build=0 ;;
    --quick|--merge) args+=("$1") ;;
    --repeats|--only|--out|--plot|--table) args+=("$1" "$2"); shift ;;
    *) echo "usage: bench/run.sh [--quick] [--no-build] [--repeats N] [--only LIST]" \
            "[--merge] [--out FILE] [--plot FILE] [--table FILE]" >&2; exit 2 ;;
  esac
  shift
done

if ! command -v gnuplot >/dev/null; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    echo "installing gnuplot-nox (for the plot)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gnuplot-nox >/dev/null ||
      echo "warning: gnuplot-nox did not install; no plot" >&2
  else
    echo "warning: gnuplot missing (apt-get install gnuplot-nox); no plot" >&2
  fi
fi

if ((build)); then
  if [[ -f $BUILD_DIR/CMakeCache.txt ]] &&
     ! grep -q '^CMAKE_BUILD_TYPE:STRING=Release$' "$BUILD_DIR/CMakeCache.txt"; then
    echo "error: $BUILD_DIR is not a Release build; set BUILD_DIR to another folder" >&2
    exit 2
  fi
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
  targets=(weightd weightctl weightd_python fetch_rank control_bench pread_bench)
  if grep -q '^build bench/cast_bench:' "$BUILD_DIR/build.ninja"; then targets+=(cast_bench); fi
  cmake --build "$BUILD_DIR" -j"$(nproc)" --target "${targets[@]}"
fi

exec /usr/bin/python3 bench/suite.py --build "$BUILD_DIR" "${args[@]}"

#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz with clang, ASan and UBSan into
# ${BUILD_DIR:-build-fuzz} and runs each for a time box, starting from a
# scratch copy of its seed corpus (tests/fuzz/corpus/<target>, never written).
#   scripts/fuzz.sh [SECONDS per target, default 60] [target ...]
# Targets default to all of them (safetensors_header safetensors_index profile
# adapter shard_cli fetch_request). Saved reproducers in
# tests/fuzz/regressions/<target>/ are replayed first. Fails when a
# reproducer still fails or a target finds a crash, leak, timeout or OOM; the
# input that did it is kept in $BUILD_DIR/fuzz-run/<target>/artifacts/.
# Prints one summary line per target (execs, execs/s, coverage).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS

seconds=${1:-60}
if (($#)); then shift; fi
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || ((seconds < 1)); then
  echo "usage: scripts/fuzz.sh [SECONDS per target] [target ...]" >&2
  exit 2
fi
targets=("$@")
if ((${#targets[@]} == 0)); then
  targets=(safetensors_header safetensors_index profile adapter shard_cli fetch_request)
fi
BUILD_DIR=${BUILD_DIR:-build-fuzz}
JOBS=${JOBS:-$(nproc)}

bash scripts/deps.sh
if ! grep -q 'add_subdirectory(fuzz)' tests/CMakeLists.txt; then
  echo "fuzz: tests/CMakeLists.txt does not add_subdirectory(fuzz) under WEIGHTD_FUZZ" >&2
  exit 1
fi

# libFuzzer's runtime ships separately from clang on some installs.
probe_dir=$(mktemp -d)
trap 'rm -rf "$probe_dir"' EXIT
echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' \
  >"$probe_dir/probe.cc"
if ! clang++ -fsanitize=fuzzer,address,undefined "$probe_dir/probe.cc" -o "$probe_dir/probe" \
  2>"$probe_dir/err"; then
  pkg="libclang-rt-$(clang++ -dumpversion | cut -d. -f1)-dev"
  echo "fuzz: clang cannot link -fsanitize=fuzzer; installing $pkg"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "$pkg"
fi

# Coverage instrumentation on every library; libFuzzer's main only on the
# fuzz executables (tests/fuzz/CMakeLists.txt). UB aborts like a crash.
flags="-fsanitize=fuzzer-no-link -fno-sanitize-recover=undefined"
CC=clang CXX=clang++ cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
  -DWEIGHTD_SANITIZE=address,undefined -DWEIGHTD_BUILD_TESTS=ON -DWEIGHTD_FUZZ=ON >/dev/null
cmake --build "$BUILD_DIR" --target weightd_fuzz -j"$JOBS"
build_s=$((SECONDS - start))

# Dictionaries of the tokens the parsers compare against, so mutations reach
# past the first field name.
write_dict() {
  case "$1" in
    safetensors_header)
      printf '%s\n' '"\"dtype\""' '"\"shape\""' '"\"data_offsets\""' '"\"__metadata__\""' \
        '"\"F64\""' '"\"F32\""' '"\"F16\""' '"\"BF16\""' '"\"I64\""' '"\"I32\""' '"\"I16\""' \
        '"\"I8\""' '"\"U8\""' '"\"BOOL\""' '"\"F8_E4M3\""' '"\"F8_E5M2\""' '"[0,0]"' '"{}"' ;;
    safetensors_index)
      printf '%s\n' '"\"weight_map\""' '"\"metadata\""' '"\"total_size\""' '"../"' \
        '".safetensors"' '"{}"' '"[]"' ;;
    profile)
      printf '%s\n' '"\"name_mapping\""' '"\"match\""' '"\"target\""' '"\"merge_index\""' \
        '"\"num_merges\""' '"\"placements\""' '"\"per_part\""' '"\"default_placements\""' \
        '"\"dtype_rules\""' '"\"dtype\""' '"\"quantize\""' '"\"scheme\""' \
        '"\"fp8_e4m3_per_tensor\""' '"\"expected\""' '"\"shape\""' '"\"strict\""' \
        '"\"allow_new\""' '"\"R\""' '"\"S0\""' '"\"S1\""' '"\"f32\""' '"\"bf16\""' '"\"keep\""' \
        '"\\\\1"' '"(.*)"' '"_extra_state"' '"_scale"' '"model\\\\."' ;;
    adapter)
      printf '%s\n' '"\"dtype\""' '"\"shape\""' '"\"data_offsets\""' '"\"F32\""' '"\"F16\""' \
        '"\"BF16\""' '"\"F8_E4M3\""' '"\"I32\""' '".lora_A.weight"' '".lora_B.weight"' \
        '".lora_B.bias"' '".lora_down.weight"' '".lora_up.weight"' '".alpha"' '".dora_scale"' \
        '".lora_magnitude_vector"' '".lora_embedding_A"' '".lora_embedding_B"' '".diff"' \
        '".diff_b"' '".diff_param"' '".set_weight"' '".set_param"' '"base_model.model."' \
        '"diffusion_model."' '"lora_unet_"' '"lora_te1_"' '"lora_transformer_"' \
        '"\"r\""' '"\"lora_alpha\""' '"\"use_rslora\""' '"\"use_dora\""' '"\"fan_in_fan_out\""' \
        '"\"bias\""' '"\"all\""' '"\"lora_only\""' '"\"rank_pattern\""' '"\"alpha_pattern\""' \
        '"\"modules_to_save\""' '"\"peft_type\""' '"\"LORA\""' '"\"init_lora_weights\""' ;;
    shard_cli)
      printf '%s\n' '"Shard("' '"Replicate()"' '"S0"' '"S15"' '"2x4"' '"keep"' '"f8_e4m3"' \
        '"bf16"' '"9223372036854775807"' ;;
    *) return 1 ;;
  esac
}

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export OPENBLAS_NUM_THREADS=1  # the adapter target's GEMMs: no thread pool per process

failed=0
summary=()
for t in "${targets[@]}"; do
  bin="$BUILD_DIR/fuzz/${t}_fuzz"
  if [ ! -x "$bin" ]; then
    echo "fuzz: no target $t ($bin)" >&2
    exit 2
  fi
  work="$BUILD_DIR/fuzz-run/$t"
  rm -rf "$work"
  mkdir -p "$work/corpus" "$work/artifacts"
  cp tests/fuzz/corpus/"$t"/* "$work/corpus/"
  dict=()
  if write_dict "$t" >"$work/dict"; then dict=(-dict="$work/dict"); fi

  regress=""
  if [ -d "tests/fuzz/regressions/$t" ] && [ -n "$(ls -A "tests/fuzz/regressions/$t")" ]; then
    if "$bin" -runs=1 tests/fuzz/regressions/"$t"/* >"$work/regressions.log" 2>&1; then
      regress=" regressions=pass"
    else
      regress=" regressions=FAIL($work/regressions.log)"
      failed=1
    fi
  fi

  echo "fuzz: $t for ${seconds}s"
  rc=0
  "$bin" "$work/corpus" "${dict[@]}" -max_total_time="$seconds" -max_len=65536 \
    -rss_limit_mb=2048 -timeout=30 -print_final_stats=1 -artifact_prefix="$work/artifacts/" \
    >"$work/fuzz.log" 2>&1 || rc=$?

  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/fuzz.log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$work/fuzz.log" | tail -1)
  cov=$(grep -o 'cov: [0-9]* ft: [0-9]* corp: [0-9]*' "$work/fuzz.log" | tail -1 || true)
  if ((rc == 0)); then
    status=ok
  else
    failed=1
    why=$(grep -m1 -E '^SUMMARY: |ERROR: libFuzzer: |FUZZ_CHECK failed' "$work/fuzz.log" || true)
    artifact=$(ls "$work/artifacts" 2>/dev/null | head -1)
    status="FAIL rc=$rc ${why:-see $work/fuzz.log}${artifact:+ input=$work/artifacts/$artifact}"
  fi
  summary+=("$(printf '%-20s execs=%-10s execs/s=%-7s %-32s %s%s' \
    "$t" "${execs:-?}" "${rate:-?}" "${cov:-cov: ?}" "$status" "$regress")")
done

echo
echo "fuzz summary (${seconds}s per target; logs in $BUILD_DIR/fuzz-run/<target>/fuzz.log):"
printf '  %s\n' "${summary[@]}"
echo "fuzz: build ${build_s}s, total $((SECONDS - start))s"
exit "$failed"

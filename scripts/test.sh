#!/usr/bin/env bash
# The one test command (README): installs what is missing, builds, and runs
# every test — C++ unit tests and the Python suites against the real daemon.
#   scripts/test.sh [--sanitize address,undefined|thread] [ctest args...]
#   WEIGHTD_TEST_HUGEPAGES=N: reserve N 2 MiB hugetlb pages for the run (below)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
# The layers (docs/architecture.md): every #include of the daemon and the
# clients against the table; fails before anything is built.
python3 scripts/check_layers.py

sanitize=""
ctest_args=()
while (($#)); do
  case "$1" in
    --sanitize) sanitize="$2"; shift ;;
    *) ctest_args+=("$1") ;;
  esac
  shift
done
if [ -n "$sanitize" ]; then
  export BUILD_DIR=${BUILD_DIR:-build-${sanitize//,/-}}
  bash scripts/build.sh --sanitize "$sanitize"
else
  export BUILD_DIR=${BUILD_DIR:-build}
  bash scripts/build.sh
  # Concurrency checked by the compiler: clang's thread-safety analysis
  # over every translation unit of this build (syntax only).
  bash scripts/thread_safety.sh "$BUILD_DIR"
  # The default build has the CUDA path where nvcc exists (WEIGHTD_CUDA=AUTO)
  # and UCX where libucx-dev does (WEIGHTD_UCX=AUTO), and the suites run
  # against it; the configuration with neither must still build (ccache
  # makes this mostly cache hits), and its daemon serves and loads from
  # peers beside UCX builds (test_peers_ucx.py, WEIGHTD_BUILD_NO_UCX).
  BUILD_DIR="$BUILD_DIR-cpu" bash scripts/build.sh -DWEIGHTD_CUDA=OFF -DWEIGHTD_UCX=OFF
  export WEIGHTD_BUILD_NO_UCX="$PWD/$BUILD_DIR-cpu"
fi
tsan_reports=""
if [[ "$sanitize" == *thread* ]]; then
  # Every process (daemon, weightctl, unit tests) writes its reports here;
  # any report fails the run, also from a daemon whose test passed.
  tsan_reports="$PWD/$BUILD_DIR/tsan-reports"
  rm -rf "$tsan_reports" && mkdir -p "$tsan_reports"
  export UCX_MEM_EVENTS=no  # see scripts/build.sh
  export TSAN_OPTIONS="suppressions=$PWD/tests/tsan.supp log_path=$tsan_reports/report ${TSAN_OPTIONS:-}"
fi
# Huge pages: WEIGHTD_TEST_HUGEPAGES=N (root, a writable vm.nr_hugepages)
# adds a pool of N 2 MiB hugetlb pages for this run, given back on exit
# whatever happens; the daemons under test (--huge-pages auto by default)
# then use it, and the huge-page tests run instead of skipping.
hp_sysfs=/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages
if [ "${WEIGHTD_TEST_HUGEPAGES:-0}" != 0 ]; then
  if [ -w "$hp_sysfs" ] && hp_old=$(cat "$hp_sysfs"); then
    trap 'echo "$hp_old" > "$hp_sysfs" 2>/dev/null || true; echo "huge pages: vm.nr_hugepages back to $hp_old" >&2' EXIT
    trap 'exit 130' INT TERM
    echo $((hp_old + WEIGHTD_TEST_HUGEPAGES)) > "$hp_sysfs" || true
    echo "huge pages: asked for $WEIGHTD_TEST_HUGEPAGES more 2 MiB pages; pool now $(cat "$hp_sysfs") (was $hp_old)" >&2
  else
    echo "huge pages: WEIGHTD_TEST_HUGEPAGES set but $hp_sysfs is not writable here; the huge-page tests skip" >&2
  fi
fi
# Our tests must run; ctest fails when it finds none.
rc=0
ctest --test-dir "$BUILD_DIR" --output-on-failure --no-tests=error -j2 "${ctest_args[@]}" || rc=$?
# A report file is a failure when it holds a report (TSan also writes its
# notices there).
if [ -n "$tsan_reports" ] && grep -lq "WARNING: ThreadSanitizer" "$tsan_reports"/report.* 2>/dev/null; then
  echo "ThreadSanitizer reports in $tsan_reports:" >&2
  set +o pipefail  # head closes the pipe early
  grep -h -A12 "WARNING: ThreadSanitizer" "$tsan_reports"/report.* | head -200 >&2
  rc=1
fi
exit "$rc"

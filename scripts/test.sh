#!/usr/bin/env bash
# The one test command (README): installs what is missing, builds, and runs
# every test — C++ unit tests and the Python suites against the real daemon.
#   scripts/test.sh [--sanitize address,undefined|thread] [ctest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh

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
fi
# Our tests must run; ctest fails when it finds none.
ctest --test-dir "$BUILD_DIR" --output-on-failure --no-tests=error -j2 "${ctest_args[@]}"

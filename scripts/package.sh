#!/usr/bin/env bash
# The installable artefacts, from a build made by scripts/build.sh:
#   BUILD_DIR/packages/weightd_<version>_<arch>.deb                daemon, weightctl, unit,
#                                                                   /etc/weightd, man pages
#   BUILD_DIR/packages/libweightd-client0.1_<version>_<arch>.deb   libweightd_client.so.0.1
#   BUILD_DIR/packages/libweightd-client-dev_<version>_<arch>.deb  headers, CMake package,
#                                                                   pkg-config
#   BUILD_DIR/dist/weightd-<version>-py3-none-any.whl               the Python client
#   scripts/package.sh [--no-build]   (BUILD_DIR defaults to build)
# With lintian installed it checks the packages and fails on an error or a
# warning (deploy/debian/lintian-overrides.txt: the tags accepted, with reasons).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
if [ "${1:-}" != "--no-build" ]; then
  bash scripts/deps.sh
  BUILD_DIR="$BUILD_DIR" bash scripts/build.sh
fi
rm -rf "$BUILD_DIR/packages"
(cd "$BUILD_DIR" && cpack -G DEB -B "$PWD/packages" >/dev/null)
rm -rf "$BUILD_DIR/packages/_CPack_Packages"
cmake --build "$BUILD_DIR" --target weightd_wheel >/dev/null
ls -l "$BUILD_DIR"/packages/*.deb "$BUILD_DIR"/dist/*.whl
if command -v lintian >/dev/null; then
  # Tags we accept, with reasons, in deploy/debian/lintian-overrides.txt.
  lintian --suppress-tags-from-file deploy/debian/lintian-overrides.txt \
    --fail-on error,warning "$BUILD_DIR"/packages/*.deb
fi

#!/usr/bin/env bash
# Installs the Debian bookworm packages weightd builds and tests with, if
# any is missing. Sourced or run by scripts/test.sh and scripts/demo.sh.
set -euo pipefail

WEIGHTD_PACKAGES=(
  cmake ninja-build g++ clang pkg-config ccache
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libabsl-dev libre2-dev libxxhash-dev nlohmann-json3-dev libcurl4-openssl-dev
  libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev prometheus-cpp-dev
  python3 python3-torch python3-numpy python3-grpcio python3-protobuf python3-pytest python3-xxhash
  python3-venv python3-setuptools python3-wheel python3-pip dpkg-dev fakeroot lintian
  podman runc containernetworking-plugins iptables debootstrap
  libucx-dev ucx-utils iperf3
)

missing=()
for p in "${WEIGHTD_PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]})); then
  echo "deps: installing ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; fi
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# [sources] test servers: nginx (HTTPS with ranges) and iperf3 (link rate, bench) from Debian;
# an S3-compatible server from npm: @20minutes/s3rver, the fork of s3rver that verifies SigV4
# signatures (s3rver 3.7.1 accepts any V4 signature). Pinned, installed outside the repo into
# WEIGHTD_TEST_TOOLS (default /opt/weightd-test), where tests/sources_servers.py finds it.
WEIGHTD_S3RVER_VERSION=5.0.0
WEIGHTD_TEST_TOOLS=${WEIGHTD_TEST_TOOLS:-/opt/weightd-test}
sources_missing=()
command -v nginx >/dev/null 2>&1 || sources_missing+=(nginx)
command -v iperf3 >/dev/null 2>&1 || sources_missing+=(iperf3)
command -v node >/dev/null 2>&1 || sources_missing+=(nodejs)
command -v npm >/dev/null 2>&1 || sources_missing+=(npm)
if ((${#sources_missing[@]})); then
  echo "deps: installing ${sources_missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; fi
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${sources_missing[@]}"
fi
if ! grep -qs "\"version\": \"$WEIGHTD_S3RVER_VERSION\"" \
    "$WEIGHTD_TEST_TOOLS/node_modules/@20minutes/s3rver/package.json"; then
  echo "deps: installing @20minutes/s3rver@$WEIGHTD_S3RVER_VERSION into $WEIGHTD_TEST_TOOLS"
  mkdir -p "$WEIGHTD_TEST_TOOLS"
  npm install --prefix "$WEIGHTD_TEST_TOOLS" --no-audit --no-fund --loglevel=error \
    "@20minutes/s3rver@$WEIGHTD_S3RVER_VERSION" >/dev/null
fi

#!/usr/bin/env bash
# Installs the Debian bookworm packages weightd builds and tests with, if
# any is missing. Sourced or run by scripts/test.sh and scripts/demo.sh.
set -euo pipefail

WEIGHTD_PACKAGES=(
  cmake ninja-build g++ clang pkg-config ccache
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libabsl-dev libre2-dev libxxhash-dev nlohmann-json3-dev
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

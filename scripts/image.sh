#!/usr/bin/env bash
# The weightd container image, built with podman from a Debian bookworm base
# made here (no image registry is reachable: debootstrap from the machine's
# Debian archive, imported as localhost/weightd-base:bookworm).
#
#   scripts/image.sh [--from packages|source] [--tag NAME] [--no-build]
#
#   --from packages  (default) deploy/Dockerfile.deb: the weightd .deb that
#                    scripts/package.sh makes from BUILD_DIR (default build),
#                    installed with its dependencies from Debian's archive
#   --from source    deploy/Dockerfile: compiles weightd inside a build stage
#                    (Release; ~10 min on 2 cores) and copies the binaries
#   --tag NAME       default localhost/weightd:<version>
#   --no-build       use BUILD_DIR as it is (packages only)
#
# Prints the image name last. The podman options this machine needs are in
# PODMAN_OPTS below, and tests/integration/test_image.py uses the same.
set -euo pipefail
cd "$(dirname "$0")/.."
from=packages tag="" build=1
while (($#)); do
  case "$1" in
    --from) from="$2"; shift ;;
    --tag) tag="$2"; shift ;;
    --no-build) build=0 ;;
    *) echo "usage: scripts/image.sh [--from packages|source] [--tag NAME] [--no-build]" >&2
       exit 2 ;;
  esac
  shift
done
case "$from" in packages|source) ;; *) echo "image: --from packages|source" >&2; exit 2 ;; esac
version=$(sed -n 's/^project(weightd VERSION \([0-9.]*\).*/\1/p' CMakeLists.txt)
tag=${tag:-localhost/weightd:$version}
BASE=localhost/weightd-base:bookworm
BUILD_DIR=${BUILD_DIR:-build}

if [ "$build" = 1 ]; then bash scripts/deps.sh; fi
for tool in podman debootstrap runc; do
  command -v "$tool" >/dev/null || { echo "image: $tool is missing (scripts/deps.sh installs it)" >&2; exit 1; }
done

# What podman needs on these machines, and why:
# - runc, not crun: the hosts mount cgroup v1 beside a v2 hierarchy with a
#   controller enabled, which crun refuses ("hybrid mode not supported");
# - rlimits no higher than the host grants: podman's defaults (nofile
#   1048576, nproc unlimited) exceed the hard limits here and the runtime
#   fails to set them.
nofile=$(ulimit -Hn)
if [ "$nofile" = unlimited ] || ((nofile > 65536)); then nofile=65536; fi
PODMAN_OPTS=(--runtime runc)
LIMITS=(--ulimit "nofile=$nofile:$nofile" --ulimit nproc=16384:16384)

# ---- the base image --------------------------------------------------------
if ! podman image exists "$BASE"; then
  # The Debian archive this machine's apt uses (deb822 or one-line sources).
  mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  if [ -z "$mirror" ]; then
    mirror=$(awk '$1 == "deb" && $2 !~ /^\[/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  fi
  [ -n "$mirror" ] || { echo "image: no Debian archive found in /etc/apt/sources*" >&2; exit 1; }
  rootfs=$(mktemp -d /tmp/weightd-rootfs.XXXXXX)
  trap 'rm -rf "$rootfs"' EXIT
  echo "image: debootstrap bookworm (minbase) into $rootfs" >&2
  debootstrap --variant=minbase bookworm "$rootfs" "$mirror" > "$rootfs.log" 2>&1 \
    || { tail -20 "$rootfs.log" >&2; exit 1; }
  rm -f "$rootfs.log"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
  rm -rf "$rootfs"
  trap - EXIT
  echo "image: base $BASE made" >&2
fi

# ---- the image ---------------------------------------------------------------
if [ "$from" = packages ]; then
  BUILD_DIR="$BUILD_DIR" bash scripts/package.sh $([ "$build" = 1 ] || echo --no-build) >&2
  ctx=$(mktemp -d /tmp/weightd-image.XXXXXX)
  trap 'rm -rf "$ctx"' EXIT
  cp "$BUILD_DIR"/packages/weightd_*.deb "$ctx/"
  podman "${PODMAN_OPTS[@]}" build "${LIMITS[@]}" --build-arg "BASE=$BASE" \
    -f deploy/Dockerfile.deb -t "$tag" "$ctx" >&2
else
  podman "${PODMAN_OPTS[@]}" build "${LIMITS[@]}" --build-arg "BUILD_BASE=$BASE" \
    --build-arg "RUNTIME_BASE=$BASE" -f deploy/Dockerfile -t "$tag" . >&2
fi

# It starts, as its own user, with no capability.
podman "${PODMAN_OPTS[@]}" run "${LIMITS[@]}" --rm --network none --cap-drop=ALL \
  --security-opt no-new-privileges "$tag" --help >/dev/null
echo "$tag"

#!/usr/bin/env python3
"""Fails on an #include that crosses the layers of docs/architecture.md.

CMake does not reject a cycle between static libraries, and a folder can
include a header of a library it does not link (the header compiles, the
symbol comes from somewhere else). So every `#include "..."` of the daemon
and the clients is checked against the table below:

  - a unit (a folder; the longest prefix wins) may include itself, any unit
    in a lower row, and the units its row entry names in its own row;
  - `deny` names lower units a unit must not include all the same (the
    transport never includes the GPU code or the service);
  - nothing below server/grpc includes grpcpp/ or generated protos, except
    proto/, common/grpc/ and server/fleet/;
  - CUDA headers only in the CUDA units; libcurl's only in server/source;
    UCX headers only in server/fleet/.

Tests (*_test.cc, tests/, bench/) are not checked: they may reach into any
layer they test. Usage: scripts/check_layers.py [ROOT]; exit 1 lists every
violation as FILE:LINE: what.
"""
import os
import re
import sys

# (unit, row, units of the same row it may include, lower units it may not)
UNITS = [
    ("common", 0, (), ()),
    ("proto", 0, ("common",), ()),  # proto/convert uses common's dtypes
    ("common/grpc", 1, (), ()),
    ("server/base", 1, (), ()),
    ("server/kernels", 2, (), ()),
    ("server/auth", 2, (), ()),
    ("server/memory", 2, (), ()),
    ("server/source", 2, (), ()),
    ("server/store", 3, (), ()),
    ("server/profile", 3, (), ()),
    ("server/adapter", 3, ("server/profile",), ()),
    ("server/fetch", 3, (), ()),
    ("server/materialize", 4, (), ()),
    ("server/lease", 4, (), ()),
    ("server/state", 4, (), ()),
    ("server/push", 5, (), ()),
    ("server/gpu", 5, ("server/push",), ()),
    ("server/service", 6, (), ("server/gpu", "server/push")),
    ("server/publish", 6, ("server/service",), ("server/gpu", "server/push")),
    ("server/engine", 7, (), ()),
    ("server/transport", 7, (), ("server/gpu", "server/service", "server/publish")),
    ("server/fleet", 7, (), ()),
    ("server/grpc", 8, (), ()),
    ("server/metrics", 8, (), ()),
    ("server/daemon", 9, (), ()),
    ("server/main.cc", 10, (), ()),
    # The clients: common, common/grpc and proto only (never server/).
    ("client", 20, (), ()),
]
CLIENT_ROWS = {"client"}
CLIENT_MAY = {"proto", "common", "common/grpc", "client"}
# Units whose files may include grpcpp/ or generated protos: row >= grpc,
# and these.
GRPC_OK = {"proto", "common/grpc", "server/fleet", "client"}
GRPC_ROW = 8
# Where a CUDA header may be included.
CUDA_OK_PREFIXES = ("server/gpu/plugin/", "server/kernels/cuda/", "client/cuda/")
# Where a UCX header may be included (the data plane between daemons).
UCX_OK_PREFIXES = ("server/fleet/",)
UCX_HEADER = re.compile(r"^(ucp|uct|ucs|ucm)/")

ROW = {u: r for u, r, _, _ in UNITS}
SIDEWAYS = {u: set(s) for u, _, s, _ in UNITS}
DENY = {u: set(d) for u, _, _, d in UNITS}

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^">]+)[">]')
GRPC_HEADER = re.compile(r'^(grpcpp/|grpc/|weightd/v\d+/|.*\.pb\.h$|.*\.grpc\.pb\.h$)')
CUDA_HEADER = re.compile(r'^(cuda[A-Za-z_]*\.h|cuda\.h|cuda_runtime.*\.h|cuda_fp16\.h|cuda_bf16\.h|'
                         r'nccl\.h|cub/|thrust/|cudaTypedefs\.h|device_launch_parameters\.h)')


def unit_of(path):
    best = None
    for u in ROW:
        if path == u or path.startswith(u + "/"):
            if best is None or len(u) > len(best):
                best = u
    return best


def is_test(path):
    base = os.path.basename(path)
    return (base.endswith("_test.cc") or base.endswith("_testing.h") or base.endswith("_testing.cc")
            or "/testing/" in path or path.startswith(("tests/", "bench/")))


def check_file(root, path, problems):
    src = unit_of(path)
    if src is None:
        return
    with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    for n, line in enumerate(lines, 1):
        m = INCLUDE.match(line)
        if not m:
            continue
        quote, inc = m.groups()
        where = "%s:%d" % (path, n)
        if CUDA_HEADER.match(inc) and not path.startswith(CUDA_OK_PREFIXES):
            problems.append("%s: CUDA header <%s> outside the CUDA units" % (where, inc))
            continue
        if inc.startswith("curl/") and not path.startswith("server/source/"):
            problems.append("%s: libcurl header <%s> outside server/source" % (where, inc))
            continue
        if UCX_HEADER.match(inc) and not path.startswith(UCX_OK_PREFIXES):
            problems.append("%s: UCX header <%s> outside server/fleet/" % (where, inc))
            continue
        if GRPC_HEADER.match(inc) and not inc.startswith("proto/"):
            if src not in GRPC_OK and ROW[src] < GRPC_ROW:
                problems.append("%s: %s includes %s (gRPC is for server/grpc and above, "
                                "common/grpc and server/fleet)" % (where, src, inc))
            continue
        if quote != '"':
            continue
        dst = unit_of(inc)
        if dst is None:
            # a header beside the file, or a third-party header in quotes
            continue
        if dst == src:
            continue
        if src in CLIENT_ROWS:
            if dst not in CLIENT_MAY:
                problems.append("%s: the client includes %s (%s)" % (where, inc, dst))
            continue
        if dst in CLIENT_ROWS:
            problems.append("%s: %s includes the client's %s" % (where, src, inc))
            continue
        if dst in DENY[src]:
            problems.append("%s: %s must not include %s (%s)" % (where, src, dst, inc))
        elif ROW[dst] < ROW[src] or dst in SIDEWAYS[src]:
            continue
        else:
            problems.append("%s: %s (row %d) includes %s (row %d): %s" %
                            (where, src, ROW[src], dst, ROW[dst], inc))


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    root = os.path.abspath(root)
    problems = []
    count = 0
    for top in ("common", "server", "client", "proto"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames[:] = [d for d in dirnames if d not in ("python", "build")]
            for name in filenames:
                if not name.endswith((".h", ".cc", ".c", ".cu", ".cuh", ".inc")):
                    continue
                path = os.path.relpath(os.path.join(dirpath, name), root)
                if is_test(path):
                    continue
                count += 1
                check_file(root, path, problems)
    for p in problems:
        print(p)
    if problems:
        print("check_layers: %d include(s) cross the layers (docs/architecture.md)" % len(problems),
              file=sys.stderr)
        return 1
    print("check_layers: %d files, every include within the layers" % count)
    return 0


if __name__ == "__main__":
    sys.exit(main())

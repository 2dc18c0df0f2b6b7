"""scripts/check_layers.py: the layer table of docs/architecture.md holds for
this tree, and an include that crosses it is caught (upward, sideways, a
denied edge, gRPC or CUDA below their layers, the client reaching into the
daemon), each named with its file and line."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CHECK = os.path.join(ROOT, "scripts", "check_layers.py")


def run(root):
    return subprocess.run([sys.executable, CHECK, root], capture_output=True, text=True)


def test_the_tree_is_within_its_layers():
    r = run(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "every include within the layers" in r.stdout


@pytest.mark.parametrize("path,include,words", [
    ("server/store/x.cc", '"server/service/model.h"', "server/store (row 3) includes server/service"),
    ("server/push/x.cc", '"server/gpu/gpu_devices.h"', "server/push (row 5) includes server/gpu"),
    ("server/transport/x.cc", '"server/gpu/cuda_push_writer.h"',
     "server/transport must not include server/gpu"),
    ("server/service/x.h", '"server/publish/publish_types.h"',
     "server/service (row 6) includes server/publish"),
    ("server/engine/x.cc", "<grpcpp/grpcpp.h>", "gRPC is for server/grpc and above"),
    ("server/memory/x.cc", '"weightd/v1/weightd.pb.h"', "gRPC is for server/grpc and above"),
    ("server/transport/x.cc", "<cuda_runtime_api.h>", "CUDA header"),
    ("client/x.cc", '"server/base/log.h"', "the client includes server/base/log.h"),
    ("common/x.cc", '"server/base/log.h"', "common (row 0) includes server/base"),
])
def test_a_crossing_include_is_named(tmp_path, path, include, words):
    tree = tmp_path / "tree"
    for top in ("common", "server", "client", "proto"):
        shutil.copytree(os.path.join(ROOT, top), tree / top,
                        ignore=shutil.ignore_patterns("python", "*.py", "*.txt", "*.json"))
    (tree / path).write_text('#include "common/fd.h"\n#include %s\n' % include)
    r = run(str(tree))
    assert r.returncode == 1, r.stdout
    assert r.stdout.splitlines() == ["%s:2: " % path + r.stdout.split(":2: ", 1)[1].strip()]
    assert words in r.stdout, r.stdout
    assert "1 include(s) cross the layers" in r.stderr

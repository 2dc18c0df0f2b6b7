"""The GPU-device bundle, checked here on the CPU (tests/gpu/README.md).

prepare_bundle.sh packs build/bin/{weightd,weightctl}, cuda_cast_test, the
Python client with its generated stubs, the non-glibc shared libraries and a
pure-Python protobuf into one archive; run_on_device.sh runs the checks from it
on a lent GPU machine that has none of our Debian packages. Here we prove what
can be proved without a device: the archive is small and reproducible; the
binaries start with nothing but glibc + libstdc++ from the system (the rest of
/usr/lib/x86_64-linux-gnu hidden in a private mount namespace, where one can be
made); the client imports and talks to the daemon with no site packages but the
bundle's protobuf (grpc and numpy borrowed from Debian: the device has its own,
grpcio and torch's numpy); run_on_device.sh completes, marks every GPU step
"skipped: no GPU", and records a failing or hanging step without stopping.

Run: /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/gpu/test_bundle.py
(WEIGHTD_BUILD picks the build directory, default build/).
"""
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.abspath(os.environ.get("WEIGHTD_BUILD", os.path.join(REPO, "build")))
PREPARE = os.path.join(REPO, "tests", "gpu", "prepare_bundle.sh")
RUN = os.path.join(REPO, "tests", "gpu", "run_on_device.sh")
LIMIT = 60 * 1024 * 1024
SYSLIB = "/usr/lib/x86_64-linux-gnu"
# What the device is assumed to provide (brief: glibc >= 2.36) and what the
# bundle therefore leaves out; libstdc++ is the device's too (lib-fallback/ has
# bookworm's for a device whose copy is too old).
GLIBC_FAMILY = re.compile(r"^(linux-vdso|ld-linux|libc|libm|libmvec|libpthread|libdl|librt|libresolv|"
                          r"libutil|libanl|libnsl|libBrokenLocale|libthread_db|libnss_[a-z]*|libgcc_s)\.so")
CLEAN_PATH = "PATH=/usr/bin:/bin"


def _ver(s):
    return tuple(int(x) for x in s.split("_", 1)[1].split("."))


def _prepare(out):
    t = time.monotonic()
    r = subprocess.run(["bash", PREPARE, BUILD, out], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    return r, time.monotonic() - t


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    if not os.path.exists(os.path.join(BUILD, "bin", "weightd")):
        pytest.fail("no %s/bin/weightd: build first (scripts/build.sh)" % BUILD)
    base = tmp_path_factory.mktemp("gpu-bundle")
    r, secs = _prepare(str(base / "gpu-bundle"))
    archive = str(base / "gpu-bundle.tar.xz")
    unpacked = base / "unpacked"
    unpacked.mkdir()
    with tarfile.open(archive) as t:   # what travels is the archive, not the staging dir
        t.extractall(unpacked)
    return {"archive": archive, "dir": str(unpacked), "base": base, "log": r.stdout + r.stderr,
            "seconds": secs, "manifest": json.load(open(unpacked / "MANIFEST.json"))}


def test_one_archive_under_the_limit(bundle):
    size = os.path.getsize(bundle["archive"])
    assert size <= LIMIT, "%d bytes > 60 MiB" % size
    assert "%d bytes" % size in bundle["log"], bundle["log"]   # it prints its size
    # How long it took is reported, not asserted: a timed test fails on a
    # loaded machine and proves nothing about the bundle.
    print("bundle made in %.1f s" % bundle["seconds"])


def test_archive_is_reproducible(bundle):
    # Same build, same bytes: sorted names, fixed times/owners, xz -T4 output
    # independent of the thread count. (A rebuild between the two runs changes
    # the binaries, so this needs a quiet build directory, as under ctest.)
    again = str(bundle["base"] / "again" / "b")
    _prepare(again)
    digest = lambda p: hashlib.sha256(open(p, "rb").read()).hexdigest()
    assert digest(again + ".tar.xz") == digest(bundle["archive"])


def test_contents(bundle):
    d, m = bundle["dir"], bundle["manifest"]
    for exe in ("weightd", "weightctl"):
        assert os.access(os.path.join(d, "bin", exe), os.X_OK)
        assert os.access(os.path.join(d, "libexec", exe), os.X_OK)
    if os.path.exists(os.path.join(BUILD, "tests", "cuda_cast_test")):
        assert "cuda_cast_test" in m["binaries"]
    # plugins the daemon dlopen()s (libweightd_cuda_plugin.so) sit beside the real executable
    for f in os.listdir(os.path.join(BUILD, "bin")):
        if ".so" in f:
            assert os.path.isfile(os.path.join(d, "libexec", f)), f
    libs = os.listdir(os.path.join(d, "lib"))
    assert libs and not [l for l in libs if GLIBC_FAMILY.match(l) or l.startswith("libstdc++")], libs
    assert not [l for l in libs if l.startswith(("libcuda", "libnvidia"))], libs
    assert os.listdir(os.path.join(d, "lib-fallback")) in ([], ["libstdc++.so.6"])
    for f in ("weightd/__init__.py", "weightd/client.py", "weightd/v1/weightd_pb2.py",
              "weightd/v1/weightd_pb2_grpc.py"):
        assert os.path.isfile(os.path.join(d, "python", f)), f
    so = [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs if f.endswith(".so") and "pyproto" in r]
    assert not so, so                                  # no C extension built for this python
    # Runs where glibc >= 2.34 and a libstdc++ of gcc >= 11 are: within the
    # device's assumed glibc >= 2.36 with its own (newer) libstdc++.
    assert _ver(m["requires"]["GLIBC"]) <= (2, 36), m["requires"]
    assert _ver(m["requires"]["GLIBCXX"]) <= (3, 4, 30), m["requires"]
    assert m["python_protobuf"].split(".")[1] == m["protoc"].split(".")[1], m


def test_no_bundled_elf_has_an_rpath(bundle):
    """No RPATH/RUNPATH in any bundled ELF: the build's weightd carries
    "/usr/lib/x86_64-linux-gnu/openblas-pthread:", whose empty entry makes
    the loader search the current directory (a library planted there would
    be loaded); on the device the wrappers' LD_LIBRARY_PATH is the one way
    libraries are found. (The test_binaries_* tests show they still run.)"""
    d = bundle["dir"]
    seen = 0
    for sub in ("libexec", "lib", "lib-fallback"):
        for name in os.listdir(os.path.join(d, sub)):
            path = os.path.join(d, sub, name)
            with open(path, "rb") as f:
                if f.read(4) != b"\x7fELF":
                    continue
            seen += 1
            r = subprocess.run(["readelf", "-d", path], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
            paths = re.findall(r"\((?:RPATH|RUNPATH)\)\s+Library r(?:un)?path: \[(.*)\]", r.stdout)
            assert not paths, "%s/%s: %s" % (sub, name, paths)
    assert seen >= 3
    # what the build itself has (why this matters): an empty entry, if any
    r = subprocess.run(["readelf", "-d", os.path.join(BUILD, "bin", "weightd")],
                       capture_output=True, text=True)
    for entry in re.findall(r"Library r(?:un)?path: \[(.*)\]", r.stdout):
        print("build/bin/weightd RPATH/RUNPATH entries:", entry.split(":"))


def _libs_listed(out):
    """[(soname, resolved or 'not found')] from ldd / ld.so --list output."""
    got = []
    for line in out.splitlines():
        line = line.strip()
        if "=>" in line:
            name, _, rest = line.partition("=>")
            rest = rest.strip()
            got.append((name.strip(), "not found" if rest.startswith("not found") else rest.split(" (")[0]))
    return got


def _check_resolution(out, d, stdcxx_dirs):
    assert "not found" not in out, out
    listed = _libs_listed(out)
    assert listed, out
    for name, path in listed:
        if name.startswith("libstdc++"):
            assert os.path.dirname(path) in stdcxx_dirs, (name, path)
        elif not GLIBC_FAMILY.match(name):
            assert os.path.dirname(path) == os.path.join(d, "lib"), (name, path)


def test_binaries_run_in_a_clean_environment(bundle):
    d = bundle["dir"]
    libenv = "LD_LIBRARY_PATH=" + os.path.join(d, "lib")
    for exe in ("weightd", "weightctl"):
        # the ELF itself, with only the bundle's lib dir ...
        r = subprocess.run(["env", "-i", CLEAN_PATH, libenv, os.path.join(d, "libexec", exe), "--help"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and "usage: " + exe in r.stdout + r.stderr, r.stdout + r.stderr
        # ... and its wrapper, with nothing at all
        r = subprocess.run(["env", "-i", CLEAN_PATH, os.path.join(d, "bin", exe), "--help"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and "usage: " + exe in r.stdout + r.stderr, r.stdout + r.stderr
    for exe in os.listdir(os.path.join(d, "libexec")):
        r = subprocess.run(["env", "-i", CLEAN_PATH, libenv, "ldd", os.path.join(d, "libexec", exe)],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        _check_resolution(r.stdout, d, {SYSLIB, "/lib/x86_64-linux-gnu"})


def _hidden_dir(tmp_path, with_stdcxx):
    """A stand-in for /usr/lib/x86_64-linux-gnu with the glibc family only."""
    keep = ["libc.so.6", "libm.so.6", "ld-linux-x86-64.so.2", "libgcc_s.so.1", "libpthread.so.0",
            "libdl.so.2", "librt.so.1", "libresolv.so.2", "libmvec.so.1"]
    if with_stdcxx:
        keep.append("libstdc++.so.6")
    hidden = tmp_path / ("sys-with-stdcxx" if with_stdcxx else "sys-glibc-only")
    hidden.mkdir()
    for k in keep:
        if os.path.exists(os.path.join(SYSLIB, k)):
            shutil.copy2(os.path.realpath(os.path.join(SYSLIB, k)), hidden / k)
    return str(hidden)


def _in_namespace(hidden, argv):
    """argv run where /usr/lib/x86_64-linux-gnu is `hidden` (private mount
    namespace: nothing leaks to this machine), in a clean environment."""
    return subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         'mount --bind "$0" %s && exec env -i %s "$@"' % (SYSLIB, CLEAN_PATH), hidden] + argv,
        capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("system_stdcxx", [True, False], ids=["system-libstdcxx", "bundled-libstdcxx"])
def test_binaries_run_with_the_debian_libraries_hidden(bundle, tmp_path, system_stdcxx):
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0 or not os.path.isdir(SYSLIB):
        pytest.skip("no private mount namespace here (unshare -m needs root or user namespaces): "
                    "only the ldd check above ran")
    d = bundle["dir"]
    hidden = _hidden_dir(tmp_path, system_stdcxx)
    libs = os.path.join(d, "lib") + ("" if system_stdcxx else ":" + os.path.join(d, "lib-fallback"))
    stdcxx_dirs = {SYSLIB, "/lib/x86_64-linux-gnu"} if system_stdcxx else {os.path.join(d, "lib-fallback")}
    for exe in os.listdir(os.path.join(d, "libexec")):
        path = os.path.join(d, "libexec", exe)
        r = _in_namespace(hidden, ["LD_LIBRARY_PATH=" + libs, "/lib64/ld-linux-x86-64.so.2", "--list", path])
        assert r.returncode == 0, r.stdout + r.stderr
        _check_resolution(r.stdout, d, stdcxx_dirs)
        if ".so" in exe:   # a plugin: resolving is all there is to check here
            continue
        args = ["--gtest_list_tests"] if exe == "cuda_cast_test" else ["--help"]
        r = _in_namespace(hidden, ["LD_LIBRARY_PATH=" + libs, path] + args)
        assert r.returncode == 0, r.stdout + r.stderr
        # the wrapper picks lib-fallback/ when told to (run_on_device.sh decides)
        r = _in_namespace(hidden, ["WEIGHTD_BUNDLE_STDCXX=" + ("system" if system_stdcxx else "bundled"),
                                   os.path.join(d, "bin", exe)] + args)
        assert r.returncode == 0, r.stdout + r.stderr
    # and the test is real: without the bundle nothing resolves
    r = _in_namespace(hidden, ["/lib64/ld-linux-x86-64.so.2", "--list", os.path.join(d, "libexec", "weightd")])
    assert r.returncode != 0 and re.search("not found|cannot open shared object", r.stdout + r.stderr), (
        r.stdout + r.stderr)


def _debian_module_dirs(*mods):
    """{name: dir} of modules the device brings itself (grpcio, torch's numpy),
    borrowed here from Debian's python3-grpcio / python3-numpy."""
    code = "import json, os, importlib; print(json.dumps({m: os.path.dirname(importlib.import_module(m).__file__) for m in %r}))" % (mods,)
    r = subprocess.run(["/usr/bin/python3", "-c", code], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    if r.returncode != 0:
        pytest.skip("/usr/bin/python3 lacks %s here: %s" % (mods, r.stderr.strip().splitlines()[-1:]))
    return json.loads(r.stdout)


@pytest.fixture
def daemon(bundle, tmp_path):
    d = bundle["dir"]
    sock = os.path.join("/tmp", "wdtb-%d-%d.sock" % (os.getpid(), int(time.time() * 1000) % 100000))
    (tmp_path / "models").mkdir()
    p = subprocess.Popen([os.path.join(d, "bin", "weightd"), "--socket", sock, "--model-root",
                          str(tmp_path / "models")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         env={"PATH": "/usr/bin:/bin"})
    try:
        for _ in range(100):
            if subprocess.run([os.path.join(d, "bin", "weightctl"), "--socket", sock, "health"],
                              capture_output=True, env={"PATH": "/usr/bin:/bin"}).returncode == 0:
                break
            assert p.poll() is None, p.stderr.read().decode()
            time.sleep(0.1)
        else:
            pytest.fail("bundled weightd did not serve")
        yield sock
    finally:
        p.terminate()
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


CLIENT_CHECK = r'''
import json, sys
B, shim, sock = sys.argv[1:4]
sys.path[:0] = [B + "/python", B + "/pyproto"]
sys.path.append(shim)
import google.protobuf
from google.protobuf.internal import api_implementation
import weightd
from weightd.v1 import weightd_pb2 as pb
m = pb.FetchRequest(model="x", mesh_shape=[2, 4], coord=[1, 2], changed_since=7)
assert pb.FetchRequest.FromString(m.SerializeToString()) == m
with weightd.Client(socket=sock, retry_deadline=0) as c:
    health = c.health()
    stats = c.stats()
files = sorted({getattr(mod, "__file__", None) or "" for mod in list(sys.modules.values())})
print(json.dumps({"protobuf": google.protobuf.__file__, "impl": api_implementation.Type(),
                  "version": google.protobuf.__version__, "weightd": weightd.__file__,
                  "health": health, "cuda_built": bool(stats["cuda_built"]),
                  "gpus_unavailable": stats["gpus_unavailable"],
                  "site": [f for f in files if "-packages" in f]}))
'''


def test_python_client_needs_only_the_bundled_protobuf(bundle, tmp_path, daemon):
    d = bundle["dir"]
    shim = tmp_path / "device-provides"   # grpc + numpy only, never google.protobuf
    shim.mkdir()
    for name, path in _debian_module_dirs("grpc", "numpy").items():
        os.symlink(path, shim / name)
    # python -S: no site packages; a clean environment, so not even
    # PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION: the bundle's own default is pure Python.
    r = subprocess.run(["env", "-i", CLEAN_PATH, "/usr/bin/python3", "-S", "-c", CLIENT_CHECK, d, str(shim), daemon],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["protobuf"].startswith(os.path.join(d, "pyproto")), got
    assert got["weightd"].startswith(os.path.join(d, "python")), got
    assert got["impl"] == "python" and got["health"] is True, got
    assert got["site"] == [], got   # nothing from any site-packages / dist-packages
    # the shim does not smuggle protobuf in: without the bundle's copy the client cannot load
    no_proto = CLIENT_CHECK.replace('B + "/pyproto"]', ']')
    r = subprocess.run(["env", "-i", CLEAN_PATH, "/usr/bin/python3", "-S", "-c", no_proto, d, str(shim), daemon],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "No module named 'google'" in r.stderr, r.stderr


def _run_on_device(bundle_path, out, extra_env=None, timeout=240):
    env = dict(os.environ, OUT=str(out), PYTHON="/usr/bin/python3")
    env.update(extra_env or {})
    t = time.monotonic()
    r = subprocess.run(["bash", RUN, bundle_path], capture_output=True, text=True, env=env, timeout=timeout)
    report = json.load(open(os.path.join(out, "report.json")))
    return r, report, time.monotonic() - t


def test_run_on_device_here_skips_the_gpu_steps(bundle, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    r, rep, _ = _run_on_device(bundle["archive"], out)
    steps = {s["name"]: s for s in rep["steps"]}
    if rep["has_gpu"]:   # on a GPU machine this is the real run: everything must pass
        assert r.returncode == 0 and rep["ok"], r.stdout + r.stderr
        return
    assert r.returncode == 0, r.stdout + r.stderr
    assert rep["ok"] and rep["no_gpu_reason"], rep["no_gpu_reason"]
    for name in ("cuda_cast_test", "gpus_match_torch", "gpu_checks"):
        assert steps[name]["gpu"] and steps[name]["status"] == "skipped", steps[name]
    for name in ("cuda_cast_test", "gpus_match_torch"):
        assert steps[name]["reason"].startswith("skipped: no GPU"), steps[name]
    for name in ("device_facts", "unpack", "libraries", "binaries_start", "daemon", "python_client",
                 "daemon_stop"):
        assert steps[name]["status"] == "pass", steps[name]
        assert steps[name]["seconds"] >= 0 and "output_tail" in steps[name]
    assert "no GPU: " in steps["daemon"]["output_tail"], steps["daemon"]["output_tail"]
    # the bundled daemon finds its CUDA plugin (when the build has one): what it
    # lacks here is the driver, not a file of the bundle
    assert "plugin cannot be loaded" not in steps["daemon"]["output_tail"], steps["daemon"]["output_tail"]
    assert rep["python_client"]["protobuf_impl"] == "python", rep["python_client"]
    assert rep["python_client"]["fetched"]["values"] == [4.0, 5.0, 6.0, 7.0]
    assert rep["bundle"]["binaries"] == bundle["manifest"]["binaries"]
    assert "device_facts" in rep and "host" in rep["device_facts"]
    assert rep["total_seconds"] < 8 * 60


def _dry_run(budget, extra_env=None):
    env = dict(os.environ, WEIGHTD_GPU_BUDGET_S=str(budget))
    env.pop("WEIGHTD_GPU_CHECKS_TIMEOUT_S", None)
    env.update(extra_env or {})
    r = subprocess.run(["bash", RUN, "--dry-run"], capture_output=True, text=True, env=env,
                       timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [(m.group(1), int(m.group(2))) for m in
            re.finditer(r"^  (\S+)\s+(\d+) s", r.stdout, re.M)]
    return r.stdout, rows


STEPS = ["device_facts", "unpack", "libraries", "binaries_start", "cuda_cast_test", "daemon",
         "gpus_match_torch", "weightctl_cuda", "python_client", "daemon_stop", "gpu_checks"]


@pytest.mark.parametrize("budget", [100, 240, 450, 600])
def test_dry_run_step_budgets_add_up_to_the_limit(budget, tmp_path):
    """--dry-run runs nothing (no OUT, no report) and prints each step's
    budget, in the order the steps run, then the reserve: they add up to
    WEIGHTD_GPU_BUDGET_S, gpu_checks getting the largest share."""
    out, rows = _dry_run(budget, {"OUT": str(tmp_path / "out")})
    names = [n for n, _ in rows]
    assert names == STEPS + ["reserve", "total"], out
    steps = dict(rows)
    assert sum(v for n, v in rows if n != "total") == budget == steps["total"], out
    assert all(v >= 0 for v in steps.values()), out
    assert steps["gpu_checks"] == max(steps[n] for n in STEPS), out
    if budget >= 240:
        assert steps["gpu_checks"] >= 80 and steps["device_facts"] >= 30, out
    assert not (tmp_path / "out").exists()
    # a cap on gpu_checks leaves the rest unused, still adding up
    out, rows = _dry_run(budget, {"WEIGHTD_GPU_CHECKS_TIMEOUT_S": "20"})
    steps = dict(rows)
    assert steps["gpu_checks"] <= 20 and [n for n, _ in rows][-3:] == ["unused", "reserve", "total"]
    assert sum(v for n, v in rows if n != "total") == budget == steps["total"], out


def test_gpu_checks_is_given_its_real_budget(bundle, tmp_path):
    """gpu_checks.py is told how long it has (--budget: what is left of the
    run less the step's grace), never more than its step's limit, so its
    own checks finish or skip within it instead of being killed mid-check:
    with the README's quick budget (240 s) the run ends within it, and the
    report lists every step's limit and the plan."""
    fake = tmp_path / "fake_checks.py"
    fake.write_text(
        "import json, os, sys\n"
        "a = sys.argv\n"
        "b = float(a[a.index('--budget') + 1]) if '--budget' in a else None\n"
        "json.dump({'budget': b, 'env': os.environ.get('WD_STEP_BUDGET_S')},\n"
        "          open(a[a.index('--out') + 1], 'w'))\n")
    out = tmp_path / "out"
    out.mkdir()
    r, rep, secs = _run_on_device(bundle["dir"], out, {
        "WEIGHTD_GPU_CHECKS": str(fake), "WEIGHTD_GPU_CHECKS_WITHOUT_GPU": "1",
        "WEIGHTD_GPU_BUDGET_S": "240"})
    steps = {s["name"]: s for s in rep["steps"]}
    assert r.returncode == 0 and steps["gpu_checks"]["status"] == "pass", r.stdout + r.stderr
    limit = steps["gpu_checks"]["limit_s"]
    got = rep["gpu_checks"]
    assert got["budget"] is not None, got   # told, not left to its default
    assert int(got["env"]) == limit and 0 < got["budget"] <= limit - 8, (got, limit)
    # at least its planned share (the steps before it left time unused), within the run
    assert rep["step_budgets"]["gpu_checks"] <= limit, (rep["step_budgets"], limit)
    assert sum(rep["step_budgets"].values()) + 15 == rep["budget_seconds"] == 240
    assert secs < 240 and rep["total_seconds"] < 240
    for s in rep["steps"]:
        if s["status"] in ("pass", "fail", "timeout"):
            assert s["limit_s"] and s["seconds"] <= s["limit_s"], s


def test_run_on_device_records_a_failing_and_hanging_step_and_goes_on(bundle, tmp_path):
    # gpu_checks.py stand-in: writes its JSON, then hangs past the run's budget.
    fake = tmp_path / "fake_checks.py"
    fake.write_text(
        "import json, sys, time\n"
        "a = sys.argv\n"
        "assert a[a.index('--weightd') + 1].endswith('/bin/weightd'), a\n"
        "json.dump({'checks': [{'name': 'fake', 'ok': False}]}, open(a[a.index('--out') + 1], 'w'))\n"
        "print('fake checks wrote', a[a.index('--out') + 1], flush=True)\n"
        "time.sleep(120)\n")
    out = tmp_path / "out"
    out.mkdir()
    r, rep, secs = _run_on_device(bundle["dir"], out, {   # an unpacked bundle dir works too
        "WEIGHTD_GPU_CHECKS": str(fake), "WEIGHTD_GPU_CHECKS_WITHOUT_GPU": "1",
        "WEIGHTD_GPU_CHECKS_TIMEOUT_S": "8"})
    steps = {s["name"]: s for s in rep["steps"]}
    assert r.returncode == 1, r.stdout + r.stderr
    assert steps["gpu_checks"]["status"] == "timeout", steps["gpu_checks"]
    assert "fake checks wrote" in steps["gpu_checks"]["output_tail"]
    assert rep["gpu_checks"] == {"checks": [{"name": "fake", "ok": False}]}
    assert rep["ok"] is False and rep["summary"]["timeout"] == 1
    assert steps["daemon_stop"]["status"] == "pass"     # the steps before it still ran
    assert steps["gpu_checks"]["reason"] == "timed out: its limit is 8 s (SIGTERM at 5 s)", \
        steps["gpu_checks"]
    assert 5 <= steps["gpu_checks"]["seconds"] <= 8, steps["gpu_checks"]
    assert secs < 60, secs

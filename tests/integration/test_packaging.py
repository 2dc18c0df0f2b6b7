"""Installing weightd like a system daemon and client library.

Against the build under test: `cmake --install` into a fresh prefix (what
lands where, nothing of server/ in the headers, every public header compiles
on its own); a consumer project that finds the C++ client with
find_package(weightd CONFIG) and another built with pkg-config, each fetching
a shard from a real daemon, compared with PyTorch's cast-and-shard; the
Python wheel installed offline into a virtual environment and used from
outside the checkout; the .deb packages (contents, control fields, shlibdeps,
conffiles, maintainer scripts, lintian), extracted and run.
"""
import email.parser
import os
import shutil
import subprocess
import sys
import textwrap
import time
import zipfile

import pytest
import torch

from harness import BUILD, REPO, Daemon
from reference import cast_shard_ref
import st_io

VERSION = None
for line in open(os.path.join(REPO, "CMakeLists.txt")):
    if line.startswith("project(weightd VERSION"):
        VERSION = line.split()[2]
assert VERSION, "project(weightd VERSION ...) not found"

CONSUMER = textwrap.dedent(r"""
    // Fetches one shard, cast to f16, and writes each tensor as
    // "name dtype d0,d1,... nbytes\n" followed by its bytes.
    #include <cstdio>
    #include <cstdlib>
    #include <string>

    #include "weightd/weightd_client.h"

    int main(int argc, char** argv) {
      if (argc != 6) return 2;
      weightd::ClientOptions opt;
      opt.socket = argv[1];
      auto client = weightd::Client::Connect(opt);
      if (!client.ok()) { std::fprintf(stderr, "%s\n", client.status().ToString().c_str()); return 1; }
      weightd::FetchOptions f;
      f.model = argv[2];
      f.mesh = weightd::MeshCoord{{std::atoll(argv[3])}, {std::atoll(argv[4])}};
      f.dtype = weightd::DType::kF16;
      auto shard = (*client)->Fetch(f);
      if (!shard.ok()) { std::fprintf(stderr, "%s\n", shard.status().ToString().c_str()); return 1; }
      FILE* out = std::fopen(argv[5], "wb");
      for (const weightd::TensorView& t : (*shard)->tensors()) {
        std::string dims;
        for (int64_t d : t.shape) dims += (dims.empty() ? "" : ",") + std::to_string(d);
        std::fprintf(out, "%s %s %s %llu\n", t.name.c_str(),
                     std::string(weightd::DTypeName(t.dtype)).c_str(),
                     dims.empty() ? "-" : dims.c_str(), (unsigned long long)t.length);
        std::fwrite(t.data, 1, t.length, out);
      }
      std::fclose(out);
      return 0;
    }
""")


def _run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert r.returncode == 0, "%s failed (%d):\n%s\n%s" % (cmd, r.returncode, r.stdout, r.stderr)
    return r


def _read_dump(path):
    out = {}
    with open(path, "rb") as f:
        while True:
            head = f.readline()
            if not head:
                return out
            name, dtype, dims, n = head.decode().split()
            assert dtype == "F16", head
            shape = [] if dims == "-" else [int(x) for x in dims.split(",")]
            data = bytearray(f.read(int(n)))
            out[name] = torch.frombuffer(data, dtype=torch.float16).reshape(shape) \
                if data else torch.empty(shape, dtype=torch.float16)


def _assert_shard(dump, tensors, world, rank, what):
    ref = {k: cast_shard_ref(t, world, rank, torch.float16) for k, t in tensors.items()}
    assert sorted(dump) == sorted(ref), what
    for k in ref:
        assert dump[k].shape == ref[k].shape, (what, k)
        assert torch.equal(dump[k].view(torch.int16), ref[k].view(torch.int16)), (what, k)


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("prefix"))
    _run(["cmake", "--install", BUILD, "--prefix", p])
    return p


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("models"))
    g = torch.Generator().manual_seed(7)
    tensors = {"layer.w": torch.randn(7, 5, generator=g),
               "layer.b": torch.randn(7, generator=g).to(torch.bfloat16),
               "emb": torch.randn(3, 4, 2, generator=g).to(torch.float16)}
    path = os.path.join(root, "m.safetensors")
    st_io.save(tensors, path)
    with Daemon(model_root=root) as d:
        d.ctl_ok("load", "m", path)
        yield d, tensors


def test_install_tree(prefix):
    def has(rel):
        return os.path.exists(os.path.join(prefix, rel))
    for rel in ["bin/weightd", "bin/weightctl",
                "include/weightd/weightd_client.h",
                "lib/cmake/weightd/weightdConfig.cmake",
                "lib/cmake/weightd/weightdConfigVersion.cmake",
                "lib/cmake/weightd/weightdTargets.cmake",
                "lib/pkgconfig/weightd-client.pc",
                "share/bash-completion/completions/weightctl",
                "share/weightd/profiles/llama-fsdp.json",
                "etc/weightd/weightd.env", "lib/systemd/system/weightd.service"]:
        assert has(rel), rel
    major, minor, _ = VERSION.split(".")
    lib = os.path.join(prefix, "lib", "libweightd_client.so")
    assert os.path.realpath(lib).endswith("libweightd_client.so." + VERSION)
    assert has("lib/libweightd_client.so.%s.%s" % (major, minor))
    # The unit runs the installed daemon, not /usr/local's.
    unit = open(os.path.join(prefix, "lib/systemd/system/weightd.service")).read()
    assert "ExecStart=%s/bin/weightd " % prefix in unit and "/usr/local/bin" not in unit
    assert "EnvironmentFile=-%s/etc/weightd/weightd.env" % prefix in unit
    # Only the client's headers: weightd_client.h and what it includes.
    headers = sorted(os.path.relpath(os.path.join(d, f), os.path.join(prefix, "include"))
                     for d, _, fs in os.walk(os.path.join(prefix, "include")) for f in fs)
    assert headers == ["weightd/common/digest.h", "weightd/common/dtype.h",
                       "weightd/common/fd.h", "weightd/common/shard.h",
                       "weightd/weightd_client.h"], headers
    # Each compiles on its own with only the installed include dirs.
    inc = os.path.join(prefix, "include")
    for h in headers:
        _run(["g++", "-std=c++20", "-fsyntax-only", "-I", inc, "-I", os.path.join(inc, "weightd"),
              "-x", "c++", os.path.join(inc, h)])
    # The installed binaries run from the prefix.
    assert "usage: weightctl" in subprocess.run([os.path.join(prefix, "bin/weightctl"), "--help"],
                                                capture_output=True, text=True).stdout + \
        subprocess.run([os.path.join(prefix, "bin/weightctl"), "--help"],
                       capture_output=True, text=True).stderr


def test_installed_weightctl_and_completion(prefix, served):
    d, _ = served
    r = _run([os.path.join(prefix, "bin/weightctl"), "--socket", d.socket, "list"])
    assert r.stdout.split("\t")[0] == "m"
    # Completion: verbs, a verb's flags, and model names asked of the daemon.
    script = textwrap.dedent("""
        source %s
        complete_line() { COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); COMPREPLY=(); _weightctl;
                          echo "${COMPREPLY[*]}"; }
        complete_line %s a
        complete_line %s fetch m --tr
        complete_line %s --socket %s info ''
    """) % (os.path.join(prefix, "share/bash-completion/completions/weightctl"),
            *[os.path.join(prefix, "bin/weightctl")] * 3, d.socket)
    out = _run(["bash", "-c", script]).stdout.splitlines()
    assert out == ["adapter apply", "--transport", "m"], out


def test_find_package_consumer(prefix, served, tmp_path):
    d, tensors = served
    src = tmp_path / "consumer"
    src.mkdir()
    (src / "main.cc").write_text(CONSUMER)
    (src / "CMakeLists.txt").write_text(textwrap.dedent("""
        cmake_minimum_required(VERSION 3.16)
        project(consumer CXX)
        find_package(weightd %s CONFIG REQUIRED)
        add_executable(consumer main.cc)
        target_link_libraries(consumer PRIVATE weightd::client)
    """ % VERSION))
    build = tmp_path / "b"
    _run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_PREFIX_PATH=" + prefix])
    _run(["cmake", "--build", str(build)])
    exe = str(build / "consumer")
    # It links the installed library (RPATH from the imported target), not the build's.
    ldd = _run(["ldd", exe]).stdout
    assert os.path.join(prefix, "lib", "libweightd_client.so") in ldd, ldd
    _run([exe, d.socket, "m", "2", "1", str(tmp_path / "out")])
    _assert_shard(_read_dump(tmp_path / "out"), tensors, 2, 1, "find_package consumer")
    # A wrong version is refused by the package's version file.
    (src / "CMakeLists.txt").write_text((src / "CMakeLists.txt").read_text().replace(
        "find_package(weightd %s" % VERSION, "find_package(weightd 99.0"))
    r = subprocess.run(["cmake", "-S", str(src), "-B", str(tmp_path / "b2"),
                        "-DCMAKE_PREFIX_PATH=" + prefix], capture_output=True, text=True)
    assert r.returncode != 0 and 'requested version "99.0"' in r.stderr and \
        "version: %s" % VERSION in r.stderr, r.stderr


def test_pkg_config_consumer(prefix, served, tmp_path):
    d, tensors = served
    (tmp_path / "main.cc").write_text(CONSUMER)
    env = dict(os.environ, PKG_CONFIG_PATH=os.path.join(prefix, "lib", "pkgconfig"))
    flags = _run(["pkg-config", "--cflags", "--libs", "weightd-client"], env=env).stdout.split()
    assert "-lweightd_client" in flags
    exe = str(tmp_path / "consumer")
    _run(["g++", "-o", exe, str(tmp_path / "main.cc"), *flags,
          "-Wl,-rpath," + os.path.join(prefix, "lib")])
    _run([exe, d.socket, "m", "3", "2", str(tmp_path / "out")])
    _assert_shard(_read_dump(tmp_path / "out"), tensors, 3, 2, "pkg-config consumer")
    assert _run(["pkg-config", "--modversion", "weightd-client"], env=env).stdout.strip() == VERSION


def test_wheel_in_a_venv(served, tmp_path):
    d, tensors = served
    _run(["cmake", "--build", BUILD, "--target", "weightd_wheel"])
    wheels = [f for f in os.listdir(os.path.join(BUILD, "dist")) if f.endswith(".whl")]
    assert wheels == ["weightd-%s-py3-none-any.whl" % VERSION], wheels
    wheel = os.path.join(BUILD, "dist", wheels[0])
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = email.parser.Parser().parsestr(
            z.read("weightd-%s.dist-info/METADATA" % VERSION).decode())
    for f in ["weightd/__init__.py", "weightd/client.py", "weightd/_version.py",
              "weightd/v1/weightd_pb2.py", "weightd/v1/weightd_pb2_grpc.py"]:
        assert f in names, f
    assert not [n for n in names if n.endswith(".pyc")], names
    requires = meta.get_all("Requires-Dist")
    assert {r.split()[0] for r in requires} == \
        {"numpy", "grpcio", "protobuf", "torch"}, requires
    assert [r for r in requires if r.startswith("torch")][0].replace('"', "'").endswith("extra == 'torch'")

    venv = tmp_path / "venv"
    _run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", str(venv)])
    py = str(venv / "bin" / "python")
    _run([py, "-m", "pip", "install", "--no-index", "--quiet", wheel])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = textwrap.dedent("""
        import sys, torch, weightd
        assert not [p for p in sys.path if p.startswith(sys.argv[3])], sys.path
        print(weightd.__file__)
        print(weightd.__version__)

        class Layer(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.empty(4, 5, device="meta"))
                self.b = torch.nn.Parameter(torch.empty(4, device="meta"))

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.layer = Layer()
                self.emb = torch.nn.Parameter(torch.empty(2, 4, 2, device="meta"))

        model = Model()
        with weightd.Client(socket=sys.argv[1]) as c:
            with c.fetch("m", world=2, rank=0, dtype="f16") as h:
                weightd.load_into_module(model, h)
                torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                           sys.argv[2])
    """)
    r = _run([py, "-c", code, d.socket, str(tmp_path / "sd.pt"), REPO], cwd=str(tmp_path),
             env=env)
    where, version = r.stdout.split()
    assert where.startswith(str(venv)) and version == VERSION, r.stdout
    sd = torch.load(str(tmp_path / "sd.pt"))
    _assert_shard(sd, tensors, 2, 0, "wheel in a venv")
    _run([py, "-m", "pip", "uninstall", "--yes", "--quiet", "weightd"])
    r = subprocess.run([py, "-c", "import weightd"], cwd=str(tmp_path), env=env,
                       capture_output=True, text=True)
    assert r.returncode != 0 and "No module named 'weightd'" in r.stderr


@pytest.fixture(scope="module")
def debs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("debs"))
    _run(["cpack", "-G", "DEB", "-B", out], cwd=BUILD)
    found = {}
    for f in os.listdir(out):
        if f.endswith(".deb"):
            found[_run(["dpkg-deb", "-f", os.path.join(out, f), "Package"]).stdout.strip()] = \
                os.path.join(out, f)
    assert sorted(found) == ["libweightd-client-dev", "libweightd-client0.1", "weightd"], \
        os.listdir(out)
    return found


def _contents(deb):
    """Paths of the files and links in a .deb (directories left out)."""
    out = set()
    for line in _run(["dpkg-deb", "-c", deb]).stdout.splitlines():
        path = line.split(" -> ")[0].split()[-1]
        if not path.endswith("/"):
            out.add(path.lstrip("."))
    return out


def test_deb_daemon_package(debs, served, tmp_path):
    d, tensors = served
    deb = debs["weightd"]
    files = _contents(deb)
    for f in ["/usr/bin/weightd", "/usr/bin/weightctl", "/lib/systemd/system/weightd.service",
              "/etc/weightd/weightd.env", "/usr/share/weightd/profiles/llama-fsdp.json",
              "/usr/share/bash-completion/completions/weightctl",
              "/usr/share/doc/weightd/copyright", "/usr/share/doc/weightd/changelog.gz",
              "/usr/share/man/man1/weightd.1.gz", "/usr/share/man/man1/weightctl.1.gz"]:
        assert f in files, (f, sorted(files))
    assert not [f for f in files if "include" in f or "libweightd_client" in f], files
    fields = _run(["dpkg-deb", "-f", deb, "Version", "Depends", "Architecture"]).stdout
    assert "Version: %s" % VERSION in fields
    # shlibdeps: the libraries the binaries really link, plus adduser for postinst.
    for dep in ["adduser", "libc6", "libgrpc++1.51", "libprotobuf32"]:
        assert dep in fields, fields
    ctl = tmp_path / "control"
    _run(["dpkg-deb", "-e", deb, str(ctl)])
    assert (ctl / "conffiles").read_text().split() == ["/etc/weightd/weightd.env"]
    for script in ["postinst", "postrm"]:
        assert os.stat(ctl / script).st_mode & 0o111, script
        _run(["sh", "-n", str(ctl / script)])
    root = tmp_path / "root"
    _run(["dpkg-deb", "-x", deb, str(root)])
    unit = (root / "lib/systemd/system/weightd.service").read_text()
    assert "ExecStart=/usr/bin/weightd " in unit and "/usr/local" not in unit
    assert "EnvironmentFile=-/etc/weightd/weightd.env" in unit
    # The packaged (stripped) weightctl talks to a real daemon.
    r = _run([str(root / "usr/bin/weightctl"), "--socket", d.socket, "list"])
    assert r.stdout.startswith("m\t")
    # The packaged daemon serves: loaded and fetched with the packaged weightctl.
    models = tmp_path / "models"
    models.mkdir()
    st_io.save(tensors, str(models / "m.safetensors"))
    sock = str(tmp_path / "pkg.sock")
    ctl = [str(root / "usr/bin/weightctl"), "--socket", sock]
    proc = subprocess.Popen([str(root / "usr/bin/weightd"), "--socket", sock,
                             "--model-root", str(models)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 30
        while time.time() < deadline and subprocess.run(ctl + ["health"],
                                                         capture_output=True).returncode:
            time.sleep(0.1)
        _run(ctl + ["load", "m", str(models / "m.safetensors")])
        _run(ctl + ["fetch", "m", "--world", "3", "--rank", "1", "--dtype", "f16",
                    "--out", str(tmp_path / "f.st")])
        got = st_io.load(str(tmp_path / "f.st"))
        _assert_shard(got, tensors, 3, 1, "packaged daemon and weightctl")
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0, proc.stderr.read()


def test_deb_client_packages(debs, served, tmp_path):
    d, tensors = served
    lib, dev = debs["libweightd-client0.1"], debs["libweightd-client-dev"]
    major, minor, _ = VERSION.split(".")
    assert _contents(lib) == {"/usr/lib/libweightd_client.so.%s" % VERSION,
                              "/usr/lib/libweightd_client.so.%s.%s" % (major, minor),
                              "/usr/share/doc/libweightd-client0.1/copyright",
                              "/usr/share/doc/libweightd-client0.1/changelog.gz"}
    files = _contents(dev)
    for f in ["/usr/include/weightd/weightd_client.h", "/usr/lib/libweightd_client.so",
              "/usr/lib/cmake/weightd/weightdConfig.cmake",
              "/usr/lib/pkgconfig/weightd-client.pc", "/usr/share/doc/libweightd-client-dev/copyright"]:
        assert f in files, (f, sorted(files))
    assert not [f for f in files if f.startswith("/usr/bin") or ".so." in f], files
    fields = _run(["dpkg-deb", "-f", lib, "Depends", "Section"]).stdout
    assert "libgrpc++1.51" in fields and "Section: libs" in fields, fields
    fields = _run(["dpkg-deb", "-f", dev, "Depends"]).stdout
    assert "libweightd-client0.1 (= %s)" % VERSION in fields and "libabsl-dev" in fields, fields
    ctl = tmp_path / "control"
    _run(["dpkg-deb", "-e", lib, str(ctl)])
    assert (ctl / "shlibs").read_text().strip() == \
        "libweightd_client %s.%s libweightd-client0.1 (>= %s)" % (major, minor, VERSION)
    assert (ctl / "triggers").read_text().split() == ["activate-noawait", "ldconfig"]
    # Both extracted anywhere: the CMake files find themselves and the library.
    root = tmp_path / "root"
    for deb in (lib, dev):
        _run(["dpkg-deb", "-x", deb, str(root)])
    src = tmp_path / "consumer"
    src.mkdir()
    (src / "main.cc").write_text(CONSUMER)
    (src / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.16)\nproject(c CXX)\n"
        "find_package(weightd CONFIG REQUIRED)\nadd_executable(c main.cc)\n"
        "target_link_libraries(c PRIVATE weightd::client)\n")
    _run(["cmake", "-S", str(src), "-B", str(tmp_path / "b"), "-DCMAKE_PREFIX_PATH=%s/usr" % root])
    _run(["cmake", "--build", str(tmp_path / "b")])
    _run([str(tmp_path / "b" / "c"), d.socket, "m", "1", "0", str(tmp_path / "out")])
    _assert_shard(_read_dump(tmp_path / "out"), tensors, 1, 0, "packaged client")


def test_lintian(debs):
    if shutil.which("lintian") is None:
        pytest.fail("lintian is not installed (scripts/deps.sh installs it)")
    r = subprocess.run(["lintian", "--suppress-tags-from-file",
                        os.path.join(REPO, "deploy/debian/lintian-overrides.txt"),
                        "--fail-on", "error,warning", *debs.values()],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr

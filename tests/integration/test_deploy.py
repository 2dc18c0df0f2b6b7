"""Deployment files (deploy/): the kustomize overlays render with `kubectl
kustomize` and validate offline against the Kubernetes schemas (npm
kubernetes-models, through tests/deploy_validate/validate.js, plus an
unknown-field check); they have the shape weightd needs (grpc probes on the
--listen port, a socket directory shared with the workers, native sidecar,
IPC_LOCK, memory sized with the budget; the huge-pages overlay's hugepages-2Mi
request equal to its limit, with memory, and --huge-pages=require); the flags
they pass start the real daemon; the systemd unit verifies and its ExecStart starts the daemon too; the
Dockerfile is checked statically here; tests/integration/test_image.py builds and runs the image of deploy/Dockerfile.deb.

Needs kubectl (with its embedded kustomize), node and npm; the first run
installs tests/deploy_validate/node_modules from the npm registry. A missing
tool is a failure, not a skip.
"""
import functools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import time

import pytest
import yaml

import harness

REPO = harness.REPO
DEPLOY = os.path.join(REPO, "deploy")
K8S = os.path.join(DEPLOY, "k8s")
VALIDATE_DIR = os.path.join(REPO, "tests", "deploy_validate")
VALIDATE_JS = os.path.join(VALIDATE_DIR, "validate.js")

OVERLAYS = {
    "daemonset": "overlays/daemonset",
    "sidecar": "overlays/sidecar",
    "large-model": "examples/daemonset-large-model",
    "hugepages": "overlays/daemonset-hugepages",
    "fleet": "overlays/daemonset-fleet",
    "sources": "overlays/daemonset-sources",
}
GiB = 1 << 30
MiB = 1 << 20


# ---- tools -----------------------------------------------------------------

def _tool(name):
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed; the deploy checks need it (not skipped on purpose)")
    return path


@functools.lru_cache(maxsize=None)
def _render(rel):
    kubectl = _tool("kubectl")
    r = subprocess.run([kubectl, "kustomize", os.path.join(K8S, rel)],
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        pytest.fail(f"kubectl kustomize {rel} failed (is `kubectl kustomize` available?):\n{r.stderr}")
    return r.stdout


def render(rel):
    return [d for d in yaml.safe_load_all(_render(rel)) if d]


@pytest.fixture(scope="session")
def validator():
    node = _tool("node")
    if not os.path.isdir(os.path.join(VALIDATE_DIR, "node_modules", "kubernetes-models")):
        npm = _tool("npm")
        r = subprocess.run([npm, "install", "--no-audit", "--no-fund"], cwd=VALIDATE_DIR,
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            pytest.fail(f"npm install in {VALIDATE_DIR} failed:\n{r.stdout}\n{r.stderr}")

    def run(text):
        r = subprocess.run([node, VALIDATE_JS], input=text, capture_output=True, text=True,
                           timeout=60)
        try:
            results = json.loads(r.stdout) if r.stdout.strip() else []
        except json.JSONDecodeError:
            results = []
        return r.returncode, results, r.stderr
    return run


def one(objs, kind, name=None):
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def pod_spec(workload):
    return workload["spec"]["template"]["spec"]


def weightd_container(workload):
    spec = pod_spec(workload)
    for c in spec.get("containers", []) + spec.get("initContainers", []):
        if c["name"] == "weightd":
            return c
    raise AssertionError("no weightd container")


def flags(container):
    """--name=value / --name value pairs of the container's args, as a dict of lists."""
    out, args = {}, list(container.get("args", []))
    i = 0
    while i < len(args):
        a = args[i]
        assert a.startswith("--"), f"unexpected argument {a!r}"
        if "=" in a:
            k, v = a.split("=", 1)
        else:
            k, v = a, args[i + 1]
            i += 1
        out.setdefault(k, []).append(v)
        i += 1
    return out


def quantity_bytes(q):
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9}
    m = re.fullmatch(r"(\d+)([A-Za-z]*)", str(q))
    assert m, q
    return int(m.group(1)) * (units[m.group(2)] if m.group(2) else 1)


def config_data(objs, container):
    """The ConfigMap the container's envFrom names (kustomize adds a hash suffix)."""
    names = [e["configMapRef"]["name"] for e in container.get("envFrom", []) if "configMapRef" in e]
    assert len(names) == 1, names
    return one(objs, "ConfigMap", names[0])["data"]


def expand(value, env):
    """Kubernetes $(VAR) expansion; an undefined variable is an error here."""
    def sub(m):
        assert m.group(1) in env, f"$({m.group(1)}) is not defined by the container's env"
        return env[m.group(1)]
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, value)


# ---- rendering and schema validation ---------------------------------------

@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_overlay_renders_and_validates(overlay, validator):
    text = _render(OVERLAYS[overlay])
    rc, results, err = validator(text)
    assert rc == 0, err
    kinds = sorted(r["kind"] for r in results)
    assert all(r["ok"] for r in results), err
    expected = {
        "daemonset": ["ConfigMap", "DaemonSet", "Namespace", "NetworkPolicy", "PriorityClass"],
        "large-model": ["ConfigMap", "DaemonSet", "Namespace", "NetworkPolicy", "PriorityClass"],
        "hugepages": ["ConfigMap", "DaemonSet", "Namespace", "NetworkPolicy", "PriorityClass"],
        "sidecar": ["ConfigMap", "Deployment", "NetworkPolicy"],
        "fleet": ["ConfigMap", "DaemonSet", "Namespace", "NetworkPolicy", "PriorityClass",
                  "Service"],
        "sources": ["ConfigMap", "DaemonSet", "Namespace", "NetworkPolicy", "PriorityClass"],
    }[overlay]
    assert kinds == expected
    # The image is set once, by the base component's `images:` entry.
    for o in render(OVERLAYS[overlay]):
        if o["kind"] in ("DaemonSet", "Deployment"):
            spec = pod_spec(o)
            for c in spec.get("containers", []) + spec.get("initContainers", []):
                assert c["image"] == "registry.example.com/weightd/weightd:0.1.0", c["name"]


def test_daemonset_worker_example_validates(validator):
    with open(os.path.join(K8S, "overlays/daemonset/worker-example.yaml")) as f:
        text = f.read()
    rc, results, err = validator(text)
    assert rc == 0 and [r["kind"] for r in results] == ["Deployment"], err
    worker = yaml.safe_load(text)
    ds = one(render(OVERLAYS["daemonset"]), "DaemonSet")
    ds_sockets = [v for v in pod_spec(ds)["volumes"] if v["name"] == "sockets"][0]
    spec = pod_spec(worker)
    host = [v for v in spec["volumes"] if "hostPath" in v]
    assert len(host) == 1 and host[0]["hostPath"]["path"] == ds_sockets["hostPath"]["path"]
    mount = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == host[0]["name"]][0]
    socket_dir = os.path.dirname(flags(weightd_container(ds))["--socket"][0])
    assert mount["mountPath"] == socket_dir
    # The daemon's socket group, for --socket-mode 0660.
    assert pod_spec(ds)["securityContext"]["runAsGroup"] in spec["securityContext"]["supplementalGroups"]


BROKEN = {
    # kubernetes-models: a type error, a missing required field, an enum.
    "grpc-port-string": ("""
apiVersion: v1
kind: Pod
metadata: {name: p}
spec:
  containers:
  - name: c
    image: i
    livenessProbe: {grpc: {port: "50051"}}
""", "must be integer"),
    "daemonset-without-selector": ("""
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: d}
spec:
  template:
    spec:
      containers: [{name: c, image: i}]
""", "selector"),
    "bad-enum": ("""
apiVersion: v1
kind: Pod
metadata: {name: p}
spec:
  containers: [{name: c, image: i, imagePullPolicy: Sometimes}]
""", "allowedValues"),
    # validate.js's own check: a misspelt field deep in a pod template.
    "unknown-field": ("""
apiVersion: apps/v1
kind: Deployment
metadata: {name: d}
spec:
  selector: {matchLabels: {a: b}}
  template:
    metadata: {labels: {a: b}}
    spec:
      initContainers:
      - name: c
        image: i
        restartPolicy: Always
        securityContext: {readOnlyRootFileSystem: true}
""", 'unknown field "readOnlyRootFileSystem"'),
    # validate.js's resource rules (the API server's, not in the schemas).
    "hugepages-request-below-limit": ("""
apiVersion: v1
kind: Pod
metadata: {name: p}
spec:
  containers:
  - name: c
    image: i
    resources:
      requests: {memory: 1Gi, hugepages-2Mi: 2Gi}
      limits: {memory: 1Gi, hugepages-2Mi: 4Gi}
""", "requests/hugepages-2Mi: must be equal to hugepages-2Mi limit of 4Gi"),
    "hugepages-without-cpu-or-memory": ("""
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: d}
spec:
  selector: {matchLabels: {a: b}}
  template:
    metadata: {labels: {a: b}}
    spec:
      containers:
      - name: c
        image: i
        resources: {limits: {hugepages-2Mi: 4Gi}}
""", "/spec/template/spec/containers/0/resources: HugePages require cpu or memory"),
    "request-over-limit": ("""
apiVersion: v1
kind: Pod
metadata: {name: p}
spec:
  containers:
  - {name: c, image: i, resources: {requests: {memory: 2Gi}, limits: {memory: 1Gi}}}
""", "must be less than or equal to memory limit of 1Gi"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_validator_rejects_broken_objects(case, validator):
    text, needle = BROKEN[case]
    rc, results, err = validator(text)
    assert rc == 1, (rc, err)
    assert len(results) == 1 and not results[0]["ok"]
    assert any(needle in e for e in results[0]["errors"]), results[0]["errors"]


def test_validator_rejects_unknown_kind_and_empty_input(validator):
    rc, _, err = validator("apiVersion: example.com/v1\nkind: Gadget\nmetadata: {name: g}\n")
    assert rc == 2, err
    rc, _, err = validator("")
    assert rc == 2 and "no objects" in err


def test_validator_rejects_broken_rendered_daemonset(validator):
    """The real DaemonSet with one field made wrong fails, so the passing run
    above is not vacuous."""
    objs = render(OVERLAYS["daemonset"])
    ds = one(objs, "DaemonSet")
    weightd_container(ds)["startupProbe"]["grpc"]["port"] = "grpc"
    rc, results, err = validator(yaml.safe_dump_all(objs))
    assert rc == 1, err
    bad = [r for r in results if not r["ok"]]
    assert [r["kind"] for r in bad] == ["DaemonSet"]
    assert any("startupProbe/grpc/port" in e for e in bad[0]["errors"])


def test_validator_rejects_hugepages_daemonset_with_request_not_limit(validator):
    """The huge-pages overlay with its hugepages-2Mi request lowered fails the
    API server's rule (requests == limits), as validate.js applies it."""
    objs = render(OVERLAYS["hugepages"])
    weightd_container(one(objs, "DaemonSet"))["resources"]["requests"]["hugepages-2Mi"] = "2Gi"
    rc, results, err = validator(yaml.safe_dump_all(objs))
    assert rc == 1, err
    bad = [r for r in results if not r["ok"]]
    assert [r["kind"] for r in bad] == ["DaemonSet"]
    assert any("requests/hugepages-2Mi: must be equal to hugepages-2Mi limit" in e
               for e in bad[0]["errors"]), bad[0]["errors"]


# ---- what weightd needs ------------------------------------------------------

def _listen_port(c):
    listen = flags(c)["--listen"][0]
    port = int(listen.rsplit(":", 1)[1])
    assert {"containerPort": port, "name": "grpc", "protocol": "TCP"} in c["ports"]
    return port


def _check_weightd_container(objs, c):
    f = flags(c)
    for required in ("--socket", "--model-root", "--listen"):
        assert required in f, f"{required} missing from {c['args']}"
    assert "--metrics-listen" not in f, "--metrics-listen is not implemented yet"
    port = _listen_port(c)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": port}, probe
    sc = c["securityContext"]
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    # Memory: requests == limits, and the limit covers the budget + overhead.
    res = c["resources"]
    assert res["requests"]["memory"] == res["limits"]["memory"]
    budget = int(config_data(objs, c)["WEIGHTD_HOST_MEMORY_BYTES"])
    assert quantity_bytes(res["limits"]["memory"]) - budget >= 2 * GiB
    # Every $(VAR) in the args is defined.
    env = dict(config_data(objs, c))
    env.update({e["name"]: e.get("value", "") for e in c.get("env", [])})
    for a in c["args"]:
        expand(a, env)
    return f


def _mount(container, volume_name):
    found = [m for m in container.get("volumeMounts", []) if m["name"] == volume_name]
    assert len(found) == 1, (container["name"], volume_name)
    return found[0]


@pytest.mark.parametrize("overlay", ["daemonset", "large-model", "hugepages"])
def test_daemonset_shape(overlay):
    objs = render(OVERLAYS[overlay])
    ds = one(objs, "DaemonSet")
    spec = pod_spec(ds)
    c = weightd_container(ds)
    assert c in spec["containers"]
    f = _check_weightd_container(objs, c)
    volumes = {v["name"]: v for v in spec["volumes"]}
    # Socket directory on a hostPath, shared with worker pods.
    socket_dir = os.path.dirname(f["--socket"][0])
    sock_mount = [m for m in c["volumeMounts"] if m["mountPath"] == socket_dir][0]
    assert volumes[sock_mount["name"]]["hostPath"] == {"path": "/run/weightd", "type": "DirectoryOrCreate"}
    assert not sock_mount.get("readOnly", False)
    # Model root: hostPath, read-only.
    model_mount = [m for m in c["volumeMounts"] if m["mountPath"] == f["--model-root"][0]][0]
    assert model_mount["readOnly"] is True
    assert "hostPath" in volumes[model_mount["name"]]
    # --state-dir on the node, writable: a replaced pod restores from it.
    state_mount = [m for m in c["volumeMounts"] if m["mountPath"] == f["--state-dir"][0]][0]
    assert not state_mount.get("readOnly", False)
    assert volumes[state_mount["name"]]["hostPath"] == {"path": "/var/lib/weightd/state",
                                                        "type": "DirectoryOrCreate"}
    # Pinned memory on GPU nodes; an added capability acts only for UID 0.
    assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert c["securityContext"]["runAsUser"] == 0
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    pc = spec["priorityClassName"]
    assert pc == "system-node-critical" or one(objs, "PriorityClass", pc)["value"] >= 10**8
    assert ds["spec"]["updateStrategy"]["type"] in ("RollingUpdate", "OnDelete")
    # Updates hand over (docs/restarts.md): the new pod starts beside the
    # old one and takes its memory and sockets through the state directory.
    if ds["spec"]["updateStrategy"]["type"] == "RollingUpdate":
        assert ds["spec"]["updateStrategy"]["rollingUpdate"] == {"maxSurge": 1,
                                                                 "maxUnavailable": 0}
        assert "--take-over" in c["args"] and "--state-dir=/var/lib/weightd/state" in c["args"]
        assert not any(a.startswith("--handover-socket") for a in c["args"]), \
            "the default, in the state directory that worker pods do not mount"
    assert not any(o["kind"] == "Service" for o in objs), "node-local: no Service"
    # The namespace admits hostPath volumes.
    ns = one(objs, "Namespace")
    assert ns["metadata"]["name"] == ds["metadata"]["namespace"]
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    # Ingress closed (kubelet probes from the node are always allowed).
    np = one(objs, "NetworkPolicy")
    assert np["spec"]["policyTypes"] == ["Ingress"] and not np["spec"].get("ingress")
    assert all(ds["spec"]["template"]["metadata"]["labels"][k] == v
               for k, v in np["spec"]["podSelector"]["matchLabels"].items())


def test_large_model_example_resizes_budget_and_limit_together():
    small = one(render(OVERLAYS["daemonset"]), "DaemonSet")
    objs = render(OVERLAYS["large-model"])
    big = one(objs, "DaemonSet")
    c = weightd_container(big)
    assert int(config_data(objs, c)["WEIGHTD_HOST_MEMORY_BYTES"]) == 136 * GiB
    assert c["resources"]["limits"]["memory"] == "138Gi"
    assert c["resources"]["limits"] != weightd_container(small)["resources"]["limits"]
    assert flags(c)["--preload"] == ["llama-70b=/models/llama-3-70b"]


def test_hugepages_overlay():
    """overlays/daemonset-hugepages: the base DaemonSet plus 2 MiB huge pages
    (hugepages-2Mi request == limit, memory requested too), --huge-pages=require,
    and a budget that fits in the hugetlb limit."""
    base = weightd_container(one(render(OVERLAYS["daemonset"]), "DaemonSet"))
    objs = render(OVERLAYS["hugepages"])
    ds = one(objs, "DaemonSet")
    c = weightd_container(ds)
    req, lim = c["resources"]["requests"], c["resources"]["limits"]
    # Kubernetes: a hugepages request equals its limit, and a container with
    # hugepages requests cpu or memory as well; this one requests memory.
    assert "hugepages-2Mi" in req and "hugepages-2Mi" in lim
    assert req["hugepages-2Mi"] == lim["hugepages-2Mi"]
    huge = quantity_bytes(lim["hugepages-2Mi"])
    assert huge > 0 and huge % (2 * MiB) == 0
    assert "memory" in req and req["memory"] == lim["memory"]
    assert req["cpu"] == base["resources"]["requests"]["cpu"]
    assert not [k for k in list(req) + list(lim) if k.startswith("hugepages-") and k != "hugepages-2Mi"]
    # The flag, from the ConfigMap, appended to the base overlay's args.
    env = dict(config_data(objs, c))
    assert [expand(v, env) for v in flags(c)["--huge-pages"]] == ["require"]
    assert c["args"] == base["args"] + ["--huge-pages=$(WEIGHTD_HUGE_PAGES)"]
    assert env["WEIGHTD_HUGE_PAGES"] == "require"
    # require: every segment of 2 MiB or more comes from the hugetlb cgroup's
    # limit, so the budget fits in it (the daemon refuses a load before the
    # cgroup would).
    assert int(env["WEIGHTD_HOST_MEMORY_BYTES"]) <= huge
    # memfd_create(MFD_HUGETLB) needs no hugetlbfs volume.
    for v in pod_spec(ds)["volumes"]:
        assert not str(v.get("emptyDir", {}).get("medium", "")).startswith("HugePages"), v
    # Only this overlay asks for huge pages.
    for other in ("daemonset", "large-model", "sidecar"):
        o = [x for x in render(OVERLAYS[other]) if x["kind"] in ("DaemonSet", "Deployment")][0]
        oc = weightd_container(o)
        assert "--huge-pages" not in flags(oc), other
        assert not any(k.startswith("hugepages-") for part in oc["resources"].values() for k in part), other


def test_fleet_overlay():
    """overlays/daemonset-fleet: the DaemonSet plus a headless Service of
    every daemon pod, --peer-dns on it at the gRPC port, --advertise from the
    pod IP, a NetworkPolicy that lets daemon pods, and only them, reach
    each other's gRPC port (docs/fleet.md), and the fleet's token from a
    Secret as --auth-token-file, --peer-token-file and --fleet-members."""
    base = weightd_container(one(render(OVERLAYS["daemonset"]), "DaemonSet"))
    objs = render(OVERLAYS["fleet"])
    ds = one(objs, "DaemonSet")
    c = weightd_container(ds)
    labels = ds["spec"]["template"]["metadata"]["labels"]
    svc = one(objs, "Service")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert all(labels[k] == v for k, v in svc["spec"]["selector"].items())
    [port] = svc["spec"]["ports"]
    grpc_port = [p for p in c["ports"] if p["name"] == "grpc"][0]["containerPort"]
    assert port["targetPort"] == "grpc"
    ns = ds["metadata"]["namespace"]
    assert svc["metadata"]["namespace"] == ns
    f = flags(c)
    assert f["--peer-dns"] == ["%s.%s.svc.cluster.local:%d" % (svc["metadata"]["name"], ns,
                                                              port["port"])]
    assert port["port"] == grpc_port
    assert f["--advertise"] == ["$(POD_IP):%d" % grpc_port]
    assert f["--listen"] == ["0.0.0.0:%d" % grpc_port]
    [pod_ip] = [e for e in c["env"] if e["name"] == "POD_IP"]
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert c["args"][:len(base["args"])] == base["args"]
    np = one(objs, "NetworkPolicy")
    [rule] = np["spec"]["ingress"]
    [src] = rule["from"]
    assert set(src) == {"podSelector"}, "daemon pods of this namespace only"
    assert all(labels[k] == v for k, v in src["podSelector"]["matchLabels"].items())
    assert rule["ports"] == [{"port": grpc_port, "protocol": "TCP"}]
    # Fleet membership: every daemon presents the token it accepts, whose
    # name is the one member listed, from a Secret mounted read-only.
    [tokens] = f["--auth-token-file"]
    assert f["--peer-token-file"] == [tokens]
    assert f["--fleet-members"] == ["token:fleet"]
    # Clear-text tokens between pods only, which the NetworkPolicy confines.
    assert f["--allow-insecure-token"] == ["true"]
    mount = [m for m in c["volumeMounts"] if tokens.startswith(m["mountPath"] + "/")]
    assert len(mount) == 1 and mount[0]["readOnly"] is True, mount
    [vol] = [v for v in pod_spec(ds)["volumes"] if v["name"] == mount[0]["name"]]
    assert vol["secret"]["secretName"] == "weightd-fleet-token"


def test_sources_overlay():
    """[sources]: credentials only from Secrets (env AWS_* by secretKeyRef, the
    HTTPS token as a read-only Secret file), and an allow-list of sources."""
    base = weightd_container(one(render(OVERLAYS["daemonset"]), "DaemonSet"))
    objs = render(OVERLAYS["sources"])
    ds = one(objs, "DaemonSet")
    c = weightd_container(ds)
    f = flags(c)
    assert f["--model-source"] == ["s3://models/", "https://artifacts.example.com/models/"]
    assert c["args"][:len(base["args"])] == base["args"], "the daemon set's flags, then these"
    env = {e["name"]: e for e in c["env"]}
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert env[k]["valueFrom"]["secretKeyRef"] == {"name": "weightd-s3-credentials", "key": k}
        assert "value" not in env[k]
    assert not any(k.startswith("AWS_") and "SECRET" in k for k in config_data(objs, c))
    token = f["--https-bearer-token-file"][0]
    mount = [m for m in c["volumeMounts"] if token.startswith(m["mountPath"] + "/")][0]
    assert mount["readOnly"] is True
    vol = [v for v in pod_spec(ds)["volumes"] if v["name"] == mount["name"]][0]
    assert vol["secret"]["secretName"] == "weightd-https-token"
    assert vol["secret"]["defaultMode"] == 0o400
    assert not any(o["kind"] == "Secret" for o in objs), "Secrets are created by the operator"


def test_sidecar_shape():
    objs = render(OVERLAYS["sidecar"])
    dep = one(objs, "Deployment")
    spec = pod_spec(dep)
    sidecar = weightd_container(dep)
    # Native sidecar: an init container that keeps running.
    assert sidecar in spec["initContainers"] and sidecar["restartPolicy"] == "Always"
    assert "startupProbe" in sidecar
    f = _check_weightd_container(objs, sidecar)
    assert "add" not in sidecar["securityContext"]["capabilities"]
    # One socket volume, an emptyDir, mounted by the sidecar and the worker at
    # the --socket directory.
    socket_dir = os.path.dirname(f["--socket"][0])
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert not any("hostPath" in v for v in volumes.values()), "sidecar mode uses no hostPath"
    name = [m for m in sidecar["volumeMounts"] if m["mountPath"] == socket_dir][0]["name"]
    assert "emptyDir" in volumes[name] and volumes[name]["emptyDir"].get("medium") in (None, "")
    [worker] = spec["containers"]
    assert _mount(worker, name)["mountPath"] == socket_dir
    script = " ".join(worker.get("command", []) + worker.get("args", []))
    assert "weightctl --socket /run/weightd/weightd.sock health" in script
    assert f["--socket"] == ["/run/weightd/weightd.sock"]
    assert _mount(sidecar, [m["name"] for m in sidecar["volumeMounts"]
                            if m["mountPath"] == f["--model-root"][0]][0])["readOnly"] is True
    # --state-dir in an emptyDir: the pod's container restarts keep it. The
    # emptyDir is writable by all, so the state directory is one the daemon
    # creates in it (its own, 0700).
    state = [m for m in sidecar["volumeMounts"]
             if m["mountPath"] == os.path.dirname(f["--state-dir"][0])][0]
    assert "emptyDir" in volumes[state["name"]] and not state.get("readOnly", False)
    # Pod Security "restricted": non-root, no escalation, drop ALL, RuntimeDefault.
    psc = spec["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["seccompProfile"]["type"] == "RuntimeDefault"
    assert psc["fsGroup"] == psc["runAsGroup"]   # the socket group, on the emptyDir
    for c in spec["initContainers"] + spec["containers"]:
        assert c["securityContext"]["allowPrivilegeEscalation"] is False, c["name"]
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], c["name"]
        assert c["securityContext"].get("runAsUser", psc["runAsUser"]) != 0, c["name"]
    # The TCP port stays closed to other pods.
    np = one(objs, "NetworkPolicy")
    assert np["spec"]["ingress"] == [{"ports": [{"port": "http", "protocol": "TCP"}]}]


def test_daemonset_and_sidecar_pass_the_same_flags():
    ds = weightd_container(one(render(OVERLAYS["daemonset"]), "DaemonSet"))
    sc = weightd_container(one(render(OVERLAYS["sidecar"]), "Deployment"))
    assert ds["args"] == sc["args"]


# ---- the flags start the real daemon ------------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_safetensors(path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + struct.pack("<2f", 1.0, 2.0))


def _run_daemon(argv, socket_path, port):
    """Starts the daemon with argv, checks health on the socket and over TCP,
    stops it; returns (`weightctl list` output, socket mode, the daemon's log)."""
    assert os.path.exists(harness.WEIGHTD), f"{harness.WEIGHTD} is not built"
    proc = subprocess.Popen([harness.WEIGHTD] + argv, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    log = ""
    try:
        deadline = time.time() + 20
        while True:
            if proc.poll() is not None:
                pytest.fail(f"weightd {argv} exited {proc.returncode}:\n{proc.stdout.read()}")
            r = subprocess.run([harness.WEIGHTCTL, "--socket", socket_path, "health"],
                               capture_output=True, text=True)
            if r.returncode == 0:
                break
            assert time.time() < deadline, f"weightd {argv} did not become healthy"
            time.sleep(0.05)
        # What the kubelet's grpc probe asks, over TCP.
        r = subprocess.run([harness.WEIGHTCTL, "--target", f"127.0.0.1:{port}", "health"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        listed = subprocess.run([harness.WEIGHTCTL, "--socket", socket_path, "list"],
                                capture_output=True, text=True)
        assert listed.returncode == 0, listed.stderr
        mode = os.stat(socket_path).st_mode & 0o777
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        log = proc.stdout.read()
        return listed.stdout, mode, log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=20)
        proc.stdout.close()


def _log_events(log, event):
    """The JSON log lines (--log-format=json) of one event."""
    out = []
    for line in log.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            if rec.get("event") == event:
                out.append(rec)
    return out


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_manifest_flags_start_the_daemon(overlay, tmp_path):
    objs = render(OVERLAYS[overlay])
    workload = [o for o in objs if o["kind"] in ("DaemonSet", "Deployment")][0]
    c = weightd_container(workload)
    env = dict(config_data(objs, c))
    env.update({e["name"]: e.get("value", "") for e in c.get("env", [])})
    run_dir, models = tmp_path / "run", tmp_path / "models"
    run_dir.mkdir()
    (models / "llama-3-70b").mkdir(parents=True)
    _write_safetensors(str(models / "llama-3-70b" / "model.safetensors"))
    port = _free_port()
    argv = []
    for a in c["args"]:
        a = expand(a, env).replace("/run/weightd", str(run_dir)).replace("=/models", f"={models}")
        a = a.replace("/var/lib/weightd/state", str(tmp_path / "state"))
        if "/etc/weightd/fleet/" in a:  # the fleet token's Secret
            (tmp_path / "fleet").mkdir(exist_ok=True)
            (tmp_path / "fleet" / "tokens").write_text("fleet %s\n" % ("f" * 64))
            a = a.replace("/etc/weightd/fleet", str(tmp_path / "fleet"))
        if "/etc/weightd/sources/" in a:  # the HTTPS token's Secret
            (tmp_path / "sources").mkdir(exist_ok=True)
            (tmp_path / "sources" / "token").write_text("t" * 32 + "\n")
            a = a.replace("/etc/weightd/sources", str(tmp_path / "sources"))
        if a.startswith("--listen="):
            a = f"--listen=127.0.0.1:{port}"
        argv.append(a)
    socket_path = flags({"args": argv})["--socket"][0]
    listed, mode, log = _run_daemon(argv, socket_path, port)
    if "--preload" in flags(c):
        assert listed.startswith("llama-70b\t"), listed
    assert mode == int(env["WEIGHTD_SOCKET_MODE"], 8)
    # The daemon took the --huge-pages mode the manifest passes: its start-up
    # host_pages event names it, with the pool and the THP setting it sees.
    if "--huge-pages" in flags(c):
        assert env["WEIGHTD_LOG_FORMAT"] == "json"
        [host_pages] = _log_events(log, "host_pages")
        assert host_pages["huge_pages"] == expand(flags(c)["--huge-pages"][-1], env), host_pages
        for key in ("hugetlb_2m_free", "hugetlb_2m_total", "shmem_thp"):
            assert key in host_pages, host_pages


# ---- systemd -------------------------------------------------------------------

UNIT = os.path.join(DEPLOY, "systemd", "weightd.service")
ENV_FILE = os.path.join(DEPLOY, "systemd", "weightd.env")


def _unit():
    """[Service] settings as {key: [values]} with continuation lines joined."""
    with open(UNIT) as f:
        text = re.sub(r"\\\n\s*", " ", f.read())
    out, section = {}, None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        k, v = line.split("=", 1)
        out.setdefault((section, k), []).append(v)
    return out


def _env_file():
    env = {}
    with open(ENV_FILE) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                k, v = line.split("=", 1)
                env[k] = v
    return env


def _exec_start(env):
    """ExecStart split as systemd does: ${VAR} one word, $VAR split at spaces."""
    [cmd] = _unit()[("Service", "ExecStart")]
    argv = []
    for word in shlex.split(cmd):
        m = re.fullmatch(r"\$\{(\w+)\}|\$(\w+)", word)
        if m and m.group(1):
            argv.append(env[m.group(1)])
        elif m:
            argv.extend(env[m.group(2)].split())
        else:
            assert "$" not in word, word
            argv.append(word)
    return argv


def test_systemd_unit_settings():
    u = _unit()
    s = lambda k: u.get(("Service", k), [])  # noqa: E731
    argv = _exec_start({k.split("=", 1)[0]: k.split("=", 1)[1] for k in s("Environment")})
    assert argv[0] == "/usr/local/bin/weightd"
    for flag in ("--socket", "--model-root", "--listen", "--host-memory-bytes"):
        assert flag in argv, flag
    assert "--metrics-listen" not in argv
    assert argv[argv.index("--socket") + 1] == "/run/weightd/weightd.sock"
    assert s("RuntimeDirectory") == ["weightd"]
    assert s("Restart") == ["on-failure"]
    assert s("LimitMEMLOCK") == ["infinity"]
    assert s("ProtectSystem") == ["strict"]
    assert s("NoNewPrivileges") == ["yes"]
    assert s("KillSignal") == ["SIGTERM"] and s("TimeoutStopSec")
    assert any("/var/lib/weightd/models" in p for p in s("ReadOnlyPaths"))
    assert s("EnvironmentFile") == ["-/etc/weightd/weightd.env"]
    # Every variable ExecStart uses has a default in the unit and an entry in
    # the example env file.
    defaults = {e.split("=", 1)[0] for e in s("Environment")}
    used = set(re.findall(r"\$\{?(\w+)\}?", s("ExecStart")[0]))
    assert used <= defaults and used <= set(_env_file())


def test_systemd_unit_verifies(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    with open(UNIT) as f:
        text = f.read().replace("/usr/local/bin/weightd", harness.WEIGHTD)
    unit = tmp_path / "weightd.service"
    unit.write_text(text)
    r = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
    r = subprocess.run([analyze, "security", "--offline=yes", str(unit)],
                       capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for \S+: ([\d.]+)", r.stdout)
    assert m and float(m.group(1)) <= 3.0, r.stdout[-500:]


def test_systemd_exec_start_starts_the_daemon(tmp_path):
    env = _env_file()
    run_dir, models = tmp_path / "run", tmp_path / "models"
    run_dir.mkdir()
    models.mkdir()
    port = _free_port()
    env.update(WEIGHTD_STATE_DIR=str(tmp_path / "state"))
    env.update(WEIGHTD_MODEL_ROOT=str(models), WEIGHTD_LISTEN=f"127.0.0.1:{port}",
               WEIGHTD_EXTRA_ARGS="--threads 2")
    argv = [a.replace("/run/weightd", str(run_dir)) for a in _exec_start(env)[1:]]
    _, mode, _ = _run_daemon(argv, str(run_dir / "weightd.sock"), port)
    assert mode == int(env["WEIGHTD_SOCKET_MODE"], 8)


# ---- Dockerfile (static: no Docker engine here) --------------------------------

DOCKERFILE = os.path.join(DEPLOY, "Dockerfile")


def _docker_instructions():
    with open(DOCKERFILE) as f:
        text = re.sub(r"\\\n", " ", f.read())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def _stages():
    stages, current = {}, None
    for op, rest in _docker_instructions():
        if op == "FROM":
            m = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", rest, re.I)
            assert m, f"every stage is named: FROM {rest}"
            current = m.group(2)
            stages[current] = {"from": m.group(1), "ins": []}
        elif current is not None:
            stages[current]["ins"].append((op, rest))
    return stages


def test_dockerfile_is_multi_stage_bookworm():
    stages = _stages()
    assert list(stages) == ["build", "runtime"]
    assert stages["build"]["from"] == "${BUILD_BASE}"
    assert stages["runtime"]["from"] == "${RUNTIME_BASE}"
    args = [rest for op, rest in _docker_instructions() if op == "ARG"]
    # The bases default to Debian's images; scripts/image.sh passes its own.
    assert "DEBIAN_RELEASE=bookworm" in args
    assert "BUILD_BASE=debian:${DEBIAN_RELEASE}" in args
    assert "RUNTIME_BASE=debian:${DEBIAN_RELEASE}-slim" in args


def test_dockerfile_build_stage():
    ins = _stages()["build"]["ins"]
    run = " ".join(rest for op, rest in ins if op == "RUN")
    for pkg in ("cmake", "ninja-build", "g++", "libgrpc++-dev", "protobuf-compiler-grpc",
                "libabsl-dev", "libre2-dev", "libxxhash-dev", "nlohmann-json3-dev", "libgtest-dev"):
        assert f" {pkg} " in f" {run} ", pkg
    assert "python3-torch" not in run
    assert "-DWEIGHTD_BUILD_TESTS=OFF" in run and "-DCMAKE_BUILD_TYPE=Release" in run
    assert re.search(r"--target weightd weightctl\b", run)
    # COPY sources exist, and cover every directory the top CMakeLists adds.
    copied = set()
    for op, rest in ins:
        if op == "COPY":
            *srcs, _dst = rest.split()
            for src in srcs:
                assert os.path.exists(os.path.join(REPO, src)), src
                copied.add(src.rstrip("/"))
    with open(os.path.join(REPO, "CMakeLists.txt")) as f:
        top = f.read()
    unconditional = re.sub(r"if\(WEIGHTD_BUILD_TESTS\).*?endif\(\)", "", top, flags=re.S)
    for sub in re.findall(r"add_subdirectory\((\w+)\)", unconditional):
        assert sub in copied, f"{sub}/ is configured but not copied"
    assert "cmake" in copied and "CMakeLists.txt" in copied


def test_dockerfile_runtime_stage():
    ins = _stages()["runtime"]["ins"]
    run = " ".join(rest for op, rest in ins if op == "RUN")
    for pkg in ("libgrpc++1.51", "libprotobuf32", "libabsl20220623", "libre2-9", "libxxhash0"):
        assert f" {pkg} " in f" {run} ", pkg
    assert not re.search(r"\S+-dev\b", run), "no -dev packages at run time"
    copies = [rest for op, rest in ins if op == "COPY"]
    assert any(c.startswith("--from=build ") and "/build/bin/weightd " in c and "/build/bin/weightctl " in c
               for c in copies), copies
    user = [rest for op, rest in ins if op == "USER"]
    assert user and not user[-1].startswith(("0", "root"))
    assert user[-1].split(":")[0] == "10001"    # the UID/GID the manifests use
    entry = [rest for op, rest in ins if op == "ENTRYPOINT"]
    assert entry and json.loads(entry[-1]) == ["/usr/local/bin/weightd"]
    cmd = json.loads([rest for op, rest in ins if op == "CMD"][-1])
    assert "--socket" in cmd and "--model-root" in cmd


def test_dockerfile_runtime_packages_cover_the_binaries():
    """The libraries the locally built binaries load come from the runtime
    stage's packages or their dependencies (Debian's dpkg/apt-cache)."""
    if not (shutil.which("dpkg") and shutil.which("apt-cache") and shutil.which("ldd")):
        pytest.skip("needs dpkg, apt-cache and ldd (Debian)")
    ins = _stages()["runtime"]["ins"]
    run = " ".join(rest for op, rest in ins if op == "RUN")
    m = re.search(r"--no-install-recommends\s+(.*?)\s*&&", run)
    wanted = m.group(1).split()
    libs = set()
    for b in (harness.WEIGHTD, harness.WEIGHTCTL):
        out = subprocess.run(["ldd", b], capture_output=True, text=True, check=True).stdout
        assert "not found" not in out, out
        libs |= {os.path.realpath(p) for p in re.findall(r"=> (/\S+)", out)}
    owners = subprocess.run(["dpkg", "-S"] + sorted(libs), capture_output=True, text=True).stdout
    pkgs = {line.split(":")[0] for line in owners.splitlines() if ":" in line}
    closure = subprocess.run(
        ["apt-cache", "depends", "--recurse", "--no-recommends", "--no-suggests", "--no-conflicts",
         "--no-breaks", "--no-replaces", "--no-enhances"] + wanted,
        capture_output=True, text=True, timeout=60).stdout
    have = {line.split(":")[0] for line in closure.splitlines() if line and not line.startswith(" ")}
    # Sanitizer runtimes appear only in scripts/test.sh --sanitize builds;
    # the image is built without sanitizers.
    sanitizers = {p for p in pkgs if re.match(r"lib(asan|ubsan|tsan|lsan)\d*$", p)}
    missing = pkgs - have - sanitizers - {"libc6", "libgcc-s1", "libstdc++6"}
    assert not missing, f"runtime stage lacks {sorted(missing)}"

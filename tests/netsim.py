"""A small simulated network for fleet tests and benchmarks: Linux network
namespaces joined by veth pairs to one bridge, with tc rate limits.

Usage: `with netsim.Net(nodes=3, storage_rate="400mbit") as net:` makes
namespaces node0..node2 (net.nodes[i], addresses 10.77.0.11, .12, ...) and
one "storage" namespace (net.storage, 10.77.0.2) whose egress (what nodes
download from it) is shaped by `tbf` to storage_rate; node_rate shapes each
node's egress, delay adds netem latency on every link. `node.prefix` is a
command prefix (`ip netns exec NS`) to hand to subprocess or to
harness.Daemon(prefix=...) (Unix sockets are files, so the test process still
reaches daemons inside); `node.run(cmd)` / `node.popen(cmd)` run a command
inside (popen'd processes are killed by close()); `node.tx_bytes()` /
`rx_bytes()` read the node's interface counters from outside (e.g. every byte
the storage node served); sources_servers.proc_io(pid) reads /proc/PID/io.
Needs root (CAP_NET_ADMIN) and `ip`/`tc`: `netsim.available()` says why not,
`netsim.require()` skips a pytest test cleanly. Namespaces are named
wdnet-<pid>-<n>-<role> and removed by close() (also at exit, and stale ones of
dead processes at the next Net()); every link lives inside the namespaces,
so nothing is left in the root namespace and parallel runs do not collide.
"""
import atexit
import json
import os
import re
import shutil
import subprocess
import threading

SUBNET = "10.77.0"
STORAGE_ADDR = SUBNET + ".2"
_counter = [0]
_live = set()
_lock = threading.Lock()


def _ip(*args, check=True):
    return subprocess.run(["ip"] + list(args), capture_output=True, text=True, check=check)


def available():
    """(True, "") when namespaces, veths and tc can be made here, else
    (False, why)."""
    if os.geteuid() != 0:
        return False, "netsim needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, "netsim needs %s" % tool
    name = "wdnet-%d-probe" % os.getpid()
    r = _ip("netns", "add", name, check=False)
    if r.returncode != 0:
        return False, "cannot create a network namespace: " + r.stderr.strip()
    try:
        r = _ip("-n", name, "link", "add", "name", "va", "type", "veth", "peer", "name", "vb", check=False)
        if r.returncode != 0:
            return False, "cannot create a veth pair: " + r.stderr.strip()
        r = subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "va", "root",
                            "tbf", "rate", "10mbit", "burst", "32kb", "latency", "50ms"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            return False, "cannot add a tc qdisc: " + r.stderr.strip()
    finally:
        _ip("netns", "del", name, check=False)
    return True, ""


def require():
    """pytest.skip()s the calling test when netsim cannot run here."""
    ok, why = available()
    if not ok:
        import pytest
        pytest.skip(why)


def _cleanup_stale():
    r = _ip("netns", "list", check=False)
    for line in r.stdout.splitlines():
        m = re.match(r"(wdnet-(\d+)-\S+)", line)
        if m and int(m.group(2)) != os.getpid() and not os.path.exists("/proc/" + m.group(2)):
            _ip("netns", "del", m.group(1), check=False)


class Node:
    def __init__(self, net, ns, addr, role):
        self.net = net
        self.ns = ns
        self.addr = addr
        self.role = role
        self.prefix = ["ip", "netns", "exec", ns]

    def run(self, cmd, **kw):
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.prefix + list(cmd), **kw)

    def popen(self, cmd, **kw):
        p = subprocess.Popen(self.prefix + list(cmd), **kw)
        self.net._procs.append(p)
        return p

    def _stats(self):
        out = _ip("-n", self.ns, "-j", "-s", "link", "show", "eth0").stdout
        return json.loads(out)[0]["stats64"]

    def tx_bytes(self):
        """Bytes this node sent on its link (counted by the kernel)."""
        return self._stats()["tx"]["bytes"]

    def rx_bytes(self):
        return self._stats()["rx"]["bytes"]

    def __repr__(self):
        return "Node(%s, %s)" % (self.ns, self.addr)


# A storage_flow_rate Net gives the nodes' connections these local ports,
# one HTB class each on the storage's egress.
FLOW_PORTS = (40000, 40255)


def _shape_per_flow(ns, dev, rate, flow_rate):
    """Each connection to a node (by the node's port, FLOW_PORTS) paced to
    flow_rate under `rate` in all: HTB classes 1:<k> under 1:1, selected by
    u32 on the destination port (this kernel has neither fq nor netem)."""
    tc = ["ip", "netns", "exec", ns, "tc"]
    total = rate or "100gbit"
    cmds = [["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "2"],
            ["class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
             "rate", total, "ceil", total],
            ["class", "add", "dev", dev, "parent", "1:1", "classid", "1:2", "htb",
             "rate", flow_rate, "ceil", flow_rate]]
    lo, hi = FLOW_PORTS
    for k, port in enumerate(range(lo, hi + 1)):
        cls = "1:%x" % (0x100 + k)
        cmds.append(["class", "add", "dev", dev, "parent", "1:1", "classid", cls, "htb",
                     "rate", flow_rate, "ceil", flow_rate])
        cmds.append(["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
                     "u32", "match", "ip", "dport", str(port), "0xffff", "flowid", cls])
    batch = "\n".join(" ".join(c) for c in cmds) + "\n"
    subprocess.run(tc + ["-batch", "-"], input=batch, text=True, check=True,
                   capture_output=True)


def _shape(ns, dev, rate, delay):
    base = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root"]
    if delay and rate:
        subprocess.run(base + ["handle", "1:", "netem", "delay", delay], check=True)
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev,
                        "parent", "1:1", "handle", "10:", "tbf", "rate", rate, "burst", "256kb",
                        "latency", "100ms"], check=True)
    elif delay:
        subprocess.run(base + ["netem", "delay", delay], check=True)
    elif rate:
        subprocess.run(base + ["tbf", "rate", rate, "burst", "256kb", "latency", "100ms"],
                       check=True)


class Net:
    """nodes: how many node namespaces; storage: add the storage namespace;
    storage_rate / node_rate: tc rates ("400mbit", None = unshaped) of the
    storage's and each node's egress; delay: netem delay on every link
    (kernels with sch_netem); storage_flow_rate: each connection from
    storage also paced to this rate, as an object store serves one
    connection well below a node's link (the nodes' local ports are then
    FLOW_PORTS)."""

    def __init__(self, nodes=2, storage=True, storage_rate=None, node_rate=None, delay=None,
                 storage_flow_rate=None):
        self._flow_rate = storage_flow_rate
        ok, why = available()
        if not ok:
            raise RuntimeError(why)
        _cleanup_stale()
        with _lock:
            _counter[0] += 1
            self.tag = "wdnet-%d-%d" % (os.getpid(), _counter[0])
        self._procs = []
        self._namespaces = []
        self.nodes = []
        self.storage = None
        try:
            self.hub = self._ns("hub")
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            if storage:
                self.storage = self._attach("storage", STORAGE_ADDR, storage_rate, delay, 0)
            for i in range(nodes):
                self.nodes.append(self._attach("node%d" % i, "%s.%d" % (SUBNET, 11 + i),
                                               node_rate, delay, i + 1))
        except BaseException:
            self.close()
            raise
        with _lock:
            _live.add(self)

    def _ns(self, role):
        name = "%s-%s" % (self.tag, role)
        _ip("netns", "add", name)
        self._namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        return name

    def _attach(self, role, addr, rate, delay, index):
        ns = self._ns(role)
        port = "p%d" % index
        _ip("link", "add", "name", port, "netns", self.hub, "type", "veth", "peer", "name", "eth0",
            "netns", ns)
        _ip("-n", self.hub, "link", "set", port, "master", "br0")
        _ip("-n", self.hub, "link", "set", port, "up")
        _ip("-n", ns, "addr", "add", addr + "/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        if role == "storage" and self._flow_rate:
            if delay:
                raise ValueError("storage_flow_rate with delay is not built")
            _shape_per_flow(ns, "eth0", rate, self._flow_rate)
        else:
            _shape(ns, "eth0", rate, delay)
        if self._flow_rate and role != "storage":
            _ip("netns", "exec", ns, "sysctl", "-q", "-w",
                "net.ipv4.ip_local_port_range=%d %d" % FLOW_PORTS)
        return Node(self, ns, addr, role)

    @property
    def all(self):
        return ([self.storage] if self.storage else []) + self.nodes

    def close(self):
        for p in self._procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self._procs = []
        for ns in reversed(self._namespaces):
            _ip("netns", "del", ns, check=False)
        self._namespaces = []
        with _lock:
            _live.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@atexit.register
def _close_all():
    for net in list(_live):
        net.close()

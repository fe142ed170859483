"""Several hosts on one machine: Linux network namespaces on a bridge, each with an address of
its own, and the faults between them: a link cut (every packet from one host to a port of
another dropped, both ways, as a firewall or a partition does) and a slow, lossy link.

The control-plane host is this machine's own namespace, at the bridge's address; the others are
namespaces joined to the bridge by veth pairs. Cuts are `tc` filters into a queue that holds
nothing (htb, u32, pfifo of limit 0: what kernels without netem or tc actions still have); the
slow link is `tests/system/wan.py`, run in each host of the pair.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field

from tests.system.harness import ROOT


def available() -> str | None:
    """Why hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "network namespaces need iproute2 (ip, tc)"
    if not os.path.exists("/dev/net/tun"):
        return "a slow link needs /dev/net/tun"
    return None


def _ip(*argv: str, namespace: str | None = None) -> None:
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    subprocess.run([*prefix, *argv], check=True, capture_output=True, timeout=30)


@dataclass
class Network:
    tag: str  # a few letters, unique on the machine: names of namespaces and links
    subnet: str  # "10.213.7": a /24 of its own
    hosts: dict[str, str] = field(default_factory=dict)  # name -> address
    _processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def control(self) -> str:
        """The control-plane host's address: this machine's namespace, on the bridge."""
        return f"{self.subnet}.1"

    @property
    def bridge(self) -> str:
        return f"br{self.tag}"

    def namespace(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def _veth(self, host: str) -> str:
        return f"v{self.tag}{list(self.hosts).index(host)}"

    def up(self, names: list[str]) -> None:
        _ip("ip", "link", "add", self.bridge, "type", "bridge")
        _ip("ip", "addr", "add", f"{self.control}/24", "dev", self.bridge)
        _ip("ip", "link", "set", self.bridge, "up")
        for number, name in enumerate(names):
            self.hosts[name] = address = f"{self.subnet}.{11 + number}"
            ns, veth, inside = self.namespace(name), self._veth(name), f"e{self.tag}{number}"
            _ip("ip", "netns", "add", ns)
            _ip("ip", "link", "add", veth, "type", "veth", "peer", "name", inside)
            _ip("ip", "link", "set", inside, "netns", ns)
            _ip("ip", "link", "set", veth, "master", self.bridge)
            _ip("ip", "link", "set", veth, "up")
            _ip("ip", "link", "set", inside, "name", "eth0", namespace=ns)
            _ip("ip", "addr", "add", f"{address}/24", "dev", "eth0", namespace=ns)
            _ip("ip", "link", "set", "lo", "up", namespace=ns)
            _ip("ip", "link", "set", "eth0", "up", namespace=ns)

    def down(self) -> None:
        for process in self._processes:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        for host in self.hosts:
            self.kill_all(host)
            subprocess.run(["ip", "netns", "del", self.namespace(host)], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def kill_all(self, host: str) -> None:
        """Every process in the host (its agent's engines, which outlive the agent, too)."""
        pids = subprocess.run(["ip", "netns", "pids", self.namespace(host)], capture_output=True,
                              text=True).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)

    def start(self, host: str, argv: list[str], *, env: dict, log) -> subprocess.Popen:
        """`argv` run in `host` (None: the control-plane host), from the project's root."""
        prefix = ["ip", "netns", "exec", self.namespace(host)] if host else []
        process = subprocess.Popen([*prefix, *argv], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        self._processes.append(process)
        return process

    def _drop(self, namespace: str | None, dev: str, match: list[str]) -> None:
        """Packets leaving `dev` that `match` (u32 terms) are dropped: queued into nothing."""
        tc = (["ip", "netns", "exec", namespace] if namespace else []) + ["tc"]
        for argv in (["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1", "r2q", "100000"],
                     ["class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", "10gbit"],
                     ["class", "add", "dev", dev, "parent", "1:", "classid", "1:2", "htb", "rate", "10gbit"],
                     ["qdisc", "add", "dev", dev, "parent", "1:2", "handle", "20:", "pfifo", "limit", "0"],
                     ["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32", *match,
                      "flowid", "1:2"]):
            subprocess.run([*tc, *argv], check=True, capture_output=True, timeout=30)

    def _undrop(self, namespace: str | None, dev: str) -> None:
        tc = (["ip", "netns", "exec", namespace] if namespace else []) + ["tc"]
        subprocess.run([*tc, "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=30)

    @contextlib.contextmanager
    def cut(self, host: str, port: int):
        """No packet between `host` and the control-plane host's `port`, either way."""
        self._drop(self.namespace(host), "eth0",
                   ["match", "ip", "dst", f"{self.control}/32", "match", "ip", "dport", str(port), "0xffff"])
        self._drop(None, self._veth(host),  # what the control-plane host sends into `host`
                   ["match", "ip", "src", f"{self.control}/32", "match", "ip", "sport", str(port), "0xffff"])
        try:
            yield
        finally:
            self._undrop(self.namespace(host), "eth0")
            self._undrop(None, self._veth(host))

    @contextlib.contextmanager
    def slow(self, one: str, other: str, *, delay_ms: int, loss: float):
        """Between `one` and `other`, each packet held `delay_ms` and `loss` of them dropped, each way."""
        links = []
        try:
            for host, peer in ((one, other), (other, one)):
                links.append(self.start(host, [sys.executable, "-m", "tests.system.wan", "--to", self.hosts[peer],
                                               "--delay-ms", str(delay_ms), "--loss", str(loss)],
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"}, log=subprocess.PIPE))
            for link in links:
                assert link.stdout.readline().strip() == b"ready", "the slow link did not start"
            yield
        finally:
            for host, link in zip((one, other), links, strict=False):  # as many as started
                link.kill()
                link.wait()
                # its TUN device went with it, and its routes; the rule that bypassed it stays
                subprocess.run(["ip", "netns", "exec", self.namespace(host), "ip", "rule", "del", "priority", "100"],
                               capture_output=True)

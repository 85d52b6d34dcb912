"""A small LAN for tests: hosts in network namespaces, joined by a Linux bridge.

The bridge lives in a namespace of its own, so that nothing (multicast DNS
included) reaches this machine's real network. Each host gets a veth pair, one
end in its namespace with an address on ``SUBNET``, the other on the bridge.
A host's link can be throttled with ``tc tbf`` on both of its ends. Needs root
and ``ip``/``tc`` (iproute2); ``available()`` says why not where they are missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from typing import Dict, List, Optional

SUBNET = "10.235.77"


def available() -> Optional[str]:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"mxp{uuid.uuid4().hex[:6]}"
    try:
        _run("ip", "netns", "add", probe)
    except subprocess.CalledProcessError as err:
        return f"cannot make a network namespace: {err.stderr.strip()}"
    _run("ip", "netns", "del", probe)
    return None


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


class Lan:
    """Hosts on one bridge; ``close()`` removes every namespace (and with them every link)."""

    def __init__(self):
        self.tag = uuid.uuid4().hex[:5]
        self.bridge_ns = f"mxb{self.tag}"
        self.hosts: Dict[str, str] = {}  # name -> address
        self.namespaces: List[str] = []
        _run("ip", "netns", "add", self.bridge_ns)
        self.namespaces.append(self.bridge_ns)
        self._ns(self.bridge_ns, "ip", "link", "set", "lo", "up")
        self._ns(self.bridge_ns, "ip", "link", "add", "br0", "type", "bridge")
        # No IGMP snooping: multicast reaches every port (mDNS's 224.0.0.251 would anyway).
        self._ns(self.bridge_ns, "ip", "link", "set", "br0", "type", "bridge", "mcast_snooping", "0")
        self._ns(self.bridge_ns, "ip", "link", "set", "br0", "up")

    def _ns(self, ns: str, *cmd: str) -> str:
        return _run("ip", "netns", "exec", ns, *cmd)

    def namespace(self, host: str) -> str:
        return f"mx{host}{self.tag}"

    def add(self, host: str) -> str:
        """A host on the bridge; returns its address."""
        ns, i = self.namespace(host), len(self.hosts) + 2
        outer, inner = f"v{host}{self.tag}"[:15], "eth0"
        _run("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        _run("ip", "link", "add", outer, "netns", self.bridge_ns, "type", "veth", "peer", "name", inner,
             "netns", ns)
        self._ns(self.bridge_ns, "ip", "link", "set", outer, "master", "br0", "up")
        self._ns(ns, "ip", "link", "set", "lo", "up")
        self._ns(ns, "ip", "addr", "add", f"{SUBNET}.{i}/24", "dev", inner)
        self._ns(ns, "ip", "link", "set", inner, "up", "multicast", "on")
        self.hosts[host] = f"{SUBNET}.{i}"
        return self.hosts[host]

    def throttle(self, host: str, rate: str, burst: str = "16kb", latency: str = "200ms") -> None:
        """Cap ``host``'s link at ``rate`` (e.g. 40mbit) both ways (``tc tbf`` on both ends)."""
        outer = f"v{host}{self.tag}"[:15]
        for ns, dev in ((self.namespace(host), "eth0"), (self.bridge_ns, outer)):
            self._ns(ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
                     "latency", latency)

    def reach_from_here(self) -> str:
        """A link from this (the root) namespace to the bridge, so that tests reach the hosts;
        returns this side's address. Nothing on this side speaks multicast DNS."""
        outer = f"vroot{self.tag}"[:15]
        _run("ip", "link", "add", outer, "type", "veth", "peer", "name", "up0", "netns", self.bridge_ns)
        self._ns(self.bridge_ns, "ip", "link", "set", "up0", "master", "br0", "up")
        _run("ip", "addr", "add", f"{SUBNET}.1/24", "dev", outer)
        _run("ip", "link", "set", outer, "up")
        return f"{SUBNET}.1"

    def command(self, host: str, *cmd: str) -> List[str]:
        """``cmd`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(host), *cmd]

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", f"vroot{self.tag}"[:15]], capture_output=True)
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.clear()

"""Which announced addresses the head may dial, and what to tell a user whose nodes it
does not find: pure decisions over what ``discovery.py`` heard (no socket is opened here).

An announcement is dialled only if it names this cluster's id, an address on one of this
machine's networks (the subnets of its interfaces; a loopback address is on loopback's),
that is a host's (not multicast, broadcast or 0.0.0.0), and none of this head's own
listening sockets. ``choose`` says which address, or why none.
"""

from __future__ import annotations

import ipaddress
from typing import List, Optional, Sequence, Tuple

ALL = ("", "0.0.0.0", "::", "[::]")  # a socket bound to these listens on every address of the machine


def local_networks() -> List[Tuple[str, ipaddress.IPv4Interface]]:
    """(interface, address/prefix) of every IPv4 address of this machine, loopback's included."""
    import ifaddr  # (python-zeroconf's own dependency)

    return [(adapter.nice_name, ipaddress.IPv4Interface(f"{a.ip}/{a.network_prefix}"))
            for adapter in ifaddr.get_adapters() for a in adapter.ips if isinstance(a.ip, str)]


def on_link(host: str, networks: Optional[Sequence[Tuple[str, ipaddress.IPv4Interface]]] = None) -> bool:
    """Whether ``host`` lies on a network one of this machine's interfaces is on."""
    try:
        ip = ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return any(ip in net.network for _, net in (local_networks() if networks is None else networks))


def _listens_on(ip: ipaddress.IPv4Address, port: int, listening: Sequence[Tuple[str, int]], mine: bool) -> bool:
    """Whether (ip, port) reaches one of ``listening`` (``mine``: ip is this machine's)."""
    for host, p in listening:
        if p != port:
            continue
        if host in ALL:
            if mine:
                return True
        elif host == str(ip):
            return True
    return False


def _refusal(host: str, port: int, networks, listening) -> Optional[Tuple[str, str]]:
    """(kind, why) the head may not dial host:port, or None."""
    try:
        ip = ipaddress.IPv4Address(host)
    except ValueError:
        return "address", f"{host} is not an IPv4 address"
    if ip.is_multicast or ip.is_unspecified or ip == ipaddress.IPv4Address("255.255.255.255"):
        return "address", f"{host} is not a host's address"
    near = [net for _, net in networks if ip in net.network]
    if not near:
        return "off-link", f"{host}:{port} is not on a network this machine is on"
    if any(net.network.prefixlen < 31 and ip in (net.network.broadcast_address, net.network.network_address)
           for net in near if not ip.is_loopback):
        return "address", f"{host} is not a host's address"
    mine = ip.is_loopback or any(ip == net.ip for _, net in networks)
    if _listens_on(ip, port, listening, mine):
        return "own", f"{host}:{port} is this head's own listening socket"
    return None


def choose(hosts: Sequence[str], port: int, cluster_id: str, ours: str,
           listening: Sequence[Tuple[str, int]] = ()) -> Tuple[str, str, str]:
    """Whether the head may dial an announcement of ``hosts`` at ``port`` with ``cluster_id``:
    (the host to dial, "", "") or (the host to list, the kind of refusal, why in words)."""
    listed = hosts[0] if hosts else ""
    if not ours:
        return listed, "unknown", "no cluster secret here to tell its cluster by"
    if not cluster_id:
        return listed, "no-id", "it announces no cluster id"
    if cluster_id != ours:
        return listed, "another", "another cluster (it announces another cluster id: another secret)"
    if not hosts:
        return listed, "address", "it announces no IPv4 address"
    if not 0 < port < 65536:
        return listed, "address", f"it announces port {port}"
    networks, first = local_networks(), None
    for host in hosts:
        refused = _refusal(host, port, networks, listening)
        if refused is None:
            return host, "", ""
        first = first or refused
    return (listed, *first)


# -- what to tell a user whose nodes are not found --------------------------------------------

_CHECKS = {  # the kind of what was seen -> what to check
    "another": "that every node holds this head's secret (the same --secret-file or $MLXPIPE_SECRET): a node of "
               "another secret announces another cluster id",
    "no-id": "that every node holds this head's secret (the same --secret-file or $MLXPIPE_SECRET) and runs this "
             "mlxpipe",
    "unknown": "the secret: give this head the cluster's (--secret-file or $MLXPIPE_SECRET)",
    "off-link": "the network: a node must announce an address on one of this machine's networks ({networks}): "
                "connect it to one, or give it --advertise with such an address",
    "address": "what the node announces (--advertise, --listen)",
    "stranger": "what answers there: it announces this cluster's id but cannot prove the secret",
    "silent": "that the node's port is reachable from here (a firewall?)",
    "refused": "the reasons above (versions, clock)",
}
_ANNOUNCE = ("that the nodes run `mlxpipe node --announce` (one started without it is never found: name it with "
             "--nodes, or start it with --join HOST:PORT)")
_MULTICAST = ("that multicast DNS (UDP port 5353) reaches this machine from them: the same network ({networks}), "
              "no Wi-Fi client isolation or firewall between")
SHOWN = 6  # nodes named in the hint; the rest counted


def hint(count: int, usable: int, seen: Sequence) -> str:
    """One line: what was seen (``discovery.Found`` of each announcement) and what to check."""
    nets = ", ".join(f"{net.with_prefixlen} ({name})" for name, net in local_networks() if not net.ip.is_loopback)
    nets = nets or "none but loopback"
    head = f"still looking for this cluster's nodes on the local network: {usable} of {count} found"
    if not seen:
        checks = [_ANNOUNCE, _MULTICAST.format(networks=nets)]
        return f"{head}; no node has announced itself here at all. Check {'; and '.join(checks)}"
    seen = sorted(seen, key=lambda f: f.address)
    said = [f"{f.name or f.instance} at {f.address}: {'usable' if f.usable else f.why}" for f in seen[:SHOWN]]
    if len(seen) > SHOWN:
        said.append(f"and {len(seen) - SHOWN} more (mlxpipe nodes)")
    kinds = list(dict.fromkeys(f.reason for f in seen if not f.usable and f.reason in _CHECKS))
    checks = [_CHECKS[k].format(networks=nets) for k in kinds]
    if sum(f.cluster == "this" for f in seen) < count:  # some of this cluster's nodes do not announce
        checks.append(_ANNOUNCE)
    return f"{head}. Seen: {'; '.join(said)}. Check {'; and '.join(checks) or 'the nodes named above'}"

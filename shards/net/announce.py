"""A node announcing itself on the local network: DNS-SD over multicast DNS (python-zeroconf).

``mlxpipe node --announce`` registers a ``_mlxpipe._tcp`` service whose TXT
record says what a head needs to choose it: the node's name, the memory it
offers, its chip, its mlxpipe, MLX and mlx-lm versions, and the cluster id
(``hello.cluster_id``: an HMAC of a fixed label under the secret, never the
secret). Heads find it with ``serve --discover`` (``server/cluster/discovery.py``).

Multicast DNS stays on the link: its packets go to 224.0.0.251, which routers
never forward. Records live ``TTL_S`` seconds in other machines' caches unless
refreshed, and a node that stops cleanly says goodbye (TTL 0).
"""

from __future__ import annotations

import logging
import re
import socket
from typing import List

from mlxpipe.shards.net import hello

logger = logging.getLogger(__name__)

SERVICE = "_mlxpipe._tcp.local."
TTL_S = 15


def addresses(host: str) -> List[str]:
    """The IPv4 addresses to announce for a node listening on ``host`` (all of this machine's
    but loopback, for 0.0.0.0)."""
    import ifaddr

    if host not in ("", "0.0.0.0", "::", "[::]"):
        return [socket.gethostbyname(host)]
    out = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str) and not ip.ip.startswith("127."):
                out.append(ip.ip)
    return out


def properties(name: str, memory_bytes: int, secret: str) -> dict:
    """The TXT record: short keys, short values."""
    v = hello.versions()
    props = {"name": name[:63], "cid": hello.cluster_id(secret), "mem": str(memory_bytes),
             "chip": hello.chip()[:63], "ver": v["mlxpipe"], "mlx": v["mlx"], "mlxlm": v["mlx_lm"]}
    if hello.rdma_devices():  # peers over Thunderbolt 5 RDMA (JACCL): a tensor group's fast link; none on Linux
        props["rdma"] = ",".join(hello.rdma_devices())[:63]
    return props


class Announcer:
    """This node's registration, from ``start`` until ``stop``."""

    def __init__(self, name: str, hosts: List[str], port: int, props: dict):
        from zeroconf import IPVersion
        from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

        # Unique on the link (machines may share a host name): the name, the first address, the port.
        instance = re.sub(r"[^A-Za-z0-9-]", "-", f"{name}-{hosts[0] if hosts else ''}-{port}")[:63]
        self.info = AsyncServiceInfo(SERVICE, f"{instance}.{SERVICE}", port=port, properties=props,
                                     addresses=[socket.inet_aton(h) for h in hosts],
                                     server=f"{instance}.local.", host_ttl=TTL_S, other_ttl=TTL_S)
        self.zc = AsyncZeroconf(ip_version=IPVersion.V4Only)

    async def start(self) -> None:
        await self.zc.async_register_service(self.info, allow_name_change=True)
        logger.warning("announcing %s on the local network (%s)", self.info.name,
                       ", ".join(f"{a}:{self.info.port}" for a in self.info.parsed_addresses()))

    async def stop(self) -> None:
        try:
            await self.zc.async_unregister_service(self.info)  # goodbye: heads drop us at once
        finally:
            await self.zc.async_close()

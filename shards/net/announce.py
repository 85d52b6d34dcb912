"""A node announcing itself on the local network: DNS-SD over multicast DNS (python-zeroconf).

``mlxpipe node --announce`` registers a ``_mlxpipe._tcp`` service whose TXT
record says what a head needs to choose it: the node's name, the memory it
offers, its chip, its mlxpipe, MLX and mlx-lm versions, and the cluster id
(``hello.cluster_id``: an HMAC of a fixed label under the secret, never the
secret). Heads find it with ``serve --discover`` (``server/cluster/discovery.py``).

Multicast DNS stays on the link: its packets go to 224.0.0.251, which routers
never forward. Records live ``TTL_S`` seconds in other machines' caches unless
refreshed, and a node that stops cleanly says goodbye (TTL 0).

Anyone on the link can announce anything, so a head reads a record with ``read``:
each field checked (type, length, printable text) before it is used or shown, and
one it cannot take skipped with a line saying why, escaped (``hello.shown``).
"""

from __future__ import annotations

import logging
import re
import socket
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from mlxpipe.shards.net import hello
from mlxpipe.shards.net.hello import shown

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


# The TXT record's text fields and the most characters each may hold (what ``properties`` writes fits).
TEXT_FIELDS = {"name": 63, "chip": 63, "ver": 64, "mlx": 64, "mlxlm": 64, "rdma": 63}
CLUSTER_ID = re.compile(r"[0-9a-f]{16}")   # hello.cluster_id's form
MAX_MEMORY_DIGITS = 18                     # bytes offered: up to an exabyte


def properties(name: str, memory_bytes: int, secret: str) -> dict:
    """The TXT record: short keys, short values."""
    v = hello.versions()
    props = {"name": name[:TEXT_FIELDS["name"]], "cid": hello.cluster_id(secret), "mem": str(memory_bytes),
             "chip": hello.chip()[:TEXT_FIELDS["chip"]], "ver": v["mlxpipe"], "mlx": v["mlx"], "mlxlm": v["mlx_lm"]}
    if hello.rdma_devices():  # peers over Thunderbolt 5 RDMA (JACCL): a tensor group's fast link; none on Linux
        props["rdma"] = ",".join(hello.rdma_devices())[:TEXT_FIELDS["rdma"]]
    return props


@dataclass
class Fields:
    """What a TXT record says, every field checked (empty where it said nothing usable)."""

    name: str = ""
    chip: str = ""
    memory_bytes: int = 0
    cluster_id: str = ""
    versions: Dict[str, str] = field(default_factory=lambda: {"mlxpipe": "", "mlx": "", "mlx_lm": ""})
    rdma: List[str] = field(default_factory=list)  # its RDMA devices (Thunderbolt 5: a tensor group's fast link)


def _text(key: str, raw: bytes) -> Tuple[str, str]:
    """(the field's text, or "" and why it was skipped)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "", f"not UTF-8 text: {shown(repr(raw), 80)}"
    if not text.isprintable():
        return "", f"not printable text: '{shown(text, 80)}'"
    if key in TEXT_FIELDS and len(text) > TEXT_FIELDS[key]:
        return "", f"longer than {TEXT_FIELDS[key]} characters: '{text[:40]}...'"
    if key == "cid" and not CLUSTER_ID.fullmatch(text):
        return "", f"not a cluster id (16 hex digits): '{shown(text, 80)}'"
    if key == "mem" and not (text.isascii() and text.isdigit() and len(text) <= MAX_MEMORY_DIGITS):
        return "", f"not a number of bytes: '{shown(text, 80)}'"
    return text, ""


def read(txt: Dict[bytes, object]) -> Tuple[Fields, List[str]]:
    """A TXT record as zeroconf gives it (bytes keys, bytes or None values): its fields
    that pass their checks, and one line for each field skipped (``field mem skipped:
    not a number of bytes: 'abc'``). Keys this version does not know are left alone."""
    fields, skipped = Fields(), []
    names = {"ver": "mlxpipe", "mlx": "mlx", "mlxlm": "mlx_lm"}
    for k, v in txt.items():
        key = k.decode("ascii", "replace") if isinstance(k, bytes) else str(k)
        if key not in TEXT_FIELDS and key not in ("cid", "mem"):
            continue
        if not isinstance(v, bytes):
            skipped.append(f"field {key} skipped: no value")
            continue
        text, why = _text(key, v)
        if why:
            skipped.append(f"field {key} skipped: {why}")
        elif key == "mem":
            fields.memory_bytes = int(text)
        elif key == "cid":
            fields.cluster_id = text
        elif key in names:
            fields.versions[names[key]] = text
        elif key == "rdma":
            fields.rdma = [d for d in text.split(",") if d]
        else:
            setattr(fields, key, text)
    return fields, skipped


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

"""This node's RDMA devices, and which Thunderbolt cable each one rides on.

JACCL (MLX's RDMA backend over Thunderbolt 5) opens, on rank i, the device that faces rank j:
``rdma_en2`` is the RDMA device of the network interface ``en2``, a Thunderbolt port. Which
peer a port faces is the cable's business, so a node says, per device, its port's domain UUID
and the UUID of the port at the cable's other end (``system_profiler SPThunderboltDataType``,
as MLX's own ``mlx.distributed_config`` reads it), and the head matches one node's ``peer``
to another's ``port`` (``server/cluster/tp_backend.py``). Nothing here on Linux: no devices.
"""

from __future__ import annotations

import functools
import json
import logging
import platform
import subprocess
from dataclasses import dataclass
from typing import Dict, List, Tuple

logger = logging.getLogger(__name__)

MAX_DEVICES = 8  # RDMA devices a node reports, at most


@dataclass(frozen=True)
class Port:
    """One RDMA device and the Thunderbolt port under it (``pb.RdmaPort``)."""

    device: str  # rdma_en2
    port: str    # the port's domain UUID
    peer: str    # the UUID of the port cabled to it ("": nothing)


def _run(*argv: str) -> str:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


@functools.lru_cache(maxsize=1)
def devices() -> tuple:
    """This node's RDMA devices (on a Mac with Thunderbolt 5 and RDMA enabled: ``rdma_en2``, ...),
    over which JACCL reaches the peers cabled to them; none elsewhere (Linux here: the ring backend)."""
    if platform.system() != "Darwin":
        return ()
    names = [line.split()[0] for line in _run("ibv_devices").splitlines()[2:] if line.strip()]  # after 2 headers
    return tuple(n for n in names if n.isprintable())[:MAX_DEVICES]


def hardware_ports(text: str) -> Dict[str, str]:
    """``networksetup -listallhardwareports``: port name (``Thunderbolt 1``) -> interface (``en2``)."""
    out, name = {}, None
    for line in text.splitlines():
        if line.startswith("Hardware Port:"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("Device:") and name is not None:
            out[name] = line.split(":", 1)[1].strip()
            name = None
    return out


def thunderbolt_ports(profile: dict, interfaces: Dict[str, str], have: Tuple[str, ...]) -> List[Port]:
    """The ports of ``system_profiler SPThunderboltDataType -json`` whose interface has an RDMA
    device in ``have``: each with its own domain UUID and its cable's other end."""
    out = []
    for bus in profile.get("SPThunderboltDataType", []):
        uuid = bus.get("domain_uuid_key")
        tag = (bus.get("receptacle_1_tag") or {}).get("receptacle_id_key")
        iface = interfaces.get(f"Thunderbolt {tag}")
        if not uuid or iface is None or f"rdma_{iface}" not in have:
            continue
        cabled = [item["domain_uuid_key"] for item in bus.get("_items", []) if "domain_uuid_key" in item]
        out.append(Port(f"rdma_{iface}", uuid, cabled[0] if cabled else ""))
    return sorted(out, key=lambda p: p.device)


@functools.lru_cache(maxsize=1)
def ports() -> Tuple[Port, ...]:
    """This node's RDMA devices with the cables under them (none on Linux, or when macOS will not say)."""
    have = devices()
    if not have:
        return ()
    try:
        profile = json.loads(_run("system_profiler", "SPThunderboltDataType", "-json") or "{}")
    except ValueError:
        logger.warning("system_profiler's Thunderbolt report is not JSON: RDMA devices reported without peers")
        return ()
    return tuple(thunderbolt_ports(profile, hardware_ports(_run("networksetup", "-listallhardwareports")), have))

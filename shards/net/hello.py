"""Who a node is, and its proof that it holds the cluster secret.

A head that discovered a node on the LAN (``announce.py``) must not send it the
secret before it knows the node holds it too: anyone can announce. So it asks
``Hello`` first, a call that needs no secret and reads no request body: the
head's random nonce and the address it dialled travel as metadata, and the node
answers ``HMAC-SHA256(secret, LABEL | nonce | address)``, but only for an
address that is its own (one of its interfaces' at its port, or the one it was
told to ``--advertise``), so a stranger cannot relay a head's question to a
real node and pass its answer off as its own. The reply also says what the node
runs (versions, chip, memory offered, its clock), for the head's checks
(``server/cluster/checks.py``).

The cluster id a node announces is an HMAC of a fixed label under the secret:
nodes of one cluster share it, and it says nothing of the secret. What a node says
of itself (here, or in its announcement) is shown by a head through ``shown``.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import importlib.metadata
import platform
import subprocess
import time
from typing import Iterable, Optional, Set

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.shards.net import rdma

LABEL = b"mlxpipe hello v1\x00"
CLUSTER_LABEL = b"mlxpipe cluster id v1"
NONCE_KEY = "mlxpipe-nonce"      # metadata: the head's nonce, hex
DIALLED_KEY = "mlxpipe-dialled"  # metadata: host:port the head dialled


def cluster_id(secret: Optional[str]) -> str:
    """The id nodes of one cluster announce: derived from the secret, never the secret."""
    if not secret:
        return ""
    return hmac.new(secret.encode(), CLUSTER_LABEL, hashlib.sha256).hexdigest()[:16]


def shown(text: str, limit: int = 200) -> str:
    """``text`` safe to print or log: control and format characters escaped (``\\n``,
    ``\\x1b``, ``\\u202e``), so it cannot start a forged line, colour a terminal or reorder
    what it shows; cut at ``limit`` characters."""
    if not text.isprintable():
        text = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)
    return text if len(text) <= limit else text[:limit] + "..."


def proof(secret: str, nonce: bytes, address: str) -> bytes:
    return hmac.new(secret.encode(), LABEL + nonce + b"|" + address.encode(), hashlib.sha256).digest()


def verify(secret: str, nonce: bytes, address: str, given: bytes) -> bool:
    return bool(given) and hmac.compare_digest(proof(secret, nonce, address), given)


@functools.lru_cache(maxsize=1)
def chip() -> str:
    """What the node computes on, in a few words (Apple M2 Ultra; an x86_64 CPU's model name)."""
    if platform.system() == "Darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=2).stdout.strip() or platform.machine()
        except (OSError, subprocess.SubprocessError):
            return platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def rdma_devices() -> tuple:
    """This node's RDMA devices (``rdma.devices``: on a Mac with Thunderbolt 5 RDMA; none on Linux)."""
    return rdma.devices()


@functools.lru_cache(maxsize=1)
def versions() -> dict:
    """mlxpipe's, MLX's and mlx-lm's versions here."""
    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return ""

    return {"mlxpipe": version("mlxpipe"), "mlx": version("mlx"), "mlx_lm": version("mlx-lm")}


def own_addresses(port: int, advertise: Iterable[str] = ()) -> Set[str]:
    """host:port of every address of this machine's interfaces at ``port``, and ``advertise``."""
    import ifaddr

    out = set(advertise)
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            host = ip.ip if isinstance(ip.ip, str) else ip.ip[0]
            out.add(f"{host}:{port}" if ":" not in host else f"[{host}]:{port}")
    return out


def reply(secret: Optional[str], memory_bytes: int, name: str, metadata, mine: Set[str],
          group_port: int = 0) -> pb.HelloReply:
    """The Hello answer to a call with ``metadata``: the proof only for an address in ``mine``;
    ``group_port``: where its rank of a tensor group would listen."""
    v = versions()
    out = pb.HelloReply(name=name, chip=chip(), memory_bytes=memory_bytes, mlxpipe_version=v["mlxpipe"],
                        mlx_version=v["mlx"], mlx_lm_version=v["mlx_lm"], time_s=time.time(),
                        cluster=cluster_id(secret), group_port=group_port, rdma=rdma_devices(),
                        rdma_ports=[pb.RdmaPort(device=p.device, port=p.port, peer=p.peer) for p in rdma.ports()])
    md = dict(metadata or ())
    try:
        nonce = bytes.fromhex(md.get(NONCE_KEY, ""))
    except ValueError:
        nonce = b""
    dialled = md.get(DIALLED_KEY, "")
    if secret and 16 <= len(nonce) <= 64 and dialled in mine:
        out.proof = proof(secret, nonce, dialled)
    return out

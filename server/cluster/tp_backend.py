"""Which collective a tensor-parallel group uses: JACCL over Thunderbolt 5 RDMA, or the ring over TCP.

JACCL needs a full mesh: a Thunderbolt cable between every pair of the group's ranks, each end
an RDMA device (``rdma_en2``). Each node says in ``Hello`` which of its devices rides on which
port and what that port is cabled to (``shards/net/rdma.py``); matching one node's ``peer`` to
another's ``port`` gives JACCL's device matrix (``devices[i][j]``: the device rank i opens
toward rank j), as ``mlx.distributed_config`` builds it from the same Thunderbolt report.

``--tp-backend auto`` (the default) takes JACCL where the matrix is a full mesh and the ring
elsewhere (every Linux machine, Macs without RDMA, a pair not cabled); ``ring`` always the
ring; ``jaccl`` refuses, in one line naming the pairs without a cable, a group that is not a
mesh (a node whose MLX has no JACCL refuses its Load: ``shards/worker/group.py``). The planner
prices a meshed group's all-reduces at RDMA's figures (``groupplan.RDMA``). Pure Python.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import FrozenSet, List, Sequence, Tuple

logger = logging.getLogger(__name__)

CHOICES = ("auto", "ring", "jaccl")


@dataclass(frozen=True)
class Backend:
    """A group's collective, as its ranks' Loads name it (``pb.TensorGroup``)."""

    name: str                              # "ring" or "jaccl"
    rdma: Tuple[Tuple[str, ...], ...] = ()  # jaccl: rdma[i][j], rank i's device(s) toward rank j, comma-separated


def facing(ports: Sequence[Sequence]) -> List[List[List[str]]]:
    """``out[i][j]``: the RDMA devices of rank i cabled to a port of rank j, from each rank's
    ``pb.RdmaPort``s (``device``, ``port``, ``peer``), in device order."""
    owner = {p.port: j for j, mine in enumerate(ports) for p in mine if p.port}
    out = [[[] for _ in ports] for _ in ports]
    for i, mine in enumerate(ports):
        for p in sorted(mine, key=lambda p: p.device):
            j = owner.get(p.peer) if p.peer else None
            if j is not None and j != i:
                out[i][j].append(p.device)
    return out


def gaps(devices: Sequence[Sequence[Sequence[str]]], names: Sequence[str]) -> List[str]:
    """The ordered pairs of ranks with no device between them, ``a -> b`` by name."""
    n = len(names)
    return [f"{names[i]} -> {names[j]}" for i in range(n) for j in range(n) if i != j and not devices[i][j]]


def matrix(devices: Sequence[Sequence[Sequence[str]]]) -> Tuple[Tuple[str, ...], ...]:
    """JACCL's device matrix of a full mesh: as many devices on every pair as the least-cabled
    pair has (``mlx.distributed_config`` does the same), comma-separated; "" on the diagonal."""
    n = len(devices)
    count = min(len(devices[i][j]) for i in range(n) for j in range(n) if i != j)
    return tuple(tuple("" if i == j else ",".join(devices[i][j][:count]) for j in range(n)) for i in range(n))


def rdma_pairs(ports: Sequence[Sequence]) -> FrozenSet[Tuple[int, int]]:
    """The pairs of nodes (i < j, by index) cabled for RDMA both ways: the planner's fast links."""
    devices = facing(ports)
    n = len(ports)
    return frozenset((i, j) for i in range(n) for j in range(i + 1, n) if devices[i][j] and devices[j][i])


def choose(wanted: str, ports: Sequence[Sequence], names: Sequence[str]) -> Backend:
    """The collective of a group whose ranks (``names``, by rank) reported ``ports``. ValueError,
    one line, when ``wanted`` is "jaccl" and the ranks are not a full RDMA mesh."""
    if wanted not in CHOICES:
        raise ValueError(f"--tp-backend takes {', '.join(CHOICES)}, not {wanted!r}")
    if wanted == "ring":
        return Backend("ring")
    devices = facing(ports)
    missing = gaps(devices, names)
    if not missing:
        logger.info("group %s: JACCL over Thunderbolt RDMA (%s)", "+".join(names),
                    "; ".join(f"{names[i]} {','.join(row[j] for j in range(len(row)) if j != i)}"
                              for i, row in enumerate(matrix(devices))))
        return Backend("jaccl", matrix(devices))
    if wanted == "jaccl":
        bare = [name for name, mine in zip(names, ports) if not mine]
        why = (f"{', '.join(bare)} reported no RDMA devices (JACCL needs a Mac with Thunderbolt 5 RDMA enabled)"
               if bare else f"no Thunderbolt RDMA cable for {', '.join(missing[:4])}"
               + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
        raise ValueError(f"--tp-backend jaccl: the group {'+'.join(names)} is not a full RDMA mesh: {why}; "
                         "cable every pair, or use --tp-backend ring")
    logger.info("group %s: the ring backend (no RDMA mesh: %s)", "+".join(names),
                "no RDMA devices" if not any(ports) else f"{len(missing)} pairs not cabled")
    return Backend("ring")

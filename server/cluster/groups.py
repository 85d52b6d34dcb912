"""The head's view of tensor-parallel groups: which nodes make each stage (``--tp`` for local
stages, ``--nodes a+b,c``, or the planner from the links), and the peers each rank's
collective connects to, learned from the ranks themselves over the authenticated channel
(``Hello``'s ``group_port``, and its RDMA ports: ``tp_backend.py``) and named to every rank in
its ``Load``.

A stage of k ranks is one stage to the rest of the head: its leader (rank 0) is the address
frames go to and results come from; the other ranks are loaded beside it and watched by the
health checks; when any rank fails, the group is rebuilt as a unit (``rebuild.py``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

from mlxpipe.proto import pipeline_pb2 as pb


@dataclass
class Layout:
    """The stages' leaders in pipeline order, and each leader's other ranks."""

    leaders: List[str]
    followers: Dict[str, List[str]] = field(default_factory=dict)

    def ranks(self, leader: str) -> List[str]:
        return [leader, *self.followers.get(leader, [])]

    def every(self) -> List[str]:
        """Every node of the pipeline, stage by stage, leaders first within a stage."""
        return [a for leader in self.leaders for a in self.ranks(leader)]

    def widths(self) -> List[int]:
        return [len(self.ranks(a)) for a in self.leaders]

    def without(self, gone: Sequence[str]) -> "Layout":
        """The layout without the stages any of whose ranks are ``gone`` (a group goes as a unit)."""
        keep = [a for a in self.leaders if not set(self.ranks(a)) & set(gone)]
        return Layout(keep, {a: self.followers[a] for a in keep if a in self.followers})


def from_nodes(nodes: Sequence[str]) -> Layout:
    """``--nodes a+b,c``: stage 0 a group of a (its leader) and b, stage 1 c alone."""
    leaders, followers = [], {}
    for entry in nodes:
        ranks = [r.strip() for r in entry.split("+") if r.strip()]
        leaders.append(ranks[0])
        if len(ranks) > 1:
            followers[ranks[0]] = ranks[1:]
    return Layout(leaders, followers)


def widths_of(stages: int, tp: Sequence[int]) -> List[int]:
    """Ranks per local stage from ``--tp``: one number for every stage, or one per stage."""
    widths = list(tp) or [1]
    if len(widths) == 1:
        widths *= stages
    if len(widths) != stages:
        raise ValueError(f"--tp names {len(widths)} stages' ranks ({','.join(map(str, tp))}), but --stages is "
                         f"{stages}: give one number, or one per stage")
    return widths


def layout_of(addresses: Sequence[str], widths: Sequence[int]) -> Layout:
    """Local stage processes, in order, grouped ``widths[i]`` to stage i."""
    leaders, followers, at = [], {}, 0
    for w in widths:
        leaders.append(addresses[at])
        if w > 1:
            followers[addresses[at]] = list(addresses[at + 1:at + w])
        at += w
    return Layout(leaders, followers)


async def hello(stubs: Sequence, addresses: Sequence[str], metadata,
                timeout: float = 10.0) -> Tuple[List[str], List[pb.HelloReply]]:
    """Where each rank's collective listens (the host the head dials it at, and the port it
    names), and each rank's ``Hello`` (its RDMA ports: ``tp_backend.choose``)."""
    replies = await asyncio.gather(*(s.Hello(pb.HelloRequest(), timeout=timeout, metadata=metadata) for s in stubs))
    out = []
    for address, reply in zip(addresses, replies):
        if not reply.group_port:
            raise ValueError(f"node {address} names no port for a tensor group (an older mlxpipe?)")
        out.append(f"{address.rpartition(':')[0]}:{reply.group_port}")
    return out, list(replies)

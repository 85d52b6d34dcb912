"""A stage's decode groups: the batched caches of the sequences that decode together.

A sequence's caches are its own while it prefills or verifies drafts; when it
decodes in group ``g`` its caches become rows of the group's batched caches
(mlx-lm's ``merge``: ``BatchKVCache``, left-padded so that members of different
lengths share a frame; ``BatchRotatingKVCache``; ``ArraysCache`` rows). Members
the head adds are merged in (``extend``), members it drops are filtered out
(``filter``) or taken back out into caches of their own (``extract``); rows
follow the frame's order. A model whose caches do not batch (a class without
``merge``) keeps every member's own caches and runs its rows one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Protocol

from mlxpipe.shards import caches as kinds


class Member(Protocol):
    caches: Optional[list]  # own caches, while in no group (and always, in a group that does not batch)
    group: Optional[int]


@dataclass
class Group:
    members: List[int] = field(default_factory=list)  # row order
    caches: Optional[list] = None                     # batched, one per cache slot (None: rows run alone)

    def rows_of(self, seqs: Dict[int, Member]) -> List[list]:
        """Each member's caches, for a group whose rows run alone."""
        return [seqs[s].caches for s in self.members]


class Groups:
    def __init__(self, seqs: Dict[int, Member], batched: bool):
        self.seqs = seqs
        self.batched = batched  # whether this stage's caches merge into batched ones
        self.groups: Dict[int, Group] = {}

    def __getitem__(self, gid: int) -> Group:
        return self.groups[gid]

    def values(self):
        return self.groups.values()

    def clear(self) -> None:
        self.groups.clear()

    def caches(self) -> list:
        """Every batched cache (for counting bytes)."""
        return [c for g in self.groups.values() if g.caches for c in g.caches]

    def drop_rows(self, gid: int, sids: List[int]) -> None:
        """Filter sequences out of a group (the group goes when empty)."""
        group = self.groups[gid]
        keep = [i for i, s in enumerate(group.members) if s not in sids]
        if not keep:
            del self.groups[gid]
            return
        for c in group.caches or ():
            c.filter(keep)
        group.members = [group.members[i] for i in keep]

    def detach(self, gid: int, sids: List[int]) -> None:
        """Take sequences out of a group, back into caches of their own."""
        group = self.groups[gid]
        for sid in sids:
            if group.caches is not None:
                row = group.members.index(sid)
                self.seqs[sid].caches = [c.extract(row) for c in group.caches]
            self.seqs[sid].group = None
        self.drop_rows(gid, sids)

    def regroup(self, gid: int, members: List[int]) -> Group:
        """Make group ``gid`` hold exactly ``members``, caches in that row order."""
        group = self.groups.get(gid)
        if group is not None and group.members == members:
            return group
        wanted = set(members)
        for sid in members:  # members that moved here from another group leave it first
            seq = self.seqs[sid]
            if seq.group is not None and seq.group != gid:
                self.detach(seq.group, [sid])
        if group is not None:
            leaving = [s for s in group.members if s not in wanted]
            if leaving:
                self.detach(gid, leaving)
            group = self.groups.get(gid)
        joining = [s for s in members if self.seqs[s].group != gid]
        if joining:
            group = self._join(gid, group, joining)
        if group.members != members:
            order = [group.members.index(s) for s in members]
            for c in group.caches or ():
                c.filter(order)
            group.members = list(members)
        return group

    def _join(self, gid: int, group: Optional[Group], joining: List[int]) -> Group:
        merged = None
        if self.batched:
            per_slot = list(zip(*(self.seqs[s].caches for s in joining)))
            merged = [type(cs[0]).merge(list(cs)) for cs in per_slot]
        if group is None:
            group = self.groups[gid] = Group(members=list(joining), caches=merged)
        else:
            for c, m in zip(group.caches or (), merged or ()):
                c.extend(m)
            group.members += joining
        for s in joining:
            if self.batched:
                self.seqs[s].caches = None
            self.seqs[s].group = gid
        return group


def batches(caches: list) -> bool:
    """Whether a stage whose sequences have caches like ``caches`` can batch them."""
    return all(kinds.batchable(c) for c in caches)

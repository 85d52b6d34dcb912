"""A stage's decode groups: the batched caches of the sequences that decode together.

A sequence's caches are its own while it prefills or verifies drafts; when it
decodes in group ``g`` its caches become rows of the group's batched caches
(mlx-lm's ``merge``: ``BatchKVCache``, left-padded so that members of different
lengths share a frame; ``BatchRotatingKVCache``; ``ArraysCache`` rows). Members
the head adds are merged in (``extend``), members it drops are filtered out
(``filter``) or taken back out into caches of their own (``extract``); rows
follow the frame's order. A model whose caches do not batch (a class without
``merge``) keeps every member's own caches and runs its rows one at a time.

With a quantized KV cache (``quantized_cache.py``), members whose caches turned
quantized and members whose caches did not yet cannot share a batched cache:
a frame's group is then two parts (``regroup_parts``), each a ``Group`` of its
own under ``(group, quantized)``, run one after the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, List, Optional, Protocol, Tuple

import mlx.core as mx

from mlxpipe.shards.cache import kinds
from mlxpipe.shards.cache.quantized import merge


class Member(Protocol):
    caches: Optional[list]  # own caches, while in no group (and always, in a group that does not batch)
    group: Optional[Hashable]  # the key of its group (or part of one)


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
        self.groups: Dict[Hashable, Group] = {}

    def __getitem__(self, gid: Hashable) -> Group:
        return self.groups[gid]

    def values(self):
        return self.groups.values()

    def clear(self) -> None:
        self.groups.clear()

    def caches(self) -> list:
        """Every batched cache (for counting bytes)."""
        return [c for g in self.groups.values() if g.caches for c in g.caches]

    def drop_rows(self, gid: Hashable, sids: List[int]) -> None:
        """Filter sequences out of a group (the group goes when empty)."""
        group = self.groups[gid]
        keep = [i for i, s in enumerate(group.members) if s not in sids]
        if not keep:
            del self.groups[gid]
            return
        for c in group.caches or ():
            c.filter(keep)
        group.members = [group.members[i] for i in keep]

    def detach(self, gid: Hashable, sids: List[int]) -> None:
        """Take sequences out of a group, back into caches of their own."""
        group = self.groups[gid]
        for sid in sids:
            if group.caches is not None:
                row = group.members.index(sid)
                self.seqs[sid].caches = [c.extract(row) for c in group.caches]
            self.seqs[sid].group = None
        self.drop_rows(gid, sids)

    def regroup(self, gid: Hashable, members: List[int]) -> Group:
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

    def regroup_parts(self, gid: int, members: List[int], form: Callable[[int], bool]) -> List[Tuple[Group, List[int]]]:
        """Make group ``gid`` hold exactly ``members`` in parts of one ``form`` each (whether a
        member's caches are quantized): (part, the rows of the frame it holds), in order."""
        parts = []
        for f in (False, True):
            rows = [i for i, s in enumerate(members) if form(s) == f]
            if rows:
                parts.append((self.regroup((gid, f), [members[i] for i in rows]), rows))
            elif (gid, f) in self.groups:  # its members left the frame: caches of their own again
                self.detach((gid, f), list(self.groups[(gid, f)].members))
        return parts

    def step(self, model, parts: List[Tuple[Group, List[int]]], tokens, hidden: Optional[mx.array],
             lengths: List[int], positions: Optional[mx.array] = None) -> mx.array:
        """One decode step of a group held in ``parts`` (``regroup_parts``) through ``model``
        (a ``SlicedModel``): each part's rows together, the outputs in the frame's row order.
        ``positions`` ``[axes, rows, 1]``: the rows' rotary positions where they are not their
        offsets (a vision model's, ``shards/worker/images.py``)."""
        if len(parts) == 1:
            return self._step(model, parts[0][0], tokens, hidden, lengths, positions)
        outs, order = [], []
        for group, rows in parts:
            part_hidden = None if hidden is None else hidden[mx.array(rows)]
            part_positions = None if positions is None else positions[:, mx.array(rows)]
            outs.append(self._step(model, group, [tokens[i] for i in rows], part_hidden, [lengths[i] for i in rows],
                                   part_positions))
            order += rows
        back = sorted(range(len(order)), key=order.__getitem__)  # frame row i is output row back[i]
        return mx.concatenate(outs, axis=0)[mx.array(back)]

    def _step(self, model, group: Group, tokens, hidden: Optional[mx.array], lengths: List[int],
              positions: Optional[mx.array] = None) -> mx.array:
        """One decode step of one group: its rows together, or one at a time when the
        stage's caches do not batch."""
        ids = mx.array(list(tokens), dtype=mx.int32)[:, None]
        if group.caches is not None:
            return model(ids, hidden, group.caches, lengths, positions=positions)
        rows = [model(ids[i : i + 1], None if hidden is None else hidden[i : i + 1], caches, [lengths[i]],
                      positions=None if positions is None else positions[:, i : i + 1])
                for i, caches in enumerate(group.rows_of(self.seqs))]
        return mx.concatenate(rows, axis=0)

    def _join(self, gid, group: Optional[Group], joining: List[int]) -> Group:
        merged = None
        if self.batched:
            per_slot = list(zip(*(self.seqs[s].caches for s in joining)))
            merged = [merge(cs) for cs in per_slot]
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

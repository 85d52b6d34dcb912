"""The head's prefix index: which cached KV blocks each stage holds. Pure logic.

Chat UIs and agents resend the same long prefix every turn. Every stage keeps
the KV of computed prefixes in blocks of ``block_tokens`` positions
(``shards/cache/prefix.py``), keyed by a chained hash of token ids: block k's key
covers tokens ``[0, (k + 1) * block_tokens)``, so equal keys mean equal
prefixes. This index is the one truth about which stage holds which block:
the scheduler asks it where a sequence may start (``match``: blocks that
*every* stage holds, since activations for the positions after them must flow
through every stage), records what it told stages to keep (``add``) and picks
what to drop (least recently used first). The chain starts from a salt
(``chain_root``): that of the model the stages loaded (``model_salt``: the digests of
what they compute with), then the sequence's own, so sequences of different tenants
(API keys) or ``cache_salt``s have different keys for the same tokens and never reuse
each other's blocks, and no block computed under other weights is ever a hit. Stages follow the head's word, so
they never disagree; after a fault each stage reports what it still holds
(``reset``), which may differ from stage to stage.

A stage with state caches (rotating windows, state-space layers) can start a
sequence after a block only where it holds the state at the block's end, which
it keeps only where the scheduler asked (``SeqEntry.snap``: its ``starts``).
``match`` ends a reuse at such a block; ``snapshot_every`` says how sparse the
snapshots are, so that they cost about what the blocks' keys and values do.

Two tiers. Where every stage has a disk tier (``disk_capacity`` > 0), every block a
stage keeps is written to its disk too, and one evicted from memory (``evict``) stays
there until the disk's own least recently used order drops it (``discard``, which the
frames carry). The index knows both, per stage (``held``: memory, ``disk``): ``match``
counts a block that every stage holds in either tier, ``fetches`` says which blocks
each stage must read back from its disk first, and ``fetched`` takes what a stage
could not read (a missing or corrupt file: its positions are computed again). After a
restart each stage reports what its disk holds (``reset``), and a block counts only
where every stage has it.

A block costs its positions, or what it is said to cost (``add``'s ``weights``:
a block kept at full precision where KV caches are quantized costs more).
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

_ROOT = 0
MAX_SNAPSHOT_EVERY = 16  # blocks between state snapshots, at most (a reuse may start this far back)


def snapshot_every(block_tokens: int, stages: Sequence[Tuple[int, int]]) -> int:
    """Blocks between state snapshots for stages of (KV bytes per token, bytes of one
    state snapshot): 0 when no stage has state caches; else about as many blocks as
    one snapshot costs in keys and values, within 1 .. MAX_SNAPSHOT_EVERY."""
    ratios = [state / max(block_tokens * kv, 1) for kv, state in stages if state]
    if not ratios:
        return 0
    return int(min(max(1, math.ceil(max(ratios))), MAX_SNAPSHOT_EVERY))


def block_cost(block_tokens: int, kv_bytes_per_token: int, state_bytes: int, every: int) -> int:
    """Bytes a cached block costs a stage, its share of the snapshots included."""
    return block_tokens * kv_bytes_per_token + (state_bytes // every if every else 0)


def model_salt(stages: Iterable[Mapping[str, str]]) -> bytes:
    """What every chain starts from besides a sequence's own salt: the units every stage
    computes with and their digests (``LoadReply.unit_digests``: each layer's tensors as
    loaded, the embedding, the head, the config), whichever stage holds which layers.
    Another model, a changed tensor anywhere, another quantization or config: another salt,
    so no block of one is ever a hit for the other. Empty when no stage says."""
    pairs = sorted({(unit, digest) for units in stages for unit, digest in units.items()})
    if not pairs:
        return b""
    return hashlib.sha256("".join(f"{u}={d}\n" for u, d in pairs).encode()).digest()


def chain_root(salt: bytes) -> int:
    """The key the chain of a sequence's blocks starts from: its salt's (the tenant's and
    the request's ``cache_salt``), so that no two salts share a block's key."""
    return int.from_bytes(hashlib.blake2b(salt, digest_size=8).digest(), "little") if salt else _ROOT


def chain_hashes(tokens: Sequence[int], block_tokens: int, hashes: List[int], upto: int,
                 salt: bytes = b"", tag: Optional[Tuple[int, int]] = None,
                 marks: Optional[Dict[int, bytes]] = None) -> List[int]:
    """Extend ``hashes`` (the keys of a sequence's first blocks) to ``upto`` blocks of
    ``tokens``; ``salt``: the chain's (``chain_root``); ``tag`` (block, value): ``value``
    goes into the key of that block, and so of every later one; ``marks``: block -> bytes
    that go into its key too (the content of the images whose placeholders it holds)."""
    while len(hashes) < upto:
        k = len(hashes)
        prev = hashes[-1] if hashes else chain_root(salt)
        data = array("i", tokens[k * block_tokens : (k + 1) * block_tokens]).tobytes()
        if tag is not None and k == tag[0]:
            data += tag[1].to_bytes(8, "little")
        if marks and k in marks:
            data += marks[k]
        digest = hashlib.blake2b(prev.to_bytes(8, "little") + data, digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "little"))
    return hashes


class PrefixIndex:
    def __init__(self, block_tokens: int, capacity: int, num_stages: int):
        self.block_tokens = block_tokens
        self.capacity = capacity  # blocks any stage may hold in memory
        self.held: List[Set[int]] = [set() for _ in range(num_stages)]
        self.lru: "OrderedDict[int, None]" = OrderedDict()  # every block some stage holds, oldest first
        self.weights: Dict[int, int] = {}  # positions a block costs, where not its own
        self.used = 0                      # positions the blocks cost
        # Per stage with state caches: the blocks (in either tier) it can start a sequence after (None: stateless).
        self.starts: List[Optional[Set[int]]] = [None] * num_stages
        self.disk_capacity = 0  # blocks any stage may hold on disk (0: no disk tier)
        self.disk: List[Set[int]] = [set() for _ in range(num_stages)]
        self.disk_lru: "OrderedDict[int, None]" = OrderedDict()  # every block some stage holds on disk, oldest first

    def reset(self, held: Sequence[Iterable[int]], capacity: int,
              starts: Optional[Sequence[Optional[Iterable[int]]]] = None,
              disk: Optional[Sequence[Sequence[int]]] = None, disk_capacity: int = 0) -> List[int]:
        """What each stage of a (re)built pipeline holds in memory and on ``disk`` (least
        recently used first), and, for a stage with state caches, which of those it can
        start after. Returns the blocks to evict from memory to fit ``capacity`` (oldest
        first, in the stages' own order); ``discard`` trims the disk."""
        self.held = [set(h) for h in held]
        self.starts = [None if s is None else set(s) for s in (starts or [None] * len(self.held))]
        self.capacity = capacity
        self.lru = OrderedDict((k, None) for h in held for k in h)
        self.disk_capacity = disk_capacity if disk is not None else 0
        disk = disk if self.disk_capacity else [[] for _ in self.held]
        self.disk = [set(d) for d in disk]
        everywhere = set.intersection(*self.disk) if self.disk else set()
        order = [k for d in disk for k in d]  # blocks some stage lacks go first: no sequence can use them
        self.disk_lru = OrderedDict((k, None) for k in sorted(order, key=lambda k: k in everywhere))
        self.weights = {k: w for k, w in self.weights.items() if k in self.lru}
        self.used = sum(self._cost(k) for k in self.lru)
        return self.evict_tokens(self.used - capacity * self.block_tokens)

    @property
    def blocks(self) -> int:
        return len(self.lru)

    @property
    def tokens(self) -> int:
        """KV positions the cached blocks take on the fullest stage (at most)."""
        return self.used

    def _cost(self, key: int) -> int:
        return self.weights.get(key, self.block_tokens)

    @property
    def disk_blocks(self) -> int:
        return len(self.disk_lru)

    def match(self, hashes: Sequence[int]) -> int:
        """How many of a sequence's first blocks every stage holds (in memory or on disk),
        ending at one every stage can start after."""
        n = 0
        for key in hashes:
            if not all(key in h or key in d for h, d in zip(self.held, self.disk)):
                break
            n += 1
        while n and not all(s is None or hashes[n - 1] in s for s in self.starts):
            n -= 1
        return n

    def fetches(self, keys: Sequence[int]) -> List[List[int]]:
        """Per stage, the blocks of ``keys`` (which ``match`` found) it holds on disk only."""
        return [[k for k in keys if k not in h] for h in self.held]

    def fetched(self, stage: int, dropped: Iterable[int]) -> None:
        """Stage ``stage`` could not read these blocks back: they are not on its disk."""
        for key in dropped:
            self._off_disk(stage, key)
            if not any(key in d for d in self.disk):
                self.disk_lru.pop(key, None)

    def _off_disk(self, stage: int, key: int) -> None:
        self.disk[stage].discard(key)
        s = self.starts[stage]
        if s is not None and key not in self.held[stage]:
            s.discard(key)

    def touch(self, keys: Iterable[int]) -> None:
        for key in keys:
            if key in self.lru:
                self.lru.move_to_end(key)
            if key in self.disk_lru:
                self.disk_lru.move_to_end(key)

    def add(self, keys: Sequence[int], protected: Set[int], evicted: List[int], room: int,
            start: Optional[int] = None, weights: Optional[Sequence[int]] = None,
            discarded: Optional[List[int]] = None) -> int:
        """Record that every stage keeps ``keys`` (in order; ``weights``: the positions each
        costs, if not its own), within ``capacity`` and ``room`` blocks' positions, making
        room by evicting least recently used blocks not in ``protected`` (appended to
        ``evicted``); with ``start``, that every stage keeps the state at the end of that
        key too. With a disk tier, the stages write them there as well, and blocks the disk
        then has no room for go from it (appended to ``discarded``). Returns how many of
        ``keys`` fit: the stages must be told to keep only those."""
        protected = protected | set(keys)
        limit = min(self.capacity, room) * self.block_tokens
        kept = 0
        for n, key in enumerate(keys):
            cost = weights[n] if weights else self.block_tokens
            if key not in self.lru:
                if self.used + cost > limit:
                    evicted.extend(self.evict_tokens(self.used + cost - limit, protected))
                    if self.used + cost > limit:
                        break
                self.used += cost
                if cost != self.block_tokens:
                    self.weights[key] = cost
            self.lru[key] = None
            self.lru.move_to_end(key)
            for h in self.held:
                h.add(key)
            if key == start:
                for s in self.starts:
                    if s is not None:
                        s.add(key)
            kept += 1
        self.spill(keys[:kept], protected, [] if discarded is None else discarded, start)  # (written through)
        return kept

    def spill(self, keys: Sequence[int], protected: Set[int], discarded: List[int],
              start: Optional[int] = None) -> List[int]:
        """Record that every stage writes ``keys`` to its disk (in order; those memory has
        no room for, or those it keeps: they are written through), within
        ``disk_capacity``, discarding least recently used blocks not in ``protected``
        (appended to ``discarded``); ``start``: as for ``add``. Returns those of ``keys``
        that fit (none without a disk tier)."""
        if not self.disk_capacity:
            return []
        protected = protected | set(keys)
        for n, key in enumerate(keys):
            if key not in self.disk_lru and len(self.disk_lru) >= self.disk_capacity:
                gone = self.discard(len(self.disk_lru) - self.disk_capacity + 1, protected)
                if not gone:
                    return list(keys[:n])
                discarded.extend(gone)
            self.disk_lru[key] = None
            self.disk_lru.move_to_end(key)
            for d, s in zip(self.disk, self.starts):
                d.add(key)
                if s is not None and key == start:
                    s.add(key)
        return list(keys)

    def evict(self, count: int, protected: Set[int] = frozenset()) -> List[int]:
        """Drop up to ``count`` least recently used blocks not in ``protected``."""
        return self._drop([k for k in self.lru if k not in protected][: max(count, 0)])

    def evict_tokens(self, tokens: int, protected: Set[int] = frozenset()) -> List[int]:
        """Drop least recently used blocks not in ``protected`` until they freed ``tokens`` positions."""
        gone, freed = [], 0
        for key in self.lru:
            if freed >= tokens:
                break
            if key not in protected:
                gone.append(key)
                freed += self._cost(key)
        return self._drop(gone)

    def _drop(self, gone: List[int]) -> List[int]:
        for key in gone:
            self.used -= self._cost(key)
            self.weights.pop(key, None)
            del self.lru[key]
            for h, d, s in zip(self.held, self.disk, self.starts):
                h.discard(key)
                if s is not None and key not in d:  # on disk, the state is still there to start after
                    s.discard(key)
        return gone

    def discard(self, count: int, protected: Set[int] = frozenset()) -> List[int]:
        """Drop up to ``count`` least recently used blocks not in ``protected`` from every
        stage's disk (those held in memory stay there)."""
        gone = [k for k in self.disk_lru if k not in protected][: max(count, 0)]
        for key in gone:
            del self.disk_lru[key]
            for i in range(len(self.disk)):
                self._off_disk(i, key)
        return gone

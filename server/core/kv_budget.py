"""The KV-cache positions of every stage, and the prefix cache inside them. Pure logic.

Admitted sequences reserve what they may grow to (prompt plus token budget);
cached prefix blocks (``PrefixIndex``) live in what is left and give way to
live sequences: admission evicts least recently used blocks before it would
make a request wait. Blocks a round's steps reuse or store are never evicted
in that round.

Where stages have state caches (rotating windows, state-space layers:
``snapshot_every`` > 0), a sequence can start only after a block whose end
state they keep: a step that starts exactly at a block's end asks for it
(``snap``) every ``snapshot_every`` blocks and at the last block of a prompt.

With KV quantization (``set_kv``), positions are counted at what a quantized
one costs: a sequence's positions before its switch point (``Seq.kv_at``,
``shards/params/kv.py``), held at full precision until then, count ``kv_ratio``
times, and so do the blocks kept from them (stages keep a block in the form
its sequence's caches had). A block that ends past its sequence's switch point
is keyed with that point too: what it holds was computed against quantized
keys from there on, so only a sequence that switches at the same point reuses
it (blocks before both points hold full-precision keys that any may reuse).

Where stages have a disk tier, a sequence may start after blocks some stage holds
on disk only. Admitting it then names, per stage, the blocks to read back
(``take_fetches``: the engine sends each stage a ``Fetch``, answered off its MLX
thread); its first step waits for every answer (``fetched``), which may shorten the
reuse to the blocks every stage could read (a missing or corrupt file: those
positions are computed again). That step keeps the blocks it read in memory
(``promote``, its ``store``), and nothing is evicted or discarded that a fetch
under way needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

from mlxpipe.server.core.prefix_index import PrefixIndex, chain_hashes
from mlxpipe.server.core.sequence import Seq
from mlxpipe.shards.params.kv import quantize_at


@dataclass
class Fetch:
    """Blocks a sequence must have read back from stages' disks before its first step."""

    seq_id: int
    keys: List[List[int]]  # per stage (empty: that stage holds them all in memory)
    epoch: int             # the pipeline it was asked of (a rebuild makes it stale)


class KvBudget:
    def __init__(self, max_tokens: int, block_tokens: int, prefix_blocks: int):
        self.max_tokens = max_tokens      # changes when the pipeline is rebuilt (``resize``)
        self.block_tokens = block_tokens
        self.prefix: Optional[PrefixIndex] = (PrefixIndex(block_tokens, prefix_blocks, 0)
                                              if prefix_blocks else None)
        self.pending_evict: List[int] = []  # blocks the next step tells the stages to drop
        self._keep: Set[int] = set()        # blocks this round's steps reuse or store: not evicted now
        self._fresh: Set[int] = set()       # blocks this round's steps store (stages keep them once those land)
        self._room = 0                      # blocks the budget leaves for the cache this round
        self.snapshot_every = 0  # blocks between state snapshots the stages keep (0: no stage has state caches)
        self.pending_discard: List[int] = []  # blocks the next step tells the stages to drop from disk too
        self.waiting: Dict[int, List[int]] = {}  # admitted sequence -> the blocks its first step (not sent yet)
                                                 # starts after: not to evict nor discard until then
        self.fetches: List[Fetch] = []  # reads the engine has yet to ask for
        self.epoch = 0
        self.kv_start: Optional[int] = None  # stages quantize their KV caches from mlx-lm's start (None: not)
        self.kv_ratio = 1.0  # what a full-precision position costs in quantized ones, where most
        self.model_salt = b""  # every key's chain starts from it: the stages' weights (prefix_index.model_salt)

    def set_kv(self, start: Optional[int], ratio: float) -> None:
        """Stages quantize their KV caches (``start``: mlx-lm's quantized_kv_start; None: not),
        a full-precision position costing ``ratio`` quantized ones where it costs most."""
        self.kv_start, self.kv_ratio = start, max(ratio, 1.0) if start is not None else 1.0

    def set_model(self, salt: bytes, seqs: Iterable[Seq]) -> None:
        """The stages' weights as the salt of every prefix-cache key (``prefix_index.model_salt``):
        where it changes (a rebuilt pipeline computes with other weights), the keys of ``seqs``
        (every live sequence) are made again from it."""
        if salt != self.model_salt:
            self.model_salt = salt
            for seq in seqs:
                seq.hashes.clear()

    def place(self, seq: Seq) -> None:
        """Where ``seq``'s caches turn quantized: where mlx-lm's would for its prompt."""
        if self.kv_start is not None and seq.kv_at is None:
            seq.kv_at = quantize_at(len(seq.prompt), self.kv_start)

    def need(self, seq: Seq) -> int:
        """KV positions ``seq`` may take (prompt plus token budget), counted at quantized
        positions: those it holds at full precision, before its switch point, cost more."""
        self.place(seq)
        n = seq.reserve
        if seq.kv_at is None:
            return n
        return max(n, math.ceil(min(n, seq.kv_at) * self.kv_ratio))

    def longest(self) -> int:
        """Tokens one sequence may hold in ``max_tokens``: all of them, unless positions held at
        full precision up to the latest switch point a prompt may have (``quantize_at``) cost more."""
        if self.kv_start is None:
            return self.max_tokens
        latest = quantize_at(1 << 40, self.kv_start)
        if math.ceil(latest * self.kv_ratio) <= self.max_tokens:
            return self.max_tokens
        return int(self.max_tokens / self.kv_ratio)

    def _hashes(self, seq: Seq, upto: int) -> List[int]:
        """The keys of ``seq``'s first ``upto`` blocks: from the first that ends past its switch
        point on, with that point in them (they hold what quantized keys gave from there)."""
        tag = None if seq.kv_at is None else (seq.kv_at // self.block_tokens, seq.kv_at)
        marks = seq.media.marks(self.block_tokens) if seq.media is not None else None  # its images' content
        return chain_hashes(seq.tokens, self.block_tokens, seq.hashes, upto, self.model_salt + seq.salt, tag, marks)

    def resize(self, max_tokens: int) -> None:
        """A rebuilt pipeline holds a different number of KV positions."""
        self.max_tokens = max_tokens

    def reset_prefix(self, held: List[Iterable[int]], capacity: int,
                     starts: Optional[Sequence[Optional[Iterable[int]]]] = None, snapshot_every: int = 0,
                     disk: Optional[Sequence[Sequence[int]]] = None, disk_capacity: int = 0) -> None:
        """What each stage of a (re)built pipeline holds, and the blocks it may hold;
        ``starts``: per stage with state caches, the held blocks it can start after
        (None for a stage without); ``snapshot_every``: see the module docstring;
        ``disk``: per stage, what its disk tier holds, and ``disk_capacity`` the blocks
        each may hold there (0: no disk tier)."""
        self.snapshot_every = snapshot_every
        self.forget_fetches()
        if self.prefix is not None:
            self.pending_evict = self.prefix.reset(held, capacity, starts, disk, disk_capacity)
            self.pending_discard = self.prefix.discard(self.prefix.disk_blocks - self.prefix.disk_capacity)

    @property
    def cached_tokens(self) -> int:
        return self.prefix.tokens if self.prefix is not None else 0

    def new_round(self) -> None:
        self._keep.clear()
        self._fresh.clear()

    def set_room(self, reserved: int) -> None:
        """Blocks that fit beside what live sequences (``reserved`` positions) may grow to."""
        if self.prefix is not None:
            self._room = (self.max_tokens - reserved) // self.block_tokens

    def take_evictions(self) -> Tuple[List[int], List[int]]:
        """The blocks the next step drops from memory, and those it drops from disk too."""
        out, self.pending_evict = self.pending_evict, []
        gone, self.pending_discard = self.pending_discard, []
        return out, gone

    def _protected(self) -> Set[int]:
        """Blocks not to evict nor discard now: this round's, and those admitted sequences start after."""
        return self._keep.union(*self.waiting.values())

    def cached_prefix(self, seq: Seq) -> List[int]:
        """The keys of the cached blocks ``seq`` may start after: all its first blocks
        that every stage holds, leaving at least its last token to compute. None for a
        sequence that scores its prompt (a cached position's log-probability is not known)
        or pools it (the last stage must see every position)."""
        if self.prefix is None or seq.sampling.prompt_logprobs or seq.pool:
            return []
        usable = (len(seq.feed) - 1) // self.block_tokens
        self._hashes(seq, usable)
        return seq.hashes[: self.prefix.match(seq.hashes[:usable])]

    def relook(self, seq: Seq, settled: bool = False) -> None:
        """Before ``seq``'s first step: start it after more blocks where every stage holds more of
        its first ones in memory now than at its admission (a like prompt admitted with it stored
        them since: a wave of requests with one prefix computes it once, not once each).
        ``settled``: not after blocks this round's steps store (its step may reach the stages
        first: interactive steps go ahead, ``priority.py``)."""
        if self.prefix is None or seq.fetching or seq.known:
            return
        hit, n = self.cached_prefix(seq), len(seq.reuse)
        if hit[:n] != seq.reuse or not all(k in h for k in seq.reuse for h in self.prefix.held):
            return  # (blocks read back from disk: its first step keeps those, ``promote``)
        while n < len(hit) and all(hit[n] in h for h in self.prefix.held) and not (settled and hit[n] in self._fresh):
            n += 1
        while n > len(seq.reuse) and not all(s is None or hit[n - 1] in s for s in self.prefix.starts):
            n -= 1  # (stages with state caches start only after a block whose state they keep)
        if n == len(seq.reuse):
            return
        if seq.cached_tokens == seq.sent:  # (what its usage reports: what this admission reuses)
            seq.cached_tokens = n * self.block_tokens
        seq.reuse, seq.stored, seq.sent = hit[:n], n, n * self.block_tokens
        self.prefix.touch(seq.reuse)
        self._keep.update(seq.reuse)
        self.waiting[seq.seq_id] = list(seq.reuse)

    def admits(self, need: int, reserved: int, hit: List[int]) -> bool:
        """Whether ``need`` more positions fit beside ``reserved`` and the cache, after
        evicting cached blocks (never ``hit``, the ones it would reuse) to make room."""
        if self.prefix is not None:  # live sequences win: drop cached blocks before refusing
            over = reserved + need + self.prefix.tokens - self.max_tokens
            if over > 0:
                self.pending_evict += self.prefix.evict_tokens(over, self._protected() | set(hit))
        return reserved + need + self.cached_tokens <= self.max_tokens

    def reusing(self, seq: Seq, hit: List[int]) -> bool:
        """A sequence was admitted to start after ``hit``; whether it must wait for
        blocks to be read back from disk first (``take_fetches``, ``fetched``)."""
        if self.prefix is None:
            return False
        self.prefix.touch(hit)
        self._keep.update(hit)
        if hit:
            self.waiting[seq.seq_id] = list(hit)
        keys = self.prefix.fetches(hit)
        if not any(keys):
            return False
        self.fetches.append(Fetch(seq.seq_id, keys, self.epoch))
        return True

    def forget_fetches(self) -> None:
        """The pipeline lost its state: fetches under way are void."""
        self.waiting.clear()
        self.fetches.clear()
        self.epoch += 1

    def take_fetches(self) -> List[Fetch]:
        out, self.fetches = self.fetches, []
        return out

    def fetched(self, fetch: Fetch, results: Sequence[Tuple[Sequence[int], Sequence[int]]],
                seq: Optional[Seq]) -> bool:
        """Each stage's answer to ``fetch`` (the keys it read back, those it could not).
        ``seq`` (if it still waits for it) starts after the blocks every stage holds in
        memory or read back; the rest is computed again. Returns False when nobody waits
        for it any more (the stages should drop what they read)."""
        hit = self.waiting.pop(fetch.seq_id, []) if fetch.epoch == self.epoch else []
        if fetch.epoch == self.epoch:
            for stage, (_, dropped) in enumerate(results):
                self.prefix.fetched(stage, dropped)
        if seq is None:
            return False
        if not seq.fetching or fetch.epoch != self.epoch:  # a fetch from before a rebuild: void
            return True
        ready = [set(loaded) | held for (loaded, _), held in zip(results, self.prefix.held)]
        n = 0
        while n < len(hit) and all(hit[n] in r for r in ready):
            n += 1
        while n and not all(s is None or hit[n - 1] in s for s in self.prefix.starts):
            n -= 1
        self.waiting[fetch.seq_id] = hit[:n]  # still not to evict: until its first step names them
        seq.fetching = False
        seq.reuse, seq.stored, seq.sent = hit[:n], n, n * self.block_tokens
        if seq.disk_tokens is None:  # its first admission: what its usage reports
            disk = sum(1 for k in hit[:n] if not all(k in h for h in self.prefix.held))
            seq.cached_tokens, seq.disk_tokens = seq.sent, disk * self.block_tokens
        return True

    def release(self, seq_id: int) -> bool:
        """A sequence ended: what it was to start after may go. Whether its first step was
        still to come (stages may hold blocks read back for it: free it there)."""
        return self.waiting.pop(seq_id, None) is not None

    def promote(self, seq: Seq) -> Tuple[int, List[int]]:
        """The blocks a sequence's first step starts after that some stage read back
        from disk, to keep in memory now (as its ``store``): (index of the first, keys)."""
        self.waiting.pop(seq.seq_id, None)
        if self.prefix is None or not seq.reuse:
            return 0, []
        self._keep.update(seq.reuse)  # (this round's evictions are yet to be taken)
        first = 0
        while first < len(seq.reuse) and all(seq.reuse[first] in h for h in self.prefix.held):
            first += 1
        keys = seq.reuse[first:]
        kept = self.prefix.add(keys, self._protected(), self.pending_evict, self._room,
                               weights=self._weights(seq, first, len(seq.reuse)), discarded=self.pending_discard)
        self._keep.update(keys[:kept])
        self._fresh.update(keys[:kept])
        return (first if kept else 0), keys[:kept]

    def store(self, seq: Seq, offset: int) -> Tuple[int, List[int], bool, List[int]]:
        """The blocks ``seq`` completed before a step at ``offset`` that the stages are
        to keep: (index of the first, their keys, whether stages with state caches keep
        the state at the last one's end too, the keys after those that memory has no
        room for, to write to disk only); none once they were asked for."""
        if self.prefix is None:
            return 0, [], False, []
        # Only confirmed positions: a verify step's offset may lie past drafted ones.
        upto = min(offset, len(seq.prompt) + len(seq.generated) - 1) // self.block_tokens
        if upto <= seq.stored:
            return 0, [], False, []
        first = seq.stored
        keys = self._hashes(seq, upto)[first:upto]
        snap = self._snaps(seq, offset, upto)
        kept = self.prefix.add(keys, self._protected(), self.pending_evict, self._room,
                               start=keys[-1] if snap else None, weights=self._weights(seq, first, upto),
                               discarded=self.pending_discard)
        self._keep.update(keys[:kept])
        self._fresh.update(keys[:kept])
        seq.stored = upto  # blocks that did not fit are not asked again
        spill = self.prefix.spill(keys[kept:], self._protected(), self.pending_discard, keys[-1] if snap else None)
        self._keep.update(spill)
        if not kept and not spill:
            return 0, [], False, []
        return first, keys[:kept], snap and kept + len(spill) == len(keys), spill

    def _weights(self, seq: Seq, first: int, upto: int) -> Optional[List[int]]:
        """What blocks ``first .. upto - 1`` of ``seq`` cost in quantized positions: those
        before its switch point are kept at full precision (None: all cost their positions)."""
        if seq.kv_at is None or self.kv_ratio <= 1.0:
            return None
        b, full = self.block_tokens, math.ceil(self.block_tokens * self.kv_ratio)
        return [full if (k + 1) * b <= seq.kv_at else b for k in range(first, upto)]

    def _snaps(self, seq: Seq, offset: int, upto: int) -> bool:
        """Whether stages with state caches keep the state at the end of block ``upto``
        - 1 (they are exactly there: it ends at the step's offset)."""
        every = self.snapshot_every
        if not every or upto * self.block_tokens != offset:
            return False
        return upto % every == 0 or upto == (len(seq.feed) - 1) // self.block_tokens

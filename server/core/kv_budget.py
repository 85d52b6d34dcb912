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
``shards/kv_quant.py``), held at full precision until then, count ``kv_ratio``
times, and so do the blocks kept from them (stages keep a block in the form
its sequence's caches had). A block that ends past its sequence's switch point
is keyed with that point too: what it holds was computed against quantized
keys from there on, so only a sequence that switches at the same point reuses
it (blocks before both points hold full-precision keys that any may reuse).
"""

from __future__ import annotations

import math
from typing import Iterable, List, Optional, Sequence, Set, Tuple

from mlxpipe.server.core.prefix_index import PrefixIndex, chain_hashes
from mlxpipe.server.core.sequence import Seq
from mlxpipe.shards.kv_quant import quantize_at


class KvBudget:
    def __init__(self, max_tokens: int, block_tokens: int, prefix_blocks: int):
        self.max_tokens = max_tokens      # changes when the pipeline is rebuilt (``resize``)
        self.block_tokens = block_tokens
        self.prefix: Optional[PrefixIndex] = (PrefixIndex(block_tokens, prefix_blocks, 0)
                                              if prefix_blocks else None)
        self.pending_evict: List[int] = []  # blocks the next step tells the stages to drop
        self._keep: Set[int] = set()        # blocks this round's steps reuse or store: not evicted now
        self._room = 0                      # blocks the budget leaves for the cache this round
        self.snapshot_every = 0  # blocks between state snapshots the stages keep (0: no stage has state caches)
        self.kv_start: Optional[int] = None  # stages quantize their KV caches from mlx-lm's start (None: not)
        self.kv_ratio = 1.0  # what a full-precision position costs in quantized ones, where most

    def set_kv(self, start: Optional[int], ratio: float) -> None:
        """Stages quantize their KV caches (``start``: mlx-lm's quantized_kv_start; None: not),
        a full-precision position costing ``ratio`` quantized ones where it costs most."""
        self.kv_start, self.kv_ratio = start, max(ratio, 1.0) if start is not None else 1.0

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
        return chain_hashes(seq.tokens, self.block_tokens, seq.hashes, upto, seq.salt, tag)

    def resize(self, max_tokens: int) -> None:
        """A rebuilt pipeline holds a different number of KV positions."""
        self.max_tokens = max_tokens

    def reset_prefix(self, held: List[Iterable[int]], capacity: int,
                     starts: Optional[Sequence[Optional[Iterable[int]]]] = None, snapshot_every: int = 0) -> None:
        """What each stage of a (re)built pipeline holds, and the blocks it may hold;
        ``starts``: per stage with state caches, the held blocks it can start after
        (None for a stage without); ``snapshot_every``: see the module docstring."""
        self.snapshot_every = snapshot_every
        if self.prefix is not None:
            self.pending_evict = self.prefix.reset(held, capacity, starts)

    @property
    def cached_tokens(self) -> int:
        return self.prefix.tokens if self.prefix is not None else 0

    def new_round(self) -> None:
        self._keep.clear()

    def set_room(self, reserved: int) -> None:
        """Blocks that fit beside what live sequences (``reserved`` positions) may grow to."""
        if self.prefix is not None:
            self._room = (self.max_tokens - reserved) // self.block_tokens

    def take_evictions(self) -> List[int]:
        out, self.pending_evict = self.pending_evict, []
        return out

    def cached_prefix(self, seq: Seq) -> List[int]:
        """The keys of the cached blocks ``seq`` may start after: all its first blocks
        that every stage holds, leaving at least its last token to compute. None for a
        sequence that scores its prompt: a cached position's log-probability is not known."""
        if self.prefix is None or seq.sampling.prompt_logprobs:
            return []
        usable = (len(seq.feed) - 1) // self.block_tokens
        self._hashes(seq, usable)
        return seq.hashes[: self.prefix.match(seq.hashes[:usable])]

    def admits(self, need: int, reserved: int, hit: List[int]) -> bool:
        """Whether ``need`` more positions fit beside ``reserved`` and the cache, after
        evicting cached blocks (never ``hit``, the ones it would reuse) to make room."""
        if self.prefix is not None:  # live sequences win: drop cached blocks before refusing
            over = reserved + need + self.prefix.tokens - self.max_tokens
            if over > 0:
                self.pending_evict += self.prefix.evict_tokens(over, self._keep | set(hit))
        return reserved + need + self.cached_tokens <= self.max_tokens

    def reusing(self, hit: List[int]) -> None:
        """A sequence was admitted to start after ``hit``."""
        if self.prefix is not None:
            self.prefix.touch(hit)
            self._keep.update(hit)

    def store(self, seq: Seq, offset: int) -> Tuple[int, List[int], bool]:
        """The blocks ``seq`` completed before a step at ``offset`` that the stages are
        to keep: (index of the first, their keys, whether stages with state caches keep
        the state at the last one's end too); none once they were asked for."""
        if self.prefix is None:
            return 0, [], False
        # Only confirmed positions: a verify step's offset may lie past drafted ones.
        upto = min(offset, len(seq.prompt) + len(seq.generated) - 1) // self.block_tokens
        if upto <= seq.stored:
            return 0, [], False
        first = seq.stored
        keys = self._hashes(seq, upto)[first:upto]
        snap = self._snaps(seq, offset, upto)
        kept = self.prefix.add(keys, self._keep, self.pending_evict, self._room, start=keys[-1] if snap else None,
                               weights=self._weights(seq, first, upto))
        self._keep.update(keys[:kept])
        seq.stored = upto  # blocks that did not fit are not asked again
        return (first if kept else 0), keys[:kept], snap and kept == len(keys)

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

    def chunk_end(self, seq: Seq, n: int, body: int) -> int:
        """A prefill chunk of ``n`` tokens from ``seq.sent``, shortened where stages
        have state caches so that it ends at a block boundary (and at the body's last
        one): the next step can then ask for the state there (``snap``)."""
        b = self.block_tokens
        if not self.snapshot_every or self.prefix is None:
            return n
        end, last = seq.sent + n, body // b * b
        if end < body and end - end % b > seq.sent:
            end -= end % b
        if seq.sent < last < end:
            end = last
        return end - seq.sent

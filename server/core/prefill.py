"""How many prompt positions a sequence's next prefill step carries: pure logic, no I/O.

``Scheduler`` asks ``PrefillPolicy.chunk`` for every prefill step but the last (the
prompt's last token, which goes alone and is sampled) and hands it the stages' times
of every such step that comes back (``observe``). The rules:

- A chunk is at most ``chunk_size`` positions. A short prefill (a new turn after a
  cached prefix) is cut into about two chunks per stage in flight, never under
  ``min_chunk``, so that every stage works on it at once.
- With ``max_stall`` > 0, a chunk holds the slowest stage at most ``max_stall``
  seconds at its measured cost (``StageFit``), never cut under ``min_chunk``
  (Sarathi-Serve's stall-free batching, alone too: whoever arrives next waits for
  the chunks in flight), but a ``small`` one down to one position (a batch prompt's
  while batch work runs: ``priority.py``), within twice a frame's fixed part where that
  alone is over half ``max_stall`` (``stall``). Unbounded until a prefill step has been timed.
- No chunk crosses its sequence's KV switch (``Seq.kv_at``: its caches turn
  quantized there, ``shards/params/kv.py``).
- Where stages have state caches (``snapshot_every`` > 0), a chunk ends at a block
  boundary, and at the prompt's last one, so that the next step can ask them to
  keep the state there (``snap``, ``kv_budget.py``).

What a chunk costs: a stage's frame time is a fixed part (launching the frame,
reading the cache, the activations in and out) plus a part per position, and a
position attends to every position before it, so that part grows with the context:

    seconds(n, offset) = fixed + per_token * n + per_context * (n * offset + n * n / 2)

for n positions from ``offset``. Each stage's three terms are fitted by least
squares to its prefill frames, the recent ones weighing most (``StageFit``), and a
chunk is the most positions that keep every stage's fit within ``max_stall``.
Counting a frame's time per position instead (as the scheduler did before) puts
its fixed part into every position: a chunk smaller than the frame measured is
then cut further than it need be, one larger overshoots, so chunks only crept
toward the bound, and with noisy timings settled under it where the fixed part
is large; and a position's cost measured at an earlier, shorter context was too
low for the next chunk's.
"""

from __future__ import annotations

import itertools
import math
from typing import List, Optional, Sequence, Tuple

from mlxpipe.server.core.scheduler_config import SchedulerConfig
from mlxpipe.server.core.sequence import Seq

DECAY = 0.9         # each earlier frame counts this much less: the fit follows the prompt as it grows
PULL = (0.5, 1e-9, 0.5)  # how many frames' worth the last fit of each term weighs against the frames: a size
                         # or a context the frames do not vary leaves that term where it was (first: no fixed
                         # part, no growth, as a frame's time counted per position assumed)
TOKENS, POSITIONS = 64.0, 4096.0  # the fit's units of n and of offsets (its terms of like size)


def _terms(n: int, offset: int) -> Tuple[float, float, float]:
    return 1.0, n / TOKENS, (n * offset + n * n / 2) / (TOKENS * POSITIONS)


def _solve(m: List[List[float]], r: List[float]) -> List[float]:
    """``m`` x = ``r`` for a small positive definite ``m`` (Gaussian elimination)."""
    k = len(r)
    m = [row[:] + [r[i]] for i, row in enumerate(m)]
    for i in range(k):
        p = max(range(i, k), key=lambda j: abs(m[j][i]))
        m[i], m[p] = m[p], m[i]
        for j in range(i + 1, k):
            f = m[j][i] / m[i][i]
            m[j] = [a - f * b for a, b in zip(m[j], m[i])]
    x = [0.0] * k
    for i in reversed(range(k)):
        x[i] = (m[i][k] - sum(m[i][j] * x[j] for j in range(i + 1, k))) / m[i][i]
    return x


class StageFit:
    """One stage's frame time as ``fixed + per_token * n + per_context * (n * offset + n * n / 2)``:
    least squares over its frames, the older weighing less (``DECAY``), each term pulled to its last
    value (``PULL``), none negative."""

    def __init__(self) -> None:
        self.gram = [[0.0] * 3 for _ in range(3)]  # sum of weight * terms x terms over the frames
        self.moment = [0.0] * 3                    # sum of weight * terms * seconds
        self.fit = (0.0, 0.0, 0.0)                 # the terms, in the fit's units (``_terms``)

    def add(self, n: int, offset: int, seconds: float) -> None:
        x = _terms(n, offset)
        for i in range(3):
            self.moment[i] = DECAY * self.moment[i] + x[i] * seconds
            for j in range(3):
                self.gram[i][j] = DECAY * self.gram[i][j] + x[i] * x[j]
        self.fit = self._refit()

    def _refit(self) -> Tuple[float, float, float]:
        """The least squares fit with no negative term: the best of those that hold some terms at 0."""
        m = [[g + (PULL[i] if i == j else 0.0) for j, g in enumerate(row)] for i, row in enumerate(self.gram)]
        r = [b + PULL[i] * self.fit[i] for i, b in enumerate(self.moment)]
        best, best_cost = (0.0, 0.0, 0.0), 0.0
        for k in (3, 2, 1):
            for free in itertools.combinations(range(3), k):
                sub = _solve([[m[i][j] for j in free] for i in free], [r[i] for i in free])
                if min(sub) < 0:
                    continue
                x = [0.0] * 3
                for i, v in zip(free, sub):
                    x[i] = v
                cost = sum(x[i] * m[i][j] * x[j] for i in range(3) for j in range(3)) - 2 * sum(
                    x[i] * r[i] for i in range(3))
                if cost < best_cost:
                    best, best_cost = tuple(x), cost
        return best

    @property
    def fixed(self) -> float:
        """Seconds a frame costs whatever its size."""
        return self.fit[0]

    def per_token(self, offset: int) -> float:
        """Seconds one more position costs at ``offset``."""
        return self.fit[1] / TOKENS + self.fit[2] * offset / (TOKENS * POSITIONS)

    def seconds(self, n: int, offset: int) -> float:
        """A frame of ``n`` positions from ``offset``."""
        return sum(a * b for a, b in zip(self.fit, _terms(n, offset)))

    def tokens_within(self, budget: float, offset: int) -> Optional[int]:
        """The most positions from ``offset`` a frame may carry in ``budget`` seconds (None: no bound)."""
        room = budget - self.fixed
        if room <= 0:
            return 0
        linear, square = self.per_token(offset), self.fit[2] / (2 * TOKENS * POSITIONS)
        if linear <= 0 and square <= 0:
            return None
        # The root of square * n^2 + linear * n = room, written so that a tiny square loses no digits.
        return min(int(2 * room / (linear + math.sqrt(linear * linear + 4 * square * room)) + 1e-6), 1 << 30)


class PrefillPolicy:
    """The size of each prefill chunk (the module's rules), from the scheduler's config (read
    live: tests change it) and the costs of the prefill frames timed so far."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.stages: List[StageFit] = []  # one per stage of the running pipeline
        self.snapshot_every = 0  # blocks between the state snapshots stages keep (0: none, or no prefix cache)

    def forget(self) -> None:
        """A new pipeline: its costs are to be measured afresh."""
        self.stages = []

    def observe(self, offset: int, n: int, stage_seconds: Sequence[float]) -> None:
        """A prefill step of ``n`` positions from ``offset`` (not sampled) took each stage this long."""
        if not n or not stage_seconds:
            return
        if len(self.stages) != len(stage_seconds):
            self.stages = [StageFit() for _ in stage_seconds]
        for fit, seconds in zip(self.stages, stage_seconds):
            fit.add(n, offset, seconds)

    def tokens_within(self, budget: float, offset: int) -> Optional[int]:
        """The most positions from ``offset`` a step may carry and hold no stage over ``budget``
        seconds (None: no stage timed yet, or none bounds it)."""
        fits = [n for n in (s.tokens_within(budget, offset) for s in self.stages) if n is not None]
        return min(fits) if fits else None

    def stall(self, small: bool = False) -> float:
        """Seconds a step may hold a stage (0: no bound): ``max_stall``; a ``small`` one (a batch frame cut
        below ``min_chunk``, ``priority.py``) up to twice the largest fixed part of a frame where that
        alone is over half ``max_stall`` (a loaded machine), where one position a frame would cost
        about what more do and an interactive request waits for a frame's fixed part anyway."""
        stall = self.config.max_stall
        if stall <= 0 or not small:
            return max(stall, 0.0)
        return max(stall, 2 * max((s.fixed for s in self.stages), default=0.0))

    def chunk(self, seq: Seq, small: bool = False) -> int:
        """Positions of ``seq``'s next prefill step, from ``seq.sent``: never past all but its last token;
        ``small``: held to ``max_stall`` below ``min_chunk`` too, down to one position (a batch prompt's
        while interactive ones may come: ``priority.py``)."""
        cfg = self.config
        body = len(seq.feed) - 1
        todo = body - len(seq.reuse) * cfg.block_tokens
        n = min(cfg.chunk_size, max(cfg.min_chunk, -(-todo // (2 * cfg.max_prefill_inflight))))
        if cfg.max_stall > 0 and (fits := self.tokens_within(self.stall(small), seq.sent)) is not None:
            n = min(n, max(1 if small else cfg.min_chunk, fits))
        n = min(n, body - seq.sent)
        if seq.kv_at is not None and seq.sent < seq.kv_at < seq.sent + n:
            n = seq.kv_at - seq.sent  # no chunk crosses where its caches turn quantized
        return self._block_end(seq, n, body)

    def _block_end(self, seq: Seq, n: int, body: int) -> int:
        """``n`` shortened, where stages have state caches, so that the chunk ends at a block boundary
        (and at the body's last one): the next step can then ask for the state there (``snap``)."""
        b = self.config.block_tokens
        if not self.snapshot_every:
            return n
        end, last = seq.sent + n, body // b * b
        if end < body and end - end % b > seq.sent:
            end -= end % b
        if seq.sent < last < end:
            end = last
        return end - seq.sent

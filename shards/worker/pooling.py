"""An embedding request on the last stage (``SeqEntry.pool``): the model's final hidden state
(after its norm, before its head: ``SlicedModel(pooled=True)``), pooled over the prompt's
positions as its chunks come (their mean, or the last position's) and normalized, answered
in ``TokenResult.embedding`` instead of a sampled token."""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx
import numpy as np

from mlxpipe.proto import pipeline_pb2 as pb

MEAN, LAST = 1, 2


class Pool:
    def __init__(self, mode: int):
        if mode not in (MEAN, LAST):
            raise ValueError(f"pool is {MEAN} (mean) or {LAST} (last position), not {mode}")
        self.mode = mode
        self.total: Optional[mx.array] = None  # mean: the positions' sum so far; last: the latest position
        self.count = 0

    @classmethod
    def of(cls, mode: int, last_stage: bool) -> Optional["Pool"]:
        """The pool of a first frame's entry, on the last stage (elsewhere a pooled sequence is any other)."""
        return cls(mode) if mode and last_stage else None

    def add(self, hidden: mx.array) -> mx.array:
        """Take one chunk's final hidden state [1, L, D]; returns what to evaluate."""
        rows = hidden[0].astype(mx.float32)
        if self.mode == MEAN:
            part = rows.sum(axis=0)
            self.total = part if self.total is None else self.total + part
        else:
            self.total = rows[-1]
        self.count += rows.shape[0]
        return self.total

    def results(self, entry: pb.SeqEntry):
        """What the frame answers: nothing until the prompt's last position (the entry the
        head marks ``sample``), then the vector."""
        def answer() -> List[pb.TokenResult]:
            if not entry.sample:
                return []
            vector = np.array(self.total / (self.count if self.mode == MEAN else 1))
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
            return [pb.TokenResult(seq_id=entry.seq_id, done=True, embedding=vector.tolist())]
        return answer

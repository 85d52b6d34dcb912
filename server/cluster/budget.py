"""The head's account of where frames' time goes, read off the wire: each frame is
stamped as it is written to stage 0, and its Result's ``StageTiming`` records, its
arrival and its handling are summed per kind into ``core/budget.py``'s totals."""

from __future__ import annotations

import time
from typing import Dict, Optional, Tuple

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.server.core.budget import STAGE_PARTS, KindTotals

MAX_PENDING = 4096  # frames in flight remembered at most (a broken pipeline's never come back)


class FrameBudget:
    """Totals per frame kind, fed by the head's pipeline as frames go and Results come."""

    def __init__(self) -> None:
        self.kinds: Dict[str, KindTotals] = {}
        self._pending: Dict[int, Tuple[float, str, int, bool]] = {}  # frame_id -> (written, kind, tokens, paced)

    def sent(self, frame: pb.Frame) -> None:
        """Call as ``frame`` is written to stage 0 (frames of no positions, CONTROL ones
        that only free or evict, are not timed: there is no work to split)."""
        tokens = sum(e.num_tokens for e in frame.seqs)
        if not tokens:
            return
        if len(self._pending) >= MAX_PENDING:
            self._pending.clear()
        # A prefill frame that samples runs the output head too: its time is no prefill frame's.
        paced = frame.kind != pb.Frame.PREFILL or not any(e.sample for e in frame.seqs)
        self._pending[frame.frame_id] = (time.perf_counter(), pb.Frame.Kind.Name(frame.kind).lower(), tokens, paced)

    def done(self, result: pb.Result, arrived: float, handled: Optional[float] = None) -> None:
        """Call after the head handled ``result`` (which arrived at ``arrived``)."""
        pending = self._pending.pop(result.frame_id, None)
        if pending is None:
            return
        written, kind, tokens, paced = pending
        t = self.kinds.setdefault(kind, KindTotals())
        t.frames += 1
        t.tokens += tokens
        t.round_trip += arrived - written
        t.head += (time.perf_counter() if handled is None else handled) - arrived
        while len(t.stages) < len(result.timings):
            t.stages.append([0.0] * len(STAGE_PARTS))
        for acc, timing in zip(t.stages, result.timings):
            for i, name in enumerate(STAGE_PARTS):
                acc[i] += getattr(timing, f"{name}_us") / 1e6
        if paced:
            t.observe(arrived - written)

    def reset(self) -> None:
        """Forget the totals (a benchmark between runs); frames in flight are still timed."""
        self.kinds.clear()

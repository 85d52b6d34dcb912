"""Priority classes in the scheduler: interactive requests before batch ones, batch never starved.

A sequence is ``INTERACTIVE`` (0) or ``BATCH`` (1): its API key's class, or batch when
the request lowered itself (vLLM's ``priority`` above 0, OpenAI's ``service_tier``
``flex``; a request never raises itself). Where both wait, ``Priorities`` decides:

- Admission: the oldest interactive sequence goes first; batch ones hold at most
  ``max_running - reserve`` of the running places, so an interactive request always
  finds one at once (no preemption needed), and while one is live at most half (the
  decode frames its steps share a stage with stay smaller).
- Prefill: an interactive prompt's step goes first; batch ones keep at most
  ``max_prefill_inflight - 1`` steps in flight while any interactive prompt runs,
  so an interactive step never waits for a free slot.
- Batch frames stay small (``guarding``): while any batch sequence is live (an interactive
  request may come at any moment, and a frame cannot be taken back once sent), a batch
  prompt's chunks hold a stage at most ``max_stall`` at the measured cost of a frame (or twice
  its fixed part, where that alone is over half of it: ``PrefillPolicy.stall``), down to one
  position (``min_chunk`` does not hold for them: ``prefill.py``), and a decode step
  of batch sequences alone carries as many rows as fit in ``max_stall`` at that cost (the
  others in its next step, ``rows``), so that an interactive prompt waits at each stage
  only for small batch frames. (Only while an interactive sequence is live would be too
  late: the one that comes to a server of batch work alone finds large frames sent.)
- Each round's steps go to the pipeline interactive first (prefill and decode), and while an
  interactive prompt is prefilling, groups of batch sequences alone send no new decode step
  (``hold_batch``: its frames then meet at every stage only the batch frames already in
  flight), for at most ``HOLD_ROUNDS`` rounds in a row.
- Batch is never starved: when an interactive sequence was chosen ``share`` times in a
  row while a batch one waited, the next admission or prefill step is batch's.

Pure logic, as the scheduler is; with no batch sequence it changes nothing.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence

from mlxpipe.server.core.plan import Step
from mlxpipe.server.core.prefill import PrefillPolicy
from mlxpipe.server.core.sequence import Seq

INTERACTIVE, BATCH = 0, 1
HOLD_ROUNDS = 32  # rounds in a row batch decode steps may be held for interactive prefills, at most
CLASSES = {"interactive": INTERACTIVE, "batch": BATCH}


def effective(key_class: int, priority: Optional[int] = None, service_tier: Optional[str] = None) -> int:
    """A request's class: its key's, or batch when the request lowers itself (vLLM's ``priority``
    above 0; OpenAI's ``service_tier`` "flex"). Nothing raises it above its key's."""
    lowered = (priority is not None and priority > 0) or service_tier == "flex"
    return BATCH if lowered else key_class


class Priorities:
    """``share``: interactive choices in a row while batch waits, at most, before batch gets one;
    ``reserve``: running places batch sequences leave free."""

    def __init__(self, share: int = 4, reserve: int = 1):
        self.share, self.reserve = share, reserve
        self._admitted_in_row = 0  # interactive admissions in a row while batch waited
        self._prefilled_in_row = 0
        self._interactive_live = False  # any interactive sequence waiting or running (``note_live``)
        self._batch_live = False  # any batch sequence waiting or running
        self._held = 0  # rounds in a row batch decode steps were held

    @staticmethod
    def _batch(seq: Seq) -> bool:
        return seq.priority >= BATCH

    def admit_next(self, waiting: Sequence[Seq], holding_batch: int, max_running: int) -> Optional[Seq]:
        """The waiting sequence to admit next (None: none may be now)."""
        first_interactive = next((s for s in waiting if not self._batch(s)), None)
        first_batch = next((s for s in waiting if self._batch(s)), None)
        # While an interactive request is live, batch sequences take at most half the running places
        # (smaller decode frames for it to wait behind); else all but ``reserve``.
        most = max_running // 2 if self._interactive_live else max_running - self.reserve
        batch_room = holding_batch < max(most, 1)
        owed = first_batch is not None and batch_room and self._admitted_in_row >= self.share
        if first_interactive is not None and not owed:
            self._admitted_in_row = self._admitted_in_row + 1 if first_batch is not None else 0
            return first_interactive
        if first_batch is not None and batch_room:
            self._admitted_in_row = 0
            return first_batch
        return None

    def prefill_candidates(self, ready: List[Seq], batch_inflight: int, max_inflight: int) -> List[Seq]:
        """Of the prompts ready for a prefill step, those that may have the next one."""
        interactive = [s for s in ready if not self._batch(s)]
        batch = [s for s in ready if self._batch(s)]
        if not batch or not interactive:
            self._prefilled_in_row = 0
            if batch and batch_inflight >= max(max_inflight - 1, 1) and self._interactive_live:
                return []  # keep a slot free for an interactive prompt that is prefilling
            return ready
        if self._prefilled_in_row >= self.share and batch_inflight < max(max_inflight - 1, 1):
            self._prefilled_in_row = 0
            return batch
        self._prefilled_in_row += 1
        return interactive

    def note_live(self, seqs: Iterable[Seq]) -> None:
        """Whether any interactive, any batch sequence is admitted or waiting and not finished (set each round)."""
        classes = {self._batch(s) for s in seqs}
        self._interactive_live, self._batch_live = False in classes, True in classes

    @property
    def guarding(self) -> bool:
        """Whether batch frames are kept small: while batch sequences are live, beside interactive ones
        or not (one may come at any moment: the frames ahead of it then are the ones already sent)."""
        return self._batch_live

    def small(self, seq: Seq) -> bool:
        """Whether ``seq``'s prefill chunks are cut to ``max_stall`` below ``min_chunk`` (``guarding``)."""
        return self._batch(seq) and self.guarding

    def rows(self, members: List[int], seqs: dict, prefill: PrefillPolicy) -> List[int]:
        """The sequences of a group its next decode step carries: all, but while ``guarding``, of a group
        of batch sequences alone as many as hold a stage at most ``max_stall`` at the measured cost of a
        prefill position at their context (at least one; the others go first in the group's next step)."""
        if not self.guarding or any(not self._batch(seqs[s]) for s in members):
            return list(members)  # (every decode step of every group comes here: the cheap tests first)
        stall = prefill.stall(small=True)
        if stall <= 0:
            return list(members)
        fits = prefill.tokens_within(stall, max(seqs[s].cached for s in members))
        if fits is None or fits >= len(members):
            return list(members)
        chosen = members[:max(fits, 1)]
        members[:] = members[len(chosen):] + chosen  # (in place: the group's own list)
        return chosen

    def hold_batch(self, prefilling: Sequence[Seq]) -> bool:
        """Whether groups of batch sequences alone wait this round (an interactive prompt is prefilling)."""
        if not any(not self._batch(s) for s in prefilling) or self._held >= HOLD_ROUNDS:
            self._held = 0
            return False
        self._held += 1
        return True

    @staticmethod
    def order(steps: List[Step], seqs: dict) -> List[Step]:
        """A round's steps, those carrying an interactive sequence first (stable otherwise)."""
        def batch_only(step: Step) -> bool:
            return bool(step.entries) and all(
                seqs[e.seq_id].priority >= BATCH for e in step.entries if e.seq_id in seqs)
        return sorted(steps, key=batch_only)

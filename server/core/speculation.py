"""Speculative decoding on the head: which sequences verify drafts, what their VERIFY
steps carry, and which samples become tokens. Pure logic.

While few sequences are live (at most ``spec_max_running``, waiting and
prefilling ones included, so the groups alone would leave stages idle and no
prompt waits behind drafts), a sequence that has a guess of what comes next
leaves its group and verifies drafts instead. Guesses come from its drafter
(``drafting.py``: prompt lookup, a draft model, or lookup first); a drafter
answers at once, so no step waits for a draft. A VERIFY step carries the last
confirmed token and the drafted tokens after it, ``spec_positions`` per step,
up to ``spec_depth`` (or the sequence's own ``max_drafts``) positions beyond
its confirmed tokens in flight, in at most ``spec_frames`` steps. The last
stage samples after every position exactly as a decode step would (same
history, same random key), so a position's sample counts only while every
draft before it matched; at the first mismatch the sampled token still
counts, the rest is void (results of steps already in flight are stale) and
the next step trims it from the stages. Greedy and seeded output is therefore
exactly what plain decoding gives. The depth follows the acceptance (halved on
a miss, one more after as many drafts in a row matched); a sequence whose
drafts keep failing decodes in its group again for a while. Nor does a
sequence speculate while a stage cannot take drafts back (``max_rewind`` 0:
the stages' Load replies), and drafts in flight never exceed what every stage
can take back.

Speculation must pay where it runs: a VERIFY frame costs more than a decode
step, by how much depends on the hardware. So it is decided by measured cost:
a sequence first decodes in its group until the pipeline has timed a decode
frame (``costs()["decode"].frame_s``: a lone sequence's seconds per token
there); while it verifies, the tokens it confirms per second over each trial
window (at least ``TRIAL_FRAMES`` decode frames' time) are set against that
rate, and a window that does not beat it sends the sequence back to its group
for ``pause`` decode steps, doubled after every trial that failed in a row (so
where speculation cannot pay it stays off by itself, trying again ever more
rarely), reset by one that pays. A sequence with a grammar never speculates:
its grammar would have to take back rejected drafts.

The model's own MTP head drafts on the last stage (``drafting.StageDrafts``): a
sequence that drafts with it says so in its first frame (``mtp_depth``: the stage
keeps an MTP cache for it), and a frame after which its drafts are wanted (it
verifies, or may leave its group at its next step) asks for them; they come back
with the frame's last accepted token (``offer``). Acceptance is counted per source
(``DraftStats.by_source``, and per sequence for its usage).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from mlxpipe.server.core.budget import KindTotals
from mlxpipe.server.core.drafting import Drafter, PromptLookup
from mlxpipe.server.core.plan import Sample
from mlxpipe.server.core.sequence import Seq, SpeculationState


TRIAL_FRAMES = 6   # a trial window of speculation lasts at least this many decode frames' time
PAUSE = 32         # decode steps in the group after a first trial that did not pay
MAX_PAUSE = 1024   # ... doubling up to this many


@dataclass
class DraftStats:
    """Drafted tokens the last stage judged since start, and how many it accepted."""

    judged: int = 0
    accepted: int = 0
    trials: int = 0  # trial windows of speculation weighed against decoding
    paid: int = 0    # ... that beat it
    by_source: Dict[str, List[int]] = field(default_factory=dict)  # source -> [judged, accepted]

    def count(self, source: str, hit: bool, seq: Optional[Seq] = None) -> None:
        self.judged += 1
        self.accepted += hit
        for book in (self.by_source, seq.drafts if seq is not None else {}):
            row = book.setdefault(source, [0, 0])
            row[0] += 1
            row[1] += hit

    def acceptance(self, source: str) -> Optional[float]:
        judged, accepted = self.by_source.get(source, (0, 0))
        return accepted / judged if judged else None

    def as_dict(self) -> dict:
        return {"drafted_tokens": self.judged, "accepted_tokens": self.accepted,
                "acceptance": round(self.accepted / self.judged, 4) if self.judged else None,
                "trials": self.trials, "trials_paid": self.paid,
                "by_source": {s: by_source(judged, accepted) for s, (judged, accepted) in self.by_source.items()}}


def by_source(judged: int, accepted: int) -> dict:
    """One source's drafts judged and accepted, and the rate."""
    return {"drafted_tokens": judged, "accepted_tokens": accepted,
            "acceptance": round(accepted / judged, 4) if judged else None}


@dataclass
class Verify:
    """A VERIFY step a sequence wants: ``tokens`` at positions from ``offset``."""

    seq: Seq
    offset: int
    tokens: List[int]
    trim: int
    epoch: int  # a rejection makes steps of older epochs stale


def verify_positions(row_cost: float, stages: int, depth: int = 4) -> int:
    """Positions per VERIFY frame that get ``depth`` + 1 positions (a typical
    window: the depth adapts) through ``stages`` stages soonest, when a frame of p
    positions costs 1 + row_cost x (p - 1) one-row steps: 1 where rows cost about
    in proportion (every stage works on its own frame, and a miss wastes least),
    the whole window in one frame where rows are nearly free."""
    def seconds(p: int) -> float:
        return (-(-(depth + 1) // p) + stages - 1) * (1 + row_cost * (p - 1))

    return min(range(1, depth + 2), key=lambda p: (seconds(p), -p))  # ties: fewer frames


class Speculator:
    """The scheduler's speculation: it says which grouped sequences leave to verify
    drafts (``leaves_group``), which steps the verifying ones want (``wants``) and
    which samples of a VERIFY result become tokens (``judge``)."""

    def __init__(self, config, drafters: Optional[Callable[[Seq], Drafter]] = None,
                 costs: Callable[[], Dict[str, KindTotals]] = dict, clock: Callable[[], float] = time.monotonic):
        self.config = config  # the scheduler's: speculate, spec_max_running, spec_positions, spec_depth, spec_frames
        self.drafters = drafters or (lambda seq: PromptLookup())  # a sequence's drafter (its ``speculation``)
        self.costs, self.clock = costs, clock  # the pipeline's measured costs per frame kind; seconds
        self.solo: List[int] = []  # sequences verifying drafts instead of decoding in a group
        self.stats = DraftStats()
        self.max_rewind = 1 << 30  # drafted positions every stage can take back (0: none)

    def may(self, seq: Seq, live: int) -> bool:
        cfg = self.config
        return (cfg.speculate and seq.speculation != "none" and seq.max_drafts != 0 and not seq.sampling.grammar
                and self.max_rewind > 0 and live <= cfg.spec_max_running)

    def state(self, seq: Seq) -> SpeculationState:
        if seq.spec_state is None:
            # A miss takes back at most `cap` positions: no more than every stage can.
            cap = min(self.config.spec_depth, seq.max_drafts or self.config.spec_depth, self.max_rewind)
            seq.spec_state = SpeculationState(depth=cap, cap=cap, drafter=self.drafters(seq))
        return seq.spec_state

    def admitted(self, seq: Seq, live: int) -> None:
        """``seq`` starts its prefill: a draft model starts on the prompt now."""
        if self.may(seq, live):
            self.state(seq).drafter.prepare(seq.feed)

    def leaves_group(self, seq: Seq, live: int) -> bool:
        """Whether a grouped sequence leaves its group to verify drafts now (the
        scheduler takes it out of the group when so)."""
        if not self.may(seq, live):
            return False
        st = self.state(seq)
        if st.cooldown:
            st.cooldown -= 1
            return False
        if self._decode_s() is None or not self._draft(seq, 1):
            return False  # (no decode frame timed yet: decode first, to know what speculation must beat)
        st.since, st.got = self.clock(), 0
        st.solo = True
        seq.group = None
        self.solo.append(seq.seq_id)
        return True

    def _draft(self, seq: Seq, need: int) -> bool:
        """Make sure ``need`` guesses exist after the confirmed tokens."""
        st = seq.spec_state
        if len(st.guesses) < need:
            tokens = seq.tokens
            new = st.drafter.propose(tokens + st.guesses, need - len(st.guesses), confirmed=len(tokens))
            st.guesses += new
            st.sources += [st.drafter.source] * len(new)
        return len(st.guesses) >= need

    def mtp_depth(self, seq: Seq, live: int, first: bool) -> int:
        """What a step of ``seq`` asks of the last stage's MTP head (``SeqEntry.mtp``): on its first
        step, whether to keep an MTP cache (any > 0: it drafts with the head); later, how many
        drafts to make after the step's token (0: none wanted now)."""
        st = seq.spec_state
        if st is None or not getattr(st.drafter, "mtp", False) or not self.may(seq, live):
            return 0
        return st.depth if first or st.solo or st.cooldown <= 1 else 0

    def offer(self, seq: Seq, drafts: Sequence[int]) -> None:
        """The last stage's MTP head guessed ``drafts`` after ``seq``'s tokens as they are now."""
        if seq.spec_state is not None:
            seq.spec_state.drafter.offered(len(seq.tokens), drafts)

    def wants(self, seqs: Dict[int, Seq], live: int) -> Tuple[List[Seq], List[Verify]]:
        """The verifying sequences that go back to decoding in a group (the pipeline
        fills up, or nothing to guess: their first decode step trims what the stages
        hold beyond the confirmed tokens), and the VERIFY steps the others want now."""
        cfg = self.config
        back, verifies = [], []
        for sid in list(self.solo):
            seq = seqs[sid]
            st = seq.spec_state
            if st.inflight == 0 and (live > cfg.spec_max_running or st.cooldown or not self._draft(seq, 1)):
                st.solo = False
                st.drop()
                self.solo.remove(sid)
                back.append(seq)
                continue
            while st.fed < st.depth + 1 and st.inflight < cfg.spec_frames:
                # Inputs for positions C + fed, ...: the last token, then guesses.
                n = min(cfg.spec_positions, st.depth + 1 - st.fed)
                if seq.kv_at is not None and seq.cached < seq.kv_at:
                    # Short of where its caches turn quantized, nothing goes past it unconfirmed:
                    # no step crosses it, and no trim takes back quantized positions before it.
                    n = min(n, seq.kv_at - seq.cached - st.fed)
                if st.fed + n - 1 > len(st.guesses):
                    self._draft(seq, st.fed + n - 1)
                    n = min(n, len(st.guesses) + 1 - st.fed)
                if n < 1:
                    break  # nothing more to guess: wait for what is in flight
                inputs = ([seq.tokens[-1]] if st.fed == 0 else []) + st.guesses[max(st.fed - 1, 0) : st.fed + n - 1]
                verifies.append(Verify(seq, seq.cached + st.fed, inputs, st.trim, st.epoch))
                st.trim = 0
                st.fed += n
                st.inflight += 1
        return back, verifies

    def judge(self, seq: Seq, epoch: int, samples: List[Sample]) -> List[Sample]:
        """The samples of a VERIFY result (of a step sent in ``epoch``) that become
        tokens: each, while every draft before it matched; at the first mismatch
        the rest is void."""
        st = seq.spec_state
        st.inflight -= 1
        if epoch != st.epoch:
            return []  # sent before a rejection: about positions that no longer exist
        taken = []
        for t in samples:
            taken.append(t)
            st.fed -= 1  # position C is confirmed now; C moves on by one
            if not st.fed:
                if st.guesses and st.guesses[0] == t.token:
                    st.take()  # guessed but not yet sent: keep the rest of the guess
                else:
                    st.drop()
                continue
            guess, source = st.take()  # the input already sent at the next position
            if self._matched(seq, guess == t.token, source):
                continue
            # A miss: what the stages hold after the confirmed tokens is void.
            st.trim, st.fed = st.trim + st.fed, 0
            st.drop()
            st.epoch += 1
            st.depth, st.streak = max(1, st.depth // 2), 0
            break
        if st.judged >= 16:  # drafts that keep failing cost more than they save: pause
            if st.matched < st.judged // 4:
                st.cooldown = PAUSE
            st.judged = st.matched = 0
        self._weigh(st, len(taken))
        return taken

    def _decode_s(self) -> Optional[float]:
        """Seconds per token of a sequence decoding in its group (a decode frame's round trip)."""
        return getattr(self.costs().get("decode"), "frame_s", None)

    def _weigh(self, st: SpeculationState, tokens: int) -> None:
        """Count ``tokens`` confirmed by speculation; at the end of a trial window, set
        its rate against decoding's, and pause speculation (longer each time) if it
        did not beat it."""
        st.got += tokens
        decode_s, now = self._decode_s(), self.clock()
        if decode_s is None or st.since is None or now - st.since < TRIAL_FRAMES * decode_s:
            return
        pays = st.got / (now - st.since) > 1.0 / decode_s
        if pays:
            st.pause = 0
        elif not st.cooldown:
            st.pause = min(2 * st.pause, MAX_PAUSE) if st.pause else PAUSE
            st.cooldown = st.pause
        self.stats.trials += 1
        self.stats.paid += pays
        st.since, st.got = now, 0

    def _matched(self, seq: Seq, hit: bool, source: str) -> bool:
        """Count one judged draft; on a hit, deepen after a streak as long as the depth."""
        st = seq.spec_state
        st.judged += 1
        self.stats.count(source, hit, seq)
        if hit:
            st.matched += 1
            st.streak += 1
            if st.streak >= st.depth and st.depth < st.cap:
                st.depth, st.streak = st.depth + 1, 0
        return hit

    def forget(self, seq: Seq) -> None:
        """``seq`` ended: its drafter closes."""
        st = seq.spec_state
        if st is not None:
            if st.solo:
                self.solo.remove(seq.seq_id)
                st.solo = False
            st.drafter.close()

    def reset(self, live: List[Seq]) -> None:
        """A replay: the stages hold nothing of any sequence now."""
        self.solo = []
        for seq in live:
            if seq.spec_state is not None:
                seq.spec_state.drafter.close()
            seq.spec_state = None

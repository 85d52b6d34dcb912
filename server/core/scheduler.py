"""What goes into the pipeline next: pure logic, no I/O, no MLX, no wire.

The engine feeds it requests (``add``, ``cancel``) and results (``on_result``)
and asks it for the steps to run (``schedule``), which ``frames.py`` turns into
frames. It keeps every sequence's truth: its prompt, the tokens generated so
far, where it is in the pipeline.

Rules:

- Prefill is chunked (token-level pipelining, as in TeraPipe): all but the
  last token of the prompt go in chunks, sent back to back without waiting for
  results, so stage 1 works on chunk k while stage 0 works on chunk k+1; how
  large each is, ``prefill.py`` decides (at most ``chunk_size``, at most
  ``max_stall`` s of the slowest stage at the measured cost of a frame, whose
  times each result brings back). The last token goes alone and is sampled,
  exactly as mlx-lm's ``generate_step`` does it.
- Prefill is fair (``_next_prefill``): a free prefill slot goes to the prompt with the fewest
  tokens left (round-robin would make a short one wait a chunk of each long one, and every
  long one finish late); the oldest gets one in every ``max_overtaken`` + 1 at least.
  Newcomers wait for the chunks in flight.
- Decoding sequences live in ``num_groups`` micro-batch groups. Each group has
  at most one step in flight; while stage i runs group g, stage i+1 runs group
  g-1. A sequence whose first token arrives joins the smallest group at that
  group's next step; one that finishes or is cancelled leaves, and its caches
  are freed on every stage by the ``free`` list of the next step.
- KV budget and prefix cache (``kv_budget.py``): a sequence is admitted when what
  it may grow to fits; it starts after the longest run of its first blocks that every
  stage holds when its first step goes (``relook``: a like prompt admitted with it may
  have stored them since), which names them (``reuse``), each later step
  tells the stages to keep the blocks it completed before it (``store``), and
  the first step of a round carries the blocks to drop (``evict``; ``discard``: from
  disk too). Where stages have state caches, a step that starts at a block's end
  asks them to keep the state there (``snap``). A block some stage holds on disk
  only is read back before the first step (``take_fetches``, ``fetched``).
- KV quantization (``kv_start``, once the stages say they quantize): a
  sequence's caches turn quantized where mlx-lm's ``generate_step`` would
  turn them for its prompt (``kv_at``, named in its first step:
  ``shards/params/kv.py``); no prefill chunk and no VERIFY step crosses it,
  and its KV reservation counts the positions before it at full precision.
- Speculative decoding (when ``speculate``): see ``speculation.py``.
- A sequence with a grammar ends when the last stage says its grammar is
  complete (``Sample.done``); replayed, its first step names the tokens
  it generated, so the last stage's grammar advances past them again.
- Queues are bounded: ``add`` raises ``QueueFull`` instead of growing.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, Iterable, List, Optional, Tuple

from mlxpipe.server.core.budget import KindTotals
from mlxpipe.server.core.drafting import Drafter
from mlxpipe.server.core.kv_budget import Fetch, KvBudget
from mlxpipe.server.core.plan import Entry, Opening, Sample, Step, StepKind, StepResult
from mlxpipe.server.core.prefill import PrefillPolicy
from mlxpipe.server.core.priority import Priorities
from mlxpipe.server.core.scheduler_config import SchedulerConfig
from mlxpipe.server.core.sequence import Phase, QueueFull, Seq, TokenEvent
from mlxpipe.server.core.speculation import Speculator

MAX_FAULTS = 2  # pipeline faults blamed on one sequence's frames before it is failed instead of replayed


@dataclass
class Flight:
    kind: StepKind
    seq_ids: List[int]
    group: Optional[int] = None
    epoch: int = 0  # VERIFY: the speculation epoch it was sent in (a rejection makes older ones stale)
    chunk: Optional[Tuple[int, int]] = None  # PREFILL, not sampled: (offset, positions), its times a prefill cost


class Scheduler:
    def __init__(self, config: SchedulerConfig, drafters: Optional[Callable[[Seq], Drafter]] = None,
                 costs: Callable[[], Dict[str, KindTotals]] = dict):
        if min(config.num_groups, config.chunk_size, config.max_prefill_inflight, config.spec_depth,
               config.spec_positions, config.spec_frames) < 1:
            raise ValueError("num_groups, chunk_size, max_prefill_inflight and the spec_ sizes must be positive")
        room = config.num_groups * config.max_batch
        if config.max_running is not None and config.max_running > room:
            raise ValueError(
                f"max_running {config.max_running} exceeds {config.num_groups} groups x "
                f"{config.max_batch} sequences"
            )
        self.config = config
        self.max_running = room if config.max_running is None else config.max_running
        self.kv = KvBudget(config.max_kv_tokens, config.block_tokens, config.prefix_blocks)
        self.prefill = PrefillPolicy(config)  # how large each prefill chunk is
        self.priorities = Priorities(config.batch_share, config.batch_reserve)  # interactive first (priority.py)
        self.speculator = Speculator(config, drafters, costs)  # (costs: per frame kind, core/budget.py)
        self.seqs: Dict[int, Seq] = {}
        self.waiting: Deque[Seq] = deque()
        self.prefilling: List[Seq] = []
        self.groups: List[List[int]] = [[] for _ in range(config.num_groups)]
        self.inflight: Dict[int, Flight] = {}
        self.pending_free: List[int] = []
        self._step_ids = itertools.count(1)

    def set_kv(self, quantizing: bool, ratio: float) -> None:
        """Whether the stages quantize their KV caches (as asked: ``kv_start``), and how many
        times a full-precision position costs a quantized one on the stage where most."""
        self.kv.set_kv(self.config.kv_start if quantizing else None, ratio)

    def resize(self, max_kv_tokens: int) -> List[TokenEvent]:
        """A rebuilt pipeline holds a different number of KV positions. A sequence waiting
        for it (all are, after ``replay_all``) may now hold no more than that: one that
        holds that much already fails (the events say so), the others end there at most."""
        self.kv.resize(max_kv_tokens)
        events = []
        for seq in [s for s in self.waiting if s.max_context > max_kv_tokens]:
            if len(seq.prompt) + len(seq.generated) >= max_kv_tokens:
                events.append(self._fail(seq, f"the rebuilt pipeline's KV cache holds {max_kv_tokens} tokens for "
                                              f"one request; this one holds {len(seq.tokens)} already"))
            else:
                seq.max_context = max_kv_tokens
        return events

    def reset_prefix(self, held: List[Iterable[int]], capacity: int,
                     starts: Optional[List[Optional[Iterable[int]]]] = None, snapshot_every: int = 0,
                     disk: Optional[List[List[int]]] = None, disk_capacity: int = 0) -> None:
        """What each stage of a (re)built pipeline holds, and the blocks it may hold; ``starts``: per stage
        with state caches, the held blocks it can start after (None for a stage without); ``snapshot_every``:
        see ``kv_budget.py``; ``disk``: what each stage's disk tier holds, ``disk_capacity`` its blocks."""
        self.kv.reset_prefix(held, capacity, starts, snapshot_every, disk, disk_capacity)
        self.prefill.snapshot_every = snapshot_every if self.kv.prefix is not None else 0

    def take_fetches(self) -> List[Fetch]:
        """Blocks to have stages read back from disk (``Fetch``), then hand to ``fetched``."""
        return self.kv.take_fetches()

    def fetched(self, fetch: Fetch, results: List[Tuple[List[int], List[int]]]) -> None:
        """Each stage's answer to ``fetch`` (keys read back, keys it could not): the
        sequence's first step may go, after what every stage holds now."""
        if not self.kv.fetched(fetch, results, self.seqs.get(fetch.seq_id)):
            self.pending_free.append(fetch.seq_id)  # ended while it waited: stages drop what they read

    @property
    def max_rewind(self) -> int:
        """Drafted positions every stage can take back (0: no speculation)."""
        return self.speculator.max_rewind

    @max_rewind.setter
    def max_rewind(self, n: int) -> None:
        self.speculator.max_rewind = n

    @property
    def max_kv_tokens(self) -> int:
        return self.kv.max_tokens

    @property
    def prefix(self):
        """The prefix index (``PrefixIndex``), or None without a prefix cache."""
        return self.kv.prefix

    @property
    def solo(self) -> List[int]:
        """Sequences verifying drafts instead of decoding in a group."""
        return self.speculator.solo

    @property
    def drafts(self):
        """Drafted tokens judged and accepted since start (``DraftStats``)."""
        return self.speculator.stats

    # -- requests -------------------------------------------------------------

    def add(self, seq: Seq) -> None:
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests already waiting")
        seq.feed = list(seq.prompt)
        self.kv.place(seq)
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def cancel(self, seq_id: int, reason: str = "cancelled") -> None:
        seq = self.seqs.get(seq_id)
        if seq is not None and seq.phase != Phase.DONE:
            self._finish(seq, reason)

    def _finish(self, seq: Seq, reason: str) -> None:
        if seq.phase == Phase.WAITING:
            self.waiting.remove(seq)
        elif seq.phase == Phase.PREFILL:
            self.prefilling.remove(seq)
        elif seq.group is not None:
            self.groups[seq.group].remove(seq.seq_id)
            seq.group = None
        self.speculator.forget(seq)
        seq.phase = Phase.DONE
        seq.finish_reason = reason
        if self.kv.release(seq.seq_id) or seq.known:  # (a fetch: stages may hold blocks read back for it)
            self.pending_free.append(seq.seq_id)
        del self.seqs[seq.seq_id]

    @property
    def live(self) -> int:
        return len(self.seqs)

    @property
    def idle(self) -> bool:
        return not (self.seqs or self.inflight or self.pending_free or self.kv.pending_evict or self.kv.pending_discard)

    @property
    def kv_reserved(self) -> int:
        """KV positions admitted sequences may grow to: prompt plus token budget each."""
        return sum(self.kv.need(s) for s in self.seqs.values() if s.phase in (Phase.PREFILL, Phase.RUNNING))

    @property
    def decoding(self) -> int:
        """Sequences past their prefill: in groups, or verifying drafts."""
        return sum(len(g) for g in self.groups) + len(self.solo)

    # -- scheduling -----------------------------------------------------------

    def schedule(self) -> List[Step]:
        """The steps to run now, in order."""
        self.kv.new_round()  # (a sequence not started keeps the blocks it starts after: KvBudget.waiting)
        self.priorities.note_live(self.seqs.values())
        self._admit()
        self.kv.set_room(self.kv_reserved)
        steps = self._verify_steps()    # may send a sequence back to a group...
        steps += self._decode_steps()   # ... or take one out of its group...
        steps += self._verify_steps()   # ... which then verifies at once
        steps = Priorities.order(steps + self._prefill_steps(), self.seqs)
        evict, discard = self.kv.take_evictions()
        if self.pending_free or evict or discard:
            if not steps:
                steps.append(self._step(StepKind.CONTROL, [], []))
            # Stages apply these before the step's work; blocks this round's
            # steps reuse or store were kept out of the evictions.
            steps[0].free, steps[0].evict, steps[0].discard = self.pending_free, evict, discard
            self.pending_free = []
        return steps

    def _admit(self) -> None:
        holding = len(self.prefilling) + self.decoding
        batch = sum(1 for s in self.seqs.values() if s.priority and s.phase in (Phase.PREFILL, Phase.RUNNING))
        reserved = self.kv_reserved
        while self.waiting and holding < self.max_running:
            seq = self.priorities.admit_next(self.waiting, batch, self.max_running)  # interactive first
            if seq is None:
                break
            hit = self.kv.cached_prefix(seq)
            need = self.kv.need(seq)
            if not self.kv.admits(need, reserved, hit) and holding:
                break  # wait for KV memory to free up (in order: nobody of its class overtakes)
            self.waiting.remove(seq)
            batch += 1 if seq.priority else 0
            seq.phase = Phase.PREFILL
            seq.reuse, seq.stored = hit, len(hit)
            seq.sent = len(hit) * self.config.block_tokens
            seq.fetching = self.kv.reusing(seq, hit)  # blocks on a disk only: its first step waits
            if seq.cached_tokens is None:
                seq.cached_tokens, seq.disk_tokens = seq.sent, None if seq.fetching else 0
            self.prefilling.append(seq)
            self.speculator.admitted(seq, self.live)
            holding += 1
            reserved += need

    def _entry(self, seq: Seq, offset: int, num_tokens: int, sample: bool, trim: int = 0) -> Entry:
        """A later step's entry for ``seq``: with the blocks it completed before it to keep."""
        entry = Entry(seq.seq_id, offset, num_tokens, sample, trim)
        entry.store_first, entry.store, entry.snap, entry.spill = self.kv.store(seq, offset)
        return entry

    def _opening(self, seq: Seq) -> Opening:
        """What ``seq``'s first step tells the stages: its sampling, the blocks it starts
        after, the reused tokens its penalties look back at, and (with a grammar) the
        tokens it generated before a replay."""
        back = seq.sampling.penalty_lookback
        context = seq.feed[max(seq.sent - back, 0) : seq.sent] if seq.reuse and back else []
        return Opening(seq.sampling, list(seq.reuse), context, list(seq.generated) if seq.sampling.grammar else [],
                       *self.kv.promote(seq), kv_at=seq.kv_at or 0, pool=seq.pool)

    def _step(self, kind: StepKind, seq_ids: List[int], entries: List[Entry], group: Optional[int] = None,
              tokens=(), epoch: int = 0, chunk: Optional[Tuple[int, int]] = None) -> Step:
        sid = next(self._step_ids)
        self.inflight[sid] = Flight(kind, seq_ids, group, epoch, chunk)
        return Step(sid, kind, entries, list(tokens), group or 0)

    def _decode_steps(self) -> List[Step]:
        steps = []
        busy_groups = {f.group for f in self.inflight.values() if f.kind == StepKind.DECODE}
        hold = self.priorities.hold_batch(self.prefilling)  # batch-only groups wait for an interactive prefill
        for g, members in enumerate(self.groups):
            if not members or g in busy_groups or (hold and all(self.seqs[s].priority for s in members)):
                continue
            for sid in list(members):
                if self.speculator.leaves_group(self.seqs[sid], self.live):
                    members.remove(sid)
            if not members:
                continue
            seqs = [self.seqs[s] for s in self.priorities.rows(members, self.seqs, self.prefill)]
            entries = []
            for s in seqs:
                trim = 0
                if s.spec_state is not None and s.spec_state.trim:  # back from speculating: drop its rejected drafts
                    trim, s.spec_state.trim = s.spec_state.trim, 0
                entries.append(self._entry(s, s.cached, 1, True, trim))
            tokens = [s.generated[-1] for s in seqs]
            steps.append(self._step(StepKind.DECODE, [s.seq_id for s in seqs], entries, g, tokens))
        return steps

    def _prefill_steps(self) -> List[Step]:
        steps = []
        inflight = sum(1 for f in self.inflight.values() if f.kind == StepKind.PREFILL)
        while inflight < self.config.max_prefill_inflight and (seq := self._next_prefill()) is not None:
            steps.append(self._prefill_step(seq))
            inflight += 1
        return steps

    def _next_prefill(self) -> Optional[Seq]:
        """Whose prefill step goes next: the prompt with the fewest tokens left to send (the first
        admitted among equals), or the oldest once passed over ``max_overtaken`` times in a row."""
        ready = [s for s in self.prefilling if s.sent < len(s.feed) and not s.fetching]  # (blocks on disk: read first)
        batch = sum(1 for f in self.inflight.values() if f.kind == StepKind.PREFILL
                    and any(self.seqs[i].priority for i in f.seq_ids if i in self.seqs))
        ready = self.priorities.prefill_candidates(ready, batch, self.config.max_prefill_inflight)
        if ready:
            oldest = ready[0]
            pick = oldest if oldest.overtaken >= self.config.max_overtaken else \
                min(ready, key=lambda s: len(s.feed) - s.sent)
            oldest.overtaken = 0 if pick is oldest else oldest.overtaken + 1
            return pick
        return None

    def _prefill_step(self, seq: Seq) -> Step:
        """``seq``'s next prefill step: a chunk of all but its last token, or that token, sampled."""
        self.kv.relook(seq, settled=not seq.priority)  # (its first: after the blocks cached now)
        n, sample = (self.prefill.chunk(seq, self.priorities.small(seq)), False) if seq.sent < len(seq.feed) - 1 \
            else (1, True)
        entry = self._entry(seq, seq.sent, n, sample) if seq.known else \
            Entry(seq.seq_id, seq.sent, n, sample, opening=self._opening(seq))  # (its first step: the opening)
        tokens, chunk = seq.feed[seq.sent : seq.sent + n], None if sample else (seq.sent, n)
        seq.sent, seq.known = seq.sent + n, True
        return self._step(StepKind.PREFILL, [seq.seq_id], [entry], tokens=tokens, chunk=chunk)

    def _verify_steps(self) -> List[Step]:
        back, verifies = self.speculator.wants(self.seqs, self.live)
        for seq in back:
            self._join_group(seq)
        return [self._step(StepKind.VERIFY, [v.seq.seq_id], [self._entry(v.seq, v.offset, len(v.tokens), True, v.trim)],
                           tokens=v.tokens, epoch=v.epoch) for v in verifies]

    # -- results --------------------------------------------------------------

    def on_result(self, result: StepResult) -> List[TokenEvent]:
        """Take one step's result; return the tokens it gave live sequences."""
        flight = self.inflight.pop(result.step_id, None)
        if flight is None:
            return []
        if flight.chunk is not None:  # (a sampled step runs the output head too: no prefill cost)
            self.prefill.observe(*flight.chunk, result.stage_s)
        events = []
        for t in result.samples:  # a sequence its stage failed: it ends here, alone
            if t.error and t.seq_id in self.seqs:
                events.append(self._fail(self.seqs[t.seq_id], f"the last stage could not go on: {t.error}"))
        if flight.kind == StepKind.VERIFY:
            seq = self.seqs.get(flight.seq_ids[0])
            if seq is None:  # finished or cancelled while the step was in flight
                return events
            for t in self.speculator.judge(seq, flight.epoch, list(result.samples)):
                events.append(self._take(seq, t))
                if seq.phase == Phase.DONE:
                    break
            return events
        by_id = {t.seq_id: t for t in result.samples}
        for sid in flight.seq_ids:
            seq = self.seqs.get(sid)
            t = by_id.get(sid)
            if seq is not None and t is not None:  # (a sequence may have ended while it was in flight)
                events.append(self._take(seq, t))
        return events

    def _fail(self, seq: Seq, why: str) -> TokenEvent:
        """End ``seq`` with an error: its request gets ``why``; nothing else changes."""
        seq.error = why
        self._finish(seq, "error")
        return TokenEvent(seq, -1, 0.0, None, True, why)

    def _take(self, seq: Seq, t: Sample) -> TokenEvent:
        """A sampled token becomes the sequence's next (none with a budget of 0: it only
        scored its prompt, and ends with the last stage's pick unused)."""
        if not seq.max_tokens:
            self._finish(seq, "length")
            return TokenEvent(seq, -1, 0.0, None, True, embedding=t.embedding)
        seq.generated.append(t.token)
        if seq.phase == Phase.PREFILL:
            self.prefilling.remove(seq)
            seq.phase = Phase.RUNNING
            self._join_group(seq)
        reason = None
        if t.token in seq.eos or t.done:
            reason = "stop"
        elif len(seq.generated) >= seq.max_tokens or len(seq.prompt) + len(seq.generated) >= seq.max_context:
            reason = "length"
        if reason:
            self._finish(seq, reason)
        return TokenEvent(seq, t.token, t.logprob, t.top, reason is not None)

    def _join_group(self, seq: Seq) -> None:
        # The smallest group; admission (max_running <= num_groups * max_batch)
        # guarantees it has room.
        g = min(range(len(self.groups)), key=lambda i: (len(self.groups[i]), i))
        self.groups[g].append(seq.seq_id)
        seq.group = g

    # -- failures -------------------------------------------------------------

    def fail_culprits(self, culprits: Iterable[int], why: str) -> List[TokenEvent]:
        """A stage broke the pipeline on a frame of these sequences: each takes a fault,
        and one that has now broke it ``MAX_FAULTS`` times is failed, not replayed
        again (a poison guard: a request must not take the pipeline down forever)."""
        events = []
        for sid in culprits:
            seq = self.seqs.get(sid)
            if seq is None or seq.phase == Phase.DONE:
                continue
            seq.faults += 1
            if seq.faults >= MAX_FAULTS:
                events.append(self._fail(seq, f"this request broke the pipeline {seq.faults} times and is not "
                                              f"retried again; the last time: {why}"))
        return events

    def replay_all(self) -> List[Seq]:
        """The pipeline lost its state: every live sequence starts over from its
        prompt plus the tokens generated so far, ahead of new requests, in the
        order they arrived. In-flight steps are forgotten."""
        self.inflight.clear()
        self.pending_free.clear()
        self.kv.take_evictions()
        self.kv.forget_fetches()
        self.prefill.forget()  # (a rebuilt pipeline's frames cost what they cost there)
        live = sorted(
            (s for s in self.seqs.values() if s.phase in (Phase.PREFILL, Phase.RUNNING)),
            key=lambda s: s.seq_id,
        )
        self.prefilling = []
        self.groups = [[] for _ in range(self.config.num_groups)]
        self.speculator.reset(live)
        for seq in reversed(live):
            seq.phase = Phase.WAITING
            seq.feed = seq.prompt + seq.generated
            seq.sent, seq.group, seq.known, seq.stored, seq.reuse, seq.fetching = 0, None, False, 0, [], False
            seq.overtaken = 0
            self.waiting.appendleft(seq)
        return live

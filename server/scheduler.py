"""What goes into the pipeline next: pure logic, no I/O, no MLX.

The engine feeds it requests (``add``, ``cancel``) and results (``on_result``)
and asks it for the frames to send (``schedule``). It keeps every sequence's
truth: its prompt, the tokens generated so far, where it is in the pipeline.

Rules:

- Prefill is chunked (token-level pipelining, as in TeraPipe): all but the
  last token of the prompt go in chunks of at most ``chunk_size``, sent back
  to back without waiting for results, so stage 1 works on chunk k while stage
  0 works on chunk k+1. A short prefill (a new turn after a cached prefix) is
  cut into about two chunks per stage (never under ``min_chunk``) so that every
  stage works on it at once. The last token goes alone and is sampled, exactly as mlx-lm's
  ``generate_step`` does it. At most ``max_prefill_inflight`` prefill frames
  are in flight, in arrival order (no starvation).
- Decoding sequences live in ``num_groups`` micro-batch groups. Each group has
  at most one frame in flight; while stage i runs group g, stage i+1 runs group
  g-1. A sequence whose first token arrives joins the smallest group at that
  group's next step; one that finishes or is cancelled leaves, and its caches
  are freed on every stage by the ``free`` list of the next frame.
- Prefix cache (when ``prefix_blocks`` > 0): a sequence starts after the
  longest run of its first blocks that every stage holds (``PrefixIndex``);
  its first frame names them (``reuse``). Each later frame of a sequence tells
  the stages to keep the blocks it completed before that frame (``store``), and
  the first frame of a round carries the blocks to drop (``evict``). Cached
  blocks count against the KV budget; live sequences win: admission evicts
  least recently used blocks before it would refuse. Where stages have state
  caches (``snapshot_every`` > 0), a sequence can start only after a block
  whose end state they keep: a frame that starts exactly at a block's end asks
  for it (``snap``) every ``snapshot_every`` blocks and at the last block of a
  prompt, and prefill chunks end at block boundaries so that such frames exist.
- Speculative decoding (when ``speculate``): while few sequences are live (at
  most ``spec_max_running``, waiting and prefilling ones included, so the
  groups alone would leave stages idle and no prompt waits behind drafts), a
  sequence that has a guess of what comes next leaves its group and sends
  VERIFY frames instead. Guesses come from its drafter, by its ``speculation``:
  prompt lookup (``draft.PromptLookup``), a draft model the head runs
  (``draft_model.ModelDrafter``), or lookup first and the model where lookup
  has nothing; a drafter answers at once, so no frame waits for a draft. A
  VERIFY frame carries its last token and the drafted tokens after it,
  ``spec_positions`` per frame, up to ``spec_depth`` (or its own
  ``max_drafts``) positions beyond its confirmed tokens in flight, in at most
  ``spec_frames`` frames. The last stage samples
  after every position exactly as a decode step would (same history, same
  random key), so the head takes a position's sample as the next token only
  while every draft before it matched what was sampled; at the first mismatch
  the sampled token still counts, the rest is discarded (results of frames
  already in flight are stale) and the next frame trims it from the stages.
  Greedy and seeded output is therefore exactly what plain decoding gives.
  The depth follows the acceptance (halved on a miss, one more after as many
  drafts in a row matched); a sequence whose drafts keep failing decodes in its group
  again for a while. A sequence with a grammar never speculates: its grammar
  would have to take back rejected drafts on the last stage. Nor does one
  while a stage cannot take drafts back (``max_rewind`` 0), and drafts in
  flight never exceed what every stage can take back.
- A sequence with a grammar ends when the last stage says its grammar is
  complete (``TokenResult.done``); replayed, its first frame names the tokens
  it generated, so the last stage's grammar advances past them again.
- Queues are bounded: ``add`` raises ``QueueFull`` instead of growing.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, FrozenSet, Iterable, List, Optional, Set, Tuple

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.server.draft import Drafter, PromptLookup
from mlxpipe.server.prefix import PrefixIndex, chain_hashes


class QueueFull(RuntimeError):
    """The server holds as many requests as it may; try again later."""


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    RUNNING = "running"
    DONE = "done"


@dataclass
class Sequence:
    seq_id: int
    prompt: List[int]
    max_tokens: int
    sampling: pb.SamplingParams
    eos: FrozenSet[int] = frozenset()
    max_context: int = 1 << 30
    generated: List[int] = field(default_factory=list)
    phase: Phase = Phase.WAITING
    sent: int = 0                  # tokens of `feed` sent as prefill
    feed: List[int] = field(default_factory=list)  # what prefill pushes (prompt, or prompt + generated on replay)
    group: Optional[int] = None
    known: bool = False            # stages may hold caches for it
    finish_reason: Optional[str] = None
    hashes: List[int] = field(default_factory=list)  # keys of its first blocks (prefix cache)
    stored: int = 0                # its first blocks the stages keep, or are told to
    reuse: List[int] = field(default_factory=list)   # the cached blocks its prefill starts after
    cached_tokens: Optional[int] = None  # prompt tokens reused at its first admission (reported in usage)
    spec: Optional["Spec"] = None  # speculative decoding state, once it may speculate
    speculation: str = "auto"      # what it drafts from (``draft.SOURCES``); "none": never speculates
    max_drafts: Optional[int] = None  # drafted positions in flight, at most (None: the scheduler's spec_depth)
    faults: int = 0                # pipeline faults a stage blamed on a frame of this sequence
    error: Optional[str] = None    # why it ended, when it failed (finish_reason "error")

    @property
    def tokens(self) -> List[int]:
        return self.prompt + self.generated

    @property
    def reserve(self) -> int:
        """KV positions this sequence may come to hold on every stage."""
        return min(len(self.prompt) + self.max_tokens, self.max_context)

    @property
    def cached(self) -> int:
        """Tokens the stages hold (or will, once in-flight frames land) for it."""
        return len(self.prompt) + len(self.generated) - 1 if self.phase == Phase.RUNNING else self.sent


@dataclass
class Flight:
    kind: int
    seq_ids: List[int]
    group: Optional[int] = None
    epoch: int = 0  # VERIFY: the speculation epoch it was sent in (a rejection makes older ones stale)


@dataclass
class Spec:
    """A sequence's speculative decoding. Its confirmed tokens are its prompt and
    what it generated; the stages hold their positions but the last (C = tokens - 1).
    ``fed`` positions after those are in flight: the last token, then guesses."""

    depth: int                      # positions beyond the confirmed it may have in flight
    cap: int                        # ... at most, however well its drafts do
    drafter: Drafter
    solo: bool = False              # verifying drafts, out of its group
    fed: int = 0                    # positions C, C+1, ... sent and not yet judged
    guesses: List[int] = field(default_factory=list)  # drafted tokens for positions C+1, C+2, ...
    epoch: int = 0
    trim: int = 0                   # positions the stages hold beyond the confirmed: the next frame drops them
    inflight: int = 0               # its VERIFY frames in flight
    judged: int = 0                 # drafted tokens judged since the last reset, and how many matched
    matched: int = 0
    streak: int = 0                 # drafts matched since the last miss or depth increase
    cooldown: int = 0               # decode steps in its group before it may speculate again


@dataclass
class SchedulerConfig:
    num_groups: int = 2            # micro-batch groups in flight (default: one per stage)
    max_batch: int = 32            # sequences per group
    chunk_size: int = 256          # prefill tokens per frame, at most
    min_chunk: int = 16            # smallest chunk a short prefill is cut into
    max_prefill_inflight: int = 2  # prefill frames in flight (default: one per stage)
    max_running: Optional[int] = None  # sequences holding caches (default: num_groups x max_batch)
    max_waiting: int = 256         # requests queued before QueueFull
    max_kv_tokens: int = 1 << 62   # KV-cache positions all admitted sequences and cached blocks may take
    block_tokens: int = 16         # positions per prefix-cache block
    prefix_blocks: int = 0         # blocks every stage may keep for the prefix cache (0: no prefix cache)
    speculate: bool = False        # verify drafted tokens (prompt lookup) while few sequences are live
    spec_max_running: int = 2      # ... at most this many (default: the stages)
    spec_positions: int = 1        # positions per VERIFY frame (1 where extra rows cost in proportion)
    spec_depth: int = 8            # positions beyond the confirmed in flight, at most (adapted per sequence)
    spec_frames: int = 2           # VERIFY frames in flight per sequence, at most (default: the stages; a frame
                                   # more would only queue at stage 0, and be lost on a miss)


@dataclass
class DraftStats:
    """Drafted tokens the last stage judged since start, and how many it accepted."""

    judged: int = 0
    accepted: int = 0

    def as_dict(self) -> dict:
        return {"drafted_tokens": self.judged, "accepted_tokens": self.accepted,
                "acceptance": round(self.accepted / self.judged, 4) if self.judged else None}


@dataclass
class TokenEvent:
    seq: Sequence
    token: int
    logprob: float
    top: Optional[Tuple[List[int], List[float]]]
    finished: bool
    error: Optional[str] = None  # the sequence failed (``token`` means nothing): ``seq.error`` says why


MAX_FAULTS = 2  # pipeline faults blamed on one sequence's frames before it is failed instead of replayed


class Scheduler:
    def __init__(self, config: SchedulerConfig, drafters: Optional[Callable[[Sequence], Drafter]] = None):
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
        self.max_kv_tokens = config.max_kv_tokens  # changes when the pipeline is rebuilt (``resize``)
        self.seqs: Dict[int, Sequence] = {}
        self.waiting: Deque[Sequence] = deque()
        self.prefilling: List[Sequence] = []
        self.groups: List[List[int]] = [[] for _ in range(config.num_groups)]
        self.solo: List[int] = []  # sequences verifying drafts instead of decoding in a group
        self.drafts = DraftStats()
        self.drafters = drafters or (lambda seq: PromptLookup())  # a sequence's drafter (its ``speculation``)
        self.inflight: Dict[int, Flight] = {}
        self.pending_free: List[int] = []
        self.prefix = PrefixIndex(config.block_tokens, config.prefix_blocks, 0) if config.prefix_blocks else None
        self.pending_evict: List[int] = []
        self._keep_this_round: Set[int] = set()  # blocks this round's frames reuse or store: not evicted now
        self._room = 0                            # blocks the KV budget leaves for the cache this round
        self.snapshot_every = 0  # blocks between state snapshots the stages keep (0: no stage has state caches)
        self.max_rewind = 1 << 30  # drafted positions every stage can take back (0: no speculation)
        self._frame_ids = itertools.count(1)

    def resize(self, max_kv_tokens: int) -> None:
        """A rebuilt pipeline holds a different number of KV positions."""
        self.max_kv_tokens = max_kv_tokens

    def reset_prefix(self, held: List[Iterable[int]], capacity: int, starts=None, snapshot_every: int = 0) -> None:
        """What each stage of a (re)built pipeline holds, and the blocks it may hold;
        ``starts``: per stage with state caches, the held blocks it can start after
        (None for a stage without); ``snapshot_every``: see the module docstring."""
        self.snapshot_every = snapshot_every
        if self.prefix is not None:
            self.pending_evict = self.prefix.reset(held, capacity, starts)

    # -- requests -------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests already waiting")
        seq.feed = list(seq.prompt)
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def cancel(self, seq_id: int, reason: str = "cancelled") -> None:
        seq = self.seqs.get(seq_id)
        if seq is not None and seq.phase != Phase.DONE:
            self._finish(seq, reason)

    def _chunk(self, seq: Sequence) -> int:
        """Tokens per prefill frame for ``seq``: about two chunks per stage in flight."""
        cfg = self.config
        todo = len(seq.feed) - 1 - len(seq.reuse) * cfg.block_tokens
        return min(cfg.chunk_size, max(cfg.min_chunk, -(-todo // (2 * cfg.max_prefill_inflight))))

    def _chunk_at(self, seq: Sequence, body: int) -> int:
        """The next prefill chunk's tokens; where stages have state caches it ends at a
        block boundary (and at the body's last one), so that the next frame can ask
        for the state there (``_snaps``)."""
        n = min(self._chunk(seq), body - seq.sent)
        b = self.config.block_tokens
        if not self.snapshot_every or self.prefix is None:
            return n
        end, last = seq.sent + n, body // b * b
        if end < body and end - end % b > seq.sent:
            end -= end % b
        if seq.sent < last < end:
            end = last
        return end - seq.sent

    def _penalty_context(self, seq: Sequence) -> List[int]:
        """For a sequence that starts after cached blocks: the reused tokens its
        sampling penalties look back at (the last stage never saw them)."""
        p = seq.sampling
        if not seq.reuse or not (p.repetition_penalty not in (0, 1) or p.presence_penalty or p.frequency_penalty):
            return []
        back = max(p.repetition_context_size or 20, p.penalty_context_size or 20)
        return seq.feed[max(seq.sent - back, 0) : seq.sent]

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.phase == Phase.WAITING:
            self.waiting.remove(seq)
        elif seq.phase == Phase.PREFILL:
            self.prefilling.remove(seq)
        elif seq.group is not None:
            self.groups[seq.group].remove(seq.seq_id)
            seq.group = None
        elif seq.spec is not None and seq.spec.solo:
            self.solo.remove(seq.seq_id)
            seq.spec.solo = False
        if seq.spec is not None:
            seq.spec.drafter.close()
        seq.phase = Phase.DONE
        seq.finish_reason = reason
        if seq.known:
            self.pending_free.append(seq.seq_id)
        del self.seqs[seq.seq_id]

    @property
    def live(self) -> int:
        return len(self.seqs)

    @property
    def idle(self) -> bool:
        return not self.seqs and not self.inflight and not self.pending_free and not self.pending_evict

    # -- scheduling -----------------------------------------------------------

    def schedule(self) -> List[pb.Frame]:
        """The frames to send now, in order."""
        frames: List[pb.Frame] = []
        self._keep_this_round.clear()
        self._admit()
        if self.prefix is not None:  # blocks that fit beside what live sequences may grow to
            self._room = (self.max_kv_tokens - self.kv_reserved) // self.config.block_tokens
        frames += self._verify_frames()  # may send a sequence back to a group...
        frames += self._decode_frames()  # ... or take one out of its group...
        frames += self._verify_frames()  # ... which then verifies at once
        frames += self._prefill_frames()
        if self.pending_free or self.pending_evict:
            if not frames:
                frames.append(self._frame(pb.Frame.CONTROL, [], []))
            # Stages apply these before the frame's work; blocks this round's
            # frames reuse or store were kept out of the evictions.
            frames[0].free.extend(self.pending_free)
            frames[0].evict.extend(self.pending_evict)
            self.pending_free.clear()
            self.pending_evict.clear()
        return frames

    @property
    def kv_reserved(self) -> int:
        """KV positions admitted sequences may grow to: prompt plus token budget each."""
        return sum(s.reserve for s in self.seqs.values() if s.phase in (Phase.PREFILL, Phase.RUNNING))

    @property
    def decoding(self) -> int:
        """Sequences past their prefill: in groups, or verifying drafts."""
        return sum(len(g) for g in self.groups) + len(self.solo)

    def _admit(self) -> None:
        holding = len(self.prefilling) + self.decoding
        reserved = self.kv_reserved
        while self.waiting and holding < self.max_running:
            seq = self.waiting[0]
            hit = self._cached_prefix(seq)
            if self.prefix is not None:  # live sequences win: drop cached blocks before refusing
                over = reserved + seq.reserve + self.prefix.tokens - self.max_kv_tokens
                if over > 0:
                    self.pending_evict += self.prefix.evict(-(-over // self.config.block_tokens),
                                                            self._keep_this_round | set(hit))
            cached = self.prefix.tokens if self.prefix is not None else 0
            if reserved + seq.reserve + cached > self.max_kv_tokens and holding:
                break  # wait for KV memory to free up (FIFO: nobody overtakes)
            self.waiting.popleft()
            seq.phase = Phase.PREFILL
            seq.reuse, seq.stored = hit, len(hit)
            seq.sent = len(hit) * self.config.block_tokens
            if seq.cached_tokens is None:
                seq.cached_tokens = seq.sent
            if self.prefix is not None:
                self.prefix.touch(hit)
                self._keep_this_round.update(hit)
            self.prefilling.append(seq)
            if self._may_speculate(seq):  # a draft model starts on the prompt now
                self._spec(seq).drafter.prepare(seq.feed)
            holding += 1
            reserved += seq.reserve

    def _cached_prefix(self, seq: Sequence) -> List[int]:
        """The keys of the cached blocks ``seq`` may start after: all its first blocks
        that every stage holds, leaving at least its last token to compute."""
        if self.prefix is None:
            return []
        usable = (len(seq.feed) - 1) // self.config.block_tokens
        chain_hashes(seq.tokens, self.config.block_tokens, seq.hashes, usable)
        return seq.hashes[: self.prefix.match(seq.hashes[:usable])]

    def _store(self, seq: Sequence, entry: pb.SeqEntry) -> None:
        """Tell the stages to keep the blocks ``seq`` completed before this frame."""
        if self.prefix is None:
            return
        # Only confirmed positions: a verify frame's offset may lie past drafted ones.
        upto = min(entry.offset, len(seq.prompt) + len(seq.generated) - 1) // self.config.block_tokens
        if upto <= seq.stored:
            return
        keys = chain_hashes(seq.tokens, self.config.block_tokens, seq.hashes, upto)[seq.stored : upto]
        snap = self._snaps(seq, entry, upto)
        kept = self.prefix.add(keys, self._keep_this_round, self.pending_evict, self._room,
                               start=keys[-1] if snap else None)
        if kept:
            entry.store_first = seq.stored
            entry.store.extend(keys[:kept])
            entry.snap = snap and kept == len(keys)
            self._keep_this_round.update(keys[:kept])
        seq.stored = upto  # blocks that did not fit are not asked again

    def _snaps(self, seq: Sequence, entry: pb.SeqEntry, upto: int) -> bool:
        """Whether stages with state caches keep the state at the end of block ``upto``
        - 1 (they are exactly there: it ends at the frame's offset)."""
        every = self.snapshot_every
        if not every or upto * self.config.block_tokens != entry.offset:
            return False
        return upto % every == 0 or upto == (len(seq.feed) - 1) // self.config.block_tokens

    def _frame(self, kind: int, seq_ids: List[int], entries, group: Optional[int] = None, tokens=()) -> pb.Frame:
        fid = next(self._frame_ids)
        self.inflight[fid] = Flight(kind, seq_ids, group)
        return pb.Frame(frame_id=fid, kind=kind, group=group or 0, seqs=entries, tokens=list(tokens))

    def _decode_frames(self) -> List[pb.Frame]:
        frames = []
        busy_groups = {f.group for f in self.inflight.values() if f.kind == pb.Frame.DECODE}
        for g, members in enumerate(self.groups):
            if not members or g in busy_groups:
                continue
            for sid in list(members):
                if self._start_speculating(self.seqs[sid]):
                    members.remove(sid)
            if not members:
                continue
            seqs = [self.seqs[s] for s in members]
            entries = [
                pb.SeqEntry(seq_id=s.seq_id, offset=s.cached, num_tokens=1, sample=True) for s in seqs
            ]
            for s, e in zip(seqs, entries):
                if s.spec is not None and s.spec.trim:  # back from speculating: drop its rejected drafts
                    e.trim, s.spec.trim = s.spec.trim, 0
                self._store(s, e)
            tokens = [s.generated[-1] for s in seqs]
            frames.append(self._frame(pb.Frame.DECODE, list(members), entries, g, tokens))
        return frames

    def _prefill_frames(self) -> List[pb.Frame]:
        frames = []
        inflight = sum(1 for f in self.inflight.values() if f.kind == pb.Frame.PREFILL)
        for seq in list(self.prefilling):
            while inflight < self.config.max_prefill_inflight and seq.sent < len(seq.feed):
                body = len(seq.feed) - 1  # all but the last token go in chunks
                if seq.sent < body:
                    n, sample = self._chunk_at(seq, body), False
                else:
                    n, sample = 1, True
                entry = pb.SeqEntry(seq_id=seq.seq_id, offset=seq.sent, num_tokens=n, sample=sample)
                if not seq.known:  # its first frame
                    entry.sampling.CopyFrom(seq.sampling)
                    entry.reuse.extend(seq.reuse)
                    entry.context.extend(self._penalty_context(seq))
                    if seq.sampling.grammar:
                        entry.generated.extend(seq.generated)
                else:
                    self._store(seq, entry)
                tokens = seq.feed[seq.sent : seq.sent + n]
                frames.append(self._frame(pb.Frame.PREFILL, [seq.seq_id], [entry], tokens=tokens))
                seq.sent += n
                seq.known = True
                inflight += 1
            if inflight >= self.config.max_prefill_inflight:
                break
        return frames


    # -- speculative decoding ---------------------------------------------------

    def _may_speculate(self, seq: Sequence) -> bool:
        cfg = self.config
        return (cfg.speculate and seq.speculation != "none" and seq.max_drafts != 0 and not seq.sampling.grammar
                and self.max_rewind > 0 and self.live <= cfg.spec_max_running)

    def _spec(self, seq: Sequence) -> Spec:
        if seq.spec is None:
            # A miss takes back at most `cap` positions: no more than every stage can.
            cap = min(self.config.spec_depth, seq.max_drafts or self.config.spec_depth, self.max_rewind)
            seq.spec = Spec(depth=cap, cap=cap, drafter=self.drafters(seq))
        return seq.spec

    def _start_speculating(self, seq: Sequence) -> bool:
        """Whether a grouped sequence leaves its group to verify drafts now."""
        if not self._may_speculate(seq):
            return False
        spec = self._spec(seq)
        if spec.cooldown:
            spec.cooldown -= 1
            return False
        if not self._draft(seq, 1):
            return False
        spec.solo = True
        seq.group = None
        self.solo.append(seq.seq_id)
        return True

    def _draft(self, seq: Sequence, need: int) -> bool:
        """Make sure ``need`` guesses exist after the confirmed tokens."""
        spec = seq.spec
        if len(spec.guesses) < need:
            tokens = seq.tokens
            more = spec.drafter.propose(tokens + spec.guesses, need - len(spec.guesses), confirmed=len(tokens))
            spec.guesses += more
        return len(spec.guesses) >= need

    def _stop_speculating(self, seq: Sequence) -> None:
        """Back to decoding in a group (its first decode frame trims what the stages
        hold beyond the confirmed tokens)."""
        seq.spec.solo = False
        seq.spec.guesses.clear()
        self.solo.remove(seq.seq_id)
        self._join_group(seq)

    def _verify_frames(self) -> List[pb.Frame]:
        cfg = self.config
        frames = []
        for sid in list(self.solo):
            seq = self.seqs[sid]
            spec = seq.spec
            if spec.inflight == 0 and (self.live > cfg.spec_max_running or not self._draft(seq, 1)):
                self._stop_speculating(seq)  # the pipeline fills up, or nothing to guess
                continue
            while spec.fed < spec.depth + 1 and spec.inflight < cfg.spec_frames:
                # Inputs for positions C + fed, ...: the last token, then guesses.
                n = min(cfg.spec_positions, spec.depth + 1 - spec.fed)
                if spec.fed + n - 1 > len(spec.guesses):
                    self._draft(seq, spec.fed + n - 1)
                    n = min(n, len(spec.guesses) + 1 - spec.fed)
                if n < 1:
                    break  # nothing more to guess: wait for what is in flight
                inputs = ([seq.tokens[-1]] if spec.fed == 0 else []) + spec.guesses[max(spec.fed - 1, 0) : spec.fed + n - 1]
                entry = pb.SeqEntry(seq_id=sid, offset=seq.cached + spec.fed, num_tokens=n, sample=True,
                                    trim=spec.trim)
                spec.trim = 0
                self._store(seq, entry)
                frames.append(self._frame(pb.Frame.VERIFY, [sid], [entry], tokens=inputs))
                self.inflight[frames[-1].frame_id].epoch = spec.epoch
                spec.fed += n
                spec.inflight += 1
        return frames

    def _judge(self, seq: Sequence, flight: Flight, results: List[pb.TokenResult]) -> List[pb.TokenResult]:
        """The samples of a VERIFY frame that become tokens: each, while every draft
        before it matched; at the first mismatch the rest is void."""
        spec = seq.spec
        spec.inflight -= 1
        if flight.epoch != spec.epoch:
            return []  # sent before a rejection: about positions that no longer exist
        taken = []
        for t in results:
            taken.append(t)
            spec.fed -= 1  # position C is confirmed now; C moves on by one
            if not spec.fed:
                if spec.guesses and spec.guesses[0] == t.token:
                    spec.guesses.pop(0)  # guessed but not yet sent: keep the rest of the guess
                else:
                    spec.guesses.clear()
                continue
            guess = spec.guesses.pop(0)  # the input already sent at the next position
            spec.judged += 1
            self.drafts.judged += 1
            if guess == t.token:
                spec.matched += 1
                self.drafts.accepted += 1
                spec.streak += 1
                if spec.streak >= spec.depth and spec.depth < spec.cap:
                    spec.depth, spec.streak = spec.depth + 1, 0
                continue
            # A miss: what the stages hold after the confirmed tokens is void.
            spec.trim, spec.fed = spec.trim + spec.fed, 0
            spec.guesses.clear()
            spec.epoch += 1
            spec.depth, spec.streak = max(1, spec.depth // 2), 0
            break
        if spec.judged >= 16:  # drafts that keep failing cost more than they save: pause
            if spec.matched < spec.judged // 4:
                spec.cooldown = 32
            spec.judged = spec.matched = 0
        return taken

    # -- results --------------------------------------------------------------

    def on_result(self, result: pb.Result) -> List[TokenEvent]:
        """Take one Result; return the tokens it gave live sequences."""
        flight = self.inflight.pop(result.frame_id, None)
        if flight is None:
            return []
        events = []
        for t in result.tokens:  # a sequence its stage failed: it ends here, alone
            if t.error and t.seq_id in self.seqs:
                events.append(self._fail(self.seqs[t.seq_id], f"the last stage could not go on: {t.error}"))
        if flight.kind == pb.Frame.VERIFY:
            seq = self.seqs.get(flight.seq_ids[0])
            if seq is None:  # finished or cancelled while the frame was in flight
                return events
            for t in self._judge(seq, flight, list(result.tokens)):
                events.append(self._take(seq, t))
                if seq.phase == Phase.DONE:
                    break
            return events
        by_id = {t.seq_id: t for t in result.tokens}
        for sid in flight.seq_ids:
            seq = self.seqs.get(sid)
            if seq is None:  # finished or cancelled while the frame was in flight
                continue
            t = by_id.get(sid)
            if t is None:
                continue
            events.append(self._take(seq, t))
        return events

    def _fail(self, seq: Sequence, why: str) -> TokenEvent:
        """End ``seq`` with an error: its request gets ``why``; nothing else changes."""
        seq.error = why
        self._finish(seq, "error")
        return TokenEvent(seq, -1, 0.0, None, True, why)

    def _take(self, seq: Sequence, t: pb.TokenResult) -> TokenEvent:
        """A sampled token becomes the sequence's next."""
        seq.generated.append(t.token)
        if seq.phase == Phase.PREFILL:
            self.prefilling.remove(seq)
            seq.phase = Phase.RUNNING
            self._join_group(seq)
        top = (list(t.top_ids), list(t.top_logprobs)) if t.top_ids else None
        reason = None
        if t.token in seq.eos or t.done:
            reason = "stop"
        elif len(seq.generated) >= seq.max_tokens or len(seq.prompt) + len(seq.generated) >= seq.max_context:
            reason = "length"
        if reason:
            self._finish(seq, reason)
        return TokenEvent(seq, t.token, t.logprob, top, reason is not None)

    def _join_group(self, seq: Sequence) -> None:
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

    def replay_all(self) -> List[Sequence]:
        """The pipeline lost its state: every live sequence starts over from its
        prompt plus the tokens generated so far, ahead of new requests, in the
        order they arrived. In-flight frames are forgotten."""
        self.inflight.clear()
        self.pending_free.clear()
        self.pending_evict.clear()
        live = sorted(
            (s for s in self.seqs.values() if s.phase in (Phase.PREFILL, Phase.RUNNING)),
            key=lambda s: s.seq_id,
        )
        self.prefilling = []
        self.groups = [[] for _ in range(self.config.num_groups)]
        self.solo = []
        for seq in reversed(live):
            if seq.spec is not None:
                seq.spec.drafter.close()
            seq.spec = None  # the stages hold nothing of it now
            seq.phase = Phase.WAITING
            seq.feed = seq.prompt + seq.generated
            seq.sent, seq.group, seq.known, seq.stored, seq.reuse = 0, None, False, 0, []
            self.waiting.appendleft(seq)
        return live

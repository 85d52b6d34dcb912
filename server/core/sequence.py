"""A sequence as the head keeps it, and what the scheduler says about it. Pure data.

The head owns every sequence's truth (its prompt, the tokens generated so
far, its sampling); the stages hold only caches rebuilt from it. A request
with ``n`` choices is ``n`` sequences.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import FrozenSet, List, Optional, Tuple

from mlxpipe.server.core.drafting import DEFAULT_SPECULATION, Drafter
from mlxpipe.server.core.media import Media
from mlxpipe.shards.params.sampling import Sampling


class QueueFull(RuntimeError):
    """The server holds as many requests as it may; try again later."""


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    RUNNING = "running"
    DONE = "done"


@dataclass
class SpeculationState:
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
    trim: int = 0                   # positions the stages hold beyond the confirmed: the next step drops them
    inflight: int = 0               # its VERIFY steps in flight
    judged: int = 0                 # drafted tokens judged since the last reset, and how many matched
    matched: int = 0
    streak: int = 0                 # drafts matched since the last miss or depth increase
    cooldown: int = 0               # decode steps in its group before it may speculate again
    pause: int = 0                  # ... after the next trial that does not pay (doubles each time)
    since: Optional[float] = None   # when its current trial of speculation began (clock seconds)
    got: int = 0                    # tokens confirmed since then


@dataclass
class Seq:
    """One sequence: its truth, and where it is in the pipeline."""

    seq_id: int
    prompt: List[int]
    max_tokens: int
    sampling: Sampling
    eos: FrozenSet[int] = frozenset()
    max_context: int = 1 << 30
    generated: List[int] = field(default_factory=list)
    phase: Phase = Phase.WAITING
    sent: int = 0                  # tokens of `feed` sent as prefill
    overtaken: int = 0             # prefill steps others took ahead of it in a row, while the oldest waiting
    feed: List[int] = field(default_factory=list)  # what prefill pushes (prompt, or prompt + generated on replay)
    group: Optional[int] = None
    known: bool = False            # stages may hold caches for it
    finish_reason: Optional[str] = None
    hashes: List[int] = field(default_factory=list)  # keys of its first blocks (prefix cache)
    salt: bytes = b""              # its prefix-cache keys' salt (tenant, cache_salt: prefix_index.chain_root)
    stored: int = 0                # its first blocks the stages keep, or are told to
    reuse: List[int] = field(default_factory=list)   # the cached blocks its prefill starts after
    cached_tokens: Optional[int] = None  # prompt tokens reused at its first admission (reported in usage)
    disk_tokens: Optional[int] = None    # ... of which some stage read back from its disk (None: not known yet)
    fetching: bool = False         # admitted, its first step waits for stages to read blocks back from disk
    spec_state: Optional[SpeculationState] = None  # speculative decoding (speculation.py), once it may
    speculation: str = DEFAULT_SPECULATION  # what it drafts from (``drafting.SOURCES``); "none": never speculates
    max_drafts: Optional[int] = None  # drafted positions in flight, at most (None: the scheduler's spec_depth)
    priority: int = 0              # its class: 0 interactive, 1 batch (``priority.py``)
    pool: int = 0                  # an embedding request: the last stage pools its final hidden state (1 mean,
                                   # 2 last position) and it ends after its prompt (``max_tokens`` 0)
    faults: int = 0                # pipeline faults a stage blamed on a frame of this sequence
    error: Optional[str] = None    # why it ended, when it failed (finish_reason "error")
    kv_at: Optional[int] = None    # with KV quantization: where its caches turn quantized (shards/params/kv.py)
    media: Optional[Media] = None  # a vision model's prompt: its images' rows and positions (media.py)

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
class TokenEvent:
    """A token a result gave a sequence (or, with ``error``, the sequence's failure)."""

    seq: Seq
    token: int
    logprob: float
    top: Optional[Tuple[List[int], List[float]]]
    finished: bool
    error: Optional[str] = None  # the sequence failed (``token`` means nothing): ``seq.error`` says why
    embedding: Optional[List[float]] = None  # a pooled sequence's vector (``Seq.pool``)

"""What the scheduler decides and what comes back, in the head's own terms. Pure data.

``Scheduler.schedule`` returns ``Step``s (which sequences, which tokens, which
blocks to reuse, store or evict, which drafts to verify); ``frames.py`` alone
turns them into ``pb.Frame``s and the last stage's ``pb.Result``s into
``StepResult``s, which ``Scheduler.on_result`` takes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from mlxpipe.shards.params.sampling import Sampling


class StepKind(enum.Enum):
    PREFILL = "prefill"   # one sequence, positions of its prompt (the last one sampled)
    DECODE = "decode"     # a group: one position per sequence, each sampled
    VERIFY = "verify"     # one sequence: its last token and drafts, every position sampled
    CONTROL = "control"   # nothing to run: only frees and evictions


@dataclass
class Opening:
    """What a sequence's first step tells the stages about it."""

    sampling: Sampling
    reuse: List[int]        # the cached blocks it starts after
    context: List[int]      # reused tokens its penalties look back at (the last stage never saw them)
    generated: List[int]    # with a grammar, on a replay: tokens the grammar must advance past
    store_first: int = 0    # of ``reuse``, the first some stage read back from disk, and the keys from there
    store: List[int] = field(default_factory=list)  # that the stages keep in memory now
    kv_at: int = 0          # with KV quantization: where its caches turn quantized (0: never)
    pool: int = 0           # an embedding request's pooling (``Seq.pool``; 0: none)


@dataclass
class Entry:
    """One sequence's part of a step: positions ``[offset, offset + num_tokens)``."""

    seq_id: int
    offset: int
    num_tokens: int
    sample: bool
    trim: int = 0           # positions the stages drop first (rejected drafts)
    store_first: int = 0    # with ``store``: the index of the first block to keep
    store: List[int] = field(default_factory=list)  # keys of blocks the stages keep after this step
    snap: bool = False      # with ``store``: stages with state caches keep the state at the last one's end
    spill: List[int] = field(default_factory=list)  # blocks after ``store``'s to write to disk only
    opening: Optional[Opening] = None  # set on its first step


@dataclass
class Step:
    step_id: int
    kind: StepKind
    entries: List[Entry]
    tokens: List[int] = field(default_factory=list)
    group: int = 0
    free: List[int] = field(default_factory=list)   # sequences the stages free first
    evict: List[int] = field(default_factory=list)  # cached blocks the stages drop first (from memory)
    discard: List[int] = field(default_factory=list)  # ... and from their disk tier too


@dataclass
class Sample:
    """A token the last stage chose for a sequence (or why it could not)."""

    seq_id: int
    token: int
    logprob: float = 0.0
    top: Optional[Tuple[List[int], List[float]]] = None
    done: bool = False      # its grammar is complete
    error: str = ""         # the sequence failed on the stage: it ends here, alone
    embedding: Optional[List[float]] = None  # a pooled sequence's vector


@dataclass
class PromptScores:
    """Prompt positions of a sequence the last stage scored (``Sampling.prompt_logprobs``)."""

    seq_id: int
    start: int                   # the position of logprobs[0]
    logprobs: List[float]
    top: List[Tuple[List[int], List[float]]] = field(default_factory=list)  # per position, when asked


@dataclass
class StepResult:
    step_id: int
    samples: List[Sample]
    stage_s: List[float] = field(default_factory=list)  # seconds the frame held each stage (its StageTiming's
                                                        # decode, compute and encode), in pipeline order

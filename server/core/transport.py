"""What the engine needs of a pipeline: frames in, results out, health. The gRPC
stage client (``cluster/stage_client.py``) is the one implementation; the engine
knows only this protocol."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, List, Optional, Protocol, Sequence, Tuple


class PipelineError(RuntimeError):
    """The pipeline cannot take or finish work; the message says where and why.
    ``suspects`` lists the addresses of the stages at fault, when known;
    ``culprits`` the sequences whose frame a stage failed on, when one says so."""

    def __init__(self, message: str, suspects: Sequence[str] = (), culprits: Sequence[int] = ()):
        super().__init__(message)
        self.suspects = list(suspects)
        self.culprits = list(culprits)


class StageView(Protocol):
    """One stage as the head places it: where it runs and which layers ``[start, end)``."""

    address: str
    start: int
    end: int


# (stage, its Health reply or None, why not): what ``Transport.health`` answers per stage.
# A reply has ``state`` ("ready", ...) and ``detail``; the API reads its figures.
StageHealth = Tuple[StageView, Optional[Any], str]


@dataclass
class StageCaches:
    """What one stage said of its caches when it loaded (its Load reply)."""

    blocks: List[int]            # the prefix-cache blocks it holds
    starts: Optional[List[int]]  # with state caches: those of ``blocks`` a sequence can start after (else None)
    kv_bytes_per_token: int
    state_bytes: int             # one sequence's state caches (0: none)
    max_rewind: int              # drafted positions it can take back (0: none)
    kv_full_bytes_per_token: int = 0  # quantizing its KV cache: a token before its sequence's switch point
                                      # (``kv_bytes_per_token``: after); 0: it does not quantize
    disk_blocks: List[int] = field(default_factory=list)  # the blocks its disk tier holds, least recently used first
    disk_starts: List[int] = field(default_factory=list)  # ... of those, the ones stored with their end state
    digests: Dict[str, str] = field(default_factory=dict)  # what it computes with: unit -> SHA-256 of its tensors
                                                           # as loaded, and of the config (LoadReply.unit_digests)


class Transport(Protocol):
    stages: List[StageView]
    budget: Any  # where frames' time goes: ``.kinds``, kind -> ``core/budget.KindTotals``

    async def open(self) -> None:
        """Open the streams; frames may be sent from now on."""

    def send(self, frame) -> None:
        """Queue a frame for stage 0; frames go out in the order sent."""

    def results(self) -> AsyncIterator[Any]:
        """Results from the last stage, until the pipeline breaks (PipelineError)."""

    async def watch_forward(self) -> None:
        """Return never; raise PipelineError when the stream into stage 0 ends."""

    async def health(self, timeout: float) -> List[StageHealth]:
        """Every stage's health, asked at once."""

    async def fetch(self, seq_id: int, keys: Sequence[Sequence[int]]) -> List[Tuple[List[int], List[int]]]:
        """Have each stage read ``keys[i]`` back from its disk for a sequence's first frame;
        per stage, (keys read, keys it could not). A stage that does not answer read none."""

    def caches(self) -> List[StageCaches]:
        """What each stage reported of its caches when it loaded."""

    async def close(self) -> None:
        """Close the streams and channels."""

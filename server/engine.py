"""Generation on a pipeline: token ids in, token streams out. Knows nothing of HTTP
or text; ``textgen.py`` turns its streams into text.

The engine runs on the event loop and owns the ``Scheduler``. Every change
(a request, a cancel, a result) is followed by ``_pump``: ask the scheduler
for frames and queue them for stage 0. A reader task takes the last stage's
Results and hands each token to its request's queue.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.server.pipeline import Pipeline, PipelineError
from mlxpipe.server.scheduler import Scheduler, SchedulerConfig, Sequence as Seq, TokenEvent

logger = logging.getLogger(__name__)


@dataclass
class Token:
    """One generated token as a request sees it."""

    id: int
    logprob: float
    top: Optional[Tuple[List[int], List[float]]]
    finish_reason: Optional[str]  # "stop", "length", or None while generating


class GenerationFailed(RuntimeError):
    """The pipeline could not finish this request; the message says why."""


class RequestStream:
    """The tokens of one request, as an async iterator. ``cancel()`` ends it and
    frees its caches on every stage."""

    def __init__(self, engine: "Engine", seq_id: int, prompt_tokens: int):
        self.engine = engine
        self.seq_id = seq_id
        self.prompt_tokens = prompt_tokens
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False
        self.submitted = time.monotonic()
        self.first_token_at: Optional[float] = None

    def __aiter__(self):
        return self

    async def __anext__(self) -> Token:
        if self.done:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, Exception):
            self.done = True
            raise item
        if item.finish_reason is not None:
            self.done = True
        return item

    def cancel(self) -> None:
        if not self.done:
            self.done = True
            self.engine.cancel(self.seq_id)


@dataclass
class EngineStats:
    requests: int = 0
    tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    # Per-stage compute seconds, summed over every frame's Result.
    stage_seconds: List[float] = field(default_factory=list)


class Engine:
    def __init__(self, pipeline: Pipeline, config: SchedulerConfig,
                 eos_token_ids: Sequence[int] = (), max_context: int = 1 << 30):
        self.pipeline = pipeline
        self.scheduler = Scheduler(config)
        self.eos = frozenset(eos_token_ids)
        self.max_context = max_context
        self.streams: Dict[int, RequestStream] = {}
        self.stats = EngineStats(stage_seconds=[0.0] * len(pipeline.stages))
        self.failure: Optional[str] = None
        self._ids = itertools.count(1)
        self._reader: Optional[asyncio.Task] = None
        self._idle = asyncio.Event()
        self._idle.set()

    async def start(self) -> None:
        await self.pipeline.open()
        self._reader = asyncio.ensure_future(self._read())

    async def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        await self.pipeline.close()

    def submit(self, prompt: Sequence[int], max_tokens: int,
               sampling: Optional[pb.SamplingParams] = None, stop_at_eos: bool = True) -> RequestStream:
        """Queue a request. Raises ``QueueFull`` when the server is at capacity,
        ``GenerationFailed`` when the pipeline is down."""
        if self.failure:
            raise GenerationFailed(self.failure)
        if not prompt:
            raise ValueError("the prompt is empty")
        sampling = pb.SamplingParams() if sampling is None else sampling
        if not sampling.has_seed:
            # Unseeded requests still get a seed, chosen here, so a request
            # replayed after a failure draws the same tokens again.
            sampling.seed = int.from_bytes(os.urandom(8), "little")
        seq_id = next(self._ids)
        seq = Seq(seq_id=seq_id, prompt=list(prompt), max_tokens=max_tokens, sampling=sampling,
                  eos=self.eos if stop_at_eos else frozenset(), max_context=self.max_context)
        self.scheduler.add(seq)
        stream = RequestStream(self, seq_id, len(prompt))
        self.streams[seq_id] = stream
        self.stats.requests += 1
        self._pump()
        return stream

    def cancel(self, seq_id: int) -> None:
        self.streams.pop(seq_id, None)
        self.scheduler.cancel(seq_id)
        self._pump()

    def _pump(self) -> None:
        if self.failure:
            return
        for frame in self.scheduler.schedule():
            self.pipeline.send(frame)
        if self.scheduler.idle:
            self._idle.set()
        else:
            self._idle.clear()

    async def drain(self) -> None:
        """Wait until no request is live and every stage has freed their caches."""
        await self._idle.wait()

    def _deliver(self, events: List[TokenEvent]) -> None:
        now = time.monotonic()
        for ev in events:
            stream = self.streams.get(ev.seq.seq_id)
            if stream is None:
                continue
            if stream.first_token_at is None:
                stream.first_token_at = now
            reason = ev.seq.finish_reason if ev.finished else None
            stream.queue.put_nowait(Token(ev.token, ev.logprob, ev.top, reason))
            self.stats.tokens += 1
            if ev.finished:
                del self.streams[ev.seq.seq_id]

    async def _read(self) -> None:
        try:
            async for result in self.pipeline.results():
                for i, s in enumerate(result.stage_seconds[: len(self.stats.stage_seconds)]):
                    self.stats.stage_seconds[i] += s
                self._deliver(self.scheduler.on_result(result))
                self._pump()
        except PipelineError as err:
            self._fail(str(err))
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - never leave requests hanging
            logger.exception("engine reader failed")
            self._fail(f"{type(err).__name__}: {err}")

    def _fail(self, why: str) -> None:
        logger.error("pipeline failed: %s", why)
        self.failure = why
        self._idle.set()
        for seq_id, stream in list(self.streams.items()):
            stream.queue.put_nowait(GenerationFailed(f"pipeline failed: {why}"))
            self.scheduler.cancel(seq_id)
        self.streams.clear()


async def collect(stream: RequestStream) -> List[Token]:
    """All tokens of a request."""
    return [t async for t in stream]

"""Generation on a pipeline: token ids in, token streams out. Knows nothing of HTTP,
of text (``api/textgen.py`` turns its streams into text) or of gRPC: it drives a
``Transport`` (``transport.py``), and ``frames.py`` speaks the wire for it.

The engine runs on the event loop and owns the ``Scheduler``. Every change
(a request, a cancel, a result) is followed by ``_pump``: ask the scheduler for frames and
queue them for stage 0, and have stages read back prefix blocks they hold on disk only
(``_fetch``). Its supervisor (``supervision.py``) runs the pipeline: the last stage's
Results are handed to each request's queue (``read_results``), the stages' health is
watched, and the pipeline is rebuilt when it breaks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Protocol, Sequence

from mlxpipe.server.core.drafting import DEFAULT_SPECULATION, SOURCES, Drafter, Either, PromptLookup
from mlxpipe.server.core.frames import Framer, prompt_scores
from mlxpipe.server.core.media import Media
from mlxpipe.server.core.plan import PromptScores
from mlxpipe.server.core.prefix_index import model_salt, snapshot_every
from mlxpipe.server.core.scheduler import Scheduler, SchedulerConfig
from mlxpipe.server.core.sequence import Seq, TokenEvent
from mlxpipe.server.core.streams import GenerationFailed, InvalidRequest, RequestStream, SequenceFailed, Token
from mlxpipe.server.core.supervision import Rebuild, Rebuilt, Supervision, Supervisor
from mlxpipe.server.core.tracing import RequestTrace
from mlxpipe.server.core.transport import StageHealth, Transport
from mlxpipe.shards.params.sampling import INT32, Sampling

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    recoveries: int = 0  # pipelines rebuilt after a fault
    generated_tokens: int = 0  # tokens delivered to requests since start (the page's tok/s chart)


class Observer(Protocol):
    """Told as tokens arrive (e.g. ``metrics.Metrics``)."""

    def first_token(self, seconds: float) -> None: ...

    def cached_prompt(self, memory_tokens: int, disk_tokens: int) -> None: ...

    def token(self, since_previous: Optional[float]) -> None: ...


class Engine:
    """Runs generation over a pipeline; its ``Supervisor`` (``supervision.py``) keeps the
    pipeline running and rebuilds it with ``rebuild`` when it breaks (clients see a pause).
    Only when no pipeline can be rebuilt do live requests end, with ``GenerationFailed``."""

    def __init__(self, pipeline: Transport, config: SchedulerConfig,
                 eos_token_ids: Sequence[int] = (), max_context: int = 1 << 30,
                 rebuild: Optional[Rebuild] = None, supervision: Optional[Supervision] = None,
                 observer: Optional[Observer] = None, draft_model=None, vocab_size: int = INT32):
        self.pipeline = pipeline  # the one owner: only the supervisor replaces it, after a rebuild
        self.draft_model = draft_model  # draft_model.DraftModel, or None
        self.scheduler = Scheduler(config, drafters=self._drafter, costs=self.frame_budget)
        self.framer = Framer(self.scheduler)  # the scheduler's steps as frames, results back as events
        self.eos = frozenset(eos_token_ids)
        self.model_context = max_context  # the model's context (or --context): what a request may hold at most
        self.context_source = "the model's maximum"  # what set model_context, in words
        self.vocab_size = vocab_size  # sampling parameters are checked against it (top_k, logit_bias)
        self.supervisor = Supervisor(self, rebuild, supervision or Supervision())
        self.streams: Dict[int, RequestStream] = {}
        self.stats = EngineStats()
        self.observer = observer
        self.state = "ready"              # "ready", "recovering" or "failed"
        self.failure: Optional[str] = None  # why, while not ready
        self._ids = itertools.count(1)
        self._supervising: Optional[asyncio.Task] = None
        self._idle = asyncio.Event()
        self._idle.set()
        self.stopping = False  # shutting down: a broken stream now is no fault to recover from
        self._fetches: set = set()  # tasks having stages read prefix blocks back from disk

    def _drafter(self, seq: Seq) -> Drafter:
        """A sequence's drafter, as its request asked ("auto": lookup, then the draft model)."""
        if self.draft_model is None or seq.speculation == "prompt_lookup":
            return PromptLookup()
        if seq.speculation == "draft_model":
            return self.draft_model.drafter()
        return Either(PromptLookup(), self.draft_model.drafter())

    def check_speculation(self, speculation: str) -> None:
        """Raise InvalidRequest unless this engine can draft from ``speculation``."""
        if speculation not in SOURCES:
            raise InvalidRequest(f"speculation must be one of {', '.join(SOURCES)}, not {speculation!r}",
                                 "speculation")
        if speculation == "draft_model" and self.draft_model is None:
            raise InvalidRequest("this server has no draft model (start it with --draft-model)", "speculation")

    def speculation(self) -> dict:
        """Drafted and accepted tokens since start, and the draft model's work."""
        out = self.scheduler.drafts.as_dict()
        if self.draft_model is not None:
            out["draft_model"] = self.draft_model.as_dict()
        return out

    @property
    def live(self) -> int:
        """Requests waiting or generating."""
        return self.scheduler.live

    @property
    def recoveries(self) -> int:
        """Pipelines rebuilt after a fault."""
        return self.stats.recoveries

    @property
    def drafts(self):
        """Drafted tokens judged and accepted since start (``DraftStats``)."""
        return self.scheduler.drafts

    @property
    def generated_tokens(self) -> int:
        """Tokens delivered to requests since start."""
        return self.stats.generated_tokens

    def frame_budget(self) -> dict:
        """Where the running pipeline's frames spent their time: kind -> ``budget.KindTotals``
        (they restart with a rebuilt pipeline)."""
        budget = getattr(self.pipeline, "budget", None)
        return budget.kinds if budget is not None else {}

    async def health(self, timeout: float = 10.0) -> List[StageHealth]:
        """Every stage of the running pipeline: (stage, Health reply or None, why not)."""
        return await self.pipeline.health(timeout=timeout)

    async def start(self) -> None:
        if self.draft_model is not None:  # drafts are ready: schedule again
            self.draft_model.bind(asyncio.get_running_loop(), self._pump)
        self._held_blocks(self.scheduler.config.prefix_blocks, self.scheduler.config.prefix_disk_blocks)
        await self.pipeline.open()
        self._supervising = asyncio.ensure_future(self.supervisor.run())

    def _held_blocks(self, capacity: int, disk_capacity: int = 0) -> None:
        """Tell the scheduler what the stages' Load replies say of their caches: prefix blocks in memory and
        on disk (those they can start after), snapshots' spacing, positions they can take back, KV bits."""
        caches = self.pipeline.caches()
        every = snapshot_every(self.scheduler.config.block_tokens,
                               [(c.kv_bytes_per_token, c.state_bytes) for c in caches])
        self.scheduler.reset_prefix([c.blocks for c in caches], capacity, [c.starts for c in caches], every,
                                    [c.disk_blocks for c in caches], disk_capacity)
        self.scheduler.kv.set_model(model_salt(c.digests for c in caches), self.scheduler.seqs.values())
        self.scheduler.max_rewind = min(c.max_rewind for c in caches)
        quantizing = [c for c in caches if c.kv_full_bytes_per_token]  # their KV caches, as asked
        self.scheduler.set_kv(bool(quantizing), max((c.kv_full_bytes_per_token / max(c.kv_bytes_per_token, 1)
                                                     for c in quantizing), default=1.0))

    def shut_down(self, why: str = "the server is shutting down") -> None:
        """Stop taking work: every live request ends now with ``why`` (an error event
        in a stream), and nothing that breaks from here on is recovered."""
        self.stopping = True
        self.state, self.failure = "stopping", why
        for seq_id, stream in list(self.streams.items()):
            stream.queue.put_nowait(GenerationFailed(why))
            self.scheduler.cancel(seq_id)
        self.streams.clear()
        self.framer.tracing.clear()

    async def stop(self) -> None:
        self.stopping = True
        await self._cancel_fetches()
        if self._supervising is not None:
            self._supervising.cancel()
            await asyncio.gather(self._supervising, return_exceptions=True)
        if self.draft_model is not None:
            self.draft_model.close()
        await self.pipeline.close()

    def submit(self, prompt: Sequence[int], max_tokens: int,
               sampling: Sampling = Sampling(), stop_at_eos: bool = True,
               speculation: str = DEFAULT_SPECULATION, max_drafts: Optional[int] = None,
               cache_salt: bytes = b"", media: Optional[Media] = None, trace: Optional[RequestTrace] = None,
               priority: int = 0, pool: int = 0) -> RequestStream:
        """Queue a request. ``speculation``: what to draft from (``drafting.SOURCES``),
        ``max_drafts``: drafted positions in flight at most (0: none), ``cache_salt``: its
        prefix-cache keys' salt (it reuses only blocks of requests with the same), ``media``:
        its prompt's images (a vision model's: ``media.py``), ``trace``: where its frames' spans go
        (``tracing.py``; None: not traced), ``priority``: its class (``priority.py``: 0 interactive,
        1 batch), ``pool``: an embedding request (``Seq.pool``, with ``max_tokens`` 0: its stream
        ends with ``embedding`` set). ``sampling`` is
        checked here, the head's one check of it (the last stage checks what
        arrives on the wire). Raises ``InvalidRequest`` or ``SamplingError`` (both
        ValueErrors naming the ``param``) for what cannot be served, ``QueueFull``
        when the server is at capacity, ``GenerationFailed`` when the pipeline is
        down. While it recovers, requests queue and wait."""
        if self.state in ("failed", "stopping"):
            raise GenerationFailed(self.failure)
        if not prompt:
            raise InvalidRequest("the prompt is empty", "prompt")
        sampling.validate(self.vocab_size)
        self.check_speculation(speculation)
        if sampling.seed is None:
            # Unseeded requests still get a seed, chosen here, so a request
            # replayed after a failure draws the same tokens again.
            sampling = replace(sampling, seed=int.from_bytes(os.urandom(8), "little"))
        seq_id = next(self._ids)
        if len(prompt) >= self.max_context:
            raise InvalidRequest(f"the prompt is {len(prompt)} tokens; this server's context is {self.max_context} "
                                 f"tokens, prompt and reply ({self.context_limit()})", "prompt")
        seq = Seq(seq_id=seq_id, prompt=list(prompt), max_tokens=max_tokens, sampling=sampling,
                  eos=self.eos if stop_at_eos else frozenset(), max_context=self.max_context,
                  speculation=speculation, max_drafts=max_drafts, salt=cache_salt, media=media, priority=priority,
                  pool=pool)
        need = self.scheduler.kv.need(seq)  # positions before its KV switch count at full precision
        if need > self.scheduler.max_kv_tokens:
            raise InvalidRequest(f"this request needs {need} KV-cache positions; the pipeline's stages "
                                 f"have room for {self.scheduler.max_kv_tokens}", "max_tokens")
        self.scheduler.add(seq)
        stream = RequestStream(self, seq_id, prompt if sampling.prompt_logprobs else ())
        self.streams[seq_id] = stream
        if trace is not None:
            self.framer.tracing.traces[seq_id] = trace
        self._pump()
        stream.cached_tokens = seq.cached_tokens or 0  # known once admitted (now, unless it waits)
        return stream

    async def _fetch(self, fetch) -> None:
        """Have the stages read a sequence's blocks back from disk; its first frame goes after."""
        try:
            results = await self.pipeline.fetch(fetch.seq_id, fetch.keys)
        except Exception:  # noqa: BLE001 - nothing read: the sequence computes it all, it never waits on
            logger.exception("reading prefix blocks back from the stages' disks")
            results = [([], []) for _ in fetch.keys]
        if not self.stopping:
            self.scheduler.fetched(fetch, results)
            self._pump()

    async def _cancel_fetches(self) -> None:
        """The pipeline they read from is gone (the scheduler voids their answers anyway)."""
        for task in list(self._fetches):
            task.cancel()
        await asyncio.gather(*self._fetches, return_exceptions=True)

    @property
    def max_context(self) -> int:
        """The served context: tokens one request may hold, prompt and reply. The model's
        (or ``--context``), within what the stages' KV cache holds for one request."""
        return min(self.model_context, self.scheduler.kv.longest())

    @property
    def kv_tokens(self) -> int:
        """KV positions all requests together may hold (and wait for)."""
        return self.scheduler.max_kv_tokens

    def context_limit(self) -> str:
        """What sets the served context, in words."""
        if self.scheduler.kv.longest() < self.model_context:
            return f"what the stages' KV cache holds for one request; {self.context_source} is {self.model_context}"
        return self.context_source

    def cancel(self, seq_id: int) -> None:
        self.streams.pop(seq_id, None)
        self.framer.tracing.forget(seq_id)
        self.scheduler.cancel(seq_id)
        self._pump()

    def _pump(self) -> None:
        if self.state == "ready":
            for frame in self.framer.schedule():
                self.pipeline.send(frame)
            for fetch in self.scheduler.take_fetches():  # (a task each, until it is answered)
                task = asyncio.ensure_future(self._fetch(fetch))
                self._fetches.add(task)
                task.add_done_callback(self._fetches.discard)
        if self.scheduler.idle or self.state == "failed":
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
            if ev.error is not None:
                stream.queue.put_nowait(SequenceFailed(ev.error))
                del self.streams[ev.seq.seq_id]
                self.framer.tracing.forget(ev.seq.seq_id)
                continue
            if stream.first_token_at is None:
                stream.first_token_at = now
                stream.cached_tokens = ev.seq.cached_tokens or 0
                disk = stream.cached_disk_tokens = ev.seq.disk_tokens or 0
                trace = self.framer.tracing.traces.get(ev.seq.seq_id)
                if trace is not None:  # cache hits, on the request's span
                    trace.attrs.update({"prefix_cache.cached_tokens": stream.cached_tokens,
                                        "prefix_cache.disk_tokens": disk, "prompt_tokens": len(ev.seq.prompt)})
                if self.observer is not None:
                    self.observer.first_token(now - stream.submitted)
                    self.observer.cached_prompt(stream.cached_tokens - disk, disk)
            if self.observer is not None:
                self.observer.token(None if stream.last_token_at is None else now - stream.last_token_at)
            stream.last_token_at = now
            reason = ev.seq.finish_reason if ev.finished else None
            if ev.token < 0:  # it only scored (or pooled) its prompt (max_tokens 0): no token of its own
                stream.embedding = ev.embedding
                stream.end(reason)
                del self.streams[ev.seq.seq_id]
                self.framer.tracing.forget(ev.seq.seq_id)
                continue
            self.stats.generated_tokens += 1
            stream.queue.put_nowait(Token(ev.token, ev.logprob, ev.top, reason))
            if ev.finished:
                del self.streams[ev.seq.seq_id]
                self.framer.tracing.forget(ev.seq.seq_id)

    def _scored(self, scores: List[PromptScores]) -> None:
        for s in scores:
            stream = self.streams.get(s.seq_id)
            if stream is not None:
                stream.scored(s.start, s.logprobs, s.top)

    async def read_results(self) -> None:
        """Hand every result of the last stage to its request, until the stream ends."""
        async for result in self.pipeline.results():
            self._scored(prompt_scores(result))  # a prompt's last scores come with its first token: first
            self._deliver(self.framer.on_result(result))
            self._pump()

    # -- what the supervisor does to the engine (``supervision.py``) ------------------------

    async def request_replan(self, why: str, timeout: float = 300.0) -> None:
        """Rebuild the pipeline over the cluster's current nodes (live sequences pause and
        replay); returns when the new pipeline runs."""
        await self.supervisor.request_replan(why, timeout)

    def fail_culprits(self, culprits: Sequence[int], why: str) -> None:
        """End the sequences a stage named as the cause of its failure (never replayed)."""
        self._deliver(self.scheduler.fail_culprits(culprits, why))

    async def pause(self) -> List[Seq]:
        """The pipeline broke: close it; every live sequence will be replayed (returned)."""
        await self._cancel_fetches()
        await self.pipeline.close()
        return self.scheduler.replay_all()

    async def swap_pipeline(self, rebuilt: Rebuilt) -> None:
        """Run on ``rebuilt``'s pipeline from now on: its KV budget and what its stages hold."""
        self.pipeline = rebuilt.pipeline
        self._deliver(self.scheduler.resize(rebuilt.max_kv_tokens))
        self._held_blocks(rebuilt.prefix_blocks, rebuilt.disk_blocks)
        await self.pipeline.open()

    def resume(self) -> None:
        self._pump()

    def fail(self, why: str) -> None:
        """No pipeline: every live request ends with a clear error, never a hang."""
        logger.error("pipeline failed: %s", why)
        self.state, self.failure = "failed", why
        for seq_id, stream in list(self.streams.items()):
            stream.queue.put_nowait(GenerationFailed(f"pipeline failed: {why}"))
            self.scheduler.cancel(seq_id)
        self.streams.clear()
        self.framer.tracing.clear()
        self.scheduler.replay_all()  # forget what the dead pipeline held
        self._pump()

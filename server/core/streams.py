"""A request's tokens as the engine hands them out, and how a request can fail."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple


class InvalidRequest(ValueError):
    """What a request asks cannot be served; ``param`` names what (the API's 400 says so)."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


@dataclass
class Token:
    """One generated token as a request sees it."""

    id: int
    logprob: float
    top: Optional[Tuple[List[int], List[float]]]
    finish_reason: Optional[str]  # "stop", "length", or None while generating


class GenerationFailed(RuntimeError):
    """The pipeline could not finish this request; the message says why."""


class SequenceFailed(RuntimeError):
    """This request, and only it, failed on a stage because of what it asked (its
    grammar, its sampling); the message says why. It is never replayed."""


class RequestStream:
    """The tokens of one request, as an async iterator. ``cancel()`` ends it and
    frees its caches on every stage."""

    def __init__(self, engine, seq_id: int, scored_prompt: Sequence[int] = ()):
        self.engine = engine
        self.seq_id = seq_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False
        self.finish_reason: Optional[str] = None  # set when it ends without a token of its own (``end``)
        # With ``Sampling.prompt_logprobs``: a Token per prompt position, as the last stage scores them
        # (all are in when the first generated token comes; position 0 has none, as OpenAI's echo).
        self.prompt: List[Optional[Token]] = [None] * len(scored_prompt)
        self._prompt_ids = list(scored_prompt)
        self.submitted = time.monotonic()
        self.first_token_at: Optional[float] = None
        self.last_token_at: Optional[float] = None
        self.cached_tokens = 0  # prompt tokens its prefill took from the prefix cache
        self.cached_disk_tokens = 0  # ... of which some stage read back from its disk
        self.embedding: Optional[List[float]] = None  # an embedding request's vector (``Engine.submit(pool=)``)

    def __aiter__(self):
        return self

    async def __anext__(self) -> Token:
        if self.done and self.queue.empty():
            raise StopAsyncIteration
        item = await self.queue.get()
        if item is None:  # cancelled
            raise StopAsyncIteration
        if isinstance(item, Exception):
            self.done = True
            raise item
        if item.finish_reason is not None:
            self.done = True
        return item

    def scored(self, start: int, logprobs: List[float], top: List[Tuple[List[int], List[float]]]) -> None:
        """Prompt positions ``start``, ``start + 1``, ... scored (a replay scores them, and the
        tokens it generated, again: the same values; positions past the prompt are not kept)."""
        for i, lp in enumerate(logprobs[: max(len(self.prompt) - start, 0)]):
            self.prompt[start + i] = Token(self._prompt_ids[start + i], lp, top[i] if top else None, None)

    def end(self, reason: str) -> None:
        """It ended with no token of its own (a prompt scored only)."""
        self.finish_reason, self.done = reason, True
        self.queue.put_nowait(None)

    def cancel(self) -> None:
        if not self.done:
            self.done = True
            self.queue.put_nowait(None)  # wakes a consumer waiting for the next token
            self.engine.cancel(self.seq_id)




async def collect(stream: RequestStream) -> List[Token]:
    """All tokens of a request."""
    return [t async for t in stream]

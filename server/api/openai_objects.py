"""One request's ``n`` token streams as OpenAI objects: the fan-in of the
streams, their text, log-probabilities, choices and usage, whole or as
server-sent events. Knows OpenAI's shapes, nothing of HTTP: ``api.py`` routes
requests here and sends what comes back.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator, Callable, List, Tuple

from mlxpipe.server.api.chat_template import Delta, Reply
from mlxpipe.server.core.streams import GenerationFailed, RequestStream, SequenceFailed
from mlxpipe.server.api.textgen import TextChunk, stream_text


class Generation:
    """One request's n streams, their text, and their usage."""

    def __init__(self, tokenizer, prompt_tokens: int, streams: List[RequestStream], stops: List[str]):
        self.tokenizer = tokenizer
        self.prompt_tokens = prompt_tokens
        self.streams = streams
        self.stops = stops
        self.completion_tokens = 0

    def cancel(self) -> None:
        for s in self.streams:
            s.cancel()

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.streams[0].cached_tokens}}

    async def chunks(self) -> AsyncIterator[Tuple[int, TextChunk]]:
        """(choice index, chunk) from all n streams, as they come; the streams are
        cancelled when this ends, however it ends."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream):
            try:
                async for c in stream_text(self.tokenizer, stream, self.stops):
                    await queue.put((i, c))
            except Exception as err:  # noqa: BLE001 - handed to the consumer
                await queue.put((i, err))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            open_ = len(tasks)
            while open_:
                i, item = await queue.get()
                if item is None:
                    open_ -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    self.completion_tokens += len(item.tokens)
                    yield i, item
        finally:
            self.cancel()
            for t in tasks:
                t.cancel()

    async def collect(self) -> List[List[TextChunk]]:
        """Every chunk of every choice."""
        out: List[List[TextChunk]] = [[] for _ in self.streams]
        async for i, c in self.chunks():
            out[i].append(c)
        return out


def _finish(chunks: List[TextChunk]) -> str:
    return chunks[-1].finish_reason if chunks else "stop"


class _Format:
    """What chat and text completions share: ids, the tokenizer for logprobs."""

    def __init__(self, tokenizer, model: str, prefix: str):
        self.tok = tokenizer
        self.base = {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}

    def token_text(self, token_id: int) -> str:
        return self.tok.decode([token_id])

    def token_logprob(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def opening(self, n: int) -> List[dict]:
        """Events a stream starts with, before any text."""
        return []

    def usage_event(self, usage: dict) -> dict:
        return self.base | {"object": self.chunk_object, "choices": [], "usage": usage}


class ChatFormat(_Format):
    """``/v1/chat/completions``: ``chat.completion`` objects and their chunks; each
    choice's text split into content, reasoning and tool calls by its ``Reply``."""

    chunk_object = "chat.completion.chunk"

    def __init__(self, tokenizer, model: str, logprobs: bool, replies: List[Reply]):
        super().__init__(tokenizer, model, "chatcmpl")
        self.logprobs = logprobs
        self.replies = replies

    def _logprobs(self, chunk: TextChunk) -> List[dict]:
        content = []
        for t in chunk.tokens:
            top = [self.token_logprob(i, lp) for i, lp in zip(*t.top)] if t.top else []
            content.append(self.token_logprob(t.id, t.logprob) | {"top_logprobs": top})
        return content

    def opening(self, n: int) -> List[dict]:
        return [self.base | {"object": self.chunk_object,
                             "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]} for i in range(n)]

    @staticmethod
    def _message(d: Delta) -> dict:
        m = {"content": d.content} if d.content else {}
        if d.reasoning:
            m["reasoning_content"] = d.reasoning
        if d.tool_calls:
            m["tool_calls"] = d.tool_calls
        return m

    def chunk(self, i: int, c: TextChunk) -> dict:
        reply = self.replies[i]
        return self.base | {"object": self.chunk_object, "choices": [{
            "index": i, "delta": self._message(reply.feed(c.text, c.finish_reason is not None)),
            "logprobs": {"content": self._logprobs(c)} if self.logprobs else None,
            "finish_reason": reply.finish_reason(c.finish_reason)}]}

    def response(self, out: List[List[TextChunk]], usage: dict) -> dict:
        choices = []
        for i, cs in enumerate(out):
            reply = self.replies[i]
            message = {"role": "assistant", "content": None} | self._message(reply.feed("".join(c.text for c in cs), True))
            if not message["content"] and "tool_calls" not in message:
                message["content"] = ""
            choices.append({
                "index": i, "message": message,
                "logprobs": {"content": [e for c in cs for e in self._logprobs(c)]} if self.logprobs else None,
                "finish_reason": reply.finish_reason(_finish(cs))})
        return self.base | {"object": "chat.completion", "choices": choices, "usage": usage}


class TextFormat(_Format):
    """``/v1/completions``: ``text_completion`` objects, whole or streamed."""

    chunk_object = "text_completion"

    def __init__(self, tokenizer, model: str, logprobs: bool, n: int):
        super().__init__(tokenizer, model, "cmpl")
        self.logprobs = logprobs
        self.offsets = [0] * n  # characters streamed so far, per choice (for text_offset)

    def _logprobs(self, chunk: TextChunk, offset: int) -> dict:
        """A chunk's logprobs; ``offset``: the characters of the choice before it."""
        texts = [self.token_text(t.id) for t in chunk.tokens]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": texts, "token_logprobs": [t.logprob for t in chunk.tokens],
                "top_logprobs": [{self.token_text(i): lp for i, lp in zip(*t.top)} if t.top else None
                                 for t in chunk.tokens],
                "text_offset": offsets}

    def chunk(self, i: int, c: TextChunk) -> dict:
        lp = self._logprobs(c, self.offsets[i]) if self.logprobs else None
        self.offsets[i] += len(c.text)
        return self.base | {"object": self.chunk_object, "choices": [
            {"index": i, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}]}

    def response(self, out: List[List[TextChunk]], usage: dict) -> dict:
        choices = []
        for i, cs in enumerate(out):
            lp = None
            if self.logprobs:
                parts, offset = [], 0
                for c in cs:
                    parts.append(self._logprobs(c, offset))
                    offset += len(c.text)
                lp = {k: [x for p in parts for x in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs",
                                                                    "text_offset")}
            choices.append({"index": i, "text": "".join(c.text for c in cs), "logprobs": lp,
                            "finish_reason": _finish(cs)})
        return self.base | {"object": self.chunk_object, "choices": choices, "usage": usage}


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def events(gen: Generation, fmt: _Format, include_usage: bool,
                 error_event: Callable[[Exception], dict]) -> AsyncIterator[str]:
    """Server-sent events: the opening, one event per chunk, an error event if the
    pipeline or this request fails (and then no more), the usage chunk when asked, ``[DONE]``."""
    for obj in fmt.opening(len(gen.streams)):
        yield sse(obj)
    try:
        async for i, c in gen.chunks():
            yield sse(fmt.chunk(i, c))
    except (GenerationFailed, SequenceFailed) as err:
        yield sse(error_event(err))
        return
    if include_usage:
        yield sse(fmt.usage_event(gen.usage()))
    yield "data: [DONE]\n\n"


"""OpenAI's response objects: ``chat.completion`` and ``text_completion``, whole or as
server-sent events, with log-probabilities and usage, made from ``generation.py``'s
choices and events; ``respond`` sends them (``openai_chat.py`` and
``openai_completions.py`` translate the requests).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator, Callable, List, Optional, Tuple

from fastapi import Request
from fastapi.responses import StreamingResponse

from mlxpipe.server.api.chat_template import Delta
from mlxpipe.server.api.generation import SSE_HEADERS, Choice, Event, Generation, Usage
from mlxpipe.server.api.textgen import TextChunk
from mlxpipe.server.core.streams import GenerationFailed, SequenceFailed, Token


def usage(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            "completion_tokens_details": predictions(u),  # drafted tokens accepted and rejected
            "cached_tokens_by_tier": u.by_tier(),  # (ours: which prefix-cache tier served them)
            "speculation": speculation(u)}  # (ours: drafts per source, and their acceptance)


def predictions(u: Usage) -> dict:
    """OpenAI's ``completion_tokens_details``: drafted tokens accepted and rejected (speculation)."""
    judged = sum(j for j, _ in u.drafts.values())
    accepted = sum(a for _, a in u.drafts.values())
    return {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": judged - accepted}


def speculation(u: Usage) -> dict:
    """Our own usage field: drafted tokens judged and accepted, per source (prompt_lookup, mtp, ...)."""
    return {source: {"drafted_tokens": j, "accepted_tokens": a, "acceptance": round(a / j, 4) if j else None}
            for source, (j, a) in sorted(u.drafts.items())}


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

    def usage_event(self, u: Usage) -> dict:
        return self.base | {"object": self.chunk_object, "choices": [], "usage": usage(u)}


class ChatFormat(_Format):
    """``/v1/chat/completions``: ``chat.completion`` objects and their chunks; each
    choice's text split into content, reasoning and tool calls."""

    chunk_object = "chat.completion.chunk"

    def __init__(self, tokenizer, model: str, logprobs: bool):
        super().__init__(tokenizer, model, "chatcmpl")
        self.logprobs = logprobs

    def _logprobs(self, tokens: List[Token]) -> List[dict]:
        content = []
        for t in tokens:
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

    def chunk(self, ev: Event) -> dict:
        return self.base | {"object": self.chunk_object, "choices": [{
            "index": ev.choice, "delta": self._message(ev.delta),
            "logprobs": {"content": self._logprobs(ev.chunk.tokens)} if self.logprobs else None,
            "finish_reason": ev.finish_reason}]}

    def response(self, out: List[Choice], u: Usage) -> dict:
        choices = []
        for i, c in enumerate(out):
            message = {"role": "assistant", "content": None} | self._message(c.delta)
            if not message["content"] and "tool_calls" not in message:
                message["content"] = ""
            choices.append({
                "index": i, "message": message,
                "logprobs": {"content": self._logprobs(c.tokens)} if self.logprobs else None,
                "finish_reason": c.finish_reason})
        return self.base | {"object": "chat.completion", "choices": choices, "usage": usage(u)}


class TextFormat(_Format):
    """``/v1/completions``: ``text_completion`` objects, whole or streamed; with ``echo``
    (``Generation.echo``: the prompt's text and scored tokens), each choice starts with
    the prompt, whose first token's log-probability is null, as OpenAI's."""

    chunk_object = "text_completion"

    def __init__(self, tokenizer, model: str, logprobs: bool, n: int,
                 echo: Optional[Callable[[], Tuple[str, List[Token]]]] = None):
        super().__init__(tokenizer, model, "cmpl")
        self.logprobs = logprobs
        self.offsets = [0] * n  # characters streamed so far, per choice (for text_offset)
        self.echo = echo
        self.echoed = [echo is None] * n

    def _prompt(self) -> List[TextChunk]:
        """The echoed prompt as a chunk (none without echo)."""
        if self.echo is None:
            return []
        text, tokens = self.echo()
        return [TextChunk(text, tokens)]

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

    def chunk(self, ev: Event) -> dict:
        i, c = ev.choice, ev.chunk
        if not self.echoed[i]:  # a choice's first chunk: the prompt's are all scored by now
            self.echoed[i] = True
            prompt = self._prompt()[0]
            c = TextChunk(prompt.text + c.text, prompt.tokens + c.tokens, c.finish_reason, c.stop)
        lp = self._logprobs(c, self.offsets[i]) if self.logprobs else None
        self.offsets[i] += len(c.text)
        return self.base | {"object": self.chunk_object, "choices": [
            {"index": i, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}]}

    def response(self, out: List[Choice], u: Usage) -> dict:
        choices = []
        for i, choice in enumerate(out):
            chunks, lp = self._prompt() + choice.chunks, None
            if self.logprobs:
                parts, offset = [], 0
                for c in chunks:
                    parts.append(self._logprobs(c, offset))
                    offset += len(c.text)
                lp = {k: [x for p in parts for x in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs",
                                                                    "text_offset")}
            choices.append({"index": i, "text": "".join(c.text for c in chunks), "logprobs": lp,
                            "finish_reason": choice.finish_reason})
        return self.base | {"object": self.chunk_object, "choices": choices, "usage": usage(u)}


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def events(gen: Generation, fmt: _Format, include_usage: bool,
                 error_event: Callable[[Exception], dict]) -> AsyncIterator[str]:
    """Server-sent events: the opening, one event per chunk, an error event if the
    pipeline or this request fails (and then no more), the usage chunk when asked, ``[DONE]``."""
    for obj in fmt.opening(len(gen.streams)):
        yield sse(obj)
    try:
        async for ev in gen.events():
            yield sse(fmt.chunk(ev))
    except (GenerationFailed, SequenceFailed) as err:
        yield sse(error_event(err))
        return
    if include_usage:
        yield sse(fmt.usage_event(gen.usage()))
    yield "data: [DONE]\n\n"


async def respond(request: Request, gen: Generation, fmt: _Format, stream: bool, include_usage: bool):
    """Server-sent events, or the whole response once every choice is done
    (cancelled if the client goes away first)."""
    if stream:
        return StreamingResponse(events(gen, fmt, include_usage, lambda e: gen.generator.error(gen.req, e).body()),
                                 media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    out = await gen.until_done(request)
    return fmt.response(out, gen.usage())

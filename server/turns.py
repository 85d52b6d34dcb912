"""From a validated request to tokens on the engine, whatever protocol it came in.

Every HTTP API translates its body into one internal request form, OpenAI's chat
request (``schemas.ChatCompletionRequest``: messages for the chat template, tools
and tool_choice, response_format, sampling, stop, max_tokens), or a text
completion (``CompletionRequest``), and hands it to ``Turns``. Here, once for
all of them: the prompt through the model's chat template, the grammar the
output must follow (``response_format``, forced tool calls: for a template with
tool-call markers in its own format, for any other as bare JSON, vLLM's way),
the token budget, the submission to the engine. ``ChatTurn.events`` gives the
reply back as protocol-neutral pieces (content, reasoning, complete tool calls,
a finish reason, which stop string ended it), split by ``chat.Reply``; the
protocol modules (``api.py`` for OpenAI chat and completions,
``anthropic_api.py``, ``responses_api.py``, ``ollama_api.py``) only translate.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Dict, List, Optional

from jinja2 import TemplateError

from mlxpipe.server.chat import Delta, ForcedReply, Reply, render, thinks_first
from mlxpipe.server.completions import Generation
from mlxpipe.server.engine import GenerationFailed, SequenceFailed
from mlxpipe.server.errors import ApiError
from mlxpipe.server.scheduler import QueueFull
from mlxpipe.server.schemas import ChatCompletionRequest
from mlxpipe.server.structured import (GrammarError, Grammars, bare_call_grammar, forced_functions,
                                       marked_calls, response_format_grammar, tool_call_grammar)
from mlxpipe.shards.grammar import in_worker
from mlxpipe.shards.sampling import SamplingError


@dataclass
class OutputPlan:
    """What a chat turn's output must follow."""

    grammar: str = ""                              # llguidance grammar ("": free text)
    bare: Optional[List[Dict[str, Any]]] = None    # forced calls written as bare JSON: the functions


@dataclass
class TurnPiece:
    """A piece of one reply as it streams: text, reasoning and complete tool calls
    (OpenAI's shape: id, type, function.name, function.arguments as JSON text);
    ``finish`` on the last ("stop", "length", "tool_calls"), with the stop string
    that ended it, if one did."""

    delta: Delta
    finish: Optional[str] = None
    stop_string: Optional[str] = None
    tokens: int = 0


class ChatTurn:
    """The choices of one chat turn on the engine."""

    def __init__(self, gen: Generation, replies: List[Any]):
        self.gen, self.replies = gen, replies

    async def pieces(self) -> AsyncIterator[TurnPiece]:
        """Choice 0's reply, piece by piece (protocols other than OpenAI's ask for one)."""
        reply = self.replies[0]
        async for _, c in self.gen.chunks():
            final = c.finish_reason is not None
            yield TurnPiece(reply.feed(c.text, final), reply.finish_reason(c.finish_reason), c.stop, len(c.tokens))

    def usage(self) -> dict:
        return self.gen.usage()

    def cancel(self) -> None:
        self.gen.cancel()


class Turns:
    """What every protocol shares: from a validated request to a ``Generation`` on
    the engine (``chat``, ``submit``), and the errors that can come back."""

    def __init__(self, cluster, options):
        self.options = options
        self.engine = cluster.engine
        self.tok = cluster.tokenizer
        self.vocab = cluster.vocab_size
        self.names = {options.model_id, "default", *options.aliases}
        self.retry_after = {"Retry-After": str(options.retry_after_s)}
        self.grammars = Grammars(cluster.tokenizer, self.vocab)

    def check_model(self, name: str) -> None:
        if name not in self.names:
            raise ApiError(404, f"The model '{name}' does not exist; this server serves "
                                f"'{self.options.model_id}'", param="model", code="model_not_found")

    def budget(self, req, prompt_len: int, clamp: bool = False) -> int:
        """The request's token budget, or a 400 saying what to change. ``clamp``: a
        budget past the context becomes what the context leaves (Anthropic's clients
        ask for 32,000 tokens of any model)."""
        options, context = self.options, self.engine.max_context
        if options.max_prompt_tokens and prompt_len > options.max_prompt_tokens:
            raise ApiError(400, f"the prompt is {prompt_len} tokens; this server takes at most "
                                f"{options.max_prompt_tokens}", param="messages", code="prompt_too_long")
        if prompt_len >= context:
            raise ApiError(400, f"This model's maximum context length is {context} tokens. However, your "
                                f"prompt is {prompt_len} tokens. Please shorten it.",
                           param="messages", code="context_length_exceeded")
        limit, asked = options.max_tokens_limit, req.token_budget()
        if asked is None:
            return min(options.default_max_tokens, limit or context, context - prompt_len)
        if clamp:
            return min(asked, limit or context, context - prompt_len)
        if limit and asked > limit:
            raise ApiError(400, f"max_tokens is {asked}; this server allows at most {limit}", param="max_tokens")
        if prompt_len + asked > context:
            raise ApiError(400, f"This model's maximum context length is {context} tokens. However, you "
                                f"requested {prompt_len + asked} tokens ({prompt_len} in the prompt, {asked} "
                                f"for the completion). Please reduce the prompt or max_tokens.",
                           param="max_tokens", code="context_length_exceeded")
        return asked

    def unavailable(self, err: GenerationFailed) -> ApiError:
        return ApiError(503, str(err), type_="server_error", code="pipeline_unavailable", headers=self.retry_after)

    @staticmethod
    def failed(req, err: SequenceFailed) -> ApiError:
        """This request's own failure on a stage (its grammar, its sampling): a 400 naming
        what the request asked; no other request noticed."""
        param = None
        if getattr(req, "response_format", None) is not None:
            param = "response_format"
        if getattr(req, "tool_choice", None) not in (None, "auto", "none"):
            param = "tool_choice"
        return ApiError(400, f"generation failed for this request: {err}", param=param, code="generation_failed")

    def error(self, req, err: Exception) -> ApiError:
        """The ApiError for what ended a generation (a stream's last event)."""
        return self.failed(req, err) if isinstance(err, SequenceFailed) else self.unavailable(err)

    async def encode(self, fn, *args) -> List[int]:
        try:
            return await asyncio.to_thread(fn, *args)
        except (TypeError, ValueError, UnicodeError, TemplateError) as err:  # what the template or tokenizer refuse
            raise ApiError(400, f"the messages could not be rendered and tokenized: {err}", param="messages")

    async def plan(self, req: ChatCompletionRequest) -> OutputPlan:
        """The grammar the request's output must follow, or a 400. Built, compiled and
        checked on the grammar thread (a deep stack, off the event loop)."""
        forced = req.choice() not in (None, "auto", "none")
        param = "tool_choice" if forced else "response_format"

        def build() -> OutputPlan:
            functions = forced_functions(req.tool_dicts() or [], req.choice())
            if functions is None:
                rf = req.response_format.as_dict() if req.response_format else None
                return OutputPlan(self.grammars.check(response_format_grammar(rf)))
            if marked_calls(self.tok):
                return OutputPlan(self.grammars.check(tool_call_grammar(self.tok, functions,
                                                                        req.parallel_tool_calls)))
            grammar = bare_call_grammar(functions, req.parallel_tool_calls)
            return OutputPlan(self.grammars.check(grammar), bare=functions)

        try:
            return await in_worker(build)
        except GrammarError as err:
            raise ApiError(400, f"{param} cannot be enforced: {err}", param=param)

    async def chat(self, req: ChatCompletionRequest, clamp: bool = False) -> ChatTurn:
        """A chat turn on the engine: its messages through the chat template, its
        output planned, its ``n`` choices submitted."""
        tok, tools = self.tok, req.tool_dicts()
        plan = await self.plan(req)
        messages = [m.for_template() for m in req.messages]
        if plan.bare is not None:
            messages = ForcedReply.instruct(messages, plan.bare)
        prompt = await self.encode(render, tok, messages, tools, req.chat_template_kwargs or {})
        gen = self.submit(req, prompt, plan.grammar, clamp)
        if plan.bare is not None:
            replies = [ForcedReply(plan.bare, req.parallel_tool_calls) for _ in range(req.n)]
        else:
            thinking = thinks_first(tok, prompt) and not plan.grammar  # a grammar leaves no room to think
            replies = [Reply(tok, tools, thinking, req.parallel_tool_calls, req.stream) for _ in range(req.n)]
        return ChatTurn(gen, replies)

    def submit(self, req, prompt: List[int], grammar: str = "", clamp: bool = False) -> Generation:
        """The request's n streams on the engine; ``grammar``: what their output must follow."""
        def sampling(choice: int = 0):
            return replace(req.sampling(self.options.default_temperature, choice), grammar=grammar)

        try:  # the last stage's own check, here where it can still be a 400
            sampling().validate(self.vocab)
        except SamplingError as err:
            raise ApiError(400, str(err), param=err.param)
        try:
            self.engine.check_speculation(req.speculation)
        except ValueError as err:
            raise ApiError(400, str(err), param="speculation")
        max_tokens = self.budget(req, len(prompt), clamp)
        streams = []
        try:
            for i in range(req.n):
                streams.append(self.engine.submit(prompt, max_tokens, sampling(i), speculation=req.speculation,
                                                  max_drafts=req.num_draft_tokens))
        except QueueFull as err:
            for s in streams:
                s.cancel()
            raise ApiError(429, f"the server is at capacity ({err}); retry shortly", type_="rate_limit_error",
                           code="server_busy", headers=self.retry_after)
        except GenerationFailed as err:
            raise self.unavailable(err)
        except ValueError as err:  # e.g. more KV cache than the stages hold
            for s in streams:
                s.cancel()
            raise ApiError(400, str(err), param="max_tokens")
        return Generation(self.tok, len(prompt), streams, req.stop_strings())

    async def whole(self, request, req, gen: Generation, work):
        """Await ``work`` (a coroutine collecting ``gen``), cancelling the generation if
        the client goes away first; a failed generation becomes its ApiError."""
        async def watch():
            while not await request.is_disconnected():
                await asyncio.sleep(0.25)

        task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(watch())
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
                gen.cancel()
        if task not in done:
            raise ApiError(499, "client closed the request")
        try:
            return task.result()
        except (GenerationFailed, SequenceFailed) as err:
            raise self.error(req, err)


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def keepalive(items: AsyncIterator, every: float) -> AsyncIterator:
    """``items``, with a None whenever ``every`` seconds pass without one (for the
    keep-alive events of a stream waiting out a long prefill)."""
    it = items.__aiter__()
    nxt = asyncio.ensure_future(it.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({nxt}, timeout=every)
            if not done:
                yield None
                continue
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            yield item
            nxt = asyncio.ensure_future(it.__anext__())
    finally:
        nxt.cancel()
        await asyncio.gather(nxt, return_exceptions=True)
        await it.aclose()

"""From a ``GenerationRequest`` to its running streams, and back as events: what every
protocol shares.

``Generator.start`` renders and tokenizes the prompt (in a worker thread, so a
huge prompt never stalls the event loop), builds and checks the grammar (on the
grammar thread), fixes the token budget, and submits ``n`` streams to the
engine (which checks the sampling parameters). The ``Generation`` it returns
fans the streams in: ``events()`` as they come (text split into content,
reasoning and tool calls as it streams), ``collect()`` whole. Every failure is
an ``ApiError`` saying what to change; no MLX work happens in this process.
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass, field, replace
from functools import partial
from typing import AsyncIterator, Callable, Dict, List, Optional, Sequence, Tuple

from jinja2 import TemplateError

from mlxpipe.server.api.chat_template import Delta, ForcedReply, Prompts, Reply, thinks_first
from mlxpipe.server.api.errors import ApiError
from mlxpipe.server.api.images import ImagePolicy, load_images
from mlxpipe.server.api.options import ApiOptions
from mlxpipe.server.api.quotas import Admission, Quotas
from mlxpipe.server.api.request import GenerationRequest
from mlxpipe.server.api.request_log import attach
from mlxpipe.server.api.structured import (GrammarError, Grammars, bare_call_grammar, forced_functions,
                                           marked_calls, response_format_grammar, tool_call_grammar)
from mlxpipe.server.api.textgen import CONTEXT_TOKENS, TextChunk, stream_text
from mlxpipe.server.api.token_budget import token_budget
from mlxpipe.server.api.traces import new_trace
from mlxpipe.server.core.priority import effective
from mlxpipe.server.core.sequence import QueueFull
from mlxpipe.server.core.streams import GenerationFailed, RequestStream, SequenceFailed, Token
from mlxpipe.shards.models.grammar import in_worker


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # server-sent events, unbuffered


@dataclass
class OutputPlan:
    """What a request's output must follow."""

    grammar: str = ""                       # llguidance grammar ("": free text)
    bare: Optional[List[dict]] = None       # a forced call written as bare JSON: the functions (any model)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens taken from the prefix cache
    cached_disk_tokens: int = 0  # ... of which some stage read back from its disk (the rest: memory)

    def by_tier(self) -> dict:
        """Our own usage field: which tier of the prefix cache served the cached tokens."""
        return {"memory": self.cached_tokens - self.cached_disk_tokens, "disk": self.cached_disk_tokens}


@dataclass
class Event:
    """What one choice's stream adds: its text (``delta``: split into content, reasoning
    and tool calls, or all content without ``split_reply``), the tokens it came from,
    and, on the last event of the choice, why it ended ("tool_calls" once it called one)."""

    choice: int
    chunk: TextChunk
    delta: Delta
    finish_reason: Optional[str]


@dataclass
class Choice:
    """One choice, whole: its chunks as they came, its text split, why it ended."""

    chunks: List[TextChunk]
    delta: Delta
    finish_reason: str
    tokens: List[Token] = field(init=False)

    def __post_init__(self):
        self.tokens = [t for c in self.chunks for t in c.tokens]

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)


class Generation:
    """One request's ``n`` streams, their text, and their usage."""

    def __init__(self, generator: "Generator", req: GenerationRequest, prompt: List[int],
                 streams: List[RequestStream], make_reply: Optional[Callable[[bool], Reply]],
                 admission: Optional[Admission] = None):
        self.generator, self.req = generator, req
        self.admission = admission  # its place among its key's concurrent requests, its tokens counted there
        if admission is not None:  # (released when its chunks end; if they never start, when it is collected)
            weakref.finalize(self, admission.release)
        self.tokenizer = generator.tok
        self.prompt = prompt
        self.prompt_tokens = len(prompt)
        self.streams = streams
        self.completion_tokens = 0
        self._make_reply = make_reply  # (streaming) -> a Reply; None: plain text
        self.meter = generator.meter(req)
        if self.meter is not None:
            self.meter.started(self)

    @property
    def live(self) -> bool:
        """Some choice is still waiting or generating."""
        return not all(s.done for s in self.streams)

    def cancel(self) -> None:
        for s in self.streams:
            s.cancel()

    def echo(self) -> Tuple[str, List[Token]]:
        """The prompt as completions' ``echo`` returns it: its text, and its tokens with the
        log-probabilities the last stage scored when asked (the first has none; all are in
        once the first choice's first chunk has come)."""
        text = self.req.text if self.req.text is not None else self.tokenizer.decode(self.prompt)
        scored = self.streams[0].prompt
        return text, [scored[i] if i < len(scored) and scored[i] is not None else Token(t, None, None, None)
                      for i, t in enumerate(self.prompt)]

    def usage(self) -> Usage:
        s = self.streams[0]
        return Usage(self.prompt_tokens, self.completion_tokens, s.cached_tokens, s.cached_disk_tokens)

    async def chunks(self) -> AsyncIterator[tuple]:
        """(choice index, chunk) from all n streams, as they come; the streams are
        cancelled when this ends, however it ends."""
        queue: asyncio.Queue = asyncio.Queue()
        # A continued prompt's last tokens lead the detokenizer in, so the reply's first
        # space is kept (``stream_text``); a chat reply starts a text, as mlx-lm's server's.
        context = self.prompt[-CONTEXT_TOKENS:] if self.req.continues else ()

        async def pump(i: int, stream: RequestStream):
            try:
                async for c in stream_text(self.tokenizer, stream, self.req.stop, context):
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
                    if self.meter is not None:
                        self.meter.generated_tokens(len(item.tokens))
                    if self.admission is not None:
                        self.admission.tokens(len(item.tokens))
                    yield i, item
        finally:
            self.cancel()
            for t in tasks:
                t.cancel()
            if self.admission is not None:
                self.admission.release()
            if self.meter is not None:
                u = self.usage()
                self.meter.cached_prompt(u.cached_tokens - u.cached_disk_tokens, u.cached_disk_tokens)

    async def events(self) -> AsyncIterator[Event]:
        """Each choice's text as it streams. Raises ``GenerationFailed`` or
        ``SequenceFailed`` (``Generator.error`` turns them into an ApiError)."""
        replies = [self._make_reply(True) if self._make_reply else None for _ in self.streams]
        async for i, c in self.chunks():
            reply, final = replies[i], c.finish_reason is not None
            if reply is None:
                yield Event(i, c, Delta(content=c.text), c.finish_reason)
            else:
                yield Event(i, c, reply.feed(c.text, final), reply.finish_reason(c.finish_reason))

    async def collect(self) -> List[Choice]:
        """Every choice, whole."""
        out: List[List[TextChunk]] = [[] for _ in self.streams]
        async for i, c in self.chunks():
            out[i].append(c)
        choices = []
        for cs in out:
            text, finish = "".join(c.text for c in cs), cs[-1].finish_reason if cs else "stop"
            reply = self._make_reply(False) if self._make_reply else None
            if reply is None:
                choices.append(Choice(cs, Delta(content=text), finish))
            else:
                choices.append(Choice(cs, reply.feed(text, True), reply.finish_reason(finish)))
        return choices

    async def until_done(self, request) -> List[Choice]:
        """``collect()``, cancelled the moment the client goes away: ``request`` is the
        route's (Starlette) request, its body read, so its next ASGI message is the
        disconnect (as a ``StreamingResponse`` listens for it). Polling
        ``is_disconnected`` instead let a prefill run on between polls."""
        async def gone():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work, watcher = asyncio.ensure_future(self.collect()), asyncio.ensure_future(gone())
        try:
            done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()
                self.cancel()
        if work not in done:  # (nobody reads it: the request log's line says it)
            raise ApiError(499, f"the client went away before the reply was complete ({self.completion_tokens} "
                                f"tokens generated, none sent)")
        try:
            return work.result()
        except (GenerationFailed, SequenceFailed) as err:
            raise self.generator.error(self.req, err) from None


class Generator:
    """The API's one way to run a request on the engine (``head``: the started
    ``Cluster``, or anything with its ``engine``, ``tokenizer``, ``vocab_size`` and
    ``model_facts()``); ``others``: the models the head serves itself (``--also``), by name (``pick``)."""

    def __init__(self, head, options: ApiOptions, metrics=None, others: Sequence = (), quotas: Optional[Quotas] = None):
        self.head = head
        self.options = options
        self.metrics = metrics  # (metrics.Metrics: each key's own activity is counted there)
        self.quotas = quotas or Quotas()  # each key's limits and priority class (quotas.py)
        self.others: Dict[str, "Generator"] = {
            m.name: Generator(m, replace(options, model_id=m.name, aliases=()), metrics, quotas=self.quotas)
            for m in others}
        self.engine = head.engine
        self.tok = head.tokenizer
        self.vocab = head.vocab_size
        self.names = {options.model_id, "default", *options.aliases}
        self.retry_after = {"Retry-After": str(options.retry_after_s)}
        self.grammars = Grammars(head.tokenizer, self.vocab)
        self.prompts = Prompts(head.tokenizer)
        self.vision = getattr(head, "vision", None)  # a vision model's processor and tower (None: text only)
        self.image_policy = ImagePolicy.of(options)

    def model_facts(self) -> dict:
        """The model's type, layers, bytes, fingerprint and bits (for APIs that list models)."""
        return self.head.model_facts()

    def meter(self, req: GenerationRequest):
        """The ``KeyMeter`` of the request's key, if this generator counts."""
        return self.metrics.key(req.tenant.key) if self.metrics is not None else None

    def served(self) -> List[str]:
        """The names of the models served: the pipeline's, the head's others, the embedding model."""
        embedder = getattr(self.head, "embedder", None)
        return [self.options.model_id, *self.others, *([embedder.facts.name] if embedder is not None else [])]

    def pick(self, name: Optional[str]) -> "Generator":
        """The model a request names: another of the head's models by its name (Ollama's
        ``:latest`` tag or not); any other name, the pipeline's (agents name their own)."""
        name = (name or "").removesuffix(":latest")
        return self.others.get(name, self)

    def check_model(self, name: str) -> "Generator":
        """``pick``, strictly (OpenAI's chat, completions and models): a name no served model
        answers to is a 404 that lists the served ones."""
        chosen = self.pick(name)
        if chosen is self and name not in self.names:
            served = ", ".join(f"'{n}'" for n in self.served())
            raise ApiError(404, f"The model '{name}' does not exist; this server serves {served}", param="model",
                           code="model_not_found")
        return chosen

    async def start(self, req: GenerationRequest) -> Generation:
        """The request's ``n`` streams on the engine, or an ApiError (a 429 or 403 from its
        key's limits: ``quotas.py``)."""
        self.quotas.check_model(req.tenant.key, self.options.model_id)
        constrained = req.response_format is not None or req.forced_tool_call
        plan = await self.plan(req) if constrained else OutputPlan()
        if plan.bare is not None:  # a template that cannot show the model its tools: a note says the call
            req = replace(req, messages=ForcedReply.instruct(req.messages or [], plan.bare))
        prompt, images = await self.prompt_images(req)
        grammar = plan.grammar
        max_tokens = self.budget(req, len(prompt))
        media = await self.media(prompt, images) if images is not None else None  # the tower, where it must run
        admission = self.quotas.admit(req.tenant.key, len(prompt))
        try:
            streams = self._submit(req, prompt, grammar, max_tokens, media)
        except BaseException:
            admission.release()
            raise
        thinking = req.split_reply and thinks_first(self.tok, prompt) and not grammar  # a grammar leaves no room
        # (streaming) -> the Reply that splits a choice's text
        make_reply = partial(Reply, self.tok, req.tools, thinking, req.parallel_tool_calls) if req.split_reply else None
        if plan.bare is not None:
            make_reply = partial(ForcedReply, plan.bare, req.parallel_tool_calls)
        gen = Generation(self, req, prompt, streams, make_reply, admission)
        attach(gen)  # its tokens and timings go in the request's log line
        return gen

    def _submit(self, req: GenerationRequest, prompt: List[int], grammar: str, max_tokens: int,
                media=None) -> List[RequestStream]:
        """The request's ``n`` streams, submitted in its priority class (its key's, or lower if it asked)."""
        streams, salt = [], req.tenant.salt()
        priority = effective(self.quotas.priority(req.tenant.key), req.priority, req.service_tier)
        try:
            for i in range(req.n):
                # (choices share the prompt: the first alone scores it, when asked)
                sampling = replace(req.sampling, grammar=grammar, prompt_logprobs=req.sampling.prompt_logprobs and not i)
                if sampling.seed is not None:
                    sampling = replace(sampling, seed=sampling.seed + i)
                streams.append(self.engine.submit(prompt, max_tokens, sampling, speculation=req.speculation,
                                                  max_drafts=req.max_drafts, cache_salt=salt, media=media,
                                                  trace=new_trace(), priority=priority))
        except QueueFull as err:
            for s in streams:
                s.cancel()
            raise ApiError(429, f"the server is at capacity ({err}); retry shortly", type_="rate_limit_error",
                           code="server_busy", headers=self.retry_after)
        except GenerationFailed as err:
            raise self.error(req, err)
        except ValueError as err:  # what the engine refuses: sampling, speculation, more KV cache than there is
            for s in streams:
                s.cancel()
            raise ApiError(400, str(err), param=getattr(err, "param", None) or "max_tokens")
        return streams

    async def prompt(self, req: GenerationRequest) -> List[int]:
        """The prompt's token ids: messages through the chat template, text tokenized, or ids checked."""
        return (await self.prompt_images(req))[0]

    async def prompt_images(self, req: GenerationRequest) -> Tuple[List[int], Optional[object]]:
        """The prompt's token ids, and its images as the model's processor made them (None: it
        holds none); images are checked and decoded first, and refused where the model takes none."""
        if req.images:
            if self.vision is None:
                first, why = req.images[0].param, getattr(self.head, "vision_note", "")
                raise ApiError(400, f"{first}: images are not supported: this model takes text only"
                               + (f" ({why})" if why else ""), param=first, code="images_not_supported")
            pictures = await load_images(req.images, self.image_policy)
            made = []
            expand = partial(_expand, self.vision, pictures, made)
            prompt = await self._encode(req.prompt_field, partial(self.prompts.render, expand=expand), req.messages,
                                        req.tools, req.template_kwargs)
            return prompt, made[0]
        if req.token_ids is not None:
            bad = [t for t in req.token_ids if not 0 <= t < self.vocab]
            if bad:
                raise ApiError(400, f"prompt token {bad[0]} is outside the vocabulary [0, {self.vocab})",
                               param=req.prompt_field)
            prompt = list(req.token_ids)
        elif req.messages is not None:
            prompt = await self._encode(req.prompt_field, self.prompts.render, req.messages, req.tools,
                                        req.template_kwargs)
        else:
            prompt = await self._encode(req.prompt_field, self.tok.encode, req.text)
        if not prompt:
            raise ApiError(400, "the prompt is empty", param=req.prompt_field)
        return prompt, None

    async def media(self, prompt: List[int], images):
        """The rows and positions of a prompt's images (``core/media.py``): the tower's work."""
        try:
            return await self.vision.media(prompt, images)
        except ValueError as err:  # what this model's images cannot do here (``shards/models/tower.py``)
            raise ApiError(400, f"the images could not be taken: {err}", param="messages", code="invalid_image")

    async def _encode(self, param: str, fn, *args) -> List[int]:
        try:
            return await asyncio.to_thread(fn, *args)
        except (TypeError, ValueError, UnicodeError, TemplateError) as err:  # what the template or tokenizer refuse
            raise ApiError(400, f"the {param} could not be rendered and tokenized: {err}", param=param)
        except RecursionError:  # tools or arguments nested deeper than the template's code can walk
            raise ApiError(400, f"the {param} could not be rendered: tools or arguments are nested too deeply",
                           param=param) from None

    async def plan(self, req: GenerationRequest) -> OutputPlan:
        """What the request's output must follow, or a 400. A forced call is written in
        the template's format where that is JSON between markers, as bare JSON for any
        other model (vLLM's way). Built, compiled and checked on the grammar thread (a
        deep stack, off the event loop)."""
        param = "tool_choice" if req.forced_tool_call else "response_format"

        def build() -> OutputPlan:
            functions = forced_functions(req.tools or [], req.tool_choice)
            if functions is None:
                return OutputPlan(self.grammars.check(response_format_grammar(req.response_format)))
            if marked_calls(self.tok):
                return OutputPlan(self.grammars.check(tool_call_grammar(self.tok, functions,
                                                                        req.parallel_tool_calls)))
            return OutputPlan(self.grammars.check(bare_call_grammar(functions, req.parallel_tool_calls)),
                              bare=functions)

        try:
            return await in_worker(build)
        except GrammarError as err:
            raise ApiError(400, f"{param} cannot be enforced: {err}", param=param)

    def budget(self, req: GenerationRequest, prompt_len: int) -> int:
        """The request's token budget (``token_budget.py``), or a 400 saying what to change."""
        return token_budget(self.options, self.engine, self.quotas.max_tokens(req.tenant.key), req, prompt_len)

    def error(self, req: GenerationRequest, err: Exception) -> ApiError:
        """A failure after the request started: the pipeline's (503, retry), or the
        request's own on a stage (its grammar, its sampling: a 400 naming what it asked;
        no other request noticed)."""
        if isinstance(err, SequenceFailed):
            return ApiError(400, f"generation failed for this request: {err}", param=req.constrained_param(),
                            code="generation_failed")
        return ApiError(503, str(err), type_="server_error", code="pipeline_unavailable", headers=self.retry_after)


def _expand(vision, pictures: list, made: list, text: str) -> str:
    """The rendered prompt with each image's marker expanded by the model's processor (the
    images as it made them go in ``made``)."""
    expanded = vision.expand(text, pictures)
    made.append(expanded)
    return expanded.text


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

"""More models the head serves itself (``serve --also MODEL``), beside the pipeline's.

Small models for an app's side tasks (titles, tags, autocomplete, summaries) that
need no pipeline: each runs in-process on one MLX thread of its own, with
continuous batching by mlx-lm's own ``BatchGenerator`` (requests join and leave
the batch between steps; mlx-lm's samplers and logits processors). The pipeline's
model keeps the nodes.

``HeadModel`` has the surface the API's ``Generator`` takes of a head (``engine``,
``tokenizer``, ``vocab_size``, ``model_facts()``), and its ``engine`` the surface
of ``core/engine.Engine`` that requests use (``submit`` returning a
``RequestStream``, ``cancel``, ``max_context``, ``kv_tokens``): every API path
reaches it through the same internal request. What it cannot do is refused with
the parameter named: a grammar (``response_format``, forced tool calls),
scoring the prompt (``echo`` with ``logprobs``), a draft model.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from mlxpipe.server.core.streams import GenerationFailed, InvalidRequest, RequestStream, Token
from mlxpipe.shards.models.store import ModelNotFound, is_repo_id, resolve_model
from mlxpipe.shards.params.quant import kv_bytes
from mlxpipe.shards.params.sampling import Sampling

logger = logging.getLogger(__name__)


class HeadModelError(ValueError):
    """An extra model that cannot be served."""


@dataclass
class _Job:
    seq_id: int
    prompt: List[int]
    max_tokens: int
    sampling: Sampling
    stop: List[List[int]]


class HeadEngine:
    """What requests see of a head model: the engine's ``submit`` surface, on the event loop;
    the model's thread runs the batch."""

    def __init__(self, owner: "HeadModel"):
        self.owner = owner
        self.streams: Dict[int, RequestStream] = {}
        self._ids = itertools.count(1)
        self.generated_tokens = 0
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    @property
    def max_context(self) -> int:
        return self.owner.context

    @property
    def kv_tokens(self) -> int:
        return self.owner.context * self.owner.max_batch

    @property
    def live(self) -> int:
        return len(self.streams)

    def context_limit(self) -> str:
        return f"the model's maximum, within the head's memory for {self.owner.max_batch} requests"

    def check_speculation(self, speculation: str) -> None:
        if speculation == "draft_model":
            raise InvalidRequest(f"the model '{self.owner.name}' runs on the head without a draft model",
                                 "speculation")

    def submit(self, prompt: Sequence[int], max_tokens: int, sampling: Sampling = Sampling(),
               stop_at_eos: bool = True, speculation: str = "auto", max_drafts: Optional[int] = None,
               cache_salt: bytes = b"", media=None, trace=None, priority: int = 0) -> RequestStream:
        """Queue a request on the model's batch (``speculation``, ``max_drafts`` and ``cache_salt``
        change nothing here: no drafts, no prefix cache shared between requests; ``trace``: its
        span has no frames, the head's thread does all of it)."""
        owner = self.owner
        if owner.closed:
            raise GenerationFailed("the server is shutting down")
        if not prompt:
            raise InvalidRequest("the prompt is empty", "prompt")
        sampling.validate(owner.vocab_size)
        self.check_speculation(speculation)
        if sampling.grammar:
            raise InvalidRequest(f"the model '{owner.name}' runs on the head and follows no grammar: drop "
                                 "response_format or the forced tool_choice, or ask the pipeline's model", None)
        if media is not None:
            raise InvalidRequest(f"the model '{owner.name}' runs on the head and takes text only", "messages")
        if sampling.prompt_logprobs:
            raise InvalidRequest(f"the model '{owner.name}' runs on the head and does not score prompts", "echo")
        if len(prompt) >= self.max_context:
            raise InvalidRequest(f"the prompt is {len(prompt)} tokens; the model '{owner.name}' holds "
                                 f"{self.max_context} tokens, prompt and reply", "prompt")
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        seq_id = next(self._ids)
        stream = RequestStream(self, seq_id)
        self.streams[seq_id] = stream
        stop = [[e] for e in sorted(owner.eos)] if stop_at_eos else []
        budget = max(1, min(max_tokens, self.max_context - len(prompt)))
        owner.commands.put(("add", _Job(seq_id, list(prompt), budget, sampling, stop)))
        return stream

    def cancel(self, seq_id: int) -> None:
        if self.streams.pop(seq_id, None) is not None:
            self.owner.commands.put(("cancel", seq_id))

    def _deliver(self, seq_id: int, token: Token) -> None:
        """On the event loop: a token from the model's thread."""
        stream = self.streams.get(seq_id)
        if stream is None:
            return
        now = time.monotonic()
        if stream.first_token_at is None:
            stream.first_token_at = now
        stream.last_token_at = now
        self.generated_tokens += 1
        stream.queue.put_nowait(token)
        if token.finish_reason is not None:
            del self.streams[seq_id]

    def _fail(self, why: str) -> None:
        """The model's thread failed: every live request ends with ``why``."""
        for stream in self.streams.values():
            stream.queue.put_nowait(GenerationFailed(why))
        self.streams.clear()


class HeadModel:
    """An extra model, loaded and run on a thread of its own; ``engine`` is what requests use.

    ``max_batch``: requests decoding together at most (more wait in mlx-lm's queue);
    ``context``: tokens one request may hold (the model's maximum at most), planned with
    the weights in the head's memory (``head_memory``)."""

    def __init__(self, path: Path, name: str, max_batch: int = 8, context: Optional[int] = None):
        from mlx_lm.utils import load as load_lm

        self.path, self.name, self.max_batch = path, name, max_batch
        self.commands: "queue.Queue" = queue.Queue()
        self.closed = False
        self.engine = HeadEngine(self)
        self._loaded = threading.Event()
        self._error: Optional[BaseException] = None
        self._load_lm = load_lm
        self._wanted_context = context
        self._thread = threading.Thread(target=self._main, name=f"head-model-{name}", daemon=True)
        self._thread.start()
        self._loaded.wait()
        if self._error is not None:
            raise HeadModelError(f"--also {name}: mlx-lm cannot load it: {self._error}") from None

    # -- what the API reads (``Generator``'s head surface) ----------------------------

    @property
    def tokenizer(self):
        return self._tokenizer

    def model_facts(self) -> dict:
        return {"model_type": self.config.get("model_type") or "", "num_layers": self.num_layers,
                "model_bytes": self.weight_bytes, "fingerprint": self.fingerprint,
                "bits": (self.config.get("quantization") or {}).get("bits"), "context_length": self.context}

    def as_dict(self) -> dict:
        """For /health: what it is and what it did."""
        return {"name": self.name, "path": str(self.path), "context_length": self.context,
                "max_batch": self.max_batch, "live_requests": self.engine.live,
                "generated_tokens": self.engine.generated_tokens}

    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one position costs across the model's layers (16-bit keys and values)."""
        c = self.config
        heads = c.get("num_key_value_heads") or c.get("num_attention_heads") or 1
        head_dim = c.get("head_dim") or (c.get("hidden_size", 0) // max(c.get("num_attention_heads") or 1, 1))
        return self.num_layers * kv_bytes(2 * heads * head_dim)

    def memory(self) -> int:
        """What it holds at most on the head: weights and the KV cache of ``max_batch`` full contexts."""
        return self.weight_bytes + self.kv_bytes_per_token() * self.context * self.max_batch

    # -- the model's thread -------------------------------------------------------

    def _main(self) -> None:
        try:
            self._load()
        except BaseException as err:  # noqa: BLE001 - said by the constructor
            self._error = err
            self._loaded.set()
            return
        self._loaded.set()
        try:
            self._serve()
        except Exception as err:  # noqa: BLE001 - every request then ends with the reason
            logger.exception("the head model %s failed", self.name)
            why = f"the model '{self.name}' failed: {err}"  # (``err`` is gone once the except block ends)
            self._post(lambda: self.engine._fail(why))
        finally:
            self.model = None

    def _load(self) -> None:
        import mlx.core as mx
        from mlx.utils import tree_flatten
        from mlx_lm.generate import BatchGenerator

        from mlxpipe.shards.models.layers import layer_list, with_sizes
        from mlxpipe.shards.models.store import fingerprint, text_config

        self.model, self._tokenizer = self._load_lm(str(self.path))
        self.config = with_sizes(text_config(json.loads((self.path / "config.json").read_text())))
        self.num_layers = len(layer_list(self.model))
        self.weight_bytes = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))
        self.fingerprint = fingerprint(self.path)
        self.vocab_size = int(self.config.get("vocab_size") or len(self._tokenizer.get_vocab()))
        self.eos = frozenset(self._tokenizer.eos_token_ids)
        most = int(self.config.get("max_position_embeddings") or 4096)
        self.context = min(most, self._wanted_context or most)
        self.batch = BatchGenerator(self.model, completion_batch_size=self.max_batch,
                                    prefill_batch_size=min(self.max_batch, 8))
        mx.eval(self.model(mx.array([[0, 0]])))  # compile the kernels now, not in the first request

    def _post(self, fn) -> None:
        loop = self.engine._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(fn)

    def _take(self, block: bool) -> bool:
        """Apply the queued commands (waiting for one when ``block``); False once closed."""
        from mlx_lm.generate import StopSequences
        from mlx_lm.sample_utils import make_logits_processors, make_sampler

        while True:
            try:
                kind, arg = self.commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "close":
                return False
            if kind == "cancel":
                uid = self._uids.pop(arg, None)
                if uid is not None:
                    self.batch.remove([uid])
                    self._seqs.pop(uid, None)
                continue
            s = arg.sampling
            sampler = make_sampler(s.temperature, top_p=s.top_p if s.top_p < 1 else 0.0, min_p=s.min_p,
                                   top_k=s.top_k)
            processors = make_logits_processors(dict(s.logit_bias) or None, s.repetition_penalty or None,
                                                s.repetition_context_size, s.presence_penalty or None,
                                                s.penalty_context_size, s.frequency_penalty or None,
                                                s.penalty_context_size)
            (uid,) = self.batch.insert([arg.prompt], [arg.max_tokens], samplers=[sampler],
                                       logits_processors=[processors], stop_sequences=[StopSequences(arg.stop or None)])
            self._uids[arg.seq_id] = uid
            self._seqs[uid] = arg

    def _serve(self) -> None:
        self._uids: Dict[int, int] = {}   # seq_id -> the batch's uid
        self._seqs: Dict[int, _Job] = {}  # uid -> its job
        while self._take(block=not self._seqs):
            if not self._seqs:
                continue
            for r in self.batch.next_generated():
                job = self._seqs.get(r.uid)
                if job is None:
                    continue
                s = job.sampling
                logprob = float(r.logprobs[r.token]) if s.logprobs else 0.0
                top = None
                if s.logprobs and s.top_logprobs:
                    import mlx.core as mx

                    ids = mx.argsort(-r.logprobs)[: s.top_logprobs].tolist()
                    top = (ids, [float(r.logprobs[i]) for i in ids])
                if r.finish_reason is not None:
                    del self._seqs[r.uid]
                    self._uids.pop(job.seq_id, None)
                token = Token(int(r.token), logprob, top, r.finish_reason)
                self._post(lambda seq_id=job.seq_id, token=token: self.engine._deliver(seq_id, token))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.commands.put(("close", None))
            self._thread.join(timeout=30)


def load_head_models(names: Sequence[str], context: Optional[int] = None, max_batch: int = 4,
                     taken: Sequence[str] = ()) -> List[HeadModel]:
    """``--also``: each a folder, a Hugging Face repo id or "default"; listed under its folder's
    name (a repo id as given; the same name twice gets a suffix). ``context``: tokens a request
    may hold at most (the model's own maximum if less); ``max_batch``: requests decoding at once;
    ``taken``: names served already (the pipeline's model: the same model again is ``NAME-head``)."""
    out: List[HeadModel] = []
    try:
        for name in names:
            try:
                path = resolve_model(name)
            except ModelNotFound as err:
                raise HeadModelError(f"--also: {err}") from None
            served = name if is_repo_id(name) and not Path(name).expanduser().exists() else path.name
            if served in taken:
                served = f"{served}-head"
            if any(m.name == served for m in out):
                served = f"{served}-{len(out) + 1}"
            out.append(HeadModel(path, served, max_batch, context))
    except BaseException:
        for m in out:
            m.close()
        raise
    return out


def check_head_memory(models: Sequence[Tuple[str, int]], pipeline_bytes: int = 0) -> None:
    """Refuse to start when what the head runs itself (``(what, bytes)``) does not fit in this
    machine's memory (``pipeline_bytes``: the pipeline's weights, when its stages share it)."""
    from mlxpipe.shards.models.profile import offered_memory

    need, offered = sum(b for _, b in models), offered_memory()
    if models and need + pipeline_bytes > offered:
        raise HeadModelError(f"the head's own models need {need / 1e9:.2f} GB ({head_memory_lines(models)[0]}) "
                             f"beside {pipeline_bytes / 1e9:.2f} GB of the pipeline's; this machine offers "
                             f"{offered / 1e9:.2f} GB: drop an --also model or lower --also-batch")


def head_memory_lines(models: Sequence[Tuple[str, int]]) -> List[str]:
    """The head's own memory, for serve's banner and the plan: what it runs and what each may hold."""
    if not models:
        return []
    return [f"head:      {sum(b for _, b in models) / 1e6:.0f} MB for the models it runs itself: "
            + "; ".join(f"{what} {b / 1e6:.0f} MB" for what, b in models)]

"""Grammar-constrained sampling on the last stage, with llguidance.

The head turns a request's ``response_format`` or forced ``tool_choice`` into an
llguidance grammar (a string: ``server/structured.py``), validates it, and sends
it with the sequence's sampling parameters (``SamplingParams.grammar``). The
last stage keeps one ``Constraint`` per such sequence: before each draw it sets
the logits of tokens the grammar forbids to -inf, after it advances the grammar
past the chosen token, and once the grammar is complete the token is the
sequence's last (``TokenResult.done``). llguidance needs the model's tokenizer:
the head sends it with the last stage's ``Load`` (``TokenizerSpec``).

Why llguidance: of the three libraries that fit (llguidance, outlines-core,
xgrammar), it computes a token mask for a JSON schema in ~0.3 ms per token
with no per-schema compile step worth caching, takes JSON schemas and Lark
(so a forced tool call is a schema inside the template's markers), and its
matcher is a plain per-sequence object with ``consume_token``: it plugs in
after mlx-lm's logits processors with no framework around it.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, Optional, Sequence, Tuple, TypeVar

import llguidance as llg
import mlx.core as mx
import numpy as np

T = TypeVar("T")
# llguidance compiles schemas recursively: a deep one needs a deep stack. Its
# work runs on a thread of its own with this much (reserved, not committed), so
# no schema the head's limits let through (``server/schema_limits.py``) comes
# near it; the 8 MiB of an ordinary thread overflowed at a 3,000-link $ref chain.
GRAMMAR_STACK_BYTES = 256 << 20


class GrammarError(ValueError):
    """A grammar that cannot be enforced (syntax, an unsupported schema keyword)."""


def tokenizer_from_json(tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> llg.LLTokenizer:
    """llguidance's tokenizer for a Hugging Face ``tokenizer.json`` whose model has
    ``vocab_size`` logits (ids past the tokenizer's own are never allowed). About
    0.3 s for a 49k vocabulary: build it once."""
    return llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))


def validate(grammar: str, tokenizer: Optional[llg.LLTokenizer] = None) -> None:
    """Raise GrammarError when ``grammar`` cannot be compiled (call on ``worker()``)."""
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise GrammarError(brief(messages[0]) if messages else "invalid grammar")


def brief(message: Optional[str]) -> str:
    """llguidance's error without the parser state and grammar it appends (which can
    hold the whole schema: tens of kilobytes)."""
    head = (message or "").split("<state>")[0].strip()
    return head.splitlines()[0][:500] if head else ""


def agree(matcher: llg.LLMatcher, tokenizer: llg.LLTokenizer, keep: np.ndarray) -> None:
    """Make a mask (``keep``, changed in place) offer only tokens ``consume_token``
    takes. Where a grammar forces text that spells a special token (a string holding
    "<|im_end|>"), llguidance's mask offers the special token itself, which the
    matcher then refuses: drop it, and offer the text's ordinary spelling instead."""
    special = special_ids(tokenizer)
    offered = special[keep[special]]
    refused = [int(t) for t in offered if matcher.validate_tokens([int(t)]) != 1]
    if not refused:
        return
    keep[refused] = False
    forced = bytes(matcher.compute_ff_bytes()).decode("utf-8", "ignore")
    first = tokenizer.greedy_tokenize(forced)[:1] if forced else []
    if first and matcher.validate_tokens(first) == 1:
        keep[first[0]] = True


def check_output(grammar: str, tokenizer: llg.LLTokenizer) -> None:
    """Raise GrammarError unless ``grammar`` compiles and admits some output: a first
    token other than the end of the sequence (a schema whose only definition is a
    ``$ref`` to itself admits none, and would "succeed" with an empty reply). Call
    on ``worker()``."""
    validate(grammar, tokenizer)
    matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
    bits = np.zeros((tokenizer.vocab_size + 31) // 32, dtype=np.int32)
    if not matcher.is_error() and not matcher.is_stopped():
        matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
    keep = np.unpackbits(bits.view(np.uint8), bitorder="little", count=tokenizer.vocab_size).view(np.bool_)
    if not matcher.is_error():
        agree(matcher, tokenizer, keep)
    keep[[t for t in tokenizer.eos_tokens if t < keep.shape[0]]] = False
    if matcher.is_error() or not keep.any():
        raise GrammarError("it admits no output at all (e.g. a schema that only refers to itself, or "
                           "contradicts itself)")


@functools.lru_cache(maxsize=None)
def worker() -> ThreadPoolExecutor:
    """The one thread that does llguidance's work in this process (compiling, masks
    computed ahead while the model runs: llguidance releases the GIL), with a
    stack of GRAMMAR_STACK_BYTES."""
    old = threading.stack_size(GRAMMAR_STACK_BYTES)
    try:
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        pool.submit(lambda: None).result()  # its thread starts now, with that stack
    finally:
        threading.stack_size(old)
    return pool


async def in_worker(fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` on the grammar thread, awaited (never on an event loop's thread)."""
    import asyncio

    return await asyncio.wrap_future(worker().submit(fn, *args))


_SPECIAL: Dict[int, Tuple[llg.LLTokenizer, np.ndarray]] = {}


def special_ids(tokenizer: llg.LLTokenizer) -> np.ndarray:
    """The ids of ``tokenizer``'s special tokens (computed once per tokenizer)."""
    held = _SPECIAL.get(id(tokenizer))
    if held is None or held[0] is not tokenizer:
        ids = np.array([t for t in range(tokenizer.vocab_size) if tokenizer.is_special_token(t)], dtype=np.int64)
        held = _SPECIAL[id(tokenizer)] = (tokenizer, ids)
    return held[1]


class Constraint:
    """One sequence's grammar state: ``mask`` before each draw, ``accept`` after it.

    Compiling the grammar (and advancing it past a replayed sequence's tokens)
    and every next mask happen on ``worker()``, as soon as what they depend on is
    known, while this stage and the others run their layers; ``mask`` then mostly
    waits for nothing. Only that thread touches the matcher until ``mask`` has
    the result, and it makes no MLX arrays. A grammar that fails (it does not
    compile, it grows too complex, it allows no token) raises ``GrammarError``
    from ``mask`` or ``accept``: the stage ends this sequence alone.
    """

    def __init__(self, grammar: str, tokenizer: llg.LLTokenizer, vocab_size: int, replayed: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.matcher: Optional[llg.LLMatcher] = None
        self.vocab_size = vocab_size
        self._bits = np.zeros((tokenizer.vocab_size + 31) // 32, dtype=np.int32)
        self._words = tokenizer.vocab_size
        self.finished = False  # the grammar is complete: nothing but the end of the sequence may follow
        self._next: Optional[Future] = worker().submit(self._start, grammar, list(replayed))

    def _start(self, grammar: str, replayed: Sequence[int]) -> Optional[np.ndarray]:
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(brief(matcher.get_error()))
        self.matcher = matcher
        self._consume(replayed)
        return None if self.finished else self._allowed()

    def _consume(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            if not self.matcher.consume_token(int(t)):
                raise GrammarError(brief(self.matcher.get_error()) or f"the grammar does not allow token {t}")
        self.finished = self.matcher.is_stopped()

    def _allowed(self) -> np.ndarray:
        """Bool [vocab_size]: the tokens the grammar allows next."""
        m = self.matcher
        m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if m.is_error():  # e.g. llguidance's ParserTooComplex
            raise GrammarError(brief(m.get_error()))
        keep = np.unpackbits(self._bits.view(np.uint8), bitorder="little", count=self._words).view(np.bool_)
        agree(self.matcher, self.tokenizer, keep)
        if not keep.any():
            raise GrammarError(brief(m.get_error()) or "the grammar allows no next token")
        if keep.shape[0] != self.vocab_size:  # logits wider than the tokenizer: extra ids never allowed
            keep = np.pad(keep, (0, max(self.vocab_size - keep.shape[0], 0)))[: self.vocab_size]
        return keep

    def _settle(self) -> Optional[np.ndarray]:
        """The mask computed ahead, once ready (None if none was); raises what its work raised."""
        ahead, self._next = self._next, None
        return ahead.result() if ahead is not None else None

    def mask(self, logits: mx.array) -> mx.array:
        """Logits [1, V] with every token the grammar forbids next at -inf."""
        keep = self._settle()
        if keep is None:
            keep = worker().submit(self._allowed).result()
        return mx.where(mx.array(keep), logits, mx.array(-mx.inf, dtype=logits.dtype))

    def accept(self, tokens: Sequence[int]) -> None:
        """Advance past chosen tokens; the next mask starts computing."""
        self._settle()
        self._consume(tokens)
        if not self.finished:
            self._next = worker().submit(self._allowed)

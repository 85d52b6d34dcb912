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

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Sequence

import llguidance as llg
import mlx.core as mx
import numpy as np


class GrammarError(ValueError):
    """A grammar that cannot be enforced (syntax, an unsupported schema keyword)."""


def tokenizer_from_json(tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> llg.LLTokenizer:
    """llguidance's tokenizer for a Hugging Face ``tokenizer.json`` whose model has
    ``vocab_size`` logits (ids past the tokenizer's own are never allowed). About
    0.3 s for a 49k vocabulary: build it once."""
    return llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))


def validate(grammar: str, tokenizer: Optional[llg.LLTokenizer] = None) -> None:
    """Raise GrammarError when ``grammar`` cannot be compiled."""
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise GrammarError(messages[0] if messages else "invalid grammar")


# Next masks are computed here, while the model runs (llguidance releases the GIL).
_AHEAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")


class Constraint:
    """One sequence's grammar state: ``mask`` before each draw, ``accept`` after it.

    The mask depends only on the tokens accepted so far, so it is computed on a
    worker thread as soon as they are known (at creation, after each accept),
    while this stage and the others run their layers; ``mask`` then mostly
    waits for nothing. Only that thread touches the matcher until ``mask`` has
    the result, and it makes no MLX arrays.
    """

    def __init__(self, grammar: str, tokenizer: llg.LLTokenizer, vocab_size: int):
        self.matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        self.vocab_size = vocab_size
        self._bits = np.zeros((tokenizer.vocab_size + 31) // 32, dtype=np.int32)
        self._words = tokenizer.vocab_size
        self.finished = False  # the grammar is complete: nothing but the end of the sequence may follow
        self._next: Optional[Future] = _AHEAD.submit(self._allowed)

    def _allowed(self) -> np.ndarray:
        """Bool [vocab_size]: the tokens the grammar allows next."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        keep = np.unpackbits(self._bits.view(np.uint8), bitorder="little", count=self._words)
        if keep.shape[0] != self.vocab_size:  # logits wider than the tokenizer: extra ids never allowed
            keep = np.pad(keep, (0, max(self.vocab_size - keep.shape[0], 0)))[: self.vocab_size]
        return keep.view(np.bool_)

    def _settle(self) -> Optional[np.ndarray]:
        """The mask computed ahead, once ready (None if none was)."""
        ahead, self._next = self._next, None
        return ahead.result() if ahead is not None else None

    def mask(self, logits: mx.array) -> mx.array:
        """Logits [1, V] with every token the grammar forbids next at -inf."""
        keep = self._settle()
        if keep is None:
            keep = self._allowed()
        return mx.where(mx.array(keep), logits, mx.array(-mx.inf, dtype=logits.dtype))

    def accept(self, tokens: Sequence[int]) -> None:
        """Advance past chosen (or replayed) tokens; the next mask starts computing."""
        self._settle()
        for t in tokens:
            if not self.matcher.consume_token(int(t)):
                raise GrammarError(self.matcher.get_error() or f"the grammar does not allow token {t}")
        self.finished = self.matcher.is_stopped()
        if not self.finished:
            self._next = _AHEAD.submit(self._allowed)

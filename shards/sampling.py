"""Token choice on the last stage, built from mlx-lm's samplers and logits processors.

A sequence's ``SamplingParams`` arrive once, with its first frame; from then on
``SeqSampler`` keeps what the penalties need (the tokens seen so far) and picks
one token per ``sample`` request, in the order mlx-lm's ``generate_step`` does:
logits processors, log-softmax, filters (top-p, min-p, top-k), then a draw at
the temperature, or the argmax when the temperature is 0.

Random draws use a key derived from the sequence's seed and the token's
position, not a running generator: the same seed gives the same text, and a
sequence replayed after a failure draws the same tokens again.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from mlxpipe.proto import pipeline_pb2 as pb

MAX_TOP_LOGPROBS = 20
_GOLDEN = 0x9E3779B97F4A7C15


class SamplingError(ValueError):
    """Sampling parameters that cannot be honoured; the message says which, ``param`` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def validate(p: pb.SamplingParams, vocab_size: int) -> None:
    """Raise SamplingError for parameters no sampler can honour."""
    checks = [
        ("temperature", p.temperature >= 0, f"temperature must be >= 0, got {p.temperature}"),
        ("top_p", 0 <= p.top_p <= 1, f"top_p must be in [0, 1], got {p.top_p}"),
        ("top_k", 0 <= p.top_k < vocab_size,
         f"top_k must be in [0, {vocab_size}) (the vocabulary's size), got {p.top_k}"),
        ("min_p", 0 <= p.min_p <= 1, f"min_p must be in [0, 1], got {p.min_p}"),
        ("repetition_penalty", p.repetition_penalty >= 0,
         f"repetition_penalty must be >= 0, got {p.repetition_penalty}"),
        ("repetition_context_size", p.repetition_context_size >= 0, "repetition_context_size must be >= 0"),
        ("penalty_context_size", p.penalty_context_size >= 0, "penalty_context_size must be >= 0"),
        ("top_logprobs", 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS,
         f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {p.top_logprobs}"),
    ]
    for param, ok, message in checks:
        if not ok:
            raise SamplingError(param, message)
    for token in p.logit_bias:
        if not 0 <= token < vocab_size:
            raise SamplingError("logit_bias",
                                f"logit_bias names token {token}, outside the vocabulary [0, {vocab_size})")


class SeqSampler:
    """Picks the tokens of one sequence."""

    def __init__(self, params: pb.SamplingParams, vocab_size: int):
        validate(params, vocab_size)
        self.params = params
        rep = params.repetition_penalty if params.repetition_penalty not in (0, 1) else None
        context = params.penalty_context_size or 20
        self.processors = make_logits_processors(
            logit_bias=dict(params.logit_bias) or None,
            repetition_penalty=rep,
            repetition_context_size=params.repetition_context_size or 20,
            presence_penalty=params.presence_penalty or None,
            presence_context_size=context,
            frequency_penalty=params.frequency_penalty or None,
            frequency_context_size=context,
        )
        # How much history the penalties can look at; keep no more than that.
        self._keep = max(params.repetition_context_size or 20, context)
        self.history: List[int] = []
        self.filters = []
        if 0 < params.top_p < 1:
            self.filters.append(lambda x: apply_top_p(x, params.top_p))
        if params.min_p:
            self.filters.append(lambda x: apply_min_p(x, params.min_p))
        if params.top_k:
            self.filters.append(lambda x: apply_top_k(x, params.top_k))

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no processors: rows like this are picked together, in one argmax."""
        return self.params.temperature == 0 and not self.processors

    def observe(self, tokens: Sequence[int]) -> None:
        """Tokens that entered the model for this sequence (prompt and fed-back tokens)."""
        if self.processors:
            self.history.extend(tokens)
            del self.history[: -self._keep]

    def process(self, logits: mx.array) -> mx.array:
        """Logits [1, V] -> log-probabilities [1, V] after the logits processors."""
        if self.processors:
            tokens = mx.array(self.history, dtype=mx.int32)
            for proc in self.processors:
                logits = proc(tokens, logits)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def draw(self, logprobs: mx.array, position: int) -> mx.array:
        """One token id from log-probabilities [1, V]."""
        p = self.params
        if p.temperature == 0:
            return mx.argmax(logprobs, axis=-1)
        x = logprobs
        for f in self.filters:
            x = f(x)
        seed = (p.seed + (position + 1) * _GOLDEN) % (1 << 64)
        return mx.random.categorical(x * (1.0 / p.temperature), key=mx.random.key(seed))


def pick_batch(
    samplers: List[SeqSampler],
    logits: mx.array,
    positions: List[int],
) -> List[Tuple[int, float, Optional[Tuple[List[int], List[float]]]]]:
    """Pick one token per row of ``logits`` [B, V].

    Returns, per row, (token, log-probability, (top ids, top log-probabilities)
    or None). Plain greedy rows share one argmax; the others go one by one.
    """
    logprobs = [None] * len(samplers)
    chosen = [None] * len(samplers)
    plain = [i for i, s in enumerate(samplers) if s.plain_greedy]
    if plain:
        rows = logits[mx.array(plain)] if len(plain) < len(samplers) else logits
        lp = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
        picks = mx.argmax(lp, axis=-1)
        for k, i in enumerate(plain):
            logprobs[i] = lp[k : k + 1]
            chosen[i] = picks[k : k + 1]
    for i, s in enumerate(samplers):
        if chosen[i] is None:
            logprobs[i] = s.process(logits[i : i + 1])
            chosen[i] = s.draw(logprobs[i], positions[i])
    tokens = mx.concatenate(chosen)
    want = [s.params.logprobs or s.params.top_logprobs > 0 for s in samplers]
    lp_chosen = None
    if any(want):
        lp_chosen = mx.concatenate(
            [logprobs[i][0, chosen[i]] for i in range(len(samplers))]
        )
    tops = {}
    for i, s in enumerate(samplers):
        k = s.params.top_logprobs
        if k:
            idx = mx.argpartition(-logprobs[i][0], kth=k - 1)[:k]
            vals = logprobs[i][0, idx]
            order = mx.argsort(-vals)
            tops[i] = (idx[order], vals[order])
    mx.eval(tokens, lp_chosen, tops)
    token_list = tokens.tolist()
    lp_list = lp_chosen.tolist() if lp_chosen is not None else [0.0] * len(samplers)
    out = []
    for i in range(len(samplers)):
        top = None
        if i in tops:
            top = (tops[i][0].tolist(), tops[i][1].tolist())
        out.append((token_list[i], lp_list[i] if want[i] else 0.0, top))
    return out

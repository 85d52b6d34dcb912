"""Token choice on the last stage, built from mlx-lm's samplers and logits processors.

The parameters are ``Sampling``'s (``sampling_params.py``: defaults, bounds,
validation and wire form). A sequence's parameters arrive once, with its first frame; from then on
``SeqSampler`` keeps what the penalties need (the tokens seen so far) and picks
one token per ``sample`` request, in the order mlx-lm's ``generate_step`` does:
logits processors, log-softmax, filters (top-p, min-p, top-k), then a draw at
the temperature, or the argmax when the temperature is 0 (below GREEDY_BELOW). A sequence with a
grammar (``grammar.py``) masks what the grammar forbids after the processors,
so that no bias or penalty revives it, and advances the grammar past each pick.

Random draws use a key derived from the sequence's seed and the token's
position, not a running generator: the same seed gives the same text, and a
sequence replayed after a failure draws the same tokens again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.shards.models.grammar import Constraint, GrammarError
from mlxpipe.shards.params.sampling import Sampling

MAX_DRAFTED = 256  # positions a sequence may have beyond its confirmed tokens (what trim may take back)
_GOLDEN = 0x9E3779B97F4A7C15


class SeqSampler:
    """Picks the tokens of one sequence (whose ``Sampling`` was validated); with a
    ``constraint``, only tokens its grammar allows."""

    def __init__(self, params: Sampling, constraint: Optional[Constraint] = None):
        # (mlx-lm's samplers pull in transformers, seconds of import: a head that only
        # checks parameters, and the CLI, never need them)
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

        self.params = params
        self.constraint = constraint
        self.seed = params.seed or 0
        self.processors = make_logits_processors(
            logit_bias=dict(params.logit_bias) or None,
            repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1 else None,
            repetition_context_size=params.repetition_context_size,
            presence_penalty=params.presence_penalty or None,
            presence_context_size=params.penalty_context_size,
            frequency_penalty=params.frequency_penalty or None,
            frequency_context_size=params.penalty_context_size,
        )
        # How much history the penalties can look at (and drafted positions that may
        # be trimmed off); keep no more than that.
        self._keep = max(params.repetition_context_size, params.penalty_context_size) + MAX_DRAFTED
        self.history: List[int] = []
        self.before: Optional[Tuple[int, mx.array]] = None  # prompt scoring: (position, log-probabilities [1, V] for it)
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
        return self.params.greedy and not self.processors and self.constraint is None

    @property
    def finished(self) -> bool:
        """Its grammar is complete: the last pick ends the sequence."""
        return self.constraint is not None and self.constraint.finished

    def observe(self, tokens: Sequence[int]) -> None:
        """Tokens that entered the model for this sequence (prompt and fed-back tokens)."""
        if self.processors:
            self.history.extend(tokens)
            del self.history[: -self._keep]

    def trim(self, n: int) -> None:
        """Forget the last ``n`` observed tokens (drafts the head rejected)."""
        if self.processors and n:
            del self.history[-n:]

    def process(self, logits: mx.array) -> mx.array:
        """Logits [1, V] -> log-probabilities [1, V] after the logits processors."""
        if self.processors:
            tokens = mx.array(self.history, dtype=mx.int32)
            for proc in self.processors:
                logits = proc(tokens, logits)
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def draw(self, logprobs: mx.array, position: int) -> mx.array:
        """One token id from log-probabilities [1, V]."""
        p = self.params
        if p.greedy:
            return mx.argmax(logprobs, axis=-1)
        x = logprobs.astype(mx.float32)  # scaled by up to 1/GREEDY_BELOW: past float16's range
        for f in self.filters:
            x = f(x)
        seed = (self.seed + (position + 1) * _GOLDEN) % (1 << 64)
        return mx.random.categorical(x * (1.0 / p.temperature), key=mx.random.key(seed))


class SequenceFailure(Exception):
    """Why one sequence's pick failed (its grammar, its own sampling parameters):
    returned in place of its pick, so that the other rows go on."""


Pick = Tuple[int, float, Optional[Tuple[List[int], List[float]]]]


def _failure(err: Exception) -> SequenceFailure:
    if isinstance(err, GrammarError):
        return SequenceFailure(f"its grammar failed: {err}")
    return SequenceFailure(f"its sampling failed: {type(err).__name__}: {err}")


def _draw_rows(samplers: List[SeqSampler], logits: mx.array, positions: List[int]):
    """Log-probabilities and a (lazy) choice per row; a row whose own processors or
    grammar raise is a failure of that row alone."""
    n = len(samplers)
    logprobs, chosen, failed = [None] * n, [None] * n, {}
    plain = [i for i, s in enumerate(samplers) if s.plain_greedy]
    if plain:  # plain greedy rows share one argmax
        rows = logits[mx.array(plain)] if len(plain) < n else logits
        lp = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
        picks = mx.argmax(lp, axis=-1)
        for k, i in enumerate(plain):
            logprobs[i], chosen[i] = lp[k : k + 1], picks[k : k + 1]
    for i, s in enumerate(samplers):
        if chosen[i] is None:
            try:
                logprobs[i] = s.process(logits[i : i + 1])
                chosen[i] = s.draw(logprobs[i], positions[i])
            except Exception as err:  # noqa: BLE001 - this sequence's own parameters or grammar
                failed[i] = _failure(err)
    return logprobs, chosen, failed


def _top(logprobs: mx.array, k: int):
    idx = mx.argpartition(-logprobs[0], kth=k - 1)[:k]
    vals = logprobs[0, idx]
    order = mx.argsort(-vals)
    return idx[order], vals[order]


def pick_batch(samplers: List[SeqSampler], logits: mx.array,
               positions: List[int]) -> List[Union[Pick, SequenceFailure]]:
    """Pick one token per row of ``logits`` [B, V].

    Returns, per row, (token, log-probability, (top ids, top log-probabilities)
    or None), or a ``SequenceFailure`` for a row whose own sampling or grammar
    failed (the others are picked all the same).
    """
    logprobs, chosen, out = _draw_rows(samplers, logits, positions)
    ok = [i for i in range(len(samplers)) if i not in out]
    if not ok:
        return [out[i] for i in range(len(samplers))]
    tokens = mx.concatenate([chosen[i] for i in ok])
    want = {i for i in ok if samplers[i].params.logprobs or samplers[i].params.top_logprobs > 0}
    lp_chosen = mx.concatenate([logprobs[i][0, chosen[i]] for i in ok]) if want else None
    tops = {i: _top(logprobs[i], samplers[i].params.top_logprobs) for i in ok if samplers[i].params.top_logprobs}
    mx.eval(tokens, lp_chosen, tops)
    token_list = tokens.tolist()
    lp_list = lp_chosen.tolist() if lp_chosen is not None else [0.0] * len(ok)
    for k, i in enumerate(ok):
        s = samplers[i]
        if s.constraint is not None:
            try:
                s.constraint.accept([token_list[k]])
            except GrammarError as err:
                out[i] = _failure(err)
                continue
        top = None
        if i in tops:  # a grammar may leave fewer than k tokens possible: report only those
            pairs = [(t, lp) for t, lp in zip(tops[i][0].tolist(), tops[i][1].tolist()) if lp > -math.inf]
            top = ([t for t, _ in pairs], [lp for _, lp in pairs])
        out[i] = (token_list[k], lp_list[k] if i in want else 0.0, top)
    return [out[i] for i in range(len(samplers))]


def pick_positions(sampler: SeqSampler, logits: mx.array, tokens: List[int], offset: int):
    """One pick after every position of one sequence (a verify frame): ``logits``
    [n, V] for input ``tokens`` at positions ``offset`` .. ``offset + n - 1``. Each
    pick is the one a plain decode step at that position would make: the same
    history for the penalties, the same random key."""
    n = len(tokens)
    if not sampler.processors:  # nothing depends on history: all rows at once
        sampler.observe(tokens)
        return pick_batch([sampler] * n, logits, [offset + i + 1 for i in range(n)])
    picks = []
    for i, t in enumerate(tokens):
        sampler.observe([t])
        picks += pick_batch([sampler], logits[i : i + 1], [offset + i + 1])
    return picks


@dataclass
class Scored:
    """Prompt positions a prefill frame scored: ``arrays`` (lazy) to evaluate, then
    ``results()``, their ``pb.PromptScores`` (none when the sequence did not ask)."""

    arrays: list = field(default_factory=list)
    results: Callable[[], list] = list


def score_prompt(sampler: SeqSampler, seq_id: int, offset: int, tokens: Sequence[int], logits: mx.array) -> Scored:
    """The log-probability of each of a prefill chunk's ``tokens`` (positions ``offset`` ..
    ``offset + n - 1``) given the tokens before it, when its sequence asked
    (``Sampling.prompt_logprobs``): position p's from the log-softmax of the logits
    [n, V] at p - 1, in float32, as mlx-lm's ``logits - logsumexp(logits)``; the
    chunk's first token from the last row of the chunk before, which the sampler
    keeps. No logits processor or grammar takes part: these are the model's own.
    Position 0, and a chunk's first position when the chunk before was not scored
    here (never, while the head gives such sequences no cached blocks), get none."""
    p = sampler.params
    if not p.prompt_logprobs:
        return Scored()
    rows = logits.astype(mx.float32)
    lp = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    n = lp.shape[0]
    before = sampler.before[1] if sampler.before is not None and sampler.before[0] == offset else None
    sampler.before = (offset + n, mx.take(lp, mx.array([n - 1]), axis=0))  # a copy: the chunk's rows can go
    if before is not None:
        scoring, start, ids = mx.concatenate([before, lp[:-1]]), offset, list(tokens)
    else:
        scoring, start, ids = lp[:-1], offset + 1, list(tokens[1:])
    if not ids:
        return Scored()
    chosen = mx.take_along_axis(scoring, mx.array(ids, dtype=mx.int32)[:, None], axis=-1)[:, 0]
    arrays = [chosen]
    if p.top_logprobs:
        part = mx.argpartition(-scoring, kth=p.top_logprobs - 1, axis=-1)[:, : p.top_logprobs]
        vals = mx.take_along_axis(scoring, part, axis=-1)
        order = mx.argsort(-vals, axis=-1)
        arrays += [mx.take_along_axis(part, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)]

    def results() -> list:
        out = pb.PromptScores(seq_id=seq_id, start=start, logprobs=chosen.tolist())
        if p.top_logprobs:
            out.top_ids.extend(arrays[1].reshape(-1).tolist())
            out.top_logprobs.extend(arrays[2].reshape(-1).tolist())
        return [out]
    return Scored(arrays, results)


def token_result(seq_id: int, pick, done: bool = False) -> pb.TokenResult:
    """A pick (token, log-probability, top alternatives) as the wire's ``TokenResult``."""
    token, logprob, top = pick
    r = pb.TokenResult(seq_id=seq_id, token=token, logprob=logprob, done=done)
    if top is not None:
        r.top_ids.extend(top[0])
        r.top_logprobs.extend(top[1])
    return r

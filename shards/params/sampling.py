"""Sampling parameters: ``Sampling``, the one home of every parameter's default,
bounds and validation, and ``SamplingError``.

The HTTP API, the head and the last stage all use it; it imports nothing but the
standard library (its wire form is ``wire.py``'s), so that the API's schemas and the
head's pure modules stay pure. The sampler that honours these parameters is
``worker/sampler.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Dict, Mapping, Optional

MAX_TOP_LOGPROBS = 20
# Temperatures below this draw the argmax. At T = 1e-5 a log-probability gap of
# 2e-4 is already 20 nats after scaling, more than the spread of the Gumbel noise
# a draw adds, so lower temperatures pick the same token bar near-exact ties; and
# 1/T must stay finite in the logits' dtype (float16 overflows from T < 1.5e-5,
# float32 from T < 3e-39). vLLM uses the same floor (_SAMPLING_EPS = 1e-5).
GREEDY_BELOW = 1e-5
INT32 = 1 << 31  # token ids and top_k travel as int32


class SamplingError(ValueError):
    """Sampling parameters that cannot be honoured; the message says which, ``param`` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Bound:
    """The values a parameter may take: ``lo`` <= (or <, when ``lo_open``) x <= ``hi``."""

    lo: float
    hi: float
    lo_open: bool = False

    def holds(self, x: float) -> bool:
        return (x > self.lo if self.lo_open else x >= self.lo) and x <= self.hi

    def describe(self) -> str:
        return f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"


@dataclass(frozen=True)
class Sampling:
    """How one sequence's tokens are chosen: the one home of every sampling
    parameter's default, bounds and validation (its wire form: ``wire.py``).

    Defaults are "off", as in mlx-lm's samplers (temperature 0 is greedy); the
    HTTP API fills in its own default temperature (OpenAI's 1.0). The API
    takes bounds from ``BOUNDS`` for its schema; the last stage validates what
    arrives on the wire with ``validate``.
    """

    temperature: float = 0.0
    top_p: float = 1.0                   # 1: off
    top_k: int = 0                       # 0: off
    min_p: float = 0.0                   # 0: off
    repetition_penalty: float = 1.0      # 1: off
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_context_size: int = 20       # tokens the presence/frequency penalties look back
    seed: Optional[int] = None           # None: the engine picks one (so a replay draws the same tokens)
    logprobs: bool = False               # report the chosen token's log-probability
    top_logprobs: int = 0                # alternatives to report per token
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    grammar: str = ""                    # llguidance grammar the output follows ("": none; see grammar.py)
    prompt_logprobs: bool = False        # score the prompt too (``sampler.score_prompt``), with top_logprobs alternatives

    # OpenAI's bounds where it has them; top_k's upper bound is the vocabulary (checked in validate).
    BOUNDS: ClassVar[Dict[str, Bound]] = {
        "temperature": Bound(0, 2),
        "top_p": Bound(0, 1),
        "top_k": Bound(0, INT32 - 1),
        "min_p": Bound(0, 1),
        "repetition_penalty": Bound(0, 10, lo_open=True),
        "repetition_context_size": Bound(0, INT32 - 1),
        "presence_penalty": Bound(-2, 2),
        "frequency_penalty": Bound(-2, 2),
        "penalty_context_size": Bound(0, INT32 - 1),
        "top_logprobs": Bound(0, MAX_TOP_LOGPROBS),
    }
    LOGIT_BIAS = Bound(-100, 100)

    def validate(self, vocab_size: int) -> None:
        """Raise SamplingError for the first parameter no sampler can honour."""
        for name, bound in self.BOUNDS.items():
            value = getattr(self, name)
            if not (math.isfinite(value) and bound.holds(value)):
                raise SamplingError(name, f"{name} must be in {bound.describe()}, got {value}")
        if self.top_k >= vocab_size:
            raise SamplingError("top_k", f"top_k must be in [0, {vocab_size}) (the vocabulary's size), "
                                         f"got {self.top_k}")
        for token, bias in self.logit_bias.items():
            if not 0 <= token < vocab_size:
                raise SamplingError("logit_bias", f"logit_bias names token {token}, outside the vocabulary "
                                                  f"[0, {vocab_size})")
            if not (math.isfinite(bias) and self.LOGIT_BIAS.holds(bias)):
                raise SamplingError("logit_bias", f"logit_bias values must be in {self.LOGIT_BIAS.describe()}, "
                                                  f"got {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalty_lookback(self) -> int:
        """Tokens of history the penalties look back at (0 when none is on); a context
        size of 0 means the default, 20, as it does on the wire (``wire.sampling_from_wire``)."""
        if self.repetition_penalty == 1 and not self.presence_penalty and not self.frequency_penalty:
            return 0
        return max(self.repetition_context_size or 20, self.penalty_context_size or 20)

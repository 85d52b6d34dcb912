"""Each API key's limits, from its line of the key file (``keys.KeyPolicy``): requests
and tokens (prompt and generated) per minute, concurrent requests, the longest
``max_tokens``, the models it may use, and its priority class.

A request over a rate is refused before any work with a 429 whose ``Retry-After``
says when the window will have room, and whose message names the limit (in each
API's own error shape: ``errors.py``); a ``max_tokens`` over the key's is a 400 and a
model the key may not use a 403, since no retry would help. The windows are the last
60 seconds, kept per key as (time, amount) entries; tokens count as a request's
prompt is admitted and as its reply streams, so a long reply uses the window it is
generated in.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, Optional, Tuple

from mlxpipe.server.api.errors import ApiError
from mlxpipe.server.api.keys import KeyPolicy, Keys
from mlxpipe.server.core.priority import CLASSES

WINDOW_S = 60.0


@dataclass
class _Usage:
    """One key's last minute, and its requests running now."""

    requests: Deque[float] = field(default_factory=deque)
    tokens: Deque[Tuple[float, int]] = field(default_factory=deque)
    token_sum: int = 0
    running: int = 0

    def trim(self, now: float) -> None:
        while self.requests and self.requests[0] <= now - WINDOW_S:
            self.requests.popleft()
        while self.tokens and self.tokens[0][0] <= now - WINDOW_S:
            self.token_sum -= self.tokens.popleft()[1]


class Admission:
    """A request let in: it holds one of its key's concurrent places until ``release``."""

    def __init__(self, quotas: "Quotas", identity: bytes):
        self.quotas, self.identity, self.released = quotas, identity, False

    def tokens(self, n: int) -> None:
        """``n`` more tokens of this request (prompt or generated) count in its key's window."""
        self.quotas.count_tokens(self.identity, n)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.quotas.usage(self.identity).running -= 1


class Quotas:
    """Every key's policy and usage (``keys``: the server's keys; without keys nothing is limited)."""

    def __init__(self, keys: Optional[Keys] = None, clock: Callable[[], float] = time.monotonic):
        self.policies: Dict[bytes, KeyPolicy] = {c.identity: c.policy for c in (keys.callers if keys else [])}
        self.clock = clock
        self._usage: Dict[bytes, _Usage] = {}

    def policy(self, identity: bytes) -> KeyPolicy:
        return self.policies.get(identity) or KeyPolicy()

    def usage(self, identity: bytes) -> _Usage:
        return self._usage.setdefault(identity, _Usage())

    def priority(self, identity: bytes) -> int:
        """The key's priority class (``core/priority.py``)."""
        return CLASSES[self.policy(identity).priority]

    def check_model(self, identity: bytes, model: str) -> None:
        allowed = self.policy(identity).models
        if allowed and model not in allowed:
            raise ApiError(403, f"this API key may not use the model '{model}'; it may use "
                                f"{', '.join(repr(m) for m in allowed)} (models in the key file)",
                           type_="permission_error", param="model", code="model_not_allowed")

    def max_tokens(self, identity: bytes) -> Optional[int]:
        return self.policy(identity).max_tokens

    def _refuse(self, limit: str, field_name: str, wait: float) -> ApiError:
        seconds = max(1, math.ceil(wait))
        return ApiError(429, f"this API key's limit of {limit} is reached ({field_name} in the key file); retry "
                             f"after {seconds} s", type_="rate_limit_error", code="rate_limit_exceeded",
                        param=field_name, headers={"Retry-After": str(seconds)})

    def admit(self, identity: bytes, prompt_tokens: int = 0) -> Admission:
        """Let a request in (counting it, its prompt's tokens and one concurrent place), or
        raise the 429 of the first limit it is over."""
        policy, use, now = self.policy(identity), self.usage(identity), self.clock()
        use.trim(now)
        if policy.concurrency is not None and use.running >= policy.concurrency:
            raise self._refuse(f"{policy.concurrency} concurrent requests", "concurrency", 1)
        if policy.rpm is not None and len(use.requests) >= policy.rpm:
            raise self._refuse(f"{policy.rpm} requests per minute", "rpm", use.requests[0] + WINDOW_S - now)
        if policy.tpm is not None and use.token_sum and use.token_sum + prompt_tokens > policy.tpm:
            free, wait = use.token_sum + prompt_tokens - policy.tpm, 0.0
            for t, n in use.tokens:  # until enough tokens have left the window
                free, wait = free - n, t + WINDOW_S - now
                if free <= 0:
                    break
            raise self._refuse(f"{policy.tpm} tokens per minute", "tpm", wait)
        use.requests.append(now)
        use.running += 1
        admission = Admission(self, identity)
        admission.tokens(prompt_tokens)
        return admission

    def count_tokens(self, identity: bytes, n: int) -> None:
        if n and self.policy(identity).tpm is not None:
            use, now = self.usage(identity), self.clock()
            use.tokens.append((now, n))
            use.token_sum += n

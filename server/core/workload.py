"""The workload the head measures, as the split should be balanced for it.

Every step the scheduler sends is counted (``Framer`` hands each one here): the
prompt positions computed (after whatever the prefix cache served), the prompt
positions sent, the rows of decode steps (a decode step of ``r`` rows generates
``r`` tokens, and ``r`` is the concurrency it ran at), and the positions verify
steps carried (speculation: prefill-like work, several positions of one
sequence). Figures are running sums that decay with a half-life of
``HALF_LIFE_S``, so that they follow the mix a cluster gets now; totals are kept
beside them. Pure: no I/O, no clock but the one given.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Dict, Optional

from mlxpipe.server.core.plan import Step, StepKind

HALF_LIFE_S = 600.0
FIELDS = ("prompt_computed", "prompt_sent", "decode_rows", "decode_steps", "verify_positions")


@dataclass
class WorkloadMeter:
    half_life_s: float = HALF_LIFE_S
    recent: Dict[str, float] = field(default_factory=lambda: dict.fromkeys(FIELDS, 0.0))
    total: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(FIELDS, 0))
    at: Optional[float] = None

    def _add(self, now: float, **counts: int) -> None:
        if self.at is not None and now > self.at:
            keep = math.exp(-math.log(2) * (now - self.at) / self.half_life_s)
            self.recent = {k: v * keep for k, v in self.recent.items()}
        self.at = now if self.at is None else max(self.at, now)
        for k, v in counts.items():
            self.recent[k] += v
            self.total[k] += v

    def step(self, step: Step, now: Optional[float] = None) -> None:
        """Count one step the scheduler sent."""
        now = time.monotonic() if now is None else now
        if step.kind is StepKind.PREFILL:
            computed = sum(e.num_tokens for e in step.entries)
            reused = sum(e.offset for e in step.entries if e.opening is not None)  # served by the prefix cache
            self._add(now, prompt_computed=computed, prompt_sent=computed + reused)
        elif step.kind is StepKind.DECODE:
            self._add(now, decode_rows=len(step.entries), decode_steps=1)
        elif step.kind is StepKind.VERIFY:
            self._add(now, verify_positions=sum(e.num_tokens for e in step.entries))

    def mix(self) -> Dict[str, float]:
        """The recent figures and what they make: prompt-like positions per generated token
        (``prompt_ratio``, what the planner balances for) and rows per decode step."""
        r = self.recent
        rows = r["decode_rows"]
        return {**{k: round(v, 1) for k, v in r.items()},
                "prompt_ratio": (r["prompt_computed"] + r["verify_positions"]) / rows if rows else 0.0,
                "concurrency": rows / r["decode_steps"] if r["decode_steps"] else 0.0,
                "cached_share": 1 - r["prompt_computed"] / r["prompt_sent"] if r["prompt_sent"] else 0.0}

    @property
    def enough(self) -> bool:
        """Whether the figures say anything yet (a few hundred tokens generated)."""
        return self.recent["decode_rows"] >= 256

"""Where a model can be cut: the stage boundaries its own structure allows.

A cut at ``c`` (a stage boundary between blocks ``c - 1`` and ``c``) is valid when
nothing but the hidden state crosses it: no block from ``c`` on reads what a block
before ``c`` returns besides the hidden state (Gemma 3n/4's last layers read the
keys and values of earlier ones), and no cache slot is shared by blocks on both
sides. It is learned from the lazy trace ``SlicedModel`` itself uses
(``slicing.trace_blocks``; nothing is evaluated, no weight read), so the head, the
profiler and the stages agree: a range ``[start, end)`` runs as a stage exactly
when both of its ends are valid cuts (or the model's ends). The blocks between two
consecutive valid cuts are a *unit*: what the profiler times and the planner
places whole.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from mlxpipe.shards.models.layers import layer_list
from mlxpipe.shards.models.slicing import UNSUPPORTED, Unsupported, crossing, trace_blocks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Cuts:
    """The valid cut points of a model of ``num_layers`` blocks, and why the others are not."""

    num_layers: int
    valid: Tuple[int, ...]                              # c in 1..L-1 where a stage may start
    why: Dict[int, str] = field(default_factory=dict)   # an invalid cut -> the reason (the first found)
    traced: bool = True                                 # False: the structure could not be read (all assumed valid)

    @classmethod
    def every(cls, num_layers: int, traced: bool = True) -> "Cuts":
        return cls(num_layers, tuple(range(1, num_layers)), {}, traced)

    @property
    def all_valid(self) -> bool:
        return len(self.valid) == max(self.num_layers - 1, 0)

    @property
    def points(self) -> Tuple[int, ...]:
        """0, the valid cuts, and L: where ranges may start and end."""
        return (0, *self.valid, self.num_layers)

    def units(self) -> List[Tuple[int, int]]:
        """The ranges between consecutive valid cuts: what runs, and is timed, as a whole."""
        p = self.points
        return list(zip(p, p[1:]))

    def allows(self, start: int, end: int) -> bool:
        return start in self.points and end in self.points

    def refusal(self, start: int, end: int) -> Optional[str]:
        """Why ``[start, end)`` cannot run as a stage (None: it can)."""
        for c in (start, end):
            if c not in self.points:
                return f"no stage may start or end at layer {c}: {self.why.get(c, 'not a valid cut')}"
        return None

    def nearest(self, c: int, lo: int = 0, hi: Optional[int] = None) -> Optional[int]:
        """The valid cut nearest ``c`` strictly between ``lo`` and ``hi`` (the earlier on a tie)."""
        hi = self.num_layers if hi is None else hi
        inside = [v for v in self.valid if lo < v < hi]
        return min(inside, key=lambda v: (abs(v - c), v)) if inside else None

    def check(self, ranges: Sequence[Tuple[int, int]]) -> None:
        """Raise ValueError, saying why and where one may cut, unless every range can run as a stage."""
        for s, e in ranges:
            why = self.refusal(s, e)
            if why is not None:
                raise ValueError(f"layers [{s}, {e}) cannot run as a stage: {why}. {self.describe()}")

    def describe(self) -> str:
        """One line: where this model can be cut."""
        if self.all_valid:
            return f"valid cuts: after every one of the {self.num_layers} layers"
        if not self.valid:
            return (f"valid cuts: none (the {self.num_layers} layers run as one stage: "
                    f"{self.why.get(1, 'the model cannot be cut')})")
        joined = [f"[{s}, {e})" for s, e in self.units() if e - s > 1]
        reason = self.why.get(next(c for c in range(1, self.num_layers) if c not in self.valid), "")
        return (f"valid cuts: at layers {', '.join(map(str, self.valid))} (of {self.num_layers}); layers "
                f"{', '.join(joined)} run whole ({reason})")

    def to_dict(self) -> dict:
        return {"num_layers": self.num_layers, "valid": list(self.valid), "units": [list(u) for u in self.units()],
                "traced": self.traced, "why": {str(k): v for k, v in sorted(self.why.items())}}


def from_trace(trace, num_layers: int) -> Cuts:
    why = {c: w for c in range(1, num_layers) if (w := crossing(trace, c)) is not None}
    return Cuts(num_layers, tuple(c for c in range(1, num_layers) if c not in why), why)


def of_model(model: nn.Module, model_type: str = "") -> Cuts:
    """The valid cuts of a (lazily built) mlx-lm model."""
    from mlx_lm.models.cache import KVCache

    blocks = layer_list(model)
    n = len(blocks)
    if model_type in UNSUPPORTED:
        return Cuts(n, (), dict.fromkeys(range(1, n), f"{model_type}: {UNSUPPORTED[model_type]}"))
    template = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in range(n)]
    try:
        trace = trace_blocks(model, blocks, template)
    except Unsupported as err:
        return Cuts(n, (), dict.fromkeys(range(1, n), str(err)))
    return from_trace(trace, n)


@functools.lru_cache(maxsize=16)
def _of_config_text(text: str) -> Cuts:
    from mlx_lm.utils import _get_classes

    config = json.loads(text)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))  # lazy: no array is evaluated
    try:
        return of_model(model, config.get("model_type", ""))
    finally:
        del model
        mx.clear_cache()


def of_config(config: dict, num_layers: int) -> Cuts:
    """The valid cuts of the model ``config`` describes, from its structure alone (no
    weights); every cut, marked untraced, where mlx-lm cannot build it here."""
    try:
        cuts = _of_config_text(json.dumps(config, sort_keys=True, default=str))
    except Exception as err:  # noqa: BLE001 - an architecture this mlx-lm cannot build
        logger.info("cannot read where %s can be cut (%s: %s); assuming anywhere",
                    config.get("model_type"), type(err).__name__, err)
        return Cuts.every(num_layers, traced=False)
    if cuts.num_layers != num_layers:  # a config whose blocks are counted otherwise: trust the structure less
        return Cuts.every(num_layers, traced=False)
    return cuts

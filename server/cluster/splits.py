"""Fixed layer splits: ``--split even`` and ``--split 18,12``. Ranges are half-open
``[start, end)``; the planner (``planner.py``) makes the balanced ones. Only the
model's valid cuts (``shards/models/cuts.py``) may bound a range: an even split snaps to
the nearest valid one and says so; explicit sizes that cut elsewhere are refused."""

from __future__ import annotations

import logging
from typing import List, Optional, Sequence, Tuple

from mlxpipe.shards.models.cuts import Cuts

logger = logging.getLogger(__name__)


def even_split(num_layers: int, stages: int, cuts: Optional[Cuts] = None,
               quiet: bool = False) -> List[Tuple[int, int]]:
    """Half-open layer ranges of (nearly) equal size; earlier stages get the extra
    layers, since the last one also carries the output head. With ``cuts``, each
    boundary is the valid cut nearest the even one (logged when it moves)."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot cut {num_layers} layers into {stages} stages")
    base, extra = divmod(num_layers, stages)
    bounds, start = [], 0
    for i in range(stages - 1):
        start += base + (1 if i < extra else 0)
        bounds.append(start)
    if cuts is not None and not cuts.all_valid:
        snapped = snap(bounds, cuts)
        if snapped != bounds and not quiet:
            logger.warning("--split even: layers cut at %s instead of %s, the nearest valid cuts (%s)",
                           snapped, bounds, cuts.describe())
        bounds = snapped
    edges = [0, *bounds, num_layers]
    return list(zip(edges, edges[1:]))


def snap(bounds: Sequence[int], cuts: Cuts) -> List[int]:
    """Each boundary moved to the valid cut nearest it, in order and distinct; ValueError
    when the model has fewer valid cuts than the boundaries asked for."""
    if len(cuts.valid) < len(bounds):
        why = "; ".join(f"not at layer {b}: {cuts.why[b]}" for b in bounds if b in cuts.why)
        raise ValueError(f"the model cannot be cut into {len(bounds) + 1} stages ({why}): {cuts.describe()}")
    out: List[int] = []
    for k, b in enumerate(bounds):
        left = len(bounds) - k - 1  # boundaries still to place after this one, each needing a cut of its own
        room = [v for v in cuts.valid if v > (out[-1] if out else 0)]
        room = room[:len(room) - left] if left else room
        chosen = min(room, key=lambda v: (abs(v - b), v))
        out.append(chosen)
    return out


def split_from_sizes(sizes: Sequence[int], num_layers: int) -> List[Tuple[int, int]]:
    """``--split 18,12`` -> [(0, 18), (18, 30)]."""
    if any(s <= 0 for s in sizes) or sum(sizes) != num_layers:
        raise ValueError(f"split {list(sizes)} must be positive and sum to the model's {num_layers} layers")
    ranges, start = [], 0
    for s in sizes:
        ranges.append((start, start + s))
        start += s
    return ranges


def fixed_ranges(num_layers: int, stages: int, split: str, cuts: Optional[Cuts] = None,
                 quiet: bool = False) -> List[Tuple[int, int]]:
    """``--split even`` or ``--split 18,12`` (refused, naming the valid cuts, where it cuts elsewhere)."""
    if split == "even":
        return even_split(num_layers, stages, cuts, quiet)
    try:
        sizes = [int(x) for x in split.split(",")]
    except ValueError:
        raise ValueError(f"--split takes 'auto', 'even' or layer counts such as 18,12, not {split!r}") from None
    if len(sizes) != stages:
        raise ValueError(f"--split lists {len(sizes)} stages but there are {stages}")
    ranges = split_from_sizes(sizes, num_layers)
    if cuts is not None:
        cuts.check(ranges)
    return ranges

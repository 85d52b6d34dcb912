"""Fixed layer splits: ``--split even`` and ``--split 18,12``. Ranges are half-open
``[start, end)``; the planner (``planner.py``) makes the balanced ones."""

from __future__ import annotations

from typing import List, Sequence, Tuple


def even_split(num_layers: int, stages: int) -> List[Tuple[int, int]]:
    """Half-open layer ranges of (nearly) equal size; earlier stages get the extra
    layers, since the last one also carries the output head."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot cut {num_layers} layers into {stages} stages")
    base, extra = divmod(num_layers, stages)
    ranges, start = [], 0
    for i in range(stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def split_from_sizes(sizes: Sequence[int], num_layers: int) -> List[Tuple[int, int]]:
    """``--split 18,12`` -> [(0, 18), (18, 30)]."""
    if any(s <= 0 for s in sizes) or sum(sizes) != num_layers:
        raise ValueError(f"split {list(sizes)} must be positive and sum to the model's {num_layers} layers")
    ranges, start = [], 0
    for s in sizes:
        ranges.append((start, start + s))
        start += s
    return ranges


def fixed_ranges(num_layers: int, stages: int, split: str) -> List[Tuple[int, int]]:
    """``--split even`` or ``--split 18,12``."""
    if split == "even":
        return even_split(num_layers, stages)
    try:
        sizes = [int(x) for x in split.split(",")]
    except ValueError:
        raise ValueError(f"--split takes 'auto', 'even' or layer counts such as 18,12, not {split!r}") from None
    if len(sizes) != stages:
        raise ValueError(f"--split lists {len(sizes)} stages but there are {stages}")
    return split_from_sizes(sizes, num_layers)

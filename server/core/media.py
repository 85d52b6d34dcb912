"""The images of a sequence's prompt, as the head keeps them. Pure data.

A vision-language model's prompt holds a run of placeholder tokens for each image
(``Media.at``); the head's tower (``server/cluster/vision.py``) has turned each image
into the rows that replace them (``ImageRows``, raw bytes as the wire carries them,
kept by the sequence for its life, so that a replay or a prefill that starts inside
an image after cached blocks sends them again without the tower). ``frames.py``
puts the rows of a prefill chunk's placeholder positions in its frame, and the
prompt's positions where the model has its own scheme (Qwen-VL's three axes;
``positions``, and ``shift`` past the prompt). The prefix cache keys each block
that holds part of an image by the image's content too (``marks``): the same
screenshot sent again is a hit, another image behind the same placeholder tokens
is not.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple


@dataclass(frozen=True)
class ImageRows:
    """One image's rows ``[tokens, hidden]``, as the tower made them."""

    digest: bytes   # the image's content (its decoded pixels: the same picture in any file format)
    tokens: int     # the placeholder positions it fills
    data: bytes     # the rows, little-endian, C order
    dtype: str      # their dtype's name (the wire's: float32, float16, bfloat16)
    hidden: int

    @property
    def row_bytes(self) -> int:
        return len(self.data) // self.tokens if self.tokens else 0


@dataclass
class Media:
    """A prompt's images: where their rows go, and its positions where they are not offsets."""

    at: List[int]                         # the placeholder positions of every image, ascending
    images: List[ImageRows]               # in prompt order: image i fills its ``tokens`` of ``at`` after image i-1's
    positions: Optional[List[List[int]]] = None  # [axes][len(prompt)] rotary positions (None: the offsets)
    shift: int = 0                        # a position past the prompt: its index + shift (every axis)
    _starts: List[int] = field(default_factory=list, repr=False)

    def __post_init__(self):
        if sum(im.tokens for im in self.images) != len(self.at):
            raise ValueError(f"the prompt holds {len(self.at)} image placeholders; its images fill "
                             f"{sum(im.tokens for im in self.images)}")
        self._starts = [0]
        for im in self.images:
            self._starts.append(self._starts[-1] + im.tokens)

    def rows(self, start: int, end: int) -> Tuple[List[int], bytes, str, int]:
        """The rows for positions ``[start, end)``: where they go (relative to ``start``), their
        bytes, dtype and width (no rows: empty)."""
        lo, hi = bisect.bisect_left(self.at, start), bisect.bisect_left(self.at, end)
        if lo == hi:
            return [], b"", "", 0
        parts = []
        j = lo
        while j < hi:
            i = bisect.bisect_right(self._starts, j) - 1   # the image row j belongs to
            image, first = self.images[i], j - self._starts[i]
            last = min(hi - self._starts[i], image.tokens)
            parts.append(image.data[first * image.row_bytes : last * image.row_bytes])
            j = self._starts[i] + last
        image = self.images[0]
        return [p - start for p in self.at[lo:hi]], b"".join(parts), image.dtype, image.hidden

    def positions_of(self, start: int, end: int) -> Optional[List[int]]:
        """Rotary positions of ``[start, end)``, ``[axes, end - start]`` flattened (None: offsets)."""
        if self.positions is None:
            return None
        n = len(self.positions[0])
        past = [i + self.shift for i in range(max(start, n), end)]
        return [p for axis in self.positions for p in axis[start:min(end, n)] + past]

    def marks(self, block_tokens: int) -> Dict[int, bytes]:
        """Prefix-cache block -> the content of the images whose positions it holds."""
        out: Dict[int, bytes] = {}
        for i, image in enumerate(self.images):
            blocks = {p // block_tokens for p in self.at[self._starts[i]:self._starts[i + 1]]}
            for k in sorted(blocks):
                out[k] = out.get(k, b"") + image.digest
        return out

    @property
    def nbytes(self) -> int:
        return sum(len(im.data) for im in self.images)

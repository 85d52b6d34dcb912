"""A vision-language model's image side, run by the head: the processor and the
vision tower (``shards/models/tower.py``) on one thread of their own.

Why on the head: the rows an image becomes are no larger than the pixels the
processor makes of it (Qwen2.5-VL: one row of ``hidden_size`` values for four
14x14x3x2 patches), so running the tower on the first stage's node would save no
bytes on the wire; the head holds every sequence's truth already, so a replay, or
a prefill that starts inside an image after cached prefix blocks, sends the rows
again without running the tower, and the first stage stays a plain splice of
rows into its embeddings. The tower's weights (mlx-vlm keeps them at full
precision, as ``mlx_vlm.convert`` does) count against the head's machine: with
local stages, the memory the planner leaves them (``Cluster._pipeline``).

``VisionRunner`` keeps the rows of recent images by their content (``digest``),
within ``cache_bytes``: the same screenshot in a later turn costs no tower run.
Every MLX call (loading included) runs on its one worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from mlxpipe.server.core.media import ImageRows, Media

logger = logging.getLogger(__name__)

ROWS_CACHE_BYTES = 256 << 20  # images' rows the head keeps by content, at most


@dataclass
class TowerStats:
    """What the tower cost, measured (``/health``, ``mlxpipe bench vision``)."""

    weight_bytes: int = 0      # its weights, read on the head
    peak_bytes: int = 0        # MLX's peak while it ran an image, over what was in use before
    images: int = 0            # images it turned into rows
    seconds: float = 0.0       # ... in all
    last_seconds: float = 0.0
    cache_hits: int = 0        # images whose rows were kept from before

    def to_dict(self) -> dict:
        return {"weight_bytes": self.weight_bytes, "peak_bytes": self.peak_bytes, "images": self.images,
                "seconds": round(self.seconds, 4), "last_seconds": round(self.last_seconds, 4),
                "cache_hits": self.cache_hits}


class VisionRunner:
    """The processor and tower of the model at ``path``, on one thread."""

    def __init__(self, path: Path, cache_bytes: int = ROWS_CACHE_BYTES):
        self.path = Path(path)
        self.cache_bytes = cache_bytes
        self.stats = TowerStats()
        self._rows: "OrderedDict[bytes, ImageRows]" = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()  # the rows cache (the event loop and the worker read it)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vision")
        try:
            self._pool.submit(self._load).result()
        except BaseException:
            self._pool.shutdown(wait=True)
            raise

    def _load(self) -> None:
        from mlxpipe.shards.models.tower import Processor, Tower

        self.processor = Processor(self.path)
        self.tower = Tower(self.path)
        self.stats.weight_bytes = self.tower.bytes
        self.image_token_id = self.tower.image_token_id
        self.multi_axis = self.tower.rope_index is not None
        logger.info("vision tower of %s on the head: %.1f MB", self.path.name, self.tower.bytes / 1e6)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # -- the prompt ---------------------------------------------------------------------

    def expand(self, text: str, images: Sequence):
        """``text`` with each image's marker replaced by what its processor makes of it (on the
        worker thread: the processor is not shared between threads)."""
        return self._pool.submit(self.processor.expand, text, images).result()

    async def media(self, ids: Sequence[int], expanded) -> Media:
        """The rows and positions of a prompt whose images ``expanded`` holds (``ids``: its tokens)."""
        return await asyncio.wrap_future(self._pool.submit(self._media, list(ids), expanded.images))

    def _media(self, ids: List[int], images) -> Media:
        at = [i for i, t in enumerate(ids) if t == self.image_token_id]
        rows = [self._image_rows(im) for im in images]
        positions, shift = None, 0
        got = self.tower.positions(ids, images) if self.multi_axis else None
        if got is not None:
            table, shift = got
            positions = table.tolist()
        return Media(at, rows, positions, shift)

    def _image_rows(self, image) -> ImageRows:
        with self._lock:
            kept = self._rows.get(image.digest)
            if kept is not None:
                self._rows.move_to_end(image.digest)
                self.stats.cache_hits += 1
                return kept
        import mlx.core as mx

        from mlxpipe.proto import codec

        before = mx.get_active_memory()
        mx.reset_peak_memory()
        rows, seconds = self.tower.timed_rows(image)
        self.stats.peak_bytes = max(self.stats.peak_bytes, mx.get_peak_memory() - before)
        self.stats.images += 1
        self.stats.seconds += seconds
        self.stats.last_seconds = seconds
        wire = codec.encode(rows)
        out = ImageRows(image.digest, int(rows.shape[0]), wire.data, wire.dtype, int(rows.shape[1]))
        self._keep(out)
        return out

    def _keep(self, rows: ImageRows) -> None:
        with self._lock:
            self._rows[rows.digest] = rows
            self._held += len(rows.data)
            while self._held > self.cache_bytes and len(self._rows) > 1:
                _, old = self._rows.popitem(last=False)
                self._held -= len(old.data)

    def report(self) -> Dict[str, object]:
        return {**self.stats.to_dict(), "rows_cached": len(self._rows), "rows_cached_bytes": self._held}


def load_vision(model) -> Optional[VisionRunner]:
    """The head's vision runner for ``model`` (a ``cluster.model.Model``), or None when the
    model takes no images (a text model, or mlx-vlm missing: said once in the log)."""
    if not model.vision:
        if model.tower_note:
            logger.warning("%s", model.tower_note)
        return None
    t0 = time.perf_counter()
    runner = VisionRunner(model.path)
    logger.info("vision tower ready in %.1f s", time.perf_counter() - t0)
    return runner
